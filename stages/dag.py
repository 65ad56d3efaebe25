"""The stage table bound to its functions: what one step of the DAG hands from stage to stage.

:data:`fp8rl_core.config.stage_kinds.STAGES` says what each stage is (its rank policy,
retries, when it runs, whether it replays, whether it syncs the engine, its tables and
time limit); this module binds each name to its stage function and to the three
things a step's runner (``flows/campaign/flow.py:run_step``) needs of it besides:

* ``inputs`` — the keyword arguments the stage takes from earlier stages of the step
  (train: the rollout and score times; checkpoint: the latest evaluation);
* ``took`` — what the step keeps of the stage's result for later stages;
* ``recorded`` — for a stage that does not replay, what its done ledger record gives
  back when a resumed step skips it (rollout, score: the sampler position; evaluate:
  the scores).

Stage functions are named ``"module:function"`` and imported on first use, so that
binding a stage imports none of them. :func:`runs_at` is the table's ``when``.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from fp8rl_core.config.campaign import CampaignConfig
from fp8rl_core.config.stage_kinds import STAGES, StageSpec, When
from fp8rl_core.registry import Registry
from stages.context import TrainState, is_checkpoint_step, is_eval_step
from stages.result import StageResult

__all__ = ["BINDINGS", "StageBinding", "StepContext", "bind_stage", "binding", "runs_at", "stage_runs"]


@dataclass
class StepContext:
    """What the stages of one step hand each other; the runner threads one through the step."""

    timings: dict[str, float] = field(default_factory=dict)  # rollout/score times for the steps row
    trained: StageResult = field(default_factory=StageResult)  # the train stage's result
    last_eval: dict[str, float] = field(default_factory=dict)  # the latest evaluation's scores


def _no_inputs(ctx: StepContext) -> dict[str, Any]:
    return {}


def _keeps_nothing(ctx: StepContext, out: StageResult) -> None:
    return None


@dataclass(frozen=True)
class StageBinding:
    """A stage's function (``"module:function"``) and how a step threads it; see the module docstring."""

    function: str
    inputs: Callable[[StepContext], dict[str, Any]] = _no_inputs
    took: Callable[[StepContext, StageResult], None] = _keeps_nothing
    recorded: Callable[[StepContext, TrainState, dict], TrainState] | None = None

    def fn(self) -> Callable[..., tuple[StageResult, TrainState]]:
        """The stage function, ``run_<stage>(env, state, step, *, attempt, **inputs)``."""
        module, _, name = self.function.partition(":")
        return getattr(importlib.import_module(module), name)


BINDINGS: Registry[StageBinding] = Registry("stage binding")


def bind_stage(name: str, binding: StageBinding) -> StageBinding:
    """Bind stage ``name`` of the table to its function; a name outside the table is an error."""
    STAGES.get(name)
    return BINDINGS.register(name)(binding)


def binding(spec: StageSpec) -> StageBinding:
    return BINDINGS.get(spec.name)


def runs_at(spec: StageSpec, cfg: CampaignConfig, step: int, ctx: StepContext) -> bool:
    """Whether ``spec`` runs at ``step`` (its ``when``; a shadow stage follows the train stage's answer)."""
    if spec.when is When.STEP:
        return step > 0
    if spec.when is When.SHADOW:
        return step > 0 and ctx.trained.shadow
    if spec.when is When.EVAL:
        return is_eval_step(cfg, step)
    return is_checkpoint_step(cfg, step)


def stage_runs(cfg: CampaignConfig, step: int, ctx: StepContext) -> Iterator[tuple[StageSpec, int]]:
    """The stage runs of ``step`` in order: ``(stage, the step it runs for)``. Lazily, so that a shadow
    stage reads the train stage's answer.

    With ``rollout.max_staleness`` k ≥ 1 the rollout side's stages (``ahead``) run, one step after
    another, for every step of ``step … step + k`` (within the run): the runner skips the ones the
    ledger already has, so an uninterrupted run generates step + k's rows here, step 1 generates
    steps 1 … 1 + k, and a run whose later rows were set aside generates them again."""
    specs = list(STAGES)
    k = cfg.rollout.max_staleness
    i = 0
    while i < len(specs):
        spec = specs[i]
        if not (spec.ahead and k):
            if runs_at(spec, cfg, step, ctx):
                yield spec, step
            i += 1
            continue
        group = []
        while i < len(specs) and specs[i].ahead:
            group.append(specs[i])
            i += 1
        for at in range(step, min(step + k, cfg.steps) + 1):
            for s in group:
                if runs_at(s, cfg, step, ctx) and runs_at(s, cfg, at, ctx):
                    yield s, at


# --------------------------------------------------------------------------- the bindings


def _sampler_from_record(ctx: StepContext, state: TrainState, info: dict) -> TrainState:
    from stages.data.prompts import SamplerState

    return dataclasses.replace(state, sampler=SamplerState.from_dict(info.get("sampler")))


def _timed(stage: str) -> Callable[[StepContext, StageResult], None]:
    def took(ctx: StepContext, out: StageResult) -> None:
        ctx.timings[f"{stage}_seconds"] = out.seconds
        for k, v in out.timings.items():  # engine memory; refill rounds' generation time adds to rollout's
            ctx.timings[k] = ctx.timings.get(k, 0.0) + v if k.endswith("_seconds") else v

    return took


def _keep_trained(ctx: StepContext, out: StageResult) -> None:
    ctx.trained = out


def _keep_scores(ctx: StepContext, out: StageResult) -> None:
    ctx.last_eval = dict(out.scores)


def _scores_from_record(ctx: StepContext, state: TrainState, info: dict) -> TrainState:
    from stages.checkpoint import eval_scores

    ctx.last_eval = eval_scores(info)
    return state


bind_stage("rollout", StageBinding("stages.rollout:run_rollout", took=_timed("rollout"), recorded=_sampler_from_record))
bind_stage("score", StageBinding("stages.score:run_score", took=_timed("score"), recorded=_sampler_from_record))
bind_stage(
    "train", StageBinding("stages.train:run_train", inputs=lambda ctx: {"timings": ctx.timings}, took=_keep_trained)
)
bind_stage("calibrate", StageBinding("stages.calibrate:run_calibrate"))
bind_stage("evaluate", StageBinding("stages.evaluate:run_evaluate", took=_keep_scores, recorded=_scores_from_record))
bind_stage(
    "checkpoint", StageBinding("stages.checkpoint:run_checkpoint", inputs=lambda ctx: {"metrics": dict(ctx.last_eval)})
)
