"""Params: composition, validation and each stage's declared view.

A group's keys are declared once, in its schema beside the code that reads it (``SCHEMAS``, see
``eagle3.schema``: types, bounds, cross-key rules); conf/config.yaml's own top-level keys (seed)
keep their check here (``TOP_LEVEL``).

``dvc exp run -S group=option`` composes ``conf/`` into ``params.yaml`` with Hydra; plain
``dvc repro`` reads the committed ``params.yaml``. ``eagle3 params -S ...`` composes it the same
way (through DVC's own function) without running anything, and writes it only once it is valid.

A stage reads its params through ``stage_params(PARAMS)``: only the keys it declares (the same
list as its ``params:`` in dvc.yaml, checked by a test), validated before it does anything else.
Reading an undeclared key fails, so a stage cannot depend on a param DVC does not track, and a
bad value set with ``dvc exp run -S`` stops the stage with the same one-line error as here.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import tempfile
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from eagle3.backends.config import BackendSettings, GenerateSettings
from eagle3.common import UserError, at_finish
from eagle3.decoding.config import EvaluateConfig
from eagle3.launch import USER_ERROR
from eagle3.layout import DEVICE_KEYS, LayoutSettings, require_device
from eagle3.hidden_states.config import ExtractSettings
from eagle3.lm.spec import ModelSettings
from eagle3.prompt_sources.config import DatasetSettings
from eagle3.schema import ABSENT, NON_NEGATIVE, OPTION_NAME, Check, check_schema, check_section_keys, refuse
from eagle3.training.config import TrainConfig
from eagle3.training.mixture import MixtureSettings



def compose_params(overrides: list[str], conf_dir: str | Path = "conf", output: str | Path = "params.yaml") -> None:
    """Compose ``conf/config.yaml`` with Hydra overrides into ``output``, exactly as DVC does.

    The composition goes to a temporary file beside ``output`` and replaces it only once valid.
    """
    conf_dir, output = Path(conf_dir).resolve(), Path(output)
    if not (conf_dir / "config.yaml").is_file():
        raise UserError(f"{conf_dir}/config.yaml: not found")
    handle, scratch = tempfile.mkstemp(prefix=f".{output.name}.tmp-", dir=output.parent)
    os.close(handle)
    try:
        _hydra_compose(Path(scratch), conf_dir, overrides)
        composed = OmegaConf.load(scratch)
        check_known_keys(composed, conf_dir, output.name)  # a `+key=value` override adds what no conf/ file declares
        check_required_keys(composed, conf_dir, output.name)  # a `~key` override removes what a stage reads
        validate(composed)
        os.replace(scratch, output)
    finally:
        Path(scratch).unlink(missing_ok=True)


def _hydra_compose(output: Path, conf_dir: Path, overrides: Iterable[str]) -> None:
    """``conf_dir``/config.yaml with Hydra ``overrides`` composed into ``output``, by DVC's own function; a
    Hydra error (an unknown option, a bad override) or an interpolation it breaks (``~seed``) as one line."""
    from hydra.errors import HydraException
    from dvc.utils.hydra import compose_and_dump
    from omegaconf.errors import OmegaConfBaseException

    try:
        compose_and_dump(output, str(conf_dir), None, "config", str(conf_dir), list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        first = str(err).strip().splitlines()[0]
        raise UserError(f"conf/: {first}") from None


def stage_params(keys: Iterable[str], path: str | os.PathLike = "params.yaml", schema: Path | None = None) -> DictConfig:
    """The declared ``keys`` of the params file, validated, and a CUDA device they name present on this
    machine; reading any other key raises. With ``schema`` (the conf/ folder: the params stage), every
    key of the whole file must be one it declares, and every key its chosen options compose must be there;
    without (a stage), every key of its own sections must be a field of the group's schema.

    When the stage finishes (``stage_main``), the file must still hold these values, else the stage
    fails (``_require_unchanged``). Under torchrun every process validates the same values: only
    rank 0 prints the error.
    """
    path, keys = Path(path), tuple(keys)
    if not path.is_file():
        raise UserError(f"{path}: not found; run from the repository root or compose it with `eagle3 params`")
    params, view = OmegaConf.load(path), OmegaConf.create()
    for key in keys:
        value = OmegaConf.select(params, key, default=ABSENT)
        if value is ABSENT:
            raise UserError(f"{path}: {key} is missing; recompose it with `eagle3 params`")
        OmegaConf.update(view, key, value, force_add=True)
    with _reported_by_rank0():
        if schema is not None:  # the params stage: every key against conf/
            check_known_keys(params, schema, path.name)
            check_required_keys(params, schema, path.name)
        else:  # a stage, maybe run alone (`dvc repro -s` skips the params stage): its sections' keys
            for group in SCHEMAS:
                check_section_keys(group, _get(view, group.GROUP))
        validate(view)
        for key in DEVICE_KEYS:
            require_device(key, _get(view, key))
    started = _declared_values(params, keys)
    at_finish(lambda: _require_unchanged(path, keys, started))
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


# --- known keys: conf/ is the schema --------------------------------------------------------------

# Mappings whose entries no conf/ file can list; the code that reads them checks their keys.
OPEN_MAPS = (
    "dataset.eval_sets",    # eval set names (DatasetSettings.relations, the prompts stage)
    "model.draft_head",     # overrides of the drafter's shape (DraftConfig.create)
    "model.source.config",  # a random verifier's transformers config (verifier_sources.random_weights)
)
Schema = dict[str, "Schema | None"]  # None: a value conf/ declares as a scalar, a list or an empty mapping


def conf_schema(conf_dir: str | Path = "conf") -> Schema:
    """Every key conf/ declares: config.yaml's own at the top, and under each group's name the union of
    the keys its options declare (so a key of any option, e.g. backend.port of sglang, is known).

    Every key is declared with its comment in conf/, so a key added there is known here too.
    """
    conf_dir = Path(conf_dir)
    schema = _declared(_conf_file(conf_dir / "config.yaml"))
    for option in sorted(conf_dir.glob("*/*.yaml")):
        schema = _union(schema, {option.parent.name: _declared(_conf_file(option))})
    return schema


def _conf_file(path: Path) -> dict:
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise UserError(f"{path}: not readable YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(loaded, dict):
        raise UserError(f"{path}: not a mapping of keys")
    return {key: value for key, value in loaded.items() if key != "defaults"}  # Hydra's list of options, not a key


def _declared(value: Any) -> Schema | None:
    return {str(key): _declared(item) for key, item in value.items()} if isinstance(value, dict) and value else None


def _union(first: Schema | None, second: Schema | None) -> Schema | None:
    if not isinstance(first, dict) or not isinstance(second, dict):
        return first if isinstance(first, dict) else second
    return {key: _union(first.get(key), second.get(key)) for key in first.keys() | second.keys()}


def check_known_keys(params: DictConfig | dict, conf_dir: str | Path = "conf", name: str = "params.yaml") -> None:
    """Refuse the first key of ``params`` that no conf/ file declares, in one line with the nearest known key.

    Within a section or a mapping conf/ declares with keys, every key must be declared (``OPEN_MAPS``
    excepted); lists (e.g. dataset.sources, checked by ``_check_sources``) are values.
    """
    values = OmegaConf.to_container(params) if isinstance(params, DictConfig) else params
    _check_keys(values, conf_schema(conf_dir), "", Path(conf_dir), name)


def _check_keys(values: Any, schema: Schema | None, prefix: str, conf_dir: Path, name: str) -> None:
    if not isinstance(values, dict) or not isinstance(schema, dict):
        return
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if str(key) not in schema:
            section = dotted.split(".")[0]
            where = conf_dir / section if (conf_dir / section).is_dir() and "." in dotted else conf_dir / "config.yaml"
            nearest = difflib.get_close_matches(str(key), list(schema), n=1)
            hint = (f"did you mean {prefix}{nearest[0]}?" if nearest else
                    f"no file of {where}/ declares it" if where.is_dir() else f"{where} does not declare it")
            raise UserError(f"{name}: {dotted}: unknown key ({hint})")
        if dotted not in OPEN_MAPS:
            _check_keys(value, schema[str(key)], f"{dotted}.", conf_dir, name)


def check_required_keys(params: DictConfig | dict, conf_dir: str | Path = "conf", name: str = "params.yaml") -> None:
    """Refuse the first key that conf/ composes for the options ``params`` names (each group's ``name``)
    but ``params`` lacks: a ``~train.lr`` override or a deleted line, which a stage would refuse only
    after DVC removed its outputs. A group whose ``name`` is no option of conf/ (renamed by hand) is not
    compared inside; the open mappings' entries are the user's to choose.
    """
    values = OmegaConf.to_container(params) if isinstance(params, DictConfig) else params
    conf_dir = Path(conf_dir).resolve()
    groups = sorted(folder.name for folder in conf_dir.iterdir() if folder.is_dir())
    chosen = {group: values[group][OPTION_NAME] for group in groups if isinstance(values.get(group), dict)
              and (conf_dir / group / f"{values[group].get(OPTION_NAME)}.yaml").is_file()}
    with tempfile.TemporaryDirectory() as scratch:
        composed = Path(scratch) / "params.yaml"
        _hydra_compose(composed, conf_dir, [f"{group}={option}" for group, option in chosen.items()])
        expected = OmegaConf.to_container(OmegaConf.load(composed))
    for key, value in expected.items():
        if key in groups and key in values and key not in chosen:
            continue  # named for no option of conf/: nothing to compare it with
        _check_present(values, {key: value}, "", f"{key}={value[OPTION_NAME]}" if key in groups else "conf/config.yaml", name)


def _check_present(values: Any, expected: Any, prefix: str, option: str, name: str) -> None:
    if not isinstance(values, dict) or not isinstance(expected, dict) or prefix[:-1] in OPEN_MAPS:
        return
    for key, value in expected.items():
        if key not in values:
            raise UserError(f"{name}: {prefix}{key}: missing (conf/ composes it for {option}); set it, or recompose "
                            "params.yaml with `eagle3 params`")
        _check_present(values[key], value, f"{prefix}{key}.", option, name)


# --- value checks: the groups' schemas, and the top-level keys' ----------------------------------

SCHEMAS = (DatasetSettings, ModelSettings, LayoutSettings, GenerateSettings, BackendSettings, ExtractSettings,  # each beside
           MixtureSettings, TrainConfig, EvaluateConfig)                                                      # its reader
TOP_LEVEL: dict[str, Check] = {"seed": NON_NEGATIVE}  # conf/config.yaml's keys of no group


def _get(params: DictConfig, key: str) -> Any:
    value = OmegaConf.select(params, key, default=ABSENT)
    return OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value


def validate(params: DictConfig) -> None:
    """Reject values and combinations that would fail hours later: one line with key, value, what is allowed.

    Checks only the keys present, so a stage validates exactly the keys it declares.
    """
    for key, (ok, allowed) in TOP_LEVEL.items():
        value = _get(params, key)
        if value is not ABSENT and not ok(value):
            raise refuse(key, value, allowed)
    for schema in SCHEMAS:
        check_schema(schema, partial(_get, params))

