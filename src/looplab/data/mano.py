"""Mano: modular arithmetic expressions in prefix notation (after Physics of LMs 4.1; docs/formulations.md#tasks).

A random expression tree with `ops` operators from {+, −, ×}: the operators
below a node are split uniformly between its left and right subtrees, and the
ops + 1 leaves are uniform in [0, modulus). The answer is the value mod
`modulus`. Training draws the operator count uniformly from 1..L; the test
split uses exactly L (the hardest length the model is asked to handle).

Paper configs use modulus 23; at tiny CPU scale 23 did not learn in minutes
(the 3 × 23² arithmetic facts are the bottleneck), so the modulus is an
argument. Measured here (d 64, 4 heads, batch 128, 2,000 steps, AdamW 3e-3,
L 3, modulus 5, chance 0.2): answer accuracy 1⊗1 0.37 / 1⊗4 0.46 with the
answer loss only, 1⊗1 0.37 / 1⊗2 0.50 / 1⊗4 0.58 with the subtree-value loss
(`subtree_values`, used by looplab.data.tasks when task_args.subtree_loss). Determinism and the content-hash train/test partition are described
in looplab.data.splits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from looplab.data.splits import MAX_ATTEMPTS, example_rng, in_test_split

TASK_ID = 2  # separates Mano RNG streams from p-hop's
OPS = ("+", "-", "*")


@dataclass(frozen=True)
class ManoExample:
    prefix: list[str]  # operators '+', '-', '*' and decimal leaf values, prefix order
    answer: int  # value of the expression mod `modulus`
    n_ops: int  # operator count of this example (1..L in training, L in test)
    modulus: int
    # per prefix position t: value of the largest subtree with >= 1 operator that ends at t, else -1
    # (intermediate supervision, the Mano analogue of p-hop's per-position hop targets)
    subtree_values: list[int]


def validate_args(L: int, modulus: int) -> None:
    for name, v in (("L", L), ("modulus", modulus)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise ValueError(f"Mano {name}={v!r} must be an integer")
    if L < 1:
        raise ValueError(f"Mano L={L} must be >= 1 (number of operators in a test expression)")
    if L > 500:
        raise ValueError(f"Mano L={L} is too large: trees are built recursively; use L <= 500")
    if modulus < 2:
        raise ValueError(f"Mano modulus={modulus} must be >= 2")


def _grow(rng: np.random.Generator, ops: int, modulus: int, out: list[str], values: dict[int, int]) -> int:
    """Append a random tree with `ops` operators to `out` (prefix order); return its value mod m.
    values[end] = value of each operator subtree, keyed by its last position; an enclosing subtree
    ending at the same position finishes later and overwrites, so the largest one wins."""
    if ops == 0:
        v = int(rng.integers(modulus))
        out.append(str(v))
        return v
    op = OPS[int(rng.integers(len(OPS)))]
    out.append(op)
    left_ops = int(rng.integers(ops))  # uniform in 0..ops−1; the rest go right
    a = _grow(rng, left_ops, modulus, out, values)
    b = _grow(rng, ops - 1 - left_ops, modulus, out, values)
    if op == "+":
        v = (a + b) % modulus
    elif op == "-":
        v = (a - b) % modulus
    else:
        v = (a * b) % modulus
    values[len(out) - 1] = v
    return v


def make_example(seed: int, split: str, index: int, *, L: int, modulus: int = 23, test_fraction: float = 0.5) -> ManoExample:
    validate_args(L, modulus)
    rng = example_rng(TASK_ID, seed, split, index)
    for _ in range(MAX_ATTEMPTS):
        n_ops = int(rng.integers(1, L + 1)) if split == "train" else L
        prefix: list[str] = []
        values: dict[int, int] = {}
        value = _grow(rng, n_ops, modulus, prefix, values)
        if in_test_split(("mano", modulus, *prefix), test_fraction) != (split == "test"):
            continue  # belongs to the other split
        sub = [values.get(t, -1) for t in range(len(prefix))]
        return ManoExample(prefix=prefix, answer=value, n_ops=n_ops, modulus=modulus, subtree_values=sub)
    raise RuntimeError(f"Mano L={L}, modulus={modulus}: no {split} expression in {MAX_ATTEMPTS} draws; raise L or modulus")


_INFIX_OK = re.compile(r"^[0-9+\-*()]+$")


def to_infix(prefix: list[str]) -> str:
    """Fully parenthesised infix rendering, built right-to-left with a stack."""
    stack: list[str] = []
    for tok in reversed(prefix):
        if tok in OPS:
            if len(stack) < 2:
                raise ValueError(f"malformed prefix expression {prefix!r}")
            a, b = stack.pop(), stack.pop()
            stack.append(f"({a}{tok}{b})")
        else:
            stack.append(str(int(tok)))
    if len(stack) != 1:
        raise ValueError(f"malformed prefix expression {prefix!r}")
    return stack[0]


def solve(prefix: list[str], modulus: int = 23) -> int:
    """Slow reference solver, independent of the generator: evaluates the infix rendering with exact
    (unbounded) integers and reduces mod m once at the end, instead of mod m at every node."""
    expr = to_infix(prefix)
    assert _INFIX_OK.match(expr), expr  # digits, operators and parentheses only: safe to eval
    return eval(expr, {"__builtins__": {}}, {}) % modulus
