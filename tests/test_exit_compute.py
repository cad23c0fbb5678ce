"""Compute-saving exits on every backbone (docs/decoding.md#exits-that-save-compute): the skip handlings against their reference.

The reference (`forward_with_exits`) is a full forward pass without caches in which each token stops
at a given exit step; cached skip_compute decoding must give the same logits when it is handed the
exit steps it chose itself. Every registered handling on every registered variant, in a left-padded batch,
is the conformance kit's (tests/test_conformance.py: skip:<handling>); here: batch 1 (every deeper loop filled
from the caches without running a layer), prelude and coda, the handlings' differences, the online reference,
exit-aware fine-tuning and the exit grid.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from looplab.models.exits import ExitPolicy
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.exit_compute import (HANDLINGS, SkipDecoding, forward_with_exits, resolve_handling,
                                         skip_compute_unsupported)
from looplab.models.exit_gate import exit_distribution, logits_at_depth
from looplab.models.exit_rules import first_exit
from looplab.models.generation import decode_one_token, generate
from looplab.testing.conformance import skip_reference

V, R, Q, ATOL = 61, 4, 0.5, 3e-5


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread (conftest)


def make_model(backbone, state_mode, seed=0, gate_bias=-0.3, mamba_mlp=False, **kw) -> LoopedLM:
    torch.manual_seed(seed)
    cfg = LoopedLMConfig(
        vocab_size=V, d_model=32, n_heads=4, n_layers=2, n_loops=R, backbone=backbone, hybrid_pattern="MA",
        state_mode=state_mode, exit_gate="ouro", max_seq_len=64, d_state=8, headdim=16, chunk_size=4,
        kernel="torch", mamba_mlp=mamba_mlp, **kw,
    )
    model = LoopedLM(cfg).eval()
    with torch.no_grad():
        if model.state is not None:
            model.state.state_out.weight.normal_(0, 0.2)
        model.exit_gate.proj.weight.normal_(0, 1 / 32**0.5)  # logits of std ≈ 1: mixed exit depths at q = 0.5
        model.exit_gate.proj.bias.fill_(gate_bias)
    return model


def reference_logits(model, out, prompt, mask, handling):
    """What the reference gives for the tokens `generate` produced: the prompt's tokens stopping at the exits the
    prefill decides online, the generated ones at the exit steps decoding chose (testing/conformance.py)."""
    return skip_reference(model, out, prompt, mask, ExitPolicy(threshold=Q, skip=handling))


@pytest.mark.parametrize("backbone,state_mode,handling", [("llama", "stateloop_attn", "kv_copy"),
                                                          ("mamba2", "stateloop_mamba2", "ssm_propagate"),
                                                          ("hybrid", "stateloop_reset", "ssm_skip")])
@torch.no_grad()
def test_skip_compute_at_batch_one_equals_its_reference(backbone, state_mode, handling):
    """At batch 1 every row exits together: each deeper loop is filled from the caches without running a layer."""
    model = make_model(backbone, state_mode, seed=1)
    prompt = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(12))
    out = generate(model, prompt, 10, return_logits=True, exits=ExitPolicy(threshold=Q, skip=handling))
    assert bool((out.exit_steps < R).any()) and len(out.exit_steps.unique()) > 1, "exits were meant to be mixed"
    ref, want = reference_logits(model, out, prompt, None, handling)
    torch.testing.assert_close(out.logits, want, atol=ATOL, rtol=1e-4)
    # each token's exit is the gate's decision on its own loops, which the reference computes in full
    probs = exit_distribution(torch.sigmoid(model.exit_gate.logit(ref.loop_hidden).permute(1, 2, 0)))
    steps = first_exit("gate", Q, R, exit_probs=probs)
    assert torch.equal(steps[:, prompt.shape[1]:], out.exit_steps[:, 1:])


@pytest.mark.parametrize("backbone,state_mode,handling", [("llama", "stateloop", "kv_copy"), ("hybrid", "vanilla", "ssm_skip")])
@pytest.mark.parametrize("batch", [1, 3])
@torch.no_grad()
def test_skip_compute_with_prelude_and_coda_equals_its_reference(backbone, state_mode, handling, batch):
    """The coda's per-depth entries of an exited token are filled by the handling too, so the next token's coda
    reads them (at batch 1 every row exits together, which once tripped the coda cache's misuse guard)."""
    model = make_model(backbone, state_mode, seed=batch, gate_bias=-2.0, prelude_layers=1, coda_layers=1)
    g = torch.Generator().manual_seed(5 + batch)
    prompt = torch.randint(0, V, (batch, 5), generator=g)
    mask = None
    if batch > 1:
        mask = torch.ones(batch, 5, dtype=torch.long)
        mask[0, :2] = 0
    out = generate(model, prompt, 10, attention_mask=mask, return_logits=True, exits=ExitPolicy(threshold=Q, skip=handling))
    assert bool((out.exit_steps < R).any()) and len(out.exit_steps.unique()) > 1, "exits were meant to be mixed"
    _, want = reference_logits(model, out, prompt, mask, handling)
    torch.testing.assert_close(out.logits, want, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("backbone", ["mamba2", "hybrid"])
@torch.no_grad()
def test_ssm_handlings_leave_different_states(backbone):
    """ssm_skip and ssm_propagate are different rules: with the same exits the later tokens' logits differ,
    and both differ from running every loop for every token."""
    model = make_model(backbone, "vanilla", seed=3)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    steps = torch.randint(1, R + 1, (2, 12), generator=torch.Generator().manual_seed(4))
    steps[:, 0] = 1
    skip = forward_with_exits(model, ids, steps, "ssm_skip").logits
    prop = forward_with_exits(model, ids, steps, "ssm_propagate").logits
    full = logits_at_depth(model(ids, return_all_loops=True).loop_logits, steps)
    assert not torch.allclose(skip[:, 1:], prop[:, 1:], atol=1e-4)
    assert not torch.allclose(prop[:, 1:], full[:, 1:], atol=1e-4)
    # a token's own logits up to its exit never depend on the handling
    torch.testing.assert_close(skip[:, 0], prop[:, 0])
    # every token exiting at R is the ordinary forward, whatever the handling
    for h in HANDLINGS.names()[1:]:
        torch.testing.assert_close(forward_with_exits(model, ids, torch.full_like(steps, R), h).logits,
                                   model(ids).logits, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("backbone,state_mode", [("mamba2", "vanilla"), ("hybrid", "stateloop_mamba2"),
                                                 ("llama", "stateloop_mamba2")])
@pytest.mark.parametrize("handling", ["ssm_skip", "ssm_propagate"])
@torch.no_grad()
def test_never_exiting_skip_equals_plain_decoding(backbone, state_mode, handling):
    model = make_model(backbone, state_mode, gate_bias=-20.0, mamba_mlp=True)
    model.exit_gate.proj.weight.zero_()
    prompt = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(6))
    plain = generate(model, prompt, 8, return_logits=True)
    skip = generate(model, prompt, 8, return_logits=True, exits=ExitPolicy(threshold=0.9, skip=handling))
    assert torch.equal(skip.sequences, plain.sequences) and bool((skip.exit_steps == R).all())
    torch.testing.assert_close(skip.logits, plain.logits, atol=ATOL, rtol=1e-4)


def rows_per_loop(exit_steps: torch.Tensor, n_loops: int = R) -> list[int]:
    """The rows a decoding step with these exit steps (B,) computes at each loop it runs: those not yet exited."""
    counts = [int((exit_steps > r).sum()) for r in range(n_loops)]
    return [n for n in counts if n > 0]


@pytest.mark.parametrize("backbone,state_mode,handling", [("llama", "vanilla", "kv_copy"),
                                                          ("hybrid", "stateloop_mamba2", "ssm_propagate")])
@torch.no_grad()
def test_skip_decoding_computes_only_the_rows_still_running(backbone, state_mode, handling):
    """A decoding step runs loop r on the rows whose token has not exited before it, and no others: the shared
    block's layers receive exactly those rows, while the logits stay the reference's."""
    model = make_model(backbone, state_mode)
    # the gate reads a direction u that two tokens carry strongly: EARLY exits after loop 1, LATE never
    u = torch.nn.functional.normalize(torch.randn(32, generator=torch.Generator().manual_seed(0)), dim=0)
    EARLY, LATE = 1, 2
    model.embed.weight[EARLY] += 10 * u
    model.embed.weight[LATE] -= 10 * u
    model.exit_gate.proj.weight.copy_(2 * u[None])
    model.exit_gate.proj.bias.zero_()
    B, T = 4, 8
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(2))
    ids[0], ids[1], ids[2, ::2] = EARLY, LATE, EARLY
    policy = ExitPolicy(threshold=Q, skip=handling)
    ref = forward_with_exits(model, ids, None, handling, rule="gate", threshold=Q)
    assert bool((ref.exit_steps[0] == 1).all()) and bool((ref.exit_steps[1] == R).all())
    seen = []  # (rows, tokens) of every call of the block's first layer
    hook = model.block[0].register_forward_pre_hook(lambda layer, args: seen.append(tuple(args[0].shape[:2])))
    try:
        cache = model.allocate_cache(B, T)
        for t in range(T):  # teacher forcing: the reference's tokens, one step each
            seen.clear()
            skip = SkipDecoding(model, policy, R)
            logits, steps = decode_one_token(model, ids[:, t:t + 1], cache, exits=policy, skip=skip)
            assert torch.equal(steps, ref.exit_steps[:, t]), t
            torch.testing.assert_close(logits, ref.logits[:, t], atol=ATOL, rtol=1e-4)
            assert list(skip.block_rows) == [int((steps > r).sum()) for r in range(R)], t
            assert seen == [(n, 1) for n in rows_per_loop(steps)], t
            assert max(list(skip.block_rows)[1:]) < B  # row 0 has left after loop 1
        # generate: every step after the prefill computes only the rows still running
        seen.clear()
        out = generate(model, ids[:, :3], 5, exits=policy, return_logits=True)
        steps_rows = [(n, 1) for i in range(1, 5) for n in rows_per_loop(out.exit_steps[:, i])]
        assert seen == [(B, 3)] * R + steps_rows and len(steps_rows) < 4 * R
    finally:
        hook.remove()
    _, want = reference_logits(model, out, ids[:, :3], None, handling)
    torch.testing.assert_close(out.logits, want, atol=ATOL, rtol=1e-4)
    assert torch.equal(out.sequences[:, 3:], want.argmax(-1))  # greedy: the tokens are the reference's argmax


def test_handling_names_and_refusals():
    assert resolve_handling(True) == "kv_copy" and resolve_handling(False) is None and resolve_handling("none") is None
    assert resolve_handling("ssm_propagate") == "ssm_propagate"
    with pytest.raises(ValueError, match="'ssm_teleport'"):
        resolve_handling("ssm_teleport")
    ssm = make_model("hybrid", "vanilla")
    assert "ssm_skip" in skip_compute_unsupported(ssm.config, skip_compute=True)
    assert skip_compute_unsupported(ssm.config, skip_compute="ssm_skip") is None
    attn = make_model("llama", "stateloop")
    assert skip_compute_unsupported(attn.config, skip_compute="ssm_propagate") is None
    with pytest.raises(ValueError, match="ssm_skip"):
        generate(ssm, torch.zeros(1, 3, dtype=torch.long), 2, exits=ExitPolicy(threshold=0.5, skip=True))
    with pytest.raises(ValueError, match="needs exit_threshold"):
        generate(ssm, torch.zeros(1, 3, dtype=torch.long), 2, exits=ExitPolicy(skip="ssm_skip"))


def test_generate_cli_takes_a_handling():
    from looplab.generate import parse_args

    assert parse_args(["ckpt=x", "skip_compute=ssm_propagate"])["skip_compute"] == "ssm_propagate"
    assert parse_args(["ckpt=x", "skip_compute=true"])["skip_compute"] is True
    assert parse_args(["ckpt=x", "skip_compute=false"])["skip_compute"] is False


# ------------------------------------------------------------------ exit-aware fine-tuning
def test_exit_aware_loss_is_the_reference_at_sampled_exits():
    """The fine-tuning loss is the next-token loss of forward_with_exits at the sampled exit steps,
    and it trains every loop the exited tokens are seen through."""
    from looplab.training.module import LoopedLMModule, per_token_loss

    model = make_model("hybrid", "stateloop_mamba2")
    objective = {"exit_stage": None, "skip_train_prob": 0.5, "skip_handling": "ssm_propagate", "eval_thresholds": []}
    module = LoopedLMModule(model.config.to_dict(), {"lr": 1e-3}, objective)
    module.model.load_state_dict(model.state_dict())
    ids = torch.randint(0, V, (4, 12), generator=torch.Generator().manual_seed(5))
    targets = ids.roll(-1, 1)
    torch.manual_seed(9)
    loss = module.exit_aware_loss(ids, targets)
    torch.manual_seed(9)
    steps = module.sample_exit_steps(ids)
    assert bool((steps < R).any()) and bool((steps == R).any()) and int(steps.min()) >= 1
    want = per_token_loss(forward_with_exits(module.model, ids, steps, "ssm_propagate").logits, targets).mean()
    torch.testing.assert_close(loss, want)
    loss.backward()
    assert all(p.grad is not None for n, p in module.model.named_parameters() if not n.startswith("exit_gate."))


def test_exit_aware_fine_tuning_trains_and_refuses_bad_configs(tiny_overrides, tmp_path):
    from test_train import run_train

    from looplab.models import ConfigError

    res = run_train(tiny_overrides + ["dataset=phop", "backbone=mamba2_tiny", "++backbone.headdim=16", "loop_depth=1x3",
                                      "exit_gate.skip_compute=ssm_skip", "exit_gate.skip_train_prob=0.5"], tmp_path / "ft")
    assert res["status"] == "ok" and res["global_step"] == 6
    with pytest.raises(ConfigError, match="set exit_gate.skip_compute"):
        run_train(tiny_overrides + ["exit_gate.skip_train_prob=0.5"], tmp_path / "a")
    with pytest.raises(ConfigError, match=r"skip_train_prob=1\.5"):
        run_train(tiny_overrides + ["exit_gate.skip_train_prob=1.5"], tmp_path / "b")
    with pytest.raises(ConfigError, match="stage 2"):
        run_train(tiny_overrides + ["exit_gate=ouro", "exit_gate.skip_compute=kv_copy", "exit_gate.skip_train_prob=0.5"],
                  tmp_path / "c")
    with pytest.raises(ValueError, match="ssm_skip"):
        run_train(tiny_overrides + ["backbone=mamba2_tiny", "++backbone.headdim=16", "exit_gate.skip_compute=kv_copy",
                                    "exit_gate.skip_train_prob=0.5"], tmp_path / "d")


@pytest.mark.parametrize("backbone,state_mode,handling", [("llama", "stateloop", "kv_copy"), ("mamba2", "vanilla", "ssm_skip"),
                                                          ("hybrid", "stateloop_attn", "ssm_propagate"),
                                                          ("mamba2", "stateloop_mamba2", "ssm_propagate")])
@pytest.mark.parametrize("rule,threshold", [("gate", Q), ("entropy", 3.9), ("hidden_delta", 0.3)])
@torch.no_grad()
def test_online_reference_decides_exits_as_skip_decoding(backbone, state_mode, handling, rule, threshold):
    """forward_with_exits(rule=...) over a whole sequence = skip_compute decoding fed the same tokens one by one
    (teacher forcing): same exit steps, same logits. Table 10 measures quality with it, batched."""

    model = make_model(backbone, state_mode, seed=2)
    ids = torch.randint(0, V, (3, 14), generator=torch.Generator().manual_seed(8))
    ref = forward_with_exits(model, ids, None, handling, rule=rule, threshold=threshold)
    assert bool((ref.exit_steps < R).any()) and bool((ref.exit_steps == R).any()), "exits were meant to be mixed"
    cache = model.allocate_cache(3, 14)
    for t in range(14):
        logits, steps = decode_one_token(model, ids[:, t:t + 1], cache,
                                         exits=ExitPolicy(threshold=threshold, rule=rule, skip=handling))
        assert torch.equal(steps, ref.exit_steps[:, t]), t
        torch.testing.assert_close(logits, ref.logits[:, t], atol=ATOL, rtol=1e-4)


def test_exit_grid_on_a_trained_checkpoint(tiny_overrides, tmp_path):
    """bench/exit_grid.py (table 10's measurements) on a trained gated Mamba-2 p-hop run: every rule × threshold ×
    handling row; a rule that never exits keeps every decoder's accuracy equal; the summary has intervals."""
    from test_train import run_train

    from looplab.bench import exit_grid

    run_train(tiny_overrides + ["dataset=phop", "backbone=mamba2_tiny", "++backbone.headdim=16", "loop_depth=1x3",
                                "exit_gate=ouro"], tmp_path / "run")
    ckpts = exit_grid.checkpoints_in([tmp_path])
    assert len(ckpts) == 1
    grid = [("gate", 0.5), ("hidden_delta", 0.0), ("entropy", 1e9)]
    res = exit_grid.run_checkpoint(ckpts[0], n_quality=32, n_time=1, grid=grid)
    assert res["seed"] is not None and res["backbone"] == "mamba2" and res["training"] == "standard"
    assert [(r["rule"], r["handling"]) for r in res["rows"]] == [(rule, h) for rule, _ in grid for h in ("ssm_skip", "ssm_propagate")]
    for r in res["rows"]:
        assert r["answers"] > 0 and set(r["per_token_ms"]) == {"all_loops", "exact_exit", "skip"}
        if r["rule"] == "hidden_delta":  # a relative change below 0 never happens: every token runs every loop
            assert r["accuracy"]["skip"] == r["accuracy"]["exact_exit"] == r["accuracy"]["all_loops"]
            assert r["mean_exit_step"]["skip"] == 3
        if r["rule"] == "entropy":  # every token stops after loop 1
            assert r["mean_exit_step"]["skip"] == 1 and r["exit_histogram_skip"][0] == r["answers"]
    summary = exit_grid.summarize([res, {**res, "seed": 2}])
    assert len(summary) == 6 and all(s["accuracy_skip"]["n"] == 2 for s in summary)
    assert all(isinstance(s["meets_target"], bool) for s in summary)


@torch.no_grad()
def test_exit_grid_quality_scores_every_token_of_a_language_model_window():
    """Language-model rows (table 10's lm_tiny checkpoints): with every position scored, perplexity is exp of the mean
    next-token loss of the logits each decoder reads — loop R for all loops, loop 1 when every token exits there, and
    loop R again under a rule that never fires."""
    from looplab.bench import exit_grid

    torch.manual_seed(0)
    model = LoopedLM(LoopedLMConfig(vocab_size=50, d_model=32, n_heads=2, n_layers=1, n_loops=3, backbone="mamba2",
                                    d_state=8, headdim=16, chunk_size=8)).eval()
    g = torch.Generator().manual_seed(1)
    examples = [{"input_ids": torch.randint(0, 50, (12,), generator=g), "targets": torch.randint(0, 50, (12,), generator=g),
                 "answer_mask": torch.ones(12, dtype=torch.bool)} for _ in range(3)]
    ids, tgt = torch.stack([e["input_ids"] for e in examples]), torch.stack([e["targets"] for e in examples])
    loops = model(ids, return_all_loops=True).loop_logits

    def ppl(logits):
        return math.exp(float(torch.nn.functional.cross_entropy(logits.reshape(-1, 50), tgt.reshape(-1))))

    first = exit_grid.quality(model, examples, "entropy", 1e9, "ssm_skip", batch_size=2)  # every token stops at loop 1
    assert first["answers"] == 36 and first["mean_exit_step"]["skip"] == 1
    assert first["perplexity"]["all_loops"] == pytest.approx(ppl(loops[-1]), rel=1e-5)
    assert first["perplexity"]["skip"] == pytest.approx(ppl(loops[0]), rel=1e-5)
    assert first["perplexity"]["exact_exit"] == pytest.approx(ppl(loops[0]), rel=1e-5)
    never = exit_grid.quality(model, examples, "hidden_delta", 0.0, "ssm_propagate")
    assert never["perplexity"]["skip"] == pytest.approx(ppl(loops[-1]), rel=1e-5) and never["mean_exit_step"]["skip"] == 3
    assert math.log(never["perplexity"]["skip"]) == pytest.approx(never["loss"]["skip"])


def test_exit_grid_finds_the_checkpoints_of_moved_run_folders(tmp_path):
    """results.json records the checkpoint's absolute path; a sweep folder moved since keeps its checkpoint next to
    its results.json, and failed runs are left out."""
    from looplab.bench.exit_grid import checkpoints_in

    for name, status in (("0", "ok"), ("1", "failed")):
        run = tmp_path / "sweep" / name
        (run / "checkpoints").mkdir(parents=True)
        (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
        (run / "results.json").write_text(json.dumps({"status": status, "checkpoint": f"/elsewhere/{name}/last.ckpt"}))
    assert checkpoints_in([tmp_path / "sweep"]) == [tmp_path / "sweep" / "0" / "checkpoints" / "last.ckpt"]


def test_exit_grid_skips_one_loop_checkpoints(tmp_path):
    """Tables 5 and 7 hold N⊗1 runs next to the looped ones: nothing to exit, so no rows (and no data loaded)."""
    from looplab.bench import exit_grid
    from looplab.checkpoint import looplab_meta

    model = LoopedLM(LoopedLMConfig(vocab_size=20, d_model=16, n_heads=2, n_layers=2, n_loops=1))
    path = tmp_path / "run" / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "looplab": looplab_meta(model.config, {"name": "lm_tiny"})}, path)
    assert exit_grid.run_checkpoint(path) is None


