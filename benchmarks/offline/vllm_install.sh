#!/usr/bin/env bash
# On the offline host: the vLLM kit (benchmarks/offline/vllm_kit.sh), one part a call, in any order:
#
#   bash benchmarks/offline/vllm_install.sh KIT/part1   # and so on; the call that brings the last piece installs
#
# Each part's piece is kept in /root/vkit. Once all are there and the joined file has the kit's sha256, the wheels
# are installed into /root/vllm-site (pip --target: nothing is written into the host's Python; a failed install
# leaves no /root/vllm-site), the one import the host's transformers breaks is guarded, and vLLM is imported with
# the versions it runs on printed: that check runs on every call once installed. Use vLLM with
#   PYTHONPATH=/root/vllm-site:/root/site   (its packages first; the project's kit after, for dvc and hydra)
set -euo pipefail
part=$1 store=${VLLM_STORE:-/root/vkit} site=${VLLM_SITE:-/root/vllm-site}  # the variables: elsewhere (the tests)
mkdir -p "$store"
cp "$part"/vllm.tar.xz.[0-9] "$part"/vllm.sha256 "$part"/pieces.txt "$store"/
pieces=$(cat "$store/pieces.txt") here=$(find "$store" -name 'vllm.tar.xz.[0-9]' | wc -l)
if [ "$here" -lt "$pieces" ]; then
  echo "vLLM kit: $here of $pieces pieces in $store; bring the others"
  exit 0
fi
if ! [ -d "$site" ]; then
  if [ "$(cat "$store"/vllm.tar.xz.[0-9] | sha256sum | cut -d' ' -f1)" != "$(cat "$store/vllm.sha256")" ]; then
    echo "error: $store: the pieces do not join into the kit's file (sha256 differs): bring each part of one kit again" >&2
    exit 1
  fi
  rm -rf "$store/wheels" "$site.partial"
  cat "$store"/vllm.tar.xz.[0-9] | xz -d -T0 | tar -x -C "$store"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site.partial" "$store"/wheels/*.whl
  # transformers 5.17 fails to import MistralCommonBackend, which this module imports at its top only for an
  # isinstance check: with the guard no tokenizer is one (the project serves no Mistral tokenizer)
  guarded=$site.partial/vllm/v1/structured_output/backend_guidance.py
  import='from transformers import MistralCommonBackend'
  guard="try:\n    $import\nexcept ImportError:  # the host's transformers (eagle3: vllm_install.sh)\n"
  guard+='    MistralCommonBackend = type("MistralCommonBackend", (), {})'
  if ! grep -qx "$import" "$guarded"; then
    echo "error: $guarded: no line '$import' to guard; check the guard against this vLLM" >&2
    exit 1
  fi
  sed -i "s/^$import\$/$guard/" "$guarded"
  # bytecode compiled now, in parallel, rather than by the first import of a timed run
  python3 -m compileall -q -j 0 "$site.partial" > /dev/null || echo "compileall: some files did not compile (as pip skips them)"
  mv "$site.partial" "$site"
  rm -rf "$store/wheels"
fi
PYTHONPATH=$site python3 -c '
import importlib.metadata as m, time
started = time.perf_counter()
import vllm
print(f"import vllm: {time.perf_counter() - started:.0f} s, from {vllm.__file__}")
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "absent"
print(", ".join(f"{name} {version(name)}" for name in ("vllm", "torch", "transformers", "xgrammar", "numpy", "numba", "llvmlite", "triton")))
'
