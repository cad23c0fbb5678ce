"""Serving under load: looplab.serve.Engine on a generated request trace (docs/performance.md#serving-under-load).

    python -m looplab.bench serve CKPT|random [--concurrency 1,8,32] [--rate R] [--requests N] [--repeats K]
                                   [--exit-rule NAME] [--exit-threshold X] [--out FILE.json]
    python -m looplab.bench --only serve        # make bench's part: `bench_model()`, 64 requests, 3 repeats

The trace (seeded): prompt lengths uniform in --prompt-len a,b tokens, output lengths uniform in --new-tokens a,b,
token ids uniform over the vocabulary (no eos: each request runs to its length). Arms, each at every concurrency c:

    plain             continuous batching, every loop for every token (schedule lockstep, no exits)
    exits_lockstep    the same with the exit policy (the gate at threshold q, or --exit-rule at its threshold; the
                      backbone's skip handling); a step still runs
                      until its deepest row has exited
    exits_depthwise   depth-wise batching (schedule depthwise, the same exit policy): one block call per step over
                      every in-flight token at its own loop

Closed loop: c requests outstanding at all times (a finished request is replaced by the next at once), the engine
holding c rows; concurrency 1 is one request at a time. --rate R adds an open-loop run per arm: Poisson arrivals
at R requests/s into an engine of max(concurrency) rows. Reported per run: output tokens/s, time to first token and
per-token latency (p50, p99; seconds), decoding tokens/s (the tokens after each request's first, over the engine's
time in decoding calls: prefill, which runs every loop in every arm, left out), the prefill's share of the wall
time, mean depth run per token (R without exits), peak cache bytes, and the check of every request against
decoding it alone (equal / ties / different, `looplab.serve.solo_agreement`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from typing import Any

import torch

from looplab.bench.common import machine_info, set_threads
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.exits import ExitPolicy
from looplab.serve import Engine, solo_agreement
from looplab.serve.depthwise import unsupported as depthwise_unsupported

ARMS = ("plain", "exits_lockstep", "exits_depthwise")
SKIP = {"llama": "kv_copy", "mamba2": "ssm_skip", "hybrid": "ssm_skip"}


def make_trace(n: int, vocab: int, prompt_len=(8, 24), new_tokens=(8, 32), rate: float | None = None,
               seed: int = 0) -> list[dict]:
    """n requests: prompt ids, output length and (with rate) a Poisson arrival time in seconds."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        if rate:
            t += rng.expovariate(rate)
        out.append({"prompt": [rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_len))],
                    "max_new_tokens": rng.randint(*new_tokens), "arrival": t if rate else None})
    return out


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_arm(model, trace: list[dict], arm: str, concurrency: int, exits: ExitPolicy | None, open_loop: bool,
            check: bool = True, progress: bool = True, schedule: str | None = None) -> dict[str, Any]:
    """One closed-loop (or open-loop) run of the trace; schedule: the arm's own (exits_depthwise: depthwise) unless
    given (a routed model's depth-wise arm runs 'plain' — no exit policy — under schedule='depthwise')."""
    R = model.config.n_loops
    max_len = max(len(r["prompt"]) + r["max_new_tokens"] for r in trace)
    schedule = schedule or ("depthwise" if arm == "exits_depthwise" else "lockstep")
    policy = None if arm == "plain" else exits
    engine = Engine(model, max_batch=concurrency, max_len=max_len, exits=policy, schedule=schedule)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(trace), desc=f"{arm} c={concurrency}{' open' if open_loop else ''}", leave=False)
    submitted = {}
    queue = list(trace)
    t0 = time.perf_counter()
    done = []  # the requests as they leave (the engine keeps none of them)
    if open_loop:
        for r in queue:
            submitted[engine.add(r["prompt"], r["max_new_tokens"], arrival=r["arrival"]).id] = r["arrival"]
        queue = []
    else:
        while queue and len(submitted) < concurrency:
            r = queue.pop(0)
            submitted[engine.add(r["prompt"], r["max_new_tokens"]).id] = engine.now()
    while not engine.idle():
        if open_loop and not engine.running and all(w.arrival > engine.now() for w in engine.waiting):
            time.sleep(max(0.0, min(w.arrival for w in engine.waiting) - engine.now()))
        finished = engine.step()
        done += finished
        for _ in finished:
            if bar is not None:
                bar.update(1)
            if queue:  # closed loop: the next request replaces the finished one at once
                r = queue.pop(0)
                submitted[engine.add(r["prompt"], r["max_new_tokens"]).id] = engine.now()
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    done.sort(key=lambda q: q.id)
    tokens = sum(len(q.tokens) for q in done)
    ttft = [q.token_times[0] - submitted[q.id] for q in done]
    gaps = [b - a for q in done for a, b in zip(q.token_times, q.token_times[1:])]
    depth = [s for q in done for s in q.exit_steps] if policy is not None else []
    res = {
        "arm": arm, "concurrency": concurrency, "open_loop": open_loop, "requests": len(done), "output_tokens": tokens,
        "wall_s": round(wall, 3), "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "token_latency_p50_s": percentile(gaps, 0.5), "token_latency_p99_s": percentile(gaps, 0.99),
        "decode_tokens_per_s": (tokens - len(done)) / max(engine.stats["decode_s"], 1e-9),  # first tokens: prefill
        "prefill_share": engine.stats["prefill_s"] / wall,
        "mean_depth": (sum(depth) / len(depth)) if depth else float(R),
        "peak_cache_bytes": engine.stats["peak_cache_bytes"], "block_calls": engine.stats["decode_calls"],
    }
    if check:
        agree = solo_agreement(model, done, exits=policy)
        res["solo_check"] = {k: agree[k] for k in ("equal", "ties", "different")}
        res["solo_check"]["differences"] = agree["differences"][:3]
    return res


