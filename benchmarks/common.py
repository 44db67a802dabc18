"""What the benchmarks record alike: the commit measured, the software and GPU it ran on, and random-weights
verifier folders (a load or a decode costs what the shape costs, so no checkpoint is needed).

    from common import commit, environment, random_verifier
    from shapes import VERIFIER_SHAPES
    folder = random_verifier(VERIFIER_SHAPES["tiny"], Path(tmp) / "verifier")   # its own word-level tokenizer

The benchmarks are scripts, not a package: each runs with this folder first on ``sys.path``, and importing
this module puts this checkout's ``src`` before an installed eagle3 (a benchmark measures the tree it is in).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))


def child_env() -> dict[str, str]:
    """This environment for a Python the benchmark starts: this checkout's ``src`` first, as here, then PYTHONPATH's
    folders made absolute (a child that runs from another folder found nothing on the relative ``PYTHONPATH=src:...``
    the docstrings give: generate_vllm.py's stage, "No module named 'eagle3'" on an H100)."""
    folders = [str(Path(folder).resolve()) for folder in os.environ.get("PYTHONPATH", "").split(os.pathsep) if folder]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys([str(ROOT / "src"), *folders]))}


def commit() -> str | None:
    """``EAGLE3_COMMIT`` where set, else this checkout's commit (with ``-dirty`` when a tracked file has changed); None
    outside a git checkout (a copy of the tree on a GPU host: the benchmarks that run there take ``--commit``). Why the
    variable: a lease's copy of the tree can carry the git metadata of an older commit (on 2026-12-05 it read the
    session's first commit, "-dirty"), so a call names the commit it sends: ``EAGLE3_COMMIT=<sha> python ...``."""
    if os.environ.get("EAGLE3_COMMIT"):
        return os.environ["EAGLE3_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty.strip() else "")


def versions() -> dict[str, str]:
    """The Python, torch and transformers a measurement ran on."""
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def gpu_name(device: str) -> str | None:
    """The GPU's name where ``device`` is a CUDA device that is there; None on the CPU."""
    import torch

    return torch.cuda.get_device_name(device) if device.startswith("cuda") and torch.cuda.is_available() else None


def environment(device: str) -> dict:
    """``versions()`` and the GPU (``gpu``: None on the CPU)."""
    return {**versions(), "gpu": gpu_name(device)}


def random_verifier(config: dict, folder: Path, device: str = "cpu", tokenizer: Path | None = None, lm=None,
                    name: str = "random") -> Path:
    """A verifier folder of ``config``'s shape (transformers config keys, ``model_type`` among them) with random
    bf16 weights, built by the ``verifier`` stage's random source on ``device`` (an 8B init is minutes on a
    CPU, seconds on a GPU), and a meta.json as ``load_verifier`` reads it.

    ``tokenizer``: a folder whose tokenizer it copies (where prompts are rendered by a chat template); None:
    a word-level tokenizer over the ids (``<i>``), which is all decoding asks of it when prompts are token ids.
    ``lm``: an ``eagle3.lm.spec.LanguageModel`` for a nested (multimodal-style) checkpoint.
    """
    import torch
    from omegaconf import OmegaConf

    from eagle3.common import write_json
    from eagle3.lm.spec import LanguageModel
    from eagle3.verifier_sources.random_weights import build_random

    lm = lm or LanguageModel()
    with tempfile.TemporaryDirectory() as scratch:
        source = OmegaConf.create({"tokenizer": str(tokenizer or word_tokenizer(config, Path(scratch))), "config": config,
                                   "dtype": "bfloat16", "seed": 0})
        with torch.device(device):
            build_random(source, folder, lm=lm)
    meta = {"name": name, "weights_path": "."}  # no fingerprint: not a stage output
    write_json(folder / "meta.json", {**meta, "language_model": asdict(lm)} if lm.nested else meta)
    return folder


def word_tokenizer(config: dict, folder: Path) -> Path:
    """A tokenizer folder mapping ``<i>`` to id i for every id of ``config``'s vocabulary, its eos and pad ids'."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(config["vocab_size"])}
    eos, pad = config.get("eos_token_id", 0), config.get("pad_token_id", config.get("eos_token_id", 0))
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<0>")), eos_token=f"<{eos}>",
                            pad_token=f"<{pad}>").save_pretrained(folder)
    return folder
