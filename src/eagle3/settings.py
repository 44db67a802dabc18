"""A stage's settings: the keys of params.yaml it declares, read and checked by its own groups' schemas.

    PARAMS = StageParams(section(ExtractSettings), keys_of(ModelSettings, "aux_layers"), keys_of(LayoutSettings, "device"))
    list(PARAMS)              # ["extract", "model.aux_layers", "layout.device"]: = dvc.yaml's params: of the stage
    params = stage_params(PARAMS, args.params)
    params.extract.max_length                           # params.model.stop raises: not declared

A stage's ``PARAMS`` is the one list of what it reads, each key named through the schema that declares it (type,
check, description: docs/params.md), so a key no schema declares fails at import. Only these keys, validated before the
stage does anything else, so a stage cannot depend on a param DVC does not track, and a bad value set with
``dvc exp run -S`` stops the stage in one line. Why through its schemas: the stage's code then depends on the schemas of
what it reads, not on every group's (``eagle3.config``, the params stage's, composes and checks them all, the rules
across groups included: a stage's view holds no other group's keys, so those rules skip there).
"""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from eagle3.common import USER_ERROR, UserError, at_finish
from eagle3.schema import ABSENT, NON_NEGATIVE, Check, check_schema, refuse

TOP_LEVEL: dict[str, Check] = {"seed": NON_NEGATIVE}  # conf/config.yaml's keys of no group
OPTION_NAME = "name"  # Hydra's name of the chosen option: a key of every group, declared by no schema (composition's own)
DEVICE_KEYS = ("layout.device", "backend.device")  # backend.device: the local backend's copy of layout.device


@dataclass(frozen=True)
class Reads:
    """What a stage reads of one group: its whole section (``names`` None), or some of its keys."""

    schema: type  # the group's schema, e.g. ExtractSettings
    names: tuple[str, ...] | None

    def keys(self) -> tuple[str, ...]:
        return (self.schema.GROUP,) if self.names is None else tuple(f"{self.schema.GROUP}.{name}" for name in self.names)


def section(schema: type) -> Reads:
    return Reads(schema, None)


def keys_of(schema: type, *names: str) -> Reads:
    """Some keys of ``schema``'s group; a name its schema does not declare is refused at once (a stage's import)."""
    unknown = sorted(set(names) - {item.name for item in fields(schema)} - {OPTION_NAME})
    if unknown:
        raise ValueError(f"{schema.__name__} declares no {unknown}")
    return Reads(schema, names)


class StageParams:
    """The params one stage reads, in order: top-level keys by name (``TOP_LEVEL``), groups through their schemas.
    Iterating it gives the dotted keys (what dvc.yaml's ``params:`` lists for the stage)."""

    def __init__(self, *reads: Reads | str):
        unknown = [read for read in reads if isinstance(read, str) and read not in TOP_LEVEL]
        if unknown:
            raise ValueError(f"no top-level key {unknown}: a group's keys are read through its schema")
        self.keys = tuple(key for read in reads for key in ((read,) if isinstance(read, str) else read.keys()))
        self.schemas = tuple(dict.fromkeys(read.schema for read in reads if isinstance(read, Reads)))

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys)


def stage_params(declared: StageParams, path: str | os.PathLike = "params.yaml",
                 whole: Callable[[DictConfig], None] | None = None) -> DictConfig:
    """The ``declared`` keys of the params file, validated by their schemas, and a CUDA device they name present on this
    machine; reading any other key raises. ``whole``: a check of the whole file (the params stage's: every key one that
    conf/ declares, every key its chosen options compose); without, every key of the stage's sections must be a field of
    its group's schema (a stage run alone: `dvc repro -s` skips the params stage).

    When the stage finishes (``runner.stage_main``), the file must still hold these values, else the stage
    fails (``_require_unchanged``). Under torchrun every process validates the same values: only
    rank 0 prints the error.
    """
    path, names = Path(path), declared.keys
    if not path.is_file():
        raise UserError(f"{path}: not found; run from the repository root or compose it with `eagle3 params`")
    params, view = OmegaConf.load(path), OmegaConf.create()
    for key in names:
        value = OmegaConf.select(params, key, default=ABSENT)
        if value is ABSENT:
            raise UserError(f"{path}: {key} is missing; recompose it with `eagle3 params`")
        OmegaConf.update(view, key, value, force_add=True)
    with _reported_by_rank0():
        if whole is not None:
            whole(params)
        else:
            for schema in declared.schemas:
                check_section_keys(schema, _get(view, schema.GROUP))
        check_values(view, declared.schemas)
        for key in DEVICE_KEYS:
            require_device(key, _get(view, key))
    started = _declared_values(params, names)
    at_finish(lambda: _require_unchanged(path, names, started))
    OmegaConf.set_struct(view, True)
    return view


