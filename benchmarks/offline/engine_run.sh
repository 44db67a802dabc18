#!/usr/bin/env bash
# vLLM's measurements of a run, started with it and detached, so that a lease needs no call between them: once
# benchmarks/offline/pipeline_run.sh's first run has succeeded (RUN/logs/pipeline.rc is 0), in its own session,
#   1. benchmarks/generate_vllm.py: generate's openai backend against `vllm serve` on the 968-prompt shard, its
#      throughput timed (the GPU alone: the variants wait);
#   2. benchmarks/serve_vllm.py on RUN at K = 7, timed at 1, 16 and 64 requests (the GPU alone); SERVE_TIMED=0 skips
#      it, where a lease has no time for it;
#   3. RUN/logs/variants.hold removed (pipeline_run.sh's HOLD_VARIANTS=1): the variants start;
#   4. serve_vllm.py at K = 3, 5 and 7, acceptance only (nothing timed, so sharing the GPU with the variants changes
#      none of its figures; K = 7 is skipped where step 2 measured it).
# AFTER_VARIANTS=1: the steps wait for pipeline_run.sh's whole job instead (RUN/logs/job.rc), the variants first, where
# a lease has time for only one of them after the run.
# Each step's output in RES/logs/<step>.log, the results in RES/serve_vllm_<dataset>.json and RES/generate_vllm_openai.json;
# RES/logs/engine.rc once all have run (a step that fails is logged and the next goes on). Run it again to resume:
# serve_vllm.py skips what its JSON holds, generate_vllm.py runs where its JSON is missing.
#
#   HOLD_VARIANTS=1 ... bash benchmarks/offline/pipeline_run.sh /root/run /root/kit/prompts.tar.gz
#   COMMIT=<sha> PYTHONPATH=/root/vllm-site:/root/site bash benchmarks/offline/engine_run.sh /root/run /root/res
#
# The scripts run from a copy of src/, benchmarks/ and conf/ in RES/code: a device call copies the repository anew
# while they run. PYTHON: the interpreter (default python3).
set -uo pipefail
if [ "${1:-}" = --job ]; then
  run=$2 res=$3
  cd "$res/code"
  export PYTHONPATH=$res/code/src:$res/code/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  python=${PYTHON:-python3} commit=$(cat "$res/logs/commit.txt")
  step() { local name=$1; shift; echo "=== $name: $*"; "$python" "$@" > "$res/logs/$name.log" 2>&1 || echo "=== $name failed: $res/logs/$name.log"; }
  ready=$run/logs/pipeline.rc
  [ "${AFTER_VARIANTS:-0}" = 0 ] || ready=$run/logs/job.rc
  until [ -f "$ready" ]; do sleep 5; done
  [ "$(cat "$run/logs/pipeline.rc")" = 0 ] || { echo "=== the run failed: nothing to serve"; echo 1 > "$res/logs/engine.rc"; exit 1; }
  serve=$res/serve_vllm_$(python3 -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["dataset"]["name"])' "$run/params.yaml").json
  [ -f "$res/generate_vllm_openai.json" ] || step generate benchmarks/generate_vllm.py "$run" --out "$res/generate_vllm_openai.json" --commit "$commit"
  [ "${SERVE_TIMED:-1}" = 0 ] || step serve_k7 benchmarks/serve_vllm.py "$run" --out "$serve" --commit "$commit" --ks 7
  rm -f "$run/logs/variants.hold"
  step serve_acceptance benchmarks/serve_vllm.py "$run" --out "$serve" --commit "$commit" --ks 3 5 7 --concurrency
  echo 0 > "$res/logs/engine.rc"
  exit 0
fi
run=$(cd "$1" && pwd) res=$2
repo=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$res/logs" && res=$(cd "$res" && pwd)
rm -rf "$res/code" && mkdir "$res/code" && cp -r "$repo/src" "$repo/benchmarks" "$repo/conf" "$res/code/"
echo "${COMMIT:-$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)}" > "$res/logs/commit.txt"
rm -f "$res/logs/engine.rc"
setsid nohup bash "$res/code/benchmarks/offline/engine_run.sh" --job "$run" "$res" > "$res/logs/engine.out" 2>&1 < /dev/null &
echo "started: job $! (its steps in $res/logs/engine.out)"
