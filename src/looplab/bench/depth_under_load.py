"""Depth under load (table 14, docs/tables.md#table-14): trained looped models in `looplab.serve.Engine`.

    python -m looplab.bench.depth_under_load RUN_OR_SWEEP... [--concurrency 1,8,32] [--requests 32] [--repeats 5]
        [--rule kl] [--grid 0.01,0.02,0.05,0.1,0.2] [--windows 64] [--select-windows 16] [--out bench/serving.json]

Each checkpoint is one of three kinds, read off its config:

    exit-aware  trained with `exit_gate.skip_train_prob` > 0 (table 11: llama with kv_copy, hybrid with ssm_skip) or
                with an exit gate. Arms: plain (every loop), exits_lockstep and exits_depthwise, both with
                ExitPolicy(q, rule, skip=the handling it was trained with; the gate's rule when it has one).
                Operating point: the largest q of the grid whose teacher-forced perplexity, with the exits and the
                skip handling, over the first `select` held-out windows stays within QUALITY_BOUND of every loop's
                on those windows; none within: the smallest q. It is chosen on those windows and reported on the
                `windows` after them (lm_tiny's validation and test splits are the same held-out works, so the
                split is by window).
    routed      a depth router (table 12's MoR): arms routed (lockstep: a step runs until its deepest row's token
                stops) and routed_depthwise (depth-wise batching); each token at the router's own depth.
    fixed       every other looped model (table 12's fixed 1⊗R): one arm, plain.

Quality on the `windows` held-out windows after the selection windows: perplexity with every loop, and with the engine's exit decisions
(`model(ids, exits=ExitPolicy(q, rule, skip=H))`: the same online rule and skip handling on the true text) and their
mean depth; a routed model's causal perplexity (`depths="inference"`, each token routed on its own as decoding does)
and mean depth. The trace (seeded, the same for every model: they share the tokenizer): request i's prompt is the
first P_i tokens of the i-th of those windows, P_i uniform in --prompt-len, its output length uniform in --new-tokens, no eos.
Timing: at each concurrency, `repeats` rounds; each round runs every (model, arm) once, closed loop (bench/serve.py
`run_arm`), so the ratios the table reads are paired within a round. Every request of the first round is checked
against decoding it alone (`solo_agreement`). One thread by default (--threads).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from looplab.bench.common import machine_info, set_threads
from looplab.bench.serve import parse_concurrency, parse_pair, run_arm
from looplab.bench.trained_runs import body_training, checkpoints_in, held_out_examples, run_results, run_seed
from looplab.models.exits import ExitPolicy

QUALITY_BOUND = 0.02  # the "perplexity within 2% of its all-loops perplexity"
GRID = (0.01, 0.02, 0.05, 0.1, 0.2)  # kl thresholds (nats between consecutive loops' next-token distributions)
GATE_GRID = (0.3, 0.5, 0.7, 0.9)
SKIP_OF_BACKBONE = {"llama": "kv_copy", "mamba2": "ssm_skip", "hybrid": "ssm_skip"}


def kind_of(model, ckpt) -> str:
    cfg = model.config
    if cfg.depth_router.name != "none":
        return "routed"
    if cfg.exit_gate != "none" or body_training(ckpt) != "standard":
        return "exit-aware"
    return "fixed"


def handling_of(model, ckpt) -> str:
    """The skip handling the body was trained with (its exit_gate.skip_compute), else the backbone's default."""
    gate = (run_results(ckpt).get("config") or {}).get("exit_gate") or {}
    h = gate.get("skip_compute")
    return h if h in ("kv_copy", "ssm_skip", "ssm_propagate") else SKIP_OF_BACKBONE[model.config.backbone]


