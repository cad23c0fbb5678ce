"""The paper tables as data: for each one its sweeps at tiny (CPU) and paper scale, the kind of its rows (`kind`:
builders/), its metric and what its setting changes from the paper, plus the per-table constants the runner and
the builders share (bench JSON paths, step counts, windows, targets). Its findings are in tables/claims.py;
tables/spec.py joins the two into `TABLES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import looplab.tables.retrofit as retrofit  # the module itself: looplab.tables' __init__ imports this one
from looplab.tables.sweeps import SCALES, Sweep, sweep


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


# Table 8 at tiny scale: stage 1 (joint gate training) gets twice the fixed-loop model's 800 steps. At 800 it
# stalls at the shallow loops' accuracy on some seeds (llama seeds 2 / 3: 0.508 / 0.417 at loop 4, the fixed
# model 1.000); at 1,600 those seeds reach 1.000 / 1.000 (StateLoop 0.998 / 0.999; experiments/README.md).
STAGE1_STEPS_TINY = 1600
# Table 8 at tiny scale runs on p-hop with mixed hop counts, p ∈ {1, 2, 3, 4} drawn per example (the
# exit_gate_*_mixed_tiny experiments). On p = 3 alone the fixed 1⊗4 body was at ceiling at loop 4 (0.999) and no
# shallower loop solved anything (0.29 / 0.47 / 0.33), so any early exit could only lose accuracy and the stage-2
# findings rested on a test that could not come out in the gate's favour. With mixed hop counts a shallow loop can
# solve the few-hop items and the gate has a depth to choose. The p = 3 experiments (exit_gate_*_tiny) stay, so that their runs stay readable.
EXIT_GATE_TINY = ["exit_gate_mamba_mixed_tiny", "exit_gate_llama_mixed_tiny", "exit_gate_stateloop_mixed_tiny"]


def _exit_sweeps(experiments: list[str], stage1: tuple[str, ...] = (), per_seed: bool = False) -> tuple[Sweep, ...]:
    """Table 8: stage 1 (the gate trained jointly, `stage1` overrides added), the fixed-loop model, then stage 2
    (gate only) warm-started from the fixed-loop run of the same seed. Stage 1 comes first: with `per_seed` the
    runner starts the commands in this order, the longest first."""
    out = [sweep(e, params={"exit_gate": ["ouro"]}, fixed=list(stage1), name=f"{e}_stage1", per_seed=per_seed)
           for e in experiments]
    out += [sweep(e, params={"exit_gate": ["none"]}, per_seed=per_seed) for e in experiments]
    out += [sweep(e, fixed=["exit_gate.stage=stage2"], name=f"{e}_stage2", init_from=(e, {"exit_gate": "none"}))
            for e in experiments]
    return tuple(out)


# Table 12 (docs/tables.md#table-12): MoR's comparisons are at equal training FLOPs, so the MoR arms train for more steps, up to
# the fixed-depth model's training FLOPs: steps × (1⊗R's FLOPs/token) / (the routed model's at MoR's capacities).
# The counts were set before LoopedLM.flops_per_token counted a routed loop's shorter attention; by that exact
# count the MoR arms get 2.4–3.1% fewer training FLOPs than 1⊗R (tests/test_tables.py), which leans, if anything,
# against MoR. Token choice gets the expert-choice count: balanced, its depths spend the same. The unrolled
# (N·R)⊗1 arm costs what 1⊗R costs.
MOR_STEPS_TINY = {"mor_lm_tiny": 834, "mor_phop_tiny": 1280}
DEFAULT_ROUTING_JSON = Path("bench/routing.json")  # table 12's decoding measurements (bench/routed_decode.py)


def _mor_sweeps(experiment: str, unrolled_layers: int) -> tuple[Sweep, ...]:
    """Table 12's arms of one experiment, one command per seed (the runner runs two at a time, longest first):
    fixed 1⊗R and the exit gate (the experiment's own +arm sweep), the two MoR routers at equal training FLOPs,
    and the unrolled (N·R)⊗1 model."""
    return (sweep(experiment, params={"+arm": ["mor_expert", "mor_token"]}, name=f"{experiment}_mor", per_seed=True,
                  fixed=[f"trainer.max_steps={MOR_STEPS_TINY[experiment]}"]),
            sweep(experiment, per_seed=True),
            sweep(experiment, params={"+arm": ["vanilla"]}, fixed=[f"loop_depth.layers={unrolled_layers}"],
                  name=f"{experiment}_unrolled", per_seed=True))


# Table 13 (docs/tables.md#table-13): the Parallel Loop Transformer's arms. G-SWA's window is scaled to the task so that it
# binds (a window longer than the sequence is plain shared-KV attention plus full own attention): 16 of lm_tiny's
# 128-token windows, 8 of p-hop's 32 tokens. The sequential arms are each experiment's own sweep.
PLT_WINDOW_TINY = {"plt_lm_tiny": 16, "plt_phop_tiny": 8}
PLT_KV = ("own", "share_first", "gswa")
DEFAULT_PLT_JSON = Path("bench/plt.json")  # table 13's decoding measurements and diagnostics (bench/routed_decode.py)
DEFAULT_SERVING_JSON = Path("bench/serving.json")  # table 14's engine measurements (bench/depth_under_load.py)


def _plt_sweeps(experiment: str, loops: int, extra_gswa_loops: tuple[int, ...] = ()) -> tuple[Sweep, ...]:
    """Table 13's arms of one experiment, one command per seed (the runner runs two at a time, longest first):
    parallel 1⊗R with each kv option, the experiment's own sequential sweep, and parallel G-SWA at other depths
    (LoopCoder-v2's loop count)."""
    par = ["loop_depth.schedule=parallel", f"loop_depth.window={PLT_WINDOW_TINY[experiment]}"]
    out = [sweep(experiment, params={"loop_depth": [f"1x{loops}"], "loop_depth.kv": list(PLT_KV)}, fixed=par,
                 name=f"{experiment}_parallel", per_seed=True),
           sweep(experiment, per_seed=True)]
    out += [sweep(experiment, params={"loop_depth": [f"1x{r}" for r in extra_gswa_loops], "loop_depth.kv": ["gswa"]},
                  fixed=par, name=f"{experiment}_parallel_depth", per_seed=True)] if extra_gswa_loops else []
    return tuple(out)


# Table 14 (docs/tables.md#table-14): depth under load. Table 11's exit-aware language models and table 12's MoR models
# with their fixed 1⊗R, trained again here (one seed: the table's intervals are over repeated engine runs), longest
# first so that the runner's two processes end together.
SERVING_QUALITY_BOUND = 0.02  # the "perplexity within 2% of its all-loops perplexity"
SERVING_TARGET = 1.5  # output tokens/s of an exit-aware model ÷ plain continuous batching, at concurrency 8 and 32 …
SERVING_TARGET_IDEAL = (1.9, 0.8)  # … or, where the ideal R / mean depth is below 1.9, 80% of that ideal


def _serving_sweeps() -> tuple[Sweep, ...]:
    exit_aware = [f"exit_gate.skip_train_prob={SKIP_TRAIN_PROB}"]
    return (sweep("speculation_tiny", params={"+arm": ["looped"]}, name="speculation_tiny_hybrid_exit_aware",
                  fixed=["backbone=hybrid_tiny", *exit_aware, "exit_gate.skip_compute=ssm_skip"], per_seed=True),
            sweep("speculation_tiny", params={"+arm": ["looped"]}, name="speculation_tiny_exit_aware",
                  fixed=[*exit_aware, "exit_gate.skip_compute=kv_copy"], per_seed=True),
            sweep("mor_lm_tiny", params={"+arm": ["mor_expert", "mor_token"]}, name="mor_lm_tiny_mor", per_seed=True,
                  fixed=[f"trainer.max_steps={MOR_STEPS_TINY['mor_lm_tiny']}"]),
            sweep("mor_lm_tiny", params={"+arm": ["looped"]}, name="mor_lm_tiny_fixed", per_seed=True))


# Every table without its findings (tables/spec.py adds them from tables/claims.py).
SPECS: dict[int, TableSpec] = {
    1: TableSpec(1, "StateLoop main: Vanilla, Vanilla Looped, StateLoop, +attn, +Mamba-2", "lm",
                 {"tiny": (sweep("stateloop_main_tiny"),), "paper": (sweep("stateloop_main"),)}, "perplexity",
                 notes={"tiny": "1⊗3 llama d128 on the embedded Shakespeare corpus with its 1,024-token BPE, 600 steps (table 2's "
                                "setting; the vanilla 1⊗1 arm checks that looping helps in it); zero-shot: the offline "
                                "`looplab_tiny` suite on the held-out plays (`zeroshot 1 --tasks looplab_tiny`, run by `make table1`)",
                        "paper": "6⊗4 at 410M and 1.4B on the Pile; zero-shot average over the 8-task suite "
                                 "(`python -m looplab.tables zeroshot 1 --scale paper` after training)"}),
    2: TableSpec(2, "Loop depth: Vanilla Looped vs StateLoop per R", "depth",
                 {"tiny": (sweep("stateloop_depth_tiny"),), "paper": (sweep("stateloop_depth"),)}, "perplexity",
                 notes={"tiny": "1⊗R (R = 2, 4, 6) llama d128, embedded corpus with its 1,024-token BPE, 600 steps",
                        "paper": "4⊗R (R = 3..7) at 410M on the Pile"}),
    3: TableSpec(3, "State reset: carry vs reset", "reset",
                 {"tiny": (sweep("stateloop_reset_tiny"),), "paper": (sweep("stateloop_reset"),)}, "perplexity",
                 notes={"tiny": "2⊗3 llama d128, embedded corpus with its 1,024-token BPE, 600 steps (table 2's setting)",
                        "paper": "6⊗4 at 410M on the Pile"}),
    4: TableSpec(4, "Decoding latency per generated token", "decode", {"tiny": (), "paper": ()}, "per_token_ms",
                 notes={"tiny": "bench/decode.json of the decoding benchmark, fp32 on the CPU (`make table4` runs it in quick mode "
                                "with 1 thread; the full run adds context 256 and a 24-layer block)",
                        "paper": "bench/decode.json of the full `python -m looplab.bench.decode` (d 512, 4⊗4 plus a 24-layer block)"}),
    5: TableSpec(5, "Mano: accuracy per N⊗R", "task",
                 {"tiny": (sweep("mano_mamba_tiny"), sweep("mano_hybrid_tiny")),
                  "paper": (sweep("mano_paper"), sweep("mano_mamba"), sweep("mano_hybrid"))}, "accuracy",
                 notes={"tiny": "L = 3, modulus 5, d 64, 1,000 steps (mano_mamba_tiny: 1⊗1, 4⊗1, 1⊗4; mano_hybrid_tiny: 2⊗1, 4⊗1, 2⊗2; "
                                "modulus 23 does not learn in CPU-minutes); the paper's rows are Mamba-2 and hybrid, "
                                "so the Transformer `mano_tiny` is left out of the 60-minute budget; `steps` gives each run's training steps",
                        "paper": "L = 24, modulus 23: 4⊗1, 4⊗6, 24⊗1"}),
    6: TableSpec(6, "p-hop induction: accuracy per N⊗R", "task",
                 {"tiny": (sweep("phop_tiny"), sweep("phop_mamba_tiny")), "paper": (sweep("phop_paper"), sweep("phop_mamba"))},
                 "accuracy",
                 notes={"tiny": "n = 32, p = 3, alphabet 4, d 64 (phop_*_tiny); `steps` gives each run's training steps", "paper": "n = 256, p = 32, alphabet 4"}),
    7: TableSpec(7, "Iso-parameter and iso-FLOP language modelling", "lm",
                 {"tiny": (sweep("lm_mamba_loops_tiny"), sweep("lm_hybrid_loops_tiny")),
                  "paper": tuple(sweep(e) for e in ("lm_mamba_isoparam", "lm_mamba_isoflop", "lm_hybrid_isoparam", "lm_hybrid_isoflop"))},
                 "perplexity",
                 notes={"tiny": "d 128 on the embedded corpus with its 1,024-token BPE, 600 steps; one sweep per backbone holds "
                                "both protocols: Mamba-2 1⊗1, 4⊗1, 1⊗4 and hybrid 2⊗1, 4⊗1, 2⊗2 (iso-parameter pairs "
                                "by N, iso-FLOP by N·R)",
                        "paper": "140M-class width on the Pile; iso-param N=4, R=1,2,4,6; iso-FLOP N·R=24"}),
    8: TableSpec(8, "Exit gate: fixed loops vs stage 1 vs stage 2", "exit",
                 {"tiny": _exit_sweeps(EXIT_GATE_TINY, stage1=(f"trainer.max_steps={STAGE1_STEPS_TINY}",), per_seed=True),
                  "paper": _exit_sweeps(["exit_gate_mamba", "exit_gate_llama", "exit_gate_stateloop"])}, "accuracy",
                 notes={"tiny": f"1⊗4 on p-hop with mixed hop counts (n 32, p ∈ {{1, 2, 3, 4}} drawn per example, so "
                                "answers need different depths); fixed loops 800 steps, stage 1 "
                                f"{STAGE1_STEPS_TINY:,} (at 800 it stalls on some seeds, experiments/README.md); stage 2 "
                                "warm-starts from the fixed-loop run",
                        "paper": "4⊗4 on the Pile (accuracy = next-token accuracy)"}),
    9: TableSpec(9, "Depth extrapolation: accuracy at test-time depth R′ = 1..2R per training recipe", "extrapolation",
                 {"tiny": (sweep("depth_extrapolation_tiny"),), "paper": (sweep("depth_extrapolation"),)}, "accuracy",
                 notes={"tiny": "p-hop (n 32, p 3) llama 1⊗4 d 64, 3,200 steps (4× the other p-hop tables: the randomized arms learn p-hop "
                                "only past 2,000, experiments/README.md); fixed depth, randomized depth "
                                "(poisson_lognormal, mean ≈ R, clamped to 1..2R) and randomized depth with backprop through "
                                "the last 2 loops, each without and with `add` injection; the final model tested at R′ = 1..8",
                        "paper": "llama 4⊗4 at 410M on the Pile, the same recipes, perplexity at R′ = 1..8"}),
    10: TableSpec(10, "Exit rules × state handlings: answer accuracy against measured decoding speed", "exitgrid",
                  {"tiny": (sweep("exit_gate_hybrid_tiny", params={"exit_gate": ["none"]}),
                            # the same body trained exit-aware (ssm_skip at sampled exits, p = 0.5)
                            sweep("exit_gate_hybrid_tiny", params={"exit_gate": ["none"]},
                                  fixed=[f"exit_gate.skip_train_prob={SKIP_TRAIN_PROB}", "exit_gate.skip_compute=ssm_skip"],
                                  name="exit_gate_hybrid_tiny_skiptrain"),
                            sweep("exit_gate_hybrid_tiny", fixed=["exit_gate.stage=stage2"], name="exit_gate_hybrid_tiny_stage2",
                                  init_from=("exit_gate_hybrid_tiny", {"exit_gate": "none"})),
                            sweep("exit_gate_hybrid_tiny", fixed=["exit_gate.stage=stage2"],
                                  name="exit_gate_hybrid_tiny_skiptrain_stage2",
                                  init_from=("exit_gate_hybrid_tiny_skiptrain", {"exit_gate": "none"}))),
                   "paper": ()}, "accuracy",
                  notes={"tiny": "p-hop 1⊗4 llama / StateLoop / Mamba-2 from table 8's stage-2 runs (n 32, mixed p ∈ "
                                 "{1, 2, 3, 4}) and 2⊗4 "
                                 "hybrid (n 32, p 3) trained here (fixed loops, then stage 2; and the same with exit-aware training: "
                                 f"ssm_skip at sampled exits with p = {SKIP_TRAIN_PROB:g}, then stage 2), 3 seeds; the looped Mano (table 5) and "
                                 "language models (table 7: perplexity of 64 test windows) with the zero-shot rules; "
                                 "every exit rule × threshold "
                                 "(bench/exit_grid.py GRID) × state handling; accuracy and exit step over 512 test "
                                 "sequences, ms/token of cached decoding over 2 test sequences, one thread",
                         "paper": "not defined: the grid scores task answers (table 8's paper runs are LM runs); run "
                                  "`python -m looplab.bench.exit_grid` on task checkpoints"}),
    11: TableSpec(11, "Self-speculative decoding: tokens/s and acceptance at identical output", "speculation",
                  {"tiny": (sweep("speculation_tiny"),
                            sweep("speculation_tiny", params={"+arm": ["looped"]}, name="speculation_tiny_exit_aware",
                                  fixed=[f"exit_gate.skip_train_prob={SKIP_TRAIN_PROB}", "exit_gate.skip_compute=kv_copy"]),
                            sweep("speculation_tiny", params={"+arm": ["looped"]}, fixed=["backbone=mamba2_tiny"],
                                  name="speculation_tiny_mamba2"),
                            sweep("speculation_tiny", params={"+arm": ["looped"]}, fixed=["backbone=hybrid_tiny"],
                                  name="speculation_tiny_hybrid"),
                            sweep("speculation_tiny", params={"+arm": ["looped"]}, name="speculation_tiny_hybrid_exit_aware",
                                  fixed=["backbone=hybrid_tiny", f"exit_gate.skip_train_prob={SKIP_TRAIN_PROB}",
                                         "exit_gate.skip_compute=ssm_skip"]),
                            sweep("speculation_tiny", params={"+arm": ["looped"]}, name="speculation_tiny_retrofit",
                                  fixed=[*retrofit.looped_overrides(RETROFIT_FOLDER), f"trainer.max_steps={retrofit.TRAIN_STEPS}",
                                         f"optim.lr={retrofit.TRAIN_LR:g}"])),
                   "paper": ()}, "tokens/s",
                  notes={"tiny": "language models on lm_tiny (table 2's setting, d 128, 600 steps) at 2⊗4: llama Vanilla "
                                 "Looped and StateLoop, llama trained exit-aware (kv_copy at sampled exits, p = "
                                 f"{SKIP_TRAIN_PROB:g}), Mamba-2, hybrid (MA) standard and exit-aware (ssm_skip); and a "
                                 "random d 512 transformers Llama (6 layers) retrofitted by `looplab.convert from-hf "
                                 f"--loops 4 --prelude 1 --coda 1` into 1⊗4 + prelude + coda, trained {retrofit.TRAIN_STEPS} "
                                 f"steps (lr {retrofit.TRAIN_LR:g}); each decodes 64 greedy tokens after 32-token held-out "
                                 "prompts at batch 1 and 8, plain against every k = 1..R−1 × γ = 2..8 (bench/speculative.py)",
                         "paper": "not defined: run `python -m looplab.bench.speculative CKPT --batch 1 8` on paper "
                                  "checkpoints"}),
    12: TableSpec(12, "Routed depth (Mixture-of-Recursions) against the other ways to spend depth", "routing",
                  {"tiny": (*_mor_sweeps("mor_lm_tiny", 3), *_mor_sweeps("mor_phop_tiny", 4)), "paper": ()}, "perplexity",
                  notes={"tiny": "language modelling on lm_tiny (table 2's setting: d 128, 600 steps) with a 1-layer llama block at R = 3 and p-hop "
                                 "(n 32, p 3, d 64, 800 steps) at R = 4; arms: fixed depth 1⊗R, expert-choice and "
                                 "token-choice MoR (MoR's defaults) trained to 1⊗R's training FLOPs "
                                 f"({MOR_STEPS_TINY['mor_lm_tiny']} / {MOR_STEPS_TINY['mor_phop_tiny']} steps), the Ouro "
                                 "gate trained jointly (read at q = 0.5) and the unrolled (N·R)⊗1 model; the same initial "
                                 "values for shared parameters and the same batches in every arm of a seed. Decoding: 64 "
                                 "greedy tokens after a 32-token held-out prompt at batch 1, one thread, every arm of a seed "
                                 "timed round-robin (bench/routed_decode.py)",
                         "paper": "not defined: train the arms with `python -m looplab.train +arm=mor_expert ...` at scale "
                                  "and run `python -m looplab.bench.routed_decode` on the checkpoints"}),

    13: TableSpec(13, "Parallel loops (PLT: cross-loop parallelism, shared KV, G-SWA) against the other ways to spend depth",
                  "plt", {"tiny": (*_plt_sweeps("plt_phop_tiny", 4), *_plt_sweeps("plt_lm_tiny", 2, (4,))), "paper": ()},
                  "perplexity",
                  notes={"tiny": "language modelling on lm_tiny (table 2's setting: d 128, 600 steps) with a 1-layer llama block: "
                                 "1⊗1, sequential 1⊗2 and 1⊗4, the unrolled 2⊗1, parallel 1⊗2 with kv own / share_first / gswa "
                                 f"(window {PLT_WINDOW_TINY['plt_lm_tiny']} of 128) and parallel G-SWA 1⊗4; p-hop (n 32, "
                                 "p 3, d 64, 800 steps; table 8's setting, where R = 2 does not learn the task) at R = 4: "
                                 "1⊗1, sequential 1⊗4 and parallel 1⊗4 with each kv option (window "
                                 f"{PLT_WINDOW_TINY['plt_phop_tiny']} of 32); the same initial values for shared parameters "
                                 "and the same batches in every arm of a seed. Decoding (LM): 64 greedy tokens after a "
                                 "32-token held-out prompt at batch 1 and 8, one thread, every arm of a seed timed "
                                 "round-robin; per-loop diagnostics on held-out windows (bench/routed_decode.py --diagnostics)",
                         "paper": "not defined: train the arms with `python -m looplab.train loop_depth.schedule=parallel "
                                  "loop_depth.kv=gswa ...` at scale and run `python -m looplab.bench.routed_decode` on the "
                                  "checkpoints"}),
    14: TableSpec(14, "Depth under load: exits and routing in the serving engine (continuous and depth-wise batching)",
                  "serving", {"tiny": _serving_sweeps(), "paper": ()}, "tokens/s",
                  notes={"tiny": "table 11's exit-aware language models (lm_tiny, d 128, 600 steps, 2⊗4: llama trained with "
                                 f"kv_copy at sampled exits, hybrid (MA) with ssm_skip, p = {SKIP_TRAIN_PROB:g}) and table "
                                 "12's (1⊗3 llama: expert- and token-choice MoR at the fixed model's training FLOPs, "
                                 f"{MOR_STEPS_TINY['mor_lm_tiny']} steps, and the fixed 1⊗3), trained here; each in "
                                 "`looplab.serve.Engine` at concurrency 1, 8 and 32 (closed loop, 32 requests: prompts = the "
                                 "first 8–24 tokens of held-out windows, 8–32 greedy tokens each, no eos), 5 rounds with every "
                                 "(model, arm) once per round, one thread (bench/depth_under_load.py). Exit-aware models: "
                                 "plain continuous batching (every loop), exits lockstep and exits depth-wise with the "
                                 "zero-shot kl rule and the handling they were trained with, at the largest grid threshold "
                                 f"within {SERVING_QUALITY_BOUND:.0%} of all-loops perplexity on 16 held-out windows "
                                 "(perplexities reported on the 64 after them); MoR models: their router under lockstep "
                                 "and depth-wise batching, against the fixed model's plain continuous batching",
                         "paper": "not defined: run `python -m looplab.bench.depth_under_load` (or `python -m looplab.bench "
                                  "serve CKPT`) on paper checkpoints, on a GPU"}),
}

