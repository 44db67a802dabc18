"""GGUF sources in packages: one file, or a split (``-0000k-of-0000n.gguf``) over several files or packages."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from support.repo import project_params
from eagle3.common import UserError, package_file, sha256_file
from eagle3.verifier import import_verifier
from eagle3.verifier_sources import gguf as gguf_source
from eagle3.verifier_sources.gguf import gguf_parts, write_gguf


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


def gguf_contents(path: Path) -> tuple[dict, list]:
    """A GGUF file's metadata (without the writer's GGUF.* and split.* keys) and its tensors as stored."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith(("GGUF.", "split."))}
    tensors = [(t.name, int(t.tensor_type), tuple(t.data.shape), t.data.tobytes()) for t in reader.tensors]
    return fields, tensors


def test_a_split_over_two_packages_imports_as_the_whole_file(tmp_path, monkeypatch):
    """transformers is handed one GGUF with the whole file's metadata and tensors, byte for byte (what it
    does with such a file is the smollm2 fixture's import)."""
    model = project_params().model
    whole = package_file(model.source.package, model.source.file)
    (tmp_path / "split").mkdir()
    write_gguf([whole], tmp_path / "split" / "smol.gguf", split_max_tensors=150)  # 272 tensors -> 2 files
    parts = sorted((tmp_path / "split").iterdir())
    assert [p.name for p in parts] == ["smol-00001-of-00002.gguf", "smol-00002-of-00002.gguf"]
    make_packages(tmp_path / "site", monkeypatch, {"llm_part_a": [], "llm_part_b": []})
    for part, package in zip(parts, ("llm_part_a", "llm_part_b")):
        part.rename(tmp_path / "site" / package / part.name)
    with pytest.raises(UserError, match="is one of 2 split files, 1 given"):
        write_gguf([tmp_path / "site" / "llm_part_a" / parts[0].name], tmp_path / "joined.gguf")
    handed = tmp_path / "handed.gguf"
    monkeypatch.setattr(gguf_source, "load_gguf", lambda path, source, out: shutil.copyfile(path, handed))
    gguf_source.import_pypi_gguf(source(["llm_part_a", "llm_part_b"], [p.name for p in parts]), tmp_path / "verifier")
    assert gguf_contents(handed) == gguf_contents(whole)


def chunk_packages(root: Path, monkeypatch, count: int, listed: list[int] | None = None) -> list[Path]:
    """The packaged SmolLM2 GGUF cut into ``count`` plain byte chunks (``smol.gguf.part01`` ...), one
    package each; returns the chunks listed (``listed``: their numbers, default all in order)."""
    data = package_file(project_params().model.source.package, project_params().model.source.file).read_bytes()
    size = -(-len(data) // count)
    names = {f"llm_chunk_{i}": [f"smol.gguf.part{i:02d}"] for i in range(1, count + 1)}
    make_packages(root, monkeypatch, names)
    for i in range(1, count + 1):
        (root / f"llm_chunk_{i}" / f"smol.gguf.part{i:02d}").write_bytes(data[(i - 1) * size : i * size])
    return [root / f"llm_chunk_{i}" / f"smol.gguf.part{i:02d}" for i in (listed or range(1, count + 1))]


def chunk_source(chunks: list[Path]):
    return source([c.parent.name for c in chunks], [c.name for c in chunks])


@pytest.mark.parametrize("listed,message", [
    ([1, 3], r"\['smol.gguf.part01', 'smol.gguf.part03'\] are not the chunks part1, part2, ... of one GGUF file in order"),
    ([2, 1, 3], r"are not the chunks part1, part2, ... of one GGUF file in order"),
    ([1], r"\['smol.gguf.part01'\] do not make up a whole GGUF file \(.*\): a chunk is missing"),
])
def test_byte_chunks_missing_or_out_of_order_are_one_line(tmp_path, monkeypatch, listed, message):
    chunks = chunk_packages(tmp_path, monkeypatch, 3, listed)
    with pytest.raises(UserError, match=message):
        import_verifier(verifier_source(chunk_source(chunks)), tmp_path / "verifier")
    assert not (tmp_path / "verifier").exists()


def test_parts_of_no_known_kind_are_refused(tmp_path, monkeypatch):
    """A first part that is no GGUF, or a GGUF followed by another file that starts as one, is neither kind."""
    chunks = chunk_packages(tmp_path, monkeypatch, 2)
    make_packages(tmp_path, monkeypatch, {"llm_other": ["junk.gguf"]})
    (tmp_path / "llm_other" / "junk.gguf").write_bytes(b"not a GGUF file")
    shutil.copy(chunks[0], tmp_path / "llm_other" / "whole.gguf")
    for first in ("junk.gguf", "whole.gguf"):
        with pytest.raises(UserError, match="are neither gguf-split files .* nor byte chunks of one GGUF file"):
            import_verifier(verifier_source(source(["llm_other", chunks[0].parent.name], [first, chunks[0].name])), tmp_path / "v")


def verifier_source(gguf_source):
    model = project_params().model
    model.source = gguf_source
    return model


def test_byte_chunks_over_packages_load_as_the_whole_file(tmp_path, monkeypatch):
    """Plain chunks (how a GGUF over PyPI's file limit is shipped) listed part by part, or by the first alone:
    transformers is handed the packaged file's bytes (whose import the smollm2 fixture is; the split test
    above imports a rewritten file whole)."""
    chunks = chunk_packages(tmp_path / "site", monkeypatch, 3)
    handed = []
    monkeypatch.setattr(gguf_source, "load_gguf", lambda path, source, out: handed.append(sha256_file(path)))
    gguf_source.import_pypi_gguf(chunk_source(chunks), tmp_path / "verifier")
    model = project_params().model
    assert handed == [sha256_file(package_file(model.source.package, model.source.file))]
    assert [p.name for p in gguf_parts(source("llm_chunk_1", "smol.gguf.part01"))] == ["smol.gguf.part01"]
    together = tmp_path / "site" / "llm_chunk_1"
    for chunk in chunks[1:]:
        chunk.rename(together / chunk.name)
    assert gguf_parts(source("llm_chunk_1", "smol.gguf.part01")) == [together / c.name for c in chunks]


def test_a_gguf_file_is_parsed_once_while_transformers_loads_it():
    """Within each_gguf_parsed_once a file's reader is built once and handed to every later parse of it (transformers
    parses the file for the tokenizer's config, the model's config and the weights); outside, gguf parses as before."""
    import gguf

    whole = package_file(project_params().model.source.package, project_params().model.source.file)
    parse = gguf.GGUFReader
    with gguf_source.each_gguf_parsed_once():
        first = gguf.GGUFReader(whole)
        assert gguf.GGUFReader(str(whole)) is first and "general.architecture" in first.fields
    assert gguf.GGUFReader is parse