def serve_bench(model, *, concurrency=(1, 8, 32), requests: int = 64, rate: float | None = None,
                exit_threshold: float = 0.5, prompt_len=(8, 24), new_tokens=(8, 32), seed: int = 0,
                arms=ARMS, check: bool = True, progress: bool = True, repeats: int = 1,
                exit_rule: str | None = None) -> dict[str, Any]:
    """exit_rule: a registered exit rule (a researcher's too, by its dotted name) instead of the gate's CDF; a
    zero-shot rule (kl, entropy, ...) serves a model without a gate. Refused before anything runs, naming the
    option, when the model cannot run it (ExitPolicy.check)."""
    cfg = model.config
    exits = None
    skipped = {}
    if cfg.exit_gate != "none" or exit_rule is not None:
        exits = ExitPolicy(threshold=exit_threshold, rule=exit_rule, skip=SKIP[cfg.backbone])
        exits.check(model, cfg.n_loops)
    for arm in arms:
        if arm != "plain" and exits is None:
            skipped[arm] = (f"exit_gate={cfg.exit_gate!r}: the model has no exit gate (a zero-shot --exit-rule "
                            "serves it)")
        elif arm == "exits_depthwise":
            why = depthwise_unsupported(model, exits)
            if why:
                skipped[arm] = why
    trace = make_trace(requests, cfg.vocab_size, prompt_len, new_tokens, seed=seed)
    runs = []
    for c in concurrency:
        for rep in range(repeats):  # arms round-robin: each repeat's ratios are paired in time
            for arm in arms:
                if arm not in skipped:
                    r = run_arm(model, trace, arm, c, exits, open_loop=False, check=check and rep == 0,
                                progress=progress)
                    runs.append({**r, "repeat": rep})
    if rate:
        open_trace = make_trace(requests, cfg.vocab_size, prompt_len, new_tokens, rate=rate, seed=seed)
        for arm in arms:
            if arm not in skipped:
                runs.append({**run_arm(model, open_trace, arm, max(concurrency), exits, open_loop=True, check=check,
                                       progress=progress), "repeat": 0})
    by = {(r["arm"], r["concurrency"], r["open_loop"], r["repeat"]): r for r in runs}
    summary = {}

    def paired(arm, c, key):
        xs = [by[(arm, c, False, k)][key] / by[("plain", c, False, k)][key] for k in range(repeats)
              if (arm, c, False, k) in by and ("plain", c, False, k) in by]
        return (statistics.median(xs), [min(xs), max(xs)]) if xs else (None, None)

    for c in concurrency:
        for arm in ("exits_lockstep", "exits_depthwise"):
            for key, name in (("output_tokens_per_s", ""), ("decode_tokens_per_s", "_decode")):
                med, rng = paired(arm, c, key)
                if med is not None:
                    summary[f"{arm}{name}_vs_plain_c{c}"] = med
                    summary[f"{arm}{name}_vs_plain_c{c}_range"] = rng
            if (arm, c, False, 0) in by:
                summary[f"{arm}_ideal_c{c}"] = cfg.n_loops / by[(arm, c, False, 0)]["mean_depth"]
        if c != 1 and ("plain", 1, False, 0) in by:
            xs = [by[("plain", c, False, k)]["output_tokens_per_s"] / by[("plain", 1, False, k)]["output_tokens_per_s"]
                  for k in range(repeats)]
            summary[f"plain_c{c}_vs_one_at_a_time"] = statistics.median(xs)
    mismatched = sum(r["solo_check"]["different"] for r in runs if "solo_check" in r)
    return {"model": {"backbone": cfg.backbone, "loops": cfg.n_loops, "layers": cfg.n_layers, "d_model": cfg.d_model,
                      "exit_gate": cfg.exit_gate, "exit_threshold": exit_threshold if exits else None,
                      "exit_rule": exits.rule_name if exits else None},
            "repeats": repeats,
            "trace": {"requests": requests, "prompt_len": list(prompt_len), "new_tokens": list(new_tokens),
                      "rate": rate, "seed": seed, "tokens": "uniform ids, no eos"},
            "skipped": skipped, "runs": runs, "summary": summary, "solo_differences": mismatched}


