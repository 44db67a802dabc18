#!/usr/bin/env bash
# Fill a run folder the way dvc.yaml lays it out, without DVC (a host where the stages run bare): RUN holds
# params.yaml and data/prompts (composed elsewhere: `eagle3 params -S ...`, then the prompts stage); this
# runs the stages' own commands in it: verifier, then generate and extract of each shard (AT_ONCE shards
# side by side: a small verifier leaves most of a GPU idle), then merge. Logs in RUN/logs.
# Shards side by side share the GPU's memory: compose the params with -S backend.cache_memory=<0.8 / AT_ONCE>
# where the slot caches are big (long answers; each process sizes its cache from the memory free when it starts).
#
#   PYTHONPATH=src:/root/site bash benchmarks/offline/run_folder.sh /root/run 3
#
# benchmarks/peer_tau.py --run RUN reads the result.
set -euo pipefail
run=$1 at_once=${2:-1}
cd "$run"
mkdir -p logs
python -m eagle3.verifier models/verifier > logs/verifier.log 2>&1 || { tail -20 logs/verifier.log; exit 1; }
python -c "import yaml; print('\n'.join(yaml.safe_load(open('params.yaml'))['dataset']['shards']))" | xargs -P "$at_once" -I{} sh -c \
  'python -m eagle3.generate models/verifier data/prompts/shards/{}.jsonl data/generated/{} --metrics metrics/generate/{}.json > logs/generate-{}.log 2>&1 &&
   python -m eagle3.extract models/verifier data/generated/{} data/hidden_states/{} > logs/extract-{}.log 2>&1 || { echo "shard {}: failed, logs/*-{}.log"; exit 255; }'
python -m eagle3.merge models/verifier data/hidden_states data/merged metrics/merge > logs/merge.log 2>&1 || { tail -20 logs/merge.log; exit 1; }
tail -1 logs/merge.log
