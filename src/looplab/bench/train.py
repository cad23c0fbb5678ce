"""Training-step benchmark: looped llama N⊗R vs `transformers` Llama with N·R layers.

One training step = forward, next-token cross-entropy, backward, AdamW step, zero_grad.
Candidates are built with the same width, heads, FFN, vocabulary and sequence, so they do
the same FLOPs per token; they are timed round-robin in one process (common.py), together
with the fp32 `torch.mm` 2048³ ceiling, so MFU and ratios see the same machine load:

- `looplab`       LoopedLM N⊗R as `python -m looplab.train` runs it: fused AdamW, and the block
                  compiled exactly when `compile=auto` would (on CPU at d_model ≥ 512: here, yes)
- `transformers`  LlamaForCausalLM with N·R distinct layers (SDPA attention, eager), the same fused AdamW
- `unlooped`      LoopedLM (N·R)⊗1: the same code without weight sharing
- options, each a copy of `looplab` with one change: `eager` (or `compile`, whichever the default
  is not: each layer compiled once and reused by all R loops; needs a C++ toolchain on CPU, an
  error is recorded), foreach AdamW, per-loop activation checkpointing, and the math SDPA
  backend (an eager-mode choice, compared with eager).

MFU divides the analytic training FLOPs — causal attention counted as causal, T(T + 1)/2 of the T² query-key
pairs (models/flops.py) — by the matmul ceiling measured right before and after each timed step
(common.time_round_robin): this VM's matmul speed drifts by ±25% within seconds. Ratios are
paired per round (see common.Timings.ratio).
`best` is the fastest looplab configuration measured, with its name.

Peak memory runs in fresh subprocesses (see common.py for why RSS): one training step's
peak resident memory above the RSS before the model was built (parameters, gradients,
AdamW state, activations, temporaries), for R = 1, 2, 4, 8 with and without checkpointing.
These are eager steps: in a compiled one, inductor's own compile-time memory would swamp the figure.

`--device cuda` (GPU machines) runs the same candidates on the GPU at GPU-sized dims (`CUDA`)
under bf16 autocast, as `hardware=gpu` trains: MFU against a bf16 `torch.mm` 8192³ ceiling,
peak memory from `torch.cuda.max_memory_allocated`. It has not run on this project's CPU-only
machines; without a GPU it stops with an error naming the missing device.
"""

from __future__ import annotations

import argparse
import gc
import json
import math

import torch
import torch.nn.functional as F

from looplab.bench import common
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.flops import causal_flops_per_token
from looplab.training.run_utils import resolve_compile

# The reference configuration: d 512, 8 heads, FFN 1408, vocab 8192, N 4, R 4, T 256, batch 8.
FULL = dict(vocab=8192, d_model=512, n_heads=8, ffn=1408, n_layers=4, n_loops=4, seq_len=256, batch=8)
QUICK = dict(vocab=256, d_model=64, n_heads=4, ffn=192, n_layers=2, n_loops=2, seq_len=32, batch=2)
# GPU-sized: a ~300M-parameter-equivalent step (16 effective layers at d 1024, T 1024)
CUDA = dict(vocab=32000, d_model=1024, n_heads=16, ffn=2816, n_layers=4, n_loops=4, seq_len=1024, batch=16)
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


def closed_form_flops(model: LoopedLM, seq_len: int, causal: bool = True) -> int:
    """The closed-form training FLOPs/token, independent of LoopedLM.flops_per_token:
    6·(matmul params, block counted R times, + LM head) + attention, L_eff = N·R layers of width d = H·hd:
    causal 3·2·2·L_eff·d·(T + 1)/2 = 6·L_eff·d·(T + 1) (a query reads (T + 1)/2 keys on average: T(T + 1)/2 of the
    T² pairs), or over every key 12·L_eff·d·T (causal=False)."""
    cfg = model.config
    block = sum(p.numel() for p in model.block.parameters() if p.dim() == 2)
    head = model.head.weight.numel()
    L, d = cfg.n_layers * cfg.n_loops, cfg.d_model
    attention = 6 * L * d * (seq_len + 1) if causal else 12 * L * d * seq_len
    return 6 * (cfg.n_loops * block + head) + attention


