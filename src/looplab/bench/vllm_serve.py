"""vLLM serving a looplab model, side by side (docs/vllm.md#speed). Run with the vLLM venv's python:

    scripts/vllm-venv
    .venvs/vllm/bin/python -m looplab.bench.vllm_serve [--concurrency 1,8,32] [--requests 64] [--out FILE.json]

Not imported by `python -m looplab.bench` (the main venv has no vLLM). One trace (looplab.bench.serve.make_trace:
prompts of 8–24 tokens, 8–32 new tokens, uniform ids, no eos), greedy, closed loop at each concurrency c (c
requests outstanding; a finished one is replaced by the next at once). Arms, all in float32 on the same threads:

    looplab_engine     looplab.serve.Engine, plain continuous batching (every loop for every token)
    vllm_looped        vLLM with looplab's plugin on the `convert to-hf` folder of the same model
    vllm_unrolled      vLLM's own LlamaForCausalLM on the same model unrolled (`convert to-hf --transformers`:
                       P + N·R + C layers, the shared weights stored R times): the same compute, no loop
    vllm_exit_plain / vllm_exit_q / vllm_exit_skip
                       an exit-gated copy of the model in vLLM, read at the last loop / at each token's exit
                       depth (hf_overrides exit_threshold=q; every loop runs) / at its exit depth with the later
                       loops skipped (exit_skip=kv_copy: docs/vllm.md#exits-that-skip-compute)
    looplab_engine_exit_depthwise
                       the exit-gated model in looplab.serve.Engine, depth-wise batching with kv_copy at q
    vllm_depth_R1 … vllm_depth_RR  (--arms vllm_depths; not in the default set)
                       the exit-gated copy with every token at R′ loops (hf_overrides n_loops=R′): what a step of R′
                       loops costs, from which follows what each schedule of the skipping exits could reach on this
                       engine (summary.depth_batching; looplab.bench.depth_ceiling)
    looplab_engine_parallel / vllm_parallel / vllm_parallel_unfolded  (--arms; not in the default set)
                       the same weights under loop_schedule=parallel (loop_kv=own: the same compute per token), in
                       looplab.serve.Engine (its folded step: the R loops of a token in one block call) and in vLLM:
                       decoding steps folded as well (the plugin's default), or loop after loop
                       (hf_overrides parallel_fold=false; docs/vllm.md#parallel-loops)

Reported per run: output tokens/s, wall time, and for vLLM the engine's start-up time; with --repeats K each arm
runs each concurrency K times (the engine started once) and the ratios use the best of the K (other processes
on the machine only ever slow a run down), the median beside it. The greedy tokens of every
vLLM arm are compared with looplab.serve.Engine's (token agreement per arm); for the exit arms, the mean exit depth
(from looplab's forward on the generated sequences) says what an exit that skips the later loops could save at
most (R / mean depth, the ideal), for the read-only exits and for the skipping ones.

With --checkpoint CKPT every arm serves a trained model instead (`checkpoint_models`: a checkpoint with an exit gate,
e.g. exit-aware fine-tuned and then its gate's stage 2; docs/vllm.md#speed), the trace's prompts are its test
windows' first tokens, and `exits.quality` gives its teacher-forced perplexity with every loop, with the exits at q
and with the exits at q skipping (kv_copy), so the quality at q is stated beside the speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# before vLLM is imported (each vLLM arm runs in a child process of its own): the engine core inside that process,
# a small KV cache
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import torch  # noqa: E402

from looplab.bench.common import machine_info  # noqa: E402
from looplab.bench.depth_ceiling import ceilings, depth_counts, simulate_adaptive  # noqa: E402
from looplab.bench.serve import make_trace, run_arm  # noqa: E402
from looplab.models import LoopedLM, LoopedLMConfig  # noqa: E402
from looplab.models.exits import ExitPolicy  # noqa: E402


def bench_models(d_model: int = 512, n_layers: int = 2, n_loops: int = 4, vocab_size: int = 1024, seed: int = 0):
    """The plain llama N⊗R (d 512, 4 heads of 128) and an exit-gated copy (same weights, a gate whose exits spread
    over the loops, as looplab.bench.serve.bench_model's)."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab_size, d_model=d_model, n_heads=d_model // 128, n_layers=n_layers, n_loops=n_loops,
               max_seq_len=256)
    plain = LoopedLM(LoopedLMConfig(**cfg)).eval()
    gated = LoopedLM(LoopedLMConfig(**cfg, exit_gate="ouro")).eval()
    missing, _ = gated.load_state_dict(plain.state_dict(), strict=False)
    assert all(k.startswith("exit_gate.") for k in missing), missing
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        gated.exit_gate.proj.weight.copy_(torch.randn(gated.exit_gate.proj.weight.shape, generator=g) / d_model ** 0.5)
        gated.exit_gate.proj.bias.fill_(-0.5)
    return plain, gated


