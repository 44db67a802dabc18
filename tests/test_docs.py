"""The README and docs/ stay true: their links resolve, their overrides compose, and the modules,
commands, scripts and files they name exist. Nothing here runs a stage: a documented override is
composed with eagle3's own `compose_params` into a temporary file, an `eagle3 ...` command line is
parsed by the CLI's own parser, a module is found without being imported.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest
import yaml

from eagle3.cli import build_parser
from eagle3.common import UserError
from eagle3.config import compose_params
from support.repo import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_LINE = 200  # characters: a page reads in a terminal and in a diff

FENCE = re.compile(r"^ *```([\w-]*)\n(.*?)^ *```", re.M | re.S)  # indented: inside a list item
SHELL_FENCES = ("bash", "sh", "shell", "console")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`]+)`")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)
SEPARATORS = {"&&", "||", ";", "|", "&"}  # shell tokens between two commands of one line
HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?")
MODULE_RUN = re.compile(r"python -m (eagle3(?:\.\w+)+)")
DOTTED_MODULE = re.compile(r"^eagle3(?:\.\w+)+$")
SUBCOMMAND = re.compile(r"(?<![\w./-])eagle3 ([a-z][\w-]*)")
# Paths the docs name as parts of this repository (benchmarks/: its scripts; results are outputs).
REPO_PATH = re.compile(r"(?<![\w./-])((?:src/)?eagle3/[\w./-]*[\w/]|tests/[\w./-]*\w|benchmarks/[\w-]+\.(?:py|sh)|docs/[\w./-]*\w)")


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def prose(text: str) -> str:
    """The page without its fenced blocks: what is rendered as text, links and code spans."""
    return FENCE.sub("", text)


def fences(text: str, languages: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line number of the first line inside, body) of every fenced block in one of ``languages``."""
    return [(text.count("\n", 0, m.start(2)) + 1, textwrap.dedent(m[2])) for m in FENCE.finditer(text) if m[1] in languages]


@dataclass(frozen=True)
class Command:
    """One command line of a shell block: its tokens, and the `error:` line a console block shows after it."""

    where: str
    tokens: tuple[str, ...]
    error: str | None = None


def bash_commands(body: str) -> list[tuple[int, str, None]]:
    """(offset, command, None) of a bash block: a trailing backslash continues a line, a heredoc's body is skipped."""
    commands: list[tuple[int, str, None]] = []
    lines, index = body.splitlines(), 0
    while index < len(lines):
        start, line = index, lines[index]
        while line.endswith("\\") and index + 1 < len(lines):
            index += 1
            line = line[:-1] + " " + lines[index].strip()
        index += 1
        heredoc = HEREDOC.search(line)
        if heredoc:  # up to and past its closing word
            while index < len(lines) and lines[index].strip() != heredoc[1]:
                index += 1
            index += 1
        commands.append((start, line, None))
    return commands


def console_commands(body: str) -> list[tuple[int, str, str | None]]:
    """(offset, command, the `error:` line of its output) of a console block: `$ ` lines, each followed by its output."""
    lines = body.splitlines()
    prompts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
    commands = []
    for i, end in zip(prompts, [*prompts[1:], len(lines)]):
        error = next((out for out in lines[i + 1:end] if out.startswith("error: ")), None)
        commands.append((i, lines[i][2:], error))
    return commands


