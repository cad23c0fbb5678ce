"""The peak bytes of the tensors a region allocates, on any device (the CPU included), from the tensors themselves:
deterministic, no wall time, no allocator statistics. torch's MemTracker counts the same way (a storage from its
creation until it is freed) but also attributes every op to modules, several times slower on a tiny model."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakBytes(TorchDispatchMode):
    """`with PeakBytes(exclude=model.parameters()) as pb: ...` → pb.peak: the most bytes held at once by storages
    created inside (a storage counted once, however many views; `exclude`: tensors whose storages are not counted,
    e.g. parameters that ops view)."""

    def __init__(self, exclude=()):
        super().__init__()
        self.now = self.peak = 0
        self._live: dict[int, weakref.ref] = {}
        self._excluded = {t.untyped_storage()._cdata for t in exclude}

    def _freed(self, key: int, nbytes: int) -> None:
        self.now -= nbytes
        self._live.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key not in self._live and key not in self._excluded:
                    n = st.nbytes()
                    self._live[key] = weakref.ref(st, lambda _, key=key, n=n: self._freed(key, n))
                    self.now += n
                    self.peak = max(self.peak, self.now)
        return out
