#!/usr/bin/env bash
# The prompts of one composition, packed to travel: OUT.tar.gz holds params.yaml, data/prompts and
# metrics/prompts.json, made here (the prompts stage reads the evals package) by the verifier and prompts
# stages in a throwaway run folder; benchmarks/offline/pipeline_run.sh records them in its run folder.
#
#   PYTHON=.venv/bin/python bash benchmarks/offline/prompts_tar.sh OUT.tar.gz -S dataset=10k -S layout=gpu1
set -euo pipefail
out=$(cd "$(dirname "$1")" && pwd)/$(basename "$1"); shift
here=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
mkdir -p "$run/data" && cp -r "$here/conf" "$run/" && cp -r "$here/data/sources" "$run/data/"
cd "$run"
export PYTHONPATH=$here/src
"$python" -m eagle3.cli params "$@" > /dev/null
{ "$python" -m eagle3.verifier models/verifier && "$python" -m eagle3.prompts models/verifier data/prompts \
    --metrics metrics/prompts.json --sources data/sources; } > stages.log 2>&1 || { tail -n 20 stages.log; exit 1; }
tar -czf "$out" params.yaml data/prompts metrics/prompts.json
echo "$out: $(du -k "$out" | cut -f1) KiB, $(cat data/prompts/shards/*.jsonl | wc -l) training prompts"
