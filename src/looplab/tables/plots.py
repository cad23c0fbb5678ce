"""PNG plots of the tables (matplotlib, Agg backend: no display needed).

- loop depth (table 2): perplexity vs R, one line per arm;
- exit gate (table 8): accuracy vs mean exit depth, fixed loops / stage 1 / stage 2 per backbone;
- task tables (5, 6): accuracy vs R per experiment (bars when N varies);
- LM tables (1, 3, 7): perplexity per configuration (bars);
- one run's test-time depth sweep (loop_depth.eval_loops): its metric against R′, the trained R marked;
- a comparison of one's own arms (tables/compare.py): each line's per-seed differences A − B, mean and interval.

Error bars are the rows' 95% t-intervals over seeds (none with one seed).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from looplab.stats import Stat
from looplab.targets import EXIT_SPEEDUP_TARGET, SPECULATION_SPEEDUP_TARGET

if TYPE_CHECKING:
    from looplab.tables.render import Table


def _pyplot():
    """matplotlib's pyplot on the Agg backend, imported when a figure is drawn, not when the report is."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _split_nr(s: str) -> tuple[int, int] | None:
    try:
        n, r = s.split("⊗")
        return int(n), int(r)
    except (ValueError, AttributeError):
        return None


def _mean_std(table: "Table", row, col):
    v = row.get(col)
    if isinstance(v, Stat):
        return v.mean, v.half or 0.0  # the 95% t-interval's half-width over seeds
    return (v, 0.0) if isinstance(v, (int, float)) else (None, 0.0)


def plot_depth(table: "Table", ax) -> None:
    lines: dict[str, list[tuple[int, float, float]]] = {}
    for row in table.rows:
        nr = _split_nr(row["N⊗R"])
        m, s = _mean_std(table, row, "perplexity")
        if nr and m is not None:
            lines.setdefault(str(row.get("arm") or row["state"]), []).append((nr[1], m, s))
    for name, pts in sorted(lines.items()):
        pts.sort()
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3, label=name)
    ax.set_xlabel("loops R")
    ax.set_ylabel("perplexity (held-out)")
    ax.legend()


def plot_exit(table: "Table", ax) -> None:
    lines: dict[str, list[tuple[float, float]]] = {}
    for row in table.rows:
        x, _ = _mean_std(table, row, "mean exit step")
        y, _ = _mean_std(table, row, "accuracy")
        if x is not None and y is not None:
            lines.setdefault(f"{row['experiment']} · {row['mode']}", []).append((x, y))
    styles = {"fixed loops": "o-", "stage 1": "s--", "stage 2": "^:"}
    for name, pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(name.split(" · ")[-1], "x-"), label=name)
    ax.set_xlabel("mean exit step (loops used)")
    ax.set_ylabel("accuracy")
    ax.legend(fontsize=7)


def plot_bars(table: "Table", ax, metric: str) -> None:
    labels, means, stds = [], [], []
    for row in table.rows:
        m, s = _mean_std(table, row, metric)
        if m is None:
            continue
        arm = row.get("arm")
        labels.append(f"{row['experiment']}\n{row['N⊗R']}" + (f" {arm}" if arm else ""))
        means.append(m)
        stds.append(s)
    ax.bar(range(len(means)), means, yerr=stds, capsize=3, color="tab:blue")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(metric)


def plot_perplexity(table: "Table", ax) -> None:
    """The LM tables (1, 3, 7) and table 12: perplexity per configuration (bars)."""
    plot_bars(table, ax, "perplexity")


