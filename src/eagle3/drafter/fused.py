"""``fused_when_training_on_gpu``: the decorator that compiles the drafter's elementwise chains.

    @fused_when_training_on_gpu
    def swiglu(gate: Tensor, up: Tensor) -> Tensor: ...

Why a module of its own: the norms and SwiGLU (``model.py``), RoPE (``rope.py``), the chain merge
(``attention.py``) and the soft cross-entropy (``loss.py``) all use it, and none of them should
import another only for this.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def fused_when_training_on_gpu(fn):
    """``fn`` compiled into generated kernels (torch.compile) when it runs with gradients on a GPU.

    Why: norms, RoPE, SwiGLU, the chain merge and the soft CE are chains of elementwise ops over
    [B·T, H]- and [N, Vd]-sized tensors; run op by op, each one is a round trip through GPU memory,
    about a quarter of an 8B-shaped training step. Fused, forward and backward each read and write
    them once. Decoding (no gradients) and CPUs keep the eager ops: decoding's few rows are
    launch-bound and would recompile for every new length, and compiling on a CPU costs more than
    the demo's whole training saves. The first call of a new shape compiles (dynamic after that).
    Inside a step that is compiled as a whole (``train.compile``), ``fn`` is traced as it is, into
    the step's own kernels.
    """
    compiled = None

    @functools.wraps(fn)
    def call(x: Tensor, *args):
        nonlocal compiled
        if torch.compiler.is_compiling() or not (x.is_cuda and torch.is_grad_enabled()):
            return fn(x, *args)
        if compiled is None:
            compiled = torch.compile(fn, fullgraph=True)
        return compiled(x, *args)

    call.eager = fn  # what the fused kernels must compute (tests compare the two)
    return call
