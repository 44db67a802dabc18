"""A setting is declared once: every conf/ group has a schema (``config.SCHEMAS``) with exactly the keys
its conf/ files declare (the union over the group's options), and no value of its own; the keys of no
group are checked by ``settings.TOP_LEVEL``. Each key's line of description is its schema field's (docs/params.md is
generated from them), conf/ holds values and their reasons, and a stage names what it reads through the schemas."""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import ClassVar

import pytest
from omegaconf import OmegaConf

from eagle3.common import UserError
from eagle3.config import REFERENCE_COMMAND, SCHEMAS, conf_schema, field_notes, params_reference, validate
from eagle3.lm.spec import ModelSettings
from eagle3.schema import ABSENT, POSITIVE, check_schema, setting
from eagle3.settings import OPTION_NAME, TOP_LEVEL, StageParams, keys_of, section
from eagle3.training.config import TrainConfig
from support.repo import ROOT


def test_every_conf_group_has_one_schema_and_every_other_key_a_top_level_check():
    groups = sorted(path.name for path in (ROOT / "conf").iterdir() if path.is_dir())
    assert sorted(schema.GROUP for schema in SCHEMAS) == groups
    assert set(conf_schema(ROOT / "conf")) - set(groups) == set(TOP_LEVEL)


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda schema: schema.GROUP)
def test_a_schema_has_exactly_the_keys_its_conf_files_declare(schema):
    declared = set(conf_schema(ROOT / "conf")[schema.GROUP]) - {OPTION_NAME}
    named = {item.name for item in fields(schema)}
    assert not declared - named, f"conf/{schema.GROUP}/ keys without a schema field: {sorted(declared - named)}"
    assert not named - declared, f"{schema.__name__} fields without a conf/{schema.GROUP}/ key: {sorted(named - declared)}"


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda schema: schema.GROUP)
def test_every_key_has_its_line_of_description(schema):
    """The comment after a field's declaration: what docs/params.md says of the key."""
    notes = field_notes(schema)
    assert not [item.name for item in fields(schema) if not notes.get(item.name)]


def restated(comment: str, description: str) -> bool:
    """A conf comment that begins as its key's description does (four words, or all of a shorter one): the description
    said twice. What a conf comment keeps is why this value (docs/params.md says what the key is)."""
    said, declared = (re.sub(r"[^\w]+", " ", text.lower()).split() for text in (comment, description))
    same = next((n for n, (a, b) in enumerate(zip(said, declared)) if a != b), min(len(said), len(declared)))
    return same >= 4 or (same >= 2 and same == len(declared))


def key_comments(path: Path) -> list[tuple[str, str]]:
    """(key, comment) of each top-level ``key: value  # comment`` line of a conf file."""
    found = (re.match(r"^(\w+):.*?\s#\s*(.*)$", line) for line in path.read_text().splitlines())
    return [(match.group(1), match.group(2)) for match in found if match]


def test_conf_holds_values_and_reasons_not_the_keys_descriptions():
    notes = {schema.GROUP: field_notes(schema) for schema in SCHEMAS}
    repeated = [f"{path.relative_to(ROOT)}: {key}: {comment!r}" for path in sorted((ROOT / "conf").glob("*/*.yaml"))
                for key, comment in key_comments(path) if restated(comment, notes[path.parent.name].get(key, ""))]
    assert not repeated, "conf comments restating the schema's description:\n" + "\n".join(repeated)


def code_field_comments(path: Path) -> list[tuple[str, str, str]]:
    """(class, field, comment) of each commented field line ``    name: type  # comment`` of a source file; a comment
    naming its key first (``extract.dtype: ...``) without that name."""
    found, owner = [], None
    for line in path.read_text().splitlines():
        owner = re.match(r"^class (\w+)", line).group(1) if line.startswith("class ") else owner
        field = re.match(r"^    (\w+): [^#]*?\s#\s*(.*)$", line)
        if field and owner:
            found.append((owner, field.group(1), re.sub(r"^\w+\.\w+:\s*", "", field.group(2))))
    return found


def test_the_code_names_a_key_it_holds_without_describing_it_again():
    """An object a stage's function receives (capture.Settings, backends.base.Generation, ...) names the key a field
    comes from (``# extract.dtype``); what the key is, its schema says."""
    described = {}
    for schema in SCHEMAS:
        for key, note in field_notes(schema).items():
            described.setdefault(key, []).append(note)
    schemas = {schema.__name__ for schema in SCHEMAS}
    repeated = [f"{path.relative_to(ROOT)}: {owner}.{name}: {comment!r}" for path in sorted((ROOT / "src" / "eagle3").rglob("*.py"))
                for owner, name, comment in code_field_comments(path)
                if owner not in schemas and any(restated(comment, note) for note in described.get(name, []))]
    assert not repeated, "field comments restating a key's description (its schema's line):\n" + "\n".join(repeated)


