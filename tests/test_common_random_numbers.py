"""Common random numbers: the paired arms of every finding share their initial values and batches.

For every finding of the tiny tables whose arms are trained side by side, both arms are built at one
seed through `looplab.train.build_run` (what `python -m looplab.train` runs), the arms paired exactly
as the report pairs them (tables.report.comparisons). Every parameter the two arms share by name and
shape must start from the same values (a residual writer whose std is scaled by the depth from the same
standard draws, scaled), and the first training batches must be identical. Parameters only one arm has
(state branch, injection, gate) must not move any other parameter's values (tests of models/rng.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose

from looplab.models import LoopedLM, LoopedLMConfig
from looplab.models.rng import named_seed
from looplab.tables import report, spec

SEED = 7
# Tables whose findings pair arms trained from scratch. Table 4 times random-weight models (one process,
# one seed); table 8's stage-2 arm warm-starts from the fixed-loop run, so it shares its weights by construction;
# table 10 has no findings.
PAIRED_TABLES = [n for n, t in spec.TABLES.items() if t.findings and n not in (4, 8)]
RESIDUAL_WRITERS = ("out_proj.weight", "down_proj.weight")


def _arm_units(table: int) -> list[report.Unit]:
    """One unit per configuration of the table's tiny sweeps, its composed config in data['cfg']."""
    units = []
    for sw in spec.get(table).sweeps_for("tiny"):
        for combo in sw.grid(seeds=[SEED]):
            cfg = compose([f"+experiment={sw.experiment}", *sw.combo_overrides(combo), *sw.fixed, "logger=none"])
            cell = report.Cell(sw, combo, [], [])
            ld = cfg.loop_depth
            model = {"layers": int(ld.layers), "loops": int(ld.loops), "loop_schedule": str(ld.schedule),
                     **({"loop_kv": str(ld.kv)} if ld.schedule == "parallel" else {})}  # as results.json records them
            run = report.Run(path=None, data={"model": model})
            units.append(report.Unit(report.run_facets(cell, run), str(SEED), {"cfg": cfg}))
    return units


def _pairs(table: int):
    units = _arm_units(table)
    seen = set()
    for fd in spec.get(table).findings:
        for _, arms, terms in report.comparisons(fd, units):
            assert not isinstance(terms, str), f"table {table}, {fd.label}: {terms}"
            # (A, B) and, for a difference in differences, (A′, B′): the pairs whose difference is taken
            for a, b in ((terms[0], terms[1]),) + (((terms[2], terms[3]),) if len(terms) == 4 else ()):
                key = (id(a[1][0]), id(b[1][0]))
                if key not in seen:
                    seen.add(key)
                    yield f"table {table} {fd.label}: {arms}", a[1][0].data["cfg"], b[1][0].data["cfg"]


ALL_PAIRS = [p for n in PAIRED_TABLES for p in _pairs(n)]


def _residual_std(cfg) -> float:
    m = cfg.config
    std = m.init_std or math.sqrt(2 / (5 * m.d_model))
    return std / math.sqrt(2 * (m.prelude_layers + m.n_layers * m.n_loops + m.coda_layers))


def _first_batches(dm, n: int = 2) -> list[dict[str, torch.Tensor]]:
    dm.prepare_data()
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(n)]


def test_every_paired_finding_is_covered():
    assert len(ALL_PAIRS) >= 15  # tables 1, 2, 3, 5, 6, 7, 9, 12 and 13: every compared pair of configurations
    assert {int(label.split()[1]) for label, *_ in ALL_PAIRS} == set(PAIRED_TABLES)


