"""LMDataModule: contiguous windows of packed tokens for language modelling.

The training split is one flat token array (looplab.data.prepare) cut into
W = (n − 1) // T windows of T + 1 tokens, window i = tokens[iT : iT + T + 1]
(neighbours share one boundary token, so every token is a target exactly once
per epoch). Input is w[:-1], target w[1:].

The training stream is endless and indexed by a global sample counter g, like
the synthetic tasks: epoch e = g // W, and sample g is window perm_e[g mod W],
where perm_e is a fixed permutation drawn from (seed, e). Global batch j holds
samples [jB, (j + 1)B); rank r of w takes its slice [jB + rB/w, jB + (r+1)B/w).
The stream therefore depends only on (seed, j), never on the number of
workers, ranks or restarts. Global batch j is optimizer step j's: with
`micro_batch` (or the trainer's accumulate_grad_batches = k) each rank's
slice is cut into k micro-batches in order (data/sampler.py MicroBatches), so
the same sequences reach the same step as without; resuming at optimizer step
s starts at batch s and reproduces exactly the batches an uninterrupted run
would have seen (Lightning's `use_distributed_sampler` must be False: this
module shards itself).

Validation reads the held-out split in order, windows r, r + w, ... on rank r
(the same count on every rank, so DDP never waits on a rank with an extra
batch), capped at `val_tokens`.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from looplab.data.prepare import SourceConfig, TokenFile, prepare
from looplab.data.sampler import MicroBatches, accumulation, micro_batching
from looplab.data.tokenizer import EMBEDDED_DEFAULT, LMTokenizer, load_tokenizer


def _plain(x: Any) -> Any:
    """Hydra passes DictConfig/ListConfig for nested values; datasets wants plain containers."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(x, (DictConfig, ListConfig)):
            return OmegaConf.to_container(x, resolve=True)
    except ImportError:
        pass
    return x


class TrainWindows(IterableDataset):
    """Endless stream of this rank's local batches, starting at global batch `start_batch`.

    Yields whole batches (use DataLoader(batch_size=None)); DataLoader workers
    take batches j ≡ worker (mod num_workers), which the DataLoader's in-order
    round robin puts back in sequence.
    """

    def __init__(self, token_file: TokenFile, seq_len: int, global_batch: int, rank: int, world_size: int,
                 seed: int = 0, start_batch: int = 0):
        if global_batch % world_size:
            raise ValueError(f"batch_size={global_batch} (global) is not divisible by world_size={world_size}; "
                             f"use a multiple of {world_size}")
        self.file, self.T, self.B = token_file, seq_len, global_batch
        self.local = global_batch // world_size
        self.rank, self.world, self.seed, self.start_batch = rank, world_size, seed, start_batch
        self.num_windows = (token_file.num_tokens - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"training split {str(token_file.path)!r} has {token_file.num_tokens} tokens, "
                             f"fewer than seq_len + 1 = {seq_len + 1}; lower seq_len or add data")
        self._perm: tuple[int, np.ndarray] | None = None
        self._tokens: np.memmap | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_windows))
        return self._perm[1]

    def window_index(self, g: np.ndarray) -> np.ndarray:
        """Global sample counters → window indices (vectorised over one batch; may cross an epoch)."""
        epochs, pos = np.divmod(g, self.num_windows)
        out = np.empty_like(g)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.permutation(int(e))[pos[sel]]
        return out

    def batch(self, j: int) -> dict[str, torch.Tensor]:
        if self._tokens is None:  # opened lazily so each DataLoader worker maps the file itself
            self._tokens = self.file.open()
        g = j * self.B + self.rank * self.local + np.arange(self.local, dtype=np.int64)
        starts = self.window_index(g) * self.T
        w = torch.from_numpy(self._tokens[starts[:, None] + np.arange(self.T + 1)].astype(np.int64))
        return {"input_ids": w[:, :-1].contiguous(), "targets": w[:, 1:].contiguous()}

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        j = self.start_batch + wid
        while True:
            yield self.batch(j)
            j += nw