def test_the_restatement_rule_sees_what_it_refuses():
    assert restated("tokens per sequence; longer ones are truncated", "tokens per sequence; longer ones are truncated and counted")
    assert restated("max global gradient norm", "max global gradient norm")
    assert not restated("batches group similar lengths", "padded tokens per verifier forward")
    assert not restated("a free port on this node", "torchrun rendezvous host:port")


def test_a_stage_names_only_keys_a_schema_declares():
    """A stage's PARAMS names each key through its group's schema: a key no schema declares fails at import."""
    with pytest.raises(ValueError, match=r"ModelSettings declares no \['aux_layer'\]"):
        keys_of(ModelSettings, "aux_layer")
    with pytest.raises(ValueError, match=r"no top-level key \['model'\]"):
        StageParams("model")
    params = StageParams("seed", section(TrainConfig), keys_of(ModelSettings, "name", "draft_head"))
    assert list(params) == ["seed", "train", "model.name", "model.draft_head"] and params.schemas == (TrainConfig, ModelSettings)


def test_docs_params_md_is_generated_from_the_schemas():
    assert (ROOT / "docs" / "params.md").read_text() == params_reference(ROOT / "dvc.yaml"), f"regenerate it: {REFERENCE_COMMAND}"


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda schema: schema.GROUP)
def test_a_schema_holds_no_defaults(schema):
    """The values live in conf/ alone: a field with a default would be a second place for one."""
    defaulted = [item.name for item in fields(schema) if item.default is not MISSING or item.default_factory is not MISSING]
    assert not defaulted


@dataclass(frozen=True)
class Probe:
    GROUP: ClassVar[str] = "probe"
    rows: int = setting(POSITIVE)


def test_a_schema_checks_only_the_keys_a_view_holds():
    check_schema(Probe, lambda key: ABSENT)  # nothing held: nothing refused
    with pytest.raises(UserError, match=r"^params.yaml: probe.rows = 0: must be an integer >= 1$"):
        check_schema(Probe, {"probe.rows": 0}.get)


@dataclass(frozen=True)
class Loose:
    GROUP: ClassVar[str] = "loose"
    anything: dict = setting()  # no check of its own


@pytest.mark.parametrize("value,where", [(float("inf"), "loose.anything = inf"), (float("-inf"), "loose.anything = -inf"),
                                         ({"a": [1.0, float("nan")]}, "loose.anything.a[1] = nan")])
def test_no_setting_takes_a_non_finite_number_whatever_its_check(value, where):
    """YAML reads .inf, .nan and 1e400 as floats no setting can use: the machinery refuses them in every field."""
    with pytest.raises(UserError, match=rf"^params.yaml: {re.escape(where)}: must be a finite number$"):
        check_schema(Loose, {"loose.anything": value}.get)
    with pytest.raises(UserError, match=r"must be a finite number$"):
        check_schema(Probe, {"probe.rows": float("inf")}.get)


def test_validate_runs_the_schemas_cross_key_rules():
    """The schemas' relations (TrainConfig's, DatasetSettings', EvaluateConfig's, MixtureSettings', LayoutSettings',
    ModelSettings', GenerateSettings'): rules over several keys, of any group, one line each."""
    with pytest.raises(UserError, match=r"train.batch_tokens = 3000: must be a multiple of train.pack_tokens \(2048\)"):
        validate(OmegaConf.create({"train": {"batch_tokens": 3000, "pack_tokens": 2048}}))
    with pytest.raises(UserError, match=r"dataset.shards = \['000032-001000'\]: must be contiguous ranges starting at 000000"):
        validate(OmegaConf.create({"dataset": {"shards": ["000032-001000"]}}))
    with pytest.raises(UserError, match=r"^params.yaml: evaluate.sets = \['code'\]: must be sets that dataset.eval_sets builds"):
        validate(OmegaConf.create({"evaluate": {"sets": ["code"]}, "dataset": {"eval_sets": {"heldout": 8}}}))
    with pytest.raises(UserError, match=r"^params.yaml: merge.max_tokens = 4: must be >= merge.min_tokens \(8\)$"):
        validate(OmegaConf.create({"merge": {"min_tokens": 8, "max_tokens": 4}}))
    with pytest.raises(UserError, match=r"^params.yaml: layout.dtype = 'bfloat16': must be float32 on the CPU"):
        validate(OmegaConf.create({"layout": {"device": "cpu", "dtype": "bfloat16"}}))
    with pytest.raises(UserError, match=r"^params.yaml: model.aux_layers \[2, 15, 30\] must be 3 ascending layer ids in \[1, 30\)$"):
        validate(OmegaConf.create({"model": {"num_layers": 30, "aux_layers": [2, 15, 30]}}))
    with pytest.raises(UserError, match=r"^params.yaml: generate.max_new_tokens = 64: must be smaller than model.max_position_embeddings"):
        validate(OmegaConf.create({"generate": {"max_new_tokens": 64}, "model": {"max_position_embeddings": 64}}))
