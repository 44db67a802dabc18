"""The wheels an offline host lacks: this environment's distributions that ``roots`` need (their
requirement closure, as installed here), minus the ones the host already has, pinned to the versions
installed here. Prints one ``name==version`` a line, for ``pip download -r``.

    python benchmarks/offline/wheels.py --have host-packages.txt dvclive hydra-core omegaconf gguf > need.txt

``--have``: the host's package names, separated by commas, spaces or newlines (``pip list`` there, or
its image's published list). Versions there are taken as they are: a pin that the host's version breaks
shows as an import error there, and that package is then carried too (``--carry NAME``). ``--leave NAME``: a
requirement that only code the host never runs imports (scmrepo's libgit2 and SSH backends, in a run folder of
``dvc init --no-scm``) is left out, and with it what only it requires.
"""

from __future__ import annotations

import argparse
import re
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str], leave: set[str] = frozenset()) -> dict[str, str]:
    """{normalised name: installed version} of ``roots`` and everything they require (no extras), not
    following the names in ``leave`` (normalised)."""
    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if normal(name) in found or normal(name) in leave:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            raise SystemExit(f"{name} is required but not installed here: install the project first (make setup)")
        found[normal(name)] = dist.version
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+")
    parser.add_argument("--have", type=Path, required=True, help="the host's package names")
    parser.add_argument("--carry", nargs="*", default=[], help="carry these even where the host has them")
    parser.add_argument("--leave", nargs="*", default=[], help="leave these (and what only they need) out")
    args = parser.parse_args()
    have = {normal(name) for name in re.split(r"[,\s]+", args.have.read_text()) if name} - {normal(n) for n in args.carry}
    for name, version in sorted(closure(args.roots, {normal(n) for n in args.leave}).items()):
        if name not in have:
            print(f"{name}=={version}")


if __name__ == "__main__":
    main()
