"""Stages under a live ``dvc repro``: start one in its own session, find its processes, kill it at a chosen moment."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


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
