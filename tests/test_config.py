"""Hydra composition of conf/ into params.yaml, the same way `dvc exp run -S` does it."""

import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from eagle3.common import UserError
from eagle3.config import compose_params, conf_schema, validate
from eagle3.launch import USER_ERROR
from eagle3.params import PARAMS
from eagle3.prompt_sources.config import shard_range
from eagle3.prompt_sources.names import flat

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


def test_the_measured_scales_train_with_their_own_sizing_and_100k_with_the_default(tmp_path):
    assert compose(tmp_path).train.name == "demo"
    scales = ("1k", "10k", "20k", "100k")
    assert [compose(tmp_path, f"dataset={scale}").train.name for scale in scales] == ["1k", "10k", "10k", "default"]
    assert compose(tmp_path, "train=debug").train.name == "debug"  # a chosen train option wins over the scale's


@pytest.mark.parametrize("smaller, scale", [("demo", "1k"), ("1k", "10k"), ("10k", "20k"), ("20k", "100k")])
def test_every_scale_extends_the_one_below_with_contiguous_shards(tmp_path, smaller, scale):
    small, bigger = compose(tmp_path, f"dataset={smaller}"), compose(tmp_path, f"dataset={scale}")
    assert list(bigger.dataset.shards[: len(small.dataset.shards)]) == list(small.dataset.shards)
    ranges = [tuple(map(int, name.split("-"))) for name in bigger.dataset.shards]
    assert ranges[0][0] == 0 and all(stop == start for (_, stop), (start, _) in zip(ranges, ranges[1:]))
    assert len(bigger.dataset.shards) <= 16  # a shard pays a process start per stage; DVC's cost grows quadratically with stages
    assert bigger.dataset.sources == small.dataset.sources


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
    params = compose(tmp_path, f"model={model}", "layout=gpu8", "train.batch_tokens=6144")  # 8 rows of the demo's 768
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


def test_params_command_validates_before_writing(tmp_path):
    out = tmp_path / "params.yaml"
    compose_params([], conf_dir=CONF, output=out)
    good = out.read_bytes()
    for override in ("model.aux_layers=[100,200,300]", "dataset.shards=[000000-000032,000040-001000]"):
        with pytest.raises(UserError, match=r"params.yaml: (model.aux_layers \[100|dataset.shards = )"):
            compose_params([override], conf_dir=CONF, output=out)
        assert out.read_bytes() == good, override
    assert [p.name for p in tmp_path.iterdir()] == ["params.yaml"]  # no scratch left