def split_commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line, comments dropped: `a && b | c` -> [[a], [b], [c]]."""
    segments: list[list[str]] = [[]]
    for token in shlex.split(line, comments=True):
        if token in SEPARATORS:
            segments.append([])
        else:
            segments[-1].append(token)
    return [segment for segment in segments if segment]


def shell_commands() -> list[Command]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for language in SHELL_FENCES:
            for first_line, body in fences(text, (language,)):
                parsed = console_commands(body) if language == "console" else bash_commands(body)
                for offset, line, error in parsed:
                    for tokens in split_commands(line):
                        found.append(Command(f"{page_id(page)}:{first_line + offset}", tuple(tokens), error))
    return found


def overrides(command: Command) -> list[str]:
    tokens = command.tokens
    return [tokens[i + 1] for i, token in enumerate(tokens[:-1]) if token == "-S"]


COMMANDS = shell_commands()
OVERRIDDEN = [command for command in COMMANDS if overrides(command)]
EAGLE3_COMMANDS = [command for command in COMMANDS if command.tokens[0] == "eagle3"]


def test_the_docs_name_commands_to_check():
    """The parsers find what the pages document (a changed fence or link style would silently check
    nothing): overrides, eagle3 command lines, conf examples, links, repository paths, modules and
    subcommand names, each at least about as many as the pages hold today."""
    texts = [page.read_text() for page in PAGES]
    found = {
        "links": sum(len(LINK.findall(prose(text))) for text in texts),
        "paths": len({path for text in texts for code in code_texts(text) for path in REPO_PATH.findall(code)}),
        "modules": len({m for text in texts for m in MODULE_RUN.findall(text)}),
        "subcommands": len({name for text in texts for code in code_texts(text) for name in SUBCOMMAND.findall(code)}),
    }
    assert len(OVERRIDDEN) >= 10 and len(EAGLE3_COMMANDS) >= 8 and CONF_EXAMPLES
    assert found["links"] >= 40 and found["paths"] >= 25 and found["modules"] >= 2 and found["subcommands"] >= 5, found


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_line_fits(page):
    long = [n for n, line in enumerate(page.read_text().splitlines(), 1) if len(line) > MAX_LINE]
    assert not long, f"{page_id(page)}: lines over {MAX_LINE} characters: {long}"


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: markup dropped, lowercase, punctuation removed, spaces -> '-'."""
    anchors: set[str] = set()
    for heading in HEADING.findall(prose(page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").replace("**", "").strip().lower()).replace(" ", "-")
        numbered, n = slug, 0
        while numbered in anchors:  # a repeated heading gets -1, -2, ...
            n += 1
            numbered = f"{slug}-{n}"
        anchors.add(numbered)
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page_id(page)}: {broken}"


@pytest.mark.parametrize("command", OVERRIDDEN, ids=lambda c: c.where)
def test_every_documented_override_composes(command, tmp_path):
    """`dvc exp run -S ...`, `eagle3 params -S ...` and the like compose, or fail with the error shown."""
    output = tmp_path / "params.yaml"
    if command.error is None:
        compose_params(overrides(command), conf_dir=ROOT / "conf", output=output)
        assert output.is_file()
    else:
        with pytest.raises(UserError) as refused:
            compose_params(overrides(command), conf_dir=ROOT / "conf", output=output)
        assert command.error.startswith(f"error: {refused.value}"), (command.error, str(refused.value))


CONF_EXAMPLE = re.compile(r"^# conf/([\w-]+)/([\w.-]+)\.yaml\n")
CONF_EXAMPLES = [(f"{page_id(page)}:{line}", body) for page in PAGES for line, body in fences(page.read_text(), ("yaml",))
                 if CONF_EXAMPLE.match(body)]


@pytest.mark.parametrize("where, body", CONF_EXAMPLES, ids=[where for where, _ in CONF_EXAMPLES])
def test_every_documented_conf_file_composes(where, body, tmp_path):
    """A yaml block headed `# conf/<group>/<option>.yaml` is a working option: added to conf/, it composes."""
    group, option = CONF_EXAMPLE.match(body).groups()
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    (conf / group / f"{option}.yaml").write_text(body)
    compose_params([f"{group}={option}"], conf_dir=conf, output=tmp_path / "params.yaml")
    assert yaml.safe_load((tmp_path / "params.yaml").read_text())[group]["name"] == option


@pytest.mark.parametrize("command", EAGLE3_COMMANDS, ids=lambda c: c.where)
def test_every_documented_eagle3_command_parses(command):
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        try:
            build_parser().parse_args(list(command.tokens[1:]))
        except SystemExit:
            pytest.fail(f"{command.where}: {shlex.join(command.tokens)}: {stderr.getvalue().strip()}")


def code_texts(text: str) -> list[str]:
    """What a page shows as code: its fenced blocks and its inline code spans."""
    return [m[2] for m in FENCE.finditer(text)] + CODE_SPAN.findall(prose(text))


def is_subcommand(name: str) -> bool:
    """`eagle3 NAME --help` prints its help (exit 0) instead of refusing the name (exit 2)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            build_parser().parse_args([name, "--help"])
        except SystemExit as stop:
            return stop.code == 0
    return False


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_named_subcommand_exists(page):
    named = {name for code in code_texts(page.read_text()) for name in SUBCOMMAND.findall(code)}
    unknown = sorted(name for name in named if not is_subcommand(name))
    assert not unknown, f"{page_id(page)}: unknown `eagle3` subcommands {unknown}"


def runnable(module: str) -> bool:
    """`python -m module` can run it: the module exists and has a main guard (a package: a __main__)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return False
    if spec.submodule_search_locations is not None:
        return importlib.util.find_spec(f"{module}.__main__") is not None
    return 'if __name__ == "__main__":' in Path(spec.origin).read_text()


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_named_module_exists(page):
    text = page.read_text()
    run = set(MODULE_RUN.findall(text))
    dotted = {code for code in CODE_SPAN.findall(prose(text)) if DOTTED_MODULE.match(code)}
    missing = sorted(m for m in run if not runnable(m)) + sorted(m for m in dotted - run if importlib.util.find_spec(m) is None)
    assert not missing, f"{page_id(page)}: no such runnable module / module: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_named_repository_file_exists(page):
    named = {path for code in code_texts(page.read_text()) for path in REPO_PATH.findall(code)}
    missing = sorted(path for path in named if not (ROOT / ("src/" + path if path.startswith("eagle3/") else path)).exists())
    assert not missing, f"{page_id(page)}: {missing}"


def config_table_options() -> dict[str, str]:
    """The README's configuration table: group -> its `options` cell."""
    rows = {}
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| group | options | concern |"):].split("\n\n")[0]  # not the other tables of 3 columns
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            for group in re.findall(r"`([\w-]+)`", cells[0]):
                rows[group] = cells[1]
    return rows


def test_the_readme_lists_every_config_option():
    rows = config_table_options()
    for group in sorted(p.name for p in (ROOT / "conf").iterdir() if p.is_dir()):
        options = {p.stem for p in (ROOT / "conf" / group).glob("[!_]*.yaml")}  # `_x.yaml`: a part, not an option
        listed = set(re.findall(r"`([\w.-]+)`", rows.get(group, "")))
        assert options <= listed, f"README configuration table, `{group}`: missing {sorted(options - listed)}"


def tau_pairs(sets: dict) -> list[str]:
    return [f"{sets[s]['tau']} / {sets[s]['tree_tau']}" for s in ("heldout", "humaneval", "math")]


def sweep_row(run: dict) -> list[str]:
    """A recipe's cells after its name in docs/training.md's first table, as the JSON has them."""
    return [str(run["steps"]), f"{run['train_tokens']:,}", *tau_pairs(run["sets"]), f"{run['val_sim_accept_len']:.4f}"]


def steps_row(run: dict) -> list[str]:
    """A recipe's cells after its name in docs/training.md's steps table (recipe_steps_1k.json)."""
    long = run.get("sets_512_new_tokens", {}).get("heldout")
    return [str(run["steps"]), f"{run['train_tokens']:,}", *tau_pairs(run["sets"]), f"{run['val_acc_0']:.4f}",
            f"{long['tau']} / {long['tree_tau']}" if long else ""]


def scale_row(run: dict) -> list[str]:
    """A recipe's cells after its name in docs/training.md's 10k table (recipe_10k.json)."""
    sets = [" / ".join(str(run["sets"][s][key]) for key in ("tau", "tree_tau", "ngram_tau")) for s in ("heldout", "humaneval", "math")]
    return [str(run["steps"]), f"{run['train_tokens']:,}", *sets, str(run["best_step"]), f"{run['val_acc_0']:.4f}"]


def doc_table(section: str, cells: int, page: str = "training.md", name_cell: int = 1) -> dict[str, list[str]]:
    """The rows of ``cells`` cells whose ``name_cell`` names a run, in docs/``page``'s section whose heading
    starts with ``section``: {run: the cells after it}."""
    text = (ROOT / "docs" / page).read_text()
    start = re.search(rf"^#+ {re.escape(section)}.*$", text, re.M).end()
    after = re.search(r"^#+ ", text[start:], re.M)
    table = {}
    for line in text[start: start + after.start() if after else None].splitlines():
        row = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(row) == cells and re.fullmatch(r"`[\w.-]+`", row[name_cell]):
            table[row[name_cell].strip("`")] = row[name_cell + 1:]
    return table


def peer_row(run: dict) -> list[str]:
    """A run's cells after its name in docs/training.md's peer tables (peer_tau_*.json)."""
    sets = [f"{run['sets'][s]['chain_tau']} / {run['sets'][s]['tree_tau']}" for s in ("heldout", "humaneval", "math")]
    return [str(run["steps"]), f"{run['tokens']:,}", str(run["train_seconds"]), *sets]


@pytest.mark.parametrize(("section", "results"), [
    ("At 1k", ("peer_tau_1k.json", "peer_tau_1k_ours_8k.json")), ("At 10k", ("peer_tau_10k.json",))],
    ids=["1k", "10k"])
def test_the_peer_tables_quote_their_json(section, results):
    runs = {run["name"]: run for name in results for run in json.loads((ROOT / "benchmarks/results" / name).read_text())["runs"]}
    table = doc_table(section, 8)
    assert table.keys() == runs.keys()
    for name, run in runs.items():
        assert table[name] == peer_row(run), name


@pytest.mark.parametrize(("results", "section"), [
    ("generate_throughput_varlen.json", "Other decode attentions"), ("generate_throughput_split.json", "The backend at 1,024 slots")],
    ids=["varlen", "split"])
def test_the_generation_tables_quote_their_json(results, section):
    report = json.loads((ROOT / "benchmarks/results" / results).read_text())
    slots = {"after": report["batch_size"], "after_varlen": report["varlen_batch_size"]}
    table = doc_table(section, 8, page="benchmarks.md", name_cell=0)
    assert table.keys() == slots.keys()
    for mode in (row for row in report["modes"] if row["mode"] in slots):
        cells = [slots[mode["mode"]], f"{mode['tokens']:,}", mode["first_s"], mode["first_tok_s"], mode["warm_tok_s"],
                 *mode["step_ms"].values(), mode["max_memory_gib"]]
        assert table[mode["mode"]] == [str(cell) for cell in cells], mode["mode"]


def two_places(value: float) -> str:
    """A figure as the README rounds it: two decimals, halves up (2.145 -> 2.15)."""
    return str(Decimal(str(value)).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))


