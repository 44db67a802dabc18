"""A wheel without some of its files: the entries under the given prefixes are left out of the archive and of its
RECORD, so what pip installs matches what the RECORD lists. The vLLM kit strips kernels a Hopper host never loads
(benchmarks/offline/vllm_kit.sh):

    python benchmarks/offline/strip_wheel.py vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl vllm/vllm-rs ...

The wheel is rewritten in place (through a temporary file beside it: a failure leaves the original).
"""

from __future__ import annotations

import argparse
import zipfile
from pathlib import Path


def kept(name: str, prefixes: list[str]) -> bool:
    return not any(name.startswith(prefix) for prefix in prefixes)


def without_records(record: str, prefixes: list[str]) -> str:
    """RECORD's lines (``path,hash,size``) for the files still in the wheel."""
    return "".join(line for line in record.splitlines(keepends=True) if kept(line.split(",", 1)[0], prefixes))


def unmatched(wheel: Path, prefixes: list[str]) -> list[str]:
    """The prefixes no entry of ``wheel`` starts with (a typo, or a wheel laid out otherwise)."""
    with zipfile.ZipFile(wheel) as source:
        names = source.namelist()
    return [prefix for prefix in prefixes if all(kept(name, [prefix]) for name in names)]


def strip(wheel: Path, prefixes: list[str]) -> list[str]:
    """Rewrites ``wheel`` without the entries under ``prefixes``; returns the names it left out."""
    partial = wheel.with_name(wheel.name + ".partial")
    dropped = []
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            if not kept(info.filename, prefixes):
                dropped.append(info.filename)
            elif info.filename.endswith(".dist-info/RECORD"):
                target.writestr(info, without_records(source.read(info).decode(), prefixes))
            else:
                target.writestr(info, source.read(info))
    partial.replace(wheel)
    return dropped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("prefixes", nargs="+", help="paths inside the wheel: every entry that starts with one goes")
    args = parser.parse_args()
    missing = unmatched(args.wheel, args.prefixes)
    if missing:
        raise SystemExit(f"{args.wheel.name} has nothing under {', '.join(missing)}: check against the wheel's files")
    dropped = strip(args.wheel, args.prefixes)
    print(f"{args.wheel.name}: {len(dropped)} files left out")


if __name__ == "__main__":
    main()
