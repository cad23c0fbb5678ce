"""FSDP2 collectives per optimizer step of a looped model, at several depths R, on CPU processes (gloo).

`python -m looplab.bench.fsdp_traffic [--loops 1 2 4 8] [--policy per_use gather_once] [--world 2]
[--d-model 128 --layers 2 --steps 4] [--out PATH]`

Every collective FSDP2 issues goes through `torch.distributed` (all_gather_single and
reduce_scatter_single in torch 2.13's _fully_shard/_fsdp_collectives.py), so `count_collectives`
wraps those module functions and counts calls and bytes (an all-gather's gathered output, a
reduce-scatter's unsharded input). Per rank and per optimizer step (forward, backward, AdamW step)
of a plain training loop, after one warm-up step (FSDP2's lazy initialisation); step time is the
median over the timed steps (common.time_round_robin, each step's batch drawn and the ranks met at a
barrier untimed) and peak memory each rank's maximum resident set size (one spawn per
depth and policy, so that it is that configuration's).

Policies (looplab.training.distributed.shard_looped_model): `per_use` is FSDP2's own schedule
(gather_once=False), `gather_once` looplab's default (one gather and one reduction per loop-shared
layer and step).

Measured 2026-12-01 (2 gloo ranks on a shared 2-core VM at load 6-10, so times are rough; 2⊗R llama,
d 512, 2 × 32 tokens per rank, rank 0, per step; `--d-model 512 --seq 32 --batch 2 --steps 5`):

    R   all-gathers (MB)       reduce-scatters (MB)   step ms            maxrss MB
        per_use   gather_once  both                   per_use  g_once    per_use  g_once
    1    6 ( 66)   4 (34)      3 (33)                 1036     374        802     742
    2   10 (130)   4 (34)      3 (33)                 1278    1029        903     736
    4   18 (258)   4 (34)      3 (33)                 1941    1315       1059     755
    8   34 (514)   4 (34)      3 (33)                 3672    2463       1259     803

Since then gather_once applies only where R > 1: at R = 1 nothing is reused, and the `gather_once` column of
the R = 1 row is FSDP2's own schedule (the `per_use` figures). Not re-measured since.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import statistics
import tempfile
from collections import Counter

import torch
import torch.distributed as dist

from looplab.bench.common import Stepper, time_round_robin

COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_single",
               "reduce_scatter_tensor", "reduce_scatter", "all_reduce", "broadcast")
POLICIES = {"per_use": False, "gather_once": True}


def _nbytes(name: str, args, kwargs) -> int:
    """An all-gather's output (the gathered tensor), a reduce-scatter's input (the unsharded one), else the tensor."""
    key = {"all_gather_single": ("output_tensor", 0), "all_gather_into_tensor": ("output_tensor", 0),
           "reduce_scatter_single": ("input", 1), "reduce_scatter_tensor": ("input", 1)}.get(name, (None, 0))
    t = kwargs.get(key[0], args[key[1]] if len(args) > key[1] else None) if key[0] else (args[0] if args else None)
    if isinstance(t, (list, tuple)):
        return sum(x.numel() * x.element_size() for x in t if isinstance(x, torch.Tensor))
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _kind(name: str) -> str:
    """all_gather_single, all_gather_into_tensor, ... → all_gather; reduce_scatter_* → reduce_scatter; else the name."""
    return "all_gather" if name.startswith("all_gather") else "reduce_scatter" if name.startswith("reduce_scatter") \
        else name


@contextlib.contextmanager
def count_collectives(by_group_size: bool = False):
    """→ a Counter of `NAME` (calls) and `NAME_bytes` for every torch.distributed collective made inside; with
    by_group_size, of (kind, group size) → calls and (kind, group size, "bytes") → bytes instead (which collectives
    stay within a node under HSDP: tests/test_fsdp_traffic.py)."""
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if by_group_size:
                key = (_kind(name), dist.get_world_size(kwargs.get("group")))
                counts[key] += 1
                counts[(*key, "bytes")] += _nbytes(name, args, kwargs)
            else:
                counts[name] += 1
                counts[name + "_bytes"] += _nbytes(name, args, kwargs)
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def summarize(counts: Counter) -> dict[str, int]:
    """Counter → {all_gather, all_gather_bytes, reduce_scatter, reduce_scatter_bytes, all_reduce, all_reduce_bytes, ...}."""
    out: Counter = Counter()
    for name, v in counts.items():
        out[_kind(name.removesuffix("_bytes")) + ("_bytes" if name.endswith("_bytes") else "")] += v
    return dict(out)


def make_model(loops: int, d_model: int, layers: int, vocab: int, seed: int = 0):
    from looplab.models import LoopedLM, LoopedLMConfig

    torch.manual_seed(seed)
    cfg = LoopedLMConfig(vocab_size=vocab, d_model=d_model, n_heads=max(2, d_model // 32), ffn_hidden=4 * d_model,
                         n_layers=layers, n_loops=loops, max_seq_len=256)
    return LoopedLM(cfg)


class _TrainStep(Stepper):
    """One optimizer step per episode: `start` draws the step's batch and meets the other ranks at a barrier
    (untimed), `step` runs forward, backward and AdamW counting the collectives → their Counter."""

    def __init__(self, model, opt, spec: dict, rank: int):
        self.model, self.opt, self.spec = model, opt, spec
        self.g = torch.Generator().manual_seed(1 + rank)

    def start(self, episode: int) -> None:
        self.ids = torch.randint(0, self.spec["vocab"], (self.spec["batch"], self.spec["seq"] + 1), generator=self.g)
        dist.barrier()

    def step(self, i: int) -> Counter:
        import torch.nn.functional as F

        with count_collectives() as counts:
            logits = self.model(self.ids[:, :-1]).logits
            F.cross_entropy(logits.flatten(0, 1), self.ids[:, 1:].flatten()).backward()
            self.opt.step()
            self.opt.zero_grad()
        return counts


def _worker(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    from looplab.training.distributed import shard_looped_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(spec.get("threads", 1))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for R in spec["loops"]:
        for policy in spec["policies"]:
            model = make_model(R, spec["d_model"], spec["layers"], spec["vocab"])
            shard_looped_model(model, gather_once=POLICIES[policy])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            counted: list[Counter] = []
            # step 0 (warm-up, untimed): FSDP2's lazy initialisation
            timings = time_round_robin({"step": _TrainStep(model, opt, spec, rank)}, episodes=[1] * (1 + spec["steps"]),
                                       after=lambda _, counts: counted.append(counts))
            per_step = [summarize(c) for c in counted[1:]]
            assert all(c == per_step[0] for c in per_step), per_step  # the same traffic every step
            results[f"{policy}/R{R}"] = {**per_step[0], "step_s": statistics.median(timings.wall["step"]),
                                         "block_params": sum(p.numel() for p in model.block.parameters()),
                                         "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
            del model, opt
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(loops=(1, 2, 4, 8), policies=("per_use", "gather_once"), world: int = 2, d_model: int = 64, layers: int = 2,
            vocab: int = 64, batch: int = 2, seq: int = 16, steps: int = 2, threads: int = 1) -> dict:
    """{"POLICY/R{R}": {all_gather, all_gather_bytes, reduce_scatter, reduce_scatter_bytes, ..., step_s, maxrss_mb}}
    per rank ({"rank0": ..., "rank1": ...}); `batch` is per rank. maxrss_mb is the rank's high-water mark so far
    (it only grows over the runs of one call: run one policy per call to compare peak memory)."""
    import torch.multiprocessing as mp

    spec = dict(loops=list(loops), policies=list(policies), d_model=d_model, layers=layers, vocab=vocab, batch=batch,
                seq=seq, steps=steps, threads=threads)
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, _free_port(), spec, out), nprocs=world, join=True)
        return {f"rank{r}": json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m looplab.bench.fsdp_traffic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--loops", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--policy", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args(argv)
    res = {}
    for R in a.loops:  # one spawn per (R, policy): maxrss is a per-process high-water mark; policies interleaved
        for policy in a.policy:
            got = measure([R], [policy], a.world, a.d_model, a.layers, 256, a.batch, a.seq, a.steps)
            for rank, figs in got.items():
                res.setdefault(rank, {}).update(figs)
    print(f"{'policy/R':<16}{'all-gathers':>12}{'AG MB':>9}{'reduce-scat':>12}{'RS MB':>9}{'all-reduce':>11}"
          f"{'step ms':>9}{'maxrss MB':>10}   (rank 0, per optimizer step)")
    for key, f in res["rank0"].items():
        print(f"{key:<16}{f.get('all_gather', 0):>12}{f.get('all_gather_bytes', 0) / 2**20:>9.2f}"
              f"{f.get('reduce_scatter', 0):>12}{f.get('reduce_scatter_bytes', 0) / 2**20:>9.2f}{f.get('all_reduce', 0):>11}"
              f"{1e3 * f['step_s']:>9.1f}{f['maxrss_mb']:>10.0f}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return res


if __name__ == "__main__":
    main()
