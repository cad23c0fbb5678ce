"""Every table kind (spec.TableSpec.kind) → the builder that makes its `Table`.

A builder is `build(spec, scale, out_root, seeds=..., **inputs) -> Table`; the inputs past seeds are the
benchmark JSON a kind reads (table 4: decode_json, 10: exits_json, 11: speculation_json, 12: routing_json, 13: plt_json, 14: serving_json).
Each kind's figure is plots.PLOTS[kind].
"""

from __future__ import annotations

from looplab.tables.builders.measured import build_decode, build_exitgrid, build_serving, build_speculation
from looplab.tables.builders.trained import (build_depth, build_exit, build_extrapolation, build_lm, build_reset,
                                             build_plt, build_routing, build_task)

BUILDERS = {
    "lm": build_lm,  # tables 1, 7
    "depth": build_depth,  # table 2
    "reset": build_reset,  # table 3
    "decode": build_decode,  # table 4
    "task": build_task,  # tables 5, 6
    "exit": build_exit,  # table 8
    "extrapolation": build_extrapolation,  # table 9
    "exitgrid": build_exitgrid,  # table 10
    "speculation": build_speculation,  # table 11
    "routing": build_routing,  # table 12
    "plt": build_plt,  # table 13
    "serving": build_serving,  # table 14
}
