"""python -m looplab.models capabilities [--import MODULE ...] [--builtins]: what every registered variant supports.

Lists looplab's own variants and every variant registered from outside looplab: the modules named with `--import`
(found as a variant's dotted name is: on PYTHONPATH or installed, never in the working directory) and the packages
installed with a `looplab.variants` entry point (docs/extending.md#registries-and-capabilities). `--builtins`
prints looplab's own only: the table docs/extending.md holds.
"""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from looplab.models.registry import capability_table, import_variant_modules

    ap = argparse.ArgumentParser(prog="python -m looplab.models", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["capabilities"])
    ap.add_argument("--import", dest="modules", action="append", default=[], metavar="MODULE",
                    help="a module that registers variants (repeatable), e.g. my_looped_ideas.mingru")
    ap.add_argument("--builtins", action="store_true", help="looplab's own variants only (docs/extending.md's table)")
    args = ap.parse_args(argv)
    if args.builtins and args.modules:
        ap.error("--builtins lists looplab's own variants only; drop it to list what --import registers")
    if not args.builtins:
        import_variant_modules(*args.modules)
    print(capability_table(builtins_only=args.builtins))
    return 0


if __name__ == "__main__":
    from looplab.cli_errors import run_cli

    sys.exit(run_cli(main, "python -m looplab.models"))
