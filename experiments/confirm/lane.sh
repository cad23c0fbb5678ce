#!/usr/bin/env bash
# One lane of C2 (docs/tables.md#confirmatory-runs): table 2's six runs of each seed given, one run at a time, one
# thread, in outputs/confirm/table2/tiny/stateloop_depth_tiny/r_<arm>_R<R>_s<seed>. Run it at `nice -n 19` beside
# other work; start two lanes on two cores. A run with a results.json is skipped, so a lane resumes where it
# stopped. The code is frozen at CODE_COMMIT (a worktree beside the checkout), so every run of C2 trains with the
# same code whatever the checkout holds by then.
#
# A session's machine does not keep outputs/: `keep.sh` copies the finished runs' results.json (nothing else) into
# experiments/confirm/kept/ to be committed unread, and this script puts them back before it starts. Nobody reads
# them before all 60 are in: `python -m looplab.tables confirm c2 --out-root outputs/confirm` is the one look.
set -euo pipefail
CODE_COMMIT=8c5b311
repo="$(cd "$(dirname "$0")/../.." && pwd)"
wt="$(dirname "$repo")/confirm-wt-$CODE_COMMIT"
[ -d "$wt" ] || git -C "$repo" worktree add --detach "$wt" "$CODE_COMMIT" >/dev/null
"$repo/experiments/confirm/keep.sh" restore
root="$repo/outputs/confirm/table2/tiny/stateloop_depth_tiny"
mkdir -p "$root"
export PYTHONPATH="$wt/src" OMP_WAIT_POLICY=PASSIVE WANDB_MODE=offline
for seed in "$@"; do
  for R in 2 4 6; do
    for arm in looped stateloop; do
      dir="$root/r_${arm}_R${R}_s${seed}"
      [ -f "$dir/results.json" ] && continue
      rm -rf "$dir"
      echo "$(date -u +%FT%TZ) start $arm R$R s$seed"
      (cd "$repo" && "$repo/.venv/bin/python" -m looplab.train +experiment=stateloop_depth_tiny "+arm=$arm" \
        "loop_depth.loops=$R" "seed=$seed" group=table2-tiny "tags=[table2,tiny,stateloop_depth_tiny,confirm]" \
        logger=csv hardware.num_threads=1 "hydra.run.dir=$dir" > "$dir.log" 2>&1) \
        && echo "$(date -u +%FT%TZ) done $arm R$R s$seed" || echo "$(date -u +%FT%TZ) FAILED $arm R$R s$seed (see $dir.log)"
    done
  done
done
