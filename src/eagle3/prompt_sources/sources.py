"""The configured prompt sources (``dataset.sources``), each as candidates in its seeded order.

Kinds: ``evals`` (chat samples shipped in the PyPI package ``evals``, by folder, folders
interleaved by size), ``jsonl`` / ``parquet`` (local files, validated record by record) and ``hf``
(a HF dataset by name, where a hub is reachable). Where the source allows (``evals`` files, by byte
offset), a candidate is parsed only when the walk reaches it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from eagle3.common import UserError, numbered_jsonl, package_file
from eagle3.prompt_sources.messages import to_messages
from eagle3.prompt_sources.order import interleave, order_key


@dataclass(frozen=True)
class Candidate:
    """A not-yet-parsed record: its place in the seeded order, its provenance, and how to read it."""

    key: bytes
    source: str
    path: Path | None = None  # lazily read records: file and byte offset of the line
    offset: int = 0
    record: dict | None = None  # records already in memory (local files, HF datasets)

    @property
    def folder(self) -> str:
        """Where it came from, for the drop counts: an ``evals`` file's folder, else the file or dataset."""
        return os.path.dirname(self.source) if self.path is not None else self.source.split("#")[0]

    def load(self) -> dict | None:
        if self.record is not None:
            return self.record
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            line = handle.readline()
        try:
            return json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None


def flat(items) -> list[str]:
    """A folder list that may nest lists (YAML anchors of other sources' lists), flattened."""
    out = []
    for item in items or []:
        out.extend(flat(item) if isinstance(item, (list, tuple)) or OmegaConf.is_list(item) else [str(item)])
    return out


def evals_folders(spec: DictConfig, where: str) -> dict[str, list[Path]]:
    """The ``evals`` package's registry data files by top-level folder, after ``folders``/``exclude``."""
    root = package_file("evals", "registry/data", f"{where} (evals)")
    files: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*.jsonl")):
        files.setdefault(path.relative_to(root).parts[0], []).append(path)
    wanted, excluded = flat(spec.get("folders")), set(flat(spec.get("exclude")))
    unknown = sorted((set(wanted) | excluded) - set(files))
    if unknown:
        raise UserError(f"{where}: folder(s) {unknown} not in the evals package's registry/data")
    return {f: paths for f, paths in files.items() if (not wanted or f in wanted) and f not in excluded}


def folder_candidates(folder: str, paths: list[Path], root: Path, seed: int) -> tuple[int, Iterator[Candidate]]:
    """How many lines one folder has, and its lines in the seeded order of their content.

    A folder holds up to 288k lines and the walk takes a few: each line is a (key, file, offset)
    tuple until the walk reaches it (a Candidate per line cost seconds). Sorting the tuples orders
    equal keys by file, then offset: as the stable sort by key of the lines in reading order.
    """
    sources = [f"evals/{path.relative_to(root)}" for path in paths]
    lines = []
    for index, (path, source) in enumerate(zip(paths, sources)):
        offset = 0
        with path.open("rb") as handle:
            for line in handle:
                lines.append((order_key(seed, source.encode() + b"\0" + line), index, offset))
                offset += len(line)
    lines.sort()
    return len(lines), (Candidate(key, sources[index], paths[index], offset) for key, index, offset in lines)


def evals_candidates(spec: DictConfig, seed: int, where: str) -> Iterator[Candidate]:
    """The lines of the selected ``evals`` folders, folders interleaved by (lines ** folder_temperature).

    Folder sizes span 15 to 288k lines: temperature 1 samples by size (two folders would be half
    of everything), 0 gives every folder the same share, 0.5 (square root) lies between.
    """
    folders = evals_folders(spec, where)
    root = package_file("evals", "registry/data", f"{where} (evals)")
    sized = [folder_candidates(f, paths, root, seed) for f, paths in folders.items()]
    temperature = float(spec.get("folder_temperature", 1.0))
    weights = [size ** temperature if size else 0.0 for size, _ in sized]
    for _, candidate in interleave([lines for _, lines in sized], weights):
        yield candidate


