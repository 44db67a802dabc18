"""The real pipeline: `dvc repro` and `dvc exp run -S` in a temporary git repo (tiny random verifier)."""

import csv
import io
import json
import shlex

import pytest
import yaml

from support.pipeline import FAST, SMALL, add_dataset, overrides, stage_lines
from support.pixels import count_color
from support.repo import ROOT, run

BIGGER = {"name": "bigger", "shards": ["000000-000008", "000008-000012"],
          "eval_sets": {"heldout": 2, "humaneval": 1, "math": 1}}


HEADLINE = {"heldout.tau", "heldout.tree_tau", "heldout.baseline_tau", "heldout.ngram_tau",  # no speedup: the demo times once
            "humaneval.tau", "humaneval.baseline_tau", "val.acc_0", "val.sim_accept_len", "tokens_trained", "hidden_state_bytes",
            "dataset.name", "model.name"}
PURPLE = (0x94, 0x5D, 0xD6)  # the first series colour of DVC's templates


def readme_exp_show() -> list[str]:
    """The compact `dvc exp show` command of the README."""
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("dvc exp show --drop"))
    return shlex.split(line)


@pytest.mark.slow
def test_repro_then_scale_up_recomputes_only_new_shards(make_project):
    repo = make_project(*FAST[1:])
    for spec in (SMALL, BIGGER):
        add_dataset(repo, spec)
    run(["eagle3", "params", *overrides(*FAST, "dataset=small")], repo)
    first = run(["dvc", "repro"], repo)
    assert {"verifier", "prompts"} <= set(stage_lines(first.stdout))
    assert "up to date" in run(["dvc", "status"], repo).stdout
    check_results(repo)
    prompt_shard = (repo / "data" / "prompts" / "shards" / "000000-000008.jsonl").read_bytes()
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "small"], repo)

    # Like Hydra, `dvc exp run -S` composes from the defaults: repeat every non-default choice.
    # Up to merge, the first stage that reads every shard: what is reused is decided before it.
    scaled = run(["dvc", "exp", "run", "merge", *overrides(*FAST, "dataset=bigger")], repo)
    ran = stage_lines(scaled.stdout)
    assert "verifier" not in ran and "prompts" in ran
    assert not [s for s in ran if s.endswith("@000000-000008")], ran  # the first shard is reused
    assert {"generate@000008-000012", "extract@000008-000012", "merge"} <= set(ran), ran
    assert (repo / "data" / "prompts" / "shards" / "000000-000008.jsonl").read_bytes() == prompt_shard
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert params["dataset"]["name"] == "bigger" and params["model"]["name"] == "tiny-random"
    shown = json.loads(run(["dvc", "exp", "show", "--json"], repo).stdout)
    assert "bigger" in json.dumps(shown)


def check_results(repo):
    """The README's compact table has the headline columns and fits a terminal; the report draws every chart."""
    columns = next(csv.reader(io.StringIO(run([*readme_exp_show(), "--csv"], repo).stdout)))
    assert HEADLINE <= set(columns) and len(columns) < 40, columns
    metrics = json.loads(run(["dvc", "metrics", "show", "--json"], repo).stdout)
    assert [path for rev in metrics.values() for path in rev["data"]] == ["metrics/summary.json"]  # details are not metrics
    charts = json.loads(run(["dvc", "plots", "show", "--json"], repo).stdout)
    expected = {"loss", "simulated_acceptance", "dvclive/train/plots/custom/ttt_acceptance.json",
                "metrics/merge/plots/custom/length_histogram.json"} | {
        f"dvclive/evaluate/plots/custom/{kind}/{name}.json" for kind in ("acceptance", "tau", "speedup") for name in ("heldout", "humaneval")}
    assert not charts.get("errors") and expected <= set(charts["data"]), charts.get("errors")
    files = run(["eagle3", "report", "--out", "report"], repo).stdout.split()
    assert len(files) == len(charts["data"]) + 1 and files[0].endswith("index.html")
    assert count_color(repo / "report" / "loss.png", PURPLE) > 500  # the curves are drawn
    page = (repo / "report" / "index.html").read_text()
    assert page.count("<svg") == len(charts["data"]) and page.count("<path") > 4 * len(charts["data"])
