"""Validation/test metrics are example-weighted means over the WHOLE split, not the last batch's.

Driven through the real LightningModule with `Trainer.validate` / `Trainer.test` on a split whose
batches differ (a short last batch, a different number of supervised tokens per batch), and
checked against sums computed here independently of looplab's metric code.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from looplab.data.tasks import TaskDataModule
from looplab.models import LoopedLMConfig
from looplab.training.module import LoopedLMModule

IGNORE = -100
THRESHOLDS = [0.3, 0.5, 0.9, 1.01]
DATASET = {"task": "phop", "task_args": {"n": 16, "p": 2, "alphabet": 4}, "batch_size": 16, "val_size": 40, "test_size": 56}


def _module(exit_gate: str, state_mode: str) -> tuple[LoopedLMModule, TaskDataModule]:
    torch.manual_seed(0)
    dm = TaskDataModule(**DATASET)
    cfg = LoopedLMConfig(vocab_size=dm.vocab_size, d_model=32, n_heads=2, n_layers=1, n_loops=3, max_seq_len=64,
                         exit_gate=exit_gate, state_mode=state_mode)
    objective = {"exit_stage": "stage1" if exit_gate != "none" else None, "beta": 0.1, "k": 50.0, "gamma": 0.005,
                 "eval_thresholds": THRESHOLDS, "eval_per_depth": True}
    module = LoopedLMModule(cfg.to_dict(), {"lr": 1e-3}, objective, dataset={"name": "phop"})
    with torch.no_grad():  # a random init predicts almost uniformly: sharpen it so batches score differently
        module.model.head.weight.mul_(30)
        if module.model.exit_gate is not None:
            torch.nn.init.normal_(module.model.exit_gate.proj.weight, std=3.0)  # spread the exits over depths
    return module, dm


def _trainer() -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=False)


@torch.no_grad()
def _expected(model, loader) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Whole-split means from running sums (float64), and the same metrics of each batch alone."""
    model.eval()
    R = model.config.n_loops
    gated = model.exit_gate is not None
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    per_batch = []

    def add(acc: dict, cnt: dict, name: str, total: float, n: int) -> None:
        acc[name] = acc.get(name, 0.0) + total
        cnt[name] = cnt.get(name, 0) + n

    for batch in loader:
        ids, targets, answer = batch["input_ids"], batch["targets"], batch["answer_mask"]
        out = model(ids, return_all_loops=True)
        sup = targets != IGNORE
        b_sum: dict[str, float] = {}
        b_cnt: dict[str, float] = {}
        depth_logits = [out.loop_logits[d] for d in range(R)]
        for d, lg in enumerate(depth_logits, start=1):
            nll = F.cross_entropy(lg.double()[sup], targets[sup], reduction="sum").item()
            correct = (lg.argmax(-1)[answer] == targets[answer]).sum().item()
            for acc, cnt in ((sums, counts), (b_sum, b_cnt)):
                add(acc, cnt, f"loss_loop{d}", nll, int(sup.sum()))
                add(acc, cnt, f"acc_loop{d}", correct, int(answer.sum()))
        if gated:
            p = out.exit_probs.double()  # (B, T, R)
            depth = torch.arange(1, R + 1, dtype=torch.float64)
            expected_step = (p * depth).sum(-1)
            cdf = p.cumsum(-1)
            for acc, cnt in ((sums, counts), (b_sum, b_cnt)):
                add(acc, cnt, "exit_expected_step", expected_step[sup].sum().item(), int(sup.sum()))
            for q in THRESHOLDS:
                # independent rule: the first depth whose cumulative exit probability reaches q, else R
                chosen = torch.full(ids.shape, R, dtype=torch.long)
                for t in range(R, 0, -1):
                    chosen = torch.where(cdf[..., t - 1] >= q, torch.full_like(chosen, t), chosen)
                picked = torch.stack(depth_logits)  # (R, B, T, V)
                lg = torch.stack([picked[chosen[b, t] - 1, b, t] for b in range(ids.shape[0]) for t in range(ids.shape[1])])
                lg = lg.view(*ids.shape, -1)
                nll = F.cross_entropy(lg.double()[sup], targets[sup], reduction="sum").item()
                correct = (lg.argmax(-1)[answer] == targets[answer]).sum().item()
                for acc, cnt in ((sums, counts), (b_sum, b_cnt)):
                    add(acc, cnt, f"exit_q{q}_loss", nll, int(sup.sum()))
                    add(acc, cnt, f"exit_q{q}_mean_step", chosen[sup].double().sum().item(), int(sup.sum()))
                    add(acc, cnt, f"exit_q{q}_acc", correct, int(answer.sum()))
                    add(acc, cnt, f"exit_q{q}_answer_step", chosen[answer].double().sum().item(), int(answer.sum()))
        per_batch.append({k: b_sum[k] / b_cnt[k] for k in b_sum})
    means = {k: sums[k] / counts[k] for k in sums}
    means["loss"] = means[f"loss_loop{R}"]
    means["ppl"] = math.exp(means[f"loss_loop{R}"])
    means["acc"] = means[f"acc_loop{R}"]
    return means, per_batch


