"""How a stage's processes end: their supervision (a stage never outlives whatever launched it), and ``torchrun``
for a stage whose command asks for several processes, whose one-line errors stay one line.

    exit_with_launcher()          # every stage, through runner.stage_main: gone when DVC or torchrun is
    subprocess.Popen(command, preexec_fn=die_with_parent)   # a child server gone with its parent
    python -m eagle3.train ... --nnodes 1 --nproc-per-node 8   # eagle3.runner: python -m eagle3.launch ... -m eagle3.train ...

One process on one node has nothing to rendezvous with or supervise, so ``eagle3.runner`` runs it in the stage's own
process, never here. Why: torchrun's agent imports torch, then spawns a fresh interpreter that imports it again (the
10k run's ``train`` on an H100 logged its first line 11 s after it started); run alone through the warm server
(``eagle3.warm``) the stage's imports are already done.

torchrun follows a failed worker's output with its own traceback and failure summary (about 30
lines). A worker that exits with ``USER_ERROR`` has already said what is wrong in one line (bad
params, bad input: see ``stage_main``), and so has one that stopped because its launcher is gone
(``LAUNCHER_GONE``: ``kill`` of dvc) or was interrupted (``INTERRUPTED``): when that is the first
failure this launcher exits with the same status and adds nothing. A termination signal to the
launcher itself (Ctrl-C reaches the agent too) ends in one line. Any other failure (a crash, a
worker killed by a signal) keeps torchrun's full report.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from eagle3.common import INTERRUPTED, LAUNCHER_GONE, USER_ERROR


def exit_with_launcher(worker: bool = False, interval: float = 1.0) -> None:
    """Exit when the process that launched this stage dies, even by SIGKILL (Linux).

    DVC runs a stage as its child; torchrun starts its workers in a new session. So a ``kill -9``
    of ``dvc repro``, or a SIGKILL of its process group, would leave the stage (or the torchrun
    workers) running on, writing checkpoints next to the rerun's. A daemon thread watches the
    chain of parents from this process up to the launcher: the processes of the same DVC stage
    (same ``DVC_STAGE`` in their environment: shell, torchrun agent, spawned workers) and the
    DVC process above them, or, outside DVC, the torchrun agent of a worker (or, with ``worker``,
    the stage process that spawned this one). When any of them is
    gone (a parent changed: orphans are re-parented), this process exits at once; checkpoints and
    outputs are written atomically, so nothing half-written is left. Nothing is watched when the
    stage is run by hand (no DVC, no torchrun), or where ``/proc`` does not exist.
    """
    links = launcher_links(worker)
    if links:
        # The kernel's own guard for the closest link: SIGKILL as soon as the direct parent dies.
        # It needs no Python thread, which a busy GPU training loop was seen to starve (a worker
        # outlived its killed torchrun agent on an H200); the watcher covers the links above it.
        die_with_parent(signal.SIGKILL)
        if os.getppid() != links[0][1]:  # the parent died before the guard was set
            os._exit(LAUNCHER_GONE)
        WATCHED[:] = links
        threading.Thread(target=_watch_links, args=(links, interval), name="launcher-watch", daemon=True).start()


WATCHED: list[tuple[int, int]] = []  # the links exit_with_launcher watches in this process


def stop_if_launcher_gone() -> None:
    """Stop as the watcher would (one line, exit LAUNCHER_GONE) if a watched link is gone already; else return.
    Why: a torchrun worker whose peers stopped for the launcher fails in its next collective before its own
    watcher looks, and that failure's traceback (one per worker) would bury the one line that says why."""
    parent = gone_link(WATCHED)
    if parent is not None:
        stop_for_launcher(parent)


PR_SET_PDEATHSIG = 1
LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies, even by SIGKILL (no-op elsewhere)."""
    if LIBC is not None:
        LIBC.prctl(PR_SET_PDEATHSIG, int(sig))


def launcher_links(worker: bool = False) -> list[tuple[int, int]]:
    """(pid, parent pid) pairs from this process up to the stage's launcher (see exit_with_launcher)."""
    stage = os.environ.get("DVC_STAGE")
    worker = worker or "TORCHELASTIC_RUN_ID" in os.environ
    if not Path("/proc/self/stat").exists() or (stage is None and not worker):
        return []
    links = [(os.getpid(), os.getppid())]
    while stage is not None and _environ(links[-1][1]).get("DVC_STAGE") == stage:
        pid = links[-1][1]
        links.append((pid, _parent(pid)))
    return links


def _parent(pid: int) -> int:
    """The parent pid of ``pid`` (0 when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])  # fields after "(comm)": state, ppid, ...


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def gone_link(links: list[tuple[int, int]]) -> int | None:
    """The first of ``links``' parents that is gone (its child has another parent now), or None."""
    return next((parent for pid, parent in links if _parent(pid) != parent), None)


def stop_for_launcher(parent: int) -> None:
    print(f"eagle3: process {parent} that launched this stage is gone; stopping (pid {os.getpid()})", file=sys.stderr, flush=True)
    os._exit(LAUNCHER_GONE)  # at once: the rerun owns the outputs now


def _watch_links(links: list[tuple[int, int]], interval: float) -> None:
    while True:
        time.sleep(interval)
        parent = gone_link(links)
        if parent is not None:
            stop_for_launcher(parent)


# ---------------------------------------------------------------------------------------------
# torchrun: its report of a failed worker trimmed to the worker's own line

REPORTED = (USER_ERROR, LAUNCHER_GONE, INTERRUPTED)  # worker exits already explained in one line


# What the agent logs about a stop that this launcher or the worker reports in one line: a worker's
# "failed (exitcode: 2) local_rank: ...", and "Received 2 death signal, shutting down workers" with
# "Sending process N closing signal SIGINT" for a signal to the agent.
HIDDEN = (*(f"(exitcode: {code})" for code in REPORTED), "death signal, shutting down workers", "closing signal")


class _HideReported(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in HIDDEN)


def main(argv: list[str]) -> None:
    from torch.distributed.run import parse_args, run  # torch only for torchrun's command line

    args = parse_args(argv)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_HideReported())
    try:
        run(args)
    except ChildFailedError as err:
        _, first = err.get_first_failure()
        if first.exitcode in REPORTED:
            sys.exit(first.exitcode)
        raise
    except SignalException as err:  # torchrun has stopped the workers already
        print(f"eagle3.launch: stopped by {err.sigval.name}; workers stopped", file=sys.stderr)
        sys.exit(128 + err.sigval)


if __name__ == "__main__":
    main(sys.argv[1:])
