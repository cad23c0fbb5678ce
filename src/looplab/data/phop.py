"""p-hop induction (docs/formulations.md#tasks).

A string of n symbols over an alphabet of size a, no two equal neighbours. One
hop from position i goes to the most recent earlier occurrence j of symbol[i]
and then one step right, to j + 1; the answer is the symbol reached after p
hops from the last position. A hop always moves left by at least one position
(j = i − 1 would be an equal neighbour), so p hops need n ≥ p + 2.

Strings are drawn uniformly among no-repeat strings and rejected until every
hop from the last position exists: at the tiny (n 32, a 4, p 3) and paper
(n 256, a 4, p 32) settings nearly every draw is accepted (measured: 100 %),
and the accepted strings are uniform over the valid ones, which a constructive
repair would not be.

Determinism and splits: example (seed, split, index) is a pure function of its
three arguments (its RNG is seeded by SeedSequence([TASK_ID, seed, split,
index])). Train and test are disjoint by construction: a string belongs to the
test split iff a keyed hash of its content falls below `test_fraction`, and each
split rejects strings of the other. The partition ignores `seed`, so no seed's
training stream ever contains another seed's test strings.

Mixed hop counts: `p` may be a list of hop counts, e.g. [1, 2, 3, 4]. Each example then draws its own hop
count uniformly from the list with its own RNG (before its string, so still a pure function of (seed, split,
index)) and records it in `PHopExample.p`; the split hash keys on the string and the whole list, so a string
is in one split whatever hop count it is drawn with. A single int is the fixed-p task, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from looplab.data.splits import MAX_ATTEMPTS, example_rng, in_test_split

TASK_ID = 1  # separates p-hop RNG streams from Mano's


@dataclass(frozen=True)
class PHopExample:
    symbols: list[int]  # n ints in [0, alphabet), no equal neighbours
    answer: int  # symbol reached after p hops from the last position
    hop_targets: list[int]  # per position t: symbol after p hops from t, or -1 if a hop is missing
    p: int


def hop_counts(p) -> tuple[int, ...] | None:
    """A list of hop counts (mixed p-hop) as a tuple; None for a single p (or anything else, left to validate_args)."""
    if isinstance(p, Sequence) and not isinstance(p, (str, bytes)):
        return tuple(p)
    return None


def _validate_hop_list(n: int, hops: tuple, alphabet: int) -> None:
    for name, v in (("n", n), ("alphabet", alphabet)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise ValueError(f"p-hop {name}={v!r} must be an integer")
    if not hops:
        raise ValueError("p-hop p=[] lists no hop count; give an int or a non-empty list such as [1, 2, 3, 4]")
    shown = list(hops)
    for h in hops:
        if not isinstance(h, (int, np.integer)) or isinstance(h, bool):
            raise ValueError(f"p-hop hop count {h!r} in p={shown} must be an integer")
        if h < 1:
            raise ValueError(f"p-hop hop count {h} in p={shown} must be >= 1 (number of hops)")
    dup = sorted({h for h in hops if list(hops).count(h) > 1})
    if dup:
        raise ValueError(f"p-hop p={shown} lists hop count {dup[0]} more than once; list each hop count once")
    validate_args(n, max(int(h) for h in hops), alphabet)  # alphabet, and n against the deepest hop count


def validate_args(n: int, p: int, alphabet: int) -> None:
    hops = hop_counts(p)
    if hops is not None:
        return _validate_hop_list(n, hops, alphabet)
    for name, v in (("n", n), ("p", p), ("alphabet", alphabet)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise ValueError(f"p-hop {name}={v!r} must be an integer")
    if p < 1:
        raise ValueError(f"p-hop p={p} must be >= 1 (number of hops)")
    if alphabet < 3:
        raise ValueError(
            f"p-hop alphabet={alphabet} must be >= 3: with no equal neighbours, two symbols leave only the "
            f"strings abab… and baba…, too few for disjoint train and test splits"
        )
    if n < p + 2:
        raise ValueError(f"p-hop n={n} is too short for p={p} hops: each hop moves left by >= 1, so n must be >= p + 2 = {p + 2}")


def hop_targets(symbols: list[int], p: int) -> list[int]:
    """Fast path, O(n·p): one left-to-right pass builds the one-hop map, then compose it p times."""
    last_seen: dict[int, int] = {}
    hop = []
    for i, c in enumerate(symbols):
        j = last_seen.get(c)
        hop.append(-1 if j is None else j + 1)
        last_seen[c] = i
    out = []
    for t in range(len(symbols)):
        i = t
        for _ in range(p):
            i = hop[i]
            if i < 0:
                break
        out.append(symbols[i] if i >= 0 else -1)
    return out


def _draw_string(rng: np.random.Generator, n: int, alphabet: int) -> list[int]:
    # uniform over no-repeat strings: first symbol uniform, each next uniform among the a − 1 others
    first = int(rng.integers(alphabet))
    steps = rng.integers(1, alphabet, size=n - 1)
    return ((first + np.concatenate(([0], np.cumsum(steps)))) % alphabet).tolist()


def make_example(seed: int, split: str, index: int, *, n: int, p: int | Sequence[int], alphabet: int,
                 test_fraction: float = 0.5) -> PHopExample:
    """Example `index` of `split`. `p`: the hop count, or a list of them (each example draws one uniformly)."""
    validate_args(n, p, alphabet)
    hops = hop_counts(p)
    if hops is not None:
        return _make_mixed(seed, split, index, n=n, hops=tuple(int(h) for h in hops), alphabet=alphabet,
                           test_fraction=test_fraction)
    rng = example_rng(TASK_ID, seed, split, index)
    for _ in range(MAX_ATTEMPTS):
        s = _draw_string(rng, n, alphabet)
        targets = hop_targets(s, p)
        if targets[-1] < 0:
            continue  # some hop from the last position does not exist
        if in_test_split(("phop", n, p, alphabet, *s), test_fraction) != (split == "test"):
            continue  # belongs to the other split
        return PHopExample(symbols=s, answer=targets[-1], hop_targets=targets, p=p)
    raise RuntimeError(
        f"p-hop n={n}, p={p}, alphabet={alphabet}: no valid {split} string in {MAX_ATTEMPTS} draws; "
        f"lower p or alphabet, or raise n"
    )


def _make_mixed(seed: int, split: str, index: int, *, n: int, hops: tuple[int, ...], alphabet: int,
                test_fraction: float) -> PHopExample:
    rng = example_rng(TASK_ID, seed, split, index)
    p = hops[int(rng.integers(len(hops)))]  # the example's own hop count, drawn before its string
    for _ in range(MAX_ATTEMPTS):
        s = _draw_string(rng, n, alphabet)
        targets = hop_targets(s, p)
        if targets[-1] < 0:
            continue
        # keyed on the string and the whole list, not on this example's p: no string is in both splits
        if in_test_split(("phop", n, hops, alphabet, *s), test_fraction) != (split == "test"):
            continue
        return PHopExample(symbols=s, answer=targets[-1], hop_targets=targets, p=p)
    raise RuntimeError(
        f"p-hop n={n}, p={p} (of {list(hops)}), alphabet={alphabet}: no valid {split} string in {MAX_ATTEMPTS} draws; "
        f"lower p or alphabet, or raise n"
    )


def solve(symbols: list[int], p: int) -> int | None:
    """Slow reference solver, written independently of the generator: searches backwards for each
    hop's source symbol by scanning the reversed prefix. Returns None if some hop does not exist."""
    i = len(symbols) - 1
    for _ in range(p):
        before = list(reversed(symbols[:i]))  # candidates j < i, most recent first
        if symbols[i] not in before:
            return None
        j = (i - 1) - before.index(symbols[i])
        i = j + 1
    return symbols[i]
