"""Per-loop overhead of cached decoding: where a decoded token's time goes.

For each width d (64, 256, 576; 576 is SmolLM-135M's width, 9 heads and 3 key/value heads) a
llama N⊗R = 2⊗4 with vocab 4096 and random weights decodes 64 greedy tokens after a 32-token
prompt, batch 1, fp32. Timed round-robin in one process (looplab.bench.common.time_round_robin),
medians of `repeats` calls; every call decodes the same tokens:

    plain                 looplab cached greedy decoding (`generate`)
    transformers          transformers' `generate` (greedy, its own KV cache) on the same model
                          unrolled into a LlamaForCausalLM of N·R layers with the same weights
                          (`convert.unrolled_transformers`): ratio_vs_transformers = tokens/s ÷ theirs
    skip_no_exit          the same weights plus an Ouro exit gate whose bias keeps every λ ≈ 0, decoded
                          with ExitPolicy(threshold=0.5, skip="kv_copy"), so no token exits: the cost of
                          the skip path's bookkeeping alone, against plain decoding of that gate model
                          (skip_overhead = time ÷ plain's − 1; the target is ≤ 0.05)
    plain at depth 1      the same model decoded at n_loops=1, so time/token = fixed + R · per_loop gives
                          the per-loop cost and the share of a token's time spent outside the loops
    static_eager          plain decoding over a static-shape cache (whole buffers read under a mask), not compiled
    static_compiled       the same step under torch.compile (`generate(compile=True)`: inductor's C++ kernels on the CPU; the
                          first call compiles, minutes, and is not timed): what fusing the per-op
                          overhead away buys (full runs: every width; --quick: none).

Output tokens are compared with plain decoding (transformers' too: `agree` is the fraction of equal
tokens; float rounding of an unrolled model may flip a near-tie).
"""

from __future__ import annotations

import statistics

import torch

from looplab.bench.common import time_round_robin
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.exits import ExitPolicy
from looplab.models.generation import decode_one_token, generate, prefill

WIDTHS = {64: dict(n_heads=4, n_kv_heads=4, ffn_hidden=176), 256: dict(n_heads=4, n_kv_heads=4, ffn_hidden=688),
          576: dict(n_heads=9, n_kv_heads=3, ffn_hidden=1536)}
DIMS = dict(n_layers=2, n_loops=4, vocab_size=4096, max_seq_len=256)
PROMPT, NEW = 32, 64


def _models(d: int, seed: int = 0) -> tuple[LoopedLM, LoopedLM]:
    """(plain model, the same weights with an exit gate that never fires)."""
    torch.manual_seed(seed)
    plain = LoopedLM(LoopedLMConfig(d_model=d, **WIDTHS[d], **DIMS)).eval()
    torch.manual_seed(seed)
    gated = LoopedLM(LoopedLMConfig(d_model=d, exit_gate="ouro", **WIDTHS[d], **DIMS)).eval()
    gated.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        gated.exit_gate.proj.bias.fill_(-30.0)  # λ ≈ 1e-13 at every loop: CDF(t) < 0.5 until R
    return plain, gated


