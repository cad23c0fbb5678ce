"""Thresholds and targets that a benchmark and the table built from its JSON must agree on.

Plain constants, no imports: `bench/` measures against them and `tables/` judges with them, and
neither imports the other (docs/tables.md, "Targets").
"""

# Table 8's findings read the exit gate at this threshold; table 12's decoding bench exits its gated
# arm at the same q so that the two tables describe one model.
EXIT_Q = 0.5

# Table 10: skip decoding at least 1.5× faster than running all loops, losing at most one point of
# answer accuracy, on p-hop, on some Mamba-2 or hybrid configuration.
EXIT_SPEEDUP_TARGET = 1.5
EXIT_LOSS_TARGET = 0.01
EXIT_TARGET_TASK = "phop"

# Table 11: self-speculative decoding at least 1.5× plain decoding's tokens/s at identical output.
SPECULATION_SPEEDUP_TARGET = 1.5
