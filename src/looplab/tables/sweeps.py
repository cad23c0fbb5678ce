"""A table's sweeps: one `python -m looplab.train -m +experiment=X ...` each, and the seeds a table runs by default.

The grid of a sweep is the product of the experiment file's own `hydra.sweeper.params` and the sweep parameters the
table adds (tables/catalog.py), so the report knows which runs *should* exist and can list the missing ones.
Nothing here imports the model or the trainer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
CONF = ROOT / "conf"
SCALES = ("tiny", "paper")
DEFAULT_OUT_ROOT = Path("outputs/tables")  # where the sweeps write their runs: <out_root>/tableN/<scale>/<sweep>/
# Seeds a table runs when `--seeds` is not given: three at tiny scale, so every row has an interval
# and every paper comparison a paired difference across seeds; the experiment's own seed at paper scale.
DEFAULT_SEEDS: dict[str, tuple[int, ...]] = {"tiny": (1, 2, 3), "paper": ()}
# lm-eval tasks of table 1's zero-shot column (None: the paper's 8-task hub suite)
ZEROSHOT_TASKS: dict[str, str | None] = {"tiny": "looplab_tiny", "paper": None}


# Tables whose tiny build runs five seeds (docs/tables.md#seeds: five where the table still fits in 60 minutes on 2 idle cores):
# table 2, 30 LM runs (measured: see experiments/README.md). Tables 1 and 3 stay at three.
TINY_SEEDS_PER_TABLE: dict[int, tuple[int, ...]] = {2: (1, 2, 3, 4, 5),
                                                    # table 11 measures speed, no paired claim: one model per arm
                                                    11: (1,),
                                                    # table 14 too: its intervals are over repeated engine runs
                                                    14: (1,)}


def default_seeds(scale: str, number: int | None = None) -> list[int] | None:
    if scale == "tiny" and number in TINY_SEEDS_PER_TABLE:
        return list(TINY_SEEDS_PER_TABLE[number])
    return list(DEFAULT_SEEDS.get(scale, ())) or None


@dataclass(frozen=True)
class Sweep:
    """One multirun over one experiment.

    params: sweep parameters added on the command line ({key: [values]}); they
        override the experiment's own `hydra.sweeper.params` entry of the same key.
    fixed: plain overrides of every job of the sweep.
    name: the sweep's folder under outputs/tables/tableN/<scale>/ (default: experiment).
    init_from: stage-2 sweeps: (sweep name, {key: value}) of the earlier sweep's job whose
        checkpoints/last.ckpt each job warm-starts from (`exit_gate.init_from=`); the
        runner runs that sweep first and resolves the path from its results.json.
    per_seed: one command per seed (folder seed<N>) instead of one multirun, like stage 2: the
        runner starts JOBS of the consecutive ones at once, so sweeps of unequal run lengths share
        the cores without one sweep's last job leaving a core idle (table 8 at tiny scale).
        Stage-2 sweeps are always per seed.
    """

    experiment: str
    params: tuple[tuple[str, tuple[str, ...]], ...] = ()
    fixed: tuple[str, ...] = ()
    name: str | None = None
    init_from: tuple[str, tuple[tuple[str, str], ...]] | None = None
    per_seed: bool = False

    @property
    def one_command_per_seed(self) -> bool:
        """Stage-2 sweeps (init_from) and per_seed sweeps run as one command per seed."""
        return self.per_seed or self.init_from is not None

    @property
    def folder(self) -> str:
        return self.name or self.experiment

    def experiment_file(self) -> Path:
        return CONF / "experiment" / f"{self.experiment}.yaml"

    def experiment_config(self) -> dict[str, Any]:
        from omegaconf import OmegaConf

        path = self.experiment_file()
        if not path.exists():
            raise FileNotFoundError(f"experiment {self.experiment!r} has no config file {path}")
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False)

    def grid_params(self, seeds: list[int] | None = None) -> dict[str, list[str]]:
        """{key: values} of the sweep, in Hydra's order: the experiment's params, then ours, then seed."""
        own = (self.experiment_config().get("hydra") or {}).get("sweeper", {}).get("params") or {}
        grid: dict[str, list[str]] = {k.lstrip("+~"): _split(v) for k, v in own.items()}
        for k, vs in self.params:
            grid[k.lstrip("+~")] = list(vs)
        if seeds:
            grid["seed"] = [str(s) for s in seeds]
        return grid

    def grid(self, seeds: list[int] | None = None) -> list[dict[str, str]]:
        """Every job the sweep should produce, as {key: value} of its swept overrides."""
        g = self.grid_params(seeds)
        keys = list(g)
        return [dict(zip(keys, combo)) for combo in itertools.product(*(g[k] for k in keys))]

    def combo_overrides(self, combo: dict[str, str]) -> list[str]:
        """A grid entry as the overrides Hydra gives that job ('+arm=looped' keeps its '+')."""
        own = (self.experiment_config().get("hydra") or {}).get("sweeper", {}).get("params") or {}
        raw = {k.lstrip("+~"): k for k in [*own, *(k for k, _ in self.params)]}
        return [f"{raw.get(k, k)}={v}" for k, v in combo.items()]

    def experiment_tags(self) -> list[str]:
        return list(self.experiment_config().get("tags") or [])


def _split(v: Any) -> list[str]:
    """A Hydra sweep value ('1x1,1x2' or a list) → its choices as strings."""
    if isinstance(v, (list, tuple)):
        return [str(x) for x in v]
    return [s.strip() for s in str(v).split(",") if s.strip()]


def sweep(experiment: str, params: dict[str, list[str]] | None = None, fixed: list[str] | None = None,
          name: str | None = None, init_from: tuple[str, dict[str, str]] | None = None, per_seed: bool = False) -> Sweep:
    return Sweep(
        experiment=experiment,
        params=tuple((k, tuple(v)) for k, v in (params or {}).items()),
        fixed=tuple(fixed or ()),
        name=name,
        init_from=(init_from[0], tuple(init_from[1].items())) if init_from else None,
        per_seed=per_seed,
    )

