"""The tiny verifiers the tests build: the tiny random Llama's shape, its ``model`` params, a base-model chat template, the cached imports."""

from __future__ import annotations

import shutil
from pathlib import Path

from filelock import FileLock
from omegaconf import OmegaConf

from eagle3.common import UserError
from eagle3.lm.loading import read_meta
from eagle3.verifier import PARAMS, import_verifier
from support.repo import CACHE, project_params

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


def verifier_model(**keys):
    """The ``model`` keys the verifier stage declares, at their committed values, ``keys`` replacing whole values."""
    committed = project_params()
    model = OmegaConf.create({key.removeprefix("model."): OmegaConf.select(committed, key) for key in PARAMS})
    for key, value in keys.items():
        model[key] = value
    return model


def tiny_model_spec():
    """The descriptive keys of a ``model`` section, for the tiny verifier."""
    spec = project_params().model.copy()
    spec.name = "tiny-random"
    spec.num_layers = TINY_LLAMA["num_hidden_layers"]
    spec.aux_layers = [1, 2, 3]
    spec.max_position_embeddings = TINY_LLAMA["max_position_embeddings"]
    return spec


def cached_import(name: str, model_cfg) -> Path:
    """The verifier ``model_cfg`` imported into ``CACHE/name``, reused while its meta.json reads; one
    pytest-xdist worker imports it while the others wait."""
    target = CACHE / name
    with cache_lock(name):
        if (target / "meta.json").is_file():
            try:
                read_meta(target)
                return target
            except UserError:
                shutil.rmtree(target)
        import_verifier(model_cfg, target)
    return target


def cache_lock(name: str) -> FileLock:
    """A lock on ``CACHE/name`` across test processes."""
    CACHE.mkdir(parents=True, exist_ok=True)
    return FileLock(CACHE / f"{name}.lock")


# A chat template for a base model: BOS, plain-text turns, and an end-of-turn marker after every
# answer that is also the stop string generation ends on (README: Your own verifier).
BASE_END_OF_TURN = "<|endoftext|>"
BASE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}Assistant: {{ m.content }}"
    + BASE_END_OF_TURN + "\n{% else %}{{ m.role | capitalize }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)
