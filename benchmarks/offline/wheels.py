"""The wheels an offline host lacks: this environment's distributions that ``roots`` need (their
requirement closure, as installed here), minus the ones the host already has, pinned to the versions
installed here. Prints one ``name==version`` a line, for ``pip download -r``.

    python benchmarks/offline/wheels.py --have host-packages.txt dvclive hydra-core omegaconf gguf > need.txt

``--have``: the host's package names, separated by commas, spaces or newlines (``pip list`` there, or
its image's published list). Versions there are taken as they are: a pin that the host's version breaks
shows as an import error there, and that package is then carried too (``--carry NAME``). ``--leave NAME``: a
requirement that only code the host never runs imports (scmrepo's libgit2 and SSH backends, in a run folder of
``dvc init --no-scm``) is left out, and with it what only it requires. A package the host has is not followed: its
requirements are installed there with it.

``--report FILE``: the distributions are read from pip's installation report (``pip install --dry-run --report``,
resolved elsewhere: benchmarks/offline/vllm_kit.sh) instead of this environment, their markers evaluated for the
environment the report was resolved in.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


Requires = Callable[[str], "tuple[str, list[str]]"]


def installed(name: str) -> tuple[str, list[str]]:
    """(version, requirement lines) of ``name`` as installed in this environment."""
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        raise SystemExit(f"{name} is required but not installed here: install the project first (make setup)")
    return dist.version, dist.requires or []


def reported(report: Path) -> tuple[Requires, dict[str, str]]:
    """The lookup of pip's installation report ``report`` (a JSON file), and the marker environment it was
    resolved for."""
    data = json.loads(report.read_text())
    found = {normal(item["metadata"]["name"]): item["metadata"] for item in data["install"]}

    def requires(name: str) -> tuple[str, list[str]]:
        if normal(name) not in found:
            raise SystemExit(f"{name} is required but not in {report}: resolve again, or name it in --have")
        return found[normal(name)]["version"], found[normal(name)].get("requires_dist", [])
    return requires, data["environment"]


def closure(roots: list[str], stop: set[str] = frozenset(), requires: Requires = installed,
            environment: dict[str, str] | None = None) -> dict[str, str]:
    """{normalised name: version} of ``roots`` and everything they require, with the extras each requirement names
    (``mistral_common[image]``), not following the names in ``stop`` (normalised); markers are evaluated for
    ``environment`` (this interpreter's if None)."""
    found: dict[str, str] = {}
    extras_of: dict[str, set[str]] = {}  # per package followed, the extras whose requirements were taken
    todo = [Requirement(root) for root in roots]
    while todo:
        requirement = todo.pop()
        name = normal(requirement.name)
        if name in stop or (name in extras_of and requirement.extras <= extras_of[name]):
            continue
        new = [""] * (name not in extras_of) + sorted(requirement.extras - extras_of.get(name, set()))  # "": no extra
        extras_of[name] = extras_of.get(name, set()) | requirement.extras
        found[name], lines = requires(requirement.name)
        for line in lines:
            needed = Requirement(line)
            marker = needed.marker
            if any((marker is None and extra == "") or (marker is not None and marker.evaluate({**(environment or {}), "extra": extra}))
                   for extra in new):
                todo.append(needed)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+")
    parser.add_argument("--have", type=Path, required=True, help="the host's package names")
    parser.add_argument("--carry", nargs="*", default=[], help="carry these even where the host has them")
    parser.add_argument("--leave", nargs="*", default=[], help="leave these (and what only they need) out")
    parser.add_argument("--report", type=Path, help="pip's installation report to read instead of this environment")
    args = parser.parse_args()
    have = {normal(name) for name in re.split(r"[,\s]+", args.have.read_text()) if name} - {normal(n) for n in args.carry}
    requires, environment = reported(args.report) if args.report else (installed, None)
    for name, version in sorted(closure(args.roots, have | {normal(n) for n in args.leave}, requires, environment).items()):
        print(f"{name}=={version}")


if __name__ == "__main__":
    main()
