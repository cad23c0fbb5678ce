"""The pre-registered confirmatory analyses (docs/tables.md#confirmatory-runs): `python -m looplab.tables confirm c2`.

Each analysis is written down before its runs start and is computed here exactly as registered: its outcome, its
seeds, one look, its rule. Nothing here chooses a threshold, a δ or a seed from the data.

C2 — table 2, pooled: per seed, G = the mean over R ∈ {2, 4, 6} of (StateLoop − Vanilla Looped) test perplexity on
seeds 101–110; the 95% t-interval of the G's, judged by the sign rule with δ = table 2's per-depth δ and smaller
than claimed against the paper's gap carried to this setting (−0.10 / −0.18 / −0.26 at R = 2 / 4 / 6, × 44 / 9.04,
mean −0.88); then, only if the pooled gap is reproduced, each R in the order 6, 4, 2 (fixed-sequence testing, each
at 0.05, stopping at the first that is not reproduced).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from looplab.stats import Rule, decisive_p, judge, t_interval, t_quantile
from looplab.tables.claims import FINDINGS

C2_SEEDS = tuple(range(101, 111))
C2_DEPTHS = (2, 4, 6)
C2_ORDER = (6, 4, 2)  # the secondary tests' fixed order
C2_EXPERIMENT = "stateloop_depth_tiny"


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


def c2_from_values(ppl: dict[tuple[int, int, str], float], learned: dict[tuple[int, int, str], bool] | None = None,
                   seeds=C2_SEEDS) -> dict[str, Any]:
    """The C2 analysis on per-run perplexities keyed (seed, R, arm) with arm 'stateloop' | 'looped'. A seed missing a
    run, or with an arm above its unigram perplexity (learned False), is reported and left out, not replaced."""
    learned = learned or {}
    used, left_out, per_R = [], {}, {R: [] for R in C2_DEPTHS}
    pooled = []
    for s in seeds:
        keys = [(s, R, arm) for R in C2_DEPTHS for arm in ("stateloop", "looped")]
        missing = [k for k in keys if k not in ppl]
        unlearned = [k for k in keys if learned.get(k) is False]
        if missing or unlearned:
            left_out[s] = ("missing " + ", ".join(f"R {R} {arm}" for _, R, arm in missing) if missing else
                           "above its unigram perplexity: " + ", ".join(f"R {R} {arm}" for _, R, arm in unlearned))
            continue
        diffs = {R: ppl[(s, R, "stateloop")] - ppl[(s, R, "looped")] for R in C2_DEPTHS}
        for R in C2_DEPTHS:
            per_R[R].append(diffs[R])
        pooled.append(statistics.fmean(diffs.values()))
        used.append(s)
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


def _fmt(r: dict[str, Any]) -> str:
    if r.get("lo") is None:
        return f"{r['verdict']} (n {r.get('n', 0)})"
    return (f"{r['verdict']}: {r['mean']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}], n {r['n']}, sd {r['sd']:.3f}; "
            f"claimed {r['claimed']:+.2f}, δ {r['delta']:.2f}")


def confirm_c2(out_root: Path = Path("outputs/confirm")) -> dict[str, Any]:
    """C2 on the runs of `python -m looplab.tables run 2 --seeds 101,...,110 --out-root OUT_ROOT`."""
    from looplab.runs import load_runs
    from looplab.tables.load import finite_value

    folder = Path(out_root) / "table2" / "tiny" / C2_EXPERIMENT
    ppl, learned, diag = {}, {}, {}
    for r in load_runs(folder):
        if not r.ok:
            continue
        d = r.data
        arm = "stateloop" if (d.get("model") or {}).get("state_mode") == "stateloop" else "looped"
        key = (int(d["seed"]), int(d["model"]["loops"]), arm)
        p, uni = finite_value(lambda x: x["perplexity"], d), finite_value(lambda x: x["unigram_perplexity"], d)
        if p is None:
            continue
        ppl[key] = p
        learned[key] = None if uni is None else p < uni
        ratio = (d.get("state_diagnostics") or {}).get("state_to_stream")
        if ratio:
            diag.setdefault((key[1], arm), []).append(ratio)
    result = c2_from_values(ppl, learned)
    result["runs_found"] = len(ppl)
    # the StateLoop diagnostic ‖W_o s‖ / ‖h‖ per loop, mean over seeds: is the state used at all?
    result["state_to_stream"] = {f"R {R} {arm}": [statistics.fmean(x) for x in zip(*v)] for (R, arm), v in sorted(diag.items())}
    lines = [f"C2 (docs/tables.md#confirmatory-runs): {len(ppl)} runs found under {folder}; seeds used "
             f"{result['seeds_used']}" + (f"; left out {result['left_out']}" if result["left_out"] else ""),
             f"primary, pooled gap G (StateLoop − Vanilla Looped, mean over R 2/4/6): {_fmt(result['primary'])}"]
    for s in result["secondary"]:
        lines.append(f"secondary R {s['R']}: " + (_fmt(s) if "mean" in s else f"{s['verdict']} ({s['why']})"))
    for R, r in result["per_R"].items():
        lines.append(f"  (descriptive) R {R}: {_fmt(r)}")
    for k, v in result["state_to_stream"].items():
        lines.append(f"  ‖W_o s‖ / ‖h‖ per loop, {k}: " + " ".join(f"{x:.3f}" for x in v))
    result["text"] = "\n".join(lines)
    return result
