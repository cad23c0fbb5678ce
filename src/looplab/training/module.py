"""LoopedLMModule: the LightningModule that trains and evaluates a LoopedLM.

Objectives (docs/formulations.md#exit-gate): plain next-token cross-entropy on supervised positions;
exit-gate stage 1 (Σ_t p(t)L^(t) − β·H(p)); stage 2 (gate-only BCE, everything
else frozen). Validation reports loss/accuracy from every loop depth through
the shared final norm and head, exit statistics at each threshold q, the
StateLoop diagnostics (retention, state norm, ‖W_o s_r‖/‖h_r‖ per loop) and, on the first
validation batch, the per-loop diagnostics of every looped model as `val_diag/<measure>_loop{r}`
(eval/diagnostics.py, docs/evaluation.md#per-loop-diagnostics; `loop_diagnostics=False` turns them off).

Training depth (docs/formulations.md#randomized-training-depth): each optimizer step runs `depth.draw(global_step)` loops
(training/depth.py; R when the sampler is fixed), with gradients through the last
`backprop_loops` of them. Stage 1 of the exit gate works at any drawn depth: the
gate's distribution and the per-depth losses are taken over the loops that step ran
(stage 2, which fits the gate of a frozen model, refuses a sampler).
Validation and test run the configured R; `eval_depth = R′` (set by train.py for
loop_depth.eval_loops) makes the test split run R′ loops and report under `test_loops{R′}/`.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric

from looplab.checkpoint import looplab_meta
from looplab.models import ConfigError, LoopedLM, LoopedLMConfig
from looplab.models.exit_gate import logits_at_depth, stage1_loss, stage2_loss, threshold_exit_steps
from looplab.models.exits import ExitPolicy
from looplab.training.compose import schedule_steps
from looplab.training.depth import DepthSampler, step_rng

IGNORE = -100


def per_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(…, T, V), (…, T) → per-token CE over supervised tokens only, flattened (N,).

    ignore_index instead of gathering the supervised rows first: a (N, V) gather copies the
    logits and its backward scatters into a zeroed (…, T, V) buffer, two extra passes over
    the largest activation of a training step.
    """
    losses = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE, reduction="none")
    return losses[targets.flatten() != IGNORE]


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """A logged training value's mean over the ranks, as one all-reduce queued on the device (NCCL: the host does
    not wait for it). Lightning's `self.log(..., sync_dist=True)` reduces through `_sync_ddp`, which calls
    `torch.distributed.barrier()` before its all-reduce: under NCCL a barrier blocks the host until the device has
    run everything queued, at every micro-batch. One process: the value itself."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    value = value.detach().float().clone()
    dist.all_reduce(value)  # a sum (gloo has no average)
    return value / dist.get_world_size()


class LoopedLMModule(L.LightningModule):
    def __init__(
        self,
        model_config: dict[str, Any],
        optim: dict[str, Any],
        objective: dict[str, Any],
        dataset: dict[str, Any] | None = None,
        checkpoint_loops: bool = False,  # the older knob: True = activation_checkpointing="loop"
        compile_block: bool = False,
        depth: dict[str, Any] | None = None,
        loop_diagnostics: bool = True,
        activation_checkpointing: bool | str | None = None,  # hardware.activation_checkpointing (models/checkpointing.py)
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = LoopedLM(LoopedLMConfig.from_dict(model_config))
        try:
            self.model.activation_checkpointing = "loop" if checkpoint_loops and activation_checkpointing is None \
                else activation_checkpointing
        except ValueError as e:
            raise ConfigError(f"hardware.{e}") from None
        self.compile_block = compile_block
        self._configured = False
        # decided once on the plain model, so that sharding (or compiling) cannot change it
        self.decay_names = decayed_parameter_names(self.model)
        check_optim(optim)  # optim.lr=-1 etc.: one line naming the key, not torch's traceback at fit
        self.optim_cfg, self.objective = optim, objective
        self.dataset_cfg = dataset or {}
        # mixed-hop p-hop (TaskDataModule.hop_counts): answers are also scored per hop count (acc_by_hops)
        self.hop_counts = [int(h) for h in self.dataset_cfg.get("_hop_counts") or []]
        self.R = self.model.config.n_loops
        # training depth per optimizer step (default: fixed at R, every loop backpropagated)
        self.depth = DepthSampler(**{**(depth or {}), "loops": self.R})
        self.depth.validate()
        if self.depth.active and objective.get("exit_stage") == "stage2":
            # stage 2 fits the gate of a frozen model at its depth; a drawn depth of 1 leaves no
            # stop-or-continue decision to train (an empty loss)
            raise ConfigError(f"loop_depth.sampler={self.depth.sampler!r} with exit_gate.stage=stage2: stage 2 trains the "
                              "gate of a frozen model at its trained depth; use loop_depth.sampler=fixed")
        self.eval_depth: int | None = None  # test at R′ instead of R (loop_depth.eval_loops)
        # exits read at validation/test: the gate's q, or a registered exit rule's thresholds (exit_gate.eval_rule)
        self.eval_rule, self.thresholds = self._eval_exits(objective)
        self._metrics_by_split: dict[str, dict[str, MeanMetric]] = {}
        self.diagnostics: dict[str, list[float]] = {}
        self.log_loop_diagnostics = bool(loop_diagnostics)  # val_diag/*: one validation batch, no grad
        self.loop_diag: dict[str, Any] = {}
        if objective.get("exit_stage") == "stage2":
            self.freeze_all_but_gate()
        if objective.get("skip_train_prob", 0.0) > 0:
            from looplab.models.exit_compute import skip_compute_unsupported

            if self.depth.active or self.depth.backprop_loops is not None:
                raise ConfigError(f"exit_gate.skip_train_prob with loop_depth.sampler={self.depth.sampler!r}, "
                                  f"backprop_loops={self.depth.backprop_loops!r}: exit-aware fine-tuning runs the configured "
                                  "depth with every loop's gradient; use loop_depth.sampler=fixed, backprop_loops=null")

            reason = skip_compute_unsupported(self.model.config, "kl", objective["skip_handling"])
            if reason:
                raise ValueError(f"exit_gate.skip_train_prob: {reason}")

    def _eval_exits(self, objective: dict[str, Any]) -> tuple[str | None, list[float]]:
        """(exit_gate.eval_rule, its thresholds): None and the gate's q for a gated model by default; a zero-shot or
        researcher's rule (models/registry.py EXIT_RULES) at exit_gate.eval_thresholds, checked before training."""
        from looplab.models.exit_rules import check_rule, get_rule

        rule = objective.get("eval_rule") or None
        thresholds = [float(q) for q in objective.get("eval_thresholds") or []]
        gated = self.model.exit_gate is not None
        if rule is None:
            return None, thresholds if gated else []
        try:
            reads = get_rule(rule).reads
            if reads == "exit_probs" and not gated:
                raise ValueError(f"exit rule {rule!r} reads the exit gate's distribution; this model has exit_gate=none")
            if not thresholds:
                raise ValueError("it needs exit_gate.eval_thresholds (e.g. [0.1, 0.5])")
            for q in thresholds:
                check_rule(rule, q, 1, self.R)
        except ValueError as e:
            raise ConfigError(f"exit_gate.eval_rule={rule!r}: {e}") from None
        return rule, thresholds

    def _exit_steps(self, out, loop_logits: torch.Tensor, q: float) -> torch.Tensor:
        """(B, T) 1-based depth each token reads at threshold q: the gate's CDF, or exit_gate.eval_rule's first stop."""
        if self.eval_rule is None:
            return threshold_exit_steps(out.exit_probs, q)
        from looplab.models.exit_rules import first_exit

        return first_exit(self.eval_rule, q, loop_logits.shape[0], logits=loop_logits, hidden=out.loop_hidden,
                          exit_probs=out.exit_probs)

    # ---------------------------------------------------------------- set-up
    def freeze_all_but_gate(self) -> None:
        if self.model.exit_gate is None:
            raise ValueError("exit_gate.stage=stage2 needs exit_gate=ouro")
        for name, p in self.model.named_parameters():
            p.requires_grad_(name.startswith("exit_gate."))

    def train(self, mode: bool = True):
        super().train(mode)
        if mode and self.objective.get("exit_stage") == "stage2":
            self.model.eval()  # frozen backbone: nothing in it should behave as in training
        return self

    def metric(self, split: str, name: str) -> MeanMetric:
        """Lazily created torchmetrics accumulators, registered so they follow the module's device."""
        metrics = self._metrics_by_split.setdefault(split, {})
        if name not in metrics:  # keyed by name: a new accumulator per batch would keep only the last batch
            m = MeanMetric().to(self.device)
            self.add_module("metric_" + f"{split}_{name}".replace("/", "_").replace(".", "_"), m)
            metrics[name] = m
        return metrics[name]

    def configure_model(self) -> None:
        """Lightning calls this once the processes exist, before wrapping the model and building the
        optimizer, for fit and again for test (hence idempotent). Sharding comes first, compiling
        after it, so the compiled layers are the sharded ones."""
        if self._configured:
            return
        from lightning.pytorch.strategies import ModelParallelStrategy

        from looplab.training.distributed import shard_looped_model

        strategy = self._trainer.strategy if self._trainer is not None else None
        # the deepest training forward (randomized depth draws up to depth.hi): gather_once where it exceeds 1
        loops = max(self.depth.loops, self.depth.hi if self.depth.active else 1)
        if hasattr(strategy, "shard_options"):  # LoopedFSDPStrategy: mesh (FSDP or HSDP), dtype policy, schedule
            shard_looped_model(self.model, loops=loops,
                               **strategy.shard_options(self.device_mesh, num_nodes=self._trainer.num_nodes))
        elif isinstance(strategy, ModelParallelStrategy):  # Lightning's own: FSDP over its data-parallel dimension
            mesh = self.device_mesh
            mesh = mesh["data_parallel"] if mesh.mesh_dim_names and "data_parallel" in mesh.mesh_dim_names else mesh
            shard_looped_model(self.model, mesh, loops=loops)
        if self.compile_block:
            self.model.compile_block()  # each layer compiled once; the R loops reuse the compiled code
        self._configured = True

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["looplab"] = looplab_meta(self.model.config, self.dataset_cfg)

    # -------------------------------------------------------------- training
    def on_train_start(self) -> None:
        """A resume must continue at a step boundary of this run's micro-batching: Lightning restores its count of
        micro-batches and steps the optimizer every k of them, while the loaders restart at the step's first
        micro-batch (data/sampler.py MicroBatches). A checkpoint of other micro-batching would cut every later step
        in the wrong place."""
        trainer = self._trainer
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        k = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        done = loop.batch_progress.current.ready if loop is not None else 0
        if k > 1 and done % k:
            raise ConfigError(f"this run resumes after {done} micro-batches, not a multiple of its {k} micro-batches per "
                              "optimizer step: the checkpoint was trained with other micro-batching (dataset.micro_batch, "
                              "trainer.accumulate_grad_batches); resume with the checkpoint's")

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, targets = batch["input_ids"], batch["targets"]
        stage = self.objective.get("exit_stage")
        # the same draw on every rank and after a resume: a function of (seed, optimizer step) only
        depth = dict(n_loops=self.depth.draw(self.global_step), backprop_loops=self.depth.backprop_loops)
        if self.depth.active:
            self.log("train/loops", float(depth["n_loops"]))
        # each token's weight in the optimizer step's mean loss (no host sync; micro-batches weighted as one batch)
        weights = self.token_weights(targets, batch)
        if self.objective.get("skip_train_prob", 0.0) > 0:
            loss = self.exit_aware_loss(ids, targets, batch_idx, weights)
        elif stage is None:
            if self.model.router is not None:
                self.model.router.train_step = int(self.global_step)  # capacity warm-up (models/router.py)
            # targets: the model returns per-token losses, its head and cross-entropy run in chunks (models/loss.py)
            out = self.model(ids, targets=targets, **depth)
            loss = (out.token_loss * weights).sum() + self.routing_loss(out)
        else:
            out = self.model(ids, return_all_loops=True, targets=targets, **depth)
            loop_losses = out.loop_token_loss.flatten(1)  # (R′ drawn, B·T), 0 at unsupervised tokens
            w = weights.flatten()
            if stage == "stage1":
                loss = stage1_loss(loop_losses, out.exit_probs.flatten(0, 1), self.objective["beta"],
                                   self.objective.get("final_loop_weight", 0.0), weights=w)
            else:
                loss = stage2_loss(loop_losses.detach(), out.exit_gate_logits.flatten(0, 1), self.objective["k"],
                                   self.objective["gamma"], weights=w)
            self.log("train/last_loop_loss", (loop_losses[-1] * w).sum().detach())
        # the mean over ranks (a no-op on one process): the loss of the global batch, as one process logs it, reduced
        # on the device (mean_over_ranks: Lightning's sync_dist=True puts a barrier, a host wait, before its
        # all-reduce at every micro-batch). Not prog_bar=True: Lightning would read it (.item(), a host sync) at every
        # step; the progress displays read it at the logging steps (training/callbacks.py LoggedLoss)
        self.log("train/loss", mean_over_ranks(loss.detach()))
        return loss

    def token_weights(self, targets: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, T) weight of each token's loss, so that the optimizer step's loss is the mean over every supervised
        token of this rank's share of the global batch, whatever the micro-batching: 1/n at supervised tokens, 0
        elsewhere, n counted on the device (a boolean-mask index would sync the host). Without accumulation n is
        this batch's count. With k micro-batches (data/sampler.py MicroBatches) n is the whole step's count on this
        rank (`step_targets`, counted by the loader), times k since Lightning divides each micro-batch's loss by k:
        the k micro-batches' gradients then sum to the k = 1 gradient. Across ranks, as before, DDP/FSDP average
        the ranks' means."""
        mask = (targets != IGNORE).to(torch.float32)
        step = batch.get("step_targets")
        if step is None:
            return mask / mask.sum().clamp_min(1.0)
        k = int(self._trainer.accumulate_grad_batches) if self._trainer is not None else 1
        return mask * (k / step[0].to(torch.float32).clamp_min(1.0))

    def routing_loss(self, out) -> torch.Tensor | float:
        """depth_router (docs/formulations.md#routed-depth): the router's weighted auxiliary losses, summed; each is logged, with the
        fraction of tokens run at each loop and the mean depth."""
        routing = out.routing
        if routing is None:
            return 0.0
        for name, value in routing.losses.items():
            self.log(f"train/router_{name}", mean_over_ranks(value.detach()))
        for r, frac in enumerate(routing.active_frac, start=1):
            self.log(f"train/router_active_loop{r}", frac)
        self.log("train/router_mean_depth", mean_over_ranks(routing.depth.float().mean()))
        return sum(routing.losses.values()) if routing.losses else 0.0

    def sample_exit_steps(self, ids: torch.Tensor, batch_idx: int = 0) -> torch.Tensor:
        """(B, T) exit steps for exit-aware fine-tuning: with probability skip_train_prob a token exits at a
        loop drawn uniformly from 1..R−1, else it runs all R loops.

        Drawn for the optimizer step's whole global batch from a generator seeded by (run seed, optimizer step),
        and this micro-batch's rows of it kept (the layout of data/sampler.py: rank r's contiguous shard, cut into
        its k micro-batches in order), so that a sample's exits depend neither on the number of ranks (2 FSDP/DDP
        processes train as one process does), nor on the micro-batching, nor on a resume."""
        trainer = self._trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        k = max(1, int(trainer.accumulate_grad_batches)) if trainer is not None else 1
        micro = batch_idx % k
        B, T = ids.shape
        rng = step_rng(self.depth.seed, self.global_step, 0, 0x5C1F)
        rows = slice((rank * k + micro) * B, (rank * k + micro + 1) * B)
        early = rng.random((B * k * world, T))[rows] < self.objective["skip_train_prob"]
        depth = rng.integers(1, max(self.R, 2), (B * k * world, T))[rows]
        steps = np.where(early & (self.R > 1), depth, self.R)
        return torch.from_numpy(steps).to(device=ids.device, dtype=torch.long)

    def exit_aware_loss(self, ids: torch.Tensor, targets: torch.Tensor, batch_idx: int = 0,
                        weights: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token loss of the reference exit forward (models/exit_compute.py) at sampled exits: the deeper
        loops learn to read what exited tokens leave under the handling decoding will use, and each token is
        scored at its exit, as skip_compute decoding reads it. It runs as a forward of the model (not of its
        parts), so FSDP2's root hooks gather the embedding, norms and head for it."""
        steps = self.sample_exit_steps(ids, batch_idx)
        out = self.model(ids, exits=ExitPolicy(skip=self.objective["skip_handling"], steps=steps), targets=targets)
        self.log("train/exit_early_frac", (steps < self.R).float().mean())
        weights = self.token_weights(targets, {}) if weights is None else weights
        return (out.token_loss * weights).sum()

    # ------------------------------------------------------------ evaluation
    @property
    def eval_R(self) -> int:
        return self.eval_depth or self.R

    def _eval_step(self, batch: dict[str, torch.Tensor], split: str) -> None:
        ids, targets = batch["input_ids"], batch["targets"]
        answer_mask = batch.get("answer_mask")
        at_r_prime = self.eval_depth is not None  # an eval_loops pass: the final metrics at R′ only
        R = self.eval_R
        per_depth = not at_r_prime and (self.objective.get("eval_per_depth", True) or self.model.exit_gate is not None
                                        or bool(self.thresholds))
        first = not at_r_prime and not self.diagnostics and self.model.state is not None
        out = self.model(ids, return_all_loops=per_depth, return_diagnostics=first, n_loops=R)
        if first:
            self.diagnostics = out.diagnostics
        if split == "val" and self.log_loop_diagnostics and not self.loop_diag and not at_r_prime:
            from looplab.eval.diagnostics import loop_diagnostics

            self.loop_diag = loop_diagnostics(self.model, ids, batch.get("attention_mask"), n_loops=self.R)
        loop_logits = out.loop_logits if per_depth else out.logits[None]
        depths = range(1, R + 1) if per_depth else [R]
        mask = targets != IGNORE
        n_tok = int(mask.sum())
        # mixed-hop p-hop: each scored answer's hop count, to score every hop count apart
        hops = (batch["hops"][:, None].expand_as(answer_mask)[answer_mask]
                if self.hop_counts and answer_mask is not None and "hops" in batch else None)
        for d, logits in zip(depths, loop_logits):
            nll = per_token_loss(logits, targets)
            self.metric(split, f"loss_loop{d}").update(nll.mean(), weight=max(n_tok, 1))
            if answer_mask is not None:
                acc = (logits.argmax(-1) == targets)[answer_mask].float()
                self.metric(split, f"acc_loop{d}").update(acc.mean(), weight=acc.numel())
                if hops is not None:
                    self._update_by_hops(split, f"acc_loop{d}", acc, hops)
        if self.model.router is not None and not at_r_prime:
            self._routed_eval(ids, targets, answer_mask, mask, n_tok, split, out)
        if self.model.exit_gate is not None and not at_r_prime:
            steps = torch.arange(1, self.R + 1, device=ids.device, dtype=out.exit_probs.dtype)
            probs = out.exit_probs[mask]
            self.metric(split, "exit_expected_step").update((probs * steps).sum(-1).mean(), weight=n_tok)
        if not at_r_prime:
            for q in self.thresholds:
                chosen = self._exit_steps(out, loop_logits, q)  # (B, T)
                logits_q = logits_at_depth(loop_logits, chosen)
                nll = per_token_loss(logits_q, targets)
                self.metric(split, f"exit_q{q}_loss").update(nll.mean(), weight=n_tok)
                self.metric(split, f"exit_q{q}_mean_step").update(chosen[mask].float().mean(), weight=n_tok)
                if answer_mask is not None:
                    acc = (logits_q.argmax(-1) == targets)[answer_mask].float()
                    self.metric(split, f"exit_q{q}_acc").update(acc.mean(), weight=acc.numel())
                    self.metric(split, f"exit_q{q}_answer_step").update(chosen[answer_mask].float().mean(), weight=acc.numel())
                    if hops is not None:
                        self._update_by_hops(split, f"exit_q{q}_acc", acc, hops)
                        self._update_by_hops(split, f"exit_q{q}_answer_step", chosen[answer_mask].float(), hops)

    def _update_by_hops(self, split: str, name: str, values: torch.Tensor, hops: torch.Tensor) -> None:
        """`<name>_hops<h>`: the mean of `values` (one per scored answer) over the answers of hop count h, for every
        hop count of the dataset (weight 0 where a batch has none, so every rank keeps the same metrics)."""
        for h in self.hop_counts:
            sel = hops == h
            n = int(sel.sum())
            self.metric(split, f"{name}_hops{h}").update(values[sel].sum() / max(n, 1), weight=n)

    def _routed_eval(self, ids, targets, answer_mask, mask, n_tok: int, split: str, out) -> None:
        """depth_router: the metrics above route as training does (expert choice: top-k over the whole sequence,
        MoR's evaluation, which lets later tokens decide an earlier token's depth). Also score the causal routing
        that decoding uses (`depths="inference"`: each token routed on its own), and the mean depth of each."""
        self.metric(split, "router_mean_depth").update(out.routing.depth[mask].float().mean(), weight=n_tok)
        causal = self.model(ids, depths="inference")
        self.metric(split, "causal_loss").update(per_token_loss(causal.logits, targets).mean(), weight=max(n_tok, 1))
        self.metric(split, "causal_mean_depth").update(causal.routing.depth[mask].float().mean(), weight=n_tok)
        if answer_mask is not None:
            acc = (causal.logits.argmax(-1) == targets)[answer_mask].float()
            self.metric(split, "causal_acc").update(acc.mean(), weight=acc.numel())

    def _eval_epoch_end(self, split: str) -> None:
        metrics = self._metrics_by_split.get(split, {})
        values = {name: float(m.compute()) for name, m in metrics.items() if m.update_count > 0}
        for name, m in metrics.items():
            m.reset()
        final = f"loss_loop{self.eval_R}"
        if final in values:
            values["loss"] = values[final]
            values["ppl"] = math.exp(min(values[final], 50.0))
        if "causal_loss" in values:
            values["causal_ppl"] = math.exp(min(values["causal_loss"], 50.0))
        if f"acc_loop{self.eval_R}" in values:
            values["acc"] = values[f"acc_loop{self.eval_R}"]
        for key, series in self.diagnostics.items():
            for r, v in enumerate(series, start=1):
                values[f"state_{key}_loop{r}"] = v
        self.diagnostics = {}
        if split == "val" and self.loop_diag:
            from looplab.eval.diagnostics import MEASURES

            # each rank's first batch; the same names on every rank (None = undefined at that loop, not logged)
            diag = {f"val_diag/{k}_loop{r}": v for k in MEASURES if k in self.loop_diag
                    for r, v in enumerate(self.loop_diag[k], start=1) if v is not None}
            self.loop_diag = {}
            self.log_dict(diag, prog_bar=False, sync_dist=True)
        # MeanMetric.compute() already reduced across ranks, so every rank holds the same values:
        # sync_dist's mean leaves them as they are (and tells Lightning they are global)
        self.log_dict({f"{split}/{k}": v for k, v in values.items() if k != "acc"}, prog_bar=False, sync_dist=True)
        if "acc" in values:
            self.log(f"{split}/acc", values["acc"], prog_bar=True, sync_dist=True)

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, "val")

    def on_validation_epoch_end(self):
        self._eval_epoch_end("val")

    @property
    def test_split(self) -> str:
        return "test" if self.eval_depth is None else f"test_loops{self.eval_depth}"

    def test_step(self, batch, batch_idx):
        self._eval_step(batch, self.test_split)

    def on_test_epoch_end(self):
        self._eval_epoch_end(self.test_split)

    # ------------------------------------------------------------- optimiser
    def configure_optimizers(self):
        o = self.optim_cfg
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                (decay if clean_param_name(name) in self.decay_names else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": o.get("weight_decay", 0.1)}, {"params": no_decay, "weight_decay": 0.0}]
        fused = o.get("fused", "auto")
        # fused AdamW has CPU and CUDA kernels (measured +6-9% per CPU training step); false = foreach
        kwargs = {"fused": True} if fused in ("auto", True) else {"foreach": True}
        opt = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=o["lr"], betas=tuple(o.get("betas", (0.9, 0.95))), eps=o.get("eps", 1e-8), **kwargs
        )
        total, warmup = schedule_steps(o, self.trainer.max_steps if self.trainer else None)
        floor = o.get("min_lr_ratio", 0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, warmup, total, floor))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def check_optim(optim: dict[str, Any]) -> None:
    """Refuse, naming the key, an optimizer setting that AdamW or the warm-up/cosine schedule cannot use (torch would
    only fail at fit, inside Lightning, with its own traceback)."""
    def number(value: Any) -> bool:
        return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)

    for key, lo, hi in (("lr", 0.0, None), ("eps", 0.0, None), ("weight_decay", 0.0, None),
                        ("warmup_frac", 0.0, 1.0), ("min_lr_ratio", 0.0, 1.0)):
        if key not in optim or (key != "lr" and optim[key] is None):
            continue
        v = optim[key]
        if not number(v) or v < lo or (hi is not None and v > hi):
            raise ConfigError(f"optim.{key}={v!r} must be a finite number >= {lo:g}" + (f" and <= {hi:g}" if hi is not None else ""))
    betas = optim.get("betas")
    if betas is not None and (isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2
                              or not all(number(b) and 0 <= b < 1 for b in betas)):
        raise ConfigError(f"optim.betas={betas!r} must be two numbers in [0, 1)")
    warm = optim.get("warmup_steps")
    if warm is not None and (isinstance(warm, bool) or not isinstance(warm, int) or warm < 0):
        raise ConfigError(f"optim.warmup_steps={warm!r} must be an integer >= 0 (or null: warmup_frac of max_steps)")


def clean_param_name(name: str) -> str:
    """A parameter's name on the plain model, whatever wrappers (compile, checkpointing) sit around it."""
    for junk in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(junk, "")
    return name


def decayed_parameter_names(model: torch.nn.Module) -> set[str]:
    """Weight matrices are decayed; norms, biases, 1-D SSM/state parameters and embeddings are not."""
    return {clean_param_name(n) for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("embed.")}


def lr_factor(step: int, warmup: int, total: int, floor: float) -> float:
    """Linear warmup to 1, then cosine down to `floor` at `total`, flat after."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
