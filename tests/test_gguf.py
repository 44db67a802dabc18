"""GGUF sources in packages: one file, or a split (``-0000k-of-0000n.gguf``) over several files or packages."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import project_params
from eagle3.common import UserError, package_file
from eagle3.verifier import gguf_parts, import_verifier, write_gguf
from eagle3.verifiers.loading import read_meta


def make_packages(root: Path, monkeypatch, files: dict[str, list[str]]) -> None:
    """Importable (never imported) packages under ``root`` holding empty stand-in files."""
    for package, names in files.items():
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").touch()
        for name in names:
            (root / package / name).touch()
    monkeypatch.syspath_prepend(str(root))


def source(package, file):
    return OmegaConf.create({"kind": "pypi-gguf", "package": package, "file": file, "dtype": "bfloat16"})


def test_split_parts_are_found_in_their_packages_or_next_to_the_first(tmp_path, monkeypatch):
    make_packages(tmp_path, monkeypatch, {"big_a": ["m-00001-of-00002.gguf"], "big_b": ["m-00002-of-00002.gguf"],
                                          "whole": ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf", "one.gguf"]})
    listed = gguf_parts(source(["big_a", "big_b"], ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]))
    assert [(p.parent.name, p.name) for p in listed] == [("big_a", "m-00001-of-00002.gguf"), ("big_b", "m-00002-of-00002.gguf")]
    assert [p.name for p in gguf_parts(source("whole", "m-00001-of-00002.gguf"))] == ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]
    assert [p.name for p in gguf_parts(source("whole", "one.gguf"))] == ["one.gguf"]
    with pytest.raises(UserError, match=r"is part of a split; \['m-00002-of-00002.gguf'\] are not next to it"):
        gguf_parts(source("big_a", "m-00001-of-00002.gguf"))
    with pytest.raises(UserError, match="model.source.package: 3 packages for 2 files"):
        gguf_parts(source(["big_a", "big_b", "whole"], ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]))


@pytest.mark.slow
def test_a_split_over_two_packages_imports_as_the_whole_file(tmp_path, monkeypatch, smollm2_dir):
    model = project_params().model
    whole = package_file(model.source.package, model.source.file)
    (tmp_path / "split").mkdir()
    write_gguf([whole], tmp_path / "split" / "smol.gguf", split_max_tensors=150)  # 272 tensors -> 2 files
    parts = sorted((tmp_path / "split").iterdir())
    assert [p.name for p in parts] == ["smol-00001-of-00002.gguf", "smol-00002-of-00002.gguf"]
    make_packages(tmp_path / "site", monkeypatch, {"llm_part_a": [], "llm_part_b": []})
    for part, package in zip(parts, ("llm_part_a", "llm_part_b")):
        part.rename(tmp_path / "site" / package / part.name)
    model.source = source(["llm_part_a", "llm_part_b"], [p.name for p in parts])
    with pytest.raises(UserError, match="is one of 2 split files, 1 given"):
        write_gguf([tmp_path / "site" / "llm_part_a" / parts[0].name], tmp_path / "joined.gguf")
    meta = import_verifier(model, tmp_path / "verifier")
    assert meta["fingerprint"] == read_meta(smollm2_dir)["fingerprint"]  # the same tokenizer and weights, byte for byte
