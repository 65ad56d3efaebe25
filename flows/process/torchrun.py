"""torchrun, as ``fp8rl run --nproc-per-node N`` starts it: quiet about the signal it forwards.

``python -m flows.process.torchrun ARGS`` is ``torchrun ARGS`` (``torch.distributed.run``)
with two differences, both for :mod:`flows.process.shutdown`'s one line:

- a SIGINT or SIGTERM that ends the ranks ends this process with 128 + the
  signal's number, without torchrun's traceback of its ``SignalException``;
- torchrun's elastic agent logs at ERROR and above only (its WARNING lines
  narrate the forwarding: "Received SIGINT death signal, shutting down workers",
  "Sending process … closing signal …"). A rank's failure is still reported
  in full (ERROR, and torchrun's error summary).

torchrun itself starts each rank in a session of its own and forwards SIGINT,
SIGTERM, SIGHUP and SIGQUIT to each rank's process group (SIGKILL 30 s later).
One addition: a SIGCONT follows the forwarded signal (:func:`wake_ranks_it_ends`), so a
rank that was stopped (SIGSTOP, a debugger, a job suspended) takes the signal and ends
by :mod:`flows.process.shutdown`'s path. A scheduler's cancel wakes only the processes it
tracks, and the ranks' own sessions are outside a process-group tracker (Slurm's
``proctrack/pgid``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

QUIET_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")


def wake_ranks_it_ends() -> None:
    """After torchrun sends a rank's process group its death signal, send SIGCONT too: a stopped rank
    would hold the signal pending until torchrun's SIGKILL 30 s later, or for ever if the agent is
    killed first (a scheduler ends the agent after its own grace period)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as handler

    close = handler.SubprocessHandler.close

    def close_and_wake(self, death_sig=None) -> None:
        close(self, death_sig)
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
        except OSError:  # the group has ended
            pass

    handler.SubprocessHandler.close = close_and_wake


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    for name in [*QUIET_LOGGERS, *logging.root.manager.loggerDict]:
        if name.startswith(QUIET_LOGGERS):
            logging.getLogger(name).setLevel(logging.ERROR)
    wake_ranks_it_ends()
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except SignalException as err:
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
