"""A paper table's shape (`TableSpec`) and the per-table constants the runner, the builders and the tests share
(bench JSON paths, step counts, windows, targets). The tables themselves — sweeps, notes, findings — are yaml files,
tables/specs/tableN.yaml, read by tables/paper_specs.py into `tables.spec.TABLES`; a number written here and in a
spec (a step count, a window) is checked to agree by tests/test_paper_specs.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from looplab.tables.sweeps import SCALES, Sweep


DEFAULT_DECODE_JSON = Path("bench/decode.json")  # table 4's decoding benchmark (bench/decode.py), run by the runner, read by the report
DEFAULT_EXITS_JSON = Path("bench/exits.json")  # table 10's exit grid (bench/exit_grid.py), run by the runner, read by the report
SKIP_TRAIN_PROB = 0.5  # table 10's exit-aware arm: the share of tokens trained at a sampled exit
DEFAULT_SPECULATION_JSON = Path("bench/speculation.json")  # table 11's measurements (bench/speculative.py)
# table 11's retrofitted model: `python -m looplab.tables.retrofit` writes it under the output root
RETROFIT_FOLDER = "{out_root}/table11/tiny/retrofit/looped"


@dataclass(frozen=True)
class TableSpec:
    number: int
    title: str
    kind: str  # its builder (builders.BUILDERS) and figure (plots.PLOTS): lm | depth | reset | decode | task | exit | ...
    sweeps: dict[str, tuple[Sweep, ...]]  # scale -> sweeps (empty for table 4)
    metric: str  # 'perplexity' or 'accuracy'
    notes: dict[str, str] = field(default_factory=dict)  # scale -> what differs from the paper
    findings: tuple = ()  # tables.claims.Finding objects: the papers' claims this table checks (experiments/README.md)

    def sweeps_for(self, scale: str) -> tuple[Sweep, ...]:
        if scale not in SCALES:
            raise ValueError(f"scale={scale!r} is unknown; choose one of {SCALES}")
        return self.sweeps[scale]


# Table 8 at tiny scale trains every arm 1,600 steps, twice the experiment files' 800 (T8, docs/tables.md#confirmatory-runs).
# At 800 stage 1 (joint gate training) stalls at the shallow loops' accuracy on some seeds (llama seeds 2 / 3: 0.508 /
# 0.417 at loop 4 on p = 3; at 1,600 1.000 / 1.000), and on mixed hop counts the fixed 1⊗4 body misses the 0.9
# precondition (0.74–0.79 at loop 4; at 1,600 llama's and StateLoop's reach 0.997 / 0.998, Mamba-2's 0.832).
TABLE8_STEPS_TINY = 1600
# Table 8 at tiny scale runs on p-hop with mixed hop counts, p ∈ {1, 2, 3, 4} drawn per example (the
# exit_gate_*_mixed_tiny experiments of specs/table8.yaml). On p = 3 alone the fixed 1⊗4 body was at ceiling at
# loop 4 (0.999) and no shallower loop solved anything (0.29 / 0.47 / 0.33), so any early exit could only lose
# accuracy and the stage-2 findings rested on a test that could not come out in the gate's favour. With mixed hop
# counts a shallow loop can solve the few-hop items and the gate has a depth to choose. The p = 3 experiments
# (exit_gate_*_tiny) stay, so that their runs stay readable. The spec lists stage 1 first (the gate trained jointly),
# then the fixed-loop model, then stage 2 warm-started from it: the runner starts per-seed commands in that order,
# the longest first.

# Table 12 (docs/tables.md#table-12): MoR's comparisons are at equal training FLOPs, so the MoR arms train for more steps, up to
# the fixed-depth model's training FLOPs: steps × (1⊗R's FLOPs/token) / (the routed model's at MoR's capacities).
# The counts were set before LoopedLM.flops_per_token counted a routed loop's shorter attention; by that exact
# count the MoR arms get 2.4–3.1% fewer training FLOPs than 1⊗R (tests/test_tables.py), which leans, if anything,
# against MoR. Token choice gets the expert-choice count: balanced, its depths spend the same. The unrolled
# (N·R)⊗1 arm costs what 1⊗R costs.
MOR_STEPS_TINY = {"mor_lm_tiny": 834, "mor_phop_tiny": 1280}
DEFAULT_ROUTING_JSON = Path("bench/routing.json")  # table 12's decoding measurements (bench/routed_decode.py)

# Table 13 (docs/tables.md#table-13): the Parallel Loop Transformer's arms. G-SWA's window is scaled to the task so that it
# binds (a window longer than the sequence is plain shared-KV attention plus full own attention): 16 of lm_tiny's
# 128-token windows, 8 of p-hop's 32 tokens. The sequential arms are each experiment's own sweep.
PLT_WINDOW_TINY = {"plt_lm_tiny": 16, "plt_phop_tiny": 8}
PLT_KV = ("own", "share_first", "gswa")
DEFAULT_PLT_JSON = Path("bench/plt.json")  # table 13's decoding measurements and diagnostics (bench/routed_decode.py)
DEFAULT_SERVING_JSON = Path("bench/serving.json")  # table 14's engine measurements (bench/depth_under_load.py)

# Table 14 (docs/tables.md#table-14): depth under load. Table 11's exit-aware language models and table 12's MoR models
# with their fixed 1⊗R, trained again here (one seed: the table's intervals are over repeated engine runs), longest
# first so that the runner's two processes end together.
SERVING_QUALITY_BOUND = 0.02  # the "perplexity within 2% of its all-loops perplexity"
SERVING_TARGET = 1.5  # output tokens/s of an exit-aware model ÷ plain continuous batching, at concurrency 8 and 32 …
SERVING_TARGET_IDEAL = (1.9, 0.8)  # … or, where the ideal R / mean depth is below 1.9, 80% of that ideal
