"""dvc.yaml declares every input a stage reads: code deps derived from imports, params from reads.

A stage's code is the closure of the eagle3 modules its ``-m eagle3.<stage>`` imports (found
with ``ast``, so imports inside functions count too). Each of them must be a dep of the stage
(a folder dep covers its files), and no ``src/`` dep may be stale, or editing it reruns the
stage for nothing. The package ``__init__`` is no dep: it holds only the docstring and version.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

from conftest import ROOT

SRC = ROOT / "src"


def stages() -> dict[str, dict]:
    """Each dvc.yaml stage's body (a ``foreach`` stage's ``do``)."""
    raw = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    return {name: body.get("do", body) for name, body in raw.items()}


def module_file(name: str) -> Path | None:
    base = SRC.joinpath(*name.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def imported_files(path: Path) -> set[Path]:
    """The eagle3 source files one file imports (``from eagle3 import x`` may name a module)."""
    package = path.relative_to(SRC).parent.parts
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join(parts + ([node.module] if node.module else []))
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    files = {module_file(name) for name in names if name.split(".")[0] == "eagle3"}
    return {file for file in files if file is not None}


def code_closure(module: str) -> set[Path]:
    seen, todo = set(), [module_file(module)]
    while todo:
        file = todo.pop()
        if file not in seen:
            seen.add(file)
            todo += imported_files(file)
    return seen - {SRC / "eagle3" / "__init__.py"}


def stage_code(body: dict) -> set[Path]:
    cmd = body["cmd"] if isinstance(body["cmd"], str) else " ".join(body["cmd"])
    return {file for module in re.findall(r"-m\s+(eagle3[\w.]*)", cmd) for file in code_closure(module)}


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


def test_package_init_holds_only_docstring_and_version():
    """Why ``eagle3/__init__.py`` need not be a dep: importing it runs nothing a stage uses."""
    body = ast.parse((SRC / "eagle3" / "__init__.py").read_text()).body
    docstring, *rest = body
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant)
    assert [ast.unparse(node).split(" =")[0] for node in rest] == ["__version__"]
