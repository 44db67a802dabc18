"""A setting is declared once: every conf/ group has a schema (``config.SCHEMAS``) with exactly the keys
its conf/ files declare (the union over the group's options), and no value of its own; the keys of no
group are checked by ``config.TOP_LEVEL``."""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, fields
from typing import ClassVar

import pytest
from omegaconf import OmegaConf

from eagle3.common import UserError
from eagle3.config import SCHEMAS, TOP_LEVEL, conf_schema, validate
from eagle3.schema import ABSENT, OPTION_NAME, POSITIVE, check_schema, setting
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
