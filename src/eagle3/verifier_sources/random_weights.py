"""Source kind ``random``: random weights of a given shape with a real tokenizer, for tests and
benchmarks where only shapes matter (e.g. a Llama-3.1-8B-shaped verifier)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from eagle3.common import UserError, read_json, to_plain, write_json
from eagle3.lm.loading import torch_dtype
from eagle3.lm.spec import LanguageModel


def build_random(source: DictConfig, out: Path, trust_remote_code: bool = False, lm: LanguageModel = LanguageModel()) -> None:
    """Random weights of ``source.config``'s shape with the tokenizer of ``source.tokenizer``.

    With a nested ``lm``, ``source.config`` is the wrapper's config: the text model is built from its
    ``lm.config`` section and saved under ``lm.prefix`` beside that config, as a multimodal checkpoint is.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer_dir = tokenizer_folder(source)
    wrapper = to_plain(source.config)
    text = dict(wrapper[lm.config]) if lm.config else dict(wrapper)
    if lm.model_type:
        text["model_type"] = lm.model_type
    torch.manual_seed(int(source.get("seed", 0)))
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**text), dtype=torch_dtype(source.dtype))
    model.save_pretrained(out)
    if lm.nested:
        nest_checkpoint(out, wrapper, lm)
    AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code).save_pretrained(out)


def tokenizer_folder(source: DictConfig) -> Path:
    """The folder ``model.source.tokenizer`` names, refused when it is not one."""
    folder = Path(str(source.tokenizer))
    if not folder.is_dir():
        raise UserError(f"model.source.tokenizer: {folder} is not an HF folder with a tokenizer")
    return folder


def random_identity(source: DictConfig) -> dict[str, Any]:
    """The random source by its recipe: shape, seed and dtype; the tokenizer enters the identity by its
    fingerprint, not by the path of the folder it was copied from."""
    return {key: value for key, value in to_plain(source).items() if key != "tokenizer"}


def nest_checkpoint(folder: Path, wrapper: dict[str, Any], lm: LanguageModel) -> None:
    """Turn a saved text model in ``folder`` into the wrapper ``lm`` describes: names under ``lm.prefix``,
    its config under ``wrapper[lm.config]`` (keeping the wrapper's own model type for it)."""
    from safetensors.torch import load_file, save_file

    for file in sorted(folder.glob("*.safetensors")):
        tensors = load_file(file)
        save_file({lm.prefix + name: tensor for name, tensor in tensors.items()}, file, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        content = read_json(index)
        content["weight_map"] = {lm.prefix + name: part for name, part in content["weight_map"].items()}
        write_json(index, content)
    text = read_json(folder / "config.json")
    if lm.config:
        text["model_type"] = wrapper[lm.config].get("model_type", text["model_type"])
        text = {**wrapper, lm.config: text}
    write_json(folder / "config.json", text)
