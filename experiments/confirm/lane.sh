#!/usr/bin/env bash
# lane.sh c2|c1|p SEED...: one lane of a confirmatory run (docs/tables.md#confirmatory-runs), one run at a time, one
# thread, each run in a folder of its own (r_<arm>[_R<R>]_s<seed>, what `python -m looplab.tables confirm NAME` reads):
#   c2  table 2: both arms at R = 2, 4, 6, 600 steps   outputs/confirm/table2/tiny/stateloop_depth_tiny
#   c1  table 1: both arms (1⊗3), 600 steps            outputs/confirm/table1/tiny/stateloop_main_tiny
#   p   table 2's R = 6 pair at 1,200 steps           outputs/confirm/pilot/stateloop_depth_tiny_1200
# Run it at `nice -n 19` beside other work, one lane per core. A run with a results.json is skipped, so a lane
# resumes where it stopped. The code is frozen at CODE_COMMIT (a worktree beside the checkout), so every
# confirmatory run trains with the same code whatever the checkout holds by then.
#
# A session's machine does not keep outputs/: `keep.sh` copies the finished runs' results.json (nothing else) into
# experiments/confirm/kept/ to be committed unread, and this script puts them back before it starts. Nobody reads
# them before all of a design's runs are in: `python -m looplab.tables confirm NAME` is its one look.
set -euo pipefail
CODE_COMMIT=8c5b311
design="${1:?usage: lane.sh c2|c1|p SEED...}"; shift
repo="$(cd "$(dirname "$0")/../.." && pwd)"
wt="$(dirname "$repo")/confirm-wt-$CODE_COMMIT"
# two lanes started together: one creates the worktree, the other waits for it
flock "$repo/.git/confirm-wt.lock" bash -c '[ -d "$1" ] || git -C "$2" worktree add --detach "$1" "$3" >/dev/null' _ "$wt" "$repo" "$CODE_COMMIT"
"$repo/experiments/confirm/keep.sh" restore
case "$design" in
  c2) experiment=stateloop_depth_tiny root="$repo/outputs/confirm/table2/tiny/stateloop_depth_tiny" depths="2 4 6" extra=() ;;
  c1) experiment=stateloop_main_tiny root="$repo/outputs/confirm/table1/tiny/stateloop_main_tiny" depths="-" extra=() ;;
  p) experiment=stateloop_depth_tiny root="$repo/outputs/confirm/pilot/stateloop_depth_tiny_1200" depths="6" extra=(trainer.max_steps=1200) ;;
  *) echo "lane.sh: unknown design '$design' (c2, c1 or p)" >&2; exit 2 ;;
esac
mkdir -p "$root"
export PYTHONPATH="$wt/src" OMP_WAIT_POLICY=PASSIVE WANDB_MODE=offline
for seed in "$@"; do
  for R in $depths; do
    for arm in looped stateloop; do
      if [ "$R" = - ]; then name="r_${arm}_s${seed}" depth=(); else name="r_${arm}_R${R}_s${seed}" depth=("loop_depth.loops=$R"); fi
      dir="$root/$name"
      [ -f "$dir/results.json" ] && continue
      rm -rf "$dir"
      echo "$(date -u +%FT%TZ) start $design $name"
      (cd "$repo" && "$repo/.venv/bin/python" -m looplab.train "+experiment=$experiment" "+arm=$arm" "${depth[@]}" \
        "seed=$seed" "tags=[confirm,$design,$experiment]" logger=csv hardware.num_threads=1 "${extra[@]}" \
        "hydra.run.dir=$dir" > "$dir.log" 2>&1) \
        && echo "$(date -u +%FT%TZ) done $design $name" || echo "$(date -u +%FT%TZ) FAILED $design $name (see $dir.log)"
    done
  done
done
