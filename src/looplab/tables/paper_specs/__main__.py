"""`python -m looplab.tables.paper_specs write|check`: canonicalize the fourteen paper-table specs, or check them
(exit 1 naming each file that does not load or is not in canonical form)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from looplab.tables.paper_specs import NUMBERS, SPEC_DIR, out_of_sync, write


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m looplab.tables.paper_specs", description=__doc__)
    ap.add_argument("command", choices=("write", "check"))
    ap.add_argument("--dir", type=Path, default=SPEC_DIR, help="the folder of table1.yaml … table14.yaml")
    args = ap.parse_args(argv)
    if args.command == "write":
        for p in write(args.dir):
            print(p)
        return 0
    problems = out_of_sync(args.dir)
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print(f"{len(NUMBERS)} paper-table specs in {args.dir}: in canonical form")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
