"""dvc.yaml declares every input a stage reads: code deps derived from imports, params from reads.

A stage's code is the closure of the eagle3 modules its ``-m eagle3.<module>`` imports (found
with ``ast``, so imports inside functions count too; importing ``eagle3.a.b`` runs ``a``'s
``__init__`` too), the process plumbing aside (``common.PLUMBING``: the runner, the warm server, the
launcher, the compile ahead run the stage's process and compute none of its outputs; not followed).
Each of them must be a dep of the stage (a folder dep covers its files), and no
``src/`` dep may be stale, or editing it reruns the stage for nothing. A package ``__init__`` that
holds only its docstring (and the version) runs nothing a stage uses: it is no dep.

A stage reads params only through ``settings.stage_params(PARAMS)``, which hands it the keys of its
module's ``PARAMS`` (a ``settings.StageParams``: each key named through its group's schema) and nothing else, checked
by those schemas; ``PARAMS`` must equal the stage's ``params:`` in dvc.yaml, key by key in order. The composition of
every group (``eagle3.config``) is the params stage's alone.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf.errors import ConfigAttributeError

from support.repo import ROOT, git_dvc_repo, run
from eagle3.common import PLUMBING
from eagle3.prompt_sources.config import DatasetSettings
from eagle3.settings import StageParams, keys_of, section, stage_params
from eagle3.training.mixture import MixtureSettings

SRC = ROOT / "src"


def stages() -> dict[str, dict]:
    """Each dvc.yaml stage's body (a ``foreach`` stage's ``do``)."""
    raw = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    return {name: body.get("do", body) for name, body in raw.items()}


def module_file(name: str) -> Path | None:
    base = SRC.joinpath(*name.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def imported_files(path: Path, parents: bool = True) -> set[Path]:
    """The eagle3 source files one file imports (``from eagle3 import x`` may name a module); with
    ``parents``, also the package ``__init__`` files Python runs on the way (``eagle3.a.b`` runs ``a``'s)."""
    package = path.relative_to(SRC).parent.parts
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join(parts + ([node.module] if node.module else []))
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    if parents:
        names = {".".join(name.split(".")[:n]) for name in names for n in range(1, name.count(".") + 2)}
    files = {module_file(name) for name in names if name.split(".")[0] == "eagle3"}
    return {file for file in files if file is not None}


def only_docstring(file: Path) -> bool:
    """A package ``__init__`` that holds only its docstring and, optionally, ``__version__``."""
    docstring, *rest = ast.parse(file.read_text()).body
    return (isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant)
            and [ast.unparse(node).split(" =")[0] for node in rest] in ([], ["__version__"]))


def code_closure(module: str) -> set[Path]:
    """The source files of ``module`` and of what it imports, transitively, but the process plumbing (``PLUMBING``:
    what runs the stage's process computes none of its outputs), which is not followed."""
    seen, todo, plumbing = set(), [module_file(module)], {module_file(name) for name in PLUMBING}
    while todo:
        file = todo.pop()
        if file not in seen:
            seen.add(file)
            todo += imported_files(file) - plumbing
    return {file for file in seen if not (file.name == "__init__.py" and only_docstring(file))}


def run_modules(body: dict) -> list[str]:
    """The eagle3 modules a stage's cmd runs; the last one is the stage's own (before it: launchers)."""
    cmd = body["cmd"] if isinstance(body["cmd"], str) else " ".join(body["cmd"])
    return re.findall(r"-m\s+(eagle3[\w.]*)", cmd)


def stage_code(body: dict) -> set[Path]:
    return {file for module in run_modules(body) for file in code_closure(module)}


def covered(file: Path, deps: list[str]) -> bool:
    return any(file == ROOT / dep or (ROOT / dep) in file.parents for dep in deps)


def test_every_stage_runs_an_eagle3_module():
    assert all(stage_code(body) for body in stages().values())


def test_every_imported_module_is_a_dep():
    missing = [
        f"stage {name}: {file.relative_to(ROOT)} is imported but not in deps"
        for name, body in stages().items()
        for file in sorted(stage_code(body))
        if not covered(file, body.get("deps", []))
    ]
    assert not missing, "\n".join(missing)


def test_no_code_dep_is_stale():
    stale = [
        f"stage {name}: {dep} is a dep but the stage never imports it"
        for name, body in stages().items()
        for dep in body.get("deps", [])
        if dep.startswith("src/") and not any(covered(file, [dep]) for file in stage_code(body))
    ]
    assert not stale, "\n".join(stale)


