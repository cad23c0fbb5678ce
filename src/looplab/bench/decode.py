"""Decoding benchmark: per-token latency of cached decoding (docs/decoding.md#caches), and the
exit gate's skip_compute on trained checkpoints (docs/decoding.md#exits-that-save-compute).

All models share d 512, N 4, R 4, 8 heads, vocab 8192, batch 1, fp32, random weights, and
are timed **round-robin in one process** (step k of every model before step k+1 of any, ABBA:
common.time_round_robin), so load on this shared machine hits all alike; figures are medians
after warm-up. For each
context length the prompt is prefilled once into the model's cache, then single-token
decoding steps are timed (each step appends one token, so "context 512" means 512 to
512 + warmup + repeats tokens).

Ratios (the StateLoop paper's, at its far larger scale: +1.42% and 18.86% less latency):
  state_overhead            StateLoop(R) / Vanilla(R) − 1
  ratio_vs_vanilla_r_plus_1 StateLoop(R) / Vanilla(R+1)
  cached_speedup_512        recompute-from-scratch per token / cached per token at 512 context
Per context, a ratio is the median over rounds of the ratio of two steps timed back to back;
scalar ratios are the median over the context lengths of the per-context ratios.
On an oversubscribed machine use threads=1: with 2 OpenMP threads and other processes
competing for the cores, every parallel region spin-waits for a descheduled thread and
per-token times inflate ~15× and scatter (measured here: 0.4 s instead of 27 ms).

skip_compute (the exit columns): trained, gated checkpoints (table 8's stage-2 runs of the
attention-only backbones) decode their own task's test sequences with all loops, with the gate's
exit depth and every loop computed, and with `skip_compute` (bench/exit_grid.py): answer
accuracy, agreement, exit depths and per-token latency. Without checkpoints
(`--exit-runs DIR ...`, each DIR a sweep folder of such runs) the section is skipped and says so:
exits of an untrained or hand-set gate would measure nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
from pathlib import Path

import torch

from looplab.bench.common import Stepper, machine_info, time_round_robin
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.generation import decode_one_token

DIMS = dict(d_model=512, n_layers=4, n_loops=4, n_heads=8, vocab_size=8192, batch=1)
HAS_MAMBA2 = importlib.util.find_spec("looplab.models.mamba2") is not None


def _config(**over) -> LoopedLMConfig:
    d = {k: v for k, v in DIMS.items() if k != "batch"}
    return LoopedLMConfig(**{**d, "max_seq_len": 1024, "headdim": 64, "kernel": "torch", **over})


def candidates() -> dict[str, LoopedLMConfig]:
    R = DIMS["n_loops"]
    c = {
        "vanilla_R": _config(),
        "vanilla_R+1": _config(n_loops=R + 1),
        "stateloop_R": _config(state_mode="stateloop"),
        "stateloop_attn_R": _config(state_mode="stateloop_attn"),
    }
    if HAS_MAMBA2:
        c["stateloop_mamba2_R"] = _config(state_mode="stateloop_mamba2")
        c["mamba2_R"] = _config(backbone="mamba2")
        c["hybrid_R"] = _config(backbone="hybrid", hybrid_pattern="MMMA")
    return c


def _build(cfg: LoopedLMConfig, seed: int = 0) -> LoopedLM:
    torch.manual_seed(seed)
    model = LoopedLM(cfg).eval()
    if model.state is not None:  # W_o is zero at init; give it weights so nothing is degenerate
        with torch.no_grad():
            model.state.state_out.weight.normal_(0, 0.02)
    return model


class _Prefilled(Stepper):
    """One model decoding after a prompt: `start` allocates its cache and prefills the prompt (untimed),
    each `step` decodes the prompt's last token once more (one token appended per step)."""

    def __init__(self, model: LoopedLM, prompt: torch.Tensor, steps: int):
        self.model, self.prompt, self.tok, self.steps = model, prompt, prompt[:, -1:], steps

    def start(self, episode: int) -> None:
        self.cache = self.model.allocate_cache(self.prompt.shape[0], self.prompt.shape[1] + self.steps + 1)
        self.model(self.prompt, cache=self.cache)

    def step(self, i: int) -> None:
        decode_one_token(self.model, self.tok, self.cache)


