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
#
# PEER_RATE=1: once the first run has succeeded, before any variant, the peer trainer on its data, the GPU to itself:
# benchmarks/peer_tau.py --rate-only --rate-steps ${PEER_STEPS:-1000} (its wheels in /root/peer-site: kit.sh with
# PEER=1; ours is not trained again) into RUN/logs/peer_tau.json, which pipeline_wait.sh's report then compares
# train's rate with. A failure there is logged (RUN/logs/peer_tau.log) and the variants go on. Its work folder (RUN/peer:
# the hidden states again, in the peer's format) is removed once the rate is measured.
#
# HOLD_VARIANTS=1: the variants wait, once the first run has succeeded, until RUN/logs/variants.hold is removed, so
# that something else can have the GPU to itself in between (benchmarks/serve_vllm.py's timings on the first run).
#
# VARIANTS: more runs after the first in the same job, '|'-separated override sets added to OVERRIDES, e.g.
#   VARIANTS="-S train.epochs=7|-S generate.max_new_tokens=256"
# each a run folder of its own, RUN/variants/<n> (its logs, report and metrics as RUN's), started once the first
# run has finished from its outputs (hard links to its data and models, copies of its metrics, its dvc.lock) on its
# DVC cache, so `dvc repro` there runs only the stages the variant changes. (DVC's run cache would not restore
# them: a stage with an uncached output is never in it.) An entry starting with "fresh" (e.g. "fresh" alone: the
# first run again) starts from nothing with an empty cache of its own, and empty compile caches: a repeat. A variant may not change
# `dataset`: the carried prompts are the first composition's.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
stamp() { python3 -u "$here/stamp.py" logs/dvc.log; }

# One run folder's pipeline, from its folder (logs/dvc.log; logs/pipeline.rc: its exit code; a folder whose
# pipeline.rc is 0 is skipped, so a resumed job goes on with the next one).
pipeline() {
  local prompts=$1 code
  [ "$(cat logs/pipeline.rc 2>/dev/null)" = 0 ] && return 0
  echo "=== session start pid $$" | stamp
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
  echo "$code" > logs/pipeline.rc
  return "$code"
}

