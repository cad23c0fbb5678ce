"""A table of one's own on W&B: one run, `<name>-verdicts` in group `<name>` (beside the spec's training runs when
they log there), holding the comparison lines as a wandb.Table, each line's verdict in the run's summary and the
plot as an image.

Offline without WANDB_API_KEY (WANDB_MODE=offline, as the training runs): the run is written under
`<folder>/wandb/offline-run-*`, which `make sync-wandb` uploads later.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT = "looplab"  # the training runs' default project (conf/logger/wandb.yaml)
COLUMNS = ["arm", "baseline", "stratum", "n_seeds", "mean_diff", "ci_lo", "ci_hi", "verdict", "p", "p_holm", "look",
           "reason"]


def line_key(line) -> str:
    """A line's name in the summary: the arm, and its stratum when the comparison has strata."""
    return line.a if line.stratum == "(all)" else f"{line.a} @ {line.stratum}"


def log_verdicts(res: dict, name: str, folder: Path, plot: Path | None = None, project: str = PROJECT) -> Path:
    """Log the comparison `res` (tables/compare.py) as the run `<name>-verdicts`; returns the run's local folder."""
    import wandb

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mode = "offline" if not os.environ.get("WANDB_API_KEY") else os.environ.get("WANDB_MODE", "online")
    seq = res.get("sequential")
    config = {k: res[k] for k in ("pair", "metric", "baseline", "sign", "delta", "require")}
    if seq:
        config["sequential"] = {"design": seq["design"], "rounds": seq["rounds"], "stop": seq["stop"]}
    run = wandb.init(project=project, name=f"{name}-verdicts", group=name, job_type="verdicts", dir=str(folder),
                     mode=mode, config=config, reinit="create_new")
    try:
        rows = []
        for x in res["lines"]:
            lo, hi = x.interval if x.interval else (None, None)
            rows.append([x.a, x.b, x.stratum, len(x.seeds), x.mean_diff, lo, hi, x.verdict, x.p, x.p_holm, x.look,
                         x.reason])
        log = {"verdicts": wandb.Table(columns=COLUMNS, data=rows)}
        if plot is not None and Path(plot).is_file():
            log["plot"] = wandb.Image(str(plot))
        run.log(log)
        for x in res["lines"]:
            run.summary[f"verdict/{line_key(x)}"] = x.verdict
            if x.mean_diff is not None:
                run.summary[f"mean_diff/{line_key(x)}"] = x.mean_diff
        counts: dict[str, int] = {}
        for x in res["lines"]:
            counts[x.verdict] = counts.get(x.verdict, 0) + 1
        run.summary["verdict_counts"] = counts
        local = Path(run.dir).parent  # <folder>/wandb/<offline->run-<time>-<id>; its files/ hold the summary
    finally:
        run.finish()
    print(f"[{name}] W&B run {name}-verdicts ({mode}): {local}" + ("  (`make sync-wandb` uploads)" if mode == "offline"
                                                                     else ""), flush=True)
    return local