def test_the_readme_demo_figures_are_the_demo_record():
    """The README's demo τ are metrics/summary.json's held-out figures as committed, rounded."""
    heldout = json.loads((ROOT / "metrics/summary.json").read_text())["heldout"]
    chain, tree, constant, lookup = (two_places(heldout[key]) for key in ("tau", "tree_tau", "baseline_tau", "ngram_tau"))
    sentence = (f"held-out τ (tokens per verifier forward) **{chain}** for the drafter's chain and {tree} for its tree, against "
                f"{constant} for the most frequent token and {lookup} for prompt lookup")
    assert sentence in " ".join((ROOT / "README.md").read_text().split())


E21 = "b8k-lr1e-3-e21-pack_tokens8192-micro_batch_rows1-"
SHORT_NAMES = {  # recipe names too long for a table row -> what docs/training.md calls them
    f"{E21}ttt_steps3-step_decay1.0-datashort": "ttt3",
    f"{E21}optimizermuon-freeze_lm_headTrue-ttt_steps3-step_decay1.0-weight_decay0.1-min_lr_ratio0.0-datashort": "ttt3-peer"}


@pytest.mark.parametrize(("results", "section", "cells", "row"), [
    ("recipe_sweep_1k.json", "The recipe sweep at 1k", 8, sweep_row), ("recipe_steps_1k.json", "Steps against answer length", 9, steps_row),
    ("recipe_10k.json", "10k at train=1k's rows", 9, scale_row), ("recipe_10k_e21.json", "The 10k recipe", 9, scale_row)],
    ids=["sweep", "steps", "10k", "10k-e21"])
