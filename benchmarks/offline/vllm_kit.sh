#!/usr/bin/env bash
# vLLM for the offline GPU host (python 3.12, x86-64, torch 2.11.0 and transformers 5.17.0 installed, no package
# registry), beside the pipeline's kit (benchmarks/offline/kit.sh), in parts that each travel in one call (an upload
# limit of 64 MiB a call, the repository's tracked files included):
#
#   benchmarks/offline/vllm_kit.sh KIT HOST_PACKAGES [PART_MB]   # here: python3.12 and PyPI needed
#   bash benchmarks/offline/vllm_install.sh KIT/part1            # there, one call per part, in any order
#
# vLLM 0.26.0 is the release pinned to the host's torch 2.11.0 (later ones pin torch 2.13+). Its requirements are
# resolved by pip in a python3.12 venv where the host's packages that vLLM pins against are present as metadata
# stubs at the host's versions (so pip keeps them instead of choosing its own), as PyPI stood on SNAPSHOT (the same
# wheels on every run); benchmarks/offline/wheels.py then takes the resolution minus every package the host has
# (HOST_PACKAGES: the "Packages:" line of the device's KINDS.md) and minus the optional kernel packages in `leave`.
# vLLM's wheel is stripped of what a Hopper host never loads: FlashAttention-2's kernels (Hopper runs FA3), the
# vllm-rs binary, DeepGEMM's and the SM100 FMHA's sources (benchmarks/offline/strip_wheel.py); every wheel is stored
# uncompressed so that xz compresses the raw files. They travel as one tar.xz cut into pieces of PART_MB (default 58)
# MB, KIT/part1, KIT/part2, ..., each with the whole file's sha256 and the number of pieces, so the install knows when
# it has them all (benchmarks/offline/pack_parts.sh).
set -euo pipefail
kit=$1 have=$2 part_mb=${3:-58}
here=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}  # PYTHON: another checkout's environment (a worktree has none)
python312=${PYTHON312:-python3.12}        # the host's Python version, for the resolution
snapshot=${SNAPSHOT:-2026-12-07T00:00:00Z}
# The host's versions (its pip list). numba and llvmlite: the host's are unread; stubbed at vLLM's pins (numba==0.65.0
# and what it needs), and carried never: the install's import check prints the host's. numpy: mistral-common asks for
# < 2.4, the host's 2.5.2 stays (vLLM imports with it).
host_stubs=(torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0 triton==3.6.0 transformers==5.17.0 tokenizers==0.23.2
            safetensors==0.8.0 huggingface-hub==1.33.0 numpy==2.5.2 numba==0.65.0 llvmlite==0.47.0)
# xgrammar: a newer release than 0.2.7 fails to import with vLLM 0.26.0's pin of apache-tvm-ffi
roots=(vllm==0.26.0 xgrammar==0.2.7 apache-tvm-ffi==0.1.10)
strip=(vllm/vllm_flash_attn/_vllm_fa2_C vllm/vllm-rs vllm/third_party/deep_gemm/ vllm/third_party/fmha_sm100/)
# Requirements vLLM imports only inside the functions that use them (flashinfer's attention, CUTLASS DSL and QuACK
# kernels for Blackwell and MoE, TileLang and TokenSpeed's MLA, video decoding) or behind has_humming(): a Llama
# verifier with its EAGLE-3 drafter on Hopper runs without them, 400 MB of wheels (with nvcc, humming's cu13 extra)
leave=(flashinfer-python nvidia-cutlass-dsl quack-kernels tilelang tokenspeed-mla pynvvideocodec torchcodec humming-kernels)

venv=$kit/resolve
rm -rf "$venv" "$kit/wheels"
"$python312" -m venv "$venv"
"$venv/bin/python" -m pip install -q pip==26.3  # --uploaded-prior-to needs pip 26
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for pin in "${host_stubs[@]}"; do
  name=${pin%%==*} version=${pin##*==}
  mkdir -p "$site/${name//-/_}-$version.dist-info"
  printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$name" "$version" > "$site/${name//-/_}-$version.dist-info/METADATA"
  : > "$site/${name//-/_}-$version.dist-info/RECORD"
done
"$venv/bin/python" -m pip install -q --dry-run --only-binary=:all: --uploaded-prior-to "$snapshot" \
  --report "$kit/report.json" "${roots[@]}"
"$python" "$here/benchmarks/offline/wheels.py" --report "$kit/report.json" --have "$have" vllm --leave "${leave[@]}" \
  > "$kit/need.txt"
"$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: -d "$kit/wheels" -r "$kit/need.txt"
"$python" "$here/benchmarks/offline/strip_wheel.py" "$kit"/wheels/*.whl --drop "${strip[@]}" --stored
echo "$(wc -l < "$kit/need.txt") wheels, $(du -sb "$kit/wheels" | awk '{printf "%.0f MB", $1 / 1e6}') unpacked"
bash "$here/benchmarks/offline/pack_parts.sh" "$kit" wheels "${part_mb}MB"
