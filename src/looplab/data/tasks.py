"""Tokenised synthetic tasks (Mano, p-hop) as map-style datasets and one LightningDataModule.

Every item is three fixed-length tensors of length T = `seq_len`:
  input_ids   (T,) long  — the sequence without its last token, PAD on the right
  targets     (T,) long  — targets[t] is the token to predict from position t (the next-token
                           shift is done here); -100 where there is no loss
  answer_mask (T,) bool  — the one scored position: its prediction is the answer

Layouts (token names as `decode` prints them):
  Mano   <bos> Q<k> <prefix tokens: + - * and values> <ans> | answer      (k = operator count;
         with task_args.subtree_loss also, at the last token of every operator subtree, its value)
  p-hop  <symbols a b c ...> <query> | answer
         (mixed hop counts, task_args.p a list: <p<k>> <symbols ...> <query> | answer, k = the example's hop count)
The answer is predicted from the <ans>/<query> position; accuracy is always
scored there. Loss: p-hop with `per_position_loss` adds, at every symbol
position t from which p hops exist, the symbol reached after p hops from t
(docs/formulations.md#tasks: with the loss on the last position alone nothing beat the ≈ 0.49
shortcut at tiny scale in 2,500 steps). Mano's loss is on the answer (SPEC);
`task_args.subtree_loss` adds the value of each operator subtree at its last
token, which tiny CPU Mano runs need (answer-only loss stayed near chance).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from looplab.data import mano, phop
from looplab.data.sampler import STREAM_LENGTH, MicroBatches, ResumableSampler, accumulation, micro_batching

IGNORE = -100  # torch.nn.functional.cross_entropy's default ignore_index
TASKS = ("phop", "mano")
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "phop": {"n": 32, "p": 3, "alphabet": 4, "test_fraction": 0.5},  # the tiny setting (docs/formulations.md#tasks)
    "mano": {"L": 24, "modulus": 23, "test_fraction": 0.5, "subtree_loss": False},  # the paper setting
}


class Vocab:
    """Token names for display; ids are positions in `names`. PAD is id 0."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        self.ids = {n: i for i, n in enumerate(self.names)}
        assert len(self.ids) == len(self.names), "duplicate token names"

    @property
    def vocab_size(self) -> int:
        return len(self.names)

    @property
    def pad_id(self) -> int:
        return self.ids["<pad>"]

    def __getitem__(self, name: str) -> int:
        return self.ids[name]

    def decode(self, ids) -> str:
        """Space-separated names; PAD and ignore-index (negative) ids are dropped."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return " ".join(self.names[i] for i in ids if i >= 0 and i != self.pad_id)


@dataclass
class Encoded:
    input_ids: np.ndarray
    targets: np.ndarray
    answer_mask: np.ndarray
    hops: int | None = None  # mixed-hop p-hop: the example's hop count (the item's `hops`, scored per hop count)


class TaskSpec:
    """What a task needs to become tensors: its example maker, vocabulary, length and encoder."""

    name: str
    vocab: Vocab
    seq_len: int
    make: Callable[..., Any]  # make(seed, split, index) -> example

    def encode(self, ex) -> Encoded:
        raise NotImplementedError

    def _layout(self, seq: list[int], loss_at: dict[int, int], answer_pos: int) -> Encoded:
        T = self.seq_len
        inp = np.full(T, self.vocab.pad_id, dtype=np.int64)
        inp[: len(seq) - 1] = seq[:-1]
        tgt = np.full(T, IGNORE, dtype=np.int64)
        for t, tok in loss_at.items():
            tgt[t] = tok
        mask = np.zeros(T, dtype=bool)
        mask[answer_pos] = True
        return Encoded(inp, tgt, mask)


def _symbol_names(alphabet: int) -> list[str]:
    return [chr(ord("a") + i) for i in range(alphabet)] if alphabet <= 26 else [f"s{i}" for i in range(alphabet)]


class PHopSpec(TaskSpec):
    name = "phop"

    def __init__(self, n: int, p: int | Sequence[int], alphabet: int, test_fraction: float = 0.5,
                 per_position_loss: bool = True):
        hops = phop.hop_counts(p)
        if hops is not None:  # mixed hop counts (a list, e.g. a Hydra ListConfig): plain ints from here on
            hops = tuple(int(h) if isinstance(h, (int, np.integer)) and not isinstance(h, bool) else h for h in hops)
            p = list(hops)
        phop.validate_args(n, p, alphabet)
        self.n, self.p, self.alphabet, self.per_position_loss = n, p, alphabet, per_position_loss
        # mixed: each sequence starts with its hop-count token, so every position (the per-position targets
        # included) knows how many hops to follow
        self.hops = tuple(sorted(hops)) if hops is not None else None
        hop_names = [f"<p{k}>" for k in self.hops] if self.hops else []
        self.vocab = Vocab(["<pad>", "<query>", *_symbol_names(alphabet), *hop_names])
        self.sym0 = self.vocab.ids["<query>"] + 1  # symbol k is token sym0 + k
        self.offset = 1 if self.hops else 0  # the hop-count token before the symbols
        self.seq_len = self.offset + n + 1  # [hop count] + symbols + query; the answer is only a target
        self.make = partial(phop.make_example, n=n, p=p, alphabet=alphabet, test_fraction=test_fraction)

    def encode(self, ex: phop.PHopExample) -> Encoded:
        o = self.offset
        head = [self.vocab[f"<p{ex.p}>"]] if self.hops else []
        seq = head + [self.sym0 + s for s in ex.symbols] + [self.vocab["<query>"], self.sym0 + ex.answer]
        loss_at = {}
        if self.per_position_loss:
            loss_at = {o + t: self.sym0 + h for t, h in enumerate(ex.hop_targets) if h >= 0}
        loss_at[o + self.n] = self.sym0 + ex.answer
        enc = self._layout(seq, loss_at, answer_pos=o + self.n)
        if self.hops:
            enc.hops = ex.p
        return enc


class ManoSpec(TaskSpec):
    name = "mano"

    def __init__(
        self, L: int, modulus: int = 23, test_fraction: float = 0.5, subtree_loss: bool = False, per_position_loss: bool = True
    ):
        mano.validate_args(L, modulus)
        # SPEC: Mano's loss is on the answer. `subtree_loss` (a task arg, off by default; p-hop's
        # per_position_loss does not switch it) adds the value of every operator subtree at its last token.
        self.L, self.modulus, self.subtree_loss = L, modulus, bool(subtree_loss)
        self.vocab = Vocab(
            ["<pad>", "<bos>", "<ans>", *mano.OPS, *(str(v) for v in range(modulus)), *(f"Q{k}" for k in range(1, L + 1))]
        )
        self.seq_len = 2 * L + 4  # <bos> Q (2L+1 expression tokens) <ans>; the answer is only a target
        self.make = partial(mano.make_example, L=L, modulus=modulus, test_fraction=test_fraction)

    def encode(self, ex: mano.ManoExample) -> Encoded:
        v = self.vocab
        seq = [v["<bos>"], v[f"Q{ex.n_ops}"], *(v[tok] for tok in ex.prefix), v["<ans>"], v[str(ex.answer)]]
        ans_pos = len(seq) - 2
        loss_at = {}
        if self.subtree_loss:
            loss_at = {2 + t: v[str(x)] for t, x in enumerate(ex.subtree_values) if x >= 0}  # 2 = <bos> Q
        loss_at[ans_pos] = v[str(ex.answer)]
        return self._layout(seq, loss_at, answer_pos=ans_pos)


def make_task(task: str, task_args: dict | None = None, per_position_loss: bool = True) -> TaskSpec:
    if task not in TASKS:
        raise ValueError(f"task={task!r} is unknown; choose one of {TASKS}")
    given = dict(task_args or {})
    unknown = sorted(set(given) - set(TASK_DEFAULTS[task]))
    if unknown:
        raise ValueError(f"unknown {task} task_args {unknown}; known: {sorted(TASK_DEFAULTS[task])}")
    args = {**TASK_DEFAULTS[task], **given}
    cls = PHopSpec if task == "phop" else ManoSpec
    return cls(**args, per_position_loss=per_position_loss)


class TaskDataset(Dataset):
    """Item i = example i of `split`, tokenised. Pure function of (seed, split, i): any worker,
    rank or restart sees the same item. The train split is a virtual stream of STREAM_LENGTH items."""

    def __init__(self, spec: TaskSpec, split: str, seed: int, size: int):
        self.spec, self.split, self.seed, self.size = spec, split, seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} outside [0, {self.size})")
        enc = self.spec.encode(self.spec.make(self.seed, self.split, int(index)))
        item = {
            "input_ids": torch.from_numpy(enc.input_ids),
            "targets": torch.from_numpy(enc.targets),
            "answer_mask": torch.from_numpy(enc.answer_mask),
        }
        if enc.hops is not None:  # mixed-hop p-hop only: evaluation scores each hop count apart (acc_by_hops)
            item["hops"] = torch.tensor(enc.hops, dtype=torch.long)
        return item


def _positive_int(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive integer")


class TaskDataModule(L.LightningDataModule):
    """Mano / p-hop for Lightning. `batch_size` is GLOBAL: each of w ranks gets batch_size // w.

    Training is one endless, resumable stream (see looplab.data.sampler): global batch s is optimizer step s's,
    so after a restart at trainer.global_step = s the next batch is global batch s and a resumed run sees
    exactly the batches of an uninterrupted one. With `micro_batch` (or the trainer's accumulate_grad_batches = k)
    each rank's share of a step is cut into k micro-batches (data/sampler.py MicroBatches): the same
    sequences per optimizer step as without. The trainer must use
    `use_distributed_sampler=False` (the sampler shards ranks itself) and count validation in
    steps (`val_check_interval=<int>`, `check_val_every_n_epoch=None`): the epoch never ends.
    Validation: the first `val_size` test-split examples; test: the first `test_size`.
    """

    def __init__(
        self,
        task: str,
        batch_size: int = 64,
        task_args: dict | None = None,
        val_size: int = 512,
        test_size: int = 1024,
        seed: int = 0,
        num_workers: int = 0,
        per_position_loss: bool = True,
        micro_batch: int | None = None,  # sequences per device per forward (null: the whole per-device share)
    ):
        super().__init__()
        self.save_hyperparameters()  # stored in checkpoints, so evaluation can rebuild the same data
        for name, v in (("batch_size", batch_size), ("val_size", val_size), ("test_size", test_size)):
            _positive_int(name, v)
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} must be a non-negative integer")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be a non-negative integer")
        self.task, self.batch_size, self.seed, self.micro_batch = task, batch_size, seed, micro_batch
        micro_batching(batch_size, 1, micro_batch)  # a bad micro_batch now, not at the first step
        self.val_size, self.test_size, self.num_workers = val_size, test_size, num_workers
        self.spec = make_task(task, dict(task_args) if task_args is not None else None, per_position_loss)

    # ---------------------------------------------------------------- metadata
    @property
    def vocab(self) -> Vocab:
        return self.spec.vocab

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab.vocab_size

    @property
    def tokenizer_identity(self) -> str:
        """The task's token names in id order, hashed (as an LM tokenizer's identity: recorded, checked on load)."""
        import hashlib
        import json

        return hashlib.sha256(json.dumps(self.spec.vocab.names).encode()).hexdigest()[:16]

    @property
    def seq_len(self) -> int:
        return self.spec.seq_len

    @property
    def hop_counts(self) -> list[int] | None:
        """Mixed-hop p-hop: the hop counts its examples draw from (items carry `hops`); None otherwise."""
        hops = getattr(self.spec, "hops", None)
        return list(hops) if hops else None

    @property
    def pad_id(self) -> int:
        return self.spec.vocab.pad_id

    def decode(self, ids) -> str:
        return self.spec.vocab.decode(ids)

    # ------------------------------------------------------------- distribution
    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is not None:
            return trainer.global_rank, trainer.world_size
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def per_rank_batch_size(self, world_size: int) -> int:
        if self.batch_size % world_size:
            raise ValueError(
                f"batch_size={self.batch_size} is the global batch and must be divisible by the "
                f"world size {world_size}; pick a multiple of {world_size}"
            )
        return self.batch_size // world_size

    def _loader(self, ds: Dataset, sampler, per_rank: int) -> DataLoader:
        return DataLoader(
            ds,
            batch_size=per_rank,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            drop_last=False,
        )

    # -------------------------------------------------------------- dataloaders
    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        per_rank = self.per_rank_batch_size(world)
        trainer = self.trainer
        if trainer is not None and world > 1 and getattr(trainer._accelerator_connector, "use_distributed_sampler", False):
            raise ValueError(
                "TaskDataModule shards ranks itself; construct the Trainer with use_distributed_sampler=False "
                "(Lightning would otherwise try to materialise the endless training stream)"
            )

        def start() -> int:  # read at every iter(): the restored step on resume, the current one on a new epoch
            if trainer is None:
                return 0
            return trainer.global_step * self.batch_size  # one global batch per optimizer step, however micro-batched

        sampler = ResumableSampler(self.batch_size, rank, world, start=start, length=STREAM_LENGTH)
        ds = TaskDataset(self.spec, "train", self.seed, STREAM_LENGTH)
        k = accumulation(self.batch_size, self.micro_batch, trainer, world)
        loader = self._loader(ds, sampler, per_rank)
        return loader if k == 1 else MicroBatches(loader, k, IGNORE)

    def _eval_loader(self, size: int) -> DataLoader:
        rank, world = self._rank_world()
        per_rank = self.per_rank_batch_size(world)
        ds = TaskDataset(self.spec, "test", self.seed, size)
        # DistributedSampler pads the last shard by repeating examples so every rank runs the same
        # number of batches (uneven counts deadlock per-step metric syncs)
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False) if world > 1 else None
        return self._loader(ds, sampler, per_rank)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.val_size)

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_size)

