"""A table of one's own: a yaml spec of arms, metric, pairing and claim, trained and judged like a paper table.

    python -m looplab.tables run path/to/spec.yaml [--dry-run] [--out-root outputs/own] [--jobs N]

The spec (every key but `claim`, `require`, `strata` and `seeds` is required; an unknown key is refused by name):

    name: minlstm_vs_vanilla            # the folder: <out-root>/<name>/
    train: [dataset=phop, loop_depth=1x3, trainer.max_steps=300]   # overrides every run gets
    pair: state_mode                    # the override whose values are the arms
    arms: [vanilla, myideas.minlstm]    # the first is the baseline B; each other arm is an A
    strata: {loop_depth.loops: [2, 4]}  # more swept overrides: one comparison per combination
    seeds: [1, 2, 3]                    # default 1, 2, 3; every arm of a stratum runs every seed
    metric: loss                        # a results.json figure (tables/compare.py: metric_value)
    claim: {sign: -1, delta: 0.05}      # the sign you expect A − B to have, and the smallest effect that matters
    require: [perplexity<unigram_perplexity]   # preconditions each arm must meet, else "not tested"

Each (arm, stratum, seed) is one `python -m looplab.train` job in its own folder, so a job whose ok results.json is
on disk is not trained again (an interrupted build resumes), and a job that fails is recorded and leaves the others
running. The arms of a seed share their common random numbers: the run seed fixes the shared parameters' initial
values and, with `dataset.seed` following it, the batches. Then `tables compare` judges the spec's seeds with its
claim (paired t-intervals, Holm with Benjamini–Hochberg beside it, preconditions, verdicts) and writes
compare_<metric>.{md,csv} beside the runs. The spec's claim and δ are read before any run is: fix them before
looking, and keep the spec file under version control with the code it tests. compare_<metric>.png beside them
plots each line's per-seed differences with their mean and interval (and the δ band).

    python -m looplab.tables run path/to/spec.yaml --seeds auto [--max-seeds 20] [--round-seeds 2] [--restart]

trains the seeds in rounds until every line is decided, as the paper tables do (tables/own_sequential.py: the
spec's seeds first, then R more a round; repeated confidence intervals; sequential.json and alpha_ledger.json
beside the runs).

W&B: when the spec's `train` sets logger=wandb, or with `--logger wandb` (which adds only this summary; the runs
log as the spec says), one more W&B run, `<name>-verdicts` in group `<name>`, holds the lines as a table, the
verdicts in its summary and the plot (offline under <out-root>/<name>/wandb without WANDB_API_KEY; `make
sync-wandb` uploads it). `--logger csv` or `none` turns it off.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_OUT_ROOT = Path("outputs/own")
KEYS = {"name", "train", "pair", "arms", "strata", "seeds", "metric", "claim", "require"}
REQUIRED = ("name", "pair", "arms", "metric")


@dataclass
class OwnSpec:
    name: str
    pair: str
    arms: list[str]
    metric: str
    train: list[str] = field(default_factory=list)
    strata: dict[str, list[str]] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    sign: int | None = None
    delta: float | None = None
    require: list[str] = field(default_factory=list)
    path: Path | None = None

    def jobs(self, seeds: list[int] | None = None) -> list[tuple[str, dict[str, str], int]]:
        """(arm, stratum overrides, seed) of every run (of `seeds`, default the spec's), seed-major so that an
        interrupted build has whole pairs."""
        keys = list(self.strata)
        combos = [dict(zip(keys, c)) for c in itertools.product(*(self.strata[k] for k in keys))] or [{}]
        return [(arm, combo, seed) for seed in (self.seeds if seeds is None else seeds) for combo in combos
                for arm in self.arms]

    def logs_to_wandb(self, logger: str | None = None) -> bool:
        """Whether the verdicts go to W&B: `--logger` when given, else whether the spec's runs log there."""
        if logger is not None:
            return logger == "wandb"
        return any(o.split("=", 1)[0].lstrip("+~") == "logger" and o.split("=", 1)[1] == "wandb" for o in self.train)

    def folder(self, out_root: Path, arm: str, combo: dict[str, str], seed: int) -> Path:
        parts = [arm] + [f"{k}-{v}" for k, v in combo.items()] + [f"s{seed}"]  # no '=': Hydra's grammar
        return out_root / self.name / re.sub(r"[^\w.-]+", "_", "_".join(parts))

    def command(self, out_root: Path, arm: str, combo: dict[str, str], seed: int) -> list[str]:
        return [sys.executable, "-m", "looplab.train", *self.train, f"{self.pair}={arm}",
                *(f"{k}={v}" for k, v in combo.items()), f"seed={seed}",
                f"hydra.run.dir={self.folder(out_root, arm, combo, seed)}"]


def load(path: str | Path) -> OwnSpec:
    """Read and check a spec file; every error names the key and the value."""
    from omegaconf import OmegaConf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"table spec {str(path)!r} does not exist")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    where = f"table spec {str(path)!r}"
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{where} is empty or not a mapping; it needs {', '.join(REQUIRED)}")
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; the keys are {sorted(KEYS)}")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"{where}: missing {missing} (see looplab/tables/own.py for an example)")
    name = str(raw["name"])
    if not re.fullmatch(r"[\w.-]+", name):
        raise ValueError(f"{where}: name={name!r} names a folder: letters, digits, '.', '-' and '_' only")
    arms = raw["arms"]
    if not isinstance(arms, list) or len(arms) < 2 or len(set(map(str, arms))) != len(arms):
        raise ValueError(f"{where}: arms={arms!r} must list two or more distinct values of {raw['pair']!r}")
    train = raw.get("train") or []
    if not isinstance(train, list) or not all(isinstance(o, str) and "=" in o for o in train):
        raise ValueError(f"{where}: train={train!r} must be a list of KEY=VALUE overrides")
    pair = str(raw["pair"])
    clash = [o for o in train if o.split("=", 1)[0].lstrip("+~") in (pair, "seed", "hydra.run.dir")]
    if clash:
        raise ValueError(f"{where}: train sets {clash}; the arms set {pair!r} and the build sets the seed and folder")
    strata = raw.get("strata") or {}
    if not isinstance(strata, dict) or not all(isinstance(v, list) and v for v in strata.values()):
        raise ValueError(f"{where}: strata={strata!r} must map overrides to non-empty lists of values")
    seeds = raw.get("seeds", [1, 2, 3])
    if not isinstance(seeds, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds) \
            or len(set(seeds)) != len(seeds):
        raise ValueError(f"{where}: seeds={seeds!r} must be a list of distinct integers")
    if len(seeds) < 3:
        raise ValueError(f"{where}: seeds={seeds!r}: a paired comparison needs at least 3 seeds")
    claim = raw.get("claim") or {}
    if not isinstance(claim, dict) or set(claim) - {"sign", "delta"}:
        raise ValueError(f"{where}: claim={claim!r} takes sign (+1 or -1) and delta (> 0)")
    sign, delta = claim.get("sign"), claim.get("delta")
    if sign not in (None, -1, 1):
        raise ValueError(f"{where}: claim.sign={sign!r} must be +1 or -1 (the sign you expect A − B to have)")
    if delta is not None and not (isinstance(delta, (int, float)) and delta > 0):
        raise ValueError(f"{where}: claim.delta={delta!r} must be a number > 0")
    require = raw.get("require") or []
    from looplab.tables.compare import Requirement

    for q in require:
        Requirement.parse(str(q))
    return OwnSpec(name=name, pair=pair, arms=[str(a) for a in arms], metric=str(raw["metric"]), train=list(train),
                   strata={str(k): [str(x) for x in v] for k, v in strata.items()}, seeds=list(seeds), sign=sign,
                   delta=float(delta) if delta is not None else None, require=[str(q) for q in require], path=path)


