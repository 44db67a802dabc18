"""How a stage's command runs: ``python -m eagle3.<stage> ARGS`` (dvc.yaml), the layout applied around the stage.

Every stage module opens, before its own imports, with

    if __name__ == "__main__":  # how this command's process runs (eagle3.runner); no part of what the stage computes
        from eagle3.runner import run_laid_out

        run_laid_out("eagle3.generate")

so that a command handed to a warm server has imported nothing heavy first. ``run_laid_out`` then applies what the layout
asks for, none of which changes a byte of a stage's outputs (tests/test_warm.py: warm and cold processes write the same
bytes); so no stage depends on this module nor on what it starts (``PLUMBING``; tests/test_dvc_deps.py):

- the warm server (``layout.warm_seconds``; ``eagle3.warm``): the stages of ``warm.SERVED`` hand their command to a
  server that imported them once, which forks a process for it;
- torchrun (``eagle3.launch``) where the command asks for more than one process (``--nnodes``, ``--nproc-per-node``,
  ``--rdzv-endpoint``: train's, from the layout); one process runs here;
- the compile ahead (``layout.compile_ahead``; ``eagle3.training.ahead``, started by the warm server beside
  ``extract``): train first waits for one still running, then reads its caches;
- the process around the stage (``stage_main``): logs, one-line errors (under DVC, with how to restore the outputs it
  removed: ``restore_note``) and exit statuses, a stage that ends with whatever launched it, the params' finish checks.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from eagle3.common import (FINISH_CHECKS, INTERRUPTED, USER_ERROR, UserError, check_lock_file, naming_params_file,
                           params_argument)
from eagle3.launch import exit_with_launcher, stop_if_launcher_gone


def run_laid_out(module: str) -> None:
    """Run stage ``module`` (``eagle3.train``) on this process's arguments, as the layout lays it out; exits."""
    import eagle3.warm as warm

    worker = "TORCHELASTIC_RUN_ID" in os.environ  # a process torchrun started: laid out already
    if module in warm.SERVED and not warm.FORKED and not worker:
        warm.hand_over(module, sys.argv[1:])  # returns where no server took the command
    processes, stage_args = torchrun_options(sys.argv[1:])
    if processes is not None and not worker and processes.nnodes * processes.nproc_per_node > 1:
        from eagle3.launch import main as launch

        launch(["--nnodes", str(processes.nnodes), "--nproc-per-node", str(processes.nproc_per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", processes.rdzv_endpoint, "-m", module, *stage_args])
        sys.exit(0)
    sys.argv[1:] = stage_args
    stage = importlib.import_module(module)  # its imports, done here (cold) or in the warm server (forked)
    stage_main(after_compile_ahead(stage.main) if module == "eagle3.train" else stage.main)
    sys.exit(0)  # the rest of the module run as __main__ would only repeat its definitions


def after_compile_ahead(main: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
    """Train's ``main``, run once a compile ahead still running in this folder is done (``wait_for_compile_ahead``)."""
    from eagle3.training.ahead import wait_for_compile_ahead

    def waiting_main(argv: list[str]) -> None:
        wait_for_compile_ahead()
        main(argv)

    return waiting_main


def torchrun_options(argv: list[str]) -> tuple[argparse.Namespace | None, list[str]]:
    """The torchrun options of a stage's command (None: it has none) and the stage's own arguments."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--nnodes", type=int)
    parser.add_argument("--nproc-per-node", type=int)
    parser.add_argument("--rdzv-endpoint", default="localhost:0")
    options, rest = parser.parse_known_args(argv)
    if options.nnodes is None and options.nproc_per_node is None:
        return None, rest
    return argparse.Namespace(nnodes=options.nnodes or 1, nproc_per_node=options.nproc_per_node or 1,
                              rdzv_endpoint=options.rdzv_endpoint), rest


def setup_logging(level: int = logging.INFO) -> None:
    """Structured one-line logs on stderr (progress bars also go to stderr)."""
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


SIGINTS: list[int] = []  # the Ctrl-Cs this process received (note_interrupt)


def note_interrupt(signum: int, frame) -> None:
    """SIGINT as Python answers it (KeyboardInterrupt), remembered: a library call it lands in may turn the
    KeyboardInterrupt into an error of its own (safetensors' slicing raised a ValueError), which is still a Ctrl-C."""
    SIGINTS.append(signum)
    signal.default_int_handler(signum, frame)


def stop_interrupted() -> None:
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # a torchrun worker: eagle3.launch says it once
        print(f"eagle3: interrupted; stopping (pid {os.getpid()})", file=sys.stderr)
    sys.exit(INTERRUPTED)  # outputs are written atomically: nothing half-written is left


def stage_main(fn: Callable[[list[str]], None]) -> None:
    """Run a stage's ``main(argv)`` and then its ``at_finish`` checks; turn a UserError into one line and
    exit USER_ERROR, and a Ctrl-C into one line and exit INTERRUPTED. Run by hand, a stage first checks dvc.lock
    (``check_lock_file``); under DVC, DVC has."""
    setup_logging()
    exit_with_launcher()
    FINISH_CHECKS.clear()  # only this run's (an in-process caller may have read params before)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where the stage was started with it ignored
        signal.signal(signal.SIGINT, note_interrupt)
    try:
        if "DVC_STAGE" not in os.environ:
            check_lock_file()
        fn(sys.argv[1:])
        for check in FINISH_CHECKS:
            check()
    except UserError as err:
        print(f"error: {naming_params_file(str(err), params_argument(sys.argv[1:]))}{restore_note()}", file=sys.stderr)
        sys.exit(USER_ERROR)
    except KeyboardInterrupt:
        stop_interrupted()
    except Exception:
        if SIGINTS:  # a Ctrl-C a library call turned into its own error
            stop_interrupted()
        stop_if_launcher_gone()  # the failure is the launcher's going (a collective with stopped peers): one line
        raise


def restore_note() -> str:
    """Under DVC (``DVC_STAGE``), how to bring back the outputs of the stage's last recorded run that DVC
    removed before it ran the stage, as the end of a refusal line; "" elsewhere, or where it removed
    none (a persistent output, as ``prompts``' and ``evaluate``'s, is left in place; an output dvc.lock
    does not record has nothing to come back). The stage's own checks come too late for them: DVC
    deletes a stage's outputs before it runs its command, and ``dvc repro -s`` skips the ``params``
    check. ``dvc checkout`` brings back the cached ones; an uncached output (metrics) comes back from git."""
    name, root = os.environ.get("DVC_STAGE"), Path(os.environ.get("DVC_ROOT", ".")).resolve()
    if not name or root != Path.cwd().resolve():  # a temporary copy's run (`dvc exp run --temp`): the workspace kept all
        return ""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    try:
        with Repo(root) as repo:
            removed = [out for stage in repo.stage.collect(name) for out in stage.outs if not out.persist and out.hash_info]
    except DvcException:  # dvc.yaml unreadable now: say what would mend it
        return f"; if DVC removed {name}'s outputs before running it, `dvc checkout {name}` brings back the recorded ones"
    if not removed:
        return ""
    uncached = [str(out.def_path) for out in removed if not out.use_cache]
    from_git = f", `git checkout {' '.join(uncached)}` the uncached ones" if uncached else ""
    return f"; DVC removed {name}'s outputs before running it: `dvc checkout {name}` brings back the recorded ones{from_git}"