def test_the_recipe_tables_quote_their_json(results, section, cells, row):
    runs = {SHORT_NAMES.get(run["name"], run["name"]): run
            for run in json.loads((ROOT / "benchmarks/results" / results).read_text())["runs"] if "sets" in run}
    table = doc_table(section, cells)
    assert table.keys() == runs.keys()
    for name, run in runs.items():
        assert table[name] == row(run), name


PIPELINE_JSON = ROOT / "benchmarks/results/pipeline_10k.json"
GENERATED = re.compile(r"^<!-- generated: pipeline_report.py --readme-results -->\n(.*?)\n<!-- end generated -->$", re.M | re.S)


def pipeline_report(*args: str) -> str:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks/pipeline_report.py"), *args],
                          capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()


def page_section(heading: str, page: str = "README.md") -> str:
    """The section of ``page`` under the heading ``heading`` (any level), up to the next heading."""
    text = (ROOT / page).read_text()
    start = re.search(rf"^#+ {re.escape(heading)}\n", text, re.M)
    rest = text[start.end():]
    after = re.search(r"^#+ ", rest, re.M)
    return start[0] + (rest[:after.start()] if after else rest)


def test_the_timing_table_is_the_pipeline_json():
    """docs/benchmarks.md's table of the whole run is benchmarks/pipeline_report.py --readme-table of its JSON."""
    table = pipeline_report("--readme-table", str(PIPELINE_JSON.relative_to(ROOT)))
    section = page_section("The whole run, timed", "docs/benchmarks.md")
    assert "\n".join(line for line in section.splitlines() if line.startswith("|")) == table


