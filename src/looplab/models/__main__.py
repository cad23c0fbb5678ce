"""python -m looplab.models capabilities: what every registered variant supports (docs/extending.md's table)."""

import sys

from looplab.models.registry import capability_table

if __name__ == "__main__":
    if sys.argv[1:] != ["capabilities"]:
        sys.exit("usage: python -m looplab.models capabilities")
    print(capability_table())
