"""Per-loop diagnostics (eval/diagnostics.py, docs/evaluation.md#per-loop-diagnostics): each measure recomputed by hand
from a loop run outside the model, the effective rank on synthetic matrices, the identities they must satisfy (an
identity block moves nothing; a constant sequence has no offset cost), left padding excluded, batches combined by
token weight, and the wiring: `python -m looplab.eval --diagnostics` and the training module's `val_diag/*`."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from looplab.data.tasks import TaskDataModule
from looplab.eval.__main__ import main
from looplab.eval.diagnostics import MEASURES, _kl_sum, diagnose, effective_rank, loop_diagnostics, loop_states
from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.config import RouterConfig
from looplab.training.module import LoopedLMModule
from test_eval_cli import gated_checkpoint  # noqa: F401  (a pytest fixture: a tiny gated checkpoint in a run folder)

V = 40


@pytest.fixture(autouse=True)
def _one_thread(one_thread_module):
    yield


def tiny(**kw) -> LoopedLM:
    torch.manual_seed(0)
    return LoopedLM(LoopedLMConfig(**{"vocab_size": V, "d_model": 32, "n_heads": 2, "n_layers": 1, "n_loops": 3,
                                      "max_seq_len": 64, **kw})).eval()


def close(a: dict, b: dict, tol: float = 1e-5) -> None:
    for k in MEASURES:
        assert (k in a) == (k in b), k
        for r, (x, y) in enumerate(zip(a.get(k, []), b.get(k, [])), start=1):
            assert (x is None) == (y is None), (k, r)
            if x is not None:
                assert x == pytest.approx(y, rel=tol, abs=tol), (k, r)


def same(a: list, b: list, tol: float = 1e-5) -> bool:
    """Two per-loop lists equal within tol, None at the same loops."""
    return len(a) == len(b) and all((x is None) == (y is None) and (x is None or x == pytest.approx(y, rel=tol, abs=tol))
                                    for x, y in zip(a, b))


def mean_norm(x, m):
    return float(x.norm(dim=-1)[m].double().mean())


@torch.no_grad()
def test_every_measure_matches_a_loop_run_by_hand():
    """A vanilla llama: the block applied by hand R + 1 times (not through the model's loop driver); the logit
    lens against the model's own per-depth logits (`return_all_loops`)."""
    model = tiny()
    R = 3
    ids = torch.randint(0, V, (2, 12))
    d = loop_diagnostics(model, ids)
    assert d["n_loops"] == R and "exit_lambda" not in d and isinstance(d["position"], str)

    positions = torch.arange(ids.shape[1])[None]
    x = model.embed(ids)
    hs = [x]  # h^(0) = e
    for _ in range(R + 1):
        for layer in model.block:
            x = layer(x, positions, None, None)
        hs.append(x)
    m = torch.ones(ids.shape, dtype=torch.bool)
    lp = [F.log_softmax(model.head(model.final_norm(h)), -1) for h in hs]
    out = model(ids, return_all_loops=True)
    assert torch.allclose(out.loop_logits, torch.stack([model.head(model.final_norm(h)) for h in hs[1:R + 1]]),
                          atol=1e-5)
    for r in range(1, R + 1):
        i = r - 1
        gap = (hs[r + 1] - hs[r]).norm(dim=-1).mean()
        assert d["fixed_point_gap"][i] == pytest.approx(float(gap), rel=1e-5)
        assert d["fixed_point_gap_rel"][i] == pytest.approx(float(gap) / mean_norm(hs[r], m), rel=1e-5)
        sv = torch.linalg.svdvals((hs[r] - hs[r].mean((0, 1))).reshape(-1, 32).double())
        p = sv / sv.sum()
        assert d["effective_rank"][i] == pytest.approx(math.exp(float(-(p * p.log()).sum())), rel=1e-5)
        if r == 1:
            for k in ("step", "step_rel", "update_cos", "logit_lens_kl", "offset_cost", "offset_cost_rel"):
                assert d[k][i] is None, k
            continue
        step = (hs[r] - hs[r - 1]).norm(dim=-1).mean()
        assert d["step"][i] == pytest.approx(float(step), rel=1e-5)
        assert d["step_rel"][i] == pytest.approx(float(step) / mean_norm(hs[r - 1], m), rel=1e-5)
        kl = (lp[r].exp() * (lp[r] - lp[r - 1])).sum(-1).mean()
        ref = F.kl_div(F.log_softmax(out.loop_logits[i - 1], -1), F.log_softmax(out.loop_logits[i], -1),
                       log_target=True, reduction="none").sum(-1).mean()
        assert d["logit_lens_kl"][i] == pytest.approx(float(kl), rel=1e-4) == pytest.approx(float(ref), rel=1e-4)
        a, b = (model.final_norm(h).reshape(-1, 32) for h in (hs[r], hs[r - 1]))
        assert _kl_sum(model.head, a, b, max_elements=5 * V) == pytest.approx(float(kl) * 24, rel=1e-4)  # 5-token chunks
        hp = hs[r - 1]
        omega = (hp[:, 1:] - hp[:, :-1]).norm(dim=-1).mean()
        assert d["offset_cost"][i] == pytest.approx(float(omega), rel=1e-5)
        assert d["offset_cost_rel"][i] == pytest.approx(float(omega) / float(hp[:, 1:].norm(dim=-1).mean()), rel=1e-5)
        if r >= 3:
            cos = F.cosine_similarity(hs[r] - hs[r - 1], hs[r - 1] - hs[r - 2], dim=-1).mean()
            assert d["update_cos"][i] == pytest.approx(float(cos), rel=1e-5)
        else:
            assert d["update_cos"][i] is None


def test_loop_states_are_the_forwards_readouts():
    """StateLoop with a prelude and a coda: loop r's readout h_r + W_o s_r, decoded through the coda, is the forward's
    depth-r prediction; h^(0) is the prelude's output."""
    model = tiny(state_mode="stateloop", prelude_layers=1, coda_layers=1)
    ids = torch.randint(0, V, (2, 10))
    st = loop_states(model, ids, n_loops=4)
    assert st.n_loops == 4 and st.valid is None and st.h(0) is st.e
    with torch.no_grad():
        out = model(ids, return_all_loops=True, n_loops=4)
        lens = torch.stack([model.logits_at(z, r, st.positions, None) for r, z in enumerate(st.readouts)])
    assert torch.allclose(lens, out.loop_logits, atol=1e-5)


def test_exit_lambda_is_the_gates_mean():
    model = tiny(exit_gate="ouro")
    torch.nn.init.normal_(model.exit_gate.proj.weight, std=2.0)
    ids = torch.randint(0, V, (3, 8))
    d = loop_diagnostics(model, ids)
    with torch.no_grad():
        lam = torch.sigmoid(model(ids, return_all_loops=True).exit_gate_logits).mean((0, 1))  # (R,)
    assert d["exit_lambda"] == pytest.approx(lam.tolist(), rel=1e-5)


def test_loop_gate_is_the_gswa_gates_mean():
    """With the query weights at zero, G-SWA's gate is σ(b_h) at every token: the measure is the heads' mean of
    σ(b) at loops ≥ 2 (left padding excluded), absent for kv=own and for sequential models."""
    model = tiny(n_heads=4, n_layers=2, loop_schedule="parallel", loop_kv="gswa", loop_window=3)
    bias = torch.tensor([-2.0, -0.5, 0.5, 3.0])
    with torch.no_grad():
        for i, layer in enumerate(model.block):
            layer.attn.loop_gate.weight.zero_()
            layer.attn.loop_gate.bias.copy_(bias + i)  # each layer its own gate: the measure averages the layers
    ids, mask = torch.randint(0, V, (2, 9)), torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    want = float(torch.stack([torch.sigmoid(bias), torch.sigmoid(bias + 1)]).mean())
    d = loop_diagnostics(model, ids, mask)
    assert d["loop_gate"][0] is None and d["loop_gate"][1:] == pytest.approx([want, want], rel=1e-6)
    assert "loop_gate" not in loop_diagnostics(tiny(loop_schedule="parallel", loop_kv="own"), ids)
    assert "loop_gate" not in loop_diagnostics(tiny(), ids)


def test_an_identity_block_moves_nothing():
    """Zero residual writers: every loop returns its input, so step, gap and logit-lens KL are 0 (KL(p‖p) = 0) and the
    effective rank is the same at every loop. R = 1: only the loop-1 measures, the gap from a loop 2."""
    model = tiny()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("out_proj.weight", "down_proj.weight")):
                p.zero_()
    ids = torch.randint(0, V, (2, 9))
    d = loop_diagnostics(model, ids)
    assert d["step"][1:] == [0.0, 0.0] and d["fixed_point_gap"] == [0.0] * 3
    assert d["logit_lens_kl"][1:] == pytest.approx([0.0, 0.0], abs=1e-7)
    assert d["effective_rank"] == pytest.approx([d["effective_rank"][0]] * 3, rel=1e-9)
    one = loop_diagnostics(model, ids, n_loops=1)
    assert one["n_loops"] == 1 and one["step"] == [None] and one["fixed_point_gap"] == [0.0]