# ------------------------------------------------------------------- steps
def make_step(model: torch.nn.Module, d: dict, *, hf: bool = False, fused: bool = True, seed: int = 0,
              device: str = "cpu"):
    """A closure running one full training step on fixed random tokens (fused AdamW unless fused=False: foreach).

    On CUDA the step runs under bf16 autocast; it returns once its kernels are queued (the timer synchronises).
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, d["vocab"], (d["batch"], d["seq_len"] + 1), generator=g)
    x, y = ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if fused else {"foreach": True}))
    V = d["vocab"]
    cuda = torch.device(device).type == "cuda"

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            if hf:
                out = model(input_ids=x)
                loss = F.cross_entropy(out.logits.view(-1, V).float(), y.view(-1))
            else:  # as looplab.train's step: the head and cross-entropy from targets (models/loss.py, chunked when large)
                loss = model(x, targets=y).token_loss.mean()
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


def cuda_peak(spec: dict) -> dict:
    """In-process on CUDA (the caching allocator keeps exact statistics): one step's peak allocated memory."""
    d, hf = spec["dims"], spec["model"] == "transformers"
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = transformers_model(d, spec["n_layers"]) if hf else looplab_model(d, spec["n_layers"], spec["n_loops"])
    if not hf:
        model.checkpoint_loops = bool(spec.get("checkpoint", False))
    step, opt = make_step(model, d, hf=hf, device="cuda")
    step()  # AdamW state now exists: the next step is the steady state
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del model, step, opt
    return {"peak_mb": round((peak - base) / 2**20, 1), "peak_method": "torch.cuda.max_memory_allocated"}


def memory_entries(d: dict, threads: int, quick: bool = False, device: str = "cpu") -> dict:
    N, R, L = d["n_layers"], d["n_loops"], d["n_layers"] * d["n_loops"]
    specs = {"transformers": dict(model="transformers", n_layers=L, dims=d)}
    if not quick:
        specs["unlooped"] = dict(model="looplab", n_layers=L, n_loops=1, dims=d)
    for ckpt in (False, True):
        for r in ((R,) if quick else MEMORY_LOOPS):
            key = f"looplab_R{r}" + ("_checkpoint" if ckpt else "")
            specs[key] = dict(model="looplab", n_layers=N, n_loops=r, checkpoint=ckpt, dims=d)
    if torch.device(device).type == "cuda":
        return {k: cuda_peak(spec) for k, spec in specs.items()}
    # RSS does not depend on CPU load, so tiny probes may run side by side; full-size ones take GBs each
    return common.run_probes("looplab.bench.train", specs, threads, parallel=len(specs) if quick else 1)


