"""The sbatch script of a campaign: one torchrun agent per node, c10d rendezvous, no restarts.

The script is a plain text rendering of the ``cluster:`` section (no template engine, no
submitit): every line is what a user would write by hand, so ``--dry-run`` shows exactly
what runs, and the script can be submitted with ``sbatch`` alone. What it does:

- ``srun --kill-on-bad-exit=1`` starts one task per node, each a ``torchrun`` agent
  (:mod:`flows.process.torchrun`) with ``--nproc-per-node`` ranks. A task that dies (its node
  lost, its agent killed) makes Slurm end the job's other tasks at once, instead of
  leaving their ranks in a collective until ``timeouts.process_group_s``;
- ``--max-restarts 0``: torchrun does not restart a failed worker group in place; the
  supervisor resubmits the whole job to resume from the ledger (the run's state lives
  in the run directory, not in the agents);
- the c10d rendezvous host is ``cluster.rendezvous_host`` or, unset, the address of the
  job's first node as Slurm records it (``NodeAddr`` of ``scontrol show node``, looked
  up inside the job). Node names need not resolve; the node's address is what the other
  agents dial. The rendezvous id is the job id, so a resubmitted job never meets the
  agents of an earlier one.

The ranks run :mod:`flows.spmd` on the run directory, which the submitter created on the
shared path before submitting; ``--resume`` is added once the ledger holds a finished stage.
Without ``PREFECT_API_URL`` rank 0 starts Prefect's temporary server, whose SQLite database
goes to the node's own disk (``$TMPDIR``), not to a home directory shared over the network
with the supervisor's own temporary server.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from fp8rl_core.config.campaign import CampaignConfig

RESULT_FILE = ".spmd-result.json"  # rank 0's summary of the campaign (flows.spmd --result)
JOB_DIR = "cluster"  # <run_dir>/cluster: the rendered scripts and the jobs' output


def job_name(run_dir: Path) -> str:
    return f"fp8rl-{run_dir.name}"[:120]


def render(cfg: CampaignConfig, run_dir: Path, *, python: str, workdir: Path, resume: bool) -> str:
    """The sbatch script that runs ``run_dir``'s campaign on ``cfg.cluster``'s nodes.

    ``python``: the interpreter every node runs (on the shared path, as the project is);
    ``workdir``: the job's working directory (the project checkout)."""
    c = cfg.cluster
    q = shlex.quote
    directives = [
        f"--job-name={job_name(run_dir)}",
        f"--nodes={c.nodes}",
        "--ntasks-per-node=1",
        *([f"--gpus-per-node={c.gpus_per_node}"] if c.request_gpus else []),
        *([f"--cpus-per-task={c.cpus_per_task}"] if c.cpus_per_task else []),
        *([f"--partition={c.partition}"] if c.partition else []),
        *([f"--time={c.time}"] if c.time else []),
        f"--chdir={workdir}",
        f"--output={run_dir / JOB_DIR}/job-%j.out",
        "--open-mode=append",
        "--export=ALL",
    ]
    if c.rendezvous_host:
        host = [f"RDZV_HOST={q(c.rendezvous_host)}  # cluster.rendezvous_host"]
    else:
        host = [
            "# the first node's address as Slurm records it (NodeAddr): node names need not resolve",
            'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "RDZV_HOST=$(scontrol show node \"$HEAD_NODE\" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p' | head -n 1)",
            '[ -n "$RDZV_HOST" ] || { echo "no NodeAddr for $HEAD_NODE; set cluster.rendezvous_host" >&2; exit 2; }',
        ]
    torchrun = [
        q(python),
        "-m flows.process.torchrun",
        f"--nnodes={c.nodes}",
        f"--nproc-per-node={c.gpus_per_node}",
        "--max-restarts=0",
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="$RDZV_HOST:$RDZV_PORT"',
        '--rdzv-id="$SLURM_JOB_ID"',
        "-m flows.spmd",
        '"$RUN_DIR"',
        f'--result="$RUN_DIR/{RESULT_FILE}"',
        *(["--resume"] if resume else []),
    ]
    lines = [
        "#!/bin/bash",
        f"# fp8rl campaign {cfg.name}: {c.nodes} node(s) x {c.gpus_per_node} rank(s), rendered by `fp8rl submit`",
        *(f"#SBATCH {d}" for d in directives),
        "set -euo pipefail",
        f"RUN_DIR={q(str(run_dir))}",
        f"RDZV_PORT={c.rendezvous_port}",
        *host,
        'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"',
        "# no Prefect server given: rank 0 starts Prefect's temporary one, its database on the node's own disk",
        '[ -n "${PREFECT_API_URL:-}" ] || export PREFECT_HOME="${TMPDIR:-/tmp}/fp8rl-prefect-$SLURM_JOB_ID"',
        'echo "fp8rl job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: rendezvous $RDZV_HOST:$RDZV_PORT"',
        "# one torchrun agent per node; a task that fails ends the job's other tasks (--kill-on-bad-exit)",
        f"srun --kill-on-bad-exit=1 --nodes={c.nodes} --ntasks-per-node=1 \\",
        "    " + " \\\n    ".join(torchrun),
        "",
    ]
    return "\n".join(lines)
