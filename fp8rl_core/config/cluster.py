"""Where a campaign runs when it is submitted to a cluster (the ``cluster:`` and ``retries:`` sections).

``fp8rl submit CONFIG --backend slurm`` renders one job from these settings: ``nodes``
nodes, one ``torchrun`` agent on each, ``gpus_per_node`` ranks per agent, c10d
rendezvous on ``rendezvous_host:rendezvous_port`` (the first node's address when no
host is set: node names need not resolve). The run directory lives under
``shared_path``, a folder every node mounts at the same place; it is created once,
before the job is submitted. ``retries.job`` bounds how often the supervisor
resubmits a job that failed or missed its heartbeat (``timeouts.heartbeat_s``).

Flags of ``fp8rl submit`` (``--nodes``, ``--gpus-per-node``) override the node and
GPU counts; whether the partition has that many nodes is checked against the
scheduler where one is installed.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from fp8rl_core.config.section import Section

# Slurm's --time forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
_SLURM_TIME = re.compile(r"\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:-]*")


class ClusterConfig(Section):
    """The job a campaign is submitted as: its nodes, GPUs, partition, time and shared folder."""

    nodes: int = Field(1, ge=1, description="Nodes of the job; one torchrun agent runs on each.")
    gpus_per_node: int = Field(1, ge=1, description="Ranks (GPUs) per node: torchrun's --nproc-per-node.")
    request_gpus: bool = Field(
        True,
        description="Ask the scheduler for gpus_per_node GPUs on each node (Slurm's --gpus-per-node); false on a "
        "CPU partition, where each node still runs gpus_per_node ranks.",
    )
    partition: str | None = Field(None, description="Slurm partition (None: the cluster's default partition).")
    time: str | None = Field(
        None, description="Wall-time limit of one job, in Slurm's --time form (e.g. 2-00:00:00); None: the partition's."
    )
    shared_path: str | None = Field(
        None,
        description="A folder every node mounts at the same path; the run directory must lie under it "
        "(None: storage.runs_root is taken as shared).",
    )
    rendezvous_host: str | None = Field(
        None,
        description="Address of the c10d rendezvous (None: the first node's address, looked up inside the job "
        "from the scheduler's node record, never from the node's name).",
    )
    rendezvous_port: int = Field(29500, ge=1, le=65535, description="Port of the c10d rendezvous on that host.")
    cpus_per_task: int | None = Field(
        None, ge=1, description="CPUs Slurm gives each node's torchrun agent (None: the partition's default)."
    )
    poll_s: float = Field(
        10.0, gt=0, le=600, description="How often the supervisor asks the scheduler and reads the ledger (s)."
    )

    @field_validator("time")
    @classmethod
    def _slurm_time(cls, value: str | None) -> str | None:
        if value is not None and not _SLURM_TIME.fullmatch(value):
            raise ValueError(f"{value!r}: expected Slurm's --time form, e.g. 90, 12:00:00 or 2-00:00:00")
        return value

    @field_validator("partition")
    @classmethod
    def _partition_name(cls, value: str | None) -> str | None:
        if value is not None and not _NAME.fullmatch(value):
            raise ValueError(f"{value!r}: a partition name is letters, digits and . _ -")
        return value

    @field_validator("rendezvous_host")
    @classmethod
    def _host(cls, value: str | None) -> str | None:
        if value is not None and not _HOST.fullmatch(value):
            raise ValueError(f"{value!r}: expected a host name or an IP address")
        return value


class RetryConfig(Section):
    """How often a failed piece of a campaign is tried again."""

    job: int = Field(
        3,
        ge=0,
        description="Resubmissions of a cluster job that failed or missed its heartbeat, each resuming the run "
        "from its ledger (0: none).",
    )
