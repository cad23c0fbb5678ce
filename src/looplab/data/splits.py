"""Per-example randomness and the train/test partition shared by the synthetic tasks.

Every example is a pure function of (task, seed, split, index): its generator is
seeded from SeedSequence([task, seed, split, index]), so any example can be made
in any order, on any rank or worker, without generating the ones before it.

Disjointness does not rely on independent streams (small settings, e.g. Mano
with L = 1, would repeat expressions across streams). Instead the content of an
example decides its split: a keyed hash of the content is mapped to [0, 1) and
the example is a test example iff that value is below `test_fraction`. Each
split's generator rejects draws that belong to the other split, so no string
can ever be in both. The hash ignores the seed, so the partition is the same
for every seed.
"""

from __future__ import annotations

import hashlib

import numpy as np

SPLITS = {"train": 0, "test": 1}
MAX_ATTEMPTS = 10_000  # rejection cap; reaching it means the settings leave (almost) no valid example
_HASH_KEY = b"looplab-split-v1"


def example_rng(task_id: int, seed: int, split: str, index: int) -> np.random.Generator:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is unknown; choose one of {tuple(SPLITS)}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative integer")
    if not isinstance(index, (int, np.integer)) or index < 0:
        raise ValueError(f"index={index!r} must be a non-negative integer")
    return np.random.default_rng(np.random.SeedSequence([task_id, int(seed), SPLITS[split], int(index)]))


def in_test_split(content: tuple, test_fraction: float) -> bool:
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction!r} must lie strictly between 0 and 1")
    digest = hashlib.blake2b(repr(content).encode(), digest_size=8, key=_HASH_KEY).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < test_fraction
