"""Source kind ``hf``: a hub id or a local HF folder, checked to hold a causal LM before any weights load.

With ``model.copy_weights: false`` only the small files are copied and the weights stay where they
are (hundreds of GB never enter the DVC cache).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from eagle3.common import UserError, sha256_file
from eagle3.lm.loading import EMBEDDING, WEIGHT_SUFFIXES, checkpoint_names, text_config_dict, torch_dtype
from eagle3.lm.spec import LanguageModel

SMALL_FILE_LIMIT = 64 << 20  # config/tokenizer files are hashed whole; weights are sampled when referenced


def require_causal_lm(path_or_id: str, trust_remote_code: bool, lm: LanguageModel = LanguageModel()) -> None:
    """Refuse a source that is not a causal LM (or does not hold one where ``lm`` says) before any weights are loaded."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if lm.nested:
        model_type = text_config_dict(Path(path_or_id), lm).get("model_type")
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise UserError(
                f"model.language_model: the text model of {path_or_id} has type {model_type!r}, which transformers cannot "
                "build as a causal LM; set model.language_model.model_type to the architecture it follows (e.g. deepseek_v3)"
            )
        require_prefix(Path(path_or_id), lm)
        return
    try:
        config = AutoConfig.from_pretrained(path_or_id, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(f"model.source: cannot read a model config from {path_or_id!r} ({str(err).splitlines()[0]})") from None
    architectures = config.architectures or []
    # Saved models name their head class; a config without one is judged by its model type.
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures) if architectures else (
        config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if not causal:
        wrapped = getattr(config, "text_config", None) is not None
        raise UserError(
            f"model.source: {path_or_id!r} is a {config.model_type!r} model ({', '.join(architectures) or 'no architectures'}), "
            "not a causal language model; "
            + ("it wraps one (text_config): declare where in model.language_model (config: text_config, prefix: its weights' prefix)"
               if wrapped else "point model.source at a decoder-only LM")
        )


def require_prefix(weights: Path, lm: LanguageModel) -> None:
    """Refuse a prefix under which the checkpoint has no text-model embedding, naming the one it has."""
    names = checkpoint_names(weights)
    if names and lm.prefix + EMBEDDING not in names:
        found = sorted(n for n in names if n.endswith("embed_tokens.weight"))
        raise UserError(
            f"model.language_model.prefix: {weights} has no {lm.prefix + EMBEDDING!r}"
            + (f"; its embedding is {found[0]!r}: set the prefix to what comes before {EMBEDDING!r}" if found else "")
        )


def import_hf(location: Path, out: Path, copy: bool, trust_remote_code: bool, lm: LanguageModel, dtype: str | None) -> Path:
    """Copy the HF model at ``location`` (``resolve_hf``) into ``out`` or, with ``copy: false``, only its small
    files; returns the weights folder.

    A nested language model is copied file by file (``dtype`` does not apply): loading it as a
    causal LM and saving it would drop the wrapper that ``lm`` describes.
    """
    require_causal_lm(str(location), trust_remote_code, lm)
    if copy and not lm.nested:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(location, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code)
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code).save_pretrained(out)
        return out
    for file in sorted(location.iterdir()):
        small = not file.name.endswith(WEIGHT_SUFFIXES) and file.stat().st_size <= SMALL_FILE_LIMIT
        if file.is_file() and (copy or small):
            shutil.copy2(file, out / file.name)
    return out if copy else location


def hf_identity(source: DictConfig, location: Path, copy: bool) -> dict[str, Any]:
    """The HF source by content: a hub id with the revision it resolved to, every file's sha256 (a
    referenced weights file's ``sampled_digest``), the dtype a copy is saved in. A local folder is
    named by its files alone: the same checkpoint lies under other paths on other machines. ``location``: where
    ``resolve_hf`` found it for the import."""
    hub = not Path(str(source.id)).expanduser().is_dir()
    files = {}
    for file in sorted(location.iterdir()):
        if file.is_file():
            referenced = not copy and file.name.endswith(WEIGHT_SUFFIXES)
            files[file.name] = sampled_digest(file) if referenced else sha256_file(file)
    revision = location.name if hub and location.parent.name == "snapshots" else None  # the HF cache's commit folder
    return {"kind": "hf", "id": str(source.id) if hub else None, "revision": revision,
            "dtype": str(source.get("dtype")), "files": files}


def sampled_digest(path: Path, sample: int = 1 << 20) -> str:
    """A large file's digest from its size and three sampled MiB (start, middle, end): hashing 600 GB would take hours."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}".encode())
    with path.open("rb") as handle:
        for offset in sorted({0, max(0, size // 2 - sample // 2), max(0, size - sample)}):
            handle.seek(offset)
            digest.update(handle.read(sample))
    return digest.hexdigest()


def local_folder(source: DictConfig) -> Path | None:
    """``model.source.id`` as a local folder, or None for a hub id; a path (absolute, or starting with
    ".") naming no folder is refused."""
    local = Path(str(source.id)).expanduser()
    if local.is_dir():
        return local.resolve()
    if local.is_absolute() or str(source.id).startswith("."):
        raise UserError(f"model.source.id: folder {local} does not exist")
    return None


def resolve_hf(source: DictConfig) -> Path:
    """A local folder as is; a hub id through the HF cache (needs the hub, or HF_HUB_OFFLINE with a warm cache)."""
    local = local_folder(source)
    if local is not None:
        return local
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(source.id), revision=source.get("revision")))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as err:
        raise UserError(
            f"model.source.id: cannot fetch {source.id!r} from the HF hub ({type(err).__name__}); "
            "download it where the hub is reachable and set model.source.id to the local folder"
        ) from None
