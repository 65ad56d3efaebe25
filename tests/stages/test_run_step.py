"""``flows.campaign.flow.run_step``'s resume branches, in-process in milliseconds.

The stage tasks are replaced by recorders (``monkeypatch`` on the module's
names, which ``run_step`` looks up at call time), the ledger is real: which
stages run again after a crash is decided by the ledger alone, as docs/method.md says.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import micro_config

import flows.campaign.flow as campaign
from fp8rl_core.config.stage_kinds import STAGES as STAGE_TABLE
from stages.context import TrainState, is_calibration_step
from stages.data.prompts import SamplerState
from stages.result import StageResult
from storage.ledger.events import Ledger
from storage.run.layout import create_run

STAGES = STAGE_TABLE.names()


@pytest.fixture
def setup(tmp_path: Path, monkeypatch):
    run = create_run(tmp_path, "r").root
    env = SimpleNamespace(
        cfg=micro_config(), ledger=Ledger(run), variant="main", run_id="r", is_main=True, world_size=1, rank=0
    )
    state = TrainState(policy=None, optimizer=None, scheduler=None, calibrator=None)
    calls: list[tuple[str, int]] = []

    def recorder(name):
        def task(env_, state_, step, **kw):
            calls.append((name, step))
            if name == "evaluate":
                return StageResult(scores={"synthetic/avg@2": 0.25}), state_
            if name == "calibrate":
                return StageResult(info={"lower": 0.8, "upper": 1.28, "alpha": 0.01}), state_
            if name == "train":  # the train stage reports whether it ran the shadow passes
                return StageResult(metrics={"reward_mean": 0.5}, shadow=is_calibration_step(env_.cfg, step)), state_
            return StageResult(metrics={"reward_mean": 0.5}), state_

        # what the rank protocol reads of a stage task (one process: only the call itself)
        task.with_options, task.peer_body = lambda retries: task, task
        return task

    recorders = {name: recorder(name) for name in STAGES}
    monkeypatch.setattr(campaign, "stage_task", lambda spec: recorders[spec.name])
    monkeypatch.setattr(campaign, "_bounds_artifact", lambda *a: None)
    monkeypatch.setattr(campaign, "_eval_artifact", lambda *a: None)
    monkeypatch.setattr(campaign, "sync_engine", lambda *a, **k: None)
    progress = campaign.Progress(env.cfg, 0, echo=lambda line: None)
    return Ctx(env, state), calls, progress


class Ctx:
    """The (environment, state) pair, the state threaded through ``run_step`` calls."""

    def __init__(self, env, state):
        self.env, self.state, self.ledger, self.last_eval = env, state, env.ledger, {}

    def step(self, step, progress):
        _, self.state, self.last_eval = campaign.run_step(self.env, self.state, step, progress, self.last_eval)


def _done(ctx, step: int, stage: str, **info) -> None:
    with ctx.ledger.stage(step, stage) as rec:
        rec.info.update(info)


def test_a_fresh_step_runs_every_stage_of_its_schedule(setup) -> None:
    ctx, calls, progress = setup
    # micro config, 3 steps: calibrate at 1, 3; evaluate at 0, 2, 3; checkpoint at 2, 3
    for step in range(4):
        ctx.step(step, progress)
    assert calls == [
        ("evaluate", 0),
        ("rollout", 1),
        ("score", 1),
        ("train", 1),
        ("calibrate", 1),
        ("rollout", 2),
        ("score", 2),
        ("train", 2),
        ("evaluate", 2),
        ("checkpoint", 2),
        *[(s, 3) for s in STAGES],
    ]


def test_done_rollout_and_score_are_not_redone_their_sampler_is_restored(setup) -> None:
    ctx, calls, progress = setup
    _done(ctx, 3, "rollout", sampler=SamplerState(epoch=1, position=5).to_dict())
    _done(ctx, 3, "score", sampler=SamplerState(epoch=1, position=9).to_dict())
    _done(ctx, 3, "train")
    _done(ctx, 3, "calibrate")
    ctx.step(3, progress)
    # train, calibrate and checkpoint replay after a restore (the weights must be rebuilt)
    assert calls == [("train", 3), ("calibrate", 3), ("evaluate", 3), ("checkpoint", 3)]
    assert ctx.state.sampler == SamplerState(epoch=1, position=9)


def test_a_done_evaluation_is_read_from_the_ledger_and_train_replays(setup) -> None:
    ctx, calls, progress = setup
    for stage in ("rollout", "score"):
        _done(ctx, 2, stage, sampler=SamplerState().to_dict())
    _done(ctx, 2, "evaluate", scores={"synthetic/avg@2": 0.75})
    ctx.step(2, progress)
    assert ("evaluate", 2) not in calls and ("train", 2) in calls and ("checkpoint", 2) in calls
    assert ctx.last_eval == {"synthetic/avg@2": 0.75}


def test_a_done_base_evaluation_is_not_redone(setup) -> None:
    ctx, calls, progress = setup
    _done(ctx, 0, "evaluate", scores={"synthetic/avg@2": 0.5})
    ctx.step(0, progress)
    assert calls == [] and ctx.last_eval == {"synthetic/avg@2": 0.5}


def test_the_stage_runner_records_a_failure_and_the_next_attempt(tmp_path: Path) -> None:
    """The body of every stage task (``task.fn``, as Prefect calls it): ledger attempts, fault hook."""
    run = create_run(tmp_path, "r").root
    env = SimpleNamespace(ledger=Ledger(run), variant="main")
    seen = []

    def boom(env_, state_, step, attempt):
        raise OSError(28, "No space left on device")

    def ok(env_, state_, step, attempt):
        seen.append(attempt)
        return StageResult(info={"n": 3}), state_

    score = dataclasses.replace(STAGE_TABLE.get("score"), waits_for_go=False)  # one process: no go to wait for
    with pytest.raises(OSError):
        campaign._make_task(score, boom).fn(env, None, 1)
    out, _ = campaign._make_task(score, ok).fn(env, None, 1)
    assert out.info["n"] == 3 and seen == [1]
    recs = [(r.attempt, r.status) for r in env.ledger.records() if r.stage == "score"]
    assert recs == [(0, "failed"), (1, "done")]
