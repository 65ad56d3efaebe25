"""A CUDA device's memory, read in a short-lived process so that the launcher never holds a CUDA context.

``fp8rl run`` checks that the model's training state fits the device before it creates the run. Asking
``torch.cuda.mem_get_info`` in the launcher would create a CUDA context on that GPU, and the launcher
then waits on torchrun for the whole campaign: rank 0 would lose 0.3-0.6 GB of its GPU to a process that
computes nothing. So the launcher asks a child, which creates the context, prints the figure and exits::

    python -m flows.plan.device_probe 0      # {"total": 85899345920, "free": ..., "name": "NVIDIA H100 ..."}

:func:`cuda_memory` is the launcher's side: ``(total bytes, name)``, or None where the child cannot tell
(no device, a broken driver, a timeout); the check is then skipped, as it is on a machine without CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys

PROBE_TIMEOUT_S = 120.0  # a cold driver and torch's import; a healthy machine answers in seconds


def cuda_memory(index: int, *, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[int, str] | None:
    """Total memory of ``cuda:index`` and its name, from a child process (module docstring)."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "flows.plan.device_probe", str(index)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    try:
        got = json.loads(out.stdout.strip().splitlines()[-1])
        return int(got["total"]), str(got["name"])
    except (IndexError, ValueError, KeyError, TypeError):
        return None


def _probe(index: int) -> dict:
    import torch

    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise SystemExit(f"no CUDA device cuda:{index}")
    free, total = torch.cuda.mem_get_info(index)
    return {"total": int(total), "free": int(free), "name": f"cuda:{index} ({torch.cuda.get_device_name(index)})"}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    print(json.dumps(_probe(int(args[0]) if args else 0)))


if __name__ == "__main__":
    main()