@pytest.mark.slow
@pytest.mark.parametrize("label,cfg_a,cfg_b", ALL_PAIRS, ids=[p[0] for p in ALL_PAIRS])
def test_paired_arms_share_initial_values_and_batches(label, cfg_a, cfg_b):
    from looplab.train import build_run

    a, b = build_run(cfg_a), build_run(cfg_b)
    ma, mb = a.module.model, b.module.model
    sa, sb = dict(ma.named_parameters()), dict(mb.named_parameters())
    shared = [k for k in sa if k in sb and sa[k].shape == sb[k].shape]
    assert shared, label
    scale_a, scale_b = _residual_std(ma), _residual_std(mb)
    for k in shared:
        if k.endswith(RESIDUAL_WRITERS) and scale_a != scale_b:  # the same standard draws, scaled by the depth
            torch.testing.assert_close(sa[k] / scale_a, sb[k] / scale_b, msg=f"{label}: {k}")
        else:
            assert torch.equal(sa[k], sb[k]), f"{label}: shared parameter {k} differs"
    for x, y in zip(_first_batches(a.dm), _first_batches(b.dm)):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), f"{label}: first batches differ in {key}"


def test_stateloop_starts_as_vanilla_looped():
    """StateLoop (docs/formulations.md#stateloop) with common random numbers: the same seed gives the same function, not only the same shared weights."""
    cfg = dict(vocab_size=64, d_model=32, n_heads=4, n_layers=1, n_loops=3)
    torch.manual_seed(1)
    van = LoopedLM(LoopedLMConfig(**cfg))
    after_vanilla = torch.get_rng_state()
    torch.manual_seed(1)
    sl = LoopedLM(LoopedLMConfig(**cfg, state_mode="stateloop_mamba2", exit_gate="ouro", injection="add"))
    assert torch.equal(after_vanilla, torch.get_rng_state())  # a branch never moves the global stream either
    ids = torch.randint(0, 64, (2, 12))
    torch.testing.assert_close(sl(ids).logits, van(ids).logits, rtol=0, atol=0)


def test_a_branch_draws_from_its_own_name():
    cfg = LoopedLMConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=1, n_loops=2, state_mode="stateloop")
    torch.manual_seed(3)
    m1 = LoopedLM(cfg)
    torch.manual_seed(3)
    m2 = LoopedLM(cfg)
    torch.manual_seed(4)
    m3 = LoopedLM(cfg)
    for (k, p1), p2, p3 in zip(m1.named_parameters(), m2.parameters(), m3.parameters()):
        assert torch.equal(p1, p2), k  # the seed fixes every value
        if p1.std() > 0 and p1.numel() > 1:
            assert not torch.equal(p1, p3), k  # and another seed moves every random one
    m1.reset_parameters(seed=m1.init_seed)
    assert all(torch.equal(p1, p2) for p1, p2 in zip(m1.parameters(), m2.parameters()))
    assert named_seed(1, "block.0.attn.qkv_proj.weight") != named_seed(1, "block.0.attn.out_proj.weight")
    assert named_seed(1, "embed.weight") == named_seed(1, "embed.weight") < 2**63


@pytest.mark.parametrize("experiment", ["stateloop_depth_tiny", "phop_tiny"])
def test_seeds_vary_the_data_too(experiment):
    """dataset.seed follows the run seed (docs/tables.md#seeds): two seeds see different batches (and, on a synthetic
    task, a different test set), so a table's interval generalises over data as well as initial weights."""
    from looplab.train import build_run

    cfgs = {s: compose([f"+experiment={experiment}", f"seed={s}", "logger=none"]) for s in (1, 2)}
    assert [cfgs[s].dataset.seed for s in (1, 2)] == [1, 2]
    first = {s: _first_batches(build_run(cfgs[s]).dm, 1)[0] for s in (1, 2)}
    key = next(iter(first[1]))
    assert not torch.equal(first[1][key], first[2][key]), "seeds 1 and 2 drew the same first batch"
    if experiment == "phop_tiny":
        runs = {s: build_run(cfgs[s]).dm for s in (1, 2)}
        tests = []
        for dm in runs.values():
            dm.setup("test")
            tests.append(next(iter(dm.test_dataloader())))
        k = next(iter(tests[0]))
        assert not torch.equal(tests[0][k], tests[1][k]), "seeds 1 and 2 scored the same test set"