@torch.no_grad()
def _latency(models: dict[str, LoopedLM], contexts, warmup: int, repeats: int, recompute_repeats: int,
             rounds: int = 1) -> dict:
    """Per-token latency per context: the median over `repeats` timed tokens, every model's step k timed
    before any model's step k + 1 (ABBA). `rounds_ms` splits the timed tokens into `rounds` consecutive blocks and
    keeps each block's median per model: the repeated timings (one process, round-robin) that table 4's
    findings pair, so that their intervals measure timing noise, not a difference between conditions."""
    V = DIMS["vocab_size"]
    g = torch.Generator().manual_seed(0)
    out: dict = {"per_token_ms": {}, "recompute_per_token_ms": {}, "rounds_ms": {}, "_times": {}}
    for ctx in contexts:
        prompt = torch.randint(0, V, (DIMS["batch"], ctx), generator=g)
        steppers = {name: _Prefilled(m, prompt, warmup + repeats) for name, m in models.items()}
        timings = time_round_robin(steppers, repeats, warmup=warmup)
        times = timings.wall
        out["per_token_ms"][str(ctx)] = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        per_round = repeats // max(1, rounds)
        if rounds > 1 and per_round >= 1:
            out["rounds_ms"][str(ctx)] = {k: [1e3 * statistics.median(v[i * per_round:(i + 1) * per_round]) for i in range(rounds)]
                                          for k, v in times.items()}
        out["_times"][str(ctx)] = timings
        # recompute from scratch: a full forward over the prefix for one new token's logits
        if recompute_repeats:
            ref = models["vanilla_R"]
            rt = time_round_robin({"recompute": lambda: ref(prompt).logits[:, -1]}, recompute_repeats, warmup=0).wall
            out["recompute_per_token_ms"][str(ctx)] = 1e3 * statistics.median(rt["recompute"])
        del steppers
    return out


