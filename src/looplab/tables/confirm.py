"""The pre-registered confirmatory analyses (docs/tables.md#confirmatory-runs): `python -m looplab.tables confirm c2|c1|p`.

Each analysis is written down before its runs start and is computed here exactly as registered: its outcome, its
seeds, one look, its rule. Nothing here chooses a threshold, a δ or a seed from the data.

C2 — table 2, pooled: per seed, G = the mean over R ∈ {2, 4, 6} of (StateLoop − Vanilla Looped) test perplexity on
seeds 101–110; the 95% t-interval of the G's, judged by the sign rule with δ = table 2's per-depth δ and smaller
than claimed against the paper's gap carried to this setting (−0.10 / −0.18 / −0.26 at R = 2 / 4 / 6, × 44 / 9.04,
mean −0.88); then, only if the pooled gap is reproduced, each R in the order 6, 4, 2 (fixed-sequence testing, each
at 0.05, stopping at the first that is not reproduced).

C1 — table 1, perplexity, two arms: per seed, StateLoop − Vanilla Looped test perplexity of `stateloop_main_tiny` on
seeds 201–220; the 95% t-interval, the sign rule with table 1's δ and smaller than claimed against the paper's −0.18
carried to this setting (−0.88). A seed is left out as in C2.

Z1 — table 1, zero-shot, two arms, on C1's runs: each C1 run scored on the offline `looplab_tiny` suite right after it
trains (zeroshot.json with each item's 0/1 outcome); per seed and item, StateLoop − Vanilla Looped; the paired seed ×
item interval (looplab.stats.paired_item_interval, 95%, the zero-shot average's weights: each task equally), judged
by the sign rule with table 1's zero-shot δ and smaller than claimed against the paper's +0.97 pp (an accuracy: no
scaling). A seed without both arms' per-item outcomes is reported and left out.

Z2 — table 1, zero-shot, the two mixer lines (StateLoop+attn − Vanilla Looped, StateLoop+Mamba-2 − Vanilla Looped):
new runs of the arms `stateloop_attn` and `stateloop_mamba2` on C1's seeds 201–220 in C1's folder, each scored like
Z1 and paired with the same seed's C1 Vanilla Looped run (same seed: same batches, same initial values of the shared
parameters). Each line at α = 0.025 (Bonferroni over the two), with two looks, at seeds 201–210 and at 201–220:
Pocock's repeated intervals, nominal α′ = Z2_NOMINAL per look (the level at which looks at 10 and 20 seeds together
miss with probability 0.025, simulated on the sequential designs' null paths), the seed part's critical t_{1−α′/2, n−1}
and the item part's z_{1−α′/2}. A line decided at the first look (any verdict but inconclusive) is final there; the
second look judges only the lines left open, and is final.

R2 — table 2's R = 2 line on fresh seeds: per seed, StateLoop − Vanilla Looped test perplexity of `stateloop_depth_tiny`
at R = 2 (600 steps) on seeds 401–420; the 95% t-interval, the sign rule with table 2's δ and smaller than claimed
against the paper's gap at R = 2 carried to this setting (−0.49). A seed is left out as in C2.

T8L — table 8's llama accuracy line on fresh seeds: the llama fixed-loop and stage-2 runs of T8's setting (every arm
1,600 steps) on seeds 311–322; the line as `report 8` computes it (stage 2 at q = 0.5 − fixed loops, the t-interval
widened by the test examples' noise, table 8's preconditions on the fixed body), judged by the sign rule with its δ and
smaller than claimed against the paper's +0.0108.

P — longer-training pilot: the paired R = 6 differences (StateLoop − Vanilla Looped) of seeds 101–105 at 1,200 steps
against the same seeds' at 600 steps (C2's runs). A table moves to 1,200 steps only if |mean| / SD at 1,200 exceeds
|mean| / SD at 600 by more than √2 (1.41×).

`python -m looplab.tables confirm NAME --apply` then writes a design's final verdicts into the committed table lines they
decide (`apply`): tableN.findings.json keeps the line as built with a `confirmatory` entry beside it, tableN.md's line
gets the confirmatory verdict appended, and the verdict summary counts the confirmatory verdict (the build's stays
shown). Only a complete look applies: every run of the design's seeds on disk (a failed one counts: its seed is left
out), and for Z2 only the lines its looks made final. C2's pooled gap and P's decision are not table lines.

The runs are the ones `experiments/confirm/lane.sh` trains: one folder per run, r_<arm>[_R<R>]_s<seed>, below
OUT_ROOT/table2/tiny/stateloop_depth_tiny (C2), OUT_ROOT/table1/tiny/stateloop_main_tiny (C1) and
OUT_ROOT/pilot/stateloop_depth_tiny_1200 (P), OUT_ROOT/r2/stateloop_depth_tiny (R2); T8L's are `tables run 8`'s folders
below OUT_ROOT/t8l. R2 and T8L read nothing before their look is complete.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from looplab.stats import (
    LEVEL, SEQUENTIAL_SEED, SEQUENTIAL_SIMULATIONS, Rule, _critical, _min_p_at_looks, decisive_p, judge,
    paired_item_interval, t_interval, t_quantile,
)
from looplab.tables.claims import FINDINGS

C2_SEEDS = tuple(range(101, 111))
C2_DEPTHS = (2, 4, 6)
C2_ORDER = (6, 4, 2)  # the secondary tests' fixed order
C2_EXPERIMENT = "stateloop_depth_tiny"
C1_SEEDS = tuple(range(201, 221))
C1_EXPERIMENT = "stateloop_main_tiny"
Z2_ARMS = ("stateloop_attn", "stateloop_mamba2")  # table 1's findings 3 and 4, each against "looped"
Z2_LOOKS = ((201, 211), (201, 221))  # seed ranges of the two looks
Z2_ALPHA = 0.025  # per line: Bonferroni over the two lines
Z2_NOMINAL = 0.013847  # Pocock α′ for looks at n = 10 and 20 at α = 0.025 (z2_nominal(), fixed at registration)
R2_SEEDS = tuple(range(401, 421))
R2_R = 2
T8L_SEEDS = tuple(range(311, 323))
T8L_STRATUM = "experiment = exit_gate_llama_mixed"
T8L_FOLDERS = ("exit_gate_llama_mixed_tiny", "exit_gate_llama_mixed_tiny_stage2")  # fixed loops, stage 2
P_SEEDS = tuple(range(101, 106))
P_R = 6
P_FACTOR = 2 ** 0.5  # doubling the steps costs what doubling the seeds does, which raises the t-statistic by √2


def c2_folder(out_root: Path) -> Path:
    return Path(out_root) / "table2" / "tiny" / C2_EXPERIMENT


def c1_folder(out_root: Path) -> Path:
    return Path(out_root) / "table1" / "tiny" / C1_EXPERIMENT


def p_folder(out_root: Path) -> Path:
    return Path(out_root) / "pilot" / f"{C2_EXPERIMENT}_1200"


def r2_folder(out_root: Path) -> Path:
    return Path(out_root) / "r2" / C2_EXPERIMENT


def t8l_root(out_root: Path) -> Path:
    """The out-root of T8L's `tables run 8` folders (table8/tiny/<sweep>/seed<S>)."""
    return Path(out_root) / "t8l"


