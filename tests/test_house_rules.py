"""House rules of src/eagle3, read with ``ast``: no module over 400 lines, no function over 6
parameters (a longer list is a keyword bundle or a small object), no dataclass of more than 5
fields constructed positionally (its fields by keyword, so a reordered field cannot shift values);
and no module of src/eagle3 or benchmarks/ imports a stage module (a library module holds what
two of them share)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from support.repo import ROOT

PACKAGE = ROOT / "src" / "eagle3"
MAX_LINES = 400
MAX_PARAMETERS = 6
MAX_POSITIONAL_FIELDS = 5

def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def tree(module: Path) -> ast.Module:
    return ast.parse(module.read_text(), str(module))


def where(module: Path, node: ast.AST) -> str:
    return f"{module.relative_to(PACKAGE)}:{node.lineno}"


def test_no_module_is_over_400_lines():
    long = [f"{module.relative_to(PACKAGE)}: {n} lines" for module in modules()
            if (n := len(module.read_text().splitlines())) > MAX_LINES]
    assert not long, "\n".join(long)


def triton_kernel(function: ast.FunctionDef) -> bool:
    """A ``@triton.jit`` kernel: its parameters are its launch arguments (pointers, strides, constexprs),
    not Python objects a bundle could carry."""
    return any(ast.unparse(d).startswith("triton.jit") for d in function.decorator_list)


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[str]:
    """Every parameter by name (``*args`` and ``**kwargs`` too), a method's ``self`` or ``cls`` not counted."""
    args = function.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    static = any(ast.unparse(d) == "staticmethod" for d in function.decorator_list)
    return names[1:] if method and not static and names[:1] in (["self"], ["cls"]) else names


def functions(module: ast.Module):
    """(function, is a method) for every def in the module, nested ones included."""
    methods = {id(item) for node in ast.walk(module) if isinstance(node, ast.ClassDef) for item in node.body}
    for node in ast.walk(module):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node, id(node) in methods


def test_no_function_takes_over_6_parameters():
    wide = [f"{where(module, function)} {function.name}: {len(names)} parameters ({', '.join(names)})"
            for module in modules() for function, method in functions(tree(module))
            if not triton_kernel(function) and len(names := parameters(function, method)) > MAX_PARAMETERS]
    assert not wide, "\n".join(wide)


def dataclass_fields(node: ast.ClassDef) -> int | None:
    """How many fields a ``@dataclass`` class has (ClassVar and the KW_ONLY marker are none); None for another class."""
    if not any(ast.unparse(d).split("(")[0].endswith("dataclass") for d in node.decorator_list):
        return None
    return sum(1 for item in node.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
               and not any(word in ast.unparse(item.annotation) for word in ("ClassVar", "KW_ONLY")))


def wide_dataclasses() -> dict[str, dict[str, int]]:
    """Module name -> {class name: fields} of the dataclasses over MAX_POSITIONAL_FIELDS fields."""
    found: dict[str, dict[str, int]] = {}
    for module in modules():
        name = ".".join(module.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in tree(module).body:
            if isinstance(node, ast.ClassDef) and (count := dataclass_fields(node)) and count > MAX_POSITIONAL_FIELDS:
                found.setdefault(name, {})[node.name] = count
    return found


def visible_classes(module: Path, parsed: ast.Module, wide: dict[str, dict[str, int]]) -> dict[str, int]:
    """The wide dataclasses a module names: its own and those it imports by name."""
    own = ".".join(module.relative_to(PACKAGE.parent).with_suffix("").parts)
    names = dict(wide.get(own, {}))
    for node in ast.walk(parsed):
        if isinstance(node, ast.ImportFrom) and node.module in wide:
            names.update({alias.asname or alias.name: wide[node.module][alias.name] for alias in node.names
                          if alias.name in wide[node.module]})
    return names


def positional_constructions(module: Path, wide: dict[str, dict[str, int]]) -> list[str]:
    parsed = tree(module)
    names = visible_classes(module, parsed, wide)
    found = []
    for cls in ast.walk(parsed):  # ``cls(...)`` inside a wide dataclass's own classmethods
        if isinstance(cls, ast.ClassDef) and cls.name in names:
            found += [f"{where(module, call)} cls(...) of {cls.name}: {len(call.args)} positional arguments"
                      for call in ast.walk(cls) if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                      and call.func.id == "cls" and call.args]
    found += [f"{where(module, call)} {call.func.id}(...): {len(call.args)} positional arguments"
              for call in ast.walk(parsed) if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
              and call.func.id in names and call.args]
    return found


def test_no_wide_dataclass_is_constructed_positionally():
    wide = wide_dataclasses()
    found = [line for module in modules() for line in positional_constructions(module, wide)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source, problems", [
    ("from dataclasses import dataclass\n@dataclass\nclass Wide:\n" + "".join(f"    f{i}: int\n" for i in range(6))
     + "def make():\n    return Wide(1, 2, 3, 4, 5, 6)\ndef fine():\n    return Wide(**{})\n", 1),
    ("def wide(a, b, c, d, e, f, g):\n    pass\nclass A:\n    def method(self, a, b, c, d, e, f):\n        pass\n", 1),
])
def test_the_rules_see_what_they_refuse(tmp_path, monkeypatch, source, problems):
    """The checks themselves, on a module written for them (a wide dataclass built positionally; a
    7-parameter function beside a 6-parameter method)."""
    module = tmp_path / "eagle3" / "probe.py"
    module.parent.mkdir()
    module.write_text(source)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "eagle3")
    wide = wide_dataclasses()
    calls = positional_constructions(module, wide)
    parsed = tree(module)
    long_lists = [f.name for f, method in functions(parsed) if len(parameters(f, method)) > MAX_PARAMETERS]
    assert len(calls) + len(long_lists) == problems


def stage_modules() -> set[str]:
    """The modules dvc.yaml's stages run (``python -m eagle3.<stage>``; a launcher before it is none)."""
    found = set()
    for body in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].values():
        cmd = body.get("do", body)["cmd"]
        found.add(re.findall(r"-m\s+(eagle3[\w.]*)", cmd if isinstance(cmd, str) else " ".join(cmd))[-1])
    return found


def stage_imports(path: Path, stages: set[str]) -> list[str]:
    """The stage modules ``path`` imports (inside functions too), its own name aside; importing a stage's
    ``main`` alone, to run the stage, is no use of it as a library."""
    found = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name in stages]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module in stages and [alias.name for alias in node.names] != ["main"]:
                found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in stages]
    own = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts) if PACKAGE in path.parents else None
    return [name for name in found if name != own]


def test_no_module_imports_a_stage():
    stages = stage_modules()
    assert {"eagle3.train", "eagle3.evaluate", "eagle3.generate"} <= stages
    files = [*modules(), *sorted((ROOT / "benchmarks").rglob("*.py"))]
    found = [f"{path.relative_to(ROOT)}: imports {name}" for path in files for name in stage_imports(path, stages)]
    assert not found, "\n".join(found)


def test_the_stage_import_rule_sees_what_it_refuses(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from eagle3.evaluate import main\nfrom eagle3 import summary\n"
                     "def f():\n    from eagle3.generate import Journal\n    import eagle3.train\n")
    assert sorted(stage_imports(probe, stage_modules())) == ["eagle3.generate", "eagle3.summary", "eagle3.train"]