@torch.no_grad()
def _deep_block(warmup: int, repeats: int, n_layers: int = 24, ctx: int = 64) -> dict:
    """The state branch costs 3·d·d_s MACs per loop whatever N is, so its share shrinks as the
    block deepens; the paper's models have 24 layers per block. Same timing at N = 24."""
    models = {k: _build(_config(n_layers=n_layers, **over)) for k, over in
              (("vanilla_R", {}), ("vanilla_R+1", {"n_loops": DIMS["n_loops"] + 1}), ("stateloop_R", {"state_mode": "stateloop"}))}
    lat = _latency(models, (ctx,), warmup, max(repeats // 2, 5), 0)
    raw = lat["_times"][str(ctx)]
    f = {k: m.flops_per_token(ctx) for k, m in models.items()}
    paired = lambda a, b: raw.ratio(a, b).median  # noqa: E731
    return {
        "n_layers": n_layers, "context": ctx, "per_token_ms": lat["per_token_ms"][str(ctx)],
        "state_overhead": paired("stateloop_R", "vanilla_R") - 1,
        "ratio_vs_vanilla_r_plus_1": paired("stateloop_R", "vanilla_R+1"),
        "state_overhead_flops": f["stateloop_R"] / f["vanilla_R"] - 1,
    }


def exit_checkpoints(run_dirs) -> list[Path]:
    """The last.ckpt of every finished run (results.json status ok) under the sweep folders run_dirs."""
    from looplab.runs import finished_checkpoints

    return finished_checkpoints(run_dirs)


def skip_compute_section(run_dirs, threads: int, n_sequences: int = 128) -> dict:
    from looplab.bench import exit_grid

    ckpts = exit_checkpoints(run_dirs or [])
    if not ckpts:
        where = ", ".join(map(str, run_dirs)) if run_dirs else "none given"
        return {"skipped": f"no trained gated checkpoint (exit runs: {where}); run `make table8` first, "
                           "or pass --exit-runs DIR with stage-2 runs of an attention-only backbone"}
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return exit_grid.decode_checkpoints(ckpts, n_sequences=n_sequences)
    finally:
        torch.set_num_threads(old)


def run(threads: int = 2, quick: bool = False, exit_runs=None) -> dict:
    """Per-token decoding latency of every looped model side by side, the paper's ratios,
    cached-vs-recompute speed-up and the exit-gate skip_compute speed-up and quality."""
    contexts = (64, 512) if quick else (64, 256, 512)
    # rounds: repeated timings per context (table 4 pairs them; ≥ 5), each the median of repeats / rounds tokens
    warmup, repeats, recompute_repeats, rounds = (2, 20, 1, 5) if quick else (3, 30, 3, 6)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        models = {k: _build(cfg) for k, cfg in candidates().items()}
        result: dict = {
            "machine": machine_info(threads),
            "dims": DIMS, "threads": threads, "contexts": list(contexts), "warmup": warmup, "repeats": repeats, "rounds": rounds,
            "dtype": "float32", "mamba2_available": HAS_MAMBA2,
            "params": {k: m.num_parameters()["total"] for k, m in models.items()},
            "flops_per_token_512": {k: m.flops_per_token(512) for k, m in models.items()},
        }
        result.update(_latency(models, contexts, warmup, repeats, recompute_repeats, rounds))
        per, raw = result["per_token_ms"], result.pop("_times")

        def ratio(a, b):  # per context: the paired ratio of steps timed back to back (common.Timings.ratio)
            return {c: t.ratio(a, b).median for c, t in raw.items()}

        so = {c: r - 1 for c, r in ratio("stateloop_R", "vanilla_R").items()}
        rr = ratio("stateloop_R", "vanilla_R+1")
        result["state_overhead_per_context"] = so
        result["ratio_vs_vanilla_r_plus_1_per_context"] = rr
        result["state_overhead"] = statistics.median(so.values())
        result["ratio_vs_vanilla_r_plus_1"] = statistics.median(rr.values())
        result["latency_reduction_vs_vanilla_r_plus_1"] = 1 - result["ratio_vs_vanilla_r_plus_1"]
        result["state_overhead_attn_mixer"] = statistics.median(r - 1 for r in ratio("stateloop_attn_R", "vanilla_R").values())
        if "stateloop_mamba2_R" in models:
            result["state_overhead_mamba2_mixer"] = statistics.median(
                r - 1 for r in ratio("stateloop_mamba2_R", "vanilla_R").values()
            )
        f = result["flops_per_token_512"]
        result["state_overhead_flops"] = f["stateloop_R"] / f["vanilla_R"] - 1
        result["ratio_vs_vanilla_r_plus_1_flops"] = f["stateloop_R"] / f["vanilla_R+1"]
        result["cached_speedup"] = {
            c: result["recompute_per_token_ms"][c] / per[c]["vanilla_R"] for c in result["recompute_per_token_ms"]
        }
        result["cached_speedup_512"] = result["cached_speedup"].get("512")
        del models
        if not quick:
            result["deep_block"] = _deep_block(warmup, repeats)
        result["skip_compute"] = skip_compute_section(exit_runs, threads)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        if threads > 1 and load > (os.cpu_count() or 1):
            result["warning"] = (
                f"load average {load:.1f} > {os.cpu_count()} cores with threads={threads}: OpenMP spin-waits "
                "inflate and scatter per-token times; rerun with --threads 1 for usable ratios"
            )
        result["targets"] = {
            "state_overhead<=0.02": result["state_overhead"] <= 0.02,
            "stateloop_R_at_least_15pct_faster_than_vanilla_R+1": result["ratio_vs_vanilla_r_plus_1"] <= 0.85,
            "cached_speedup_512>=10": (result["cached_speedup_512"] or 0) >= 10,
        }
        return result
    finally:
        torch.set_num_threads(old)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m looplab.bench.decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/decode.json"))
    ap.add_argument("--exit-runs", nargs="*", type=Path, default=[], metavar="DIR",
                    help="sweep folders of trained gated runs (table 8 stage 2) for the skip_compute section")
    a = ap.parse_args()
    out = a.out
    res = run(threads=a.threads, quick=a.quick, exit_runs=a.exit_runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if not isinstance(v, dict) or k in ("targets",)}, indent=2))
    print(f"wrote {out}")
