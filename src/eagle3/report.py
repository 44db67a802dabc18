"""``eagle3 report``: the charts of dvc.yaml's ``plots`` as files that open without a network.

    eagle3 report                     # the workspace's run -> report/index.html, report/<chart>.png
    eagle3 report main exp-1a2b3     # revisions side by side, as `dvc plots diff` draws them
    eagle3 report --out DIR

Why: the page ``dvc plots show`` writes loads the Vega libraries from a CDN and stays blank on a
machine without internet (GPU clusters often are). DVC still fills the charts (templates, data,
titles); ``vl-convert-python`` carries the Vega engine and renders each to SVG and PNG here.
``index.html`` holds every chart as inline SVG: one file, no scripts, opens anywhere. The folder is
written beside ``--out`` and renamed into place (its previous files go): never old and new charts mixed.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import subprocess
from pathlib import Path
from typing import Any

from eagle3.common import UserError, atomic_dir

PNG_SCALE = 2  # PNG pixels per Vega pixel: sharp enough for a README or a slide


def dvc_charts(revisions: list[str]) -> dict[str, dict[str, Any]]:
    """{plot id: Vega-Lite spec with its data inlined} as DVC fills them (``dvc plots show/diff --json``)."""
    command = ["dvc", "plots", "diff", *revisions, "--json"] if revisions else ["dvc", "plots", "show", "--json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"`{' '.join(command)}` failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    shown = json.loads(done.stdout)
    charts = {name: entry["content"] for name, entries in shown.get("data", {}).items()
              for entry in entries if entry.get("type") == "vega"}
    if not charts:
        raise UserError(f"`{' '.join(command)}` drew no charts: {unreadable(shown.get('errors') or [])}")
    return charts


def unreadable(errors: list[dict]) -> str:
    """Why DVC drew no charts: the first file it could not read (an invalid params.yaml, which dvc.yaml's
    interpolation reads), else no plot data yet."""
    if not errors:
        return "run the pipeline first (`dvc repro`)"
    first = errors[0]
    return f"{first.get('rev', 'workspace')}: {first.get('msg') or first.get('type')}; correct it, then `eagle3 report` again"


def slug(plot_id: str) -> str:
    """A file name for a plot id: ``dvclive/evaluate/plots/custom/tau/heldout.json`` -> ``evaluate-tau-heldout``."""
    parts = [p for p in Path(plot_id).with_suffix("").parts if p not in ("dvclive", "metrics", "plots", "custom")]
    return re.sub(r"[^A-Za-z0-9_]+", "-", "-".join(parts)).strip("-")


def render(charts: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    """Replace the folder ``out`` with ``<slug>.png`` per chart and ``index.html`` with all of them as inline SVG,
    written beside it first (an interrupted report leaves the previous one whole); returns the files."""
    foreign = sorted(path.name for path in out.iterdir() if not is_report_file(path)) if out.is_dir() else []
    if foreign or out.resolve() == Path.cwd().resolve():
        raise UserError(f"--out {out}: holds other files than a report's ({', '.join(foreign[:3]) or 'the repository'}), "
                        "which the new report would replace; choose another folder")
    with atomic_dir(out) as tmp:
        written = [out / path.name for path in write_charts(charts, tmp)]
    return written


def is_report_file(path: Path) -> bool:
    return path.is_file() and (path.name == "index.html" or path.suffix == ".png")


def write_charts(charts: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    """Write ``<slug>.png`` per chart and ``index.html`` into the folder ``out``; returns the files."""
    import vl_convert

    written, sections = [], []
    for plot_id, spec in charts.items():
        name = slug(plot_id)
        (out / f"{name}.png").write_bytes(vl_convert.vegalite_to_png(spec, scale=PNG_SCALE))
        svg = vl_convert.vegalite_to_svg(spec)
        sections.append(f'<figure id="{name}"><figcaption>{html.escape(name)}</figcaption>\n{svg}\n</figure>')
        written.append(out / f"{name}.png")
    page = out / "index.html"
    page.write_text("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>eagle3 report</title>\n"
                    "<style>body{font-family:sans-serif;margin:1em} figure{display:inline-block;vertical-align:top;margin:1em}"
                    " figcaption{color:#555}</style></head>\n"
                    "<body><h1>eagle3 report</h1>\n" + "\n".join(sections) + "\n</body></html>\n")
    return [page, *written]


def _report(args: argparse.Namespace) -> None:
    for path in render(dvc_charts(args.revisions), args.out):
        print(path)


def add_parser(commands) -> None:
    report = commands.add_parser("report", help="render dvc.yaml's plots to HTML and PNG files, offline")
    report.add_argument("revisions", nargs="*", help="git revisions or experiments to compare (default: the workspace)")
    report.add_argument("--out", type=Path, default=Path("report"), help="output folder (default: report)")
    report.set_defaults(func=_report)