def test_exit_grid_names_the_body_training_through_the_stage2_run(tmp_path):
    """A stage-2 gate's row says how the body it started from was trained (exit-aware vs standard)."""
    from looplab.bench.exit_grid import body_training

    def run(name, gate):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        (tmp_path / name / "results.json").write_text(json.dumps({"config": {"exit_gate": gate}}))
        return str(tmp_path / name / "checkpoints" / "last.ckpt")

    aware = run("aware", {"name": "none", "skip_train_prob": 0.5, "skip_compute": "ssm_skip"})
    plain = run("plain", {"name": "none", "skip_train_prob": 0.0, "skip_compute": False})
    assert body_training(run("s2_aware", {"name": "ouro", "stage": "stage2", "init_from": aware})) == "exit-aware (ssm_skip, p=0.5)"
    assert body_training(run("s2_plain", {"name": "ouro", "stage": "stage2", "init_from": plain})) == "standard"
    assert body_training(aware) == "exit-aware (ssm_skip, p=0.5)" and body_training(tmp_path / "nowhere.ckpt") == "standard"


@pytest.mark.parametrize("backbone,state_mode,handling,injection", [
    ("llama", "stateloop", "kv_copy", "add"), ("mamba2", "vanilla", "ssm_skip", "concat"),
    ("hybrid", "stateloop_mamba2", "ssm_propagate", "diag")])