def _c2_finding():
    return FINDINGS[2][0]  # StateLoop − Vanilla Looped per R: its δ and its claimed effect per R


def c2_rule_pooled() -> Rule:
    fd = _c2_finding()
    claimed = statistics.fmean(fd.claimed(f"R = {R}") for R in C2_DEPTHS)
    return Rule("sign", fd.sign, delta=fd.delta, claimed=round(claimed, 4))


def c2_rule_at(R: int) -> Rule:
    fd = _c2_finding()
    return Rule("sign", fd.sign, delta=fd.delta, claimed=fd.claimed(f"R = {R}"))


def _judge(values: list[float], rule: Rule) -> dict[str, Any]:
    n = len(values)
    if n < 2:
        return {"n": n, "mean": statistics.fmean(values) if values else None, "lo": None, "hi": None,
                "verdict": "inconclusive", "p": None}
    lo, hi = t_interval(values)
    mean, half = statistics.fmean(values), (hi - lo) / 2
    return {"n": n, "mean": mean, "sd": statistics.stdev(values), "lo": lo, "hi": hi, "verdict": judge(rule, lo, hi),
            "p": decisive_p(rule, mean, half, n - 1), "t": t_quantile(n - 1), "claimed": rule.claimed, "delta": rule.delta}


def _paired(ppl: dict[tuple, float], learned: dict[tuple, bool], seeds, strata) -> tuple[dict, dict]:
    """seed -> {stratum: StateLoop − Vanilla Looped} for the seeds with every run of every stratum, each arm below its
    unigram perplexity; the others -> why they are left out (reported, not replaced)."""
    diffs, left_out = {}, {}
    for s in seeds:
        keys = [(s, R, arm) for R in strata for arm in ("stateloop", "looped")]
        missing = [k for k in keys if k not in ppl]
        unlearned = [k for k in keys if learned.get(k) is False]
        if missing or unlearned:
            what = lambda ks: ", ".join(" ".join(x for x in (f"R {R}" if R else "", arm) if x) for _, R, arm in ks)
            left_out[s] = f"missing {what(missing)}" if missing else f"above its unigram perplexity: {what(unlearned)}"
            continue
        diffs[s] = {R: ppl[(s, R, "stateloop")] - ppl[(s, R, "looped")] for R in strata}
    return diffs, left_out


def c2_from_values(ppl: dict[tuple[int, int, str], float], learned: dict[tuple[int, int, str], bool] | None = None,
                   seeds=C2_SEEDS) -> dict[str, Any]:
    """The C2 analysis on per-run perplexities keyed (seed, R, arm) with arm 'stateloop' | 'looped'. A seed missing a
    run, or with an arm above its unigram perplexity (learned False), is reported and left out, not replaced."""
    diffs, left_out = _paired(ppl, learned or {}, seeds, C2_DEPTHS)
    used = list(diffs)
    per_R = {R: [diffs[s][R] for s in used] for R in C2_DEPTHS}
    pooled = [statistics.fmean(diffs[s].values()) for s in used]
    primary = {**_judge(pooled, c2_rule_pooled()), "values": pooled}
    secondary = []
    go_on = primary["verdict"] == "reproduced"
    for R in C2_ORDER:
        if not go_on:
            secondary.append({"R": R, "verdict": "not tested", "why": "the fixed sequence stopped before it"})
            continue
        res = {"R": R, **_judge(per_R[R], c2_rule_at(R)), "values": per_R[R]}
        secondary.append(res)
        go_on = res["verdict"] == "reproduced"
    return {"name": "c2", "seeds_used": used, "left_out": left_out, "primary": primary, "secondary": secondary,
            "per_R": {R: _judge(per_R[R], c2_rule_at(R)) for R in C2_DEPTHS}}


