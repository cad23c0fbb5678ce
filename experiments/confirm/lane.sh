#!/usr/bin/env bash
# lane.sh c2|c1|z2|p|t8|r2|t8l SEED...: one lane of a confirmatory run (docs/tables.md#confirmatory-runs), one run at a time,
# one thread, each run in a folder of its own (r_<arm>[_R<R>]_s<seed>, what `python -m looplab.tables confirm NAME`
# reads; t8: the folders of `tables run 8`, what `tables report 8` reads):
#   c2  table 2: both arms at R = 2, 4, 6, 600 steps   outputs/confirm/table2/tiny/stateloop_depth_tiny
#   c1  table 1: both arms (1⊗3), 600 steps            outputs/confirm/table1/tiny/stateloop_main_tiny
#       (and Z1: each run's zero-shot, zeroshot.json beside its results.json)
#   z2  table 1's two mixer arms (1⊗3), 600 steps, in C1's folder, each with its zero-shot (Z2)
#   p   table 2's R = 6 pair at 1,200 steps           outputs/confirm/pilot/stateloop_depth_tiny_1200
#   t8  table 8 at 1,600 steps: the registered `tables run 8 --seeds S --extra trainer.max_steps=1600` commands of
#       each seed, one after another (its three stage-2 runs start from its fixed runs' checkpoints), below
#       outputs/confirm/table8/tiny; once all nine have run, the seed's results.json files are kept (keep.sh seed8)
#   r2  table 2's R = 2 pair, 600 steps                outputs/confirm/r2/stateloop_depth_tiny
#   t8l T8's llama fixed-loop and stage-2 runs only (two of its nine, in that order), below outputs/confirm/t8l/table8/tiny;
#       kept a seed at a time as t8's
# Run it at `nice -n 19` beside other work, one lane per core. A run with a results.json is skipped, so a lane
# resumes where it stopped. The code is frozen at CODE_COMMIT (a worktree beside the checkout), so every
# confirmatory run trains with the same code whatever the checkout holds by then.
#
# A session's machine does not keep outputs/: `keep.sh` copies the finished runs' results.json (nothing else) into
# experiments/confirm/kept/ to be committed unread, and this script puts them back before it starts. Nobody reads
# them before all of a design's runs are in: `python -m looplab.tables confirm NAME` is its one look.
set -euo pipefail
CODE_COMMIT=8c5b311
design="${1:?usage: lane.sh c2|c1|z2|p|t8|r2|t8l SEED...}"; shift
repo="$(cd "$(dirname "$0")/../.." && pwd)"
wt="$(dirname "$repo")/confirm-wt-$CODE_COMMIT"
# two lanes started together: one creates the worktree, the other waits for it
flock "$repo/.git/confirm-wt.lock" bash -c '[ -d "$1" ] || git -C "$2" worktree add --detach "$1" "$3" >/dev/null' _ "$wt" "$repo" "$CODE_COMMIT"
"$repo/experiments/confirm/keep.sh" restore
export PYTHONPATH="$wt/src" OMP_WAIT_POLICY=PASSIVE WANDB_MODE=offline

# train_run NAME DIR COMMAND...: one run into DIR (its output in DIR.log); returns 1, running nothing, when DIR has a
# results.json already (a failed run is a result too: it is logged and returns 0)
train_run() {
  local name="$1" dir="$2"; shift 2
  [ -f "$dir/results.json" ] && return 1
  rm -rf "$dir"; mkdir -p "$(dirname "$dir")"
  echo "$(date -u +%FT%TZ) start $design $name"
  (cd "$repo" && "$@" > "$dir.log" 2>&1) \
    && echo "$(date -u +%FT%TZ) done $design $name" || echo "$(date -u +%FT%TZ) FAILED $design $name (see $dir.log)"
}

