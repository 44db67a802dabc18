"""eagle3: EAGLE-3 draft-model training as a declarative, versioned DVC pipeline.

Each dvc.yaml stage is one top-level module of this package run as ``python -m eagle3.<stage>``;
``common`` and ``settings`` hold what every stage shares (errors, atomic outputs, JSONL; its params), ``runner`` how
its command runs (docs/layout.md), ``config`` the composition of params (the params stage's).
The library the stages share is grouped by concern: ``lm`` (the verifier as a language model:
loading its folder, its family's spec, chat rendering), ``verifier_sources`` and
``prompt_sources`` (what the verifier and prompts stages read), ``backends`` (generation),
``hidden_states`` (capture, the on-disk format and the training loader), ``drafter`` (the model
and its export), ``training`` (loss, data plan, step, checkpoints, parallelism), ``decoding``
(speculative decoding and what evaluate times and counts) and ``lifecycle`` (DVC cache gc, the S3
remote).
"""

import os
import platform

__version__ = "0.1.0"

# CPU outputs byte-identical across x86 machines: torch picks its vectorised CPU kernels by what the CPU offers
# (AVX-512 on one host, AVX2 on another), and their float rounding differs (the demo's extract wrote other bytes on
# an AVX-512 host than on the AVX2 hosts before it). Set before any stage imports torch; a value the user set is kept.
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
