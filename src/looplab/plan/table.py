"""`python -m looplab.tables plan N --scale paper`: the plan of every run of a paper table, before any node is booked.

A table's runs are its sweeps' grids (tables/sweeps.py), each composed with the overrides `python -m looplab.tables
run N` gives that job (the experiment, the grid entry, the sweep's fixed overrides, `--hardware`, and for a stage-2
sweep the checkpoint path it would warm-start from, which the plan does not read). Seeds do not change a plan: one
per configuration.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from looplab.tables.spec import DEFAULT_OUT_ROOT, get


def table_runs(number: int, scale: str, hardware: str | None = None,
               out_root: Path = DEFAULT_OUT_ROOT) -> list[tuple[str, list[str]]]:
    """[(name, train overrides)] of every configuration of table `number` at `scale`."""
    from looplab.tables.runner import _experiment_hardware, resolve_init_from

    table = get(number)
    runs = []
    for sw in table.sweeps_for(scale):
        for i, combo in enumerate(sw.grid()):
            overrides = [f"+experiment={sw.experiment}", *sw.combo_overrides(combo)]
            if hardware:
                overrides.append(f"hardware={hardware}")
                if hardware != "fsdp" and _experiment_hardware(sw) == "fsdp":
                    overrides.append("trainer.strategy=fsdp")
            overrides += [a.replace("{out_root}", str(out_root)) for a in sw.fixed]
            if sw.init_from is not None:
                ckpt = resolve_init_from(table, scale, sw, out_root, None, None, dry_run=True)  # not read by a plan
                overrides.append(f"exit_gate.init_from={ckpt}")
            name = sw.folder + ("" if len(sw.grid()) == 1 else f"[{','.join(f'{k}={v}' for k, v in combo.items())}]")
            runs.append((name, overrides))
    return runs


def plan_table(number: int, scale: str, *, gpu: str = "h100", nodes: int | None = None, devices: int | None = None,
               hardware: str | None = None,
               extra: list[str] | None = None, propose: bool = True, out: Path | None = None,
               echo=print) -> list[dict[str, Any]]:
    """Plan every run of the table; print each plan and a summary; write them all as JSON to `out`."""
    from looplab.plan import compose, format_plan, plan

    runs = table_runs(number, scale, hardware)
    if not runs:
        echo(f"table {number} has no training runs at scale {scale} (nothing to plan)")
        return []
    planned = []
    for name, overrides in runs:
        world = [f"trainer.{k}={v}" for k, v in (("num_nodes", nodes), ("devices", devices)) if v is not None]
        argv = [*overrides, *world, f"plan.gpu={gpu}", f"plan.propose={str(propose).lower()}", *(extra or [])]
        echo(f"\n== table {number} {scale}: {name}\n   python -m looplab.plan {' '.join(argv)}")
        try:
            p = plan(compose(argv), overrides=argv)
            echo(format_plan(p))
        except Exception as e:  # recorded, and the next run is planned
            p = {"error": f"{type(e).__name__}: {e}", "fits": False}
            echo(f"error: {p['error']}")
        planned.append({"run": name, "overrides": argv, **p})
    echo(f"\n== table {number} ({scale}) on {gpu}: {sum(bool(p.get('fits')) for p in planned)}/{len(planned)} runs fit")
    for p in planned:
        if "error" in p:
            echo(f"  {p['run']}: error ({p['error'][:120]})")
            continue
        best = (p.get("proposal") or {}).get("best")
        echo(f"  {p['run']}: {p['nodes']}×{p['devices_per_node']} GPUs, peak {p['peak_bytes'] / 2**30:,.2f} GiB "
             f"{'fits' if p['fits'] else 'does NOT fit'}, micro-batch {p['micro_batch']}×{p['grad_accum']}, "
             f"estimated {p['est_tokens_per_s']:,.0f} tokens/s, estimated MFU {100 * p['est_mfu']:.1f}%"
             + (f"; fits with {' '.join(best['overrides'])}" if best else ""))
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(planned, indent=2, default=str))
        echo(f"wrote {out}")
    return planned