def c1_rule() -> Rule:
    fd = FINDINGS[1][0]  # StateLoop − Vanilla Looped perplexity: its δ and its claimed effect
    assert fd.metric == "perplexity", fd.label
    return Rule("sign", fd.sign, delta=fd.delta, claimed=fd.claimed(None))


def c1_from_values(ppl: dict[tuple[int, int, str], float], learned: dict[tuple[int, int, str], bool] | None = None,
                   seeds=C1_SEEDS) -> dict[str, Any]:
    """The C1 analysis on per-run perplexities keyed (seed, 0, arm) (table 1 has one depth, R = 3)."""
    diffs, left_out = _paired(ppl, learned or {}, seeds, (0,))
    values = [d[0] for d in diffs.values()]
    return {"name": "c1", "seeds_used": list(diffs), "left_out": left_out,
            "primary": {**_judge(values, c1_rule()), "values": values}}


def r2_rule() -> Rule:
    return c2_rule_at(R2_R)  # table 2's line at R = 2: its δ and the paper's gap at R = 2 in this setting's units


def r2_from_values(ppl: dict[tuple[int, int, str], float], learned: dict[tuple[int, int, str], bool] | None = None,
                   seeds=R2_SEEDS) -> dict[str, Any]:
    """The R2 analysis on per-run perplexities keyed (seed, 2, arm); a seed is left out as in C2."""
    diffs, left_out = _paired(ppl, learned or {}, seeds, (R2_R,))
    values = [d[R2_R] for d in diffs.values()]
    return {"name": "r2", "seeds_used": list(diffs), "left_out": left_out,
            "primary": {**_judge(values, r2_rule()), "values": values}}


def t8l_rule() -> Rule:
    fd = FINDINGS[8][0]  # stage 2 at q = 0.5 − fixed loops, accuracy: its δ and the paper's +1.08 points
    assert fd.metric == "accuracy" and fd.per == ("experiment",), fd.label
    return Rule("sign", fd.sign, delta=fd.delta, claimed=fd.claimed(T8L_STRATUM))


def t8l_from_verdicts(verdicts, seeds=T8L_SEEDS) -> dict[str, Any]:
    """The T8L analysis from a table-8 build's verdicts (report.build(8, ...) on T8L's runs): the llama accuracy line's
    interval as the table computes it (t over the paired seeds ⊕ the test examples' noise) and its preconditions, judged
    by t8l_rule (the sign rule with δ, smaller than claimed). Its seeds' runs only: another seed is an error."""
    fd = FINDINGS[8][0]
    lines = [v for v in verdicts if (v.finding.label, v.finding.metric) == (fd.label, fd.metric) and v.stratum == T8L_STRATUM]
    if len(lines) != 1:
        raise ValueError(f"T8L: {len(lines)} llama accuracy lines in the build (one expected)")
    v = lines[0]
    extra = sorted(set(v.reps) - {str(s) for s in seeds})
    if extra:
        raise ValueError(f"T8L: runs of seeds {extra}, which are not its seeds {seeds[0]}–{seeds[-1]}")
    rule = t8l_rule()
    res: dict[str, Any] = {"n": len(v.diffs), "values": list(v.diffs), "claimed": rule.claimed, "delta": rule.delta,
                           "lo": v.lo, "hi": v.hi, "mean": v.mean, "h_examples": v.h_ex, "not_tested": v.not_tested}
    if v.not_tested:
        res["verdict"] = "not tested"
    elif v.lo is None or len(v.diffs) < 2:
        res["verdict"] = "inconclusive"
    else:
        res.update(verdict=judge(rule, v.lo, v.hi), sd=statistics.stdev(v.diffs),
                   p=decisive_p(rule, v.mean, (v.hi - v.lo) / 2, len(v.diffs) - 1))
    used = [int(r) for r in v.reps]
    return {"name": "t8l", "seeds_used": used, "left_out": {s: "a run missing or failed" for s in seeds if s not in used},
            "primary": res}


def z1_rule() -> Rule:
    fd = FINDINGS[1][1]  # StateLoop − Vanilla Looped zero-shot: its δ and its claimed effect
    assert fd.metric == "zero-shot" and fd.label == "StateLoop − Vanilla Looped", fd.label
    return Rule("sign", fd.sign, delta=fd.delta, claimed=fd.claimed(None))


def _paired_items(items: dict, a_arm: str, b_arm: str, seeds) -> tuple[list, list, dict, dict | None]:
    """(per-seed item differences a − b, seeds used, seeds left out with why, {task: document ids}) from per-item
    outcomes keyed (seed, arm). A seed without both arms' outcomes, or whose arms scored other items, is left out."""
    d, used, left_out, ref = [], [], {}, None
    for s in seeds:
        a, b = items.get((s, a_arm)), items.get((s, b_arm))
        if a is None or b is None:
            left_out[s] = "no per-item outcomes for " + " and ".join(
                arm for arm, x in ((a_arm, a), (b_arm, b)) if x is None)
            continue
        ids = {t: x[0] for t, x in a.items()}
        if ids != {t: x[0] for t, x in b.items()} or (ref is not None and ids != ref):
            left_out[s] = "its runs scored different items"
            continue
        ref = ids
        d.append([x - y for t in sorted(a) for x, y in zip(a[t][1], b[t][1])])
        used.append(s)
    return d, used, left_out, ref


