#!/usr/bin/env bash
# The GPU measurements the docs wait for, one after the other, each skipped once its JSON exists (rerun
# to resume), run in a run folder made for dataset=10k (params.yaml and data/prompts; models/verifier is
# imported first where missing: see docs/benchmarks.md "On a GPU host with no package registry"):
#
#   1. decode_attention.py: one layer's decode attention by kernel (split, flash's varlen, masked);
#   2. generate_throughput.py on the 968-prompt shard, answers up to 2,048 tokens, 1,024 slots: the local
#      backend as it is (the split kernel) and with flash's varlen kernel, the eager path, greedy ties;
#   3. recipe_sweep.py: our trainer at the peer trainer's rows and epochs on the 10k data (RECIPES), with
#      the CUDA tests of tests/test_slots.py beside it (their log: RES/logs/cuda-tests.log).
#
#   COMMIT=<sha> PYTHONPATH=src:/root/site bash benchmarks/offline/gpu_measurements.sh /root/run /root/res   # COMMIT: no .git there
#   SMOKE=1 bash benchmarks/offline/gpu_measurements.sh RUN RES     # the CPU: tiny counts, 2 training steps
set -uo pipefail
run=$1 res=$2
repo=$(cd "$(dirname "$0")/../.." && pwd)
commit=${COMMIT:-$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)}
RECIPES=${RECIPES:-"b8k-lr1e-3-e21-pack_tokens8192-micro_batch_rows1-ttt_steps3-step_decay1.0-datashort
b8k-lr1e-3-e21-pack_tokens8192-micro_batch_rows1-optimizermuon-freeze_lm_headTrue-ttt_steps3-step_decay1.0-weight_decay0.1-min_lr_ratio0.0-datashort"}
for need in params.yaml data/prompts; do
  [ -e "$run/$need" ] || { echo "error: $run/$need not found: a run folder holds params.yaml and data/prompts (eagle3 params -S ..., then the prompts stage)"; exit 2; }
done
mkdir -p "$res/logs"
failed=()
export PYTHONUNBUFFERED=1
if [ -n "${SMOKE:-}" ]; then
  generate=(--device cpu --count 6 --slow-count 6 --max-new-tokens 8 --slow-max-new-tokens 8 --batch-size 4
            --varlen-batch-size 6 --threads 1 --budget-s 600)
  sweep=(--device cpu --parallel 1 --threads 1 --set train.max_steps=2 train.lm_head_init=verifier evaluate.max_prompts=1)
  shard=000000-000032
else
  generate=(--device cuda --count 1000 --max-new-tokens 2048 --batch-size 1024 --varlen-batch-size 1024
            --modes after after_varlen before ties --budget-s 420)
  sweep=(--device cuda --parallel 2 --shards-at-once 3)
  shard=000032-001000
fi
step() {  # name json command...: unless json exists, the command (its --json: json.partial), json once it exits 0
  local name=$1 json=$2; shift 2
  if [ -f "$json" ]; then echo "=== $name: $json exists, skipped"; return; fi
  echo "=== $name $(date +%T)"
  "$@" --json "$json.partial" > "$res/logs/$name.log" 2>&1
  local code=$?
  echo "=== $name exit $code $(date +%T)"; tail -n 12 "$res/logs/$name.log"
  if [ "$code" = 0 ] && [ -f "$json.partial" ]; then mv "$json.partial" "$json"; else failed+=("$name"); fi
}
if [ ! -f "$run/models/verifier/meta.json" ]; then  # the verifier stage where it was not run yet (its import differs by host)
  (cd "$run" && python -m eagle3.verifier models/verifier > "$res/logs/verifier.log" 2>&1) || { tail -n 20 "$res/logs/verifier.log"; exit 1; }
fi
if [ -z "${SMOKE:-}" ]; then
  step kernels "$res/decode_attention.json" python "$repo/benchmarks/decode_attention.py"
fi
step generate "$res/generate_throughput.json" python "$repo/benchmarks/generate_throughput.py" --verifier "$run/models/verifier" \
  --prompts "$run/data/prompts/shards/$shard.jsonl" --commit "$commit" "${generate[@]}"
if [ -z "${SMOKE:-}" ]; then  # beside the sweep: tiny models, no timing
  (cd "$repo" && python -m pytest -q -p no:cacheprovider tests/test_slots.py > "$res/logs/cuda-tests.log" 2>&1 &)
fi
cd "$run"
# shellcheck disable=SC2086  # RECIPES: one name a line
step recipes "$res/recipes_10k.json" python "$repo/benchmarks/recipe_sweep.py" --params params.yaml --work "$res/sweep" \
  --commit "$commit" --only $RECIPES "${sweep[@]}"
if [ ${#failed[@]} -gt 0 ]; then echo "=== all done, failed: ${failed[*]} (logs in $res/logs; rerun to retry) $(date +%T)"; exit 1; fi
echo "=== all done $(date +%T)"