def checkpoint_models(ckpt: str, requests: int, prompt_len, new_tokens, exit_threshold: float, seed: int = 0,
                      n_windows: int = 64):
    """A trained checkpoint with an exit gate (exit-aware fine-tuning, then the gate's stage 2), its plain copy (the same
    weights without the gate: what every loop gives), a trace from its test windows, and its quality beside the speed
    (table 14's teacher-forced perplexity on the first n_windows test windows: every loop, the exits at q, the exits
    at q with kv_copy skipping), so that a speed-up is read with what it costs."""
    from looplab.bench.depth_under_load import make_trace as text_trace
    from looplab.bench.depth_under_load import quality, windows
    from looplab.checkpoint import load_model

    gated, meta = load_model(ckpt, map_location="cpu")
    gated.eval()
    if gated.exit_gate is None:
        raise SystemExit(f"--checkpoint {ckpt}: the model has no exit gate (exit_gate={gated.config.exit_gate!r}); the "
                         "exit arms read one: train its stage 2 (exit_gate=ouro exit_gate.stage=stage2 exit_gate.init_from=...)")
    plain = LoopedLM(LoopedLMConfig(**{**gated.config.architecture_dict(), "exit_gate": "none"})).eval()
    _, unexpected = plain.load_state_dict(gated.state_dict(), strict=False)
    assert all(k.startswith("exit_gate.") for k in unexpected), unexpected
    ids, tgt = windows(meta, max(requests, n_windows))
    trace = text_trace(ids, requests, prompt_len, new_tokens, seed)
    q_ids, q_tgt = ids[:n_windows], tgt[:n_windows]
    qual = {"windows": n_windows, "all_loops": quality(gated, q_ids, q_tgt),
            "exits": quality(gated, q_ids, q_tgt, ExitPolicy(threshold=exit_threshold)),
            "exits_skip": quality(gated, q_ids, q_tgt, ExitPolicy(threshold=exit_threshold, skip="kv_copy"))}
    for k in ("exits", "exits_skip"):
        qual[k]["perplexity_ratio"] = qual[k]["perplexity"] / qual["all_loops"]["perplexity"]
    return plain, gated, trace, qual


def parallel_copy(plain: LoopedLM) -> LoopedLM:
    """The same weights under loop_schedule=parallel, loop_kv=own (a different model: loop r reads loop r − 1 one
    token back)."""
    par = LoopedLM(LoopedLMConfig(**{**plain.config.architecture_dict(), "loop_schedule": "parallel"})).eval()
    par.load_state_dict(plain.state_dict(), strict=True)
    return par