def _item_judgement(d, ref, rule: Rule, n: int, *, critical: float | None = None, level: float = LEVEL) -> dict:
    res: dict[str, Any] = {"n": n, "verdict": "inconclusive", "lo": None, "hi": None, "claimed": rule.claimed,
                           "delta": rule.delta}
    pi = (paired_item_interval(d, groups=[t for t in sorted(ref) for _ in ref[t]], critical=critical, level=level)
          if ref else None)
    if pi is not None:
        res.update(mean=pi.mean, lo=pi.mean - pi.half, hi=pi.mean + pi.half, h_seeds=pi.h_seeds, h_items=pi.h_items,
                   disagree=pi.disagree, n_items=pi.n_items, verdict=judge(rule, pi.mean - pi.half, pi.mean + pi.half))
    return res


def z1_from_outcomes(items: dict[tuple[int, str], dict[str, tuple[tuple[int, ...], list[int]]] | None],
                     seeds=C1_SEEDS) -> dict[str, Any]:
    """The Z1 analysis on per-item outcomes keyed (seed, arm), arm 'stateloop' | 'looped', each {task: (document ids,
    0/1 outcomes)} as tables.load.zeroshot_outcomes reads zeroshot.json (None: a file without them). A seed without
    both arms' outcomes, or whose arms scored different items, is reported and left out, not replaced."""
    d, used, left_out, ref = _paired_items(items, "stateloop", "looped", seeds)
    return {"name": "z1", "seeds_used": used, "left_out": left_out,
            "primary": _item_judgement(d, ref, z1_rule(), len(used))}


def z2_rule(arm: str) -> Rule:
    fd = FINDINGS[1][2 + Z2_ARMS.index(arm)]  # StateLoop+attn / +Mamba-2 − Vanilla Looped zero-shot
    assert fd.metric == "zero-shot" and dict(fd.a)["arm"] == arm and dict(fd.b)["arm"] == "looped", fd.label
    return Rule("sign", fd.sign, delta=fd.delta, claimed=fd.claimed(None))


def z2_nominal(simulations: int = SEQUENTIAL_SIMULATIONS, seed: int = SEQUENTIAL_SEED) -> float:
    """Pocock's α′ of Z2: the per-look level at which the t-intervals at n = 10 and n = 20 paired seeds together miss
    the true mean with probability Z2_ALPHA (the sequential designs' simulated null paths)."""
    import math

    low = sorted(_min_p_at_looks(20, (10, 20), simulations, seed))
    return float(low[math.ceil(Z2_ALPHA * len(low)) - 1])


def z2_from_outcomes(items: dict[tuple[int, str], dict | None], looks: int) -> dict[str, Any]:
    """The Z2 analysis at its first `looks` looks (1 or 2) on per-item outcomes keyed (seed, arm), arms
    'stateloop_attn', 'stateloop_mamba2' and 'looped'. Per line: the first look judges seeds 201–210; a line it leaves
    inconclusive is judged again at the second look on 201–220, and a line decided at the first is final there."""
    lines = []
    for arm in Z2_ARMS:
        rule, history = z2_rule(arm), []
        for k in range(looks):
            d, used, left_out, ref = _paired_items(items, arm, "looped", range(*Z2_LOOKS[k]))
            crit = _critical(len(used) - 1, Z2_NOMINAL) if len(used) >= 2 else None
            res = _item_judgement(d, ref, rule, len(used), critical=crit, level=1 - Z2_NOMINAL)
            history.append({"look": k + 1, "seeds_used": used, "left_out": left_out, **res})
            if res["verdict"] != "inconclusive":
                break
        lines.append({"arm": arm, "looks": history, "final": history[-1]["verdict"] != "inconclusive" or looks == 2,
                      **{k: v for k, v in history[-1].items() if k not in ("look", "seeds_used", "left_out")},
                      "decided_at": history[-1]["look"]})
    return {"name": "z2", "lines": lines, "nominal": Z2_NOMINAL, "alpha_per_line": Z2_ALPHA}


def _signal(values: list[float]) -> float | None:
    """|mean| / SD of paired differences (None below two values or at SD 0)."""
    if len(values) < 2 or statistics.stdev(values) == 0:
        return None
    return abs(statistics.fmean(values)) / statistics.stdev(values)


def p_from_values(ppl_1200: dict[tuple[int, int, str], float], ppl_600: dict[tuple[int, int, str], float],
                  learned_1200: dict | None = None, learned_600: dict | None = None, seeds=P_SEEDS) -> dict[str, Any]:
    """The pilot's rule on R = 6 perplexities keyed (seed, 6, arm) at 1,200 and at 600 steps. Only seeds with both
    pairs (each arm below its unigram perplexity) count, so the two ratios come from the same seeds."""
    long, left_long = _paired(ppl_1200, learned_1200 or {}, seeds, (P_R,))
    short, left_short = _paired(ppl_600, learned_600 or {}, seeds, (P_R,))
    both = [s for s in seeds if s in long and s in short]
    left_out = {s: "; ".join(f"{steps} steps: {left[s]}" for steps, left in (("1,200", left_long), ("600", left_short))
                             if s in left) for s in seeds if s not in both}
    at_1200, at_600 = [long[s][P_R] for s in both], [short[s][P_R] for s in both]
    r_long, r_short = _signal(at_1200), _signal(at_600)
    if r_long is None or r_short is None:
        decision, factor = "not decided (fewer than two seeds with both pairs, or an SD of 0)", None
    else:
        factor = r_long / r_short if r_short > 0 else float("inf")
        decision = "move to 1,200 steps" if factor > P_FACTOR else "stay at 600 steps"
    return {"name": "p", "seeds_used": both, "left_out": left_out, "values_1200": at_1200, "values_600": at_600,
            "signal_1200": r_long, "signal_600": r_short, "factor": factor, "threshold": P_FACTOR, "decision": decision}


