"""A training step that never waits for its GPU, checked on the CPU (docs/performance.md#host-syncs-in-a-training-step).

`looplab.testing.syncs.HostSyncs` counts what would make a GPU wait for its queued kernels — `.item()`, `.tolist()`,
`int()` of a tensor, a boolean-mask index, a tensor built from host data — and the callbacks' own device synchronize
is counted with them. A real `looplab.train` run (in process, on the CPU, under a SLURM job's environment so that the
preemption handler runs too, with a CSV logger and the learning-rate monitor) is counted optimizer step by optimizer
step: every hook of a step, from the first `on_train_batch_start` to the next one. Before this, a 2⊗4 step made
12.25 of them (one RoPE bound check per attention layer and loop, the token-id check, the loss's boolean index,
Lightning reading the progress-bar loss, the throughput monitor's synchronize, the requeue flag's copy and read);
now a step that does not log makes none, and a logging step (every trainer.log_every_n_steps) reads the logged
values once: constant in layers, loops and steps.
"""

from __future__ import annotations

import types
from collections import Counter

import lightning as L
import numpy as np
import pytest
import torch

from looplab.models import LoopedLM, LoopedLMConfig
from looplab.testing.syncs import HostSyncs
from looplab.training import callbacks
from test_slurm_requeue import slurm_job_env  # noqa: F401  (a fixture: a one-task SLURM job's environment)
from test_train import run_train

LOG_EVERY = 4
STEPS = 10


class StepSyncs(L.Callback):
    """Host syncs per optimizer step: a HostSyncs window from one on_train_batch_start (this callback runs first)
    to the next, or to on_train_end. Steps 0 and 1 are left out (the first optimizer step builds AdamW's state)."""

    def __init__(self, skip: int = 2) -> None:
        self.skip = skip
        self.mode: HostSyncs | None = None
        self.steps: list[tuple[bool, int, Counter]] = []  # (logs at this step?, global step, kinds)
        self.sites: Counter = Counter()
        self.monitors: list = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.monitors = [type(c) for c in trainer.callbacks]

    def _close(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.steps[-1] = (*self.steps[-1][:2], self.mode.kinds)
            self.sites += self.mode.sites
            self.mode = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._close()
        if batch_idx >= self.skip:
            self.steps.append((trainer._logger_connector.should_update_logs, trainer.global_step, Counter()))
            self.mode = HostSyncs()
            self.mode.__enter__()

    def on_train_end(self, trainer, pl_module) -> None:
        self._close()

    def synchronize(self, device) -> None:  # stands in for callbacks.synchronize: a device sync, counted
        if self.mode is not None:
            self.mode.kinds["device synchronize"] += 1
            self.mode.sites["device synchronize (callbacks.synchronize)"] += 1


def count_steps(overrides, tmp_path, monkeypatch, name) -> StepSyncs:
    counter = StepSyncs()
    monkeypatch.setattr(callbacks, "synchronize", counter.synchronize)
    init = L.Trainer.__init__

    def first(self, *args, callbacks=None, **kwargs):  # the counter first: its window holds every hook of a step
        init(self, *args, callbacks=[counter, *(callbacks or [])], **kwargs)

    monkeypatch.setattr(L.Trainer, "__init__", first)
    res = run_train(overrides, tmp_path / name)
    monkeypatch.setattr(L.Trainer, "__init__", init)
    assert res["global_step"] == STEPS
    return counter


def test_training_steps_do_not_sync_constant_in_layers_and_loops(tiny_overrides, tmp_path, monkeypatch,
                                                                  slurm_job_env):  # noqa: F811
    common = tiny_overrides + ["logger=csv", f"trainer.max_steps={STEPS}", f"trainer.log_every_n_steps={LOG_EVERY}",
                               "trainer.val_check_interval=100", "checkpoint_every_n_steps=100", "test_after_fit=false",
                               "dataset.batch_size=2", "dataset.task_args.n=16", "trainer.enable_progress_bar=true"]
    per_step, kinds = {}, {}
    for depth in ("1x2", "2x4"):
        c = count_steps(common + [f"loop_depth={depth}"], tmp_path, monkeypatch, depth)
        assert callbacks.SlurmRequeue in c.monitors and callbacks.ThroughputMonitor in c.monitors
        assert callbacks.PlainProgress in c.monitors  # a non-terminal's progress lines (they read the loss too)
        quiet = [(step, dict(k)) for logs, step, k in c.steps if not logs and sum(k.values())]
        assert not quiet, (depth, quiet, c.sites)  # a step that does not log never waits for the device
        logging = [sum(k.values()) for logs, _, k in c.steps if logs]
        assert len(logging) == sum((k + 1) % LOG_EVERY == 0 for k in range(2, STEPS))  # Lightning's logging steps
        # a logging step reads what it logs: train/loss, the learning rates (Lightning's monitor builds a tensor of
        # each group's lr), one synchronize for the throughput reading, the progress line's loss
        assert max(logging) <= 6, (depth, c.sites)
        per_step[depth] = sum(logging) / len(c.steps)
        kinds[depth] = sum((k for *_, k in c.steps), Counter())
    assert per_step["1x2"] == per_step["2x4"] <= 2, per_step  # amortised over log_every_n_steps: ≤ 2 per step
    assert kinds["1x2"] == kinds["2x4"], kinds


def test_a_training_forward_and_backward_never_sync():
    """The model's own part of a step, N·R attention calls: the RoPE bound is checked on shapes, the token ids on
    the device (before: one int(positions.max()) per attention layer and loop and one .tolist())."""
    for layers, loops in ((1, 2), (2, 4)):
        torch.manual_seed(0)
        model = LoopedLM(LoopedLMConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=layers, n_loops=loops,
                                        prelude_layers=1, coda_layers=1, state_mode="stateloop", max_seq_len=16)).train()
        ids = torch.randint(0, 50, (2, 16))
        with HostSyncs() as syncs:
            model(ids).logits.float().pow(2).mean().backward()
        assert syncs.count == 0, syncs.report()


