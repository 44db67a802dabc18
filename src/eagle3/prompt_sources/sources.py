"""The configured prompt sources (``dataset.sources``), each as candidates in its seeded order.

Kinds: ``evals`` (chat samples shipped in the PyPI package ``evals``, by folder, folders
interleaved by size; ``dataset.unseen_folders`` of them set apart for the ``unseen`` eval set),
``jsonl`` / ``parquet`` (local files, validated record by record), ``sharegpt`` (ShareGPT-style
JSON conversations, a prompt per human turn; a local file or a package's), ``passages`` (copy
tasks: the assistant turns of such a file as passages, each wrapped in one of the source's task
templates) and ``hf`` (a HF dataset by name, where a hub is reachable). Where the source allows
(``evals`` files, by byte offset), a candidate is parsed only when the walk reaches it. Any kind
takes a ``match`` (a regular expression): only the prompts whose last user turn it finds stay.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from eagle3.common import UserError, numbered_jsonl, package_file
from eagle3.prompt_sources.messages import SHAREGPT_ROLES, NotAPrompt, to_messages
from eagle3.prompt_sources.names import EVALS_PREFIX, claims_folder, flat, record_prefix, source_name
from eagle3.prompt_sources.order import interleave, order_key
from eagle3.prompt_sources.sharegpt import ConversationFile, human_turn_prompts

log = logging.getLogger(__name__)
PATH_KINDS = ("jsonl", "parquet", "sharegpt", "passages")  # kinds that read a local file by `path`


@dataclass(frozen=True)
class Candidate:
    """A not-yet-parsed record: its place in the seeded order, its provenance, and how to read it."""

    key: bytes
    source: str
    path: Path | None = None  # lazily read records: file and byte offset of the line
    offset: int = 0
    record: dict | None = None  # records already in memory (local files, HF datasets)
    unseen: bool = False  # of a folder kept out of training and held-out for the `unseen` eval set

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


def evals_folders(spec: DictConfig, where: str) -> dict[str, list[Path]]:
    """The ``evals`` package's registry data files by top-level folder, after ``folders``/``exclude``."""
    root = package_file("evals", "registry/data", f"{where} (evals)")
    files: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*.jsonl")):
        files.setdefault(path.relative_to(root).parts[0], []).append(path)
    unknown = sorted((set(flat(spec.get("folders"))) | set(flat(spec.get("exclude")))) - set(files))
    if unknown:
        raise UserError(f"{where}: folder(s) {unknown} not in the evals package's registry/data")
    return {f: paths for f, paths in files.items() if claims_folder(spec, f)}


def unseen_folders(folders: Sequence[str], setting: float | int, seed: int, where: str) -> list[str]:
    """The folders of one source kept out of training and held-out: a share (a float < 1, at least
    one folder when > 0) or a count (an int), the first in a seeded order of their names. The order
    depends on the seed and the folder names only, never on the scale, so shards stay prefix-stable."""
    if isinstance(setting, bool) or not isinstance(setting, (int, float)) or setting < 0 or (
            isinstance(setting, float) and setting >= 1):
        raise UserError(f"params.yaml: dataset.unseen_folders = {setting!r}: must be a share in [0, 1) or a count "
                        "of folders per source (an int >= 0)")
    count = setting if isinstance(setting, int) else (max(1, round(setting * len(folders))) if setting > 0 else 0)
    if count >= len(folders) and count:
        raise UserError(f"{where}: dataset.unseen_folders = {setting!r} sets apart {count} of its {len(folders)} "
                        "folders, leaving none for training; use fewer")
    return sorted(sorted(folders, key=lambda f: order_key(seed, b"unseen\0" + f.encode()))[:count])


def folder_candidates(folder: str, paths: list[Path], root: Path, seed: int,
                      unseen: bool = False) -> tuple[int, Iterator[Candidate]]:
    """How many lines one folder has, and its lines in the seeded order of their content.

    A folder holds up to 288k lines and the walk takes a few: each line is a (key, file, offset)
    tuple until the walk reaches it (a Candidate per line cost seconds). Sorting the tuples orders
    equal keys by file, then offset: as the stable sort by key of the lines in reading order.
    """
    sources = [f"{EVALS_PREFIX}{path.relative_to(root)}" for path in paths]
    lines = []
    for index, (path, source) in enumerate(zip(paths, sources)):
        offset = 0
        with path.open("rb") as handle:
            for line in handle:
                lines.append((order_key(seed, source.encode() + b"\0" + line), index, offset))
                offset += len(line)
    lines.sort()
    return len(lines), (Candidate(key=key, source=sources[index], path=paths[index], offset=offset, unseen=unseen)
                        for key, index, offset in lines)


