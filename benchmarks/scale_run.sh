#!/usr/bin/env bash
# End-to-end scale run of the pipeline from this repo's dvc.yaml, timing every stage group.
#
#   benchmarks/scale_run.sh OUT_DIR -S dataset=1k -S layout=gpu1
#
# Composes params.yaml from the overrides (as `dvc exp run -S` does), then runs `dvc repro`
# one stage group at a time so each gets a wall time; writes OUT_DIR/stage_times.json and copies
# every metrics file (generate, merge, train, evaluate) next to it.
set -euo pipefail
out=$1; shift
mkdir -p "$out"
python -m eagle3.cli params "$@"
times=()
for stage in verifier prompts generate extract merge train evaluate; do
  start=$(date +%s.%N)
  dvc repro "$stage" 2>&1 | grep -vE "it/s\]|s/it\]" | tail -n 40
  times+=("\"$stage\": $(python -c "import time; print(round(time.time() - $start, 1))")")
done
(IFS=,; echo "{${times[*]}}") > "$out/stage_times.json"
cp params.yaml "$out/"
for f in metrics/merge/metrics.json dvclive/train/metrics.json dvclive/evaluate/metrics.json; do
  [ -f "$f" ] && cp "$f" "$out/$(echo "$f" | tr / _)"
done
cat metrics/generate/*.json > "$out/generate_stats.jsonl" 2>/dev/null || true
cat "$out/stage_times.json"
