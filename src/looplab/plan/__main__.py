"""python -m looplab.plan [train overrides] trainer.num_nodes=N trainer.devices=G plan.gpu=h100|h200|a100 [plan.out=FILE.json]

A dry run of the training configuration those overrides give `python -m looplab.train` (looplab/plan/__init__.py,
docs/scale.md): peak memory per GPU and whether it fits, collectives, FLOPs, an estimated step time, tokens/s and MFU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    if any(a in ("-m", "--multirun") for a in argv):
        raise SystemExit("python -m looplab.plan plans one configuration; "
                         "`python -m looplab.tables plan N` plans a table's runs")
    from looplab.plan import compose, format_plan, plan
    from looplab.training.variants import register_cli_variants

    register_cli_variants(argv)  # a researcher's variant named on the command line, as looplab.train does
    cfg = compose(argv)
    result = plan(cfg, overrides=argv)
    print(format_plan(result))
    out = cfg.plan.get("out")
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    from looplab.cli_errors import run_cli

    sys.exit(run_cli(main, "python -m looplab.plan"))
