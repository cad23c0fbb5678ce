"""Decoding on a GPU (marked `gpu`; skipped, saying why, without CUDA).

Each decoder with a path of its own on a GPU decodes plain cached decoding's tokens, on every call: the
static-shape step compiled (`compile=True`) and captured by CUDA graphs (`compile="reduce-overhead"`: the first
call compiles and captures, the second replays; docs/decoding.md#static-shape-decoding), and self-speculation
(k 2, γ 4; docs/decoding.md#self-speculative-decoding). A random d 512 llama 2⊗4 at batch 1 and 8, 128 new
tokens, fp32: in bf16, near-ties flip greedy tokens between kernels, which says nothing about the decoders.
Each test records tokens/s of the decoder and of plain decoding beside it, and the first call's seconds
(`record_property`), which `make gpu-check` keeps in gpu-check.json (docs/gpu.md#gpu-check). Parallel loops
(models/parallel.py) decode against their teacher-forced CLP forward (max|Δ| / RMS ≤ 1e-4), each kv mode, with
tokens/s of the sequential and the unlooped model of the same block beside them.

A decoder with a GPU path is added to DECODERS; the comparison itself runs on the CPU too (a tiny model),
so it is known to work before a GPU is lent.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from looplab.gpu_check import cuda_problems
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.generation import Speculation, generate

MISSING = cuda_problems()
needs_cuda = pytest.mark.skipif(bool(MISSING), reason="needs CUDA: " + "; ".join(MISSING))

# name → generate() keywords
DECODERS = {
    "compiled": {"compile": True},
    "reduce_overhead": {"compile": "reduce-overhead"},
    "speculative_k2_g4": {"speculation": Speculation(loops=2, draft_tokens=4)},
}
VOCAB, PROMPT, NEW_TOKENS = 8192, 32, 128


def _timed(fn, device) -> tuple[torch.Tensor, float]:
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def decode_against_plain(model, ids: torch.Tensor, new_tokens: int, **decoder) -> dict[str, Any]:
    """Two calls of generate(**decoder) against plain cached decoding: whether each decoded plain's tokens,
    the first call's seconds (compile, capture) and tokens/s of the second, and plain's tokens/s (its
    second call) beside them."""
    ref, _ = _timed(lambda: generate(model, ids, new_tokens), ids.device)  # also the warm-up
    _, plain_s = _timed(lambda: generate(model, ids, new_tokens), ids.device)
    first, first_s = _timed(lambda: generate(model, ids, new_tokens, **decoder), ids.device)
    second, second_s = _timed(lambda: generate(model, ids, new_tokens, **decoder), ids.device)
    n = ids.shape[0] * new_tokens
    return {"same_tokens": [bool(torch.equal(first, ref)), bool(torch.equal(second, ref))],
            "tokens_per_s": round(n / second_s, 1), "plain_tokens_per_s": round(n / plain_s, 1),
            "first_call_s": round(first_s, 2)}


@pytest.fixture(scope="module")
def gpu_model():
    torch.manual_seed(0)
    cfg = LoopedLMConfig(vocab_size=VOCAB, d_model=512, n_heads=8, n_layers=2, n_loops=4, max_seq_len=512)
    return LoopedLM(cfg).to("cuda").eval()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("decoder", list(DECODERS))
def test_decoder_on_the_gpu_decodes_plain_tokens(gpu_model, decoder, batch, record_property):
    ids = torch.randint(0, VOCAB, (batch, PROMPT), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(batch))
    res = decode_against_plain(gpu_model, ids, NEW_TOKENS, **DECODERS[decoder])
    for key, value in res.items():
        record_property(key, value)
    assert res["same_tokens"] == [True, True], f"{decoder} at batch {batch} decoded other tokens than plain decoding"


@pytest.mark.usefixtures("one_thread_module")  # a tiny model (conftest)
@pytest.mark.parametrize("decoder", ["speculative_k2_g4"])
def test_the_comparison_runs_on_the_cpu(decoder):
    """The harness on a tiny model (reduce-overhead needs CUDA graphs; inductor on the CPU takes minutes: the
    static-shape step uncompiled is checked against plain decoding on the CPU in test_compiled_decode.py)."""
    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, n_loops=3,
                                    max_seq_len=64)).eval()
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    res = decode_against_plain(model, ids, 8, **DECODERS[decoder])
    assert res["same_tokens"] == [True, True]
    assert res["tokens_per_s"] > 0 and res["plain_tokens_per_s"] > 0 and res["first_call_s"] >= 0


# ------------------------------------------------------------------ parallel loops (models/parallel.py)
def parallel_against_forward(model, ids: torch.Tensor, mask: torch.Tensor | None, new_tokens: int) -> dict[str, Any]:
    """Parallel decoding (prefill, then one folded block call per token) against the teacher-forced CLP forward
    over prompt + generated tokens: max|Δ| / RMS(logits) at every generated position, and tokens/s (second call)."""
    generate(model, ids, new_tokens, attention_mask=mask)  # warm-up
    out, s = _timed(lambda: generate(model, ids, new_tokens, attention_mask=mask, return_logits=True), ids.device)
    full = None if mask is None else torch.cat([mask, torch.ones_like(mask[:, :1]).expand(-1, new_tokens)], 1)
    with torch.no_grad():
        ref = model(out.sequences, attention_mask=full).logits[:, ids.shape[1] - 1:-1]
    err = float((out.logits - ref).abs().max() / ref.pow(2).mean().sqrt())
    return {"rel_err": err, "tokens_per_s": round(ids.shape[0] * new_tokens / s, 1)}


def _left_padded(batch: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    ids = torch.randint(0, VOCAB, (batch, PROMPT), device=device,
                        generator=torch.Generator(device=device).manual_seed(batch))
    if batch == 1:
        return ids, None
    mask = torch.ones_like(ids)
    for b in range(batch):
        mask[b, : (3 * b) % (PROMPT // 2)] = 0
    return ids, mask


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kv", ["own", "share_first", "gswa"])
def test_parallel_decoding_on_the_gpu_equals_the_clp_forward(kv, batch, record_property):
    """d 512 llama 2⊗4 (fp32) under loop_schedule=parallel: decoding equals the CLP forward (convert's bound), and
    its tokens/s beside the sequential 2⊗4 and the unlooped 2⊗1 model with the same block (PLT's claim on a GPU)."""
    dims = dict(vocab_size=VOCAB, d_model=512, n_heads=8, n_layers=2, max_seq_len=512)
    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(**dims, n_loops=4, loop_schedule="parallel", loop_kv=kv,
                                    loop_window=64)).to("cuda").eval()
    ids, mask = _left_padded(batch, "cuda")
    res = parallel_against_forward(model, ids, mask, NEW_TOKENS)
    for name, R in (("sequential_tokens_per_s", 4), ("unlooped_tokens_per_s", 1)):
        torch.manual_seed(0)
        other = LoopedLM(LoopedLMConfig(**dims, n_loops=R)).to("cuda").eval()
        generate(other, ids, NEW_TOKENS, attention_mask=mask)
        _, s = _timed(lambda: generate(other, ids, NEW_TOKENS, attention_mask=mask), ids.device)
        res[name] = round(batch * NEW_TOKENS / s, 1)
    for key, value in res.items():
        record_property(key, value)
    assert res["rel_err"] <= 1e-4, f"parallel decoding ({kv}, batch {batch}) differs from the CLP forward: {res}"


@pytest.mark.usefixtures("one_thread_module")
def test_the_parallel_comparison_runs_on_the_cpu():
    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=1, n_loops=3, max_seq_len=128,
                                    loop_schedule="parallel", loop_kv="gswa", loop_window=4)).eval()
    ids, mask = _left_padded(3, "cpu")
    res = parallel_against_forward(model, ids, mask, 8)
    assert res["rel_err"] <= 1e-4 and res["tokens_per_s"] > 0


