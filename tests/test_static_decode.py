"""Static-shape decoding (models/static_decode.py, docs/decoding.md#static-shape-decoding): the step CUDA graphs
can capture decodes exactly what plain cached decoding does; what it does not cover is refused by name. The
compiled and captured step itself is checked on a GPU (tests/test_gpu_decode.py, run by `make gpu-check`);
inductor on the CPU compiles it too, but in minutes."""

from __future__ import annotations

import pytest
import torch

from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.generation import generate
from looplab.models.static_decode import StaticDecoder, static_decode_unsupported

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


@pytest.mark.parametrize("name", CONFIGS)
def test_static_decoding_equals_plain_decoding(name):
    model = _model(**CONFIGS[name])
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # rows of different lengths, left-padded
    mask[2, :6] = 0
    for n_loops in (None, 5):  # the trained depth, and a test-time depth beyond it
        ref = generate(model, ids, 9, attention_mask=mask, return_logits=True, n_loops=n_loops)
        for _ in range(2):  # the second call reuses the decoder (and, compiled, its graph)
            out = generate(model, ids, 9, attention_mask=mask, return_logits=True, n_loops=n_loops, compile=True)
            assert torch.equal(out.sequences, ref.sequences)
            torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)


def test_static_step_keeps_its_shapes_and_fills_the_cache_in_place():
    model = _model()
    dec = StaticDecoder(model, batch_size=1, max_len=12)
    logits = dec.prefill(torch.tensor([[1, 2, 3]]))
    k_before = dec.entries[0, 0].k
    for t in range(3, 12):
        logits = dec.step(logits.argmax(-1))
        assert logits.shape == (1, 64) and dec.entries[0, 0].k is k_before and dec.length == t + 1
    assert bool(dec.mask.all()) and int(dec.positions) == 12
    with pytest.raises(RuntimeError, match="static cache full"):
        dec.step(logits.argmax(-1))


@pytest.mark.parametrize("over, name", [(dict(backbone="mamba2"), "Mamba-2"), (dict(backbone="hybrid"), "Mamba-2"),
                                        (dict(state_mode="stateloop_attn"), "stateloop_attn")])
def test_static_decoding_refuses_what_it_does_not_cover(over, name):
    cfg = LoopedLMConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, n_loops=2, headdim=8, **over)
    assert name in static_decode_unsupported(cfg)
    with pytest.raises(ValueError, match=name):
        generate(LoopedLM(cfg).eval(), torch.tensor([[1, 2]]), 2, compile=True)


def test_static_decoding_refuses_other_strategies_by_name():
    model = _model(exit_gate="ouro")
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="speculative_loops=1"):
        generate(model, ids, 3, speculation=Speculation(1), compile=True)
    with pytest.raises(ValueError, match="exit_threshold=0.5"):
        generate(model, ids, 3, exits=ExitPolicy.from_kwargs(exit_threshold=0.5), compile="eager")
    with pytest.raises(ValueError, match="static_cache='graphs' is unknown"):
        generate(model, ids, 3, compile="graphs")
