"""Count, on the CPU, what would make a GPU wait: host-device syncs in a decoding step (docs/decoding.md#on-a-gpu).

A step that reads a tensor's value on the host — `.item()`, `.tolist()`, `int()` / `bool()` / `float()` / an index
of a tensor, `nonzero`, `unique`, a boolean-mask index, `torch.multinomial` — or builds a device tensor from Python
data (`torch.tensor([...])`: a host-to-device copy) waits for every kernel queued before it. None of that shows on
the CPU, where nothing is queued; `HostSyncs` sees each one as it is called (a TorchFunctionMode), so tests pin the
counts per step without a GPU:

    with HostSyncs() as syncs:
        engine.step()
    assert syncs.count <= 3, syncs.report()
"""

from __future__ import annotations

import sys
import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

# what reads a device value on the host, or copies host data to the device
READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique", "unique_consecutive",
         "masked_select", "multinomial", "argwhere", "bincount", "repeat_interleave", "numpy", "cpu"}
CREATES = {"tensor", "as_tensor"}  # from Python data: a host-to-device copy on a GPU


class HostSyncs(TorchFunctionMode):
    """Counts the calls that would sync a GPU with its host, by kind and by the line of looplab that made them."""

    def __init__(self):
        super().__init__()
        self.kinds: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.kinds.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        kind = None
        if name in READS:
            if name != "repeat_interleave" or (len(args) > 1 and isinstance(args[1], torch.Tensor)
                                               and "output_size" not in kwargs):
                kind = name
        elif name in CREATES and args and not isinstance(args[0], torch.Tensor):
            kind = f"torch.{name}(host data)"
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and _bool_index(args[1]):
            kind = f"{name}[bool mask]"
        elif name == "where" and len(args) == 1 and not kwargs:
            kind = "where(cond)"
        if kind is not None:
            self.kinds[kind] += 1
            self.sites[f"{kind} at {_site()}"] += 1
        return func(*args, **kwargs)

    def report(self) -> str:
        return ", ".join(f"{n}× {s}" for s, n in self.sites.most_common())


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _site() -> str:
    """The innermost frame of looplab's own code (not this module, not torch)."""
    for frame in reversed(traceback.extract_stack(sys._getframe(2), limit=12)):
        if "looplab" in frame.filename and "testing/syncs.py" not in frame.filename:
            return f"{frame.filename.split('looplab/')[-1]}:{frame.lineno}"
    return "?"
