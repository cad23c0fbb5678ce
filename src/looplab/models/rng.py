"""Initial values as a function of (seed, parameter name): common random numbers across arms.

A paired comparison (StateLoop − Vanilla Looped, reset − carry, injection − none) measures the
difference between two arms best when everything the arms share is the same: the same initial
values of every shared parameter and the same batches. Drawing a model's initial values from one
global generator in module order breaks that: a branch built in between (the state branch, an
exit gate) shifts every later draw, so the two arms start from different weights and their
difference carries the full noise of initialisation.

So every parameter draws from its own generator, seeded from the model's init seed and its
state-dict name. Adding or removing a module never moves another module's values, and a
parameter of the same name and shape gets the same values in both arms (a residual writer whose
std is scaled by the depth gets the same standard draws, scaled).
"""

from __future__ import annotations

import hashlib

import torch


def named_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name), stable across processes and Python versions (no hash())."""
    digest = hashlib.blake2b(f"{int(seed)}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def named_generator(seed: int, name: str, device: torch.device | str | None = None) -> torch.Generator | None:
    """A fresh generator for the parameter (or module) `name` of a model initialised with `seed` (None for
    the meta device, whose tensors hold no values: a model built there only to count FLOPs or shapes)."""
    if torch.device(device or "cpu").type == "meta":
        return None
    g = torch.Generator(device=device or "cpu")
    g.manual_seed(named_seed(seed, name))
    return g


def draw_init_seed() -> int:
    """The model's init seed, one draw from the global CPU generator: `torch.manual_seed(s)` (or
    Lightning's seed_everything) before building a model fixes every initial value."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64, device="cpu").item())  # also under a meta default device
