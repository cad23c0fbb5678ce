"""python -m looplab.plan (docs/scale.md): it writes its figures, it proposes what fits, it counts causal attention as
causal, and it agrees with a real run.

The real run is `python -m looplab.train` of a tiny looped llama under FSDP2 on 2 CPU processes (gloo) with gradient
accumulation, given a callback (tests/plan_probe.py) that counts its second optimizer step with the plan's collective
counter and torch's FSDPMemTracker. It starts first and runs while the other tests run here; the comparison with it
is the file's last test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT

# 2⊗2 llama, d 64, FSDP2 over 2 ranks, 4 sequences per rank per micro-batch, 2 micro-batches per optimizer step
TINY = ["+experiment=phop_tiny", "loop_depth=2x2", "hardware=fsdp", "trainer.accelerator=cpu", "trainer.devices=2",
        "dataset.batch_size=16", "trainer.accumulate_grad_batches=2", "backbone.d_model=64", "backbone.n_heads=2",
        "backbone.ffn_hidden=128", "logger=none"]
REAL_ONLY = ["trainer.max_steps=2", "trainer.limit_val_batches=0", "test_after_fit=false", "trainer.enable_progress_bar=false",
             "trainer.enable_model_summary=false", "checkpoint_every_n_steps=1000"]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """The real run, started in the background; call the fixture's value to wait for its two ranks' counts."""
    out = tmp_path_factory.mktemp("plan_real_run")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "looplab.train", *TINY, *REAL_ONLY, f"hydra.run.dir={out / 'run'}",
           "+callbacks.probe._target_=plan_probe.PlanProbe", f"+callbacks.probe.out={out / 'probe'}"]
    proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = {}

    def wait():
        if not result:
            log = proc.communicate(timeout=1800)[0]
            assert proc.returncode == 0, log[-4000:]
            result["ranks"] = [json.loads((out / "probe" / f"rank{r}.json").read_text()) for r in (0, 1)]
        return result["ranks"]

    yield wait
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def tiny_plan(real_run, tmp_path_factory):
    """`python -m looplab.plan` of the real run's overrides (its CLI, in this process), read back from plan.out."""
    from looplab.plan.__main__ import main

    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main([*TINY, "plan.gpu=h100", f"plan.out={path}"]) == 0
    return json.loads(path.read_text())


def test_plan_writes_its_figures(tiny_plan):
    from looplab.plan import REQUIRED_KEYS

    p = tiny_plan
    assert set(REQUIRED_KEYS) <= set(p)
    assert p["fits"] is True and 0 < p["peak_bytes"] < p["capacity_bytes"]
    assert p["capacity_bytes"] == 81_559 * 2**20 - 2 * 2**30  # the H100's memory less the default reserve
    assert set(p["breakdown"]) == {"parameters", "gradients", "optimizer_state", "activations", "temporaries"}
    assert sum(p["breakdown"].values()) == p["peak_bytes"]
    assert all(p["breakdown"][k] > 0 for k in ("parameters", "optimizer_state", "activations"))
    # 8 sequences per micro-batch over 2 ranks, 2 micro-batches per optimizer step
    assert (p["micro_batch"], p["grad_accum"], p["global_batch"], p["world_size"]) == (4, 2, 16, 2)
    assert p["collective_bytes_per_step"] == sum(c["bytes"] for c in p["collectives"].values()) > 0
    assert p["flops_per_step"] == 2 * p["flops_per_gpu_step"] > 0
    assert p["recompute_flops_per_step"] == 0  # no activation checkpointing
    assert 0 < p["est_step_s"] and 0 < p["est_mfu"] < 1 and p["est_tokens_per_s"] > 0
    assert p["est_step_s"] == pytest.approx(p["est_compute_s"] + p["est_comm_s"])
    assert p["precision"] == "32-true" and p["strategy"] == "fsdp2"


