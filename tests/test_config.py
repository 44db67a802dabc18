"""Hydra composition of conf/ into params.yaml, the same way `dvc exp run -S` does it."""

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from eagle3.common import UserError
from eagle3.config import compose_params, shard_range, validate
from eagle3.prompts import flat

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def compose(tmp_path, *overrides):
    out = tmp_path / "params.yaml"
    compose_params(list(overrides), conf_dir=CONF, output=out)
    return OmegaConf.load(out)


def test_committed_params_equal_the_composed_defaults(tmp_path):
    assert OmegaConf.to_container(compose(tmp_path)) == yaml.safe_load((ROOT / "params.yaml").read_text())


def test_defaults_are_the_embedded_demo(tmp_path):
    params = compose(tmp_path)
    assert (params.dataset.name, params.model.name, params.layout.name, params.backend.name) == (
        "demo", "smollm2-135m", "cpu", "local")


@pytest.mark.parametrize("scale", ["1k", "10k", "100k"])
def test_every_scale_extends_the_demo_with_contiguous_shards(tmp_path, scale):
    demo, bigger = compose(tmp_path, "dataset=demo"), compose(tmp_path, f"dataset={scale}")
    assert list(bigger.dataset.shards[: len(demo.dataset.shards)]) == list(demo.dataset.shards)
    assert len(bigger.dataset.shards) <= 100  # DVC's cost grows quadratically with stage count
    assert bigger.dataset.sources == demo.dataset.sources


def test_the_evals_sources_split_its_folders_without_overlap(tmp_path):
    """math and code name their folders; chat excludes them (and the licensed ones): no folder twice."""
    sources = {spec.label: spec for spec in compose(tmp_path).dataset.sources}
    math, code = set(sources["math"].folders), set(sources["code"].folders)
    excluded = set(flat(sources["chat"].exclude))
    assert not math & code and math | code <= excluded and not sources["chat"].get("folders")


def test_every_group_file_has_a_name_matching_its_file():
    for path in CONF.glob("*/[!_]*.yaml"):  # `_x.yaml`: a part the options include, not an option
        assert yaml.safe_load(path.read_text())["name"] == path.stem, path


@pytest.mark.parametrize("model", ["llama-3.1-8b", "kimi-k2.5"])
def test_real_model_descriptions_compose(tmp_path, model):
    params = compose(tmp_path, f"model={model}", "layout=gpu8")
    assert params.model.source.kind == "hf" and params.model.copy_weights is False
    assert params.layout.server.tp == 8


def test_unknown_option_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="dataset"):
        compose(tmp_path, "dataset=5k")


def test_impossible_combinations_are_refused(tmp_path):
    params = compose(tmp_path)
    params.model.aux_layers = [15, 2, 27]
    with pytest.raises(UserError, match="aux_layers"):
        validate(params)
    params = compose(tmp_path)
    params.dataset.shards = ["000000-000032", "000040-001000"]
    with pytest.raises(UserError, match="contiguous"):
        validate(params)
    with pytest.raises(UserError, match="range"):
        shard_range("first")