def _arm(model: dict) -> str | None:
    """A confirmatory run's arm from its model summary: its state mode ('stateloop', 'stateloop_attn', ...), the
    plain looped model 'looped'; None for a mixer given apart from the state mode (no confirmatory arm has one)."""
    if model.get("state_mixer") not in (None, "none"):
        return None
    return {"vanilla": "looped"}.get(model.get("state_mode"), model.get("state_mode"))


def _read(folder: Path, *, depth_from_model: bool = True) -> tuple[dict, dict, dict]:
    """(perplexity, learned, ‖W_o s‖ / ‖h‖ per loop) per run under `folder`, keyed (seed, R or 0, arm)."""
    from looplab.runs import load_runs
    from looplab.tables.load import finite_value

    ppl, learned, diag = {}, {}, {}
    for r in load_runs(folder):
        if not r.ok:
            continue
        d = r.data
        model = d.get("model") or {}
        arm = _arm(model)
        if arm not in ("stateloop", "looped"):
            continue  # C2, C1 and P compare these two arms only
        key = (int(d["seed"]), int(model["loops"]) if depth_from_model else 0, arm)
        p, uni = finite_value(lambda x: x["perplexity"], d), finite_value(lambda x: x["unigram_perplexity"], d)
        if p is None:
            continue
        ppl[key] = p
        learned[key] = None if uni is None else p < uni
        ratio = (d.get("state_diagnostics") or {}).get("state_to_stream")
        if ratio:
            diag.setdefault((key[1], arm), []).append(ratio)
    return ppl, learned, diag


def _diag_lines(diag: dict) -> tuple[dict, list[str]]:
    per = {(f"R {R} {arm}" if R else arm): [statistics.fmean(x) for x in zip(*v)] for (R, arm), v in sorted(diag.items())}
    return per, [f"  ‖W_o s‖ / ‖h‖ per loop, {k}: " + " ".join(f"{x:.3f}" for x in v) for k, v in per.items()]


def _found_line(name: str, runs: int, folder: Path, result: dict[str, Any]) -> str:
    return (f"{name} (docs/tables.md#confirmatory-runs): {runs} runs found under {folder}; seeds used "
            f"{result['seeds_used']}" + (f"; left out {result['left_out']}" if result["left_out"] else ""))


def _perplexity_design(name: str, folder: Path, analyse, what: str, *, depth_from_model: bool = True) -> dict[str, Any]:
    """A one-line perplexity design (C1, R2) on the runs under `folder`: `analyse(ppl, learned)`, the runs found, the
    StateLoop diagnostic per arm and the printed text."""
    ppl, learned, diag = _read(folder, depth_from_model=depth_from_model)
    result = analyse(ppl, learned)
    result["runs_found"] = len(ppl)
    result["state_to_stream"], diag_text = _diag_lines(diag)
    result["text"] = "\n".join([_found_line(name, len(ppl), folder, result), f"{what}: {_fmt(result['primary'])}",
                                *diag_text])
    return result


def confirm_c1(out_root: Path = Path("outputs/confirm")) -> dict[str, Any]:
    """C1 on the runs of `experiments/confirm/lane.sh c1 ...` below OUT_ROOT."""
    return _perplexity_design("C1", c1_folder(out_root), c1_from_values, "StateLoop − Vanilla Looped perplexity",
                              depth_from_model=False)


def _item_outcomes(folder: Path, arms) -> dict[tuple[int, str], dict | None]:
    """Per-item zero-shot outcomes keyed (seed, arm) of the ok runs of `arms` under `folder`
    (tables.load.zeroshot_outcomes: None for a run without them)."""
    from looplab.runs import load_runs
    from looplab.tables.load import zeroshot_outcomes

    return {(int(r.data["seed"]), arm): zeroshot_outcomes(r.zeroshot())
            for r in load_runs(folder) if r.ok and (arm := _arm(r.data.get("model") or {})) in arms}


def _item_text(r: dict[str, Any]) -> str:
    """A paired seed × item judgement: mean and interval, its two parts, how often the arms differ, the rule's claim."""
    body = (f"{r['mean']:+.4f} [{r['lo']:+.4f}, {r['hi']:+.4f}], n {r['n']} seeds × {r['n_items']} items (seed part "
            f"±{r['h_seeds']:.4f}, item part ±{r['h_items']:.4f}; the arms differ on {100 * r['disagree']:.1f}% of cells)"
            if r["lo"] is not None else f"n {r['n']}")
    return f"{body}; claimed {r['claimed']:+.4f}, δ {r['delta']:.4f}"