# The first run's outputs in a variant's folder: the folders of data/ and models/ as hard links (the stages write
# their outputs whole and atomically, never into a file), the files (data/params.ok) and metrics as copies, its
# dvc.lock.
link_outputs() {
  local from=$1 to=$2 entry
  for entry in "$from"/data/* "$from"/models; do
    case "$(basename "$entry")" in sources) ;; *) if [ -d "$entry" ]; then cp -al "$entry" "$to/${entry#"$from"/}"
                                                     else cp -a "$entry" "$to/${entry#"$from"/}"; fi ;; esac
  done
  cp -a "$from/metrics" "$from/dvclive" "$from/dvc.lock" "$to/"
}

# The peer's rate on the first run's data, once (RUN/logs/peer_tau.done), if the fresh run folder asked for it.
peer_rate() {
  [ -f logs/peer_rate.wanted ] && [ ! -f logs/peer_tau.done ] || return 0
  echo "=== peer rate: benchmarks/peer_tau.py --rate-only (logs/peer_tau.log)" | stamp
  if PYTHONPATH="$PWD/src:$PWD/tools/benchmarks:${PYTHONPATH:-}:/root/peer-site" python3 tools/benchmarks/peer_tau.py --run "$PWD" \
      --work "$PWD/peer" --json logs/peer_tau.json --ours models/drafter --rate-only --rate-steps "$(cat logs/peer_rate.wanted)" \
      --commit "$(cat logs/commit.txt 2>/dev/null)" --peer-flags "--loss-implementation eager" > logs/peer_tau.log 2>&1; then
    touch logs/peer_tau.done && echo "=== peer rate: done" | stamp
    rm -rf peer  # its copy of the hidden states in the peer's format (as big as ours): the variants need the disk
  else
    echo "=== peer rate: failed (logs/peer_tau.log)" | stamp
  fi
}

if [ "${1:-}" = --job ]; then  # the detached job itself (below: `setsid ... "$0" --job RUN PROMPTS`)
  run=$2 prompts=$3
  cd "$run"
  python3 "$here/gpu_sampler.py" logs/gpu.tsv --every "${SAMPLE_EVERY:-0.2}" &
  sampler=$!
  trap 'kill "$sampler" 2>/dev/null || true' EXIT
  set +e
  pipeline "$prompts"
  code=$?
  [ "$code" = 0 ] && peer_rate
  while [ "$code" = 0 ] && [ -f logs/variants.hold ]; do sleep 5; done
  for variant in variants/*/; do
    [ "$code" = 0 ] && [ -d "$variant" ] || break
    if [ -f "$variant/logs/linked" ]; then
      [ -f "$variant/dvc.lock" ] || link_outputs "$run" "$variant"
      (cd "$variant" && pipeline "")
    else  # a repeat from nothing: its compile caches (torch.compile's, Triton's) empty too, as on a new host
      (cd "$variant" && TORCHINDUCTOR_CACHE_DIR=$PWD/compile-cache/inductor TRITON_CACHE_DIR=$PWD/compile-cache/triton \
        pipeline "$prompts")
    fi
    code=$?
  done
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
# A run folder DIR from this repository's files and params composed from OVERRIDES ($2), its DVC cache at
# CACHE ($3; default its own).
prepare() {
  local dir=$1 overrides=$2 cache=${3:-}
  mkdir -p "$dir/logs" "$dir/data"
  cp -r "$repo/dvc.yaml" "$repo/conf" "$repo/src" "$dir/"
  cp -r "$repo/data/sources" "$dir/data/"
  [ -f "$repo/.dvcignore" ] && cp "$repo/.dvcignore" "$dir/"
  find "$dir/src" -name __pycache__ -prune -exec rm -rf {} +
  # shellcheck disable=SC2086  # the overrides, split as words
  (cd "$dir" && python -m eagle3.cli params $overrides)
  (cd "$dir" && python -m dvc init --no-scm -q && python -m dvc config cache.type hardlink \
    && python -m dvc config core.analytics false && { [ -z "$cache" ] || python -m dvc config cache.dir "$cache"; })
  if [ -n "$cache" ]; then
    touch "$dir/logs/linked"
    echo "eagle3 params $overrides; dvc init --no-scm; the first run's outputs and cache; dvc repro" > "$dir/logs/command.txt"
  else
    echo "eagle3 params $overrides; dvc init --no-scm; dvc repro verifier;${prompts:+ prompts carried, dvc commit -f prompts;} dvc repro" \
      > "$dir/logs/command.txt"  # the report's "command"
  fi
  [ -z "${COMMIT:-}" ] || echo "$COMMIT" > "$dir/logs/commit.txt"
}

dataset_of() { python3 -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["dataset"])' "$1"; }

if [ ! -d "$run/.dvc" ]; then  # a fresh run folder
  overrides=${OVERRIDES:--S dataset=10k -S layout=gpu1}
  COMMIT=${COMMIT:-$(cat "$(dirname "${prompts:-.}")/commit.txt" 2>/dev/null || true)}  # the kit's (kit.sh)
  prepare "$run" "$overrides"
  # the job runs from its own copy: a device call re-copies the repository while the job runs
  mkdir -p "$run/tools/benchmarks" && cp "$here/pipeline_run.sh" "$here/stamp.py" "$here/gpu_sampler.py" "$run/tools/"
  cp "$here"/../*.py "$run/tools/benchmarks/" && cp -r "$here" "$run/tools/benchmarks/offline"  # peer_tau.py and its imports
  [ -z "${HOLD_VARIANTS:-}" ] || [ -z "${VARIANTS:-}" ] || touch "$run/logs/variants.hold"  # no variants: nothing to hold
  [ -z "${PEER_RATE:-}" ] || echo "${PEER_STEPS:-1000}" > "$run/logs/peer_rate.wanted"
  if [ -n "$prompts" ]; then
    tar -xzf "$prompts" -O params.yaml | cmp -s - "$run/params.yaml" \
      || { echo "error: $prompts holds another params.yaml than $run/params.yaml: compose both with the same OVERRIDES"; exit 2; }
  fi
  n=0
  IFS='|' read -ra variants <<< "${VARIANTS:-}"
  for variant in "${variants[@]}"; do
    n=$((n + 1)) dir=$run/variants/$n cache=$run/.dvc/cache
    case "$variant" in fresh*) variant=${variant#fresh} cache= ;; esac
    prepare "$dir" "$overrides $variant" "$cache"
    ln -s ../../../logs/gpu.tsv "$dir/logs/gpu.tsv"  # the job's one sampler
    [ "$(dataset_of "$dir/params.yaml")" = "$(dataset_of "$run/params.yaml")" ] \
      || { echo "error: VARIANTS entry $n ($variant) changes dataset: the carried prompts are the first run's"; rm -rf "$run/variants" "$run/.dvc"; exit 2; }
  done
fi
cd "$run"
rm -f logs/job.rc
setsid nohup bash "$run/tools/pipeline_run.sh" --job "$run" "$prompts" > logs/job.out 2>&1 < /dev/null &
echo $! > logs/job.pid
echo "started: job $! in $run (logs in $run/logs; python3 benchmarks/pipeline_report.py $run --poll)"
