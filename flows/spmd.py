"""The per-rank entry of an SPMD campaign under ``torchrun`` (one or many nodes).

``fp8rl run CONFIG --nproc-per-node N`` creates the run directory, then starts
``torchrun --standalone --nproc-per-node N -m flows.spmd RUN_DIR``; for several
nodes, start the same module on each node with a rendezvous endpoint::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m flows.spmd RUN_DIR [--resume]

Every rank runs :func:`flows.campaign.run_campaign`; rank 0 runs it inside the
Prefect flow and writes the result summary (``--result``) for the launcher.
torchrun stops every rank when one fails, so a failure (or SIGKILL) acts on all
ranks together, and ``fp8rl resume RUN_DIR --nproc-per-node N`` continues from
the newest checkpoint on any number of ranks.

``fp8rl`` starts torchrun as :mod:`flows.torchrun` in a session of its own and
forwards SIGINT and SIGTERM to it; torchrun forwards them to each rank's
process group, and each rank ends by :mod:`flows.shutdown`'s path, quietly
(the launcher prints the one line).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# A signal's way through the ranks (flows.shutdown): a rank ends within RANK_DEADLINE_S; the launcher waits
# FORWARD_WAIT_S for torchrun, then ends what is left itself; all of it inside the 10 s a run has to end.
RANK_DEADLINE_S = 6.0
FORWARD_WAIT_S = 7.0


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    """torchrun gets SIGTERM (and forwards it to the ranks) if the launcher dies, even by SIGKILL."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def _torchrun(cmd: list[str], env: dict) -> int:
    """torchrun's exit status; a signal that interrupts the wait is forwarded to it (it forwards it to
    every rank's process group) and re-raised once torchrun has ended (at most ``FORWARD_WAIT_S``)."""
    from flows.shutdown import Interrupted

    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    try:
        return proc.wait()
    except Interrupted as err:
        proc.send_signal(err.signum)
        try:
            proc.wait(timeout=FORWARD_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()  # the ranks left are ended by the launcher (flows.shutdown.end_descendants)
            proc.wait()
        raise


def launch(run_dir: Path, *, resume: bool, nproc_per_node: int) -> dict:
    """Run the campaign in ``run_dir`` on ``nproc_per_node`` local ranks via torchrun; rank 0's summary."""
    result = run_dir / ".spmd-result.json"
    result.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "flows.torchrun",
        "--standalone",
        f"--nproc-per-node={nproc_per_node}",
        "-m",
        "flows.spmd",
        str(run_dir),
        "--result",
        str(result),
    ] + (["--resume"] if resume else [])
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    from storage.lock import LAUNCHER_ENV

    env[LAUNCHER_ENV] = str(Path(run_dir).resolve())  # this process holds the run's lock for the ranks
    code = _torchrun(cmd, env)
    if code != 0:  # torchrun already printed which rank failed and why
        raise SystemExit(
            f"error: torchrun exited with {code} (a rank failed; all ranks were stopped); "
            f"`fp8rl resume {run_dir} --nproc-per-node N` continues from the last checkpoint"
        )
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--result", default=None, help="where rank 0 writes the summary (JSON)")
    ap.add_argument("--stop-after-step", type=int, default=None)
    args = ap.parse_args(argv)
    rank0 = int(os.environ.get("RANK", "0")) == 0

    def body(start_server) -> dict:
        from flows.campaign import run_campaign
        from flows.prefect_env import quiet_console_failures

        if rank0:  # rank 0 runs the Prefect flow: its temporary server, in a session of its own
            start_server()
            quiet_console_failures()  # a failure is one line (the launcher's or the rank's), not tracebacks

        return run_campaign(args.run_dir, resume=args.resume, stop_after_step=args.stop_after_step)

    from flows.run_process import until_signal

    # a signal (forwarded by torchrun) ends this rank quietly: the launcher says the one line
    out = until_signal(body, resume=None, deadline_s=RANK_DEADLINE_S)
    if rank0 and args.result:
        Path(args.result).write_text(json.dumps(out, default=str))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from flows.shutdown import RunEnded, exit_now

    try:
        raise SystemExit(main())
    except RunEnded as end:
        exit_now(end)
