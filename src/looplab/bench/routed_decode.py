"""Decoding of each way to spend depth measured (tables 12 and 13; not a timed test): tokens/s and KV-cache
bytes on the same prompts, and optionally the per-loop diagnostics.

    python -m looplab.bench.routed_decode SWEEP_DIR_OR_CKPT ... [--prompt 32] [--new 64] [--repeats 5]
                                          [--batch 1 [8 ...]] [--threads 1] [--diagnostics]
                                          [--out bench/routing.json]

Runs are grouped by seed (the same held-out prompts for every arm of a seed: the first --prompt tokens of the
first test windows, one per row). At each --batch size every arm of a group decodes --new greedy tokens, timed
round-robin (ABBA: bench/common.time_round_robin), so a slow moment of the machine hits all arms alike; the
figure is the median tokens/s (batch × new tokens over the wall time from the call to `generate` to its
return, prefill included). `tokens_per_s` is the first batch size's; `batches` holds every one. A parallel-loop
model (loop_depth.schedule=parallel) decodes its R loops as one folded block call per token. How each arm decodes:

    depth router    its inference router (models/router.py: each token routed on its own, per-depth caches)
    exit gate       the gate's exit at threshold --exit-q, exited tokens skipping the deeper loops (kv_copy)
    otherwise       every loop

KV bytes: the cache after the prompt and the decoded tokens (LoopCache.nbytes, the entries actually written),
replayed token by token through the model's own cached forward at batch 1; a depth router's per-depth caches
hold only the tokens that reached their depth. The exit gate's kv_copy writes every deeper loop's entry for an
exited token, so it keeps the full cache (its replay runs every loop). A parallel model's G-SWA cache is loop
1's full cache plus R − 1 windows. `mean_depth`: loops per decoded token.

--diagnostics: each checkpoint's per-loop diagnostics (eval/diagnostics.py: LoopCoder-v2's measures, the
G-SWA gate's mean) over the first --diagnostics-batches test batches of its dataset, as `diagnostics`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from looplab.models.exits import ExitPolicy
from looplab.models.generation import generate
from looplab.targets import EXIT_Q


def decode_kwargs(model, exit_q: float = EXIT_Q) -> dict[str, Any]:
    """How an arm decodes: an exit gate exits at its threshold and skips (kv_copy); anything else as built."""
    if model.exit_gate is not None:
        return {"exits": ExitPolicy(threshold=exit_q, skip="kv_copy")}
    return {}


@torch.no_grad()
def replay_cache(model, sequence: torch.Tensor, prompt_len: int) -> tuple[int, float]:
    """(KV bytes after prefill + one-token steps over `sequence` (1, T), mean loops per decoded token)."""
    T = sequence.shape[1]
    cache = model.allocate_cache(1, T)
    out = model(sequence[:, :prompt_len], cache=cache)
    depths = []
    for t in range(prompt_len, T):
        out = model(sequence[:, t:t + 1], cache=cache)
        depths.append(float(out.routing.depth.float().mean()) if out.routing is not None else float(model.config.n_loops))
    return cache.nbytes(), statistics.fmean(depths) if depths else float(model.config.n_loops)


@torch.no_grad()
def time_group(models: dict[str, Any], ids: torch.Tensor, new_tokens: int, repeats: int,
               exit_q: float = EXIT_Q) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The arms of one seed on the prompts ids (B, T), timed round-robin → (their decoded outputs,
    {name: tokens_per_s, tokens_per_s_range, new_tokens})."""
    from looplab.bench.common import device_of, time_round_robin

    kwargs = {name: decode_kwargs(m, exit_q) for name, m in models.items()}
    outs = {name: generate(m, ids, new_tokens, return_logits=True, **kwargs[name]) for name, m in models.items()}
    fns = {name: (lambda m=m, kw=kwargs[name]: generate(m, ids, new_tokens, **kw)) for name, m in models.items()}
    device = device_of(next(iter(models.values())))
    times = time_round_robin(fns, repeats, warmup=0, device=device).wall  # the calls above were the warm-up
    result = {}
    for name in models:
        n = ids.shape[0] * (outs[name].sequences.shape[1] - ids.shape[1])
        result[name] = {"tokens_per_s": round(n / statistics.median(times[name]), 2),
                        "tokens_per_s_range": [round(n / max(times[name]), 2), round(n / min(times[name]), 2)],
                        "new_tokens": n}
    return outs, result


@torch.no_grad()
def measure_group(models: dict[str, Any], ids: torch.Tensor, new_tokens: int, repeats: int,
                  exit_q: float = EXIT_Q) -> dict[str, dict[str, Any]]:
    """The arms of one seed on one prompt (1, T) → {name: tokens_per_s, kv_bytes, mean_depth}."""
    outs, timed = time_group(models, ids[:1], new_tokens, repeats, exit_q)
    result = {}
    for name, m in models.items():
        seq = outs[name].sequences
        kv, depth = replay_cache(m, seq, ids.shape[1])
        if outs[name].exit_steps is not None:  # the gate's exits, as decoded (replay ran every loop)
            depth = float(outs[name].exit_steps.float().mean())
        result[name] = {**timed[name], "kv_bytes": kv, "mean_depth": round(depth, 4)}
    return result