# ------------------------------------------------------------------ serving engine (looplab.serve)
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arm", ["plain", "exits_lockstep", "exits_depthwise"])
def test_engine_on_the_gpu_equals_solo_decoding(arm, record_property):
    """looplab.serve.Engine on the GPU (make bench's exit-gated d 512 llama 2⊗4, fp32), 32 requests at concurrency 8:
    every request's tokens and exit depths equal it decoded alone (docs/decoding.md#serving-many-requests), with the
    output tokens/s, decoding tokens/s and mean depth recorded."""
    from looplab.bench.serve import bench_model, make_trace, run_arm
    from looplab.models.exits import ExitPolicy

    model = bench_model().to("cuda")
    trace = make_trace(32, model.config.vocab_size, (8, 24), (8, 32), seed=0)
    res = run_arm(model, trace, arm, 8, ExitPolicy(threshold=0.5, skip="kv_copy"), open_loop=False, progress=False)
    for key in ("output_tokens_per_s", "decode_tokens_per_s", "mean_depth", "peak_cache_bytes"):
        record_property(key, res[key])
    record_property("solo_ties", res["solo_check"]["ties"])
    assert res["requests"] == 32
    assert res["solo_check"]["different"] == 0, f"{arm} on the GPU decoded other tokens than solo decoding: {res}"