def test_plan_says_by_how_much_and_proposes_what_fits(monkeypatch):
    """A card one byte too small: over by that byte, and the largest micro-batch that fits at the same global batch
    (a 1⊗1 model: the search measures several steps)."""
    import looplab.plan as planner
    from looplab.plan import compose, plan

    settings = planner.ac_candidates()[:2]  # off and the first mode: the search is the same for every setting
    monkeypatch.setattr(planner, "ac_candidates", lambda: settings)
    one = [*TINY, "loop_depth=1x1"]
    fitting = plan(compose([*one, "plan.propose=false"]))
    memory_gib = (fitting["peak_bytes"] - 1) / 2**30
    p = plan(compose([*one, f"plan.memory_gib={memory_gib!r}", "plan.reserve_gib=0"]))
    assert not p["fits"] and 0 < p["over_by_bytes"] <= 2 and p["peak_bytes"] == fitting["peak_bytes"]
    prop = p["proposal"]
    best = prop["best"]
    assert prop["global_batch"] == 16 and best["fits"] and best["peak_bytes"] <= p["capacity_bytes"]
    assert best["micro_batch"] * best["grad_accum"] == 8  # sequences per rank per optimizer step, kept
    plain = [t for t in prop["tried"] if t["activation_checkpointing"] is False]
    assert {t["micro_batch"]: t["fits"] for t in plain}[4] is False  # the configured micro-batch: one byte over
    assert max(t["micro_batch"] for t in plain if t["fits"]) == 2  # the largest divisor below it fits
    assert any(t["activation_checkpointing"] is not False for t in prop["tried"])  # activation checkpointing tried too
    assert f"dataset.micro_batch={best['micro_batch']}" in best["overrides"]


@pytest.mark.parametrize("causal", [True, False])
def test_attention_flops_count_the_causal_mask(causal):
    """SDPA's FLOPs, forward and backward, against the analytic count over the query-key pairs the mask keeps
    (torch's counter counts all S² pairs, and nothing at all for the CPU kernel)."""
    from looplab.plan.cost import StepCounter, causal_pairs

    B, H, S, D = 2, 3, 16, 8
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    with StepCounter() as fwd:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with StepCounter() as bwd:
        out.sum().backward()
    pairs = S * (S + 1) // 2 if causal else S * S
    assert fwd.flops == 2 * B * H * pairs * (D + D)  # scores QKᵀ and output PV
    assert bwd.flops == 2 * B * H * pairs * (3 * D + 2 * D)  # scores recomputed, dP, dV, dQ, dK (torch's convention)


def test_causal_pairs_match_the_mask():
    from looplab.plan.cost import causal_pairs

    for s_q, s_k in [(1, 1), (16, 16), (4, 6), (6, 4), (7, 3)]:
        assert causal_pairs(s_q, s_k) == int(torch.ones(s_q, s_k).tril().sum())


def test_collective_time_uses_the_link_the_group_crosses():
    from looplab.plan.cost import collective_seconds
    from looplab.plan.gpus import GPUS

    h100 = GPUS["h100"]
    one_node = collective_seconds("all_gather", 8e9, list(range(8)), world=16, per_node=8, gpu=h100)
    two_nodes = collective_seconds("all_gather", 8e9, list(range(16)), world=16, per_node=8, gpu=h100)
    assert one_node == pytest.approx(7 / 8 * 8e9 / h100.nvlink_bytes_per_s)
    assert two_nodes == pytest.approx(15 / 16 * 8e9 / h100.internode_bytes_per_s)
    assert collective_seconds("all_reduce", 8e9, list(range(8)), 8, 8, h100) == pytest.approx(2 * one_node)


def test_a_paper_table_is_planned_run_by_run():
    """`python -m looplab.tables plan 1 --scale paper`: every configuration of table 1, with run's overrides, composes."""
    from looplab.plan import compose
    from looplab.plan.table import table_runs

    runs = table_runs(1, "paper")
    assert len(runs) == 10  # 5 arms x 2 sizes
    assert runs[-1][1] == ["+experiment=stateloop_main", "+arm=stateloop_mamba2", "backbone=llama_1.4b"]
    for name, overrides in runs[::9]:
        cfg = compose([*overrides, "trainer.devices=8"])
        assert cfg.hardware.name == "fsdp" and cfg.dataset.name == "pile", name


