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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

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
