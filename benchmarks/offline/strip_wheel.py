"""Wheels without some of their files: the entries under the given prefixes are left out of the archive and of its
RECORD, so what pip installs matches what the RECORD lists. The vLLM kit strips kernels a Hopper host never loads
(benchmarks/offline/vllm_kit.sh):

    python benchmarks/offline/strip_wheel.py KIT/wheels/*.whl --drop vllm/vllm-rs ... --stored

``--stored``: every entry kept is stored uncompressed, for a kit compressed as a whole (xz finds far more in the raw
kernels than in their deflate streams; pip installs either). Each wheel is rewritten in place (through a temporary
file beside it: a failure leaves the original). A prefix that no wheel has is refused before any is rewritten.
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


def unmatched(wheels: list[Path], prefixes: list[str]) -> list[str]:
    """The prefixes no entry of any of ``wheels`` starts with (a typo, or a wheel laid out otherwise)."""
    names = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as source:
            names += source.namelist()
    return [prefix for prefix in prefixes if all(kept(name, [prefix]) for name in names)]


def strip(wheel: Path, prefixes: list[str], stored: bool = False) -> list[str]:
    """Rewrites ``wheel`` without the entries under ``prefixes`` (with ``stored``, the others uncompressed); returns the
    names it left out."""
    partial = wheel.with_name(wheel.name + ".partial")
    dropped = []
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(partial, "w") as target:
        for info in source.infolist():
            if not kept(info.filename, prefixes):
                dropped.append(info.filename)
                continue
            data = source.read(info)
            if stored:  # after the read: the entry is read as it was written
                info.compress_type = zipfile.ZIP_STORED
            target.writestr(info, without_records(data.decode(), prefixes).encode()
                            if info.filename.endswith(".dist-info/RECORD") else data)
    partial.replace(wheel)
    return dropped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheels", nargs="+", type=Path)
    parser.add_argument("--drop", nargs="*", default=[], help="paths inside a wheel: every entry that starts with one goes")
    parser.add_argument("--stored", action="store_true", help="store the entries kept uncompressed")
    args = parser.parse_args()
    missing = unmatched(args.wheels, args.drop)
    if missing:
        raise SystemExit(f"no wheel has anything under {', '.join(missing)}: check against the wheels' files")
    for wheel in args.wheels:
        dropped = strip(wheel, args.drop, args.stored)
        if dropped:
            print(f"{wheel.name}: {len(dropped)} files left out")


if __name__ == "__main__":
    main()