def test_a_folder_dep_is_a_package_the_stage_imports_whole():
    """A folder dep (one line for a package) only where the stage imports every module of it, so an
    edit of a module it does not import never reruns it."""
    partial = [
        f"stage {name}: {dep} is a folder dep but the stage does not import {sorted(missing)}"
        for name, body in stages().items()
        for dep in body.get("deps", [])
        if dep.startswith("src/") and (ROOT / dep).is_dir()
        for missing in [{p.name for p in (ROOT / dep).glob("*.py")} - {f.name for f in stage_code(body) if f.parent == ROOT / dep}
                        - ({"__init__.py"} if only_docstring(ROOT / dep / "__init__.py") else set())]
        if missing
    ]
    assert not partial, "\n".join(partial)


def dep_files(deps: list[str]) -> set[Path]:
    """The source files of ``src/`` deps, a folder dep's modules included."""
    paths = [ROOT / dep for dep in deps if dep.startswith("src/")]
    return {file for path in paths for file in (sorted(path.glob("*.py")) if path.is_dir() else [path])}


def import_cycle(files: list[Path]) -> list[Path] | None:
    """One cycle of explicit imports among ``files`` (a module's own package ``__init__``, which Python
    runs first, is no edge of its own), or None."""
    graph = {file: imported_files(file, parents=False) - {file} for file in files}
    state: dict[Path, int] = {}  # 1: on the current path, 2: done

    def visit(file: Path, path: list[Path]) -> list[Path] | None:
        state[file] = 1
        for child in sorted(graph.get(file, ())):
            if state.get(child) == 1:
                return [*path[path.index(child):], child] if child in path else [file, child]
            if child not in state and (found := visit(child, [*path, child])):
                return found
        state[file] = 2
        return None

    return next((found for file in files if file not in state and (found := visit(file, [file]))), None)


def test_imports_are_acyclic():
    """No module imports, even inside a function, one that imports it back: each concern builds on
    the ones below it."""
    cycle = import_cycle(sorted((SRC / "eagle3").rglob("*.py")))
    assert cycle is None, " -> ".join(str(file.relative_to(SRC)) for file in cycle)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86 pin")
@pytest.mark.parametrize("chosen,expected", [(None, "AVX2"), ("default", "DEFAULT")])
def test_eagle3_pins_torchs_cpu_kernels_unless_the_user_chose(chosen, expected):
    """``eagle3/__init__.py`` (a dep of every stage) has torch run its AVX2 kernels on every x86 host, whatever it
    offers more (an AVX-512 host wrote other extract bytes), so CPU outputs match across machines; a value the user
    set is kept."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"} | ({"ATEN_CPU_CAPABILITY": chosen} if chosen else {})
    result = subprocess.run([sys.executable, "-c", "import eagle3, torch; print(torch.backends.cpu.get_cpu_capability())"],
                            env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == expected


def test_library_subpackages_are_no_deps_themselves():
    """The library's subpackages are folders of modules whose ``__init__`` only says what they hold, so
    a stage depends on the modules it imports, not on all (every view is validated with
    ``backends.config``: it must not bring the backends along)."""
    inits = sorted(path.parent.name for path in (SRC / "eagle3").glob("*/__init__.py") if not only_docstring(path))
    assert inits == []


def test_the_training_code_in_the_run_id_is_what_train_depends_on():
    """``train``'s run id hashes the code training runs, derived from its imports (a new module under
    drafter/ enters it by being imported): train's src/ deps but the launchers, which run the stage
    and are no part of it, and the export, which determines none of the weights."""
    from eagle3.training.checkpoints import training_code

    deps = {file for file in dep_files(stages()["train"]["deps"]) if not (file.name == "__init__.py" and only_docstring(file))}
    launchers = {SRC / "eagle3" / "launch.py", SRC / "eagle3" / "warm.py"}
    assert set(training_code()) == deps - launchers - {SRC / "eagle3" / "drafter" / "export.py"}


def params_mismatch(name: str, body: dict, reads: StageParams | None = None) -> str | None:
    """How a stage's dvc.yaml ``params:`` differs from its module's ``PARAMS`` (``reads``), or None: the same keys in the
    same order, so a key either side gains, repeats or moves shows. Not generated into dvc.yaml: its lists sit in a
    hand-written file among comments on why a stage reads a key, which a YAML rewrite would lose."""
    module = run_modules(body)[-1]
    reads, declared = list(reads or importlib.import_module(module).PARAMS), [str(key) for key in body.get("params", [])]
    if reads == declared:
        return None
    return f"stage {name}: dvc.yaml params: {declared} != {module}.PARAMS {reads}: list {reads} in dvc.yaml"


def test_every_stage_reads_exactly_its_declared_params():
    wrong = [problem for name, body in stages().items() if (problem := params_mismatch(name, body))]
    assert not wrong, "\n".join(wrong)


def test_a_key_either_side_lacks_is_a_mismatch():
    merge = stages()["merge"]
    assert params_mismatch("merge", merge) is None
    with_lr = {**merge, "params": [*merge["params"], "train.lr"]}
    reads = "['seed', 'dataset.shards', 'dataset.sources', 'dataset.extra_sources', 'merge']"
    assert params_mismatch("merge", with_lr) == (
        "stage merge: dvc.yaml params: ['seed', 'dataset.shards', 'dataset.sources', 'dataset.extra_sources', 'merge', "
        f"'train.lr'] != eagle3.merge.PARAMS {reads}: list {reads} in dvc.yaml")
    fewer = StageParams("seed", keys_of(DatasetSettings, "shards"), section(MixtureSettings))
    assert "eagle3.merge.PARAMS ['seed', 'dataset.shards', 'merge']" in params_mismatch("merge", merge, fewer)
    moved = StageParams(section(MixtureSettings), "seed", keys_of(DatasetSettings, "shards", "sources", "extra_sources"))
    assert params_mismatch("merge", merge, moved) is not None


def test_a_stage_cannot_read_an_undeclared_param():
    params = stage_params(StageParams("seed", keys_of(DatasetSettings, "shards")), ROOT / "params.yaml")
    assert params.seed == 0 and list(params.dataset.shards) == ["000000-000032"]
    with pytest.raises(ConfigAttributeError):
        params.dataset.sources  # noqa: B018 (the read itself must fail)
    with pytest.raises(ConfigAttributeError):
        params.model  # noqa: B018


def test_only_stage_params_reads_the_params_file():
    """settings.stage_params reads a stage's params; config.py reads only what it composed (compose_params)."""
    readers = sorted(path.name for path in (SRC / "eagle3").rglob("*.py") if "OmegaConf.load(" in path.read_text())
    assert readers == ["config.py", "settings.py"]