# ------------------------------------------------------------------ the dtype matrix on the GPU
# (the CPU's: tests/test_gpu_readiness.py). cuBLAS picks other kernels for a batch than for one row, so bf16 logits
# differ more than on the CPU: a tie is a solo top-2 margin within 0.25 (bf16's spacing at |logit| 32), fp32's 1e-3.
GPU_TIE = {"fp32": 1e-3, "bf16": 0.25, "autocast": 0.25}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("name", ["plain_gqa_prelude_coda", "exit_readout", "skip_kv_copy", "skip_ssm_skip",
                                  "skip_ssm_propagate", "speculation", "routed", "parallel_gswa"])
def test_every_decoder_in_every_dtype_on_the_gpu(name, mode):
    from looplab.testing import decode_matrix as matrix

    assert matrix.decoder_agrees(name, mode, GPU_TIE[mode], device="cuda", d_model=64) == []


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("schedule", ["lockstep", "depthwise"])
@pytest.mark.parametrize("name", ["exits_kv_copy", "exits_ssm_skip", "routed", "plain_parallel"])
def test_both_serving_schedules_in_every_dtype_on_the_gpu(name, schedule, mode):
    from looplab.testing import decode_matrix as matrix

    got = matrix.engine_agreement(name, schedule, mode, GPU_TIE[mode], device="cuda", d_model=64)
    if got is not None:
        assert got["equal"] + got["ties"] == 6, got["differences"]


@pytest.mark.gpu
@needs_cuda
def test_reduce_overhead_captures_a_cuda_graph(gpu_model, record_property):
    """compile="reduce-overhead" replays a captured CUDA graph: no cudagraph skip (its step mutates only static
    addresses, every cache buffer marked), a graph recorded, and plain decoding's tokens."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ids = torch.randint(0, VOCAB, (2, PROMPT), device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    ref = generate(gpu_model, ids, 32)
    for _ in range(2):
        assert torch.equal(generate(gpu_model, ids, 32, compile="reduce-overhead"), ref)
    record_property("cudagraph_skips", counters["inductor"]["cudagraph_skips"])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert "cudagraph_recorded_non_static_inputs" in counters["inductor"], "no CUDA graph was recorded"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("attn", ["sdpa", "eager", "flash_attention_2"])
def test_the_exported_model_on_the_gpu(attn, tmp_path):
    """The transformers remote-code folder on the GPU in bf16, under each attention implementation: its logits are
    looplab's, or (flash-attention not installed) the load refuses it naming the implementation."""
    from transformers import AutoModelForCausalLM

    from looplab.checkpoint import looplab_meta
    from looplab.convert import to_hf
    from looplab.testing import decode_matrix as matrix

    model = matrix.make(d_model=64, n_kv_heads=2, state_mode="stateloop_attn", prelude_layers=1, coda_layers=1)
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "looplab": looplab_meta(model.config, {})}, ckpt)
    to_hf(str(ckpt), tmp_path / "hf", log=lambda *a: None)
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True, dtype=torch.bfloat16,
                                                  attn_implementation=attn).to("cuda").eval()
    except (ImportError, ValueError) as e:
        assert attn == "flash_attention_2" and "flash" in str(e).lower(), e
        pytest.skip(f"{attn}: {e}")
    ids, mask = matrix.padded(matrix.prompts(device="cuda"))
    model = model.to("cuda", torch.bfloat16)
    with torch.no_grad():
        got, want = hf(input_ids=ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
    real = mask.bool()
    assert float((got[real].float() - want[real].float()).abs().max()) <= 0.25
