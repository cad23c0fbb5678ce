"""The eight paper tables: which sweeps feed each one, at tiny (CPU) and paper scale.

A table is a list of `Sweep`s (one `python -m looplab.train -m +experiment=X ...`
each) plus the way its rows are built (report.py). The grid of a sweep is the
product of the experiment file's own `hydra.sweeper.params` and the sweep
parameters the table adds here, so the report knows which runs *should* exist and
can list the missing ones. Nothing here imports the model or the trainer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
CONF = ROOT / "conf"
SCALES = ("tiny", "paper")


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
    """

    experiment: str
    params: tuple[tuple[str, tuple[str, ...]], ...] = ()
    fixed: tuple[str, ...] = ()
    name: str | None = None
    init_from: tuple[str, tuple[tuple[str, str], ...]] | None = None

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
          name: str | None = None, init_from: tuple[str, dict[str, str]] | None = None) -> Sweep:
    return Sweep(
        experiment=experiment,
        params=tuple((k, tuple(v)) for k, v in (params or {}).items()),
        fixed=tuple(fixed or ()),
        name=name,
        init_from=(init_from[0], tuple(init_from[1].items())) if init_from else None,
    )


@dataclass(frozen=True)
class TableSpec:
    number: int
    title: str
    kind: str  # how report.py builds rows: lm | task | depth | reset | decode | exit
    sweeps: dict[str, tuple[Sweep, ...]]  # scale -> sweeps (empty for table 4)
    metric: str  # 'perplexity' or 'accuracy'
    notes: dict[str, str] = field(default_factory=dict)  # scale -> what differs from the paper

    def sweeps_for(self, scale: str) -> tuple[Sweep, ...]:
        if scale not in SCALES:
            raise ValueError(f"scale={scale!r} is unknown; choose one of {SCALES}")
        return self.sweeps[scale]


def _exit_sweeps(experiments: list[str]) -> tuple[Sweep, ...]:
    """Table 8: fixed loops and stage 1 in one sweep, then stage 2 warm-started from the fixed-loop run."""
    out = []
    for e in experiments:
        out.append(sweep(e, params={"exit_gate": ["none", "ouro"]}))
    for e in experiments:
        out.append(sweep(e, fixed=["exit_gate.stage=stage2"], name=f"{e}_stage2",
                         init_from=(e, {"exit_gate": "none"})))
    return tuple(out)


TABLES: dict[int, TableSpec] = {
    1: TableSpec(1, "StateLoop main: Vanilla, Vanilla Looped, StateLoop, +attn, +Mamba-2", "lm",
                 {"tiny": (sweep("stateloop_main_tiny"),), "paper": (sweep("stateloop_main"),)}, "perplexity",
                 notes={"tiny": "2⊗3 llama d128 on the embedded Shakespeare corpus, 300 steps; zero-shot: n/a (a 300-step "
                                "Shakespeare model is at chance on any zero-shot suite; `zeroshot 1 --tasks looplab_tiny_mc` "
                                "runs the plumbing on the shipped 20-question task)",
                        "paper": "6⊗4 at 410M and 1.4B on the Pile; zero-shot average over the 8-task suite "
                                 "(`python -m looplab.tables zeroshot 1 --scale paper` after training)"}),
    2: TableSpec(2, "Loop depth: Vanilla Looped vs StateLoop, R = 3..7", "depth",
                 {"tiny": (sweep("stateloop_depth_tiny"),), "paper": (sweep("stateloop_depth"),)}, "perplexity",
                 notes={"tiny": "1⊗R llama d128, embedded corpus, 300 steps", "paper": "4⊗R at 410M on the Pile"}),
    3: TableSpec(3, "State reset: carry vs reset", "reset",
                 {"tiny": (sweep("stateloop_reset_tiny"),), "paper": (sweep("stateloop_reset"),)}, "perplexity",
                 notes={"tiny": "2⊗3 llama d128, embedded corpus, 300 steps", "paper": "6⊗4 at 410M on the Pile"}),
    4: TableSpec(4, "Decoding latency per generated token", "decode", {"tiny": (), "paper": ()}, "per_token_ms",
                 notes={"tiny": "bench/decode.json of the decoding benchmark, fp32 on the CPU (`make table4` runs it in quick mode "
                                "with 1 thread; the full run adds context 256 and a 24-layer block)",
                        "paper": "bench/decode.json of the full `python -m looplab.bench.decode` (d 512, 4⊗4 plus a 24-layer block)"}),
    5: TableSpec(5, "Mano: accuracy per N⊗R", "task",
                 {"tiny": (sweep("mano_tiny"), sweep("mano_mamba_tiny"), sweep("mano_hybrid_tiny")),
                  "paper": (sweep("mano_paper"), sweep("mano_mamba"), sweep("mano_hybrid"))}, "accuracy",
                 notes={"tiny": "the mano_*_tiny experiments, small L and modulus (conf/dataset/mano.yaml and the experiment files; modulus 23 does not learn in CPU-minutes, SPEC §5); `steps` gives each run's training steps",
                        "paper": "L = 24, modulus 23: 4⊗1, 4⊗6, 24⊗1"}),
    6: TableSpec(6, "p-hop induction: accuracy per N⊗R", "task",
                 {"tiny": (sweep("phop_tiny"), sweep("phop_mamba_tiny")), "paper": (sweep("phop_paper"), sweep("phop_mamba"))},
                 "accuracy",
                 notes={"tiny": "n = 32, p = 3, alphabet 4, d 64 (phop_*_tiny); `steps` gives each run's training steps", "paper": "n = 256, p = 32, alphabet 4"}),
    7: TableSpec(7, "Iso-parameter and iso-FLOP language modelling", "lm",
                 {"tiny": tuple(sweep(e) for e in ("lm_mamba_isoparam_tiny", "lm_mamba_isoflop_tiny",
                                                   "lm_hybrid_isoparam_tiny", "lm_hybrid_isoflop_tiny")),
                  "paper": tuple(sweep(e) for e in ("lm_mamba_isoparam", "lm_mamba_isoflop", "lm_hybrid_isoparam", "lm_hybrid_isoflop"))},
                 "perplexity",
                 notes={"tiny": "d 128 on the embedded corpus, 300 steps; iso-param N=2, R=1,2,4; iso-FLOP N·R=4",
                        "paper": "140M-class width on the Pile; iso-param N=4, R=1,2,4,6; iso-FLOP N·R=24"}),
    8: TableSpec(8, "Exit gate: fixed loops vs stage 1 vs stage 2", "exit",
                 {"tiny": _exit_sweeps(["exit_gate_mamba_tiny", "exit_gate_llama_tiny", "exit_gate_stateloop_tiny"]),
                  "paper": _exit_sweeps(["exit_gate_mamba", "exit_gate_llama", "exit_gate_stateloop"])}, "accuracy",
                 notes={"tiny": "1⊗4 on p-hop (n 32, p 3); stage 2 warm-starts from the fixed-loop run",
                        "paper": "4⊗4 on the Pile (accuracy = next-token accuracy)"}),
}


def get(number: int) -> TableSpec:
    try:
        return TABLES[int(number)]
    except (KeyError, ValueError):
        raise ValueError(f"table {number!r} does not exist; choose one of {sorted(TABLES)}") from None
