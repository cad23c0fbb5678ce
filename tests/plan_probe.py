"""A callback that `python -m looplab.train` is given in tests/test_plan.py (PYTHONPATH=tests): one optimizer step of
the real run, counted as the plan counts its fake one."""

from __future__ import annotations

import json
import os

import lightning as L


class PlanProbe(L.Callback):
    """Counts optimizer step `step` (0-based; the second by default: FSDP2's lazy initialisation and the optimizer's
    state are behind it) of the real run with the plan's collective counter (looplab.plan.cost.StepCounter) and
    torch's FSDPMemTracker, and writes both to `<out>/rank<r>.json`. The window opens at the end of the previous
    step (Lightning broadcasts its SIGTERM flag before each micro-batch's `on_train_batch_start`) and closes at the
    end of the step's optimizer step."""

    def __init__(self, out: str, step: int = 1):
        self.out, self.step = out, int(step)
        self.tracker = self.counter = None
        self.done = False

    def _last_micro_batch(self, trainer, batch_idx) -> bool:
        return (batch_idx + 1) % trainer.accumulate_grad_batches == 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.tracker is None or self.done:
            return
        if batch_idx % trainer.accumulate_grad_batches:
            self.tracker.reset_mod_stats()  # a second root forward in one tracked step (accumulation)
        self.tracker.track_inputs((batch,))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        from looplab.plan.cost import StepCounter

        if self.done or not self._last_micro_batch(trainer, batch_idx):
            return
        if self.tracker is None:
            if trainer.global_step == self.step:  # the previous step just ended
                self.tracker = FSDPMemTracker(pl_module.model, trainer.optimizers[0])
                self.counter = StepCounter()
                self.tracker.__enter__()
                self.counter.__enter__()
            return
        self.counter.__exit__(None, None, None)
        self.tracker.__exit__(None, None, None)
        self.done = True
        snap = self.tracker.get_tracker_snapshot("peak")
        dev = max(snap.values(), key=lambda d: d.get("Total", 0))
        result = {"peak_bytes": int(dev["Total"]),
                  "breakdown": {(k.value if hasattr(k, "value") else str(k)): int(v) for k, v in dev.items()},
                  "collectives": self.counter.collectives.as_dict(), "collective_bytes": self.counter.collectives.total_bytes,
                  "flops": self.counter.flops,
                  # Lightning's per-batch SIGTERM broadcast replaced by the host one (callbacks.HostSigtermFlag)
                  "sigterm_on_host": "_broadcast_sigterm_tensor" in vars(trainer.fit_loop.epoch_loop)}
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(result, f)
