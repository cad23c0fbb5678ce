"""Loop schedules: how the loops are driven over a sequence and a cache (docs/formulations.md#looping).

    sequential   loop r+1 reads loop r's output at the same token: `LoopedLM.run_loops`, one loop after the other
    parallel     loop r+1 reads loop r's output one token back (models/parallel.py: PLT's cross-loop parallelism)

A schedule is a registered class (models/registry.py LOOP_SCHEDULES). It may add modules to the model (`build`),
run its own forward over a sequence (`forward`; None: LoopedLM's sequential loop) and allocate its own cache
(`allocate_cache`; None: one entry per (loop, layer)). The sequential schedule's `step` is one loop of the block;
a schedule that changes only what one loop computes subclasses Sequential and overrides `step`
(docs/extending.md#a-loop-schedule).
"""

from __future__ import annotations

from dataclasses import fields, replace

from looplab.models.registry import LOOP_SCHEDULES, ConfigError, Supports, Variant

PARALLEL_FIELDS = ("loop_kv", "loop_window", "loop_gate", "loop_mix", "loop_mix_learned", "loop_norm")


class LoopSchedule(Variant):
    """How a LoopedLM runs its R loops. `sequential` (class attribute): LoopedLM.forward's own loop drives it,
    one `step` per loop, and every decoder (plain, exits, speculation, serving) runs it unchanged."""

    sequential = True

    @classmethod
    def validate(cls, config) -> None:
        """Refuse, naming the field, what this schedule cannot run."""

    @classmethod
    def build(cls, model) -> None:
        """Add the schedule's own modules to a freshly built model (before its parameters are initialised)."""

    @classmethod
    def step(cls, model, stream, r: int, cache=None, *, gate=None, call=None):
        """One loop (0-based r) of a sequential schedule (LoopedLM.loop_step calls it): LoopedLM.loop_body."""
        return model.loop_body(stream, r, cache, gate, call)

    @classmethod
    def forward(cls, model, input_ids, attention_mask, cache, n_loops, **kw):
        """A non-sequential schedule's forward over a sequence (a LoopedLMOutput)."""
        raise NotImplementedError

    @classmethod
    def allocate_cache(cls, model, batch_size: int, max_len: int, device, dtype, n_loops: int, static: bool):
        """A cache of the schedule's own (None: LoopedLM's one entry per (loop, layer))."""
        return None

    @classmethod
    def loop_flops(cls, model, seq_len: int) -> int:
        """What each loop after the first computes beyond the block and the injection, per token."""
        return 0


@LOOP_SCHEDULES.register("sequential")
class Sequential(LoopSchedule):
    supports = Supports(parallel_loops=True, export=True)

    @classmethod
    def capabilities(cls, config) -> Supports:
        if cls.step.__func__ is Sequential.step.__func__:
            return cls.supports
        # depth-wise serving runs LoopedLM.loop_body over (row, loop) items itself, not the schedule's step
        return replace(cls.supports, depthwise=f"loop_schedule={cls.name} changes the loop step, which depth-wise "
                       "batching does not run (it batches LoopedLM.loop_body across loops); use schedule='lockstep'")

    @classmethod
    def validate(cls, config):
        defaults = {f.name: f.default for f in fields(config) if f.name in PARALLEL_FIELDS}
        changed = [f"{k}={getattr(config, k)!r}" for k in PARALLEL_FIELDS
                   if (tuple(getattr(config, k)) if k == "loop_mix" else getattr(config, k)) != defaults[k]]
        if changed:
            raise ConfigError(f"{', '.join(changed)} with loop_schedule={config.loop_schedule}: these are options of "
                              "the parallel loop schedule; set loop_depth.schedule=parallel or leave them at their "
                              "defaults")
