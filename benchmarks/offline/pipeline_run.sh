#!/usr/bin/env bash
# The whole pipeline by one `dvc repro` in a fresh DVC run folder, detached, timed and watched, for
# benchmarks/pipeline_report.py (its --poll shows the progress):
#
#   PYTHONPATH=/root/site bash benchmarks/offline/pipeline_run.sh /root/run /root/kit/prompts.tar.gz   # the GPU host
#   OVERRIDES="-S dataset=demo -S layout=cpu" bash benchmarks/offline/pipeline_run.sh /tmp/run prompts.tar.gz
#
# RUN, made once: `dvc init --no-scm` with an empty cache (cache.type hardlink), this repository's dvc.yaml,
# conf/, src/ and data/sources, params.yaml composed from OVERRIDES (default: dataset=10k layout=gpu1).
# Then, in a process of its own session (setsid: it outlives the call that started it, until the machine
# goes back), with an NVML sampler beside it (RUN/logs/gpu.tsv, benchmarks/offline/gpu_sampler.py):
#   1. `dvc repro verifier` (params, then the verifier's import);
#   2. PROMPTS (kit.sh's prompts.tar.gz: params.yaml, data/prompts, metrics/prompts.json; its params.yaml must
#      be the one composed here) unpacked and recorded as the prompts stage's outputs (`dvc commit -f prompts`);
#      without PROMPTS the prompts stage runs in step 3 (it needs the evals package);
#   3. one `dvc repro` of everything else.
# Every line of DVC's output (and so the stages') goes to RUN/logs/dvc.log after its time
# (benchmarks/offline/stamp.py); the job's exit code to RUN/logs/job.rc. Run it again to resume: while the job
# runs it only says so; after a failure (or a killed job) it starts the job again and `dvc repro` continues
# (done stages are skipped, train resumes from its checkpoints); once the job has succeeded it does nothing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
if [ "${1:-}" = --job ]; then  # the detached job itself (below: `setsid ... "$0" --job RUN PROMPTS`)
  run=$2 prompts=$3
  cd "$run"
  stamp() { python3 -u "$here/stamp.py" logs/dvc.log; }
  python3 "$here/gpu_sampler.py" logs/gpu.tsv --every "${SAMPLE_EVERY:-0.2}" &
  sampler=$!
  trap 'kill "$sampler" 2>/dev/null || true' EXIT
  echo "=== session start pid $$" | stamp
  set +e
  python -m dvc repro verifier 2>&1 | stamp
  code=${PIPESTATUS[0]}
  echo "=== dvc repro verifier: exit $code" | stamp  # "=== " lines end a stage's window (pipeline_report.py)
  if [ "$code" = 0 ] && [ -n "$prompts" ] && [ ! -f logs/prompts.committed ]; then
    { tar -xzf "$prompts" data/prompts metrics/prompts.json && python -m dvc commit -f prompts \
        && touch logs/prompts.committed && echo "=== prompts committed"; } 2>&1 | stamp
    code=${PIPESTATUS[0]}
  fi
  if [ "$code" = 0 ]; then
    python -m dvc repro 2>&1 | stamp
    code=${PIPESTATUS[0]}
  fi
  echo "=== exit $code" | stamp
  echo "$code" > logs/job.rc
  exit "$code"
fi

run=$1 prompts=${2:-}
[ -z "$prompts" ] || prompts=$(cd "$(dirname "$prompts")" && pwd)/$(basename "$prompts")
[ -z "$prompts" ] || [ -f "$prompts" ] || { echo "error: $prompts not found: kit.sh's prompts.tar.gz (PROMPTS=...)"; exit 2; }
mkdir -p "$run/logs"
run=$(cd "$run" && pwd)
if [ -f "$run/logs/job.pid" ] && kill -0 "$(cat "$run/logs/job.pid")" 2>/dev/null; then
  echo "running: job $(cat "$run/logs/job.pid") (python3 benchmarks/pipeline_report.py $run --poll)"; exit 0
fi
if [ "$(cat "$run/logs/job.rc" 2>/dev/null)" = 0 ]; then echo "done: $run/logs/job.rc is 0"; exit 0; fi
export PYTHONPATH="$run/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DVC_NO_ANALYTICS=1
if [ ! -d "$run/.dvc" ]; then  # a fresh run folder
  cp -r "$repo/dvc.yaml" "$repo/conf" "$repo/src" "$run/"
  # the job runs from its own copy: a device call re-copies the repository while the job runs
  mkdir -p "$run/tools" && cp "$here/pipeline_run.sh" "$here/stamp.py" "$here/gpu_sampler.py" "$run/tools/"
  mkdir -p "$run/data" && cp -r "$repo/data/sources" "$run/data/"
  [ -f "$repo/.dvcignore" ] && cp "$repo/.dvcignore" "$run/"
  find "$run/src" -name __pycache__ -prune -exec rm -rf {} +
  # shellcheck disable=SC2086  # OVERRIDES: the overrides, split as words
  (cd "$run" && python -m eagle3.cli params ${OVERRIDES:--S dataset=10k -S layout=gpu1})
  if [ -n "$prompts" ]; then
    tar -xzf "$prompts" -O params.yaml | cmp -s - "$run/params.yaml" \
      || { echo "error: $prompts holds another params.yaml than $run/params.yaml: compose both with the same OVERRIDES"; exit 2; }
  fi
  (cd "$run" && python -m dvc init --no-scm -q && python -m dvc config cache.type hardlink \
    && python -m dvc config core.analytics false)
  echo "eagle3 params ${OVERRIDES:--S dataset=10k -S layout=gpu1}; dvc init --no-scm; dvc repro verifier;${prompts:+ prompts carried, dvc commit -f prompts;} dvc repro" \
    > "$run/logs/command.txt"  # the report's "command"
fi
cd "$run"
rm -f logs/job.rc
setsid nohup bash "$run/tools/pipeline_run.sh" --job "$run" "$prompts" > logs/job.out 2>&1 < /dev/null &
echo $! > logs/job.pid
echo "started: job $! in $run (logs in $run/logs; python3 benchmarks/pipeline_report.py $run --poll)"
