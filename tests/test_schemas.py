"""A setting is declared once: every conf/ group has a schema (``config.SCHEMAS``) with exactly the keys
its conf/ files declare (the union over the group's options), and no value of its own; the keys of no
group are checked by ``settings.TOP_LEVEL``. Each key's line of description is its schema field's (docs/params.md is
generated from them), conf/ holds values and their reasons (its groups' files and conf/config.yaml's group defaults), no
class outside ``SCHEMAS`` declares a setting, an object a stage's function receives names only declared keys, and a stage
names what it reads through the schemas."""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import ClassVar

import pytest
from omegaconf import OmegaConf

from eagle3.common import UserError
from eagle3.config import REFERENCE_COMMAND, SCHEMAS, conf_schema, field_notes, params_reference, validate
from eagle3.decoding.config import EvaluateConfig, TreeShape
from eagle3.lm.spec import ModelSettings
from eagle3.schema import ABSENT, POSITIVE, check_schema, read_section, setting
from eagle3.settings import OPTION_NAME, TOP_LEVEL, StageParams, keys_of, section
from eagle3.training.config import TrainConfig
from support.repo import ROOT, project_params


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


def key_comments(text: str, group: str | None) -> list[tuple[str, str]]:
    """(dotted key, comment) of each ``key: value  # comment`` line of a group's conf file (``group``: its keys at the
    top), or of conf/config.yaml (``group`` None: its own keys at the top, a group's defaults one level in)."""
    found, section = [], None
    for line in text.splitlines():
        match = re.match(r"^( {2})?(\w+):.*?\s#\s*(.*)$", line)
        section = re.match(r"^(\w+):", line).group(1) if re.match(r"^\w+:", line) else section
        if match and group is not None and not match.group(1):
            found.append((f"{group}.{match.group(2)}", match.group(3)))
        elif match and group is None:
            found.append((f"{section}.{match.group(2)}" if match.group(1) else match.group(2), match.group(3)))
    return found


def conf_comments() -> list[tuple[str, str, str]]:
    """(file, dotted key, comment) of every commented key line of conf/ that can restate a schema's description."""
    files = [(ROOT / "conf" / "config.yaml", None), *((path, path.parent.name) for path in sorted((ROOT / "conf").glob("*/*.yaml")))]
    return [(str(path.relative_to(ROOT)), key, comment) for path, group in files for key, comment in key_comments(path.read_text(), group)]


def test_conf_holds_values_and_reasons_not_the_keys_descriptions():
    notes = {f"{schema.GROUP}.{name}": note for schema in SCHEMAS for name, note in field_notes(schema).items()}
    repeated = [f"{where}: {key}: {comment!r}" for where, key, comment in conf_comments() if restated(comment, notes.get(key, ""))]
    assert not repeated, "conf comments restating the schema's description:\n" + "\n".join(repeated)


def test_every_conf_file_s_comments_are_read():
    """conf/config.yaml's group defaults (model.placement) are compared as the groups' own files are."""
    assert key_comments("seed: 0  # why\nmodel:  # a\n  placement: {}  # b\n    tp: 1  # c\n", None) == [
        ("seed", "why"), ("model", "a"), ("model.placement", "b")]
    assert key_comments("name: x  # a\nsub:\n  inner: 1  # b\n", "train") == [("train.name", "a")]
    assert {key for _, key, _ in conf_comments()} >= {"seed", "model.language_model", "model.placement", "train.lr"}


def test_no_key_is_declared_by_two_schemas():
    """One class per group, and no class but those of ``SCHEMAS`` declaring settings (a second schema of a group's keys,
    e.g. a stage's own typed copy, would be a second declaration of each)."""
    groups = [schema.GROUP for schema in SCHEMAS]
    assert len(groups) == len(set(groups)), groups
    schemas = {schema.__name__ for schema in SCHEMAS}
    owners = sorted({f"{path.relative_to(ROOT)}: {owner}" for path in (ROOT / "src" / "eagle3").rglob("*.py")
                     for owner, _, declaration in class_fields(path) if "= setting(" in declaration and owner not in schemas})
    assert not owners, "classes declaring settings outside config.SCHEMAS:\n" + "\n".join(owners)


