#!/usr/bin/env bash
# keep.sh [save|restore]: the confirmatory runs' results.json files between outputs/confirm (not kept by a session's
# machine) and experiments/confirm/kept (committed). Only results.json moves; nothing prints a figure from it.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
out="$repo/outputs/confirm" kept="$repo/experiments/confirm/kept"
case "${1:-save}" in
  save) src="$out" dst="$kept" ;;
  restore) src="$kept" dst="$out" ;;
  *) echo "usage: keep.sh [save|restore]" >&2; exit 2 ;;
esac
[ -d "$src" ] || exit 0
n=0
while IFS= read -r f; do
  rel="${f#"$src"/}"
  [ -f "$dst/$rel" ] && continue
  mkdir -p "$dst/$(dirname "$rel")" && cp "$f" "$dst/$rel" && n=$((n + 1))
done < <(find "$src" -name results.json -not -path '*/.submitit/*')
echo "keep.sh ${1:-save}: $n results.json copied to $dst"
