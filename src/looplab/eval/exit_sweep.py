"""Accuracy / perplexity against exit depth: one forward per batch serves every threshold q.

Each row of the sweep is one inference mode (docs/formulations.md#exit-gate): a fixed depth k
(`exit_at_step=k`), a threshold q (first depth whose cumulative exit probability
≥ q), `expected` (probability-weighted logits), or a zero-shot exit rule at a threshold
(`kl`, `entropy`, `hidden_delta`, `argmax_stable`; models/exit_rules.py). Every row reports its metric
together with the mean and histogram of the exit depth, scored at the task's
answer positions (synthetic tasks) or at every target token (language modelling).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F

from looplab.models.exit_gate import logits_at_depth, threshold_exit_steps
from looplab.models.exit_rules import check_rule, first_exit, get_rule

IGNORE = -100


class _Row:
    def __init__(self, name: str, R: int):
        self.name, self.R = name, R
        self.nll = 0.0
        self.correct = 0
        self.n = 0
        self.hist = torch.zeros(R, dtype=torch.float64)

    def update(self, logits, targets, scored, steps):
        """logits (B,T,V); targets (B,T); scored (B,T) bool; steps (B,T) long 1-based, or a float expected depth."""
        lg, tg = logits[scored].float(), targets[scored]
        self.nll += float(F.cross_entropy(lg, tg, reduction="sum"))
        self.correct += int((lg.argmax(-1) == tg).sum())
        self.n += int(tg.numel())
        if isinstance(steps, torch.Tensor) and steps.dtype == torch.long:
            self.hist += torch.bincount(steps[scored] - 1, minlength=self.R).double()
        else:  # expected mode: a distribution over depths per token
            self.hist += steps[scored].double().sum(0)

    def result(self) -> dict[str, Any]:
        depth = torch.arange(1, self.R + 1, dtype=torch.float64)
        total = float(self.hist.sum()) or 1.0
        nll = self.nll / max(self.n, 1)
        return {
            "mode": self.name,
            "accuracy": self.correct / max(self.n, 1),
            "nll": nll,
            "perplexity": math.exp(min(nll, 50.0)),
            "mean_exit_step": float((self.hist * depth).sum()) / total,
            "exit_histogram": (self.hist / total).tolist(),
            "scored": self.n,
        }


@torch.no_grad()
def exit_sweep(
    model: torch.nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    thresholds: Sequence[float] = (0.3, 0.5, 0.7, 0.9, 1.01),
    max_batches: int | None = None,
    device: str | torch.device | None = None,
    rule: str | None = None,
    rule_thresholds: Sequence[float] = (),
    min_loops: int = 1,
) -> dict[str, Any]:
    """thresholds: the gate's q (gated models); rule, rule_thresholds: a zero-shot exit rule's rows."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    R = model.config.n_loops
    gated = model.exit_gate is not None
    rows = [_Row(f"exit_at_step={k}", R) for k in range(1, R + 1)]
    q_rows = [_Row(f"q={q}", R) for q in thresholds] if gated else []
    for q in thresholds if gated else ():  # a bad q is refused before any batch runs, naming it
        check_rule("gate", q, 1, R)
    if rule is not None:
        if get_rule(rule).reads == "exit_probs":
            raise ValueError(f"exit rule {rule!r} reads the gate's exit distribution: it is the thresholds q of a gated "
                             "model; pass it as thresholds")
        for tau in rule_thresholds:
            check_rule(rule, tau, min_loops, R)
    rule_rows = [_Row(f"{rule}<{tau}" if rule != "argmax_stable" else f"{rule} k={tau:g}", R) for tau in rule_thresholds] \
        if rule is not None else []
    expected = _Row("expected", R) if gated else None
    was_training = model.training
    model.eval()
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            ids, targets = batch["input_ids"].to(device), batch["targets"].to(device)
            scored = batch["answer_mask"].to(device) if "answer_mask" in batch else targets != IGNORE
            out = model(ids, return_all_loops=True)
            B, T = ids.shape
            for k, row in enumerate(rows, start=1):
                row.update(out.loop_logits[k - 1], targets, scored, torch.full((B, T), k, dtype=torch.long, device=device))
            if gated:
                for q, row in zip(thresholds, q_rows):
                    steps = threshold_exit_steps(out.exit_probs, q)
                    row.update(logits_at_depth(out.loop_logits, steps), targets, scored, steps)
                mixed = torch.einsum("btr,rbtv->btv", out.exit_probs, out.loop_logits)  # the gate's expected logits
                expected.update(mixed, targets, scored, out.exit_probs)
            for tau, row in zip(rule_thresholds, rule_rows):
                steps = first_exit(rule, tau, R, min_loops=min_loops, logits=out.loop_logits, hidden=out.loop_hidden)
                row.update(logits_at_depth(out.loop_logits, steps), targets, scored, steps)
    finally:
        model.train(was_training)
    if rows[0].n == 0:  # every row scores the same positions
        raise ValueError(f"no target tokens were scored (max_batches={max_batches}; or an empty split, or every target "
                         "ignored): there is no metric over 0 tokens")
    result = {"n_loops": R, "fixed": [r.result() for r in rows], "thresholds": [], "expected": None,
              "rule": [{**r.result(), "rule": rule, "threshold": tau, "min_loops": min_loops}
                       for tau, r in zip(rule_thresholds, rule_rows)]}
    if gated:
        result["thresholds"] = [{**r.result(), "q": q} for q, r in zip(thresholds, q_rows)]
        result["expected"] = expected.result()
    return result


def sweep_markdown(result: dict[str, Any], metric: str) -> str:
    lines = [f"| mode | {metric} | mean exit step | exit-depth histogram (1..R) |", "|---|---|---|---|"]
    for row in (result["fixed"] + result["thresholds"] + ([result["expected"]] if result["expected"] else [])
                + result.get("rule", [])):
        hist = " ".join(f"{p:.2f}" for p in row["exit_histogram"])
        lines.append(f"| {row['mode']} | {row[metric]:.4f} | {row['mean_exit_step']:.2f} | {hist} |")
    return "\n".join(lines) + "\n"


def plot_sweep(result: dict[str, Any], metric: str, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    fixed = result["fixed"]
    ax.plot([r["mean_exit_step"] for r in fixed], [r[metric] for r in fixed], "o-", label="fixed depth (exit_at_step=k)")
    if result["thresholds"]:
        th = result["thresholds"]
        ax.plot([r["mean_exit_step"] for r in th], [r[metric] for r in th], "s--", label="exit gate, threshold q")
        for r in th:
            ax.annotate(f"q={r['q']}", (r["mean_exit_step"], r[metric]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if result.get("rule"):
        ru = result["rule"]
        ax.plot([r["mean_exit_step"] for r in ru], [r[metric] for r in ru], "^:", label=f"exit rule {ru[0]['rule']}")
        for r in ru:
            ax.annotate(f"{r['threshold']:g}", (r["mean_exit_step"], r[metric]), fontsize=7, xytext=(3, -9),
                        textcoords="offset points")
    ax.set_xlabel("mean exit depth")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