def test_the_readme_headline_is_the_pipeline_json():
    """The README's results are pipeline_report.py --readme-results of the pipeline JSON its command names (τ) and the
    evaluate metrics beside it (speedups), and nothing beside them in that section is a hand-written figure (a decimal)."""
    section = page_section("Results")
    (generated,) = GENERATED.findall(section)
    source = re.search(r"--readme-results\s+(benchmarks/results/[\w.-]+\.json)", section)[1]  # the record the README shows
    assert generated == pipeline_report("--readme-results", source)
    assert "batch 64" in generated and not re.findall(r"\d\.\d", GENERATED.sub("", section))


def test_the_readme_headline_says_whether_the_run_finished(tmp_path):
    """An unfinished run says so and names the sets read from evaluate's log; a finished one has no such line."""
    result = json.loads(PIPELINE_JSON.read_text())
    unfinished = tmp_path / "unfinished.json"
    unfinished.write_text(json.dumps({**result, "finished": False}))
    assert "**Unfinished**" in pipeline_report("--readme-results", str(unfinished))
    sets = {name: {key: value for key, value in s.items() if key != "from"} for name, s in result["sets"].items()}
    finished = tmp_path / "finished.json"
    finished.write_text(json.dumps({**result, "finished": True, "sets": sets}))
    text = pipeline_report("--readme-results", str(finished))
    assert "Unfinished" not in text and "| `heldout` | 200 |" in text


def test_the_readme_headline_says_where_drafting_is_slower(tmp_path):
    """The speedups come from the evaluate metrics beside the run's JSON; every one below 1× is named, a set whose
    timings disagreed is flagged, and a run without evaluate's metrics shows no speedup rather than a stale one."""
    metrics = json.loads(PIPELINE_JSON.with_name("pipeline_10k_evaluate_metrics.json").read_text())
    metrics["math"]["batch"]["64"]["tree"]["speedup"] = 1.5  # one batch-64 speedup above 1x: the others are listed
    (tmp_path / "run.json").write_text(PIPELINE_JSON.read_text())
    (tmp_path / "run_evaluate_metrics.json").write_text(json.dumps(metrics))
    text = pipeline_report("--readme-results", str(tmp_path / "run.json"))
    assert "| `math` | 200 | 256 | **2.60** | **3.25** | 1.95 | 1.33× | 1.21× | 1.33× | 0.46× | 1.50× |" in text
    assert "Below 1× (slower than plain decoding): at batch 64: `heldout`'s chain, `heldout`'s tree, `humaneval`'s chain" in text
    assert "`math`'s chain, `mtbench`'s chain" in text and "`math`'s tree" not in text
    assert "(`unstable`): `humaneval`, `mtbench`, `unseen`." in text
    (tmp_path / "run_evaluate_metrics.json").unlink()
    text = pipeline_report("--readme-results", str(tmp_path / "run.json"))
    assert "| `math` | 200 | 256 | **2.60** | **3.25** | 1.95 | 1.33× |\n" in text and "batch 1" not in text


README_MAX_LINES = 150  # a front page: what it is, the commands, serving, one table of results, links
FRONT_PAGE = ("Two commands", "Your own verifier on a GPU", "Serve", "Results", "Documentation")


