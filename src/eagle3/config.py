"""Params composed and checked as a whole: the ``params`` stage's (and ``eagle3 params``'), which alone imports every
group's schema (``SCHEMAS``).

A group's keys are declared once, in its schema beside the code that reads it (see ``eagle3.schema``: types, bounds,
rules over several keys); conf/config.yaml's own top-level keys (seed) keep their check in ``eagle3.settings``
(``TOP_LEVEL``), which also cuts each stage's view (``stage_params``: the stage's keys, checked by its own groups'
schemas).

``dvc exp run -S group=option`` composes ``conf/`` into ``params.yaml`` with Hydra; plain
``dvc repro`` reads the committed ``params.yaml``. ``eagle3 params -S ...`` composes it the same
way (through DVC's own function) without running anything, and writes it only once it is valid.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from eagle3.backends.config import BackendSettings, GenerateSettings
from eagle3.common import UserError
from eagle3.decoding.config import EvaluateConfig
from eagle3.layout import LayoutSettings
from eagle3.hidden_states.config import ExtractSettings
from eagle3.lm.spec import ModelSettings
from eagle3.prompt_sources.config import DatasetSettings
from eagle3.settings import OPTION_NAME, TOP_LEVEL, check_values
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
        check_conf_keys(composed, conf_dir, output.name)
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


# --- known keys: conf/ is the schema --------------------------------------------------------------

# Mappings whose entries no conf/ file can list; the code that reads them checks their keys.
OPEN_MAPS = (
    "dataset.eval_sets",    # eval set names (DatasetSettings.relations, the prompts stage)
    "model.draft_head",     # overrides of the drafter's shape (DraftConfig.create)
    "model.source.config",  # a random verifier's transformers config (verifier_sources.random_weights)
    "merge.source_repeats", # source names (MixtureSettings.relations)
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


def check_conf_keys(params: DictConfig | dict, conf_dir: str | Path = "conf", name: str = "params.yaml") -> None:
    """``params``' keys against conf/, the schema of the keys: every key one that conf/ declares (a ``+key=value``
    override adds what no conf/ file declares), every key the chosen options compose there (a ``~key`` removes it)."""
    check_known_keys(params, conf_dir, name)
    check_required_keys(params, conf_dir, name)


# --- value checks: every group's schema ------------------------------------------------------------

SCHEMAS = (DatasetSettings, ModelSettings, LayoutSettings, GenerateSettings, BackendSettings, ExtractSettings,  # each beside
           MixtureSettings, TrainConfig, EvaluateConfig)                                                      # its reader


def validate(params: DictConfig) -> None:
    """Every group's checks over ``params`` (the keys present), the rules across groups included."""
    check_values(params, SCHEMAS)


# --- the reference of every key: docs/params.md ------------------------------------------------------------------

REFERENCE_COMMAND = "python -m eagle3.config dvc.yaml > docs/params.md"


def field_notes(schema: type) -> dict[str, str]:
    """Each field's one line of description: the comment after its declaration in the schema's source
    (``lr: float = setting(POSITIVE_NUMBER)  # peak learning rate ...``)."""
    declarations = (re.match(r"    (\w+): .*= setting\(.*?  # (.*)$", line) for line in inspect.getsource(schema).splitlines())
    return {found.group(1): found.group(2).strip() for found in declarations if found}


def stage_reads(pipeline: Path) -> dict[str, set[str]]:
    """Each stage of a dvc.yaml and the params it reads: its ``params:`` (= its module's ``PARAMS``,
    tests/test_dvc_deps.py) and those its command interpolates (train's ``${layout.nnodes}``). The stage that lists every
    section (``params``, which checks them all) is left out: it would be every key's reader."""
    stages = (yaml.safe_load(pipeline.read_text()) or {}).get("stages", {})
    reads = {name: {str(key) for key in body.get("do", body).get("params", [])}
             | set(re.findall(r"\$\{([\w.]+)\}", str(body.get("do", body).get("cmd", "")))) - {"item"}
             for name, body in stages.items()}
    return {name: keys for name, keys in reads.items() if not {schema.GROUP for schema in SCHEMAS} <= keys}


def readers(key: str, reads: dict[str, set[str]]) -> str:
    """The stages reading ``key`` (``train.lr``): those listing it or its section."""
    return ", ".join(f"`{stage}`" for stage, keys in reads.items() if key in keys or key.split(".")[0] in keys)


def params_reference(pipeline: Path) -> str:
    """docs/params.md: every key of params.yaml, by group, with its type, what its check allows, its description (the
    schemas: ``SCHEMAS``, ``settings.TOP_LEVEL``) and the stages of ``pipeline`` (dvc.yaml) that read it: the page is
    generated, never edited."""
    reads = stage_reads(pipeline)
    lines = ["# Params", "",
             f"Every key of `params.yaml`, generated from the groups' schemas and dvc.yaml (`{REFERENCE_COMMAND}`;",
             "`tests/test_schemas.py` fails when this page differs from them). The values live in `conf/`; a stage reads the",
             "keys its module's `PARAMS` names (= its `params:` in dvc.yaml), checked by its groups' schemas; the `params` stage",
             "checks them all, the rules across groups included (\"read by\": the other stages, by their params or command).", "",
             "| key | allowed | read by |", "|---|---|---|",
             *(f"| `{key}` | {check.allowed} | {readers(key, reads)} |" for key, check in TOP_LEVEL.items())]
    for schema in SCHEMAS:
        notes = field_notes(schema)
        lines += ["", f"## `{schema.GROUP}`", "", f"`{schema.__name__}` in `{schema.__module__}`, values in `conf/{schema.GROUP}/`.", "",
                  "| key | type | allowed | what it is | read by |", "|---|---|---|---|---|"]
        for item in fields(schema):
            check, key = item.metadata.get("check"), f"{schema.GROUP}.{item.name}"
            allowed = check.allowed if check else "(checked where it is read)"
            cells = [f"`{key}`", f"`{item.type}`", allowed, notes.get(item.name, ""), readers(key, reads)]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    print(params_reference(Path(sys.argv[1])), end="")