# ------------------------------------------------------------------ make bench's part
def bench_model(seed: int = 0, d_model: int = 512, n_layers: int = 2, vocab_size: int = 1024) -> LoopedLM:
    """A random-init exit-gated llama 2⊗4 (d 512, vocab 1024) whose gate spreads the exits over the loops
    (mean depth ≈ 2.1 of 4 at q = 0.5)."""
    torch.manual_seed(seed)
    m = LoopedLM(LoopedLMConfig(vocab_size=vocab_size, d_model=d_model, n_heads=4, n_layers=n_layers, n_loops=4,
                                max_seq_len=256, exit_gate="ouro")).eval()
    with torch.no_grad():
        m.exit_gate.proj.weight.normal_(0, 1 / d_model ** 0.5)
        m.exit_gate.proj.bias.fill_(-0.5)
    return m


def run(threads: int, quick: bool) -> dict[str, Any]:
    set_threads(threads)
    model = bench_model(d_model=128, n_layers=1) if quick else bench_model()
    res = serve_bench(model, concurrency=(1, 8) if quick else (1, 8, 32), requests=12 if quick else 64,
                      new_tokens=(4, 8) if quick else (8, 32), progress=False, repeats=1 if quick else 3)
    s = res["summary"]
    out = {**res, **s}
    for c in (8, 32):
        if f"exits_depthwise_vs_plain_c{c}" in s:
            out[f"depthwise_vs_plain_c{c}"] = s[f"exits_depthwise_vs_plain_c{c}"]
            out[f"depthwise_vs_plain_c{c}_range"] = s[f"exits_depthwise_vs_plain_c{c}_range"]
            out[f"depthwise_decode_vs_plain_c{c}"] = s[f"exits_depthwise_decode_vs_plain_c{c}"]
            out[f"depthwise_decode_vs_plain_c{c}_range"] = s[f"exits_depthwise_decode_vs_plain_c{c}_range"]
            out[f"lockstep_exits_vs_plain_c{c}"] = s[f"exits_lockstep_vs_plain_c{c}"]
            out[f"ideal_c{c}"] = s[f"exits_depthwise_ideal_c{c}"]
    return out