def check_local_sources(sources: ListConfig, folder: Path) -> None:
    """Refuse a prompt file outside ``folder`` (a dep of the stage: DVC sees edits only there)."""
    for index, spec in enumerate(sources):
        if spec.kind not in ("jsonl", "parquet"):
            continue
        path = Path(str(spec.path))
        if not os.path.abspath(path).startswith(os.path.abspath(folder) + os.sep):
            raise UserError(
                f"params.yaml: dataset.sources[{index}].path: {path} is outside {folder}/, the folder whose edits "
                f"rerun `prompts`; move the file there and set the path to {folder / path.name} "
                f"(a large file: `dvc add {folder / path.name}`)"
            )


def file_records(spec: DictConfig) -> Iterator[dict]:
    """The records of a local JSONL or Parquet file, each a chat prompt: else the file and line are named."""
    path = Path(str(spec.path))
    if not path.is_file():
        raise UserError(f"{path}: not found or not a file; check dataset.sources")
    if spec.kind == "jsonl":
        numbered = ((f"{path}:{number}", record) for number, record in numbered_jsonl(path))
    else:
        numbered = ((f"{path}: row {number}", record) for number, record in enumerate(parquet_rows(path), start=1))
    empty = True
    for place, record in numbered:
        if to_messages(record) is None:
            raise UserError(
                f"{place}: not a chat prompt; give a 'messages' (or 'conversations') list of {{role, content}} "
                "turns ending with a user turn, or a 'prompt' string"
            )
        empty = False
        yield record
    if empty:
        raise UserError(f"{path}: no records; add prompts to it or remove it from dataset.sources")


def parquet_rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises many types for unreadable files
        raise UserError(f"{path}: not a readable Parquet file ({err})") from None


def hf_records(spec: DictConfig, where: str) -> Iterator[dict]:
    try:
        import datasets
    except ImportError:
        raise UserError(f"{where}: kind 'hf' needs the datasets library: pip install 'eagle3[datasets]'") from None
    try:
        dataset = datasets.load_dataset(str(spec.name), spec.get("subset"), split=str(spec.get("split", "train")))
    except Exception as err:  # hub, auth and format errors come in many types
        raise UserError(f"{where}: cannot load HF dataset {spec.name!r} ({str(err).splitlines()[0]})") from None
    yield from dataset


def memory_candidates(records: Iterator[dict], source: str, seed: int) -> Iterator[Candidate]:
    for index, record in enumerate(records):
        data = json.dumps(record, sort_keys=True, ensure_ascii=False, default=str).encode()
        yield Candidate(order_key(seed, source.encode() + b"\0" + data), f"{source}#{index}", record=record)


def source_name(spec: DictConfig) -> str:
    """A source's name in the metrics: its ``label``, else its path, HF dataset name or kind."""
    return str(spec.get("label") or spec.get("path") or spec.get("name") or spec.kind)


def source_candidates(spec: DictConfig, index: int, seed: int) -> Iterator[Candidate]:
    """One source's candidates in its seeded order (lazily where the source allows)."""
    where = f"params.yaml: dataset.sources[{index}]"
    if spec.kind == "evals":
        return evals_candidates(spec, seed, where)
    if spec.kind in ("jsonl", "parquet"):
        records = memory_candidates(file_records(spec), str(spec.path), seed)
    elif spec.kind == "hf":
        records = memory_candidates(hf_records(spec, where), f"hf/{spec.name}", seed)
    else:
        raise UserError(f"{where}.kind: {spec.kind!r} is not one of evals, jsonl, parquet, hf")
    return iter(sorted(records, key=lambda c: c.key))


def source_weights(sources: Sequence[DictConfig]) -> list[float]:
    """Each source's ``weight`` (default 1), normalised to shares; a clear error for bad values."""
    weights = []
    for index, spec in enumerate(sources):
        weight = spec.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight <= 0:
            raise UserError(f"params.yaml: dataset.sources[{index}].weight: {weight!r} is not a positive number")
        weights.append(float(weight))
    names = [source_name(spec) for spec in sources]
    if len(set(names)) != len(names):
        raise UserError(f"params.yaml: dataset.sources: names {names} repeat; give each source its own `label:`")
    return [w / sum(weights) for w in weights]