def confirm_z1(out_root: Path = Path("outputs/confirm")) -> dict[str, Any]:
    """Z1 on the zeroshot.json files that `experiments/confirm/lane.sh c1 ...` writes beside C1's runs."""
    folder = c1_folder(out_root)
    items = _item_outcomes(folder, ("stateloop", "looped"))
    result = z1_from_outcomes(items)
    result["runs_found"] = sum(v is not None for v in items.values())
    pr = result["primary"]
    line = f"{pr['verdict']}: {_item_text(pr)}" if pr["lo"] is not None else f"{pr['verdict']} (n {pr['n']})"
    result["text"] = "\n".join([
        f"Z1 (docs/tables.md#confirmatory-runs): {result['runs_found']} runs with per-item outcomes under {folder}; "
        f"seeds used {result['seeds_used']}" + (f"; left out {result['left_out']}" if result["left_out"] else ""),
        f"StateLoop − Vanilla Looped zero-shot (looplab_tiny, paired seed × item interval): {line}"])
    return result


def _waiting(folder: Path, arms, seeds) -> list[str]:
    """The runs r_<arm>_s<seed> of `folder` not in yet: without a results.json (a failed run has one), or finished
    and still without the zeroshot.json that `lane.sh` scores right after it (Z1, Z2: the per-item outcomes; a look
    read while one is being written would leave its seed out for want of time, not of data)."""
    from looplab.runs import load_run

    def waits(run: Path) -> bool:
        r = load_run(run)  # an unreadable results.json is a failed run: in, its seed left out by the analysis
        return r is None or (r.ok and not (run / "zeroshot.json").is_file())

    return [f"r_{arm}_s{s}" for s in seeds for arm in arms if waits(folder / f"r_{arm}_s{s}")]


def _not_due(name: str, waiting: list[str], where: Path, look: str = "one look") -> str:
    """What a design prints before its look is due: the runs it waits for, and that it read none."""
    return (f"{name.upper()} (docs/tables.md#confirmatory-runs): its {look} is not due; it waits for {len(waiting)} "
            f"run(s) under {where}: {', '.join(waiting[:6])}{' …' if len(waiting) > 6 else ''}. Nothing was read.")


def z2_due(out_root: Path = Path("outputs/confirm")) -> tuple[int, list[str]]:
    """(how many of Z2's looks are due, the runs the next look still waits for): a look is due once every run of its
    seeds (both mixer arms and C1's Vanilla Looped) has a results.json, a failed one too (its seed is then left out),
    and every finished one its zeroshot.json."""
    folder, due = c1_folder(out_root), 0
    for first, stop in Z2_LOOKS:
        waiting = _waiting(folder, ("looped", *Z2_ARMS), range(first, stop))
        if waiting:
            return due, waiting
        due += 1
    return due, []


def confirm_z2(out_root: Path = Path("outputs/confirm")) -> dict[str, Any]:
    """Z2 at the looks that are due, on the zeroshot.json files that `lane.sh c1` and `lane.sh z2` write in C1's
    folder. Before its first look is due it judges nothing and says which runs it waits for."""
    folder = c1_folder(out_root)
    looks, waiting = z2_due(out_root)
    if not looks:
        return {"name": "z2", "looks": 0, "waiting": waiting, "text": _not_due("z2", waiting, folder, "first look")}
    result = z2_from_outcomes(_item_outcomes(folder, ("looped", *Z2_ARMS)), looks)
    result.update(looks_due=looks, waiting=waiting)
    text = [f"Z2 (docs/tables.md#confirmatory-runs): look(s) due {looks} of 2; per line α {Z2_ALPHA}, nominal α′ "
            f"{Z2_NOMINAL} per look; runs under {folder}"]
    for ln in result["lines"]:
        for h in ln["looks"]:
            text.append(f"{ln['arm']} − looped zero-shot, look {h['look']} (seeds {h['seeds_used']}"
                        + (f"; left out {h['left_out']}" if h["left_out"] else "") + f"): {h['verdict']}: {_item_text(h)}")
        text.append(f"  → {ln['arm']}: {ln['verdict']}" + (" (final)" if ln["final"] else
                                                             " (open: the second look judges it)"))
    if looks == 1 and waiting:
        text.append(f"the second look waits for {len(waiting)} run(s)")
    result["text"] = "\n".join(text)
    return result


def confirm_p(out_root: Path = Path("outputs/confirm")) -> dict[str, Any]:
    """P on the runs of `experiments/confirm/lane.sh p ...` (1,200 steps) and C2's R = 6 runs (600 steps)."""
    long, learned, diag = _read(p_folder(out_root))
    short, learned_short, _ = _read(c2_folder(out_root))
    result = p_from_values(long, short, learned, learned_short)
    result["runs_found"] = len(long)
    result["state_to_stream"], diag_text = _diag_lines(diag)
    fmt = lambda x: "–" if x is None else f"{x:.3f}"
    result["text"] = "\n".join([
        f"P (docs/tables.md#confirmatory-runs): {len(long)} runs at 1,200 steps under {p_folder(out_root)}; seeds "
        f"used {result['seeds_used']}" + (f"; left out {result['left_out']}" if result["left_out"] else ""),
        f"|mean| / SD of the R = 6 differences: {fmt(result['signal_1200'])} at 1,200 steps, {fmt(result['signal_600'])} "
        f"at 600; factor {fmt(result['factor'])} (threshold {P_FACTOR:.2f}): {result['decision']}", *diag_text])
    return result