def vllm_closed_loop(llm, trace: list[dict], concurrency: int) -> dict[str, Any]:
    """The trace through vLLM's engine with `concurrency` requests outstanding (LLMEngine.add_request / step)."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    queue = list(enumerate(trace))
    out: dict[int, list[int]] = {}
    outstanding = 0

    def submit():
        nonlocal outstanding
        i, r = queue.pop(0)
        sp = SamplingParams(max_tokens=r["max_new_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
        eng.add_request(str(i), {"prompt_token_ids": r["prompt"]}, sp)
        outstanding += 1

    t0 = time.perf_counter()
    while queue and outstanding < concurrency:
        submit()
    while outstanding:
        for o in eng.step():
            if o.finished:
                out[int(o.request_id)] = list(o.outputs[0].token_ids)
                outstanding -= 1
                if queue:
                    submit()
    wall = time.perf_counter() - t0
    tokens = sum(len(v) for v in out.values())
    return {"concurrency": concurrency, "requests": len(out), "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tokens_per_s": tokens / wall, "tokens": [out[i] for i in range(len(trace))]}


def start_vllm(folder, max_num_seqs: int, eager: bool, **kw):
    from vllm import LLM

    t = time.perf_counter()
    llm = LLM(model=str(folder), dtype="float32", skip_tokenizer_init=True, max_model_len=256, seed=0,
              max_num_seqs=max_num_seqs, enforce_eager=eager, **kw)
    return llm, time.perf_counter() - t


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    same = sum(x == y for x, y in zip(a, b))
    first = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None) for x, y in zip(a, b)]
    return {"requests_equal": same, "requests": len(a),
            "first_difference_at": sorted(i for i in first if i is not None)[:5]}


def run(concurrency=(1, 8, 32), requests: int = 64, prompt_len=(8, 24), new_tokens=(8, 32), threads: int = 1,
        eager: bool = False, exit_threshold: float = 0.5, seed: int = 0, work: str | None = None, repeats: int = 1,
        arms=("looplab_engine", "vllm_looped", "vllm_unrolled", "vllm_exit"), checkpoint: str | None = None) -> dict[str, Any]:
    from looplab.convert import to_transformers
    from looplab.remote_code import write_folder

    torch.set_num_threads(threads)
    quality = None
    if checkpoint:
        plain, gated, trace, quality = checkpoint_models(checkpoint, requests, prompt_len, new_tokens, exit_threshold,
                                                         seed)
    else:
        plain, gated = bench_models(seed=seed)
        trace = make_trace(requests, plain.config.vocab_size, prompt_len, new_tokens, seed=seed)
    work = Path(work or tempfile.mkdtemp(prefix="looplab-vllm-bench-"))
    runs: list[dict] = []
    par = parallel_copy(plain) if {"looplab_engine_parallel", "vllm_parallel", "vllm_parallel_unfolded"} & set(arms) \
        else None
    for arm, model in (("looplab_engine", plain), ("looplab_engine_parallel", par)):
        if arm not in arms:
            continue
        for c in concurrency:
            for k in range(repeats):
                r = run_arm(model, trace, "plain", c, None, open_loop=False, check=False, progress=False)
                runs.append({"arm": arm, "concurrency": c, "repeat": k, "wall_s": r["wall_s"],
                             "output_tokens_per_s": r["output_tokens_per_s"], "output_tokens": r["output_tokens"]})
    # looplab's own greedy tokens per request (the Engine's equal decoding alone: looplab.serve.solo_agreement)
    from looplab.models.generation import generate

    want = [generate(plain, torch.tensor([r["prompt"]]), r["max_new_tokens"])[0, len(r["prompt"]):].tolist()
            for r in trace]
    folders = {"vllm_looped": work / "looped", "vllm_unrolled": work / "unrolled", "vllm_exit": work / "gated"}
    write_folder(plain, folders["vllm_looped"])
    to_transformers(plain, folders["vllm_unrolled"], log=lambda *_: None)
    write_folder(gated, folders["vllm_exit"])
    startup = {}
    exits = {}
    plans = [(arm, folders[arm], None, want) for arm in ("vllm_looped", "vllm_unrolled") if arm in arms]
    if {"vllm_parallel", "vllm_parallel_unfolded"} & set(arms):
        folders["vllm_parallel"] = work / "parallel"
        write_folder(par, folders["vllm_parallel"], engine="vllm")
        want_par = [generate(par, torch.tensor([r["prompt"]]), r["max_new_tokens"])[0, len(r["prompt"]):].tolist()
                    for r in trace]
        plans += [(arm, folders["vllm_parallel"], over, want_par) for arm, over in
                  (("vllm_parallel", None), ("vllm_parallel_unfolded", {"parallel_fold": False})) if arm in arms]
    if {"vllm_exit", "vllm_depths"} & set(arms):
        skip = ExitPolicy(threshold=exit_threshold, skip="kv_copy")
        for c in concurrency if "vllm_exit" in arms else ():
            for k in range(repeats):
                r = run_arm(gated, trace, "exits_depthwise", c, skip, open_loop=False, check=False, progress=False)
                runs.append({"arm": "looplab_engine_exit_depthwise", "concurrency": c, "repeat": k,
                             "wall_s": r["wall_s"], "output_tokens_per_s": r["output_tokens_per_s"],
                             "output_tokens": r["output_tokens"]})
        pol = ExitPolicy(threshold=exit_threshold)
        want_plain = [generate(gated, torch.tensor([r["prompt"]]), r["max_new_tokens"])[0, len(r["prompt"]):].tolist()
                      for r in trace]
        want_exit = [generate(gated, torch.tensor([r["prompt"]]), r["max_new_tokens"], exits=pol)[0,
                     len(r["prompt"]):].tolist() for r in trace]
        depths = []
        with torch.no_grad():
            for r, toks in zip(trace, want_exit):
                depths += gated(torch.tensor([r["prompt"] + toks]), exits=pol).exit_steps[0, -len(toks) - 1:-1].tolist()
        want_skip = [generate(gated, torch.tensor([r["prompt"]]), r["max_new_tokens"], exits=skip)[0,
                     len(r["prompt"]):].tolist() for r in trace]
        skip_depths = []  # every token's, the prompt's too: under skipping a prompt token stops at its exit as well
        with torch.no_grad():
            for r, toks in zip(trace, want_skip):
                skip_depths += gated(torch.tensor([r["prompt"] + toks[:-1]]), exits=skip).exit_steps[0].tolist()
        R = gated.config.n_loops
        mean_depth = sum(depths) / len(depths)
        mean_skip = sum(skip_depths) / len(skip_depths)
        exits = {"threshold": exit_threshold, "mean_exit_depth": mean_depth, "loops": R,
                 "ideal_speedup_if_later_loops_were_skipped": R / mean_depth,
                 "skip": {"handling": "kv_copy", "mean_exit_depth_all_tokens": mean_skip,
                          "ideal_block_speedup": R / mean_skip, "depth_counts": depth_counts(skip_depths)}}
        if quality:
            exits["quality"] = quality
        if "vllm_exit" in arms:
            plans += [("vllm_exit_plain", folders["vllm_exit"], None, want_plain),
                      ("vllm_exit_q", folders["vllm_exit"], {"exit_threshold": exit_threshold}, want_exit),
                      ("vllm_exit_skip", folders["vllm_exit"],
                       {"exit_threshold": exit_threshold, "exit_skip": "kv_copy"}, want_skip)]
        if "vllm_depths" in arms:
            # every token at R' loops, R' = 1 .. R: what a step of R' loops costs on this engine, from which follows
            # what each schedule of the exits above could buy (bench.depth_ceiling)
            plans += [(f"vllm_depth_R{k}", folders["vllm_exit"], {"n_loops": k},
                       [generate(plain, torch.tensor([r["prompt"]]), r["max_new_tokens"], n_loops=k)[0,
                        len(r["prompt"]):].tolist() for r in trace]) for k in range(1, R + 1)]
    (work / "trace.json").write_text(json.dumps(trace))
    for arm, folder, over, w in plans:
        # each vLLM engine in a process of its own, as a server has it: vLLM's compilation traces the model's forward
        # once per process and drops Dynamo's guards, so a second model of the class in one process could reuse the
        # first one's code; and vLLM binds a process's threads to cores
        out = work / f"{arm}.json"
        cmd = [sys.executable, "-m", "looplab.bench.vllm_serve", "--_arm", str(folder), "--_trace", str(work / "trace.json"),
               "--_result", str(out), "--concurrency", ",".join(map(str, concurrency)), "--threads", str(threads),
               "--repeats", str(repeats)]
        if over:
            cmd += ["--_overrides", json.dumps(over)]
        if eager:
            cmd.append("--eager")
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        res = json.loads(out.read_text())
        startup[arm] = res["startup_s"]
        for r in res["runs"]:
            r["agreement_with_looplab"] = agreement(r.pop("tokens"), w)
            runs.append({"arm": arm, **r})
    import statistics

    per: dict[tuple, list[float]] = {}
    for r in runs:
        per.setdefault((r["arm"], r["concurrency"]), []).append(r["output_tokens_per_s"])
    best = {k: max(v) for k, v in per.items()}  # other processes only ever slow a run down: best of the repeats
    tokens_per_s = {f"{a}_c{c}": {"best": max(v), "median": statistics.median(v), "all": v}
                    for (a, c), v in per.items()}
    summary = {}
    for c in concurrency:
        for a, b in (("vllm_looped", "looplab_engine"), ("vllm_looped", "vllm_unrolled"),
                     ("vllm_exit_q", "vllm_exit_plain"), ("vllm_exit_plain", "vllm_looped"),
                     ("vllm_exit_skip", "vllm_exit_plain"), ("vllm_exit_skip", "vllm_exit_q"),
                     ("vllm_exit_skip", "looplab_engine_exit_depthwise"),
                     ("vllm_parallel", "looplab_engine_parallel"), ("vllm_parallel", "vllm_looped"),
                     ("vllm_parallel", "vllm_parallel_unfolded"), ("vllm_parallel_unfolded", "vllm_looped"),
                     ("looplab_engine_parallel", "looplab_engine")):
            if (a, c) in best and (b, c) in best:
                summary[f"{a}_vs_{b}_c{c}"] = best[(a, c)] / best[(b, c)]
    if "vllm_depths" in arms:
        summary["depth_batching"] = depth_batching(best, exits, concurrency)
    cfg = plain.config
    return {"model": {"backbone": cfg.backbone, "layers": cfg.n_layers, "loops": cfg.n_loops, "d_model": cfg.d_model,
                      "n_heads": cfg.n_heads, "vocab_size": cfg.vocab_size, "dtype": "float32",
                      "checkpoint": checkpoint, "weights": "trained" if checkpoint else "random, seeded"},
            "trace": {"requests": requests, "prompt_len": list(prompt_len), "new_tokens": list(new_tokens),
                      "seed": seed, "tokens": "test windows' first tokens, no eos" if checkpoint else "uniform ids, no eos"},
            "vllm": {"eager": eager, "startup_s": startup, "version": _version("vllm-cpu"),
                     "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE")},
            "threads": threads, "repeats": repeats, "exits": exits, "tokens_per_s": tokens_per_s, "runs": runs,
            "summary": summary}


ARMS = {"looplab_engine", "vllm_looped", "vllm_unrolled", "vllm_exit", "vllm_depths", "looplab_engine_parallel",
        "vllm_parallel", "vllm_parallel_unfolded"}


ADAPTIVE = (0.1, 0.2, 0.3, 0.4, 0.5)  # keep_looping fractions of bench.depth_ceiling.simulate_adaptive


def depth_batching(best: dict[tuple, float], exits: dict, concurrency) -> dict[str, Any]:
    """Per concurrency, what each schedule of the skipping exits could reach from the `vllm_depth_R*` arms' measured
    costs (bench.depth_ceiling), beside the skipping arm's measured speed-up where it ran."""
    R, counts = exits["loops"], exits["skip"]["depth_counts"]
    out = {}
    for c in concurrency:
        t = {k: 1.0 / best[(f"vllm_depth_R{k}", c)] for k in range(1, R + 1)}
        est = ceilings(t, counts, c)
        est["adaptive"] = {k: t[R] / simulate_adaptive(counts, c, t, k, passes=5000) for k in ADAPTIVE}
        if ("vllm_exit_skip", c) in best:
            est["in_step"]["measured_speedup"] = best[("vllm_exit_skip", c)] / best[(f"vllm_depth_R{R}", c)]
        out[f"c{c}"] = est
    return out


