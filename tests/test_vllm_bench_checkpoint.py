"""`python -m looplab.bench.vllm_serve --checkpoint CKPT` (docs/vllm.md#speed): a trained gated model, its plain copy,
a trace from its test text and its quality at q beside the speed. The vLLM arms themselves run in the vLLM venv
(tests_engines/vllm); what they are given is checked here."""

from __future__ import annotations

import pytest
import torch

from test_depth_under_load import _train

# conftest's tiny_overrides, for a module-scoped checkpoint (_train sets the run folder)
TINY = ["logger=none", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "dataset.batch_size=8",
        "backbone.d_model=32", "backbone.n_heads=2", "backbone.ffn_hidden=64"]


@pytest.fixture(scope="module")
def gated_ckpt(tmp_path_factory):
    run = _train(TINY, tmp_path_factory.mktemp("runs") / "gated", ["exit_gate=ouro"])
    return str(run / "checkpoints" / "last.ckpt")


def test_the_plain_copy_is_the_gated_model_at_every_loop_and_the_trace_is_its_test_text(gated_ckpt):
    from looplab.bench.depth_under_load import windows
    from looplab.bench.vllm_serve import checkpoint_models
    from looplab.checkpoint import load_model

    plain, gated, trace, quality = checkpoint_models(gated_ckpt, requests=4, prompt_len=(2, 6), new_tokens=(2, 5),
                                                     exit_threshold=0.5, n_windows=8)
    assert plain.exit_gate is None and gated.exit_gate is not None
    ids = torch.tensor([trace[0]["prompt"]])
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, gated(ids).logits)  # the same weights: the last loop's logits
    _, meta = load_model(gated_ckpt, map_location="cpu")
    test_ids, _ = windows(meta, 8)
    for i, r in enumerate(trace):
        assert r["prompt"] == test_ids[i, :len(r["prompt"])].tolist() and 2 <= len(r["prompt"]) <= 6
        assert 2 <= r["max_new_tokens"] <= 5
    R = gated.config.n_loops
    assert quality["all_loops"]["mean_depth"] == R and quality["windows"] == 8
    for k in ("exits", "exits_skip"):
        assert 1 <= quality[k]["mean_depth"] <= R and quality[k]["tokens"] == quality["all_loops"]["tokens"]
        assert quality[k]["perplexity_ratio"] == pytest.approx(quality[k]["perplexity"] / quality["all_loops"]["perplexity"])


def test_a_threshold_never_reached_gives_every_loops_quality(gated_ckpt):
    """q = 1.0: no token's cumulative exit probability reaches it before the last loop, so the exits (skipping or
    not) read every token at loop R: the same perplexity as every loop."""
    from looplab.bench.vllm_serve import checkpoint_models

    *_, quality = checkpoint_models(gated_ckpt, requests=2, prompt_len=(2, 6), new_tokens=(2, 5), exit_threshold=1.0,
                                    n_windows=4)
    for k in ("exits", "exits_skip"):
        assert quality[k]["mean_depth"] == quality["all_loops"]["mean_depth"]
        assert quality[k]["perplexity"] == pytest.approx(quality["all_loops"]["perplexity"], rel=1e-6)


def test_a_checkpoint_without_a_gate_is_refused_by_name(tmp_path):
    from looplab.bench.vllm_serve import checkpoint_models

    run = _train(TINY, tmp_path / "plain", [])
    with pytest.raises(SystemExit, match="no exit gate .exit_gate='none'.*exit_gate.stage=stage2"):
        checkpoint_models(str(run / "checkpoints" / "last.ckpt"), 2, (2, 6), (2, 5), 0.5, n_windows=4)