class ValWindows(Dataset):
    """Held-out windows r, r + w, r + 2w, ... (the same count on every rank)."""

    def __init__(self, token_file: TokenFile, seq_len: int, rank: int = 0, world_size: int = 1, max_tokens: int | None = None):
        self.file, self.T = token_file, seq_len
        n = (token_file.num_tokens - 1) // seq_len
        if max_tokens is not None:
            n = min(n, max_tokens // seq_len)
        n -= n % world_size
        if n < 1:
            raise ValueError(f"validation split {str(token_file.path)!r} has {token_file.num_tokens} tokens: too few for one "
                             f"window of seq_len + 1 = {seq_len + 1} per rank (val_tokens, world_size={world_size})")
        self.index = np.arange(rank, n, world_size)
        self._tokens: np.memmap | None = None

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self._tokens is None:
            self._tokens = self.file.open()
        s = int(self.index[i]) * self.T
        w = torch.from_numpy(self._tokens[s : s + self.T + 1].astype(np.int64))
        return {"input_ids": w[:-1], "targets": w[1:]}


class LMDataModule(L.LightningDataModule):
    """Language-model data from any `datasets` source (see looplab.data.prepare for `source`)."""

    def __init__(
        self,
        name: str = "lm",  # config label only
        source: str = "shakespeare",
        tokenizer: str = EMBEDDED_DEFAULT,
        seq_len: int = 256,
        batch_size: int = 32,  # global: divided across ranks; one optimizer step's
        micro_batch: int | None = None,  # sequences per device per forward (None: the whole per-device share)
        val_batch_size: int | None = None,  # global; None = batch_size
        val_tokens: int | None = 131072,  # held-out tokens evaluated per validation (None = all)
        cache_dir: str = "data_cache",
        num_workers: int = 0,
        num_proc: int = 1,  # tokenisation processes (datasets.map)
        seed: int = 0,  # window order
        data_files: Any = None,
        subset: str | None = None,
        text_field: str = "text",
        train_split: str = "train",
        val_split: str | None = None,
        val_fraction: float = 0.05,
        streaming: bool = False,
        revision: str | None = None,
        max_train_tokens: int | None = None,
        max_val_tokens: int | None = None,
        eos_token: str | None = None,
        pin_memory: bool = False,
    ):
        super().__init__()
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be positive")
        self.name = name
        self.src = SourceConfig(
            source=source, data_files=_plain(data_files), subset=subset, text_field=text_field,
            train_split=train_split, val_split=val_split, val_fraction=val_fraction, streaming=streaming,
            revision=revision, max_train_tokens=max_train_tokens, max_val_tokens=max_val_tokens,
        )
        self.tokenizer_spec = tokenizer
        self.eos_token = eos_token
        self.seq_len, self.batch_size, self.micro_batch = seq_len, batch_size, micro_batch
        micro_batching(batch_size, 1, micro_batch)  # a bad micro_batch now, not at the first step
        self.val_batch_size = val_batch_size or batch_size
        self.val_tokens = val_tokens
        self.cache_dir = os.path.expanduser(str(cache_dir))
        self.num_workers, self.num_proc, self.seed, self.pin_memory = num_workers, num_proc, seed, pin_memory
        self._tok: LMTokenizer | None = None
        self.files: dict[str, TokenFile] | None = None

    # ----------------------------------------------------------- tokenizer
    @property
    def tokenizer(self) -> LMTokenizer:
        if self._tok is None:
            self._tok = load_tokenizer(self.tokenizer_spec, self.eos_token)
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def tokenizer_identity(self) -> str:
        """Which id each token has (data/tokenizer.py tokenizer_identity): recorded in checkpoints, checked on load."""
        return self.tokenizer.identity

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tokenizer.decode(ids)

    # ---------------------------------------------------------------- data
    def prepare(self) -> dict[str, TokenFile]:
        """Tokenise and pack (or reuse the cache); idempotent."""
        if self.files is None:
            self.files = prepare(self.src, self.tokenizer, self.cache_dir, num_proc=self.num_proc, eos_token=self.eos_token)
        return self.files

    def prepare_data(self) -> None:
        self.prepare()

    def setup(self, stage: str | None = None) -> None:
        self.prepare()

    def _rank_world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return trainer.global_rank, trainer.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def train_batches(self, start_batch: int = 0, rank: int | None = None, world_size: int | None = None) -> DataLoader:
        """This rank's loader of the endless training stream from global batch `start_batch` on."""
        r, w = self._rank_world()
        r, w = (r if rank is None else rank), (w if world_size is None else world_size)
        ds = TrainWindows(self.prepare()["train"], self.seq_len, self.batch_size, r, w, self.seed, start_batch)
        return DataLoader(ds, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
                          persistent_workers=False)

    def train_dataloader(self) -> DataLoader | MicroBatches:
        trainer = getattr(self, "trainer", None)
        start = trainer.global_step if trainer is not None else 0  # one global batch per optimizer step
        loader = self.train_batches(start)
        k = accumulation(self.batch_size, self.micro_batch, trainer, self._rank_world()[1])
        return loader if k == 1 else MicroBatches(loader, k)

    def val_windows(self, rank: int | None = None, world_size: int | None = None) -> ValWindows:
        r, w = self._rank_world()
        r, w = (r if rank is None else rank), (w if world_size is None else world_size)
        return ValWindows(self.prepare()["validation"], self.seq_len, r, w, self.val_tokens)

    def val_dataloader(self) -> DataLoader:
        _, w = self._rank_world()
        return DataLoader(self.val_windows(), batch_size=max(1, self.val_batch_size // w), shuffle=False,
                          num_workers=self.num_workers, pin_memory=self.pin_memory)

    def test_dataloader(self) -> DataLoader:
        # lm_tiny / hf sources have one held-out split; it serves as validation and test
        return self.val_dataloader()

    def unigram_perplexity(self) -> float:
        """The perplexity of the training split's unigram distribution (add-one smoothed) on the held-out
        targets the test scores: the bar a language model must get below to have learned anything from
        context (the findings' precondition for a language-model arm, tables/spec.py)."""
        files = self.prepare()
        counts = np.bincount(np.asarray(files["train"].open(), dtype=np.int64), minlength=self.vocab_size).astype(np.float64)
        logp = np.log(counts + 1.0) - np.log(counts.sum() + len(counts))
        held = self.val_windows(rank=0, world_size=1)
        tokens = np.asarray(files["validation"].open(), dtype=np.int64)
        targets = np.concatenate([tokens[int(s) * self.seq_len + 1: int(s) * self.seq_len + self.seq_len + 1] for s in held.index])
        return float(np.exp(-logp[targets].mean()))

    def state_dict(self) -> dict[str, Any]:
        # the position in the stream is global_step (restored by Lightning); keep what decides the order
        return {"seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len}  # not micro_batch: no order

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        changed = {k: (state[k], mine[k]) for k in mine if k in state and state[k] != mine[k]}
        if changed:
            import warnings

            warnings.warn(f"resuming with a different data order ({', '.join(f'{k}: {a} -> {b}' for k, (a, b) in changed.items())}): "
                          "the stream restarts at global_step in the new order, so some windows are seen twice and others skipped")
