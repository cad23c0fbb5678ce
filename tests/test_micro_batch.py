"""Micro-batches that keep the global batch (docs/training.md#micro-batches): `dataset.micro_batch` or
`trainer.accumulate_grad_batches` cut each device's share of an optimizer step into k micro-batches; the same
sequences reach the same step, a resume continues at the right one, and the update equals the k = 1 update."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import compose
from looplab.data.sampler import MicroBatches, micro_batching
from looplab.data.tasks import TaskDataModule


@pytest.fixture(autouse=True)
def _one_thread(one_thread_module):
    yield


def _trainer(step=0, k=1, rank=0, world=1):
    return SimpleNamespace(global_step=step, accumulate_grad_batches=k, global_rank=rank, world_size=world,
                           _accelerator_connector=SimpleNamespace(use_distributed_sampler=False))


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _rows(t: torch.Tensor) -> list[tuple]:
    return sorted(map(tuple, t.tolist()))


# ------------------------------------------------------------------ arithmetic
def test_micro_batching_resolves_and_refuses_in_one_line():
    assert micro_batching(256, 8) == (32, 1)
    assert micro_batching(256, 8, micro_batch=2) == (2, 16)
    assert micro_batching(256, 8, accumulate=4) == (8, 4)
    assert micro_batching(256, 8, micro_batch=8, accumulate=4) == (8, 4)  # both given, in agreement
    assert micro_batching(256, 8, micro_batch=2, accumulate=1) == (2, 16)  # 1: Lightning's default, not a choice
    for kwargs, words in [(dict(micro_batch=3), ["dataset.micro_batch=3", "32 sequences per device", "1, 2, 4, 8, 16, 32"]),
                          (dict(accumulate=5), ["trainer.accumulate_grad_batches=5", "dataset.batch_size=256"]),
                          (dict(micro_batch=2, accumulate=4), ["micro_batch=2", "accumulate_grad_batches=4", "16"])]:
        with pytest.raises(ValueError) as e:
            micro_batching(256, 8, **kwargs)
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(ValueError, match="not divisible by the world size 3"):
        micro_batching(256, 3)


# ------------------------------------------------------------------ data order
def test_task_steps_hold_the_same_sequences_at_any_micro_batching():
    """Optimizer step s holds the same sequences, on the same rank, with k = 1 and k = 4; a resume at step s starts
    at step s's first micro-batch."""
    kw = dict(task="mano", task_args=dict(L=3, modulus=5, subtree_loss=True), batch_size=16, seed=3)
    for world in (1, 2):
        for rank in range(world):
            whole = TaskDataModule(**kw)
            whole.trainer = _trainer(rank=rank, world=world)
            steps = _take(whole.train_dataloader(), 3)
            micro = TaskDataModule(**kw, micro_batch=16 // world // 4)
            micro.trainer = _trainer(k=4, rank=rank, world=world)
            parts = _take(micro.train_dataloader(), 12)
            for s in range(3):
                mine = parts[4 * s: 4 * s + 4]
                assert all(p["input_ids"].shape[0] == 16 // world // 4 for p in mine)
                for key in ("input_ids", "targets", "answer_mask"):
                    assert torch.equal(torch.cat([p[key] for p in mine]), steps[s][key])  # same rows, same order
                count = int((steps[s]["targets"] != -100).sum())
                assert all(int(c) == count for p in mine for c in p["step_targets"])  # the step's supervised targets
            micro.trainer = _trainer(step=2, k=4, rank=rank, world=world)  # resumed at optimizer step 2
            assert torch.equal(_take(micro.train_dataloader(), 1)[0]["input_ids"], parts[8]["input_ids"])
    bad = TaskDataModule(**kw, micro_batch=2)
    bad.trainer = _trainer(k=1)  # a Trainer built without the accumulation micro_batch needs
    with pytest.raises(ValueError, match="accumulate_grad_batches=8"):
        bad.train_dataloader()


class _Tokens:
    """A packed token file without files (data/prepare.py TokenFile's interface as TrainWindows reads it)."""

    def __init__(self, n):
        self.tokens, self.num_tokens, self.path = np.arange(n, dtype=np.int64) % 997, n, "memory"

    def open(self):
        return self.tokens


def test_lm_steps_hold_the_same_windows_at_any_micro_batching():
    from looplab.data.lm import LMDataModule

    def dm(micro=None):
        m = LMDataModule(seq_len=8, batch_size=8, micro_batch=micro, seed=5)
        m.files = {"train": _Tokens(2000)}  # no tokenising: the stream's order is all that is compared
        return m

    whole, micro = dm(), dm(2)
    whole.trainer, micro.trainer = _trainer(), _trainer(k=4)
    steps, parts = _take(whole.train_dataloader(), 2), _take(micro.train_dataloader(), 8)
    for s in range(2):
        for key in ("input_ids", "targets"):
            assert torch.equal(torch.cat([p[key] for p in parts[4 * s: 4 * s + 4]]), steps[s][key])
    micro.trainer = _trainer(step=1, k=4)
    assert torch.equal(_take(micro.train_dataloader(), 1)[0]["input_ids"], parts[4]["input_ids"])


def test_micro_batches_keep_the_loader_length():
    assert len(MicroBatches([{"input_ids": torch.zeros(4, 2), "targets": torch.zeros(4, 2)}] * 3, 2)) == 6


def test_exit_aware_exits_do_not_depend_on_the_micro_batching():
    from looplab.training.module import LoopedLMModule

    cfg = dict(vocab_size=16, d_model=16, n_heads=2, n_layers=1, n_loops=3)
    module = LoopedLMModule(cfg, {"lr": 1e-3}, {"exit_stage": None, "skip_train_prob": 0.5, "skip_handling": "kv_copy"})
    ids = torch.zeros(8, 5, dtype=torch.long)
    for world in (1, 2):
        for rank in range(world):
            module._trainer = _trainer(step=7, k=1, rank=rank, world=world)
            whole = module.sample_exit_steps(ids[: 8 // world])
            module._trainer = _trainer(step=7, k=4, rank=rank, world=world)
            parts = [module.sample_exit_steps(ids[: 8 // world // 4], batch_idx=28 + m) for m in range(4)]
            assert torch.equal(torch.cat(parts), whole)


# ------------------------------------------------------------------ one optimizer step, through Lightning
class _Seen:
    """Records the rows of every micro-batch under the optimizer step it belongs to; `save`: a checkpoint once
    step 1 is done (where Lightning's periodic checkpoint would write it)."""

    def __init__(self, save: str | None = None):
        import lightning as L

        class Cb(L.Callback):
            def on_train_batch_start(cb, trainer, module, batch, batch_idx):
                self.steps.setdefault(trainer.global_step, []).extend(map(tuple, batch["input_ids"].tolist()))

            def on_train_batch_end(cb, trainer, module, outputs, batch, batch_idx):
                if save and trainer.global_step == 1 and not trainer.fit_loop._should_accumulate():
                    trainer.save_checkpoint(save)

        self.steps: dict[int, list] = {}
        self.callback = Cb()


def _fit(extra: list[str], steps: int, micro: int, resume: str | None = None, save: str | None = None):
    import lightning as L

    from looplab.train import build_run, set_micro_batches

    cfg = compose(["dataset=mano", "loop_depth=1x2", "backbone.d_model=16", "backbone.n_heads=2",
                   "backbone.ffn_hidden=32", "dataset.batch_size=8", "logger=none", "optim.fused=false", *extra])
    run = build_run(cfg)
    seen = _Seen(save)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[seen.callback],
                        gradient_clip_val=cfg.trainer.gradient_clip_val,
                        accumulate_grad_batches=cfg.trainer.accumulate_grad_batches)
    assert set_micro_batches(trainer, run.dm, cfg) == micro  # sequences per forward, as python -m looplab.train sets
    trainer.fit(run.module, datamodule=run.dm, ckpt_path=resume)
    return {k: v.detach().clone() for k, v in run.module.model.state_dict().items()}, seen.steps, trainer


def test_k4_steps_equal_k1_steps_and_resume(tmp_path):
    """Mano with subtree loss: the sequences carry 2–4 supervised targets each, so a mean of per-micro-batch means
    would differ from the step's mean; the k = 4 update equals the k = 1 update, and a k = 4 run resumed after its
    first step ends where the uninterrupted one does, having seen the same sequences at each step."""
    w1, seen1, _ = _fit([], 2, micro=8)
    w4, seen4, t4 = _fit(["dataset.micro_batch=2"], 2, micro=2, save=str(tmp_path / "step1.ckpt"))
    assert t4.accumulate_grad_batches == 4 and t4.global_step == 2
    assert {s: sorted(r) for s, r in seen1.items()} == {s: sorted(r) for s, r in seen4.items()}
    assert set(seen1) == {0, 1} and all(len(r) == 8 for r in seen1.values())
    for k in w1:
        torch.testing.assert_close(w4[k], w1[k], rtol=1e-5, atol=1e-6, msg=k)
    wr, seen_r, _ = _fit(["trainer.accumulate_grad_batches=4"], 2, micro=2, resume=str(tmp_path / "step1.ckpt"))
    assert sorted(seen_r[1]) == sorted(seen4[1]) and set(seen_r) == {1}
    for k in w4:
        torch.testing.assert_close(wr[k], w4[k], rtol=1e-5, atol=1e-6, msg=k)


def test_a_resume_off_the_step_boundary_is_refused():
    """A checkpoint of other micro-batching (6 micro-batches done, 4 per step now) would cut every later step in the
    wrong place: refused at the start of training, naming the keys."""
    from looplab.models import ConfigError
    from looplab.training.module import LoopedLMModule

    module = LoopedLMModule(dict(vocab_size=8, d_model=8, n_heads=2, n_layers=1, n_loops=2), {"lr": 1e-3}, {})

    def at(done, k):
        module._trainer = SimpleNamespace(accumulate_grad_batches=k, fit_loop=SimpleNamespace(
            epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(current=SimpleNamespace(ready=done)))))
        module.on_train_start()

    at(8, 4)
    at(6, 1)
    with pytest.raises(ConfigError, match="after 6 micro-batches, not a multiple of its 4 .*dataset.micro_batch"):
        at(6, 4)