def test_effective_rank_of_synthetic_matrices():
    torch.manual_seed(1)
    N, d, k = 300, 24, 5
    ones = torch.ones(N, 1, dtype=torch.float64) / math.sqrt(N)
    q, _ = torch.linalg.qr(torch.cat([ones, torch.randn(N, k, dtype=torch.float64)], 1))
    basis, _ = torch.linalg.qr(torch.randn(d, k, dtype=torch.float64))
    x = q[:, 1:] @ basis.T * 3.0 + torch.randn(d, dtype=torch.float64)  # k equal singular values, zero-mean columns + a shift
    assert effective_rank(x) == pytest.approx(k, abs=1e-6)
    assert effective_rank(x.float()) == pytest.approx(k, abs=1e-3)
    skewed = (torch.randn(N, k) * torch.tensor([10.0, 3, 1, 0.3, 0.1])) @ torch.randn(k, d)  # rank k, unequal σ
    assert 1.0 < effective_rank(skewed) < k
    assert effective_rank(torch.randn(N, 1) @ torch.randn(1, d)) == pytest.approx(1.0, abs=1e-3)
    assert effective_rank(torch.ones(N, d)) == 0.0 and effective_rank(torch.randn(1, d)) == 0.0


def test_a_constant_sequence_has_no_offset_cost():
    """Every position holds the same token: attention averages identical values, so every loop's state is the same at
    every position (Ω = 0, rank 0), while the loops still move it."""
    model = tiny()
    d = loop_diagnostics(model, torch.full((2, 10), 7))
    assert d["offset_cost"][1:] == pytest.approx([0.0, 0.0], abs=1e-6)
    assert d["offset_cost_rel"][1:] == pytest.approx([0.0, 0.0], abs=1e-6)
    assert d["effective_rank"] == pytest.approx([0.0] * 3, abs=1e-3)
    assert d["step"][1] > 1e-3


