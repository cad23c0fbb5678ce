"""Training-step benchmark (issue 9): looped llama N⊗R vs `transformers` Llama with N·R layers.

One training step = forward, next-token cross-entropy, backward, AdamW step, zero_grad.
Candidates are built with the same width, heads, FFN, vocabulary and sequence, so they do
the same FLOPs per token; they are timed round-robin in one process (common.py), together
with the fp32 `torch.mm` 2048³ ceiling, so MFU and ratios see the same machine load:

- `looplab`       LoopedLM N⊗R as `python -m looplab.train` runs it: eager, fused AdamW
- `transformers`  LlamaForCausalLM with N·R distinct layers (SDPA attention), the same fused AdamW
- `unlooped`      LoopedLM (N·R)⊗1: the same code without weight sharing
- options, each a copy of `looplab` with one change: foreach AdamW, the math SDPA backend,
  per-loop activation checkpointing, `torch.compile` of every block layer (`compile=true`:
  compiled once, reused by all R loops; needs a C++ toolchain on CPU — an error is recorded).

MFU divides by the matmul ceiling measured right before and after each timed step
(common.time_side_by_side): this VM's matmul speed drifts by ±25% within seconds.
`best` is the fastest looplab configuration measured, with its name.

Peak memory runs in fresh subprocesses (see common.py for why RSS): one training step's
peak resident memory above the RSS before the model was built (parameters, gradients,
AdamW state, activations, temporaries), for R = 1, 2, 4, 8 with and without checkpointing.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import time

import torch
import torch.nn.functional as F

from looplab.bench import common
from looplab.models import LoopedLM, LoopedLMConfig

# The issue's anchor config: d 512, 8 heads, FFN 1408, vocab 8192, N 4, R 4, T 256, batch 8.
FULL = dict(vocab=8192, d_model=512, n_heads=8, ffn=1408, n_layers=4, n_loops=4, seq_len=256, batch=8)
QUICK = dict(vocab=256, d_model=64, n_heads=4, ffn=192, n_layers=2, n_loops=2, seq_len=32, batch=2)
MEMORY_LOOPS = (1, 2, 4, 8)


# ------------------------------------------------------------------ models
def looplab_model(d: dict, n_layers: int | None = None, n_loops: int | None = None) -> LoopedLM:
    cfg = LoopedLMConfig(
        vocab_size=d["vocab"], d_model=d["d_model"], n_heads=d["n_heads"], ffn_hidden=d["ffn"],
        n_layers=n_layers or d["n_layers"], n_loops=n_loops or d["n_loops"], max_seq_len=d["seq_len"],
    )
    return LoopedLM(cfg)


def transformers_model(d: dict, n_layers: int) -> torch.nn.Module:
    """`LlamaForCausalLM` built from a config (no download) with looplab's dims and no biases/tying."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=d["vocab"], hidden_size=d["d_model"], intermediate_size=d["ffn"], num_hidden_layers=n_layers,
        num_attention_heads=d["n_heads"], num_key_value_heads=d["n_heads"], max_position_embeddings=d["seq_len"],
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def compile_layers(model: LoopedLM) -> None:
    """`torch.compile` every layer of the looped block in place; the R loops reuse the compiled code."""
    for layer in model.block:
        layer.compile(dynamic=False)


def issue_formula_flops(model: LoopedLM, seq_len: int) -> int:
    """Issue 9's training FLOPs/token: 6·(matmul params, block counted R times) + 12·L_eff·d·T + LM head."""
    cfg = model.config
    block = sum(p.numel() for p in model.block.parameters() if p.dim() == 2)
    head = model.head.weight.numel()
    return 6 * (cfg.n_loops * block + head) + 12 * cfg.n_layers * cfg.n_loops * cfg.d_model * seq_len


