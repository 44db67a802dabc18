"""What a configured prompt source is called, and which source a prompt record came from.

    source_name(spec)                          # "copy": its label, else its file, dataset or kind
    source_of("copy#CtYTOLK_0/25", specs)      # "copy": the source whose prompts' ``source`` strings look so

Why apart from the readers (``sources.py``): ``merge`` names each training sample's source (for
``merge.source_repeats``) from the ``source`` string its prompt record carries, without the
readers' packages; the strings are built here and read back here, so the two cannot drift.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from omegaconf import DictConfig, OmegaConf

EVALS_PREFIX = "evals/"  # an evals prompt's source: evals/<folder>/<file>


def flat(items) -> list[str]:
    """A folder list that may nest lists (YAML anchors of other sources' lists), flattened."""
    out = []
    for item in items or []:
        out.extend(flat(item) if isinstance(item, (list, tuple)) or OmegaConf.is_list(item) else [str(item)])
    return out


def source_name(spec: Mapping) -> str:
    """A source's name in the metrics: its ``label``, else its path, HF dataset name, package file or kind (``spec``: a
    DictConfig, or the plain mapping a params check reads)."""
    packaged = f"{spec['package']}/{spec['file']}" if spec.get("package") and spec.get("file") else None
    return str(spec.get("label") or spec.get("path") or spec.get("name") or packaged or spec.get("kind"))


def configured_sources(dataset: Mapping) -> list[tuple[str, Mapping]]:
    """(where, spec) of every training source: ``dataset.sources``, then ``dataset.extra_sources``
    (what a preset adds without restating the shared list)."""
    return [(f"params.yaml: dataset.{key}[{index}]", spec) for key in ("sources", "extra_sources")
            for index, spec in enumerate(dataset.get(key) or [])]


def record_prefix(spec: DictConfig) -> str:
    """What the ``source`` of each prompt of a source read whole (every kind but ``evals``) starts with, before its
    ``#``: the file of ``jsonl``/``parquet``, ``hf/<name>``, else (``sharegpt``, ``passages``) the source's name."""
    if spec.kind in ("jsonl", "parquet"):
        return str(spec.path)
    if spec.kind == "hf":
        return f"hf/{spec.name}"
    return source_name(spec)


def claims_folder(spec: DictConfig, folder: str) -> bool:
    """Whether an ``evals`` source reads ``folder``: one of its ``folders`` (all when none are named), not ``exclude``d."""
    wanted = flat(spec.get("folders"))
    return (not wanted or folder in wanted) and folder not in set(flat(spec.get("exclude")))


def source_of(source: str, specs: Sequence[DictConfig]) -> str | None:
    """The name of the source among ``specs`` that a prompt record's ``source`` came from; None: none of them."""
    folder = source.split("/")[1] if source.startswith(EVALS_PREFIX) and source.count("/") >= 2 else None
    for spec in specs:
        if spec.kind == "evals":
            if folder is not None and claims_folder(spec, folder):
                return source_name(spec)
        elif source.startswith(record_prefix(spec) + "#"):
            return source_name(spec)
    return None