def _finished(folder: Path) -> bool:
    from looplab.runs import load_runs

    return any(r.ok for r in load_runs(folder))


def plan(spec: OwnSpec, out_root: Path, seeds: list[int] | None = None, extra: list[str] | None = None,
         jobs: int = 1) -> tuple[list[list[str]], list[dict]]:
    """The commands of the runs of `seeds` (default the spec's) that have no ok results.json yet, and a record of
    each one that has ('done')."""
    extra = list(extra or [])
    if jobs > 1 and not any(o.split("=", 1)[0] == "hardware.num_threads" for o in spec.train + extra):
        extra.append(f"hardware.num_threads={max(1, (os.cpu_count() or 1) // jobs)}")  # the cores split between jobs
    todo, records = [], []
    for arm, combo, seed in spec.jobs(seeds):
        argv = spec.command(out_root, arm, combo, seed) + extra
        if _finished(spec.folder(out_root, arm, combo, seed)):
            records.append({"argv": argv, "returncode": 0, "done": True})
        else:
            todo.append(argv)
    return todo, records


def train(todo: list[list[str]], jobs: int = 1, tag: str = "") -> list[dict]:
    """Run the commands, `jobs` at a time; one record (argv, returncode) each. A failed job stops nothing."""
    for argv in todo:
        print(f"[{tag}] {' '.join(argv[1:])}", flush=True)
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}

    def execute(argv):
        return {"argv": argv, "returncode": subprocess.run(argv, env=env).returncode}

    if jobs > 1 and len(todo) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(jobs) as pool:
            return list(pool.map(execute, todo))
    return [execute(a) for a in todo]


def judge(spec: OwnSpec, out_root: Path, **kw) -> dict:
    """The spec's folder judged with its claim (tables/compare.py); kw: compare's at_seeds and design."""
    from looplab.tables import compare

    return compare.compare(out_root / spec.name, spec.pair, spec.metric, baseline=spec.arms[0], sign=spec.sign,
                           delta=spec.delta, require=spec.require, order=spec.arms, **kw)


def publish(spec: OwnSpec, res: dict, logger: str | None = None) -> list[Path]:
    """compare_<metric>.{md,csv,png} beside the runs, and the W&B summary when the spec logs there."""
    from looplab.tables import compare

    paths = compare.write(res)
    if spec.logs_to_wandb(logger):
        from looplab.tables.wandb_summary import log_verdicts

        png = next((p for p in paths if p.suffix == ".png"), None)
        paths.append(log_verdicts(res, spec.name, Path(res["folder"]), png))
    return paths


def run(path: str | Path, out_root: Path = DEFAULT_OUT_ROOT, *, dry_run: bool = False, jobs: int = 1,
        extra: list[str] | None = None, logger: str | None = None) -> dict:
    """Train the spec's missing runs (`jobs` at a time), then judge the folder. Returns compare's result plus
    'records' (one per job: argv, returncode, or 'done' when it was already on disk) and 'paths' (what it wrote)."""
    spec = load(path)
    todo, records = plan(spec, out_root, extra=extra, jobs=jobs)
    if dry_run:
        for argv in todo:
            print(f"[{spec.name}] {' '.join(argv[1:])}", flush=True)
        return {"records": records + [{"argv": a, "returncode": None} for a in todo]}
    records += train(todo, jobs, spec.name)
    res = judge(spec, out_root, at_seeds=spec.seeds)  # the spec's seeds only: a sequential build's later rounds
    # may share the folder, and a fixed t-interval over seeds added because earlier looks were undecided is not valid
    res["records"] = records
    res["paths"] = publish(spec, res, logger)
    return res
