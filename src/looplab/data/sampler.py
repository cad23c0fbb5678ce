"""The resumable, rank-sharded order of the endless training stream.

Training is one stream: the sample with global index g is example g of the
train split. Global batch b holds samples [b·B, (b+1)·B); rank r of w takes the
contiguous shard [b·B + r·B/w, b·B + (r+1)·B/w). Starting at sample `start`
(global_step · B after a restart) therefore reproduces exactly the batches an
uninterrupted run would have seen, on any number of ranks, with no state to
checkpoint. `start` may be a callable read at every `iter()`, so a DataLoader
that Lightning iterates again (a new "epoch", e.g. with limit_train_batches)
continues from the current step instead of replaying. The stream is virtual:
nothing is allocated, so its length can be far beyond any run (STREAM_LENGTH)
and must never be materialised with list().

Global batch b is optimizer step b's, however it is micro-batched: with gradient
accumulation (k micro-batches per step) each rank's shard is cut into k
micro-batches in order (MicroBatches), so `start` stays global_step · B.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.utils.data import Sampler

STREAM_LENGTH = 2**40  # samples; ~1.7e10 batches of 64, fits int64 with room to spare


class ResumableSampler(Sampler[int]):
    def __init__(
        self,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        start: int | Callable[[], int] = 0,
        length: int = STREAM_LENGTH,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
        if batch_size % world_size:
            raise ValueError(
                f"global batch_size={batch_size} is not divisible by world_size={world_size}; "
                f"pick a multiple of {world_size}"
            )
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self._start, self.length = start, length
        self.per_rank = batch_size // world_size
        self.start  # validate now, not at the first iteration

    @property
    def start(self) -> int:
        start = self._start() if callable(self._start) else self._start
        if start < 0 or start % self.batch_size:
            raise ValueError(f"start={start} must be a non-negative multiple of batch_size={self.batch_size}")
        return start

    def __iter__(self) -> Iterator[int]:
        B, per = self.batch_size, self.per_rank
        for b in range(self.start // B, self.length // B):
            lo = b * B + self.rank * per
            yield from range(lo, lo + per)

    def __len__(self) -> int:
        return max(0, self.length // self.batch_size - self.start // self.batch_size) * self.per_rank


# ------------------------------------------------------------------ micro-batches
def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def micro_batching(global_batch: int, world_size: int, micro_batch: int | None = None,
                   accumulate: int | None = None) -> tuple[int, int]:
    """(sequences per device per forward, micro-batches per optimizer step) for a global batch that stays the
    optimizer step's: each device's share, global_batch / world_size, is cut into k micro-batches.

    micro_batch (`dataset.micro_batch`) fixes the sequences per forward, k = share / micro_batch; or accumulate
    (`trainer.accumulate_grad_batches`) fixes k, micro-batch = share / k; neither: one micro-batch of the whole
    share. accumulate 1 (Lightning's default) counts as not given. A value that does not divide, or the two
    given in disagreement, is refused in one line naming them."""
    for name, v in (("dataset.batch_size", global_batch), ("world size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if global_batch % world_size:
        raise ValueError(f"dataset.batch_size={global_batch} (global) is not divisible by the world size {world_size}; "
                         f"use a multiple of {world_size}")
    share = global_batch // world_size
    where = f"the {share} sequences per device (dataset.batch_size={global_batch} over {world_size} devices)"
    acc = None if accumulate is None or accumulate == 1 else accumulate
    if acc is not None and (isinstance(acc, bool) or not isinstance(acc, int) or acc < 1):
        raise ValueError(f"trainer.accumulate_grad_batches={accumulate!r} must be a positive integer")
    if micro_batch is None:
        k = acc or 1
        if share % k:
            raise ValueError(f"trainer.accumulate_grad_batches={k} does not divide {where}; use one of {_divisors(share)}")
        return share // k, k
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"dataset.micro_batch={micro_batch!r} must be a positive integer (or null: {where})")
    if share % micro_batch:
        raise ValueError(f"dataset.micro_batch={micro_batch} does not divide {where}; use one of {_divisors(share)}")
    k = share // micro_batch
    if acc is not None and acc != k:
        raise ValueError(f"dataset.micro_batch={micro_batch} and trainer.accumulate_grad_batches={acc} disagree: {where} "
                         f"in micro-batches of {micro_batch} are {k} per optimizer step; set one of the two")
    return micro_batch, k


def accumulation(global_batch: int, micro_batch: int | None, trainer, world_size: int) -> int:
    """Micro-batches per optimizer step of a DataModule's training loader: the trainer's accumulate_grad_batches,
    checked against the DataModule's `micro_batch` (python -m looplab.train sets the one from the other)."""
    k = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1)) if trainer is not None else 1
    _, want = micro_batching(global_batch, world_size, micro_batch, k)
    if want != k:
        raise ValueError(f"dataset.micro_batch={micro_batch} makes {want} micro-batches per optimizer step, but the "
                         f"trainer accumulates {k}; build the Trainer with accumulate_grad_batches={want} (python -m "
                         "looplab.train does)")
    return k


class MicroBatches:
    """A training loader of whole optimizer steps (each item: this rank's share of one global batch, as without
    accumulation) yielding each step as k micro-batches in order: micro-batch m holds rows [m·b, (m+1)·b) of the
    share, b = share / k. So the same sequences reach the same optimizer step, on the same rank, as with k = 1,
    and a resume at global_step s starts at the loader's step s as before.

    Each micro-batch also carries `step_targets` (b,): every entry the number of supervised targets (≠ -100) in
    the whole step's share, counted here on the host, so the loss can weight each token by 1/(that count)
    (training/module.py token_weights): the k micro-batches' gradients then add up to the whole share's mean."""

    def __init__(self, loader, k: int, ignore_index: int = -100):
        self.loader, self.k, self.ignore_index = loader, int(k), ignore_index

    def __iter__(self):
        k = self.k
        for batch in self.loader:
            n = batch["input_ids"].shape[0]
            if n % k:
                raise ValueError(f"a training batch of {n} sequences cannot be cut into {k} micro-batches")
            count = int((batch["targets"] != self.ignore_index).sum())
            parts = {name: value.chunk(k) for name, value in batch.items()}
            for m in range(k):
                micro = {name: chunks[m] for name, chunks in parts.items()}
                micro["step_targets"] = torch.full((n // k,), count, dtype=torch.long)
                yield micro

    def __len__(self) -> int:
        return len(self.loader) * self.k  # a TypeError where the loader has no length (Lightning: an endless one)
