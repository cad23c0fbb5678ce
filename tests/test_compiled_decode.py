"""Static-shape and compiled decoding (docs/decoding.md#static-shape-decoding): plain decoding over a static cache
(`allocate_cache(static=True)`: whole buffers read under a mask) decodes exactly what eager decoding does, and
`generate(compile=...)` traces that step into one graph (fullgraph, no recompiles from token to token), kept in a
bounded per-model LRU. Dynamo traces here with its "eager" backend: inductor on the CPU compiles the same graph in
minutes, and the compiled and captured step itself is checked on a GPU (tests/test_gpu_decode.py, `make gpu-check`).
What it does not cover is refused by name."""

from __future__ import annotations

import pytest
import torch

from looplab.models import ExitPolicy, LoopedLM, LoopedLMConfig, Speculation
from looplab.models import generation
from looplab.models.generation import compile_unsupported, decode_one_token, generate, prefill

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread (conftest)

CONFIGS = {
    "llama": dict(),
    "gqa_prelude_coda": dict(n_kv_heads=2, prelude_layers=1, coda_layers=1),
    "stateloop_inject": dict(state_mode="stateloop", injection="add"),
}


def _model(**over) -> LoopedLM:
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, d_model=32, n_heads=4, n_layers=2, n_loops=3, max_seq_len=64)
    return LoopedLM(LoopedLMConfig(**{**cfg, **over})).eval()


def _padded():
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # rows of different lengths, left-padded
    mask[2, :6] = 0
    return ids, mask


@torch.no_grad()
def static_greedy(model, ids, mask, new: int, n_loops: int):
    """Greedy decoding over a static cache, uncompiled → (sequences, logits (B, new, V))."""
    cache = model.allocate_cache(ids.shape[0], ids.shape[1] + new, n_loops=n_loops, static=True)
    logits, _ = prefill(model, ids, mask, cache, n_loops)
    out, lg = [logits.argmax(-1)], [logits]
    for _ in range(new - 1):
        logits, _ = decode_one_token(model, out[-1], cache, n_loops=n_loops)
        out.append(logits.argmax(-1))
        lg.append(logits)
    return torch.cat([ids, torch.stack(out, 1)], 1), torch.stack(lg, 1)


@pytest.mark.parametrize("name", CONFIGS)
def test_static_cache_decoding_equals_eager_decoding(name):
    model = _model(**CONFIGS[name])
    ids, mask = _padded()
    for n_loops in (3, 5):  # the trained depth, and a test-time depth beyond it
        ref = generate(model, ids, 9, attention_mask=mask, return_logits=True, n_loops=n_loops)
        seq, logits = static_greedy(model, ids, mask, 9, n_loops)
        assert torch.equal(seq, ref.sequences)
        torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_static_cache_keeps_its_buffers_and_refuses_overflow():
    model = _model()
    cache = model.allocate_cache(1, 12, static=True)
    logits, _ = prefill(model, torch.tensor([[0, 1, 2, 3]]), torch.tensor([[0, 1, 1, 1]]), cache, 3)  # one pad column
    k_before = cache[0, 0].k
    for t in range(4, 12):
        logits, _ = decode_one_token(model, logits.argmax(-1), cache)
        assert logits.shape == (1, 64) and cache[0, 0].k is k_before and int(cache.lengths[0]) == t + 1
    # every column written, only the padding one masked out; RoPE positions count the real tokens
    assert cache.valid[0].tolist() == [False] + [True] * 11 and int(cache.next_pos[0]) == 11
    with pytest.raises(RuntimeError, match="full"):
        decode_one_token(model, logits.argmax(-1), cache)


def test_compiled_step_is_one_graph_that_never_recompiles(monkeypatch):
    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setattr(generation, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    counters.clear()
    model = _model(**CONFIGS["gqa_prelude_coda"])
    ids, mask = _padded()
    ref = generate(model, ids, 9, attention_mask=mask, return_logits=True)
    for _ in range(2):  # the second call reuses the decoder and its graph
        out = generate(model, ids, 9, attention_mask=mask, return_logits=True, compile=True)
        assert torch.equal(out.sequences, ref.sequences)
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1  # fullgraph: one capture for all 2 × 8 steps
    # decoders are kept per (batch, length bucket, depth, mode, device, dtype), at most MAX_COMPILED per model
    table = model._compiled_decoders
    assert len(table) == 1
    for b in range(2, 2 + generation.MAX_COMPILED + 1):
        generation.compiled_decoder(model, b, 16, 3, "default")
    keys = {k[:4] for k in table}
    assert len(table) == generation.MAX_COMPILED and (2, 64, 3, "default") not in keys  # the least recently used
    assert (3, 64, 3, "default") in keys  # used again after batch 2 was built


@pytest.mark.parametrize("over, name", [(dict(backbone="mamba2"), "Mamba-2"), (dict(backbone="hybrid"), "Mamba-2"),
                                        (dict(state_mode="stateloop_attn"), "stateloop_attn")])
def test_compile_refuses_what_it_does_not_cover(over, name):
    cfg = LoopedLMConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, n_loops=2, headdim=8, **over)
    assert name in compile_unsupported(cfg)
    with pytest.raises(ValueError, match=name):
        generate(LoopedLM(cfg).eval(), torch.tensor([[1, 2]]), 2, compile=True)


def test_compile_refuses_other_strategies_by_name():
    model = _model(exit_gate="ouro")
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="does not combine with speculation"):
        generate(model, ids, 3, speculation=Speculation(1), compile=True)
    with pytest.raises(ValueError, match="does not combine with exits"):
        generate(model, ids, 3, exits=ExitPolicy(threshold=0.5), compile="reduce-overhead")
    with pytest.raises(ValueError, match="compile='graphs' is unknown"):
        generate(model, ids, 3, compile="graphs")
