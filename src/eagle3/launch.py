"""``torchrun`` for pipeline stages: the same command line, but a stage's one-line error stays one line.

    python -m eagle3.launch --nnodes 1 --nproc-per-node 8 ... -m eagle3.train ...

torchrun follows a failed worker's output with its own traceback and failure summary (about 30
lines). A worker that exits with ``USER_ERROR`` has already said what is wrong in one line (bad
params, bad input: see ``stage_main``), and so has one that stopped because its launcher is gone
(``LAUNCHER_GONE``: ``kill`` of dvc) or was interrupted (``INTERRUPTED``): when that is the first
failure this launcher exits with the same status and adds nothing. A termination signal to the
launcher itself (Ctrl-C reaches the agent too) ends in one line. Any other failure (a crash, a
worker killed by a signal) keeps torchrun's full report.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from eagle3.common import INTERRUPTED, LAUNCHER_GONE, USER_ERROR

REPORTED = (USER_ERROR, LAUNCHER_GONE, INTERRUPTED)  # worker exits already explained in one line


# What the agent logs about a stop that this launcher or the worker reports in one line: a worker's
# "failed (exitcode: 2) local_rank: ...", and "Received 2 death signal, shutting down workers" with
# "Sending process N closing signal SIGINT" for a signal to the agent.
HIDDEN = (*(f"(exitcode: {code})" for code in REPORTED), "death signal, shutting down workers", "closing signal")


class _HideReported(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in HIDDEN)


def main(argv: list[str]) -> None:
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_HideReported())
    try:
        run(parse_args(argv))
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