@pytest.mark.parametrize("kw", [{}, {"state_mode": "stateloop", "prelude_layers": 1, "coda_layers": 1, "exit_gate": "ouro",
                                     "injection": "add"}], ids=["vanilla", "stateloop_gated_prelude_coda"])
def test_left_padding_is_excluded(kw):
    model = tiny(**kw)
    row = torch.randint(1, V, (1, 9))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), row], 1)
    mask = torch.cat([torch.zeros(1, 4), torch.ones(1, 9)], 1).long()
    got, alone = loop_diagnostics(model, padded, mask), loop_diagnostics(model, row)
    assert all(len(got[k]) == len(alone[k]) > 0 for k in ("step", "effective_rank", "offset_cost"))
    close(got, alone)
    # the comparison can fail: with the pads counted (no mask) the measures move
    counted = loop_diagnostics(model, padded)
    assert not all(same(counted[k], alone[k]) for k in ("step", "effective_rank", "offset_cost"))


def test_batches_combine_by_token_weight():
    model = tiny()
    a, b = torch.randint(0, V, (2, 8)), torch.randint(0, V, (3, 8))
    both = diagnose(model, [{"input_ids": a}, {"input_ids": b}])
    whole = loop_diagnostics(model, torch.cat([a, b]))
    assert both["batches"] == 2 and both["tokens"] == 40
    for k in ("step", "step_rel", "update_cos", "fixed_point_gap", "logit_lens_kl", "offset_cost", "offset_cost_rel"):
        assert same(both[k], whole[k]), k
    ea, eb = loop_diagnostics(model, a)["effective_rank"], loop_diagnostics(model, b)["effective_rank"]
    assert both["effective_rank"] == pytest.approx([(2 * x + 3 * y) / 5 for x, y in zip(ea, eb)], rel=1e-6)
    close(diagnose(model, [a, b], max_batches=1), loop_diagnostics(model, a))


