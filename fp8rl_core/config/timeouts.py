"""Time limits of a campaign's stages and of its process group (the ``timeouts:`` section of a config).

Every rank enforces the same stage limit the same way (``stages.runtime.deadline``):
a stage still running on a rank when its limit passes ends that rank's process with
one line, and with it every rank, and ``fp8rl resume`` continues from the last
completed stage. The limit covers a stage's attempts and retries together, and a
rank waiting in the stage for another rank's work (the grading, calibration and
checkpoint export rank 0 does alone) counts its wait too.

The process group's timeout bounds a collective that waits for a rank outside any
stage. It must exceed every stage's limit: a rank that waits in a collective for
a phase another rank runs alone must be ended by that phase's own limit, never by
a collective timing out first (NCCL's watchdog would kill the job without a word
of which phase ran long).

The heartbeat is the cluster supervisor's limit (``fp8rl submit``, ``flows.cluster``):
a running job whose ledger has not changed for ``heartbeat_s`` is cancelled and
resubmitted to resume. A stage writes the ledger when it starts and ends, so the
heartbeat must also exceed every stage's limit: a long stage is the stage limit's
to end, and the heartbeat catches what no rank can report (a node that vanished,
ranks stopped or stuck outside any stage).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fp8rl_core.config.stage_kinds import STAGES


def _limit(stage: str) -> float:
    return STAGES.get(stage).limit_s


class TimeoutConfig(BaseModel):
    """Seconds a stage may run on any rank, and the process group's collective timeout."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rollout_s: float = Field(_limit("rollout"), gt=0, description="Rollout of one step (its first round).")
    score_s: float = Field(_limit("score"), gt=0, description="Score of one step: grading and DAPO's refill rounds.")
    train_s: float = Field(_limit("train"), gt=0, description="Train of one step: every mini-batch on every rank.")
    calibrate_s: float = Field(_limit("calibrate"), gt=0, description="Calibration of one shadow step (rank 0 alone).")
    evaluate_s: float = Field(_limit("evaluate"), gt=0, description="Evaluation of one step: generation and grading.")
    checkpoint_s: float = Field(
        _limit("checkpoint"), gt=0, description="Checkpoint: sharded state on every rank, export on rank 0."
    )
    process_group_s: float = Field(
        4200.0,
        gt=0,
        description="torch.distributed process group timeout (s); must exceed every stage limit above.",
    )
    heartbeat_s: float = Field(
        4500.0,
        gt=0,
        description="Cluster jobs (fp8rl submit): a running job whose ledger is silent this long is cancelled and "
        "resubmitted to resume; must exceed every stage limit above.",
    )

    @model_validator(mode="after")
    def _group_outlasts_stages(self) -> "TimeoutConfig":
        name, longest = max(((s, self.stage_s(s)) for s in STAGES.names()), key=lambda kv: kv[1])
        if self.process_group_s <= longest:
            raise ValueError(
                f"timeouts.process_group_s={self.process_group_s:g} must exceed the longest stage limit, "
                f"timeouts.{name}_s={longest:g}: a rank waiting for another's phase would time out first"
            )
        if self.heartbeat_s <= longest:
            raise ValueError(
                f"timeouts.heartbeat_s={self.heartbeat_s:g} must exceed the longest stage limit, "
                f"timeouts.{name}_s={longest:g}: a job in a long stage would be taken for a hung one"
            )
        return self

    def stage_s(self, stage: str) -> float:
        """The limit of ``stage`` (a name of the stage table), seconds: its ``<stage>_s`` field, or,
        for a stage without one, the table's default limit."""
        return float(getattr(self, f"{stage}_s", None) or STAGES.get(stage).limit_s)