def r2_waiting(out_root: Path = Path("outputs/confirm")) -> list[str]:
    """R2's runs without a results.json (a failed run has one: in, its seed left out)."""
    folder = r2_folder(out_root)
    return [f"r_{arm}_R{R2_R}_s{s}" for s in R2_SEEDS for arm in ("looped", "stateloop")
            if not (folder / f"r_{arm}_R{R2_R}_s{s}" / "results.json").is_file()]


def t8l_waiting(out_root: Path = Path("outputs/confirm")) -> list[str]:
    """T8L's runs (llama fixed loops and stage 2 of each seed) without a results.json."""
    root = t8l_root(out_root) / "table8" / "tiny"
    return [f"{f}/seed{s}" for s in T8L_SEEDS for f in T8L_FOLDERS if not (root / f / f"seed{s}" / "results.json").is_file()]


def confirm_r2(out_root: Path = Path("outputs/confirm")) -> dict[str, Any]:
    """R2 on the runs of `experiments/confirm/lane.sh r2 ...`, once all 40 are in (one look; before that nothing is read)."""
    folder = r2_folder(out_root)
    waiting = r2_waiting(out_root)
    if waiting:
        return {"name": "r2", "complete": False, "waiting": waiting, "text": _not_due("r2", waiting, folder)}
    result = _perplexity_design("R2", folder, r2_from_values, f"StateLoop − Vanilla Looped perplexity at R = {R2_R}")
    result["complete"] = True
    return result


def _t8l_fixed_body(units) -> dict[str, float]:
    """The fixed-loop arm's seed means that table 8's preconditions read: its accuracy at R and its best shallower loop."""
    from looplab.tables.findings import comparisons

    fd = FINDINGS[8][0]
    for stratum, _, terms in comparisons(fd, units):
        if stratum == T8L_STRATUM and not isinstance(terms, str):
            fixed = terms[1][1]
            return {m: statistics.fmean(v for u in fixed if (v := u.value(m)) is not None)
                    for m in ("accuracy", "best shallower loop accuracy")}
    return {}


def confirm_t8l(out_root: Path = Path("outputs/confirm")) -> dict[str, Any]:
    """T8L on the runs of `experiments/confirm/lane.sh t8l ...`, once all 24 are in (one look; before that nothing is
    read): table 8 built from them as `report 8` builds it, its llama accuracy line judged by t8l_rule."""
    from looplab.tables import report

    root = t8l_root(out_root)
    waiting = t8l_waiting(out_root)
    if waiting:
        return {"name": "t8l", "complete": False, "waiting": waiting, "text": _not_due("t8l", waiting, root)}
    table = report.build(8, "tiny", root, seeds=list(T8L_SEEDS), sequential=False)
    result = t8l_from_verdicts(table.verdicts)
    result["complete"] = True
    pr = result["primary"]
    body = "" if pr["lo"] is None else (
        f"{pr['mean']:+.4f} [{pr['lo']:+.4f}, {pr['hi']:+.4f}], n {pr['n']}, sd {pr.get('sd', 0):.4f}, examples' part "
        f"±{pr['h_examples']:.4f}; ")
    result["preconditions"] = _t8l_fixed_body(table.units)
    result["text"] = "\n".join([
        f"T8L (docs/tables.md#confirmatory-runs): runs under {root}; seeds used {result['seeds_used']}"
        + (f"; left out {result['left_out']}" if result["left_out"] else ""),
        f"llama, stage 2 at q = 0.5 − fixed loops, accuracy: {pr['verdict']}: {body}claimed {pr['claimed']:+.4f}, "
        f"δ {pr['delta']:.4f}" + (f"; not tested: {pr['not_tested']}" if pr["not_tested"] else ""),
        "  the fixed body (seed means): " + ", ".join(f"{k} {v:.3f}" for k, v in result["preconditions"].items())])
    return result


REGISTERED = {"c1": "2026-12-05", "z1": "2026-12-06 13:45 UTC", "z2": "2026-12-06 16:30 UTC",
              "r2": "2026-12-07 01:08 UTC", "t8l": "2026-12-07 01:08 UTC"}


