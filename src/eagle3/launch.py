"""``torchrun`` for pipeline stages: the same command line, but a stage's one-line error stays one line.

    python -m eagle3.launch --nnodes 1 --nproc-per-node 8 ... -m eagle3.train ...

torchrun follows a failed worker's output with its own traceback and failure summary (about 30
lines). A worker that exits with ``USER_ERROR`` has already said what is wrong in one line (bad
params, bad input: see ``stage_main``), so when that is the first failure this launcher exits
with the same status and adds nothing. Any other failure (a crash, a signal) keeps torchrun's
full report.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from eagle3.common import USER_ERROR


class _HideUserErrorExits(logging.Filter):
    """Drops the agent's "failed (exitcode: 2) local_rank: ..." line for a user error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return f"(exitcode: {USER_ERROR})" not in record.getMessage()


def main(argv: list[str]) -> None:
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_HideUserErrorExits())
    try:
        run(parse_args(argv))
    except ChildFailedError as err:
        _, first = err.get_first_failure()
        if first.exitcode == USER_ERROR:
            sys.exit(USER_ERROR)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
