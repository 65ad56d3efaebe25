"""torchrun, as ``fp8rl run --nproc-per-node N`` starts it: quiet about the signal it forwards.

``python -m flows.torchrun ARGS`` is ``torchrun ARGS`` (``torch.distributed.run``)
with two differences, both for :mod:`flows.shutdown`'s one line:

- a SIGINT or SIGTERM that ends the ranks ends this process with 128 + the
  signal's number, without torchrun's traceback of its ``SignalException``;
- torchrun's elastic agent logs at ERROR and above only (its WARNING lines
  narrate the forwarding: "Received SIGINT death signal, shutting down workers",
  "Sending process … closing signal …"). A rank's failure is still reported
  in full (ERROR, and torchrun's error summary).

torchrun itself starts each rank in a session of its own and forwards SIGINT,
SIGTERM, SIGHUP and SIGQUIT to each rank's process group (SIGKILL 30 s later).
"""

from __future__ import annotations

import logging
import sys

QUIET_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    for name in [*QUIET_LOGGERS, *logging.root.manager.loggerDict]:
        if name.startswith(QUIET_LOGGERS):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except SignalException as err:
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
