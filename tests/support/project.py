"""A temporary git+DVC copy of this project on the tiny random verifier (the ``make_project`` fixture builds it)."""

from __future__ import annotations

import shutil
from pathlib import Path

from omegaconf import OmegaConf

from eagle3.config import compose_params
from support.models import TINY_LLAMA, tiny_model_spec
from support.repo import ROOT, run


def build_project(tmp_path: Path, tiny_verifier_dir: Path, *overrides: str, name: str = "project", model=None) -> Path:
    """What the ``make_project`` fixture builds (see its docstring): the git+DVC project ``tmp_path/name``."""
    repo = tmp_path / name
    repo.mkdir()
    for file in ("dvc.yaml", ".dvcignore", ".gitignore"):
        shutil.copy(ROOT / file, repo)
    shutil.copytree(ROOT / "conf", repo / "conf")
    shutil.copytree(ROOT / "data" / "sources", repo / "data" / "sources")
    shutil.copytree(ROOT / "src", repo / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    tiny = {"name": "tiny-random", "copy_weights": True, "trust_remote_code": False,
            "source": {"kind": "random", "tokenizer": str(tiny_verifier_dir), "config": TINY_LLAMA,
                       "seed": 0, "dtype": "float32"}}
    tiny.update({k: v for k, v in OmegaConf.to_container(tiny_model_spec()).items() if k not in tiny})
    (repo / "conf" / "model" / "tiny-random.yaml").write_text(OmegaConf.to_yaml(tiny))
    if model is not None:
        (repo / "conf" / "model" / f"{model.name}.yaml").write_text(OmegaConf.to_yaml(model))
    run(["git", "init", "-q", "-b", "main"], repo)
    run(["git", "config", "user.email", "test@eagle3"], repo)
    run(["git", "config", "user.name", "eagle3 test"], repo)
    run(["dvc", "init", "-q"], repo)
    for key, value in [("hydra.enabled", "true"), ("cache.type", "hardlink"), ("core.autostage", "true")]:
        run(["dvc", "config", key, value], repo)
    choice = f"model={model.name if model is not None else 'tiny-random'}"
    compose_params([choice, *overrides], conf_dir=repo / "conf", output=repo / "params.yaml")
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "project"], repo)
    return repo
