"""Decoding with routed depth measured (table 12; not a timed test): tokens/s and KV-cache bytes of
each way to spend depth, on the same prompts.

    python -m looplab.bench.routed_decode SWEEP_DIR_OR_CKPT ... [--prompt 32] [--new 64] [--repeats 5]
                                          [--threads 1] [--out bench/routing.json]

Runs are grouped by seed (the same held-out prompt for every arm of a seed: the first --prompt tokens of the
first test window). Every arm of a group decodes --new greedy tokens at batch 1, timed round-robin (ABBA:
bench/common.time_round_robin), so a slow moment of the machine hits all arms alike; the figure is the median
tokens/s, wall time from the call to `generate` to its return (prefill included). How each arm decodes:

    depth router    its inference router (models/router.py: each token routed on its own, per-depth caches)
    exit gate       the gate's exit at threshold --exit-q, exited tokens skipping the deeper loops (kv_copy)
    otherwise       every loop

KV bytes: the cache after the prompt and the decoded tokens (LoopCache.nbytes, the entries actually written),
replayed token by token through the model's own cached forward; a depth router's per-depth caches hold only
the tokens that reached their depth. The exit gate's kv_copy writes every deeper loop's entry for an exited
token, so it keeps the full cache (its replay runs every loop). `mean_depth`: loops per decoded token.
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
def measure_group(models: dict[str, Any], ids: torch.Tensor, new_tokens: int, repeats: int,
                  exit_q: float = EXIT_Q) -> dict[str, dict[str, Any]]:
    """The arms of one seed on one prompt → {name: tokens_per_s, kv_bytes, mean_depth}."""
    from looplab.bench.common import device_of, time_round_robin

    kwargs = {name: decode_kwargs(m, exit_q) for name, m in models.items()}
    outs = {name: generate(m, ids, new_tokens, return_logits=True, **kwargs[name]) for name, m in models.items()}
    fns = {name: (lambda m=m, kw=kwargs[name]: generate(m, ids, new_tokens, **kw)) for name, m in models.items()}
    device = device_of(next(iter(models.values())))
    times = time_round_robin(fns, repeats, warmup=0, device=device).wall  # the calls above were the warm-up
    result = {}
    for name, m in models.items():
        seq = outs[name].sequences
        kv, depth = replay_cache(m, seq, ids.shape[1])
        if outs[name].exit_steps is not None:  # the gate's exits, as decoded (replay ran every loop)
            depth = float(outs[name].exit_steps.float().mean())
        n = seq.shape[1] - ids.shape[1]
        result[name] = {"tokens_per_s": round(n / statistics.median(times[name]), 2),
                        "tokens_per_s_range": [round(n / max(times[name]), 2), round(n / min(times[name]), 2)],
                        "kv_bytes": kv, "mean_depth": round(depth, 4), "new_tokens": n}
    return result


def _arm(run_dir: Path, res: dict) -> str:
    """The run's arm as the table names it (its `+arm=` override), else its folder."""
    for o in res.get("overrides") or []:
        k, _, v = o.partition("=")
        if k.lstrip("+~") == "arm":
            return v
    return run_dir.name


def run(paths, prompt_len: int = 32, new_tokens: int = 64, repeats: int = 5, threads: int | None = 1,
        exit_q: float = EXIT_Q) -> dict[str, Any]:
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
        models, info, ids = {}, {}, None
        for c in members:
            model, meta = load_model(c, map_location="cpu")
            model.eval()
            res = run_results(c)
            run_dir = Path(c).parent.parent if Path(c).name == "last.ckpt" else Path(c)
            name = f"{_arm(run_dir, res)} {model.config.n_layers}x{model.config.n_loops} ({run_dir})"
            models[name] = model
            info[name] = {"checkpoint": str(c), "run_dir": str(run_dir), "arm": _arm(run_dir, res), "seed": seed,
                          "n_layers": model.config.n_layers, "n_loops": model.config.n_loops,
                          "depth_router": model.config.depth_router.name, "exit_gate": model.config.exit_gate}
            if ids is None:
                ids = held_out_prompts(model, meta, 1, prompt_len)
        measured = measure_group(models, ids, new_tokens, repeats, exit_q)
        runs += [{**info[name], **measured[name]} for name in models]
        print(f"[routed_decode] seed {seed}: " + ", ".join(f"{info[n]['arm']} {measured[n]['tokens_per_s']:.0f} tok/s "
                                                         f"{measured[n]['kv_bytes'] / 1024:.0f} KiB" for n in models), flush=True)
    return {"threads": threads or torch.get_num_threads(), "prompt": prompt_len, "new_tokens": new_tokens,
            "repeats": repeats, "exit_q": exit_q, "runs": runs}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="checkpoints or sweep folders (every run with an ok results.json)")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--exit-q", type=float, default=EXIT_Q, help="the exit gate's threshold when an arm has one")
    p.add_argument("--out", help="write the JSON here too")
    a = p.parse_args(argv)
    out = run(a.paths, a.prompt, a.new, a.repeats, a.threads, a.exit_q)
    text = json.dumps(out, indent=2)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