# ------------------------------------------------------------------- steps
def make_step(model: torch.nn.Module, d: dict, *, hf: bool = False, fused: bool = True, seed: int = 0):
    """A closure running one full training step on fixed random tokens (fused AdamW unless fused=False: foreach)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, d["vocab"], (d["batch"], d["seq_len"] + 1), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if fused else {"foreach": True}))
    V = d["vocab"]

    def step() -> None:
        out = model(input_ids=x) if hf else model(x)
        loss = F.cross_entropy(out.logits.view(-1, V), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt


# ------------------------------------------------------------------ memory
def probe(spec: dict) -> dict:
    """Run inside a fresh process: peak RSS of one training step of the model in `spec`."""
    d, hf = spec["dims"], spec["model"] == "transformers"
    tiny = dict(QUICK, vocab=16, d_model=16, n_heads=2, ffn=32, seq_len=4, batch=1)

    def build(dims: dict) -> torch.nn.Module:
        if hf:
            return transformers_model(dims, spec["n_layers"])
        m = looplab_model(dims, spec["n_layers"], spec["n_loops"])
        m.checkpoint_loops = bool(spec.get("checkpoint", False))
        return m

    # one tiny step first, so lazily loaded code (transformers modules, oneDNN, autograd,
    # checkpointing) is resident before the baseline and not counted as training memory
    make_step(build(tiny), tiny, hf=hf)[0]()
    gc.collect()
    rss0 = common.current_rss_mb()
    model = build(d)
    step, opt = make_step(model, d, hf=hf)
    for p in model.parameters():  # allocate AdamW state up front: steady-state memory, not a spike
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    rss_setup = common.current_rss_mb()
    exact = common.reset_peak_rss()
    step()
    peak = common.peak_rss_mb()
    return {
        "peak_mb": round(peak - rss0, 1),  # everything the training needs at its peak
        "step_extra_mb": round(peak - rss_setup, 1),  # activations + gradients + temporaries
        "state_mb": round(rss_setup - rss0, 1),  # parameters + AdamW moments
        "peak_method": "VmHWM reset via /proc/self/clear_refs" if exact else "ru_maxrss (process lifetime)",
    }


def memory_entries(d: dict, threads: int, quick: bool = False) -> dict:
    N, R, L = d["n_layers"], d["n_loops"], d["n_layers"] * d["n_loops"]
    specs = {"transformers": dict(model="transformers", n_layers=L, dims=d)}
    if not quick:
        specs["unlooped"] = dict(model="looplab", n_layers=L, n_loops=1, dims=d)
    for ckpt in (False, True):
        for r in ((R,) if quick else MEMORY_LOOPS):
            key = f"looplab_R{r}" + ("_checkpoint" if ckpt else "")
            specs[key] = dict(model="looplab", n_layers=N, n_loops=r, checkpoint=ckpt, dims=d)
    # RSS does not depend on CPU load, so tiny probes may run side by side; full-size ones take GBs each
    return common.run_probes("looplab.bench.train", specs, threads, parallel=len(specs) if quick else 1)


# -------------------------------------------------------------------- run
def run(threads: int = 2, quick: bool = False, *, repeats: int | None = None, options: bool = True,
        compile: bool | None = None, memory: bool = True) -> dict:
    common.set_threads(threads)
    d = dict(QUICK if quick else FULL)
    repeats = repeats or (2 if quick else 7)
    compile = (not quick) if compile is None else compile
    N, R, T, B = d["n_layers"], d["n_loops"], d["seq_len"], d["batch"]
    torch.manual_seed(0)

    base = looplab_model(d)
    candidates = {
        "looplab": make_step(base, d)[0],
        "transformers": make_step(transformers_model(d, N * R), d, hf=True)[0],
    }
    option_info: dict = {}
    if options and compile:  # next to the reference: the pairing `best` usually uses
        comp = copy.deepcopy(base)
        compile_layers(comp)
        comp_step = make_step(comp, d)[0]
        t0 = time.perf_counter()
        try:
            comp_step()  # compiles forward and backward graphs once
            option_info["opt_compile"] = {"compile_s": round(time.perf_counter() - t0, 1)}
            candidates["opt_compile"] = comp_step
        except Exception as e:  # noqa: BLE001 — CPU inductor needs a C++ toolchain; record why
            option_info["opt_compile"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    candidates["unlooped"] = make_step(looplab_model(d, N * R, 1), d)[0]
    if options:
        candidates["opt_foreach_adamw"] = make_step(copy.deepcopy(base), d, fused=False)[0]

        ckpt = copy.deepcopy(base)
        ckpt.checkpoint_loops = True
        candidates["opt_checkpoint_loops"] = make_step(ckpt, d)[0]

        from torch.nn.attention import SDPBackend, sdpa_kernel

        math_step = make_step(copy.deepcopy(base), d)[0]

        def sdpa_math() -> None:
            with sdpa_kernel(SDPBackend.MATH):
                math_step()

        candidates["opt_sdpa_math"] = sdpa_math
    cpu: dict = {}
    local: dict = {}
    probe_mm = common.matmul_probe(256 if quick else 2048)
    times = common.time_side_by_side(candidates, warmup=1, repeats=repeats, cpu_times=cpu,
                                     ceiling=probe_mm, local_ceilings=local)
    med = {k: common.median(v) for k, v in times.items()}
    all_ceilings = [c for v in local.values() for c in v]
    ceiling = common.median(all_ceilings)
    fpt = base.flops_per_token(T, training=True)
    tok = {k: B * T / s for k, s in med.items()}

    def mfu(k: str) -> float:
        """Median over calls of achieved FLOP/s / the ceiling measured around that call."""
        return common.median([B * T * fpt / t / (c * 1e9) for t, c in zip(times[k], local[k])])

    def paired(other: str, t: dict, base: str = "looplab") -> float:
        """Median over rounds of other/looplab: the two run back to back within a round, so a load
        change between rounds cancels (steadier than a ratio of medians on a shared machine)."""
        return common.median([o / s for o, s in zip(t[other], t[base])])

    res = {
        "config": dict(d, model=f"{N}x{R}"),
        "tokens_per_s": tok["looplab"],
        "ratio_vs_transformers": paired("transformers", times),
        "ratio_vs_unlooped": paired("unlooped", times),
        "mfu": mfu("looplab"),
        "transformers_tokens_per_s": tok["transformers"],
        "transformers_mfu": mfu("transformers"),
        "unlooped_tokens_per_s": tok["unlooped"],
        "unlooped_mfu": mfu("unlooped"),
        "matmul_gflops": ceiling,
        "matmul_gflops_range": [min(all_ceilings), max(all_ceilings)],
        "mfu_vs_median_ceiling": tok["looplab"] * fpt / (ceiling * 1e9),
        "flops_per_token": fpt,
        "flops_per_token_issue_formula": issue_formula_flops(base, T),
        # the same ratio from CPU seconds: steadier when other jobs share the cores (see common.py)
        "ratio_vs_transformers_cpu_time": paired("transformers", cpu),
        "ratio_vs_unlooped_cpu_time": paired("unlooped", cpu),
        "step_s": {k: [round(t, 4) for t in v] for k, v in times.items()},
        "step_cpu_s": {k: [round(t, 4) for t in v] for k, v in cpu.items()},
        "ceiling_gflops": {k: [round(c, 1) for c in v] for k, v in local.items()},
        "repeats": repeats,
    }
    opts = {}
    for k in tok:
        if k.startswith("opt_"):
            opts[k[4:]] = {"tokens_per_s": tok[k], "speedup_vs_default": paired("looplab", times, base=k), "mfu": mfu(k),
                           "speedup_vs_default_cpu_time": paired("looplab", cpu, base=k),
                           **option_info.get(k, {})}
    for k, v in option_info.items():
        if "error" in v:
            opts[k[4:]] = v
    if opts:
        res["options"] = opts
    # the fastest looplab configuration (every option computes the same training step)
    best = max((k for k in tok if k == "looplab" or k.startswith("opt_")), key=lambda k: tok[k])
    res["best"] = {
        "config": "default" if best == "looplab" else best[4:],
        "tokens_per_s": tok[best],
        "ratio_vs_transformers": paired("transformers", times, base=best),
        "ratio_vs_transformers_cpu_time": paired("transformers", cpu, base=best),
        "mfu": mfu(best),
    }
    del candidates, base
    gc.collect()
    if memory:
        mem = memory_entries(d, threads, quick)
        res["memory_mb"] = mem
        ref, own = mem["transformers"].get("peak_mb"), mem[f"looplab_R{R}"].get("peak_mb")
        if ref and own:
            res["peak_memory_mb"] = own
            res["peak_memory_ratio_vs_transformers"] = own / ref
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="looplab training-step benchmark (also the memory probe)")
    ap.add_argument("--probe", help="internal: JSON spec of one memory probe")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    common.set_threads(args.threads)
    if args.probe:
        print(json.dumps(probe(json.loads(args.probe))))
    else:
        res = run(args.threads, args.quick)
        print(json.dumps(res, indent=1, default=lambda v: v if math.isfinite(v) else str(v)))


if __name__ == "__main__":
    main()
