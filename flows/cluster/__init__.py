"""Campaigns on a cluster: ``fp8rl submit`` renders the job, submits it and supervises it.

- :mod:`flows.cluster.backends`: the backends as data (what each renders, submits, needs);
- :mod:`flows.cluster.slurm_script` / :mod:`flows.cluster.k8s_job`: the job, rendered from the config;
- :mod:`flows.cluster.slurm`: the scheduler's commands (sbatch, squeue, scontrol, scancel, sinfo);
- :mod:`flows.cluster.supervise`: the Prefect flow that submits, watches the ledger as heartbeat,
  cancels and resubmits to resume;
- :mod:`flows.cluster.attempts`: each job attempt, recorded in the ledger and ``run.json``;
- :mod:`flows.cluster.cli`: the command.

The ranks themselves run today's :mod:`flows.spmd` under ``torchrun``; nothing here is a launcher
of its own.
"""