def test_bad_inputs_are_still_refused_in_a_training_forward():
    """The device-side checks keep the host checks' guarantees: on the CPU the same error naming the value."""
    model = LoopedLM(LoopedLMConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=1, n_loops=2, max_seq_len=16))
    for mode in (model.train, model.eval):
        mode()
        for bad, word in ((50, "token id 50 outside the vocabulary"), (-2, "token id -2 outside")):
            ids = torch.randint(0, 50, (2, 8))
            ids[1, 3] = bad
            with pytest.raises(ValueError, match=word):
                model(ids)
        with pytest.raises(ValueError, match="position 16 exceeds max_seq_len=16; raise backbone.max_seq_len"):
            model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds max_seq_len=16"):  # a layer called on its own checks it too
        model.block[0].attn.rope(torch.arange(17)[None])


# ------------------------------------------------------------------ the callbacks' parts, one by one
def fake_trainer(device: str, logs_at, world: int = 1):
    """What ThroughputMonitor reads of a Trainer: a step counter whose logging steps are `logs_at`."""
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn

    t = types.SimpleNamespace(step=0, world_size=world, log_every_n_steps=LOG_EVERY, sanity_checking=False,
                              enable_validation=False, logged=[])
    t.state = types.SimpleNamespace(stage=RunningStage.TRAINING, fn=TrainerFn.FITTING)
    t.strategy = types.SimpleNamespace(root_device=torch.device(device))
    t.precision_plugin = L.pytorch.plugins.Precision()
    t.fit_loop = types.SimpleNamespace(_should_accumulate=lambda: False, total_batch_idx=0)

    class Connector:
        should_update_logs = property(lambda self: t.step in logs_at)

        def log_metrics(self, metrics, step=None):
            t.logged.append(metrics)

    t._logger_connector = Connector()
    return t


@pytest.mark.parametrize("cls", ["looplab", "lightning"])
def test_throughput_monitor_synchronizes_only_when_it_logs(cls, monkeypatch):
    """On a GPU, Lightning's ThroughputMonitor synchronizes after every training batch; looplab's at the steps it
    logs. Its figures are the same: samples, tokens and FLOPs per second over the readings' window."""
    from lightning.pytorch.callbacks import throughput_monitor

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synced.append(1))
    monkeypatch.setattr(throughput_monitor, "get_available_flops", lambda device, dtype: 1e12)
    clock = iter(range(1000))
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: float(next(clock)))  # one clock for both monitors
    monitor = (callbacks.ThroughputMonitor if cls == "looplab" else throughput_monitor.ThroughputMonitor)(
        batch_size_fn=lambda b: b.shape[0], length_fn=lambda b: b.numel(), **({"window_steps": 8} if cls == "looplab"
                                                                               else {"window_size": 8}))
    trainer = fake_trainer("cuda", logs_at={3, 7, 11, 15})
    module = types.SimpleNamespace(flops_per_batch=1000)
    monitor.setup(trainer, module, "fit")
    monitor.on_train_start(trainer, module)
    for trainer.step in range(16):
        monitor.on_train_batch_end(trainer, module, None, torch.zeros(2, 8))
    if cls == "lightning":
        assert len(synced) == 16  # what looplab's replaces: a wait for the GPU after every batch
        return
    assert len(synced) == 4  # once per logging step
    last = trainer.logged[-1]
    assert last["train/batches"] == 16 and last["train/samples"] == 32 and last["train/lengths"] == 256
    # window of 8 steps = 2 readings (steps 11 and 15): 4 batches of 2 samples, 16 tokens and 1000 FLOPs each,
    # 4 clock ticks apart (one perf_counter per reading)
    assert last["train/device/samples_per_sec"] == 8 / 1 and last["train/device/items_per_sec"] == 64 / 1
    assert last["train/device/flops_per_sec"] == 4000 / 1 and last["train/device/mfu"] == 4000 / 1e12


def test_ranks_agree_on_a_preemption_on_the_host(tmp_path):
    """Several ranks sum their preemption flags over a host (gloo) group and read the sum from its numpy buffer:
    no device tensor, no host-device sync (before: a host-to-device copy, an all-reduce and a float() per step)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        req = callbacks.SlurmRequeue(tmp_path / "last.ckpt")
        trainer = types.SimpleNamespace(world_size=2, global_step=5)  # a second rank, as far as the callback knows
        req._make_group(trainer)
        assert req._on_host
        with HostSyncs() as syncs:
            quiet = req.any_rank_signalled(trainer)
            req.signalled = 10
            loud = req.any_rank_signalled(trainer)
        assert (quiet, loud) == (False, True) and syncs.count == 0, syncs.report()
        assert isinstance(req._flag, np.ndarray)
    finally:
        dist.destroy_process_group()


def test_progress_displays_read_the_loss_at_logging_steps_only():
    """The rich bar and the plain lines show the loss read every `every` steps (Lightning read a prog_bar=True loss,
    `.item()`, at every step)."""
    loss = callbacks.LoggedLoss(every=LOG_EVERY)
    trainer = types.SimpleNamespace(global_step=0, callback_metrics={})
    shown, reads = [], 0
    for trainer.global_step in range(1, 10):
        trainer.callback_metrics = {"train/loss": torch.full((), float(trainer.global_step))}
        with HostSyncs() as syncs:
            shown.append(loss.read(trainer))
        reads += syncs.count
    assert shown == [1, 1, 1, 4, 4, 4, 4, 8, 8] and reads == 3  # the first, then every 4th step
