"""``eagle3 report`` renders Vega-Lite charts offline: the PNG shows the series, the HTML holds SVG marks."""

from __future__ import annotations

from eagle3.report import render, slug
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