BAD = [
    ("train.lr=-1", "params.yaml: train.lr = -1: must be a number > 0"),
    ("train.loss_normalisation=document", "params.yaml: train.loss_normalisation = 'document': must be one of ['token', 'sequence']"),
    ("evaluate.draft_tokens=0", "params.yaml: evaluate.draft_tokens = 0: must be an integer >= 1"),
    ("layout=gpu8", "params.yaml: train.batch_tokens = 768: must be a multiple of 6144: whole packed rows of train.pack_tokens (768) "
                    "for each of the 8 training processes (layout.train_procs x layout.nnodes); it makes 1 row a step, fewer than the "
                    "processes; the layout cuts the recipe's global batch, it never changes it"),
    ("model.aux_layers=[2,27,15]", "params.yaml: model.aux_layers [2, 27, 15] must be 3 ascending layer ids in [1, 30)"),
    ("model.aux_layers=[2,15,30]", "params.yaml: model.aux_layers [2, 15, 30] must be 3 ascending layer ids in [1, 30)"),
    ("model.aux_layers=[0,15,27]", "params.yaml: model.aux_layers [0, 15, 27] must be 3 ascending layer ids in [1, 30)"),
    ("dataset.shards=[000000-000032,000040-001000]",
     "params.yaml: dataset.shards = ['000000-000032', '000040-001000']: must be contiguous ranges (one ends at 000032, "
     "the next starts at 000040)"),
    ("merge.max_tokens=4", "params.yaml: merge.max_tokens = 4: must be >= merge.min_tokens (8)"),
    ("merge.train_prompts=0", "params.yaml: merge.train_prompts = 0: must be an integer >= 1, or null for all"),
    ("generate.top_p=0", "params.yaml: generate.top_p = 0: must be a number in (0, 1]"),
    ("generate.samples=0", "params.yaml: generate.samples = 0: must be an integer >= 1"),
    ("backend.cache_memory=1.5", "params.yaml: backend.cache_memory = 1.5: must be a number in (0, 1]"),
    ("generate.sample_temperatures=[0.7,-1]", "params.yaml: generate.sample_temperatures = [0.7, -1]: must be a non-empty "
     "list of numbers >= 0"),
    ("layout.verifier.tp=0", "params.yaml: layout.verifier = {'tp': 0, 'ep': 1}: must be {tp: an integer >= 1, ep: 1 or tp}"),
    ("layout.verifier.ep=3", "params.yaml: layout.verifier = {'tp': 1, 'ep': 3}: must be {tp: an integer >= 1, ep: 1 or tp}"),
    ("model.placement.tp=0", "params.yaml: model.placement = {'tp': 0, 'ep': 1}: must be {tp: an integer >= 1, ep: 1 or tp}"),
    ("extract.dtype=float16", "params.yaml: extract.dtype = 'float16': must be one of ['bfloat16', 'float8_e4m3fn']"),
    ("evaluate.sets=[heldout,mmlu]", "params.yaml: evaluate.sets = ['heldout', 'mmlu']: must be sets that dataset.eval_sets "
     "builds (['heldout', 'humaneval', 'math'])"),
    ("dataset.eval_sets.heldout=0", "params.yaml: evaluate.sets = ['heldout', 'humaneval', 'math']: must be sets with prompts: "
     "dataset.eval_sets gives ['heldout'] none; give them prompts, or list the others in evaluate.sets"),
    # Not a number a run can use: every float setting is finite (the schema machinery's rule, not each key's).
    ("train.lr=inf", "params.yaml: train.lr = inf: must be a finite number"),
    ("train.lr=1e400", "params.yaml: train.lr = inf: must be a finite number"),  # YAML reads it as infinity
    ("train.weight_decay=inf", "params.yaml: train.weight_decay = inf: must be a finite number"),
    ("generate.temperature=inf", "params.yaml: generate.temperature = inf: must be a finite number"),
    ("generate.sample_temperatures=[0.7,nan]", "params.yaml: generate.sample_temperatures[1] = nan: must be a finite number"),
    ("+model.draft_head.rope_theta=-inf", "params.yaml: model.draft_head.rope_theta = -inf: must be a finite number"),
]


@pytest.mark.parametrize("override,message", BAD, ids=[b[0].split("=")[0] for b in BAD])
def test_a_bad_value_is_one_line_naming_key_value_and_what_is_allowed(tmp_path, override, message):
    with pytest.raises(UserError) as caught:
        compose(tmp_path, override)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_the_committed_params_are_valid():
    validate(OmegaConf.load(ROOT / "params.yaml"))


TRAIN = ["-m", "eagle3.train", "verifier", "merged", "hidden", "out", "--checkpoints", "ckpt", "--live", "live", "--nnodes", "1",
         "--nproc-per-node", "1", "--rdzv-endpoint", "localhost:0"]
STAGES = [  # what `dvc exp run -S key=value` hands a stage: params.yaml with the bad value, unchecked
    (["-m", "eagle3.prompts", "verifier", "out", "--sources", "sources"], "dataset.shards", ["000000-000032", "000040-001000"],
     "dataset.shards = ['000000-000032', '000040-001000']: must be contiguous ranges (one ends at 000032, the next "
     "starts at 000040)"),
    (["-m", "eagle3.generate", "verifier", "prompts.jsonl", "out"], "generate.temperature", -1,
     "generate.temperature = -1: must be a number >= 0"),
    (["-m", "eagle3.extract", "verifier", "generated", "out"], "model.aux_layers", [2, 27, 15],
     "model.aux_layers [2, 27, 15] must be 3 ascending layer ids >= 1 (and below the verifier's layer count)"),
    (TRAIN, "train.lr", -1, "train.lr = -1: must be a number > 0"),
    (["-m", "eagle3.evaluate", "verifier", "drafter", "prompts", "out"], "evaluate.draft_tokens", 0,
     "evaluate.draft_tokens = 0: must be an integer >= 1"),
    # A misspelt key of a stage's own section (`dvc repro -s` skips the params stage's check against conf/).
    (["-m", "eagle3.generate", "verifier", "prompts.jsonl", "out"], "generate.temprature", 0.5,
     "generate.temprature: unknown key (did you mean generate.temperature?)"),
    (TRAIN, "train.lrr", 0.1, "train.lrr: unknown key (did you mean train.lr?)"),
]