def _version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def serve_arm(folder: str, trace_file: str, result: str, concurrency, eager: bool, threads: int,
              overrides: dict | None, repeats: int = 1) -> None:
    """One vLLM arm (a child process of `run`): start the engine, run the trace at each concurrency."""
    torch.set_num_threads(threads)
    trace = json.loads(Path(trace_file).read_text())
    llm, startup = start_vllm(folder, max(concurrency), eager, **({"hf_overrides": overrides} if overrides else {}))
    runs = [{**vllm_closed_loop(llm, trace, c), "repeat": k} for c in concurrency for k in range(repeats)]
    Path(result).write_text(json.dumps({"startup_s": startup, "runs": runs}))


def main(argv=None) -> dict[str, Any]:
    from looplab.bench.serve import parse_concurrency, parse_pair

    ap = argparse.ArgumentParser(prog="python -m looplab.bench.vllm_serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", default="8,24")
    ap.add_argument("--new-tokens", default="8,32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--exit-threshold", type=float, default=0.5)
    ap.add_argument("--eager", action="store_true", help="vLLM without torch.compile (enforce_eager)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per arm and concurrency (best and median reported)")
    ap.add_argument("--arms", default="looplab_engine,vllm_looped,vllm_unrolled,vllm_exit")
    ap.add_argument("--checkpoint", default=None, help="a trained looplab checkpoint with an exit gate (exit-aware "
                    "fine-tuned, then its gate): its weights, its test text as the trace, and its perplexity at q beside "
                    "the speed (default: random seeded weights, d 512)")
    ap.add_argument("--out", default=os.path.join("bench", "vllm_serve.json"))
    for hidden in ("--_arm", "--_trace", "--_result", "--_overrides"):  # a child process's one vLLM arm
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    unknown = sorted(set(a.arms.split(",")) - ARMS)
    if unknown:
        ap.error(f"--arms: unknown arm(s) {unknown}; known: {', '.join(sorted(ARMS))}")
    if a._arm:
        serve_arm(a._arm, a._trace, a._result, parse_concurrency(ap, a.concurrency), a.eager, a.threads,
                  json.loads(a._overrides) if a._overrides else None, a.repeats)
        return {}
    t0 = time.perf_counter()
    res = run(parse_concurrency(ap, a.concurrency), a.requests, parse_pair(ap, a.prompt_len, "prompt-len"),
              parse_pair(ap, a.new_tokens, "new-tokens"), a.threads, a.eager, a.exit_threshold,
              arms=tuple(a.arms.split(",")), repeats=a.repeats, checkpoint=a.checkpoint)
    res["machine"] = machine_info(a.threads)
    res["total_s"] = round(time.perf_counter() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    for r in res["runs"]:
        agree = r.get("agreement_with_looplab")
        print(f"{r['arm']:<16} c={r['concurrency']:<3} #{r['repeat']} {r['output_tokens_per_s']:9.1f} tok/s  wall "
              f"{r['wall_s']:7.2f}s" + (f"  equal to looplab {agree['requests_equal']}/{agree['requests']}" if agree else ""))
    for k, v in res["tokens_per_s"].items():
        print(f"{k:<24} best {v['best']:8.1f}  median {v['median']:8.1f} tok/s")
    for k, v in res["summary"].items():
        if k != "depth_batching":
            print(f"{k:<45} {v:.3f}")
    for c, est in res["summary"].get("depth_batching", {}).items():
        across = " ".join(f"L{L} {e['speedup']:.2f}x" for L, e in est["across_steps"].items())
        measured = est["in_step"].get("measured_speedup")
        fixed = est["fit"]["fixed_share_of_a_step"]
        print(f"depth batching {c}: a step beside its loops {fixed:.0%} of an every-loop step; over every loop: perfect "
              f"{est['perfect']['speedup']:.2f}x, in-step {est['in_step']['speedup']:.2f}x"
              + (f" (measured {measured:.2f}x)" if measured else "") + f", across steps {across}, adaptive "
              + " ".join(f"{k} {x:.2f}x" for k, x in est["adaptive"].items()))
    if res["exits"]:
        print(f"exits: {res['exits']}")
    print(f"vLLM start-up (s): {res['vllm']['startup_s']}")
    print(f"wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
