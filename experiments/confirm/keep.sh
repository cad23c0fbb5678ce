#!/usr/bin/env bash
# keep.sh [save|restore|seed8 SEED]: the confirmatory runs' results.json files (and Z1's zeroshot.json) between
# outputs/confirm (not kept by a session's machine) and experiments/confirm/kept (committed). Only these move; nothing
# prints a figure from them.
# T8's runs move a seed at a time, once all nine of its runs have run (`seed8 SEED`, from lane.sh t8): a seed cut off
# by the end of a session has lost the fixed runs' checkpoints its stage-2 runs start from, so it trains again whole.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
out="$repo/outputs/confirm" kept="$repo/experiments/confirm/kept"
only=(-not -path '*/table8/*')
case "${1:-save}" in
  save) src="$out" dst="$kept" ;;
  restore) src="$kept" dst="$out" only=() ;;
  seed8) src="$out" dst="$kept" only=(-path "*/table8/tiny/*/seed${2:?keep.sh seed8 SEED}/*") ;;
  *) echo "usage: keep.sh [save|restore|seed8 SEED]" >&2; exit 2 ;;
esac
[ -d "$src" ] || exit 0
n=0
while IFS= read -r f; do
  rel="${f#"$src"/}"
  [ -f "$dst/$rel" ] && continue
  # a C1 run is kept with its zero-shot (Z1) or not at all: without it the next session trains it again (its
  # checkpoint, which the zero-shot needs, is gone with this machine)
  [ "${1:-save}" = save ] && [[ "$rel" == table1/*/results.json ]] && [ ! -f "$(dirname "$f")/zeroshot.json" ] && continue
  mkdir -p "$dst/$(dirname "$rel")" && cp "$f" "$dst/$rel" && n=$((n + 1))
done < <(find "$src" \( -name results.json -o -name zeroshot.json \) -not -path '*/.submitit/*' "${only[@]}")
echo "keep.sh ${1:-save}: $n results.json / zeroshot.json files copied to $dst"
