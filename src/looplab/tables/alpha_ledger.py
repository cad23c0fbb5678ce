"""The α ledger of a sequential build: every design that judged a table's runs, the looks it made and the α it spent.

`outputs/tables/tableN/<scale>/alpha_ledger.json` sits beside `sequential.json` and outlives it: moving the state
file away no longer starts a new design at the full α on runs that were already looked at (simulated for a cap-9
design looked at 3, 5, 7, 9 seeds and restarted at cap 20: a false-sign rate of 0.053 instead of 0.040). A new
design on these runs (`run N --seeds auto --restart`) is calibrated at the α the ledger says is left
(stats.SequentialDesign.restarted: union bound, every design together errs with probability ≤ α); the ledger is
updated at every save of the state, each design's α spent computed at the looks it actually made
(stats.SequentialDesign.alpha_spent)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from looplab.stats import ALPHA, SEQUENTIAL_MIN_ALPHA_LEFT, SequentialDesign
from looplab.tables.sequential_state import SequentialState, _now

LEDGER_FILE = "alpha_ledger.json"
_DESIGN_KEYS = ("method", "alpha", "cap", "first_look", "simulations", "seed", "nominal_alpha", "spent_alpha")


def ledger_path(out_root: Path, number: int, scale: str) -> Path:
    return Path(out_root) / f"table{number}" / scale / LEDGER_FILE


def _entry(d: dict[str, Any]) -> dict[str, Any]:
    return {k: d[k] for k in _DESIGN_KEYS if k in d}


def _same(entry: dict[str, Any], design: SequentialDesign) -> bool:
    return (int(entry["cap"]) == design.cap and abs(float(entry["alpha"]) - design.alpha) < 1e-12
            and abs(float(entry.get("spent_alpha", 0.0)) - design.spent) < 1e-12)


@dataclass
class AlphaLedger:
    table: int
    scale: str
    designs: list[dict[str, Any]] = field(default_factory=list)
    table_key = staticmethod(int)  # what `table` is read back as: a paper table's number (own_sequential: a name)

    @classmethod
    def load(cls, path: Path) -> AlphaLedger | None:
        path = Path(path)
        if not path.exists():
            return None
        d = json.loads(path.read_text())
        return cls(cls.table_key(d["table"]), d["scale"], list(d.get("designs") or []))

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"table": self.table, "scale": self.scale, "alpha": self.overall,
                                   "alpha_spent": self.spent, "alpha_left": self.left, "designs": self.designs},
                                  indent=2) + "\n")
        os.replace(tmp, path)

    @property
    def overall(self) -> float:
        return SequentialDesign.from_dict(self.designs[0]).overall if self.designs else round(ALPHA, 12)

    @property
    def spent(self) -> float:
        return sum(float(e.get("alpha_spent", 0.0)) for e in self.designs)

    @property
    def left(self) -> float:
        return self.overall - self.spent

    def looks_text(self) -> str:
        return "; ".join(f"design {i} (cap {e['cap']}) looked at n = {', '.join(map(str, e.get('looks') or [])) or 'none'} "
                         f"and spent α = {float(e.get('alpha_spent', 0.0)):.4f}" for i, e in enumerate(self.designs, 1))

    # ------------------------------------------------------------------ with a state file
    def record(self, state: SequentialState) -> None:
        """Bring the ledger up to the state's design and its looks (the first time: every design the state knows)."""
        cur = self.designs[-1] if self.designs and not self.designs[-1].get("closed") else None
        if cur is not None and not _same(cur, state.design) and state.design.history \
                and _same(cur, SequentialDesign.from_dict(state.design.history[-1])):
            h = state.design.history[-1]  # the state was just restarted (--restart): close its earlier design
            cur.update(looks=list(h.get("looks") or []), alpha_spent=float(h.get("alpha_spent", 0.0)),
                       closed=h.get("closed") or _now(), updated=_now())
            cur = None
        if not self.designs:
            self.designs = [{**_entry(h), "looks": list(h.get("looks") or []), "alpha_spent": float(h.get("alpha_spent", 0.0)),
                             "closed": h.get("closed") or "before the ledger"} for h in state.design.history]
        if cur is None:
            cur = {**_entry(state.design.as_dict()), "opened": _now(), "closed": None}
            self.designs.append(cur)
        elif not _same(cur, state.design):
            raise ValueError(f"the state file's design (cap {state.design.cap}, α = {state.design.alpha:.4f}) is not the "
                             f"α ledger's current one (cap {cur['cap']}, α = {float(cur['alpha']):.4f}): was an old "
                             f"sequential.json put back? The ledger: {self.looks_text()}")
        looks = state.design_looks()
        cur.update(looks=looks, alpha_spent=state.design.alpha_spent(looks), updated=_now())

    # ------------------------------------------------------------------ without one (it was moved away)
    def restarted(self, cap: int) -> SequentialDesign:
        """A new design capped at `cap`, calibrated at the α the ledger's designs left; closes the current one at the
        looks it recorded (the state file that held it is gone) and opens the new one."""
        if not self.designs:
            raise ValueError("the α ledger holds no design to restart from")
        base = SequentialDesign.from_dict(self.designs[-1])
        left = self.left
        if left < SEQUENTIAL_MIN_ALPHA_LEFT:
            raise ValueError(f"the designs on these runs have spent α = {self.spent:.4f} of {self.overall:.2f}; the "
                             f"{left:.4f} left is too little for a new design ({self.looks_text()})")
        for e in self.designs:
            e["closed"] = e.get("closed") or _now()
        history = tuple({**_entry(e), "looks": list(e.get("looks") or []), "alpha_spent": float(e.get("alpha_spent", 0.0)),
                         "closed": e["closed"]} for e in self.designs)
        design = SequentialDesign(cap, alpha=left, first_look=base.first_look, simulations=base.simulations,
                                  seed=base.seed, method=base.method, spent=self.spent, history=history)
        self.designs.append({**_entry(design.as_dict()), "opened": _now(), "closed": None, "looks": [], "alpha_spent": 0.0})
        return design
