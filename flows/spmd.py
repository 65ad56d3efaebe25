"""The per-rank entry of an SPMD campaign under ``torchrun`` (one or many nodes).

``fp8rl run CONFIG --nproc-per-node N`` creates the run directory, then starts
``torchrun --standalone --nproc-per-node N -m flows.spmd RUN_DIR``
(:func:`flows.campaign.launch.launch`); for several nodes, ``fp8rl submit`` renders a
Slurm job that starts the same module under one agent per node
(:mod:`flows.cluster.slurm_script`), or start it on each node by hand with a
rendezvous endpoint::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m flows.spmd RUN_DIR [--resume]

Every rank runs :func:`flows.campaign.flow.run_campaign`; rank 0 runs it inside the
Prefect flow and writes the result summary (``--result``) for the launcher.
torchrun stops every rank when one fails, so a failure (or SIGKILL) acts on all
ranks together, and ``fp8rl resume RUN_DIR --nproc-per-node N`` continues from
the newest checkpoint on any number of ranks.

``fp8rl`` starts torchrun as :mod:`flows.process.torchrun` in a session of its own and
forwards SIGINT and SIGTERM to it; torchrun forwards them to each rank's
process group, and each rank ends by :mod:`flows.process.shutdown`'s path, quietly
(the launcher prints the one line). A rank whose torchrun agent dies, however it
dies (a cluster job's task SIGKILLed, its node's agent lost), gets SIGTERM from the
kernel and ends by the same path (:func:`end_with_agent`): no rank outlives its
agent, whether or not the scheduler tracks the ranks' sessions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# A signal's way through the ranks (flows.process.shutdown): a rank ends within RANK_DEADLINE_S; the launcher
# (flows.campaign.launch.launch) waits a little longer for torchrun: all of it inside the 10 s a run has to end.
RANK_DEADLINE_S = 6.0


def end_with_agent() -> None:
    """SIGTERM to this rank when its parent, the torchrun agent, ends (``PR_SET_PDEATHSIG``; Linux)."""
    import ctypes
    import signal

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> int:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank under torchrun: its parent is the agent
        end_with_agent()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--result", default=None, help="where rank 0 writes the summary (JSON)")
    ap.add_argument("--stop-after-step", type=int, default=None)
    args = ap.parse_args(argv)
    rank0 = int(os.environ.get("RANK", "0")) == 0

    def body(start_server) -> dict:
        from flows.campaign.flow import run_campaign
        from flows.orchestration.env import quiet_console_failures

        if rank0:  # rank 0 runs the Prefect flow: its temporary server, in a session of its own
            start_server()
            quiet_console_failures()  # a failure is one line (the launcher's or the rank's), not tracebacks

        return run_campaign(args.run_dir, resume=args.resume, stop_after_step=args.stop_after_step)

    from flows.campaign.launch import until_signal

    # a signal (forwarded by torchrun) ends this rank quietly: the launcher says the one line
    out = until_signal(body, resume=None, deadline_s=RANK_DEADLINE_S)
    if rank0 and args.result:
        Path(args.result).write_text(json.dumps(out, default=str))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from flows.process.shutdown import RunEnded, end_process, exit_now

    try:
        code = main()
    except RunEnded as end:
        exit_now(end)
    except SystemExit as end:  # argparse's usage errors and the like
        code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
        if not isinstance(end.code, (int, type(None))):
            sys.stderr.write(f"{end.code}\n")
    except BaseException:  # a failed rank: its traceback, then exit 1 (torchrun says which rank)
        import traceback

        traceback.print_exc()
        code = 1
    end_process(code)  # a rank never aborts in the interpreter's teardown (flows.process.shutdown.end_process)