def applications(result: dict[str, Any], out_root: Path = Path("outputs/confirm")) -> list[dict[str, Any]]:
    """The committed table lines a confirmatory result decides: [{table, label, metric, verdict, measured, design}].
    Raises ValueError when its look is not complete (a run of its seeds not in: `_waiting`)."""
    name = result["name"]
    if name not in REGISTERED:
        raise ValueError(f"confirm {name}: decides no committed table line (C2's pooled gap and P's setting are not "
                         "lines of a table); nothing to apply")
    tag = f"confirmatory {name.upper()} (registered {REGISTERED[name]}, docs/tables.md#confirmatory-runs)"

    def measured(r: dict, seeds: list, digits: int) -> str:
        return (f"{r['mean']:+.{digits}f} [{r['lo']:+.{digits}f}, {r['hi']:+.{digits}f}], {len(seeds)} fresh seeds "
                f"({min(seeds)}–{max(seeds)})" if r.get("lo") is not None and seeds else f"no interval ({len(seeds)} seeds)")

    if name in ("r2", "t8l"):
        waiting = r2_waiting(out_root) if name == "r2" else t8l_waiting(out_root)
        if waiting:
            raise ValueError(f"confirm {name}: its look is not complete ({len(waiting)} run(s) not in, e.g. "
                             f"{', '.join(waiting[:3])}); nothing is applied before it is")
        pr = result["primary"]
        fd, stratum = (FINDINGS[2][0], f"R = {R2_R}") if name == "r2" else (FINDINGS[8][0], T8L_STRATUM)
        text = measured(pr, result["seeds_used"], 3 if name == "r2" else 4)
        if pr.get("not_tested"):
            text += f"; not tested: {pr['not_tested']}"
        return [{"table": 2 if name == "r2" else 8, "label": fd.label, "metric": fd.metric, "stratum": stratum,
                 "verdict": pr["verdict"], "design": tag, "measured": text}]
    folder = c1_folder(out_root)
    if name == "z2":  # the runs of the last look it made (none made: the first look's)
        arms, seeds = ("looped", *Z2_ARMS), range(*Z2_LOOKS[max(result.get("looks_due", 0), 1) - 1])
    else:
        arms, seeds = ("looped", "stateloop"), C1_SEEDS
    waiting = _waiting(folder, arms, seeds)
    if waiting or (name == "z2" and not result.get("looks_due")):
        raise ValueError(f"confirm {name}: its look is not complete ({len(waiting)} run(s) not in, e.g. "
                         f"{', '.join(waiting[:3])}); nothing is applied before it is")

    if name == "c1":
        fd, pr = FINDINGS[1][0], result["primary"]
        return [{"table": 1, "label": fd.label, "metric": fd.metric, "verdict": pr["verdict"], "design": tag,
                 "measured": measured(pr, result["seeds_used"], 3)}]
    if name == "z1":
        fd, pr = FINDINGS[1][1], result["primary"]
        return [{"table": 1, "label": fd.label, "metric": fd.metric, "verdict": pr["verdict"], "design": tag,
                 "measured": measured(pr, result["seeds_used"], 4) + f" × {pr.get('n_items')} items, paired"}]
    out = []
    for ln in result["lines"]:
        if ln["final"]:
            fd = FINDINGS[1][2 + Z2_ARMS.index(ln["arm"])]
            h = ln["looks"][-1]
            out.append({"table": 1, "label": fd.label, "metric": fd.metric, "verdict": ln["verdict"], "design": tag,
                        "measured": measured(h, h["seeds_used"], 4) + f" × {h.get('n_items')} items, paired, look "
                                    f"{h['look']} of 2"})
    return out


def apply(apps: list[dict[str, Any]], table_dir: Path = Path("experiments/tables")) -> list[Path]:
    """Write confirmatory verdicts beside the committed lines they decide (tableN.findings.json, tableN.md) and
    regenerate the verdict summary. Applying the same result again changes nothing."""
    from looplab.tables.render import write_summary
    from looplab.tables.rejudge import confirmatory_note

    written = []
    for n in sorted({a["table"] for a in apps}):
        jpath, mpath = Path(table_dir) / f"table{n}.findings.json", Path(table_dir) / f"table{n}.md"
        d = json.loads(jpath.read_text())
        text = mpath.read_text() if mpath.exists() else None
        for a in (a for a in apps if a["table"] == n):
            lines = [f for f in d["findings"] if f["label"] == a["label"] and f["metric"] == a["metric"]
                     and ("stratum" not in a or f.get("stratum") == a["stratum"])]
            if len(lines) != 1:
                raise ValueError(f"table {n}: {len(lines)} committed lines match {a['label']!r} ({a['metric']})")
            line = lines[0]
            line["confirmatory"] = {k: a[k] for k in ("design", "verdict", "measured")}
            if text is not None:  # the line's bullet, its earlier note of this design (if any) replaced
                note = confirmatory_note(line)
                prefix = note.split(":")[0] + ":"  # " **Confirmatory Z1:"
                text = "\n".join(row.split(prefix)[0] + note if row.startswith("- **") and f"— {line['title']}." in row
                                 else row for row in text.split("\n"))
        jpath.write_text(json.dumps(d, indent=2, default=str) + "\n")
        written.append(jpath)
        if text is not None:
            mpath.write_text(text)
            written.append(mpath)
    written.append(write_summary(Path(table_dir)))
    return written


def _fmt(r: dict[str, Any]) -> str:
    if r.get("lo") is None:
        return f"{r['verdict']} (n {r.get('n', 0)})"
    return (f"{r['verdict']}: {r['mean']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}], n {r['n']}, sd {r['sd']:.3f}; "
            f"claimed {r['claimed']:+.2f}, δ {r['delta']:.2f}")


def confirm_c2(out_root: Path = Path("outputs/confirm")) -> dict[str, Any]:
    """C2 on the runs of `experiments/confirm/lane.sh c2 ...` (or `tables run 2 --seeds 101,...,110 --out-root OUT_ROOT`)."""
    folder = c2_folder(out_root)
    ppl, learned, diag = _read(folder)
    result = c2_from_values(ppl, learned)
    result["runs_found"] = len(ppl)
    # the StateLoop diagnostic ‖W_o s‖ / ‖h‖ per loop, mean over seeds: is the state used at all?
    result["state_to_stream"], diag_text = _diag_lines(diag)
    lines = [_found_line("C2", len(ppl), folder, result),
             f"primary, pooled gap G (StateLoop − Vanilla Looped, mean over R 2/4/6): {_fmt(result['primary'])}"]
    for s in result["secondary"]:
        lines.append(f"secondary R {s['R']}: " + (_fmt(s) if "mean" in s else f"{s['verdict']} ({s['why']})"))
    for R, r in result["per_R"].items():
        lines.append(f"  (descriptive) R {R}: {_fmt(r)}")
    lines += diag_text
    result["text"] = "\n".join(lines)
    return result