def plot_plt(table: "Table", ax) -> None:
    """Table 13: the language models' perplexity against their decoding tokens/s at batch 1, one point per arm
    (seed means ± their 95% half-widths), labelled with its arm and N⊗R."""
    for row in table.rows:
        x, xs = _mean_std(table, row, "decode tok/s b1")
        y, ys = _mean_std(table, row, "perplexity")
        if x is None or y is None:
            continue
        ax.errorbar([x], [y], xerr=[xs], yerr=[ys], marker="o", capsize=3)
        ax.annotate(f"{row['arm']} {row['N⊗R']}", (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("decoding tokens/s, batch 1 (one thread)")
    ax.set_ylabel("perplexity (held-out)")


def plot_task(table: "Table", ax) -> None:
    """Accuracy vs R for experiments whose N is fixed; bars otherwise."""
    by_exp: dict[str, list[tuple[int, int, float, float]]] = {}
    for row in table.rows:
        nr = _split_nr(row["N⊗R"])
        m, s = _mean_std(table, row, "accuracy")
        if nr and m is not None:
            by_exp.setdefault(row["experiment"], []).append((*nr, m, s))
    if any(len({p[0] for p in pts}) > 1 for pts in by_exp.values()):
        plot_bars(table, ax, "accuracy")
        return
    for name, pts in sorted(by_exp.items()):
        pts.sort(key=lambda p: p[1])
        ax.errorbar([p[1] for p in pts], [p[2] for p in pts], yerr=[p[3] for p in pts], marker="o", capsize=3,
                    label=f"{name} (N={pts[0][0]})")
    ax.set_xlabel("loops R")
    ax.set_ylabel("accuracy (held-out)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)


def plot_exitgrid(table: "Table", ax) -> None:
    """Table 10: accuracy of skip decoding against its measured speed-up over all loops, one series per task, backbone
    and handling (language-model rows have perplexity instead and are not plotted)."""
    series: dict[str, list[tuple[float, float, float, float]]] = {}
    for row in table.rows:
        x, xs = _mean_std(table, row, "speed-up vs all loops")
        y, ys = _mean_std(table, row, "accuracy, skip")
        if x is not None and y is not None:
            trained = "" if row.get("training", "standard") == "standard" else ", exit-aware"
            task = "" if row.get("task", "phop") == "phop" else f"{row['task']}: "
            series.setdefault(f"{task}{row['backbone']} {row['state']} ({row['handling']}{trained})", []).append((x, y, xs, ys))
    for name, pts in sorted(series.items()):
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], xerr=[p[2] for p in pts], yerr=[p[3] for p in pts],
                    fmt="o", capsize=2, label=name, alpha=0.8)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.axvline(EXIT_SPEEDUP_TARGET, color="tab:red", lw=0.8, ls="--", label=f"target {EXIT_SPEEDUP_TARGET:g}×")
    ax.set_xlabel("decoding speed-up of skip vs all loops (per-token latency)")
    ax.set_ylabel("answer accuracy, skip decoding")
    ax.legend(fontsize=7)


def plot_extrapolation(table: "Table", ax) -> None:
    """Table 9: the metric against test-time depth R′, one line per recipe × injection, the trained R marked."""
    cols = [c for c in table.columns if c.startswith("R′ = ")]
    trained = set()
    for row in table.rows:
        pts = [(int(c.split("= ")[1]), *_mean_std(table, row, c)) for c in cols]
        pts = [p for p in pts if p[1] is not None]
        if pts:
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=2,
                        label=f"{row.get('arm')} · {row.get('injection')}")
        if row.get("trained R"):
            trained.add(row["trained R"])
    for r in trained:
        ax.axvline(r, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("test-time depth R′ (dashed: trained R)")
    ax.set_ylabel("accuracy (held-out)")
    ax.legend(fontsize=7)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def plot_speculation(table: "Table", ax) -> None:
    """Table 11: speed-up over plain decoding against γ at batch 1, one line per model and k (identical output)."""
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in table.rows:
        if r["batch"] == 1:
            lines.setdefault(f"{r['model']} {r['training'][:10]} k={r['k']}", []).append((r["γ"], r["speed-up"]))
    for label, pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, lw=1, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(SPECULATION_SPEEDUP_TARGET, color="r", lw=0.8, ls="--")
    ax.set_xlabel("draft tokens γ")
    ax.set_ylabel("tokens/s ÷ plain (batch 1)")
    ax.legend(fontsize=5, ncol=2)


def plot_serving(table: "Table", ax) -> None:
    """Table 14: output tokens/s against concurrency, one line per model and arm (mean over rounds, 95% interval)."""
    lines: dict[str, list[tuple[int, float, float]]] = {}
    for r in table.rows:
        st = r["output tokens/s"]
        ci = st.interval
        lines.setdefault(f"{r['model']} · {r['arm']}", []).append((r["concurrency"], st.mean, 0.0 if ci is None else (ci[1] - ci[0]) / 2))
    for label, pts in sorted(lines.items()):
        pts.sort()
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", ms=3, lw=1,
                    capsize=2, label=label, ls="--" if "plain" in label else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrency (closed loop)")
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize=5, ncol=2)