@pytest.mark.parametrize("argv,key,value,message", STAGES, ids=[s[1] for s in STAGES])
def test_a_stage_refuses_a_bad_param_in_one_line_before_anything(tmp_path, argv, key, value, message):
    params = OmegaConf.load(ROOT / "params.yaml")
    OmegaConf.update(params, key, value)
    OmegaConf.save(params, tmp_path / "params.yaml")
    result = subprocess.run([sys.executable, *argv, "--params", "params.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == USER_ERROR, result.stderr
    assert result.stderr.splitlines() == [f"error: params.yaml: {message}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]  # nothing written


def test_a_refusal_names_the_params_file_a_command_was_given(tmp_path):
    """`--params FILE` (a stage run by hand) and `eagle3 params --output FILE`: the line names FILE, not params.yaml."""
    params = OmegaConf.load(ROOT / "params.yaml")
    OmegaConf.update(params, "generate.temperature", -1)
    OmegaConf.save(params, tmp_path / "experiment.yaml")
    stage = subprocess.run([sys.executable, "-m", "eagle3.generate", "verifier", "prompts.jsonl", "out", "--params=experiment.yaml"],
                           cwd=tmp_path, capture_output=True, text=True)
    assert stage.stderr.splitlines() == ["error: experiment.yaml: generate.temperature = -1: must be a number >= 0"]
    composed = subprocess.run([sys.executable, "-m", "eagle3.cli", "params", "-S", "train.lr=-1", "--conf", str(CONF),
                               "--output", "conf-test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert composed.stderr.splitlines() == ["error: conf-test.yaml: train.lr = -1: must be a number > 0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["experiment.yaml"]  # nothing written


def test_params_command_refuses_in_one_line_with_the_status_of_every_eagle3_command(tmp_path):
    """docs/guarantees.md: exit status 1 from `eagle3 params`, as from the other commands."""
    result = subprocess.run([sys.executable, "-m", "eagle3.cli", "params", "-S", "train.lr=-1", "--conf", str(CONF),
                             "--output", "params.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.splitlines() == ["error: params.yaml: train.lr = -1: must be a number > 0"]
    assert "1 from `eagle3 params` as from every `eagle3` command" in " ".join((ROOT / "docs/guarantees.md").read_text().split())


def test_every_recipe_of_the_sweep_is_a_valid_change_of_the_gpu_scales(tmp_path):
    """benchmarks/recipe_sweep.py's answer lengths and recipes override keys the 1k params have, with valid values."""
    sweep = runpy.run_path(str(ROOT / "benchmarks" / "recipe_sweep.py"))
    base = compose(tmp_path, "dataset=1k", "layout=gpu1")
    for name, overrides in {**sweep["DATA"], **sweep["RECIPES"]}.items():
        keys = {k: v for k, v in {**sweep["DATA"].get(overrides.get("data"), {}), **overrides}.items() if k != "data"}
        assert all(OmegaConf.select(base, k) is not None for k in keys), name
        validate(OmegaConf.merge(base, OmegaConf.from_dotlist([f"{k}={v}" for k, v in keys.items()])))


UNKNOWN = [  # a `+key=value` override (the form `dvc exp run -S` suggests) adds a key no conf/ file declares
    ("+train.lrr=0.1", "params.yaml: train.lrr: unknown key (did you mean train.lr?)"),
    ("+merge.draft_vocab_sise=256", "params.yaml: merge.draft_vocab_sise: unknown key (did you mean merge.draft_vocab_size?)"),
    ("+model.source.revison=main", "params.yaml: model.source.revison: unknown key (did you mean model.source.revision?)"),
    ("+evaluate.tree.depth=3", "params.yaml: evaluate.tree.depth: unknown key (no file of conf/evaluate/ declares it)"),
    ("+colour=1", "params.yaml: colour: unknown key (conf/config.yaml does not declare it)"),
]


@pytest.mark.parametrize("override,message", UNKNOWN, ids=[u[0] for u in UNKNOWN])
def test_a_key_no_conf_file_declares_is_refused_in_one_line_and_nothing_is_written(tmp_path, override, message):
    out = tmp_path / "params.yaml"
    with pytest.raises(UserError) as caught:
        compose_params([override], conf_dir=CONF, output=out)
    assert str(caught.value).replace(str(CONF), "conf") == message
    assert list(tmp_path.iterdir()) == []


MISSING = [  # a `~key` override removes what the chosen options compose, which a stage reads
    ("~train.lr", "params.yaml: train.lr: missing (conf/ composes it for train=demo); set it, or recompose params.yaml "
                  "with `eagle3 params`"),
    ("~model.language_model.prefix", "params.yaml: model.language_model.prefix: missing (conf/ composes it for "
                                     "model=smollm2-135m); set it, or recompose params.yaml with `eagle3 params`"),
    ("~seed", "conf/: Interpolation key 'seed' not found"),  # generate.seed reads it: once a traceback
]


@pytest.mark.parametrize("override,message", MISSING, ids=[m[0] for m in MISSING])
def test_a_key_the_chosen_options_compose_is_required_and_nothing_is_written(tmp_path, override, message):
    out = tmp_path / "params.yaml"
    with pytest.raises(UserError) as caught:
        compose_params([override], conf_dir=CONF, output=out)
    assert str(caught.value) == message
    assert list(tmp_path.iterdir()) == []


def test_the_known_keys_are_those_conf_declares_in_any_option_of_the_group(tmp_path):
    """conf/ is the schema: a key one option declares is known with every option; a key added to a conf
    file is known at once; the open mappings take any entry."""
    compose(tmp_path, "backend=sglang")  # keys only sglang's option declares
    compose(tmp_path, "+backend.port=30001")  # with backend=local: sglang declares it
    compose(tmp_path, "+model.draft_head.rope_theta=10000.0", "+dataset.eval_sets.mine=3")
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    train = conf / "train" / "default.yaml"
    train.write_text(train.read_text() + "new_knob: false       # a new key, declared with its comment\n")
    compose_params(["train.new_knob=true"], conf_dir=conf, output=tmp_path / "params.yaml")
    assert OmegaConf.load(tmp_path / "params.yaml").train.new_knob is True
    assert set(conf_schema(CONF)) == set(PARAMS)  # every section is the params stage's


def test_a_source_entry_takes_the_keys_of_its_kind(tmp_path):
    params = compose(tmp_path)
    params.dataset.sources = [{"kind": "jsonl", "path": "data/sources/a.jsonl", "weight": 1, "folders": ["x"]}]
    with pytest.raises(UserError, match=r"^params.yaml: dataset.sources\[0\].folders: unknown key \(a jsonl source has "
                                        r"\['kind', 'label', 'weight', 'match', 'path'\]\)$"):
        validate(params)
    params.dataset.sources = [{"kind": "hf", "name": "x", "spilt": "train"}]
    with pytest.raises(UserError, match=r"^params.yaml: dataset.sources\[0\].spilt: unknown key \(did you mean "
                                        r"dataset.sources\[0\].split\?\)$"):
        validate(params)


@pytest.mark.parametrize("overrides,greedy", [
    (["generate.samples=3", "generate.sample_temperatures=[0]"], [0, 1, 2]),
    (["generate.samples=3", "generate.temperature=0.7", "generate.sample_temperatures=[0]"], [1, 2]),
    (["generate.samples=2", "generate.sample_temperatures=[0,0.7]"], [0, 1]),
])
def test_a_second_greedy_answer_is_refused(tmp_path, overrides, greedy):
    """Greedy decoding has one answer: a second answer at temperature 0 is its copy (generation for nothing)."""
    with pytest.raises(UserError) as caught:
        compose(tmp_path, *overrides)
    assert str(caught.value).startswith(f"params.yaml: generate.sample_temperatures = ") and "\n" not in str(caught.value)
    assert f"answers {greedy} would be at temperature 0" in str(caught.value)
    compose(tmp_path, "generate.samples=2", "generate.temperature=0.7", "generate.sample_temperatures=[0]")  # one greedy answer
    compose(tmp_path, "generate.samples=3", "generate.sample_temperatures=[0.7,1.0]")