def diagnostics_of(model, meta: dict[str, Any], max_batches: int) -> dict[str, Any]:
    """The checkpoint's per-loop diagnostics over its first max_batches test batches."""
    from looplab.data.registry import datamodule_from_meta
    from looplab.eval.diagnostics import diagnose

    dm = datamodule_from_meta(meta["dataset"], source="the trained run's checkpoint")
    if hasattr(dm, "prepare_data"):
        dm.prepare_data()
    dm.setup("test")
    return diagnose(model, dm.test_dataloader(), max_batches)


def _arm(run_dir: Path, res: dict) -> str:
    """The run's arm as the table names it (its `+arm=` override), else its folder."""
    for o in res.get("overrides") or []:
        k, _, v = o.partition("=")
        if k.lstrip("+~") == "arm":
            return v
    return run_dir.name


def run(paths, prompt_len: int = 32, new_tokens: int = 64, repeats: int = 5, threads: int | None = 1,
        exit_q: float = EXIT_Q, batches: tuple[int, ...] = (1,), diagnostics: bool = False,
        diagnostics_batches: int = 4) -> dict[str, Any]:
    from looplab.bench.trained_runs import checkpoints_in, held_out_prompts, run_results, run_seed
    from looplab.checkpoint import load_model

    if threads:
        torch.set_num_threads(threads)
    ckpts = checkpoints_in(paths)
    if not ckpts:
        raise SystemExit(f"no trained checkpoint in {', '.join(map(str, paths))}")
    groups: dict[str, list[Path]] = defaultdict(list)
    for c in ckpts:
        groups[str(run_seed(c))].append(Path(c))
    runs = []
    for seed, members in sorted(groups.items()):
        models, info, metas = {}, {}, {}
        for c in members:
            model, meta = load_model(c, map_location="cpu")
            model.eval()
            res = run_results(c)
            run_dir = Path(c).parent.parent if Path(c).name == "last.ckpt" else Path(c)
            name = f"{_arm(run_dir, res)} {model.config.n_layers}x{model.config.n_loops} ({run_dir})"
            models[name] = model
            cfg = model.config
            info[name] = {"checkpoint": str(c), "run_dir": str(run_dir), "arm": _arm(run_dir, res), "seed": seed,
                          "n_layers": cfg.n_layers, "n_loops": cfg.n_loops,
                          "depth_router": cfg.depth_router.name, "exit_gate": cfg.exit_gate,
                          "loop_schedule": cfg.loop_schedule,
                          **({"loop_kv": cfg.loop_kv, "loop_window": cfg.loop_window}
                             if cfg.loop_schedule == "parallel" else {})}
            metas[name] = meta
        first = next(iter(models))
        ids = held_out_prompts(models[first], metas[first], max(batches), prompt_len)
        by_batch = {}
        for b in batches:
            by_batch[b] = (measure_group(models, ids[:1], new_tokens, repeats, exit_q) if b == 1
                           else time_group(models, ids[:b], new_tokens, repeats, exit_q)[1])
        measured = {name: {**by_batch[batches[0]][name],
                           "batches": {str(b): {k: by_batch[b][name][k] for k in ("tokens_per_s", "tokens_per_s_range")}
                                       for b in batches}}
                    for name in models}
        if 1 in batches:  # the cache after batch-1 decoding, every batch size's figure per row
            for name in models:
                measured[name].update({k: by_batch[1][name][k] for k in ("kv_bytes", "mean_depth")})
        if diagnostics:
            for name, m in models.items():
                measured[name]["diagnostics"] = diagnostics_of(m, metas[name], diagnostics_batches)
        runs += [{**info[name], **measured[name]} for name in models]
        print(f"[routed_decode] seed {seed}: " + ", ".join(
            f"{info[n]['arm']} {n.split(' (')[0].split(' ')[-1]} " + " / ".join(
                f"{measured[n]['batches'][str(b)]['tokens_per_s']:.0f}" for b in batches) + " tok/s"
            + (f" {measured[n]['kv_bytes'] / 1024:.0f} KiB" if "kv_bytes" in measured[n] else "") for n in models), flush=True)
    return {"threads": threads or torch.get_num_threads(), "prompt": prompt_len, "new_tokens": new_tokens,
            "repeats": repeats, "exit_q": exit_q, "batch_sizes": list(batches), "runs": runs}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="checkpoints or sweep folders (every run with an ok results.json)")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--exit-q", type=float, default=EXIT_Q, help="the exit gate's threshold when an arm has one")
    p.add_argument("--batch", type=int, nargs="+", default=[1],
                   help="batch sizes to time (the first is `tokens_per_s`); KV bytes come from batch 1 when listed")
    p.add_argument("--diagnostics", action="store_true", help="add each checkpoint's per-loop diagnostics")
    p.add_argument("--diagnostics-batches", type=int, default=4, help="test batches the diagnostics read")
    p.add_argument("--out", help="write the JSON here too")
    a = p.parse_args(argv)
    if any(b < 1 for b in a.batch):
        p.error(f"--batch {a.batch}: every batch size must be >= 1")
    out = run(a.paths, a.prompt, a.new, a.repeats, a.threads, a.exit_q, tuple(a.batch), a.diagnostics,
              a.diagnostics_batches)
    text = json.dumps(out, indent=2)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