@pytest.mark.parametrize("exit_gate, state_mode", [("ouro", "vanilla"), ("none", "stateloop")])
@pytest.mark.parametrize("split", ["test", "val"])
def test_logged_metrics_are_whole_split_means(exit_gate, state_mode, split):
    module, dm = _module(exit_gate, state_mode)
    trainer = _trainer()
    if split == "test":
        trainer.test(module, datamodule=dm, verbose=False)
        loader = dm.test_dataloader()
        size = DATASET["test_size"]
    else:
        trainer.validate(module, datamodule=dm, verbose=False)
        loader = dm.val_dataloader()
        size = DATASET["val_size"]
    logged = {k.split("/", 1)[1]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(f"{split}/")}
    expected, per_batch = _expected(module.model, loader)

    sizes = [len(b["input_ids"]) for b in loader]
    assert sum(sizes) == size and sizes[-1] < sizes[0]  # a short last batch: unequal weights matter
    names = {f"{m}_loop{d}" for m in ("loss", "acc") for d in (1, 2, 3)} | {"loss", "ppl", "acc"}
    if exit_gate == "ouro":
        names |= {"exit_expected_step"} | {f"exit_q{q}_{k}" for q in THRESHOLDS for k in ("loss", "mean_step", "acc", "answer_step")}
    assert names <= set(logged), sorted(names - set(logged))
    for name in sorted(names - {"ppl"}):
        assert logged[name] == pytest.approx(expected[name], rel=2e-6, abs=1e-6), name
    # perplexity = exp(loss): compared on the log scale (float32 metric sums; exp magnifies the last digit)
    assert math.log(logged["ppl"]) == pytest.approx(math.log(expected["ppl"]), abs=1e-5)

    # the split's batches really differ: the last batch alone gives other values, so a metric that
    # kept only the last batch (the bug fixed in 0ab7d95) would fail the equality above
    last = per_batch[-1]
    differ = [n for n in ("loss_loop3", "acc_loop1", "acc_loop3", "exit_expected_step", "exit_q0.5_mean_step")
              if n in last and abs(last[n] - expected[n]) > 1e-3]
    assert len(differ) >= (4 if exit_gate == "ouro" else 2), (last, expected)
    # p-hop supervises a different number of positions per example: token weights differ between batches
    tokens = [int((b["targets"] != IGNORE).sum()) for b in loader]
    assert len(set(t / s for t, s in zip(tokens, sizes))) > 1


def test_metrics_reset_between_evaluations():
    """A second evaluation of the same split gives the same values (accumulators are reset, not carried)."""
    module, dm = _module("ouro", "vanilla")
    trainer = _trainer()
    first = {k: float(v) for k, v in trainer.test(module, datamodule=dm, verbose=False)[0].items()}
    second = {k: float(v) for k, v in trainer.test(module, datamodule=dm, verbose=False)[0].items()}
    assert first.keys() == second.keys() and len(first) > 10
    for k in first:
        assert second[k] == pytest.approx(first[k], rel=1e-6), k