def test_tables_plan_plans_every_run_of_a_table(tmp_path):
    """`python -m looplab.tables plan 3 --scale tiny` (table 3 has two tiny runs): each planned, all written."""
    from looplab.plan import REQUIRED_KEYS
    from looplab.tables.__main__ import main

    out = tmp_path / "table3-plan.json"
    assert main(["plan", "3", "--scale", "tiny", "--no-propose", "--out", str(out)]) == 0
    planned = json.loads(out.read_text())
    assert [p["run"] for p in planned] == ["stateloop_reset_tiny[arm=stateloop]", "stateloop_reset_tiny[arm=stateloop_reset]"]
    for p in planned:
        assert set(REQUIRED_KEYS) <= set(p) and p["fits"] and p["accelerator"] == "cpu"


def test_plan_agrees_with_the_real_run(tiny_plan, real_run):
    """The same collectives (kind, count, bytes) and FLOPs per optimizer step, and the peak within 10%."""
    ranks = real_run()
    assert ranks[0]["collectives"] == ranks[1]["collectives"]
    real = ranks[0]
    # nothing in the step waits on the host under NCCL: no barrier (Lightning's sync_dist=True logging put one in every
    # micro-batch), and Lightning's SIGTERM flag is broadcast on the host (callbacks.HostSigtermFlag)
    assert "barrier" not in real["collectives"], real["collectives"]
    assert real["sigterm_on_host"] and ranks[1]["sigterm_on_host"]
    assert tiny_plan["collectives"] == real["collectives"]
    assert tiny_plan["collective_bytes_per_step"] == real["collective_bytes"]
    assert tiny_plan["flops_per_gpu_step"] == real["flops"]
    assert abs(tiny_plan["peak_bytes"] - real["peak_bytes"]) <= 0.1 * real["peak_bytes"], (tiny_plan["peak_bytes"], real)


def test_the_scale_table_is_the_plans_and_every_llama_preset_fits():
    """docs/scale.md's preset table is rendered from docs/scale_plans.json (python -m looplab.plan.presets), covers
    every preset on both topologies, and every LLaMA paper preset fits one 8×H100 node at its global batch."""
    from looplab.plan.presets import END, PRESETS, START, TOPOLOGIES, render

    data = json.loads((ROOT / "docs" / "scale_plans.json").read_text())
    doc = (ROOT / "docs" / "scale.md").read_text()
    assert doc.split(START, 1)[1].split(END, 1)[0].strip() == render(data).strip()
    rows = {(r["preset"], r["nodes"], r["devices_per_node"]): r for r in data["rows"]}
    assert set(rows) == {(name, n, g) for name, _ in PRESETS for n, g in TOPOLOGIES}
    for (name, nodes, devices), r in rows.items():
        assert "error" not in r, r
        assert r["global_batch"] == 256 and r["micro_batch"] * r["grad_accum"] * nodes * devices == 256
        if not name.startswith(("mamba2", "hybrid")):
            assert r["fits"] and r["peak_bytes"] <= r["capacity_bytes"], (name, nodes, r["peak_bytes"])
        assert 0 < r["est_mfu"] < 1 and r["est_days"] > 0


def test_selective_checkpointing_runs_under_fsdp_with_mamba2_fp32_units(tmp_path):
    """Mamba-2 under bf16 all-gathers keeps its fp32 parameters in an FSDP2 unit of their own, nested in the layer:
    its all-gather runs inside a selectively checkpointed region, in the recompute but not in the forward (R = 1:
    FSDP2's own schedule). torch's SAC refused it ("fsdp.split_with_sizes_copy.default encountered during backward
    but not found in storage"), so `hardware.activation_checkpointing=selective` crashed every Mamba-2 and hybrid
    FSDP run at its first backward; models/checkpointing.py lets communication through."""
    from looplab.plan.__main__ import main

    path = tmp_path / "plan.json"
    assert main(["+experiment=lm_tiny", "backbone=mamba2_tiny", "loop_depth=4x1", "hardware=fsdp", "trainer.devices=2",
                 "hardware.activation_checkpointing=selective", "dataset.batch_size=8",
                 "trainer.accumulate_grad_batches=2", "plan.propose=false", f"plan.out={path}"]) == 0
    p = json.loads(path.read_text())
    assert p["activation_checkpointing"] == "selective" and p["fits"] and p["peak_bytes"] > 0