RECEIVED = {"hidden_states/capture.py": "Settings", "backends/base.py": "Generation", "decoding/settings.py": "Settings"}


def test_every_field_a_stage_s_function_receives_names_its_key():
    """capture.Settings, Generation and evaluate's Settings hold params values under the code's names: each field's
    comment names the key it holds (``workers: int  # layout.extract_workers``), so none is a key's second name."""
    groups = "|".join([schema.GROUP for schema in SCHEMAS] + list(TOP_LEVEL))
    unnamed = [f"{path}: {owner}.{name}" for path, cls in RECEIVED.items()
               for owner, name, line in class_fields(ROOT / "src" / "eagle3" / path)
               if owner == cls and not re.search(rf"#.*\b(?:{groups})\.\w+", line)]
    assert not unnamed, "fields naming no key:\n" + "\n".join(unnamed)


def test_a_field_names_only_keys_a_schema_declares():
    """A field of an object a stage's function receives names the key it holds (``# extract.dtype``): a key that no
    schema declares (renamed, removed) is a stale second name for one."""
    declared = {f"{schema.GROUP}.{item.name}" for schema in SCHEMAS for item in fields(schema)} | set(TOP_LEVEL)
    declared |= {f"{schema.GROUP}.{OPTION_NAME}" for schema in SCHEMAS}
    stale = [f"{path.relative_to(ROOT)}: {owner}.{name}: {key}" for path in sorted((ROOT / "src" / "eagle3").rglob("*.py"))
             for owner, name, declaration in class_fields(path)
             for key in re.findall(r"#\s*((?:" + "|".join(schema.GROUP for schema in SCHEMAS) + r")\.\w+)", declaration)
             if key not in declared]
    assert not stale, "fields naming keys no schema declares:\n" + "\n".join(stale)


def class_fields(path: Path) -> list[tuple[str, str, str]]:
    """(class, field, line) of each field line ``    name: type ...`` of a top-level class of a source file."""
    found, owner = [], None
    for line in path.read_text().splitlines():
        owner = re.match(r"^class (\w+)", line).group(1) if line.startswith("class ") else owner if line.startswith(" ") or not line else None
        field = re.match(r"^    (\w+): ", line)
        if field and owner:
            found.append((owner, field.group(1), line))
    return found


def code_field_comments(path: Path) -> list[tuple[str, str, str]]:
    """(class, field, comment) of each commented field line ``    name: type  # comment`` of a source file; a comment
    naming its key first (``extract.dtype: ...``) without that name."""
    commented = ((owner, name, re.match(r"^    \w+: [^#]*?\s#\s*(.*)$", line)) for owner, name, line in class_fields(path))
    return [(owner, name, re.sub(r"^\w+\.\w+:\s*", "", found.group(1))) for owner, name, found in commented if found]


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


def test_a_section_is_read_as_its_schema_declares():
    """``read_section``: each field as its ``read`` says, the option's name left out, a missing key one line."""
    assert read_section(Probe, {"name": "small", "rows": 3}) == Probe(rows=3)
    with pytest.raises(UserError, match=r"^params.yaml: probe.rows: missing; set it, or recompose params.yaml with `eagle3 params`$"):
        read_section(Probe, {"name": "small"})
    evaluate = EvaluateConfig.from_params(project_params().evaluate)
    assert isinstance(evaluate.batch_sizes, tuple) and isinstance(evaluate.sets, tuple)
    assert evaluate.tree is None or isinstance(evaluate.tree, TreeShape)
    assert read_section(EvaluateConfig, {**project_params().evaluate, "tree": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}}
                        ).tree == TreeShape.chain(2)


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
