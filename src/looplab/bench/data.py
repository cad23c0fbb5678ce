"""Data benchmark: the DataModules' training batches/s vs the training step rate.

The loader must never be the bottleneck: the target is ≥ 20× the training step rate at the
same batch size and sequence length. Loaders run in the main process (num_workers=0, the
CPU default), so these are single-process figures. Each DataModule is imported lazily; a part
that has not landed yet is reported as pending rather than failing the benchmark.
"""

from __future__ import annotations

import os
import time

from looplab.bench import common

TARGET = 20.0


def _rate(it, n: int, warmup: int) -> float:
    """Batches per wall second: n batches drawn one per timed call, after `warmup` untimed ones."""
    return n / sum(common.time_round_robin({"next": lambda: next(it)}, n, warmup=warmup).wall["next"])


def lm_batches_per_s(batch: int, seq_len: int, n: int, cache_dir: str) -> dict:
    try:
        from looplab.data.lm import LMDataModule
    except ImportError as e:
        return {"status": "pending", "reason": f"looplab.data.lm not importable: {e}"}
    dm = LMDataModule(source="shakespeare", tokenizer="shakespeare-bpe-4096", seq_len=seq_len, batch_size=batch,
                      cache_dir=cache_dir)
    t0 = time.perf_counter()
    dm.prepare()  # tokenise + pack once (cached afterwards); not part of the steady-state rate
    prep = time.perf_counter() - t0
    return {"batches_per_s": _rate(iter(dm.train_batches(0)), n, warmup=3), "prepare_s": round(prep, 2),
            "source": "shakespeare (embedded)", "batch": batch, "seq_len": seq_len}


def task_batches_per_s(batch: int, seq_len: int, n: int) -> dict:
    try:
        from looplab.data.tasks import TaskDataModule
    except ImportError as e:
        return {"status": "pending", "reason": f"looplab.data.tasks not importable: {e}"}
    # p-hop at the paper's n = 256 (sequence 257) matches the training benchmark's T
    dm = TaskDataModule("phop", batch_size=batch, task_args={"n": seq_len, "p": 32 if seq_len >= 64 else 3, "alphabet": 4})
    return {"batches_per_s": _rate(iter(dm.train_dataloader()), n, warmup=2), "task": "phop", "batch": batch,
            "seq_len": dm.seq_len}


def _train_step_rate(threads: int, quick: bool) -> float:
    """Training steps/s of the looped model at the same config, when the train entry did not run."""
    from looplab.bench import train

    d = train.QUICK if quick else train.FULL
    step = train.make_step(train.looplab_model(d), d)[0]
    t = common.time_round_robin({"s": step}, 2 if quick else 3, warmup=1).wall["s"]
    return 1.0 / common.median(t)


def run(threads: int = 2, quick: bool = False, train_steps_per_s: float | None = None,
        cache_dir: str | None = None) -> dict:
    common.set_threads(threads)
    from looplab.bench import train

    d = train.QUICK if quick else train.FULL
    n = 20 if quick else 100
    cache_dir = cache_dir or os.environ.get("LOOPLAB_CACHE", "data_cache")
    res: dict = {
        "lm": lm_batches_per_s(d["batch"], d["seq_len"], n, cache_dir),
        "tasks": task_batches_per_s(d["batch"], d["seq_len"], n),
    }
    if train_steps_per_s is None:
        train_steps_per_s = _train_step_rate(threads, quick)
    res["train_steps_per_s"] = train_steps_per_s
    for k in ("lm", "tasks"):
        if "batches_per_s" in res[k]:
            res[k]["ratio_vs_train_step"] = res[k]["batches_per_s"] / train_steps_per_s
            res[k]["meets_20x"] = res[k]["ratio_vs_train_step"] >= TARGET
    ratios = [res[k]["ratio_vs_train_step"] for k in ("lm", "tasks") if "ratio_vs_train_step" in res[k]]
    if ratios:
        res["min_ratio_vs_train_step"] = min(ratios)
    return res