# --- with real DVC: a settings edit reruns only the stages that read the settings -----------------------------------

# Each stage's command replaced by one that writes its outputs (and what later stages read inside them): DVC then
# records the real deps and params of dvc.yaml without running the pipeline.
STAND_IN = """import sys
from pathlib import Path
for path in map(Path, sys.argv[1:]):
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix:
        path.write_text("{}")
    else:
        path.mkdir(exist_ok=True)
        (path / "x").write_text("x")
"""


def stand_in_dvc_yaml(shards: list[str]) -> dict:
    """dvc.yaml with each stage's command a ``STAND_IN`` writing its outputs, then the deps of later stages that lie in them."""
    raw = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    deps = [dep.replace("${item}", shard) for body in stages().values() for dep in body.get("deps", []) for shard in shards]
    for body in raw["stages"].values():
        stage = body.get("do", body)
        outs = [next(iter(out)) if isinstance(out, dict) else out for key in ("outs", "metrics") for out in stage.get(key, [])]
        inside = sorted({dep for dep in deps for out in outs if "${item}" not in out and dep.startswith(f"{out}/")})
        stage["cmd"] = " ".join(["python stand_in.py", *outs, *inside])
    return raw


@pytest.mark.slow
def test_an_edit_of_evaluates_and_trains_settings_or_the_plumbing_reruns_no_data_stage(tmp_path):
    repo = git_dvc_repo(tmp_path / "repo")
    for folder in ("src", "conf", "data/sources"):
        shutil.copytree(ROOT / folder, repo / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "params.yaml", repo / "params.yaml")
    (repo / "stand_in.py").write_text(STAND_IN)
    shards = list(yaml.safe_load((ROOT / "params.yaml").read_text())["dataset"]["shards"])
    (repo / "dvc.yaml").write_text(yaml.safe_dump(stand_in_dvc_yaml(shards), sort_keys=False))
    run(["dvc", "repro", "-q"], repo)
    for module in ("decoding/config.py", "training/config.py", "warm.py", "launch.py", "runner.py", "training/ahead.py"):
        with (repo / "src" / "eagle3" / module).open("a") as source:
            source.write("# an edit\n")
    changed = {name.split("@")[0] for name in json.loads(run(["dvc", "status", "--json"], repo).stdout)}
    assert changed == {"params", "train", "evaluate"}
