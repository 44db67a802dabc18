"""Stage ``train`` on real tiny data: extracted and merged records (the ``tiny_data`` fixture), stage params and arguments, output bytes.

``tiny_data`` is a module-scoped fixture: a test module that uses it imports it from here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from eagle3.extract import extract, stage_arguments
from eagle3.merge import merge
from support.data import conversation, tiny_params, write_generated
from support.repo import ROOT, project_params

DEBUG = OmegaConf.load(ROOT / "conf" / "train" / "debug.yaml")


def make_data(root: Path, verifier: Path, model_params, records: int, draft_vocab_size: int) -> Path:
    shard = "000000-000032"
    params = tiny_params(model_params)
    params.layout.threads = 1  # a busy 2-core machine runs one thread faster than two
    extract(verifier, write_generated(root / "generated" / shard, [conversation(i) for i in range(records)]),
            root / "hidden" / shard, *stage_arguments(params))
    params.dataset.shards = [shard]
    params.merge = OmegaConf.merge(params.merge, {"val_fraction": 0.25, "draft_vocab_size": draft_vocab_size, "min_tokens": 4})
    merge(verifier, root / "hidden", root / "merged", root / "metrics-merge", params)
    return root


def stage_params(path: Path, **train) -> Path:
    params = project_params()
    params.train = OmegaConf.merge(DEBUG, {"pack_tokens": 128, "batch_tokens": 128}, train)  # rows of a few tiny samples: several rows
    OmegaConf.save(params, path)
    return path


def stage_args(root: Path, verifier: Path, name: str, params: Path) -> list[str]:
    return [str(verifier), str(root / "merged"), str(root / "hidden"), str(root / name / "drafter"),
            "--checkpoints", str(root / name / "checkpoints"), "--live", str(root / name / "live"), "--params", str(params)]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory, tiny_verifier_dir, tiny_model_params):
    return make_data(tmp_path_factory.mktemp("train"), tiny_verifier_dir, tiny_model_params, records=12, draft_vocab_size=256)


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def copy_data(tiny_data: Path, root: Path) -> Path:
    for name in ("merged", "hidden"):
        shutil.copytree(tiny_data / name, root / name)
    return root


ELEMENT_BYTES = {"BF16": 2, "I32": 4}


def part_element(part: Path, tensor: str, element: int) -> int:
    """The file offset of element ``element`` of a bf16 or int32 tensor of a safetensors part."""
    header_len = int.from_bytes(part.read_bytes()[:8], "little")
    header = json.loads(part.read_bytes()[8 : 8 + header_len])
    return 8 + header_len + header[tensor]["data_offsets"][0] + ELEMENT_BYTES[header[tensor]["dtype"]] * element