def test_a_routed_model_has_no_loop_beyond_r():
    model = tiny(depth_router=RouterConfig(name="expert_choice"))
    d = loop_diagnostics(model, torch.randint(0, V, (2, 8)))
    assert d["fixed_point_gap"][-1] is None and all(v is not None for v in d["fixed_point_gap"][:-1])
    assert d["fixed_point_gap"][0] == pytest.approx(d["step"][1])
    with pytest.raises(ValueError, match="n_loops=4"):
        loop_diagnostics(model, torch.randint(0, V, (2, 8)), n_loops=4)


def test_eval_cli_writes_diagnostics(gated_checkpoint, tmp_path):  # noqa: F811
    path, model, dm = gated_checkpoint
    out = tmp_path / "eval"
    report = main([str(path), "--diagnostics", "--max-batches", "1", "--thresholds", "0.5", "--out", str(out)])
    on_disk = json.loads((out / "eval.json").read_text())["diagnostics"]
    assert on_disk["n_loops"] == 3 and on_disk["batches"] == 1 and len(on_disk["exit_lambda"]) == 3
    dm.setup("test")
    expected = diagnose(model, dm.test_dataloader(), max_batches=1)
    close(on_disk, expected)
    assert report["diagnostics"]["tokens"] == expected["tokens"]
    assert (out / "loop_diagnostics.png").stat().st_size > 0


def test_validation_logs_val_diag():
    dm = TaskDataModule(task="phop", task_args={"n": 16, "p": 2, "alphabet": 4}, batch_size=8, val_size=16, test_size=8)
    cfg = LoopedLMConfig(vocab_size=dm.vocab_size, d_model=32, n_heads=2, n_layers=1, n_loops=3, max_seq_len=64)
    objective = {"exit_stage": None, "eval_thresholds": [], "eval_per_depth": True}
    trainer_kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, limit_val_batches=1)
    torch.manual_seed(0)
    module = LoopedLMModule(cfg.to_dict(), {"lr": 1e-3}, objective)
    trainer = L.Trainer(**trainer_kw)
    trainer.validate(module, datamodule=dm, verbose=False)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_diag/")}
    batch = next(iter(dm.val_dataloader()))
    expected = loop_diagnostics(module.model, batch["input_ids"])
    names = {f"val_diag/{k}_loop{r}": v for k in MEASURES if k in expected
             for r, v in enumerate(expected[k], start=1) if v is not None}
    assert set(logged) == set(names) and "val_diag/step_loop2" in logged and "val_diag/step_loop1" not in logged
    for k, v in names.items():
        assert logged[k] == pytest.approx(v, rel=1e-5), k

    off = LoopedLMModule(cfg.to_dict(), {"lr": 1e-3}, objective, loop_diagnostics=False)
    trainer = L.Trainer(**trainer_kw)
    trainer.validate(off, datamodule=dm, verbose=False)
    assert not [k for k in trainer.callback_metrics if k.startswith("val_diag/")]
    assert "val/loss" in trainer.callback_metrics


def test_the_config_switch_reaches_the_module(tiny_overrides):
    from conftest import compose
    from looplab.train import build_run

    assert compose(tiny_overrides).loop_diagnostics is True
    assert build_run(compose(tiny_overrides + ["loop_diagnostics=false"])).module.log_loop_diagnostics is False
