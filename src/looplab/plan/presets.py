"""`python -m looplab.plan.presets`: the plan of every paper preset on 1×8 and 4×8 GPUs, the table of docs/scale.md.

Each preset is planned as its own `python -m looplab.plan` (a subprocess: one configuration per process, as a user
runs it), at the preset's own global batch and micro-batch, without the proposal search. The figures go to
`docs/scale_plans.json`; the markdown table between the markers in docs/scale.md is rendered from that file
(`render`), and tests/test_plan.py checks that the two agree and that every preset fits.

    python -m looplab.plan.presets [--gpu h100] [--jobs 2] [--out docs/scale_plans.json] [--doc docs/scale.md]
    python -m looplab.plan.presets --render-only     # re-render docs/scale.md from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_OUT = ROOT / "docs" / "scale_plans.json"
DEFAULT_DOC = ROOT / "docs" / "scale.md"
START, END = "<!-- scale-table:start (python -m looplab.plan.presets) -->", "<!-- scale-table:end -->"

ARMS = ("vanilla", "looped", "stateloop", "stateloop_attn", "stateloop_mamba2")
# (name, overrides): the paper presets, table 1's grid at both sizes, and the Mamba-2 / hybrid 370M backbones on
# lm_410m's recipe (48 layers of d 1024, the 370M models' depth)
PRESETS: list[tuple[str, list[str]]] = [
    ("lm_410m", ["+experiment=lm_410m"]),
    ("lm_1.4b", ["+experiment=lm_1.4b"]),
    *[(f"stateloop_main {size} {arm}", ["+experiment=stateloop_main", f"+arm={arm}", f"backbone=llama_{size}"])
      for size in ("410m", "1.4b") for arm in ARMS],
    ("mamba2_370m 48x1", ["+experiment=lm_410m", "backbone=mamba2_370m", "loop_depth=48x1"]),
    ("hybrid_370m 48x1", ["+experiment=lm_410m", "backbone=hybrid_370m", "loop_depth=48x1"]),
]
TOPOLOGIES: list[tuple[int, int]] = [(1, 8), (4, 8)]  # (nodes, GPUs per node)
KEPT = ("fits", "peak_bytes", "capacity_bytes", "breakdown", "micro_batch", "grad_accum", "global_batch", "seq_len",
        "tokens_per_step", "world_size", "activation_checkpointing", "collective_bytes_per_step", "collectives",
        "flops_per_step", "est_step_s", "est_comm_s", "est_tokens_per_s", "est_mfu", "notes")


def plan_one(name: str, overrides: list[str], nodes: int, devices: int, gpu: str) -> dict:
    """One preset on nodes × devices: `python -m looplab.plan` in a subprocess, its JSON cut to the table's keys plus
    the token budget (trainer.max_steps × tokens per step)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        argv = [*overrides, f"trainer.num_nodes={nodes}", f"trainer.devices={devices}", f"plan.gpu={gpu}",
                "plan.propose=false"]
        proc = subprocess.run([sys.executable, "-m", "looplab.plan", *argv, f"plan.out={out}"], cwd=tmp,
                              capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            return {"preset": name, "nodes": nodes, "devices_per_node": devices, "overrides": argv, "fits": False,
                    "error": (proc.stderr or proc.stdout).strip().splitlines()[-1]}
        full = json.loads(out.read_text())
    from looplab.plan import compose

    max_steps = int(compose(argv).trainer.max_steps)
    row = {"preset": name, "nodes": nodes, "devices_per_node": devices, "overrides": argv,
           "parameters": full["config"]["parameters"], **{k: full[k] for k in KEPT if k in full}}
    row["max_steps"] = max_steps
    row["token_budget"] = max_steps * full["tokens_per_step"]
    row["est_days"] = row["token_budget"] / full["est_tokens_per_s"] / 86400
    return row


def gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def render(data: dict) -> str:
    """The markdown table of docs/scale.md from the presets' JSON (every figure rounded from it)."""
    lines = [f"Planned {data['planned']} on {data['gpu_name']} ({gib(data['rows'][0]['capacity_bytes'])} GiB usable per "
             f"GPU after the {data['reserve_gib']:g} GiB reserve) with `{data['command']}`; figures from "
             "`docs/scale_plans.json`. *est.* = estimated (roofline, not measured).",
             "",
             "| preset | GPUs | params | micro-batch × accum. | peak GiB / GPU | fits | collectives GB / step / GPU "
             "| est. tokens/s | est. MFU | est. days to budget (tokens) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        gpus = f"{r['nodes']}×{r['devices_per_node']}"
        if "error" in r:
            lines.append(f"| {r['preset']} | {gpus} | | | | error: {r['error']} | | | | |")
            continue
        ac = r.get("activation_checkpointing")
        mb = f"{r['micro_batch']} × {r['grad_accum']}" + (f" (AC {ac})" if ac not in (False, None, "false") else "")
        lines.append(
            f"| {r['preset']} | {gpus} | {r['parameters'] / 1e6:,.0f}M | {mb} | {gib(r['peak_bytes'])} "
            f"| {'yes' if r['fits'] else '**no**'} | {r['collective_bytes_per_step'] / 1e9:.2f} "
            f"| {r['est_tokens_per_s']:,.0f} | {100 * r['est_mfu']:.1f}% "
            f"| {r['est_days']:.1f} ({r['token_budget'] / 1e9:.1f}B) |")
    return "\n".join(lines)


def write_doc(data: dict, doc: Path) -> None:
    text = doc.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{doc} has no {START} … {END} block to render the table into")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{START}\n{render(data)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m looplab.plan.presets", description=__doc__.splitlines()[0])
    p.add_argument("--gpu", default="h100")
    p.add_argument("--jobs", type=int, default=2, help="plans at once (each uses about one core)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC)
    p.add_argument("--render-only", action="store_true", help="re-render --doc from --out without planning")
    a = p.parse_args(argv)
    if not a.render_only:
        from datetime import date

        from looplab.plan.gpus import get_gpu

        jobs = [(n, o, nodes, dev) for n, o in PRESETS for nodes, dev in TOPOLOGIES]
        with ThreadPoolExecutor(max(1, a.jobs)) as pool:
            rows = list(pool.map(lambda j: plan_one(*j, a.gpu), jobs))
        for r in rows:
            print(f"{r['preset']} {r['nodes']}×{r['devices_per_node']}: "
                  + (r["error"] if "error" in r else f"{gib(r['peak_bytes'])} GiB, fits {r['fits']}, "
                     f"est. MFU {100 * r['est_mfu']:.1f}%"))
        data = {"planned": date.today().isoformat(), "gpu": a.gpu, "gpu_name": get_gpu(a.gpu).name,
                "reserve_gib": 2.0,
                "command": "python -m looplab.plan <preset> trainer.num_nodes=N trainer.devices=8 plan.gpu="
                           f"{a.gpu} plan.propose=false",
                "rows": rows}
        a.out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {a.out}")
    data = json.loads(a.out.read_text())
    write_doc(data, a.doc)
    print(f"rendered the table into {a.doc}")
    return 0 if all(r.get("fits") for r in data["rows"] if not r["preset"].startswith(("mamba2", "hybrid"))) else 1


if __name__ == "__main__":
    sys.exit(main())