# -------------------------------------------------------------------- run
def run(threads: int = 2, quick: bool = False, *, repeats: int | None = None, options: bool = True,
        compile: bool | None = None, memory: bool = True, device: str = "cpu") -> dict:
    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError(f"--device {device}: torch sees no CUDA device here (torch {torch.__version__}); "
                           "run the CPU benchmark, or this one on a GPU machine")
    common.set_threads(threads)
    d = dict(QUICK if quick else (CUDA if cuda else FULL))
    repeats = repeats or (2 if quick else 7)
    N, R, T, B = d["n_layers"], d["n_loops"], d["seq_len"], d["batch"]
    # the default candidate compiles exactly when `compile=auto` training would (run_utils);
    # compile=False forces eager and skips the compile option (--no-compile)
    if compile is None:
        compile, compile_why = resolve_compile("auto", d["d_model"], "cpu" if not cuda else "cuda")
    else:
        compile_why = f"bench --{'' if compile else 'no-'}compile"
    torch.manual_seed(0)
    base = looplab_model(d)
    option_info: dict = {}

    def variant(compiled: bool, n_layers: int | None = None, n_loops: int | None = None, *,
                fused: bool = True, checkpoint: bool = False):
        """A training step of a copy of `base` (same weights where the shapes match) with one change."""
        m = looplab_model(d, n_layers, n_loops)
        if n_layers is None and n_loops is None:
            m.load_state_dict(base.state_dict())
        m.checkpoint_loops = checkpoint
        if compiled:
            m.compile_block(dynamic=False)
        return make_step(m, d, fused=fused, device=device)[0]

    def compiled_or_error(key: str, step):
        """The step after its compiling call, or None (the reason is kept in option_info[key])."""
        option_info[key] = common.first_compiled_call(step, device)
        return None if "error" in option_info[key] else step

    default = variant(compile)
    if compile and compiled_or_error("looplab", default) is None:
        compile, compile_why = False, "compile failed: " + option_info["looplab"]["error"]
        default = variant(False)
    candidates = {"looplab": default,
                  "transformers": make_step(transformers_model(d, N * R), d, hf=True, device=device)[0]}
    flip = "opt_eager" if compile else "opt_compile"  # next to the reference: `best` usually pairs with it
    # the compile option is skipped in --quick (tiny dims: compile time, no meaningful figure)
    if options and (compile or (not quick and "failed" not in compile_why)):
        step = variant(not compile)
        if compile or compiled_or_error(flip, step) is not None:
            candidates[flip] = step
    candidates["unlooped"] = variant(compile, N * R, 1)
    if options:
        candidates["opt_foreach_adamw"] = variant(compile, fused=False)
        candidates["opt_checkpoint_loops"] = variant(compile, checkpoint=True)

        from torch.nn.attention import SDPBackend, sdpa_kernel

        math_step = variant(False)  # a backend choice is an eager-mode option

        def sdpa_math() -> None:
            with sdpa_kernel(SDPBackend.MATH):
                math_step()

        candidates["opt_sdpa_math"] = sdpa_math
    probe_mm = (common.matmul_probe(8192, device=device, dtype=torch.bfloat16) if cuda
                else common.matmul_probe(256 if quick else 2048))
    timings = common.time_round_robin(candidates, repeats, warmup=1, reference="looplab", device=device,
                                      ceiling=probe_mm)
    times, cpu, local = timings.wall, timings.cpu, timings.ceiling
    med = {k: common.median(v) for k, v in times.items()}
    all_ceilings = [c for v in local.values() for c in v]
    ceiling = common.median(all_ceilings)
    fpt = causal_flops_per_token(base, T, training=True)  # causal attention counted as causal (models/flops.py)
    tok = {k: B * T / s for k, s in med.items()}

    def mfu(k: str) -> float:
        """Median over calls of achieved FLOP/s / the ceiling measured around that call."""
        return common.median([B * T * fpt / t / (c * 1e9) for t, c in zip(times[k], local[k])])

    def paired(other: str, clock: str = "wall", base: str = "looplab") -> float:
        """Median over rounds of other's step time / base's: base's speed in units of other's."""
        return timings.ratio(other, base, clock).median

    res = {
        "config": dict(d, model=f"{N}x{R}"),
        "compiled": compile,
        "compile_decision": compile_why,
        **({"compile_s": option_info["looplab"]["compile_s"]} if "compile_s" in option_info.get("looplab", {}) else {}),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": "bf16 autocast" if cuda else "float32",
        "tokens_per_s": tok["looplab"],
        "ratio_vs_transformers": paired("transformers"),
        "ratio_vs_unlooped": paired("unlooped"),
        "mfu": mfu("looplab"),
        "transformers_tokens_per_s": tok["transformers"],
        "transformers_mfu": mfu("transformers"),
        "unlooped_tokens_per_s": tok["unlooped"],
        "unlooped_mfu": mfu("unlooped"),
        "matmul_gflops": ceiling,
        "matmul_gflops_range": [min(all_ceilings), max(all_ceilings)],
        "mfu_vs_median_ceiling": tok["looplab"] * fpt / (ceiling * 1e9),
        "flops_per_token": fpt,
        "flops_per_token_issue_formula": closed_form_flops(base, T),
        "flops_per_token_all_keys": base.flops_per_token(T, training=True),  # the count MFU used before: +% over fpt
        # the same ratio from CPU seconds: steadier when other jobs share the cores (see common.py)
        "ratio_vs_transformers_cpu_time": paired("transformers", "cpu"),
        "ratio_vs_unlooped_cpu_time": paired("unlooped", "cpu"),
        "step_s": {k: [round(t, 4) for t in v] for k, v in times.items()},
        "step_cpu_s": {k: [round(t, 4) for t in v] for k, v in cpu.items()},
        "ceiling_gflops": {k: [round(c, 1) for c in v] for k, v in local.items()},
        "repeats": repeats,
    }
    opts = {}
    for k in tok:
        if k.startswith("opt_"):
            # SDPA math is an eager-mode choice: against eager when the default compiles
            ref = "opt_eager" if k == "opt_sdpa_math" and "opt_eager" in tok else "looplab"
            opts[k[4:]] = {"tokens_per_s": tok[k], "speedup_vs_default": paired(ref, base=k), "mfu": mfu(k),
                           "speedup_vs_default_cpu_time": paired(ref, "cpu", base=k),
                           "baseline": "eager" if ref == "opt_eager" else "default",
                           **option_info.get(k, {})}
    for k, v in option_info.items():
        if "error" in v and k != "looplab":
            opts[k[4:]] = v
    if opts:
        res["options"] = opts
    # the fastest looplab configuration (every option computes the same training step)
    best = max((k for k in tok if k == "looplab" or k.startswith("opt_")), key=lambda k: tok[k])
    res["best"] = {
        "config": "default" if best == "looplab" else best[4:],
        "tokens_per_s": tok[best],
        "ratio_vs_transformers": paired("transformers", base=best),
        "ratio_vs_transformers_cpu_time": paired("transformers", "cpu", base=best),
        "mfu": mfu(best),
    }
    del candidates, base
    gc.collect()
    if memory:
        mem = memory_entries(d, threads, quick, device)
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
