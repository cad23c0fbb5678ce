"""Decoding on a GPU (marked `gpu`; skipped, saying why, without CUDA).

Each decoder with a path of its own on a GPU decodes plain cached decoding's tokens, on every call: the
static-shape step compiled (`compile=True`) and captured by CUDA graphs (`compile="reduce-overhead"`: the first
call compiles and captures, the second replays; docs/decoding.md#static-shape-decoding), and self-speculation
(k 2, γ 4; docs/decoding.md#self-speculative-decoding). A random d 512 llama 2⊗4 at batch 1 and 8, 128 new
tokens, fp32: in bf16, near-ties flip greedy tokens between kernels, which says nothing about the decoders.
Each test records tokens/s of the decoder and of plain decoding beside it, and the first call's seconds
(`record_property`), which `make gpu-check` keeps in gpu-check.json (docs/gpu.md#gpu-check).

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