def test_the_readme_is_a_front_page():
    """At most 150 lines with the sections a newcomer looks for; the GPU commands train at a real scale, not the demo's,
    and the serving commands load the exported drafter."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert [h for h in HEADING.findall(prose(text)) if h in FRONT_PAGE] == list(FRONT_PAGE)
    gpu = [c for c in COMMANDS if c.where.startswith("README.md") and "layout=gpu1" in overrides(c)]
    assert gpu and all(any(o.startswith("dataset=") and o != "dataset=demo" for o in overrides(c)) for c in gpu)
    serve = page_section("Serve")
    assert "vllm serve" in serve and "sglang.launch_server" in serve and serve.count("models/drafter") >= 3


# A figure as the README prints it: a number not glued to a word (H100, 08a55a2, SmolLM2-135M and x1 are names), with
# its thousands commas, an optional k/M multiplier and unit. Ranges (1.30-1.33×) print two figures.
FIGURE = re.compile(r"(?<![\w.\-/])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(k|M)?(?:\s?(×|%|s|ms|min|tokens/s)(?![\w/]))?(?![\w.]\d)")
MULTIPLIERS = {"k": 1e3, "M": 1e6, None: 1.0}
MEASURE_UNITS = {"×", "%", "s", "ms", "min", "tokens/s"}  # a number with one of these is a measurement, never a setting
# A JSON a sentence quotes: a path (metrics/summary.json, benchmarks/results/X.json), or a bare name as benchmarks/results/
# names its records (pipeline_10k_fa0beff.json); a bare identity.json or meta.json describes an output, not a source.
NAMED_FILE = re.compile(r"(?<![\w.-])((?:[\w.-]+/)+[\w.-]+\.json|[a-z]\w*_[\w.-]+\.json)\b")
SENTENCE_END = re.compile(r"(?<=[.;:])\s+(?=[A-Z`*(\[])")  # where a sentence (or a clause after ; or :) ends


@dataclass(frozen=True)
class Figure:
    text: str  # as printed
    value: float  # the multiplier (k, M) applied
    places: int  # decimals printed
    multiplier: float
    unit: str | None


def figures(text: str) -> list[Figure]:
    """The figures of a piece of prose, code spans and link targets left out (commands, keys and paths are not figures)."""
    plain = LINK.sub(lambda m: m[0][: m[0].index("](")], CODE_SPAN.sub(" ", text))
    found = []
    for m in FIGURE.finditer(plain):
        whole, decimals, multiplier = m[1].replace(",", ""), m[2] or "", MULTIPLIERS[m[3]]
        found.append(Figure(m[0], float(whole + decimals) * multiplier, max(len(decimals) - 1, 0), multiplier, m[4]))
    return found


def json_numbers(path: Path) -> list[float]:
    """Every number a JSON holds: its numeric values, and the figures in its strings (a run's note, its log lines)."""
    numbers: list[float] = []

    def walk(node):
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, str):
            numbers.extend(figure.value for figure in figures(node))
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            numbers.append(float(node))
    walk(json.loads(path.read_text()))
    return numbers


def holds(numbers: list[float], figure: Figure) -> bool:
    """Some number rounds to the figure as printed (to its decimals, scaled by its k or M); a percentage may be
    stored as a share (0.79 for 79 %)."""
    tolerance = 0.5 * 10 ** -figure.places * figure.multiplier * (1 + 1e-9)
    scales = (1, 100) if figure.unit == "%" else (1,)
    return any(abs(number * scale - figure.value) <= tolerance for number in numbers for scale in scales)


def source_files(names: list[str]) -> tuple[list[Path], list[str]]:
    """(the committed JSONs among the names a sentence gives, the records it names that benchmarks/results/ lacks). A
    path to a file git does not hold (data/prompts/meta.json: a stage's output) is no source."""
    found, missing = [], []
    for name in names:
        candidates = [ROOT / name, ROOT / "benchmarks/results" / name.removeprefix("benchmarks/results/")]
        file = next((candidate for candidate in candidates if candidate.is_file()), None)
        if file:
            found.append(file)
        elif "/" not in name or name.startswith("benchmarks/results/"):
            missing.append(name)
    return found, missing