def windows(meta: dict[str, Any], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n (input_ids, targets) windows of the checkpoint's test split."""
    held = held_out_examples(meta, n, every_token=True)
    if len(held) < n:
        raise ValueError(f"the test split has {len(held)} windows, fewer than the {n} asked for")
    return torch.stack([ex["input_ids"] for ex in held]), torch.stack([ex["targets"] for ex in held])


@torch.no_grad()
def quality(model, ids: torch.Tensor, targets: torch.Tensor, policy: ExitPolicy | None = None, routed: bool = False,
            batch_size: int = 16) -> dict[str, float]:
    """Teacher-forced perplexity over every next token: every loop (policy None), with the exit policy (its online
    rule and skip handling), or routed causally; and the mean depth run per token."""
    nll, n, depth = 0.0, 0, 0.0
    R = model.config.n_loops
    for i in range(0, ids.shape[0], batch_size):
        x, y = ids[i:i + batch_size], targets[i:i + batch_size]
        if routed:
            out = model(x, depths="inference")
            d = out.routing.depth.float()
        elif policy is not None:
            out = model(x, exits=policy)
            d = out.exit_steps.float()
        else:
            out = model(x)
            d = torch.full(y.shape, float(R))
        keep = y >= 0
        nll += float(F.cross_entropy(out.logits[keep].float(), y[keep], reduction="sum"))
        depth += float(d[keep].sum())
        n += int(keep.sum())
    return {"perplexity": math.exp(nll / max(n, 1)), "mean_depth": depth / max(n, 1), "tokens": n}


def choose_threshold(model, ids, targets, rule: str, handling: str, grid) -> dict[str, Any]:
    """The operating point on the selection windows: the largest q of the grid within QUALITY_BOUND of every loop."""
    full = quality(model, ids, targets)["perplexity"]
    tried = []
    for q in sorted(grid):
        qual = quality(model, ids, targets, ExitPolicy(threshold=q, rule=rule, skip=handling))
        tried.append({"threshold": q, "perplexity": qual["perplexity"], "mean_depth": qual["mean_depth"],
                      "ratio": qual["perplexity"] / full})
    within = [t for t in tried if t["ratio"] - 1 <= QUALITY_BOUND]
    pick = (max(within, key=lambda t: t["threshold"]) if within else tried[0])["threshold"]
    return {"threshold": pick, "within_bound": bool(within), "all_loops_perplexity": full, "grid": tried}


def make_trace(test_ids: torch.Tensor, n: int, prompt_len=(8, 24), new_tokens=(8, 32), seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    if test_ids.shape[0] < n or test_ids.shape[1] < prompt_len[1]:
        raise ValueError(f"the trace needs {n} test windows of {prompt_len[1]} tokens; got {tuple(test_ids.shape)}")
    return [{"prompt": test_ids[i, :rng.randint(*prompt_len)].tolist(), "max_new_tokens": rng.randint(*new_tokens),
             "arrival": None} for i in range(n)]


def run(paths, concurrency=(1, 8, 32), requests: int = 32, repeats: int = 5, rule: str = "kl", grid=GRID,
        n_windows: int = 64, n_select: int = 16, prompt_len=(8, 24), new_tokens=(8, 32), seed: int = 0,
        threads: int | None = 1, check: bool = True, progress: bool = False) -> dict[str, Any]:
    from looplab.checkpoint import load_model

    if threads:
        set_threads(threads)
    ckpts = checkpoints_in(paths)
    if not ckpts:
        raise SystemExit(f"no trained checkpoint in {', '.join(map(str, paths))}")
    t_start = time.time()
    models, trace = [], None
    for c in ckpts:
        model, meta = load_model(c, map_location="cpu")
        model.eval()
        cfg = model.config
        kind = kind_of(model, c)
        held_ids, held_tgt = windows(meta, n_select + max(n_windows, requests))
        sel_ids, sel_tgt = held_ids[:n_select], held_tgt[:n_select]
        test_ids, test_tgt = held_ids[n_select:], held_tgt[n_select:]
        info = {"checkpoint": str(c), "seed": run_seed(c), "kind": kind, "training": body_training(c),
                "backbone": cfg.backbone, "state_mode": cfg.state_mode, "n_layers": cfg.n_layers, "n_loops": cfg.n_loops,
                "d_model": cfg.d_model, "depth_router": cfg.depth_router.name, "exit_gate": cfg.exit_gate}
        policy, arms = None, ["plain"]
        q_ids, q_tgt = test_ids[:n_windows], test_tgt[:n_windows]
        info["all_loops"] = quality(model, q_ids, q_tgt)
        if kind == "exit-aware":
            handling = handling_of(model, c)
            r = "gate" if cfg.exit_gate != "none" else rule
            info["operating_point"] = {"rule": r, "handling": handling,
                                       **choose_threshold(model, sel_ids, sel_tgt, r, handling,
                                                          GATE_GRID if r == "gate" else grid)}
            policy = ExitPolicy(threshold=info["operating_point"]["threshold"], rule=None if r == "gate" else r,
                                skip=handling)
            info["exits"] = quality(model, q_ids, q_tgt, policy)
            arms = ["plain", "exits_lockstep", "exits_depthwise"]
        elif kind == "routed":
            info["routed"] = quality(model, q_ids, q_tgt, routed=True)
            arms = ["routed", "routed_depthwise"]
        if trace is None:
            trace = make_trace(test_ids, requests, prompt_len, new_tokens, seed)
        models.append({"model": model, "policy": policy, "arms": arms, "info": info, "runs": []})
        print(f"[depth_under_load] {kind} {cfg.backbone} {cfg.n_layers}x{cfg.n_loops} ({c}): all loops ppl "
              f"{info['all_loops']['perplexity']:.2f}"
              + (f", exits q={policy.threshold:g} ppl {info['exits']['perplexity']:.2f} depth "
                 f"{info['exits']['mean_depth']:.2f}" if policy is not None else "")
              + (f", routed ppl {info['routed']['perplexity']:.2f} depth {info['routed']['mean_depth']:.2f}"
                 if kind == "routed" else ""), flush=True)
    for c in concurrency:
        for rep in range(repeats):
            for m in models:  # every (model, arm) once per round: the round's ratios are paired in time
                for arm in m["arms"]:
                    routed = arm.startswith("routed")
                    res = run_arm(m["model"], trace, "plain" if routed else arm, c, m["policy"], open_loop=False,
                                  check=check and rep == 0, progress=progress,
                                  schedule="depthwise" if arm == "routed_depthwise" else None)
                    res["arm"], res["repeat"] = arm, rep
                    if routed:  # the engine does not report the router's depths: the causal forward's figure
                        res["mean_depth"] = m["info"]["routed"]["mean_depth"]
                    m["runs"].append(res)
            print(f"[depth_under_load] c={c} round {rep + 1}/{repeats}: " + ", ".join(
                f"{m['info']['kind']} {m['info']['backbone']} {r['arm']} {r['output_tokens_per_s']:.0f}"
                for m in models for r in m["runs"] if r["concurrency"] == c and r["repeat"] == rep) + " tok/s", flush=True)
    return {"concurrency": list(concurrency), "requests": requests, "repeats": repeats, "rule": rule,
            "grid": list(grid), "quality_bound": QUALITY_BOUND, "windows": n_windows, "select_windows": n_select,
            "trace": {"prompt_len": list(prompt_len), "new_tokens": list(new_tokens), "seed": seed,
                      "source": "test windows' first tokens, no eos"},
            "threads": threads or torch.get_num_threads(), "machine": machine_info(threads or torch.get_num_threads()),
            "seconds": round(time.time() - t_start, 1),
            "models": [{**m["info"], "arms": m["arms"], "runs": m["runs"]} for m in models]}


def main(argv=None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m looplab.bench.depth_under_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="checkpoints or sweep folders (every run with an ok results.json)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rule", default="kl", help="the zero-shot exit rule of models without a gate")
    ap.add_argument("--grid", default=",".join(f"{q:g}" for q in GRID), help="thresholds the operating point is chosen from")
    ap.add_argument("--windows", type=int, default=64, help="test windows the perplexities are measured on")
    ap.add_argument("--select-windows", type=int, default=16,
                    help="held-out windows the threshold is chosen on (the ones before the measured windows)")
    ap.add_argument("--prompt-len", default="8,24")
    ap.add_argument("--new-tokens", default="8,32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--out", default="bench/serving.json")
    a = ap.parse_args(argv)
    try:
        grid = tuple(float(x) for x in a.grid.split(","))
    except ValueError:
        ap.error(f"--grid {a.grid!r}: give numbers separated by commas")
    if a.repeats < 1 or a.requests < 1:
        ap.error(f"--repeats {a.repeats} / --requests {a.requests}: must be >= 1")
    out = run(a.paths, parse_concurrency(ap, a.concurrency), a.requests, a.repeats, a.rule, grid, a.windows,
              a.select_windows, parse_pair(ap, a.prompt_len, "prompt-len"), parse_pair(ap, a.new_tokens, "new-tokens"),
              a.seed, a.threads, not a.no_check, progress=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out} ({out['seconds']:.0f} s)")
    return out


if __name__ == "__main__":
    main()