@torch.no_grad()
def static_eager(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy decoding over a static-shape cache, uncompiled: what the compiled step computes, op by op."""
    cache = model.allocate_cache(ids.shape[0], ids.shape[1] + new, static=True)
    logits, _ = prefill(model, ids, None, cache, model.config.n_loops)
    out = [logits.argmax(-1)]
    for _ in range(new - 1):
        out.append(decode_one_token(model, out[-1], cache)[0].argmax(-1))
    return torch.cat([ids, torch.stack(out, 1)], 1)


@torch.no_grad()
def run_width(d: int, repeats: int = 5, transformers: bool = True, new: int = NEW, compile: bool = False) -> dict:
    plain, gated = _models(d)
    ids = torch.randint(0, DIMS["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(1))
    ref = generate(plain, ids, new)
    no_exit = ExitPolicy(threshold=0.5, skip="kv_copy")
    skip = generate(gated, ids, new, exits=no_exit, return_logits=True)
    if not bool((skip.exit_steps == DIMS["n_loops"]).all()):
        raise AssertionError("a token exited: skip_no_exit measures nothing")
    fns = {
        "plain": lambda: generate(plain, ids, new),
        "plain_depth1": lambda: generate(plain, ids, new, n_loops=1),
        "gate_plain": lambda: generate(gated, ids, new),
        "skip_no_exit": lambda: generate(gated, ids, new, exits=no_exit),
        "static_eager": lambda: static_eager(plain, ids, new),
    }
    compile_s = None
    if compile:
        import time

        t0 = time.perf_counter()
        if not torch.equal(generate(plain, ids, new, compile=True), ref):
            raise AssertionError("the compiled static step decoded other tokens than plain decoding")
        compile_s = time.perf_counter() - t0
        fns["static_compiled"] = lambda: generate(plain, ids, new, compile=True)
    if not torch.equal(static_eager(plain, ids, new), ref):
        raise AssertionError("the static-shape cache decoded other tokens than plain decoding")
    agree = None
    if transformers:
        from looplab.convert import unrolled_transformers

        hf = unrolled_transformers(plain)
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
        theirs = hf.generate(ids, **kw)
        agree = float((theirs[:, PROMPT:] == ref[:, PROMPT:]).float().mean())
        fns["transformers"] = lambda: hf.generate(ids, **kw)
    times = time_round_robin(fns, repeats, warmup=1).wall
    ms = {k: 1e3 * statistics.median(v) / new for k, v in times.items()}  # per token, prefill included
    R = DIMS["n_loops"]
    per_loop = (ms["plain"] - ms["plain_depth1"]) / (R - 1)
    fixed = ms["plain_depth1"] - per_loop
    out = {
        "ms_per_token": {k: round(v, 3) for k, v in ms.items()},
        "tokens_per_s": round(1e3 / ms["plain"], 1),
        "per_loop_ms": round(per_loop, 3),
        "outside_loops_ms": round(fixed, 3),
        "outside_loops_share": round(fixed / ms["plain"], 3),
        "skip_overhead": round(ms["skip_no_exit"] / ms["gate_plain"] - 1, 3),
    }
    out["static_eager_speedup"] = round(ms["plain"] / ms["static_eager"], 3)
    if compile:
        out["static_compiled_speedup"] = round(ms["plain"] / ms["static_compiled"], 3)
        out["compile_s"] = round(compile_s, 1)
    if transformers:
        out["ratio_vs_transformers"] = round(ms["transformers"] / ms["plain"], 3)
        out["transformers_agree"] = round(agree, 3)
    return out


def run(threads: int, quick: bool = False, repeats: int | None = None, widths=None, compile_widths=tuple(WIDTHS)) -> dict:
    """quick: d 64 only, 16 new tokens, 2 repeats, nothing compiled (a smoke test; the figures mean little)."""
    widths = list(widths or ((64,) if quick else WIDTHS))
    compile_widths = () if quick else tuple(compile_widths)
    repeats = repeats or (2 if quick else 5)
    new = 16 if quick else NEW
    res = {"dims": {**DIMS, "prompt": PROMPT, "new_tokens": new, "batch": 1},
           "widths": {str(d): run_width(d, repeats, new=new, compile=d in compile_widths) for d in widths}}
    per = res["widths"].values()
    res["skip_overhead"] = max(w["skip_overhead"] for w in per)
    res["ratio_vs_transformers"] = min(w["ratio_vs_transformers"] for w in per)
    res["outside_loops_share"] = max(w["outside_loops_share"] for w in per)
    return res


if __name__ == "__main__":
    import json
    import sys

    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    print(json.dumps(run(torch.get_num_threads()), indent=1))
