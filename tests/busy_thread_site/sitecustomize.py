"""Put on ``PYTHONPATH`` of a child process the tests start, with ``FP8RL_TEST_BUSY_THREAD=MODULE``: a
process started as ``python -m MODULE`` runs a daemon thread that adds torch tensors until the process
ends (what a library's background thread does). A thread like it that takes the GIL back during the
interpreter's teardown aborts the process (std::terminate, SIGABRT) unless the process skips teardown.
Without the variable, or in any other process, it does nothing."""

import os
import sys

_MODULE = os.environ.get("FP8RL_TEST_BUSY_THREAD")
_ARGV = sys.orig_argv
_RUN = _ARGV[_ARGV.index("-m") + 1] if "-m" in _ARGV[:-1] else None  # the module this process runs
if _MODULE and _RUN == _MODULE:
    import threading

    import torch

    def _add_forever() -> None:
        a = torch.ones(4096)
        while True:
            a + a

    threading.Thread(target=_add_forever, name="busy-torch", daemon=True).start()