if [ "$design" = t8 ] || [ "$design" = t8l ]; then
  out_root="$repo/outputs/confirm"; [ "$design" = t8l ] && out_root="$repo/outputs/confirm/t8l"
  for seed in "$@"; do
    # the registered command, this seed only, as `tables run` would launch it (--dry-run prints each run's command)
    mapfile -t cmds < <(cd "$repo" && "$repo/.venv/bin/python" -m looplab.tables run 8 --seeds "$seed" \
      --extra trainer.max_steps=1600 --out-root "$out_root" --table-dir "$repo/outputs/confirm/tables" \
      --dry-run | sed -n 's/^\[table8\] //p')
    [ "${#cmds[@]}" = 9 ] || { echo "lane.sh $design: expected 9 runs for seed $seed, got ${#cmds[@]}" >&2; exit 1; }
    if [ "$design" = t8l ]; then  # llama's fixed loops, then its stage 2 (warm-started from them)
      mapfile -t cmds < <(printf '%s\n' "${cmds[@]}" | grep -E 'hydra\.sweep\.dir=[^ ]*/exit_gate_llama_mixed_tiny(_stage2)? ')
      [ "${#cmds[@]}" = 2 ] || { echo "lane.sh t8l: expected 2 llama runs for seed $seed, got ${#cmds[@]}" >&2; exit 1; }
    fi
    for cmd in "${cmds[@]}"; do
      dir="$(sed -n 's/.*hydra\.sweep\.dir=\([^ ]*\) .*/\1/p' <<< "$cmd")/seed$seed"
      train_run "${dir#"$repo"/outputs/confirm/}" "$dir" eval "$cmd" || continue
    done
    "$repo/experiments/confirm/keep.sh" seed8 "$seed"  # all its runs ran (a failed one is a result: its seed is left out)
  done
  exit 0
fi
case "$design" in
  c2) experiment=stateloop_depth_tiny root="$repo/outputs/confirm/table2/tiny/stateloop_depth_tiny" depths="2 4 6" extra=() ;;
  c1) experiment=stateloop_main_tiny root="$repo/outputs/confirm/table1/tiny/stateloop_main_tiny" depths="-" extra=() ;;
  z2) experiment=stateloop_main_tiny root="$repo/outputs/confirm/table1/tiny/stateloop_main_tiny" depths="-" extra=()
      arms="stateloop_attn stateloop_mamba2" ;;
  p) experiment=stateloop_depth_tiny root="$repo/outputs/confirm/pilot/stateloop_depth_tiny_1200" depths="6" extra=(trainer.max_steps=1200) ;;
  r2) experiment=stateloop_depth_tiny root="$repo/outputs/confirm/r2/stateloop_depth_tiny" depths="2" extra=() ;;
  *) echo "lane.sh: unknown design '$design' (c2, c1, z2, p, t8, r2 or t8l)" >&2; exit 2 ;;
esac
for seed in "$@"; do
  for R in $depths; do
    for arm in ${arms:-looped stateloop}; do
      if [ "$R" = - ]; then name="r_${arm}_s${seed}" depth=(); else name="r_${arm}_R${R}_s${seed}" depth=("loop_depth.loops=$R"); fi
      dir="$root/$name"
      train_run "$name" "$dir" "$repo/.venv/bin/python" -m looplab.train "+experiment=$experiment" "+arm=$arm" \
        "${depth[@]}" "seed=$seed" "tags=[confirm,$design,$experiment]" logger=csv hardware.num_threads=1 \
        "${extra[@]}" "hydra.run.dir=$dir" || continue
      if { [ "$design" = c1 ] || [ "$design" = z2 ]; } && [ -f "$dir/results.json" ]; then
        # Z1, Z2: the zero-shot suite with per-item outcomes (zeroshot.json) while the run's checkpoint is on this machine;
        # `tables zeroshot` scores every run of the folder without one, one lane at a time; its output (figures) goes
        # to the run's own log, unread
        (cd "$repo" && flock "$repo/.git/confirm-zeroshot.lock" "$repo/.venv/bin/python" -m looplab.tables zeroshot 1 \
          --tasks looplab_tiny --out-root "$repo/outputs/confirm" > "$dir.zeroshot.log" 2>&1) \
          || echo "$(date -u +%FT%TZ) FAILED zero-shot of $design $name (see $dir.zeroshot.log)"
      fi
    done
  done
done
