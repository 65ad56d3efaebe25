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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def launch(run_dir: Path, *, resume: bool, nproc_per_node: int) -> dict:
    """Run the campaign in ``run_dir`` on ``nproc_per_node`` local ranks via torchrun; rank 0's summary."""
    result = run_dir / ".spmd-result.json"
    result.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
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
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:  # torchrun already printed which rank failed and why
        raise SystemExit(
            f"error: torchrun exited with {proc.returncode} (a rank failed; all ranks were stopped); "
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
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 starts Prefect's temporary server: it dies with this rank
        from flows import child_guard

        child_guard.start()
    from flows.campaign import run_campaign

    out = run_campaign(args.run_dir, resume=args.resume, stop_after_step=args.stop_after_step)
    if int(os.environ.get("RANK", "0")) == 0 and args.result:
        Path(args.result).write_text(json.dumps(out, default=str))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