# Each table kind's figure (spec.TableSpec.kind; None: no figure), drawn by draw(table, ax).
PLOTS = {
    "lm": plot_perplexity,  # tables 1, 7
    "depth": plot_depth,  # table 2
    "reset": plot_perplexity,  # table 3
    "decode": None,  # table 4
    "task": plot_task,  # tables 5, 6
    "exit": plot_exit,  # table 8
    "extrapolation": plot_extrapolation,  # table 9
    "exitgrid": plot_exitgrid,  # table 10
    "speculation": plot_speculation,  # table 11
    "routing": plot_perplexity,  # table 12
    "plt": plot_plt,  # table 13
    "serving": plot_serving,  # table 14
}


def plot_table(table: "Table", path: Path) -> Path | None:
    """Draw the table's figure into `path` (PNG); None when the table's kind has no figure (decode)."""
    draw = PLOTS[table.spec.kind]
    if draw is None:
        return None
    fig, ax = _pyplot().subplots(figsize=(7, 4.5))
    draw(table, ax)
    ax.set_title(f"Table {table.spec.number}: {table.spec.title} ({table.scale})", fontsize=9)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_eval_loops(results: dict, path: Path) -> Path:
    """depth.png of one run: the test metric at each test-time depth R′ (results.json's
    per_depth.eval_loops) on a log2 axis, the trained R marked by a vertical line. Accuracy for
    tasks, perplexity for language modelling."""
    sweep = results["per_depth"]["eval_loops"]
    depths = sorted(int(d) for d in sweep)
    metric = "accuracy" if all(sweep[str(d)].get("accuracy") is not None for d in depths) else "perplexity"
    values = [sweep[str(d)].get(metric) for d in depths]
    R = results["model"]["loops"]
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    ax.plot(depths, values, marker="o")
    ax.axvline(R, color="grey", linestyle="--", label=f"trained R = {R}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("test-time loops R′")
    ax.set_ylabel(f"{metric} (held-out test)")
    if metric == "accuracy":
        ax.set_ylim(0, 1.02)
    sampler = (results.get("depth") or {}).get("sampler", "fixed")
    m = results["model"]
    ax.set_title(f"{results.get('dataset')} · {m['backbone']} {m['layers']}⊗{R} · {m['state_mode']} · sampler {sampler}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_compare(res: dict, path: Path) -> Path | None:
    """compare_<metric>.png: one row per comparison line (tables/compare.py), its per-seed differences A − B as dots,
    their mean with the line's interval (the fixed-seed t-interval, or a sequential build's repeated one) as a bar,
    0 as a vertical rule and the negligible band (−δ, +δ) shaded; the verdict at the right. None without lines."""
    lines = res["lines"]
    if not lines:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 1.8 + 0.6 * len(lines)))
    delta = res.get("delta")
    if delta:
        ax.axvspan(-delta, delta, color="0.88", zorder=0, label=f"negligible band ±{delta:g}")
    ax.axvline(0.0, color="k", lw=0.8)
    labelled: set[str] = set()

    def once(label: str) -> str | None:  # each kind of mark once in the legend
        if label in labelled:
            return None
        labelled.add(label)
        return label

    interval = "repeated 95% interval" if res.get("sequential") else "95% t-interval"
    for i, x in enumerate(lines):
        y = len(lines) - 1 - i  # the first line on top, as in the markdown table
        if x.diffs:  # the seeds just above their mean, spread a little so equal differences stay visible
            ax.scatter(x.diffs, [y + 0.2 + 0.05 * (k % 3) for k in range(len(x.diffs))], s=14, color="tab:blue",
                       alpha=0.7, zorder=2, label=once("per-seed A − B"))
        if x.interval:
            lo, hi = x.interval
            ax.errorbar([x.mean_diff], [y], xerr=[[x.mean_diff - lo], [hi - x.mean_diff]], fmt="D", color="tab:red",
                        capsize=4, zorder=3, label=once(f"mean, {interval}"))
        ax.annotate(x.verdict, (1.01, y), xycoords=("axes fraction", "data"), va="center", fontsize=7,
                    annotation_clip=False)
    ax.set_yticks(range(len(lines)), [f"{x.a} − {x.b}" + ("" if x.stratum == "(all)" else f"\n{x.stratum}")
                                      for x in reversed(lines)], fontsize=7)
    ax.set_ylim(-0.6, len(lines) - 0.2)
    ax.set_xlabel(f"A − B in {res['metric']} (paired by seed)")
    claim = f"expected sign {res['sign']:+d}" if res.get("sign") else "two-sided"
    ax.set_title(f"{res['metric']}: each {res['pair']} against {res['baseline']} ({claim})", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, loc="best")
    return _save(fig, path)