@contextlib.contextmanager
def _reported_by_rank0() -> Iterator[None]:
    """A UserError inside is printed by rank 0 only; the other torchrun processes exit USER_ERROR silently."""
    try:
        yield
    except UserError:
        if os.environ.get("RANK", "0") != "0":
            raise SystemExit(USER_ERROR) from None
        raise


def _declared_values(params: DictConfig, keys: Iterable[str]) -> dict[str, Any]:
    """The leaves of the declared ``keys``, by dotted name: ``{"evaluate.tree.topk": 4, ...}``."""
    leaves: dict[str, Any] = {}

    def add(name: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for child, item in value.items():
                add(f"{name}.{child}", item)
        else:
            leaves[name] = value

    for key in keys:
        add(key, _get(params, key))
    return leaves


def _require_unchanged(path: Path, keys: Iterable[str], started: dict[str, Any]) -> None:
    """Refuse to finish when the params file no longer holds the declared values the stage started with.

    A `dvc exp run -S` refused by DVC's lock while this stage ran has already rewritten params.yaml
    (DVC releases its lock while a stage's command runs), and DVC would record the new values
    for outputs made with the old ones: a stage failing here gets no dvc.lock entry.
    """
    try:
        now = _declared_values(OmegaConf.load(path), keys)
    except (OSError, yaml.YAMLError):
        now = {}
    changed = [key for key in sorted(started.keys() | now.keys()) if started.get(key, ABSENT) != now.get(key, ABSENT)]
    if changed:
        shown = ", ".join(f"{key} {_shown(started.get(key, ABSENT))} -> {_shown(now.get(key, ABSENT))}" for key in changed[:3])
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        with _reported_by_rank0():
            raise UserError(f"{path}: changed while this stage ran ({shown}{more}): its outputs are of the values it "
                            f"started with, so nothing is recorded; run `dvc repro` again for the new values, or first "
                            f"`git checkout {path}` for the old ones")


def _shown(value: Any) -> str:
    return "(missing)" if value is ABSENT else repr(value)


def _get(params: DictConfig, key: str) -> Any:
    value = OmegaConf.select(params, key, default=ABSENT)
    return OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value


def check_values(params: DictConfig, schemas: Iterable[type]) -> None:
    """Reject values and combinations that would fail hours later: one line with key, value, what is allowed.

    Checks only the keys present, so a stage validates exactly the keys it declares.
    """
    for key, (ok, allowed) in TOP_LEVEL.items():
        value = _get(params, key)
        if value is not ABSENT and not ok(value):
            raise refuse(key, value, allowed)
    for schema in schemas:
        check_schema(schema, partial(_get, params))


def check_section_keys(schema: type, section: Any) -> None:
    """Refuse a key of ``schema``'s group ``section`` (its plain value, or ABSENT) that the schema has no field for, with
    the nearest field: a stage's own check of its sections (the params stage checks every key against conf/, where a
    key added to a conf file is known at once)."""
    known = [item.name for item in fields(schema)] + [OPTION_NAME]
    for key in section if isinstance(section, dict) else ():
        if key not in known:
            nearest = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {schema.GROUP}.{nearest[0]}?" if nearest else f"{schema.__name__} has no such field"
            raise UserError(f"params.yaml: {schema.GROUP}.{key}: unknown key ({hint})")


def require_device(key: str, device: Any) -> None:
    """Refuse ``device`` "cuda" on a machine where torch sees no CUDA device (else a stage fails with a
    torch.cuda traceback, after DVC removed its outputs). Not a schema rule: `eagle3 params` may compose
    a GPU layout on a CPU machine for another; the params stage and each stage check the machine that runs them."""
    if device != "cuda":
        return
    import torch  # only for a CUDA layout: reading params loads no torch

    if not torch.cuda.is_available():
        raise UserError(f"params.yaml: {key} = 'cuda': this machine has no CUDA device torch can use; choose a layout for it "
                        "(-S layout=cpu), or run on a GPU machine")