@pytest.mark.parametrize("n_loops", [3, 6])
@torch.no_grad()
def test_skip_compute_with_test_time_depth_and_injection(backbone, state_mode, handling, injection, n_loops):
    """Skip decoding composes with the depth knobs (docs/formulations.md#depth-as-a-knob): at R′ ≠ R and with input injection, cached skip
    decoding equals the online reference at R′."""

    torch.manual_seed(0)
    cfg = make_model(backbone, state_mode).config.to_dict() | {"injection": injection}
    model = LoopedLM(LoopedLMConfig.from_dict(cfg)).eval()
    for p in model.inject.parameters():
        p.normal_(0, 0.1)
    model.exit_gate.proj.weight.normal_(0, 1 / 32**0.5)
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(1))
    lp = torch.log_softmax(model(ids, n_loops=n_loops, return_all_loops=True).loop_logits[1], -1)
    tau = float((-(lp.exp() * lp).sum(-1)).median())  # about half the tokens stop by loop 2
    ref = forward_with_exits(model, ids, None, handling, rule="entropy", threshold=tau, n_loops=n_loops)
    assert ref.loop_logits.shape[0] == n_loops and bool((ref.exit_steps < n_loops).any())
    cache = model.allocate_cache(2, 10, n_loops=n_loops)
    for t in range(10):
        logits, steps = decode_one_token(model, ids[:, t:t + 1], cache, n_loops=n_loops,
                                         exits=ExitPolicy(threshold=tau, rule="entropy", skip=handling))
        assert torch.equal(steps, ref.exit_steps[:, t])
        torch.testing.assert_close(logits, ref.logits[:, t], atol=ATOL, rtol=1e-4)
    # never exiting, the reference is the model's own forward at R′
    full = forward_with_exits(model, ids, torch.full((2, 10), n_loops), handling, n_loops=n_loops)
    torch.testing.assert_close(full.logits, model(ids, n_loops=n_loops).logits, atol=ATOL, rtol=1e-4)
