#!/usr/bin/env bash
# Wait for benchmarks/offline/pipeline_run.sh's job: until it ends or SECONDS pass, printing its progress every
# minute (benchmarks/pipeline_report.py --poll); then the report as it stands (finished: false while the job
# runs) and the run's logs and metrics into OUT, gzipped where large (what a device call brings back: 8 files).
#
#   COMMIT=<sha> bash benchmarks/offline/pipeline_wait.sh /root/run 540 "$OUT"   # PEER=FILE: pipeline_report.py --peer
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
  if [ "$SECONDS" -ge "$next" ]; then python3 "$report" "$run" --poll --lines 2; next=$((SECONDS + 60)); fi
done
python3 "$report" "$run" --poll
mkdir -p "$out"
python3 "$report" "$run" --out "$out/pipeline_10k.json" --commit "${COMMIT:-unknown}" \
  --command "${COMMAND:-$(cat "$run/logs/command.txt")}" ${PEER:+--peer "$PEER"} > /dev/null
gzip -c "$run/logs/dvc.log" > "$out/dvc.log.gz"
[ -f "$run/logs/gpu.tsv" ] && gzip -c "$run/logs/gpu.tsv" > "$out/gpu.tsv.gz"
tar -C "$run" -czf "$out/metrics.tar.gz" --ignore-failed-read params.yaml dvc.lock logs/job.out metrics dvclive 2>/dev/null
ls -la "$out"