def evals_candidates(spec: DictConfig, seed: int, where: str, unseen: float | int, report: dict) -> Iterator[Candidate]:
    """The lines of the selected ``evals`` folders, folders interleaved by (lines ** folder_temperature).

    Folder sizes span 15 to 288k lines: temperature 1 samples by size (two folders would be half
    of everything), 0 gives every folder the same share, 0.5 (square root) lies between. The
    unseen folders stay in the interleave (their candidates are marked), so the other folders'
    order is the same whatever their number.
    """
    folders = evals_folders(spec, where)
    root = package_file("evals", "registry/data", f"{where} (evals)")
    apart = set(unseen_folders(list(folders), unseen, seed, where))
    if apart:
        report["unseen_folders"] = sorted(apart)
    sized = [folder_candidates(f, paths, root, seed, f in apart) for f, paths in folders.items()]
    temperature = float(spec.get("folder_temperature", 1.0))
    weights = [size ** temperature if size else 0.0 for size, _ in sized]
    return (candidate for _, candidate in interleave([lines for _, lines in sized], weights))


def check_local_sources(sources: Sequence[tuple[str, DictConfig]], folder: Path) -> None:
    """Refuse a prompt file outside ``folder`` (a dep of the stage: DVC sees edits only there)."""
    for where, spec in sources:
        if spec.kind not in PATH_KINDS or spec.get("path") is None:
            continue
        path = Path(str(spec.path))
        if not os.path.abspath(path).startswith(os.path.abspath(folder) + os.sep):
            raise UserError(
                f"{where}.path: {path} is outside {folder}/, the folder whose edits "
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
        try:
            to_messages(record)
        except NotAPrompt as err:
            raise UserError(f"{place}: not a chat prompt: {err}") from None
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
        # surrogatepass: a lone surrogate must reach the walk, which names or counts it, not fail here
        data = json.dumps(record, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass")
        yield Candidate(key=order_key(seed, source.encode() + b"\0" + data), source=f"{source}#{index}", record=record)


def sharegpt_path(spec: DictConfig, where: str) -> Path:
    """The ShareGPT JSON file (of a ``sharegpt`` or ``passages`` source): a local ``path``, or ``file`` inside the
    installed ``package``."""
    if spec.get("path") is not None:
        path = Path(str(spec.path))
        if not path.is_file():
            raise UserError(f"{path}: not found or not a file; check {where}.path")
        return path
    if spec.get("package") is None or spec.get("file") is None:
        raise UserError(f"{where}: kind '{spec.kind}' needs a `path`, or a `package` and the `file` in it")
    return package_file(str(spec.package), str(spec.file), f"{where}.package")


def conversations(spec: DictConfig, where: str, report: dict) -> Iterator[tuple[str, dict, bytes]]:
    """(name, record, raw JSON bytes) of each conversation of a ShareGPT-style file; a file cut
    mid-record gives the records before the cut, and the cut is logged and reported."""
    path = sharegpt_path(spec, where)
    name, records = record_prefix(spec), ConversationFile(path)
    for record, raw in records:
        if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
            raise UserError(f"{path}: record {records.records} has no 'conversations' list of {{from, value}} "
                            "turns; fix it or remove it")
        yield f"{name}#{record.get('id', records.records)}", record, raw.encode("utf-8", "surrogatepass")
    report["conversations"] = records.records
    if records.cut:
        report["truncated_at_byte"] = path.stat().st_size
        log.warning("%s: cut off inside a record at byte %d: read the %d complete conversations before the cut",
                    path, path.stat().st_size, records.records)


def turn_key(seed: int, spec: DictConfig, data: bytes, turn: int) -> bytes:
    """A turn's place in its source's seeded order: the source, its conversation's raw JSON, the turn's index."""
    return order_key(seed, source_name(spec).encode() + b"\0" + data + b"\0" + str(turn).encode())


def sharegpt_candidates(spec: DictConfig, seed: int, where: str, report: dict) -> Iterator[Candidate]:
    """A candidate per human turn of each conversation (with the turns before it)."""
    for conversation, record, data in conversations(spec, where, report):
        for turn, prompt in human_turn_prompts(record):
            report["prompts"] = report.get("prompts", 0) + 1
            yield Candidate(key=turn_key(seed, spec, data, turn), source=f"{conversation}/{turn}", record=prompt)


def passage_candidates(spec: DictConfig, seed: int, where: str, report: dict) -> Iterator[Candidate]:
    """Copy tasks: each assistant turn of the conversations whose text has ``min_chars`` to
    ``max_chars`` characters is a passage, put in one task template (``{text}`` marks where): one
    of ``code_tasks`` for a passage holding a fenced code block, else of ``tasks``, chosen by a
    seeded hash of the turn. The verifier's answer then repeats much of its prompt, as answers to
    users' summaries, translations, rewrites and code edits do."""
    low, high = int(spec.get("min_chars", 0)), int(spec.get("max_chars", 10**9))
    for conversation, record, data in conversations(spec, where, report):
        for turn, message in enumerate(record["conversations"]):
            text = passage_text(message)
            if text is None or not low <= len(text) <= high:
                continue
            report["passages"] = report.get("passages", 0) + 1
            key = turn_key(seed, spec, data, turn)
            templates = list(spec.code_tasks if "```" in text else spec.tasks)
            template = templates[int.from_bytes(order_key(seed, b"task\0" + key), "big") % len(templates)]
            yield Candidate(key=key, source=f"{conversation}/{turn}",
                            record={"messages": [{"role": "user", "content": template.replace("{text}", text)}]})


def passage_text(turn: object) -> str | None:
    """An assistant turn's text, stripped; None for any other turn."""
    if not isinstance(turn, dict) or SHAREGPT_ROLES.get(turn.get("from") or turn.get("role")) != "assistant":
        return None
    text = turn.get("value", turn.get("content"))
    return text.strip() if isinstance(text, str) else None


def matching(candidates: Iterator[Candidate], pattern: str) -> Iterator[Candidate]:
    """The candidates whose last user turn ``pattern`` finds (a record that is no prompt passes on,
    for the walk to count it)."""
    regex = re.compile(pattern)
    for candidate in candidates:
        raw = candidate.load()
        try:
            messages = to_messages(raw if isinstance(raw, dict) else {})
        except NotAPrompt:
            yield candidate
            continue
        if regex.search(messages[-1]["content"]):
            yield candidate


def source_candidates(spec: DictConfig, where: str, seed: int, unseen: float | int = 0,
                      report: dict | None = None) -> Iterator[Candidate]:
    """One source's candidates in its seeded order (lazily where the source allows); ``report``
    receives what the reading found (unseen folders, a file's cut)."""
    report = {} if report is None else report
    if spec.kind == "evals":
        candidates = evals_candidates(spec, seed, where, unseen, report)
    else:
        candidates = iter(sorted(memory_source(spec, seed, where, report), key=lambda c: c.key))
    return matching(candidates, str(spec.match)) if spec.get("match") is not None else candidates


def memory_source(spec: DictConfig, seed: int, where: str, report: dict) -> Iterator[Candidate]:
    """The candidates of a source read whole (every kind but ``evals``), in file order."""
    if spec.kind in ("jsonl", "parquet"):
        return memory_candidates(file_records(spec), record_prefix(spec), seed)
    if spec.kind == "sharegpt":
        return sharegpt_candidates(spec, seed, where, report)
    if spec.kind == "passages":
        return passage_candidates(spec, seed, where, report)
    if spec.kind == "hf":
        return memory_candidates(hf_records(spec, where), record_prefix(spec), seed)
    raise UserError(f"{where}.kind: {spec.kind!r} is not one of evals, jsonl, parquet, sharegpt, passages, hf")


def source_weights(sources: Sequence[tuple[str, DictConfig]]) -> list[float]:
    """Each source's ``weight`` (default 1), normalised to shares; a clear error for bad values."""
    weights = []
    for where, spec in sources:
        weight = spec.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight <= 0:
            raise UserError(f"{where}.weight: {weight!r} is not a positive number")
        weights.append(float(weight))
    names = [source_name(spec) for _, spec in sources]
    if len(set(names)) != len(names):
        raise UserError(f"params.yaml: dataset.sources: names {names} repeat; give each source its own `label:`")
    return [w / sum(weights) for w in weights]
