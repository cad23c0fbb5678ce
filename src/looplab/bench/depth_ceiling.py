"""What skipping an exited token's later loops can buy on a serving engine, from the engine's own measured costs
(docs/vllm.md#what-any-schedule-could-reach).

The engine serves the same trace with every token at R′ loops, for R′ = 1 … R (bench.vllm_serve's `vllm_depths`
arm): t(R′), the time per output token closed loop at concurrency c, is what a decoding step of c rows that runs R′
loops costs per token. With each token's exit depth d from the model itself (its distribution over the trace), three
schedules follow, each as the time per output token against t(R) (every loop, the baseline), from the measured t
alone, with no cost model in between:

    perfect     E[t(d)]                      each token pays a step of its own depth: no schedule that batches
                                             tokens does better
    in-step     E[t(max of c depths)]        a step's loops run while one of its c tokens still loops (what the
                                             plugin's `exit_skip=kv_copy` does), at no cost beyond a step of that
                                             depth: the bound of that design
    across steps, L loops a pass
                E[⌈d / L⌉]·t(L)              continuous depth batching (vllm-rlt; Continuous Depth Batching): every
                                             pass runs L loops for every running request's token, samples the tokens
                                             that exit in it, and carries the others to the next pass; a token
                                             takes ⌈d / L⌉ passes, each a step of L loops

(A loop of c rows is taken to cost what it costs with fewer rows, as it does on this CPU at these sizes:
docs/vllm.md.) `simulate_across_steps` runs that scheduler over the trace's requests pass by pass, a slow solver the
closed form is checked against (tests/test_depth_ceiling.py), and `simulate_adaptive` a family between the two (a
pass ends once few of its tokens still loop; the rest carry over). `fit_step_cost` describes the measurements as t(R′)
= a + b·R′ (a: what a step costs beside its loops), which says why a schedule that adds steps cannot win here.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Callable, Iterable, Sequence


def fit_step_cost(seconds_per_token: dict[int, float]) -> tuple[float, float]:
    """(a, b) of t(R′) = a + b·R′ by least squares over the measured depths (at least two)."""
    if len(seconds_per_token) < 2:
        raise ValueError(f"fit_step_cost: needs at least two depths R′, got {sorted(seconds_per_token)}")
    xs, ys = zip(*sorted(seconds_per_token.items()))
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def expected_max(counts: dict[int, int], c: int, f: Callable[[int], float] = float) -> float:
    """E[f(max of c depths drawn independently from `counts`)]: with f the identity, the depth a step of c tokens
    runs to; with f = t, what such a step costs."""
    n = sum(counts.values())
    below = 0  # tokens with depth < d
    e = 0.0
    for d in sorted(counts):
        at_most = below + counts[d]
        e += f(d) * ((at_most / n) ** c - (below / n) ** c)  # P(max = d)
        below = at_most
    return e


def ceilings(seconds_per_token: dict[int, float], depth_counts: dict[int, int], concurrency: int) -> dict:
    """Each schedule's time per output token and its speed-up over every loop (t(R) / its time), R the deepest
    measured R′ (every depth 1..R measured)."""
    t = seconds_per_token
    loops = max(t)
    if sorted(t) != list(range(1, loops + 1)):
        raise ValueError(f"ceilings: needs t(R') for every R' in 1..{loops}, got {sorted(t)}")
    if not depth_counts or min(depth_counts) < 1 or max(depth_counts) > loops:
        raise ValueError(f"ceilings: exit depths must lie in 1..{loops}, got {sorted(depth_counts)}")
    n = sum(depth_counts.values())
    mean = sum(d * k for d, k in depth_counts.items()) / n
    base = t[loops]

    def entry(x):
        return {"seconds_per_token": x, "speedup": base / x}

    in_step = expected_max(depth_counts, concurrency, t.__getitem__)  # E[t(max of c depths)]
    across = {}
    for L in range(1, loops + 1):
        passes = sum(math.ceil(d / L) * k for d, k in depth_counts.items()) / n
        across[L] = {**entry(passes * t[L]), "passes_per_token": passes}
    best = max(across, key=lambda L: across[L]["speedup"])
    a, b = fit_step_cost(t)
    residual = max(abs(a + b * r - x) / x for r, x in t.items())
    return {"every_loop": entry(base), "mean_exit_depth": mean,
            "perfect": entry(sum(t[d] * k for d, k in depth_counts.items()) / n),
            "in_step": {**entry(in_step), "expected_max_depth": expected_max(depth_counts, concurrency)},
            "across_steps": across, "across_steps_best_L": best,
            "fit": {"a": a, "b": b, "fixed_share_of_a_step": a / (a + b * loops), "max_relative_residual": residual}}


def simulate_across_steps(requests: Sequence[Sequence[int]], concurrency: int, loops_per_pass: int,
                          seconds_per_token: dict[int, float]) -> float:
    """Seconds per output token of continuous depth batching over `requests` (each a list of its tokens' exit
    depths, in order), closed loop at `concurrency`: a pass costs what a step of L loops does, c·t(L) (a loop costs
    the same for fewer rows), every running token advances L loops, one that reaches its depth is sampled and its
    request's next token starts at the next pass; a finished request is replaced by the next at once."""
    queue = list(requests)
    running: list[list] = []  # [tokens left (depths), loops done on the current token]
    wall, tokens = 0.0, 0

    def admit():
        while queue and len(running) < concurrency:
            r = list(queue.pop(0))
            if r:
                running.append([r, 0])

    admit()
    while running:
        wall += concurrency * seconds_per_token[loops_per_pass]
        for slot in running:
            slot[1] += loops_per_pass
            if slot[1] >= slot[0][0]:
                slot[0].pop(0)
                slot[1] = 0
                tokens += 1
        running[:] = [s for s in running if s[0]]
        admit()
    return wall / tokens


def simulate_adaptive(depth_counts: dict[int, int], concurrency: int, seconds_per_token: dict[int, float],
                      keep_looping: float, passes: int = 20_000, seed: int = 0) -> float:
    """Seconds per output token of depth batching whose passes end adaptively: a pass runs loops for its c tokens
    (each carried over from the last pass at the loop it reached, or a fresh one) until fewer than keep_looping·c
    of them still loop, none does, or it has run R loops; then the tokens that exited are sampled and replaced. A
    token that exits early in a pass idles for the rest of it; a pass of ℓ loops costs c·t(ℓ). keep_looping = 0 is
    the in-step schedule (a pass runs until its last token exits), keep_looping > 1 one loop a pass. Depths are drawn
    independently from depth_counts (seeded)."""
    rng = random.Random(seed)
    pool = [d for d, k in sorted(depth_counts.items()) for _ in range(k)]
    loops = max(seconds_per_token)
    left = [rng.choice(pool) for _ in range(concurrency)]  # loops each token still has to run
    wall, tokens = 0.0, 0
    for _ in range(passes):
        ran = 0
        while True:
            ran += 1
            left = [max(x - 1, 0) for x in left]
            still = sum(x > 0 for x in left)
            if ran == loops or still == 0 or still < keep_looping * concurrency:
                break
        wall += concurrency * seconds_per_token[ran]
        for i, x in enumerate(left):
            if x == 0:
                tokens += 1
                left[i] = rng.choice(pool)
    return wall / tokens


def depth_counts(depths: Iterable[int]) -> dict[int, int]:
    return dict(sorted(Counter(int(d) for d in depths).items()))