def figure_units(text: str) -> list[tuple[str, list[str]]]:
    """(sentence or table row, the JSON files it names) of a page's prose, outside fences and generated blocks (their
    own tests check those): a list item is a paragraph, and a table row also counts the files its caption (the
    sentence before the table) names."""
    units: list[tuple[str, list[str]]] = []
    for block in re.split(r"\n\s*\n", prose(GENERATED.sub("", text))):
        lines = block.strip().splitlines()
        if lines and all(line.strip().startswith("|") for line in lines):
            caption = NAMED_FILE.findall(units[-1][0]) if units else []
            units += [(row, NAMED_FILE.findall(row) + caption) for row in lines]
            continue
        for item in re.split(r"\n(?=\s*- )", block):
            units += [(sentence, NAMED_FILE.findall(sentence)) for sentence in SENTENCE_END.split(" ".join(item.split()))]
    return units


def unsupported_figures(text: str) -> list[str]:
    """What a page states against its files: a figure in a sentence naming JSON files that none of them holds
    (rounded as printed), a named JSON that does not exist, and a measurement (×, %, s, tokens/s) in a sentence that
    names no file at all."""
    wrong = []
    for unit, names in figure_units(text):
        files, missing = source_files(names)
        wrong += [f"{name}: no such file in benchmarks/results/, in: {unit[:120]}" for name in missing]
        numbers = [number for file in files for number in json_numbers(file)]
        for figure in figures(unit):
            if files and not holds(numbers, figure):
                wrong.append(f"{figure.text!r} is in none of {[str(file.relative_to(ROOT)) for file in files]}: {unit[:120]}")
            elif not files and not missing and figure.unit in MEASURE_UNITS:
                wrong.append(f"{figure.text!r} names no file it comes from: {unit[:120]}")
    return wrong


def test_every_readme_figure_is_in_the_file_it_names():
    """A figure in a README sentence (or table row) that names a JSON is in that JSON, rounded as printed; a
    measurement names its file. The README checked has figures of its own to check (the demo's τ at least)."""
    text = (ROOT / "README.md").read_text()
    assert sum(len(figures(unit)) for unit, names in figure_units(text) if names) >= 4
    assert unsupported_figures(text) == []


def test_a_figure_its_file_does_not_hold_is_caught():
    """The README's demo figure changed by one in its last place fails; so do a figure quoted from a file that does
    not hold it or does not exist, and a measurement that names no file; the figures as recorded pass."""
    text = (ROOT / "README.md").read_text()
    demo = "**1.16** for the drafter's chain"
    assert demo in text
    (wrong,) = unsupported_figures(text.replace(demo, "**1.17** for the drafter's chain"))
    assert wrong.startswith("'1.17' is in none of ['metrics/summary.json']: ")
    record = "At a9a86d0 `train` trained 55.8M tokens at 634.6k tokens/s, 79 % busy, in 88 s (`benchmarks/results/pipeline_10k.json`)."
    assert unsupported_figures(record) == []
    assert unsupported_figures(record.replace("634.6k", "643.6k")) == [
        f"'643.6k tokens/s' is in none of ['benchmarks/results/pipeline_10k.json']: {record.replace('634.6k', '643.6k')[:120]}"]
    assert unsupported_figures(record.replace("pipeline_10k.json", "pipeline_10k_fa0beff.json"))  # another run's file
    assert unsupported_figures(record.replace("pipeline_10k.json", "pipeline_10k_a9a86d0.json"))[0].startswith(
        "benchmarks/results/pipeline_10k_a9a86d0.json: no such file in benchmarks/results/")
    table = "Chain τ by set (`pipeline_10k.json`):\n\n| set | chain τ |\n|---|---|\n| `heldout` | 3.18 |\n| `math` | 2.61 |\n"
    assert unsupported_figures(table) == ["'2.61' is in none of ['benchmarks/results/pipeline_10k.json']: | `math` | 2.61 |"]
    assert unsupported_figures("`train` took 88 s.") == ["'88 s' names no file it comes from: `train` took 88 s."]
    # the audit of issue 63: the README's recipe row "the defaults (the headline)" held 42c77ec's figures
    recipes = "Chain τ (`benchmarks/results/pipeline_10k.json`):\n\n| recipe | held-out | HumanEval |\n|---|---|---|\n" \
              "| the defaults (the headline) | 3.23 | 2.50 |\n"
    assert unsupported_figures(recipes) == [
        "'3.23' is in none of ['benchmarks/results/pipeline_10k.json']: | the defaults (the headline) | 3.23 | 2.50 |"]
    assert unsupported_figures(recipes.replace("pipeline_10k.json", "pipeline_10k_42c77ec.json")) == []