def parse_pair(ap: argparse.ArgumentParser, s: str, name: str) -> tuple[int, int]:
    """--NAME a,b (a length range, 1 <= a <= b); a bad value ends the command with ap.error naming it."""
    try:
        lo, hi = (int(x) for x in s.split(","))
    except ValueError:
        ap.error(f"--{name} {s!r}: give two integers a,b")
    if not 1 <= lo <= hi:
        ap.error(f"--{name} {s!r}: need 1 <= a <= b")
    return lo, hi


def parse_concurrency(ap: argparse.ArgumentParser, s: str) -> tuple[int, ...]:
    """--concurrency 1,8,32; a bad value ends the command with ap.error naming it."""
    try:
        conc = tuple(int(x) for x in s.split(","))
    except ValueError:
        ap.error(f"--concurrency {s!r}: give integers, e.g. 1,8,32")
    if any(c < 1 for c in conc):
        ap.error(f"--concurrency {s!r}: every concurrency must be >= 1")
    return conc


def main(argv=None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m looplab.bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", help="a training checkpoint (last.ckpt or a folder) or 'random' (make bench's model)")
    ap.add_argument("--concurrency", default="1,8,32", help="closed-loop concurrencies (default 1,8,32)")
    ap.add_argument("--rate", type=float, default=None, help="also an open-loop run: Poisson arrivals, requests/s")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--exit-threshold", type=float, default=0.5, help="the exit rule's threshold (gate: q)")
    ap.add_argument("--exit-rule", default=None, help="a registered exit rule instead of the gate (gate, kl, entropy, "
                    "..., or a researcher's dotted name, e.g. myideas.hidden_norm); see python -m looplab.models")
    ap.add_argument("--prompt-len", default="8,24")
    ap.add_argument("--new-tokens", default="8,32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1,
                    help="closed-loop runs per arm and concurrency, arms round-robin; ratios paired per repeat "
                         "(median and range); outputs checked on the first")
    ap.add_argument("--no-check", action="store_true", help="skip decoding every request alone to check the outputs")
    ap.add_argument("--out", default=os.path.join("bench", "serve.json"))
    a = ap.parse_args(argv)
    conc = parse_concurrency(ap, a.concurrency)
    if a.repeats < 1:
        ap.error(f"--repeats {a.repeats}: must be >= 1")
    if a.rate is not None and a.rate <= 0:
        ap.error(f"--rate {a.rate}: must be > 0")
    set_threads(a.threads)
    if a.ckpt == "random":
        model = bench_model(a.seed)
    else:
        from looplab.checkpoint import load_model

        model, _ = load_model(a.ckpt)
        model.eval()
    res = serve_bench(model, concurrency=conc, requests=a.requests, rate=a.rate, exit_threshold=a.exit_threshold,
                      prompt_len=parse_pair(ap, a.prompt_len, "prompt-len"),
                      new_tokens=parse_pair(ap, a.new_tokens, "new-tokens"),
                      seed=a.seed, check=not a.no_check, repeats=a.repeats, exit_rule=a.exit_rule)
    res["machine"] = machine_info(a.threads)
    res["ckpt"] = a.ckpt
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    for r in res["runs"]:
        chk = r.get("solo_check", {})
        print(f"{r['arm']:<16} c={r['concurrency']:<3} #{r['repeat']}{' open' if r['open_loop'] else '     '} "
              f"{r['output_tokens_per_s']:9.1f} tok/s  ttft p50 {r['ttft_p50_s']:.4f}s  token p50 "
              f"{(r['token_latency_p50_s'] or 0):.4f}s p99 {(r['token_latency_p99_s'] or 0):.4f}s  "
              f"decode {r['decode_tokens_per_s']:.1f} tok/s  prefill {r['prefill_share']:.0%}  depth "
              f"{r['mean_depth']:.2f}  cache {r['peak_cache_bytes'] / 1e6:.2f} MB  solo {chk}")
    for k, v in res["summary"].items():
        print(f"{k:<40} " + (f"{v[0]:.3f} – {v[1]:.3f}" if isinstance(v, list) else f"{v:.3f}"))
    for arm, why in res["skipped"].items():
        print(f"{arm}: not run ({why})")
    print(f"wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
