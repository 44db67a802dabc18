#!/usr/bin/env bash
# Wait for benchmarks/offline/pipeline_run.sh's job: until it ends or SECONDS pass, printing its progress every
# minute (benchmarks/pipeline_report.py --poll); then the report as it stands (finished: false while the job
# runs) and the run's logs and metrics into OUT, gzipped where large; with VARIANTS (pipeline_run.sh), each
# variant's report, log and metrics in OUT/variants.tar.gz (variants/<n>/: pipeline_10k.json, dvc.log.gz, metrics.tar.gz).
#
#   bash benchmarks/offline/pipeline_wait.sh /root/run 540 "$OUT"   # PEER=FILE: pipeline_report.py --peer
# The commit is the kit's (kit.sh wrote it; COMMIT=<sha> overrides it). STAGE_START=1: once the job has succeeded, also
# benchmarks/stage_start.py on the run's verifier (what a shard's process pays before its work, each phase; ~1 min)
# into OUT/stage_start.json, once. Where the job measured the peer's rate (pipeline_run.sh's PEER_RATE=1), its
# RUN/logs/peer_tau.json goes to OUT and the report's peer.tokens_per_s is its rate.
set -uo pipefail
run=$1 seconds=$2 out=$3
here=$(cd "$(dirname "$0")" && pwd)
report=$here/../pipeline_report.py
# a job started a moment ago has its pid before its first line: give it a few seconds
for _ in 1 2 3 4 5 6; do [ -f "$run/logs/dvc.log" ] || ! [ -f "$run/logs/job.pid" ] && break; sleep 1; done
[ -f "$run/logs/dvc.log" ] || { echo "error: $run/logs/dvc.log not found: no run here (a fresh machine?): pipeline_run.sh first"; exit 2; }
end=$((SECONDS + seconds)) next=$((SECONDS + 60))
while [ ! -f "$run/logs/job.rc" ] && [ "$SECONDS" -lt "$end" ]; do
  if ! kill -0 "$(cat "$run/logs/job.pid")" 2>/dev/null; then echo "the job ended without its exit code (killed?): rerun pipeline_run.sh to resume"; break; fi
  sleep 5
  if [ "$SECONDS" -ge "$next" ]; then
    for dir in "$run" "$run"/variants/*; do [ -f "$dir/logs/dvc.log" ] && python3 "$report" "$dir" --poll --lines 2; done
    next=$((SECONDS + 60))
  fi
done
# One run folder's report, log and metrics into a folder.
collect() {
  local dir=$1 to=$2
  mkdir -p "$to"
  python3 "$report" "$dir" --out "$to/pipeline_10k.json" --commit "${COMMIT:-$(cat "$dir/logs/commit.txt" 2>/dev/null || echo unknown)}" \
    --command "${COMMAND:-$(cat "$dir/logs/command.txt")}" ${PEER:+--peer "$PEER"} > /dev/null
  gzip -c "$dir/logs/dvc.log" > "$to/dvc.log.gz"
  tar -C "$dir" -czf "$to/metrics.tar.gz" --ignore-failed-read params.yaml dvc.lock logs/job.out metrics dvclive 2>/dev/null
}
for dir in "$run" "$run"/variants/*; do [ -f "$dir/logs/dvc.log" ] && python3 "$report" "$dir" --poll; done
[ -f "$run/logs/peer_tau.done" ] && PEER=${PEER:-$run/logs/peer_tau.json}
collect "$run" "$out"
if [ -n "${STAGE_START:-}" ] && [ "$(cat "$run/logs/job.rc" 2>/dev/null)" = 0 ] && [ ! -f "$run/logs/stage_start.json" ]; then
  python3 "$here/../stage_start.py" "$run/logs/stage_start.json" --verifier "$run/models/verifier" --repeats 1 \
    > "$run/logs/stage_start.log" 2>&1 || echo "stage_start.py failed: $run/logs/stage_start.log"
fi
for file in stage_start.json stage_start.log peer_tau.json peer_tau.log; do [ -f "$run/logs/$file" ] && cp "$run/logs/$file" "$out/"; done
[ -f "$run/logs/gpu.tsv" ] && gzip -c "$run/logs/gpu.tsv" > "$out/gpu.tsv.gz"
variants=$(mktemp -d)
for dir in "$run"/variants/*; do [ -f "$dir/logs/dvc.log" ] && collect "$dir" "$variants/variants/$(basename "$dir")"; done
[ -d "$variants/variants" ] && tar -C "$variants" -czf "$out/variants.tar.gz" variants
rm -rf "$variants"
ls -la "$out"
