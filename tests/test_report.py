"""``eagle3 report`` renders Vega-Lite charts offline: the PNG shows the series, the HTML holds SVG marks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from eagle3.launch import INTERRUPTED
from eagle3.report import render, slug
from support.repo import git_dvc_repo, with_sources
from support.pixels import count_color

PURPLE = (0x94, 0x5D, 0xD6)  # the first series colour of DVC's templates


def line_chart(points: list[tuple[int, float]]) -> dict:
    """A small chart shaped as DVC fills its linear template: inline data, title, axis titles."""
    return {
        "$schema": "https://vega.github.io/schema/vega-lite/v5.json",
        "title": "loss", "width": 120, "height": 80,
        "data": {"values": [{"step": s, "loss": v, "rev": "workspace"} for s, v in points]},
        "mark": {"type": "line", "strokeWidth": 3},
        "encoding": {"x": {"field": "step", "type": "quantitative", "title": "step"},
                     "y": {"field": "loss", "type": "quantitative", "title": "loss"},
                     "color": {"field": "rev", "legend": None, "scale": {"domain": ["workspace"], "range": ["#945dd6"]}}},
    }


def test_slug_names_files_by_stage_and_chart():
    assert slug("dvclive/evaluate/plots/custom/tau/heldout.json") == "evaluate-tau-heldout"
    assert slug("metrics/merge/plots/custom/length_histogram.json") == "merge-length_histogram"
    assert slug("loss") == "loss"


def test_render_draws_the_series_without_network(tmp_path):
    files = render({"loss": line_chart([(1, 4.0), (2, 3.0), (3, 2.5), (4, 1.0)])}, tmp_path)
    assert [f.name for f in files] == ["index.html", "loss.png"]
    assert count_color(tmp_path / "loss.png", PURPLE) > 50  # the line is drawn, not a blank canvas
    page = (tmp_path / "index.html").read_text()
    assert page.count("<svg") == 1 and "<path" in page and "http" not in page.split("<svg")[0]


def test_empty_chart_has_no_series_pixels(tmp_path):
    """The check above can fail: without data the PNG has axes but no purple line."""
    render({"loss": line_chart([])}, tmp_path)
    assert count_color(tmp_path / "loss.png", PURPLE) == 0


def plot_repo(tmp_path, charts: int) -> Path:
    """A git + DVC repo whose dvc.yaml declares ``charts`` plots of loss curves (no stage: the files are there)."""
    repo = git_dvc_repo(tmp_path / "repo")
    plots = [{f"loss{index}.json": {"x": "step", "y": "loss"}} for index in range(charts)]
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"make": {"cmd": "echo ${seed}", "outs": ["x"]}}, "plots": plots}))
    (repo / "params.yaml").write_text("seed: 1\n")
    set_curves(repo, charts, slope=1.0)
    return repo


def set_curves(repo: Path, charts: int, slope: float) -> None:
    for index in range(charts):
        (repo / f"loss{index}.json").write_text(json.dumps([{"step": s, "loss": 5 - slope * s} for s in range(5)]))


def report(repo: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "eagle3.cli", "report", *args], cwd=repo, env=with_sources(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_ctrl_c_during_report_is_one_line_and_keeps_the_previous_report_whole(tmp_path):
    charts = 24
    repo = plot_repo(tmp_path, charts)
    assert report(repo).wait() == 0
    before = {path.name: path.read_bytes() for path in (repo / "report").iterdir()}
    assert len(before) == charts + 1
    set_curves(repo, charts, slope=0.5)
    started = time.time()
    process = report(repo)
    while not [path for path in repo.rglob("*.png") if path.stat().st_mtime > started] and process.poll() is None:
        time.sleep(0.01)  # the first new chart is written: the report is midway
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == INTERRUPTED and err.splitlines() == [
        "eagle3 report: interrupted (Ctrl-C)"], err
    assert {path.name: path.read_bytes() for path in (repo / "report").iterdir()} == before
    assert [path.name for path in repo.iterdir() if path.name.startswith(".report")] == []


def test_report_with_a_params_file_that_is_not_yaml_says_so(tmp_path):
    repo = plot_repo(tmp_path, 1)
    (repo / "params.yaml").write_text("seed: [1\n")
    _, err = report(repo).communicate(timeout=60)
    assert err.splitlines() == ["error: `dvc plots show --json` drew no charts: workspace: unable to read: 'params.yaml', "
                                "YAML file structure is corrupted; correct it, then `eagle3 report` again"], err


def test_report_never_replaces_a_folder_of_other_files(tmp_path):
    repo = plot_repo(tmp_path, 1)
    (repo / "notes").mkdir()
    (repo / "notes" / "todo.txt").write_text("mine\n")
    _, err = report(repo, "--out", "notes").communicate(timeout=60)
    assert err.splitlines() == ["error: --out notes: holds other files than a report's (todo.txt), which the new report "
                                "would replace; choose another folder"], err
    assert (repo / "notes" / "todo.txt").read_text() == "mine\n"
