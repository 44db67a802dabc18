"""The ``dataset`` params section's schema: the scale's shards, its prompt sources, eval sets and filters.

    check_schema(DatasetSettings, get)    # config.validate, for every view holding dataset keys
    shard_range("000032-001000")          # (32, 1000): a shard is a range of the seeded prompt order
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from eagle3.common import UserError
from eagle3.schema import ABSENT, FRACTION, POSITIVE, Check, Lookup, integer, refuse, setting

SHARD_NAME = re.compile(r"^(\d{6})-(\d{6})$")
SOURCE_KEYS = {  # dataset.sources: the keys of an entry, by kind (docs/data.md), besides kind, label, weight and match
    "evals": ("folders", "exclude", "folder_temperature"),
    "jsonl": ("path",),
    "parquet": ("path",),
    "sharegpt": ("path", "package", "file"),
    "passages": ("path", "package", "file", "min_chars", "max_chars", "tasks", "code_tasks"),
    "hf": ("name", "subset", "split"),
}
SOURCE_KINDS = tuple(SOURCE_KEYS)
SHARE_OR_COUNT = Check(lambda v: integer(0)(v) or (isinstance(v, float) and 0 <= v < 1),
                       "a share of each evals source's folders in [0, 1) or a count per source (an int >= 0)")


@dataclass(frozen=True)
class DatasetSettings:
    """One field per key of conf/dataset/*.yaml (read by the prompts stage, ``sources`` and ``eval_sets``)."""

    GROUP: ClassVar[str] = "dataset"

    shards: list = setting()  # contiguous ranges of the seeded prompt order from 000000 (relations)
    draft_vocab_size: int = setting()  # merge.draft_vocab_size's value, checked there
    eval_sets: dict = setting()  # prompts per eval set, or {prompts: n, kind: ...} (relations)
    sources: list = setting()  # the weighted prompt sources, by kind (relations)
    extra_sources: list = setting()  # sources added to `sources` (relations)
    heldout_fraction: float = setting(FRACTION)  # share of prompts kept out of training (eval set heldout)
    unseen_folders: float | int = setting(SHARE_OR_COUNT)  # folders kept out of training and held out
    max_prompt_tokens: int = setting(POSITIVE)  # longer prompts (chat-templated) are dropped

    @staticmethod
    def relations(get: Lookup) -> None:
        """The shards contiguous from 0, every source entry one of its kind, a count per eval set."""
        _check_shards(get("dataset.shards"))
        _check_sources(get("dataset.sources"), get("dataset.extra_sources"))
        sets = get("dataset.eval_sets")
        counts = [n.get("prompts") if isinstance(n, dict) else n for n in sets.values()] if isinstance(sets, dict) else None
        if sets is not ABSENT and (counts is None or not all(integer(0)(n) for n in counts)):
            raise refuse("dataset.eval_sets", sets, "a mapping of eval set names to prompt counts >= 0 (or to "
                         "{prompts: n, kind: ..., ...})")
        for name, value in sets.items() if isinstance(sets, dict) else ():
            if isinstance(value, dict) and "kind" in value:  # a set read from a source: that source's keys
                _check_source(f"dataset.eval_sets.{name}", {k: v for k, v in value.items()
                                                             if k not in ("prompts", "max_prompt_tokens")})


def shard_range(name: str) -> tuple[int, int]:
    """``"000032-001000"`` -> ``(32, 1000)``: a shard is a range of the seeded prompt order."""
    match = SHARD_NAME.match(str(name))
    if not match or int(match[1]) >= int(match[2]):
        raise UserError(f"params.yaml: dataset.shards: {name!r} is not a range 'SSSSSS-EEEEEE' with start < end")
    return int(match[1]), int(match[2])


def _check_shards(shards: Any) -> None:
    if shards is ABSENT:
        return
    if not isinstance(shards, list) or not shards:
        raise refuse("dataset.shards", shards, "a non-empty list of ranges 'SSSSSS-EEEEEE'")
    ranges = [shard_range(s) for s in shards]
    if ranges[0][0] != 0:
        raise refuse("dataset.shards", shards, "contiguous ranges starting at 000000")
    for (_, stop), (start, _) in zip(ranges, ranges[1:]):
        if start != stop:
            raise refuse("dataset.shards", shards, f"contiguous ranges (one ends at {stop:06d}, the next starts at {start:06d})")


def _check_sources(sources: Any, extra: Any) -> None:
    if sources is not ABSENT and (not isinstance(sources, list) or not sources):
        raise refuse("dataset.sources", sources, "a non-empty list of {kind: ...} entries")
    if extra is not ABSENT and not isinstance(extra, list):
        raise refuse("dataset.extra_sources", extra, "a list of {kind: ...} entries (a preset's sources), [] for none")
    for key, entries in (("dataset.sources", sources), ("dataset.extra_sources", extra)):
        for index, spec in enumerate(entries if isinstance(entries, list) else []):
            _check_source(f"{key}[{index}]", spec)


def _check_source(key: str, spec: Any) -> None:
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind not in SOURCE_KINDS:
        raise refuse(f"{key}.kind", kind, f"one of {list(SOURCE_KINDS)}")
    known = ("kind", "label", "weight", "match", *SOURCE_KEYS[kind])
    for name in spec:
        if name not in known:
            nearest = difflib.get_close_matches(str(name), known, n=1)
            hint = f"did you mean {key}.{nearest[0]}?" if nearest else f"a {kind} source has {list(known)}"
            raise UserError(f"params.yaml: {key}.{name}: unknown key ({hint})")
    if kind in ("jsonl", "parquet") and not spec.get("path"):
        raise refuse(f"{key}.path", spec.get("path"), f"the path of the {kind} file")
    if kind in ("sharegpt", "passages") and not (spec.get("path") or (spec.get("package") and spec.get("file"))):
        raise refuse(key, spec, f"a {kind} source with a `path`, or a `package` and its `file`")
    if kind == "passages":
        _check_passages(key, spec)
    if spec.get("match") is not None:
        _check_pattern(f"{key}.match", spec["match"])
    if kind == "hf" and not spec.get("name"):
        raise refuse(f"{key}.name", spec.get("name"), "a HF dataset name")


def _check_passages(key: str, spec: dict) -> None:
    """A passages source's task templates (each with ``{text}``, where the passage goes) and its length bounds."""
    for name in ("tasks", "code_tasks"):
        templates = spec.get(name)
        if not isinstance(templates, list) or not templates or not all(
                isinstance(t, str) and "{text}" in t for t in templates):
            raise refuse(f"{key}.{name}", templates, "a non-empty list of task templates, each holding {text} where "
                         "the passage goes")
    for name in ("min_chars", "max_chars"):
        if spec.get(name) is not None and not integer(0)(spec[name]):
            raise refuse(f"{key}.{name}", spec[name], "an integer >= 0 (characters)")


def _check_pattern(key: str, pattern: Any) -> None:
    if not isinstance(pattern, str):
        raise refuse(key, pattern, "a regular expression (a string)")
    try:
        re.compile(pattern)
    except re.error as err:
        raise refuse(key, pattern, f"a regular expression ({err})") from None
