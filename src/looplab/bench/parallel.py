"""Parallel loops against sequential loops and the unlooped block (`make bench`'s `parallel` part;
docs/performance.md#parallel-loops).

Greedy decoding of 48 tokens after a 32-token prompt (quick: 16 tokens), fp32, at batch 1 and batch 8, every
model timed round-robin in one process (`common.time_round_robin`; a ratio is the median of per-round paired
ratios of whole `generate` calls, prefill included):

    1x1             the block run once (the cost a parallel model aims at)
    seq_1x4         the sequential 1⊗4 model: four block calls per token
    par_1x4_<kv>    the parallel 1⊗4 model (models/parallel.py), kv own | share_first | gswa (w = 16): one
                    folded block call on 4 rows per token

Random-init llama at d 128 (4 heads, 1 layer, vocab 4096, lm_tiny's tokenizer size); the parallel and sequential
models share the block's initial values (common random numbers), the timing does not depend on them. KV bytes:
each model's cache after prompt + generated tokens (`LoopCache.nbytes`). Before timing, each parallel model's
decoded logits are checked against its teacher-forced CLP forward (max|Δ| / RMS ≤ 1e-4).

    python -m looplab.bench.parallel [--quick] [--threads N] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch

from looplab.bench.common import device_of, machine_info, set_threads, time_round_robin
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.generation import generate

DIMS = dict(d_model=128, n_heads=4, n_layers=1, vocab_size=4096, max_seq_len=256)
PROMPT, NEW, NEW_QUICK = 32, 48, 16
WINDOW = 16
KVS = ("own", "share_first", "gswa")
DECODE_THREADS = 1  # the setting (batch-1 decoding of a d 128 model gains nothing from a second thread)
CLOCK = "cpu"
TARGETS = {"gswa_vs_1x1_batch1": 0.8, "gswa_vs_seq_batch1": 2.0}  # docs/performance.md#parallel-loops


def models(seed: int = 0) -> dict[str, LoopedLM]:
    def build(**kw):
        torch.manual_seed(seed)
        return LoopedLM(LoopedLMConfig(**DIMS, **kw)).eval()

    out = {"1x1": build(n_loops=1), "seq_1x4": build(n_loops=4)}
    for kv in KVS:
        out[f"par_1x4_{kv}"] = build(n_loops=4, loop_schedule="parallel", loop_kv=kv, loop_window=WINDOW)
    return out


@torch.no_grad()
def check_exact(model, ids: torch.Tensor, new: int) -> float:
    """Decoded logits against the CLP forward over prompt + generated tokens: max|Δ| / RMS(logits)."""
    out = generate(model, ids, new, return_logits=True)
    ref = model(out.sequences).logits[:, ids.shape[1] - 1:-1]
    return float((out.logits - ref).abs().max() / ref.pow(2).mean().sqrt())


@torch.no_grad()
def kv_bytes(model, batch: int, length: int) -> int:
    cache = model.allocate_cache(batch, length)
    model(torch.randint(0, DIMS["vocab_size"], (batch, length)), cache=cache)
    return cache.nbytes()


@torch.no_grad()
def measure(arms: dict[str, LoopedLM], batch: int, new: int, repeats: int, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed + batch)
    ids = torch.randint(0, DIMS["vocab_size"], (batch, PROMPT), generator=g)
    calls = {name: (lambda m=m: generate(m, ids, new)) for name, m in arms.items()}
    t = time_round_robin(calls, repeats, warmup=1, reference="1x1", device=device_of(arms["1x1"]))
    n = batch * new
    cells = {}
    for name in arms:
        # the 1⊗1 model's time / this one's: tokens/s relative to 1⊗1, per round, on the thread's CPU clock (one
        # thread: the steadier figure on this shared VM; the wall clock's ratios are kept beside it)
        vs_1x1 = t.ratio("1x1", name, clock=CLOCK)
        vs_seq = t.ratio("seq_1x4", name, clock=CLOCK)
        cells[name] = {"tokens_per_s": round(n / statistics.median(t.wall[name]), 1),
                       "vs_1x1": round(vs_1x1.median, 3), "vs_1x1_range": [round(vs_1x1.low, 3), round(vs_1x1.high, 3)],
                       "vs_seq_1x4": round(vs_seq.median, 3),
                       "vs_seq_1x4_range": [round(vs_seq.low, 3), round(vs_seq.high, 3)],
                       "vs_1x1_wall": round(t.ratio("1x1", name).median, 3),
                       "vs_seq_1x4_wall": round(t.ratio("seq_1x4", name).median, 3),
                       "kv_bytes": kv_bytes(arms[name], batch, PROMPT + new)}
    return cells


def run(threads: int, quick: bool) -> dict[str, Any]:
    set_threads(DECODE_THREADS)  # whatever the other parts use: decoding is measured at one thread
    arms = models()
    new = NEW_QUICK if quick else NEW
    repeats = 3 if quick else 21
    ids = torch.randint(0, DIMS["vocab_size"], (2, PROMPT), generator=torch.Generator().manual_seed(7))
    exact = {name: check_exact(m, ids, new) for name, m in arms.items() if name.startswith("par_")}
    bad = {k: v for k, v in exact.items() if not v <= 1e-4}
    if bad:
        raise AssertionError(f"parallel decoding differs from the CLP forward: {bad}")
    batches = {f"batch{b}": measure(arms, b, new, repeats) for b in (1, 8)}
    g1 = batches["batch1"]["par_1x4_gswa"]
    res: dict[str, Any] = {
        "dims": DIMS, "prompt": PROMPT, "new_tokens": new, "window": WINDOW, "repeats": repeats,
        "decode_threads": DECODE_THREADS, "clock": CLOCK,
        "decode_vs_clp_forward": {k: float(f"{v:.3g}") for k, v in exact.items()},
        **batches,
        "gswa_vs_1x1_batch1": g1["vs_1x1"], "gswa_vs_seq_batch1": g1["vs_seq_1x4"],
        "gswa_vs_1x1_batch8": batches["batch8"]["par_1x4_gswa"]["vs_1x1"],
        "gswa_vs_seq_batch8": batches["batch8"]["par_1x4_gswa"]["vs_seq_1x4"],
        "seq_vs_1x1_batch1": batches["batch1"]["seq_1x4"]["vs_1x1"],
        "gswa_kv_ratio_vs_1x1": round(g1["kv_bytes"] / batches["batch1"]["1x1"]["kv_bytes"], 3),
        "targets": TARGETS,
    }
    res["targets_met"] = {k: res[k] >= v for k, v in TARGETS.items()}
    return res


def main(argv=None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m looplab.bench.parallel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the JSON here (default: print it)")
    args = ap.parse_args(argv)
    res = {"machine": machine_info(args.threads), **run(args.threads, args.quick)}
    text = json.dumps(res, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return res


if __name__ == "__main__":
    main()
