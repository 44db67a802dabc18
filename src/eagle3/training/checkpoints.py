"""A training run's identity, its lock and its resumable checkpoints (what ``eagle3.train`` keeps
outside the DVC outputs, in ``<checkpoints>/<run id>/``), and the export of its best weights.

    with run_folder(checkpoints, merged, hidden_states, shards, make_id, world) as run_dir:
        state = resume(run_dir, model, optimizers, schedulers)      # or a fresh TrainState
        ...
        save_checkpoint(run_dir, model, optimizers, schedulers, state, world)
    export(out, verifier, Trained(best_weights, draft, embed, d2t), training)   # the best weights, checked

The run id hashes everything that determines the trained weights: the params, the source of every
eagle3 module training runs (derived from the imports, ``training_code``: a superset of the code that
decides the weights, so an edit of e.g. ``config`` or ``common`` also starts a fresh run rather than
resume weights that other code made), the verifier, the seed,
the process count and the sha256 of every data file training reads. A run is resumed only by a
trainer with the same id, so other data or other code never continues an old run's weights; a
lock on the folder keeps a second trainer out. ``latest.pt`` holds model, optimizers, schedulers,
step, RNG states, the metric history and the weights of the best validation so far (kept on the device between
checkpoints: in the one file, a resumed run's best weights always match its best validation).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import logging
import os
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from eagle3.common import PLUMBING, UserError, atomic_dir, sha256_file, stable_hash, try_lock_run, write_json
from eagle3.drafter.export import check_drafter, verifier_facts, write_drafter
from eagle3.drafter.model import DraftConfig, Eagle3Drafter
from eagle3.hidden_states.loader import check_recorded_digests
import eagle3.training.parallel as parallel
from eagle3.training.parallel import World

log = logging.getLogger(__name__)

PACKAGE = Path(__file__).resolve().parents[1]  # src/eagle3

# Code that determines none of the weights: the export writes the weights it is given (a rerun
# after an export change resumes the finished run and only re-exports), and the process plumbing
# (supervision, exit statuses, the warm server, the compile ahead) runs the stage, no part of it.
NO_WEIGHTS_CODE = ("eagle3.drafter.export", *PLUMBING)

# ---------------------------------------------------------------------------------------------
# Run identity: the checkpoint folder is keyed by everything that determines the trained weights


def run_id(train: dict[str, Any], draft: dict[str, Any], fingerprint: str, seed: int, processes: int, inputs: dict[str, str]) -> str:
    """Checkpoint folder name: changes with anything that would make resuming wrong.

    ``train``, ``draft``: the params of training and of the drafter; ``inputs``: content digests of
    every data file training reads (``training_inputs``).
    """
    code = {str(file.relative_to(PACKAGE)): sha256_file(file) for file in training_code()}
    return stable_hash({"train": train, "draft": draft, "inputs": inputs, "code": code, "verifier": fingerprint,
                        "seed": seed, "world": processes})


def training_code(stage: str = "eagle3.train") -> list[Path]:
    """The source files of ``stage`` and of every eagle3 module it imports, transitively, but those
    of ``NO_WEIGHTS_CODE``, and ``eagle3/__init__.py`` (it picks torch's CPU kernels). Read with ``ast``,
    so an import inside a function counts and nothing is imported. Subpackages' ``__init__`` files are
    not followed: they hold only docstrings (tests/test_dvc_deps.py checks it), and train's dvc.yaml
    deps list the same files.
    """
    seen, todo = set(), [module_source(stage), PACKAGE / "__init__.py"]
    while todo:
        file = todo.pop()
        if file not in seen:
            seen.add(file)
            todo += imported_sources(file) - {module_source(name) for name in NO_WEIGHTS_CODE}
    return sorted(seen)


def module_source(name: str) -> Path | None:
    """``eagle3.training.loss`` -> ``src/eagle3/drafter/loss.py``; None for a package or another library."""
    package, *path = name.split(".")
    file = PACKAGE.joinpath(*path).with_suffix(".py")
    return file if package == "eagle3" and path and file.is_file() else None


def imported_sources(file: Path) -> set[Path]:
    """The eagle3 modules one source file imports, anywhere in it (eagle3 imports are absolute)."""
    names = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}  # the name may be a module
    return {source for source in map(module_source, names) if source is not None}


def training_inputs(merged: Path, hidden_states: Path, shards: list[str], cache: Path) -> dict[str, str]:
    """sha256 of every file of ``merged`` and of the referenced hidden-state shards, by relative path."""
    files = {f"merged/{p.relative_to(merged)}": p for p in sorted(merged.rglob("*")) if p.is_file()}
    for shard in shards:
        folder = hidden_states / shard
        files.update({f"hidden_states/{p.relative_to(hidden_states)}": p for p in sorted(folder.rglob("*")) if p.is_file()})
    return content_digests(files, cache)


def content_digests(files: dict[str, Path], cache: Path) -> dict[str, str]:
    """sha256 of each file's whole content; a digest is reused while the file's stat is unchanged.

    Why full content and not sampled bytes or sizes: one flipped byte in a part must give another
    run id. Why the stat cache: rehashing terabytes of hidden states on every resume would cost
    minutes per TB. A cached digest is reused only while (device, inode, size, mtime, ctime) is
    unchanged — the test DVC itself uses to skip rehashing, plus ctime, which no user tool can set
    back — so any write to a file, or a different file restored in its place, is hashed again.
    Files are hashed in parallel threads (hashlib releases the GIL), with a progress bar.
    """
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    stats = {name: file_stat(path) for name, path in files.items()}
    todo = {name: path for name, path in files.items() if known.get(str(path.resolve()), {}).get("stat") != stats[name]}
    progress = tqdm(total=sum(stats[name][2] for name in todo), desc="hash inputs", unit="B", unit_scale=True, disable=not todo)

    def digest(path: Path) -> str:
        hasher = hashlib.sha256()
        with path.open("rb") as handle:
            while block := handle.read(1 << 24):
                hasher.update(block)
                progress.update(len(block))
        return hasher.hexdigest()

    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        fresh = dict(zip(todo, pool.map(digest, todo.values())))
    progress.close()
    if fresh:
        known.update({str(files[name].resolve()): {"stat": stats[name], "sha256": sha} for name, sha in fresh.items()})
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        write_json(tmp, known)
        os.replace(tmp, cache)
    return {name: fresh.get(name) or known[str(path.resolve())]["sha256"] for name, path in files.items()}


def file_stat(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


# ---------------------------------------------------------------------------------------------
# The run folder and its lock


def lock_run(run_dir: Path) -> int:
    """An exclusive lock on ``run_dir`` (the open descriptor; closing it or exiting releases it);
    refuses when another trainer holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = try_lock_run(run_dir)
    if fd is None:
        holder = (run_dir / "lock").read_text(errors="replace")[:32].strip() or "?"
        raise UserError(f"{run_dir}: another trainer (pid {holder}) is writing this run; wait for it to end or stop it")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@contextlib.contextmanager
def run_folder(checkpoints: Path, merged: Path, hidden_states: Path, shards: list[str], make_id: Callable[..., str],
               world: World) -> Iterator[Path]:
    """This run's folder under ``checkpoints``, locked by the main process until the block ends.

    The main process hashes the inputs (``merged`` and the ``shards`` of ``hidden_states``),
    compares the shards' with what extract recorded, names the run ``make_id(inputs=...)`` and
    takes the lock; the others get the folder from it.
    """
    run_dir, lock = None, None
    if world.main:
        inputs = training_inputs(merged, hidden_states, shards, checkpoints / "digests.json")
        check_recorded_digests(hidden_states, shards, inputs)  # before training: refuse damaged shards
        run_dir = checkpoints / make_id(inputs=inputs)
        lock = lock_run(run_dir)
    try:
        yield parallel.broadcast_object(run_dir, world)
    finally:
        if lock is not None:
            os.close(lock)  # closing the descriptor releases the flock


# ---------------------------------------------------------------------------------------------
# Checkpoints


@dataclass
class TrainState:
    """What a checkpoint must restore besides model, optimizers and schedulers."""

    step: int = 0  # optimizer steps done; also the data position
    best: dict | None = None  # best validation summary so far, with its "step"
    history: list = field(default_factory=list)  # every logged (step, prefix, metrics), replayed on resume
    best_weights: dict | None = None  # the model state dict of the best validation (parallel.model_copy; main process)


def save_checkpoint(run_dir: Path, model, optimizers: list, schedulers: list, state: TrainState, world: World) -> None:
    """``latest.pt``: everything to resume; written atomically by the main process."""
    model_state, optim_state = parallel.full_state(model, optimizers)  # a collective under FSDP
    if world.main:
        save_atomic(run_dir / "latest.pt", {
            "model": model_state, "optimizer": optim_state, "schedulers": [s.state_dict() for s in schedulers],
            "step": state.step, "best": state.best, "history": state.history, "rng": rng_state(),
            "best_weights": None if state.best_weights is None else {k: v.cpu() for k, v in state.best_weights.items()},
        })
    parallel.barrier(world)


def resume(run_dir: Path, model, optimizers: list, schedulers: list) -> TrainState:
    """The state of ``latest.pt`` loaded into model/optimizers/schedulers, or a fresh state."""
    path = run_dir / "latest.pt"
    if not path.is_file():
        return TrainState()
    saved = torch.load(path, map_location="cpu", weights_only=False)
    parallel.load_full_state(model, optimizers, saved["model"], saved["optimizer"])
    for scheduler, scheduler_state in zip(schedulers, saved["schedulers"], strict=True):
        scheduler.load_state_dict(scheduler_state)
    set_rng_state(saved["rng"])
    return TrainState(step=saved["step"], best=saved["best"], history=saved["history"], best_weights=saved["best_weights"])


def save_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------
# The export: the best weights as the drafter folder


@dataclass(frozen=True)
class Trained:
    """A trained drafter as training holds it."""

    state: dict[str, Tensor]  # the TTT module's state dict (names under ``drafter.``)
    draft: DraftConfig  # its shape
    embed: Tensor  # the verifier's input embedding (the drafter's, not trained)
    d2t: Tensor  # data/merged's draft-to-verifier token map, which the state must hold


def export(out: Path, verifier: Path, trained: Trained, training: dict) -> None:
    """Write the drafter of ``trained`` to ``out`` and refuse it unless check_drafter passes."""
    drafter = Eagle3Drafter(trained.draft, trained.embed.cpu())
    drafter.load_state_dict({k.removeprefix("drafter."): v for k, v in trained.state.items()})
    if not torch.equal(drafter.d2t, trained.d2t):
        raise RuntimeError("the trained drafter's d2t differs from data/merged's")
    with atomic_dir(out) as tmp:
        write_drafter(drafter, tmp, verifier_facts(verifier), training)
        problems = check_drafter(tmp, verifier)
        if problems:
            raise UserError(f"{out}: the export fails check-drafter: {'; '.join(problems)}")
    log.info("drafter exported to %s", out)
