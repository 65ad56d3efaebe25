"""FP4 precisions and the stress task through the stages.

One full campaign step in each new precision writes every table with r8/r16 (here:
FP4 vs BF16) on the calibration step; a checkpoint/restore in FP4 continues the
stochastic-rounding stream, so the resumed step equals the uninterrupted one;
``steps.garbled_share`` is the contract's (answer parser) share. (The stress task's
pipeline is covered by tests/fp8rl_core/tasks/test_stress_task.py without a bootstrap: a stress
micro-bootstrap measures its base accuracy on 1,000 x 47-token generations, minutes.)
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import StageRun as _Run
from conftest import micro_config, open_micro_run

from fp8rl_core.tasks.synthetic import extract_answer
from stages.calibrate import run_calibrate
from stages.checkpoint import restore, run_checkpoint
from stages.context import is_calibration_step, open_run
from stages.evaluate import run_evaluate
from stages.rollout import run_rollout
from stages.score import run_score
from stages.train import run_train
from storage.queries.catalog import connect, query

pytestmark = pytest.mark.timeout(600)  # the first test may pay the session's micro bootstrap

FP4_MODES = {
    "nvfp4": ["precision.train=nvfp4", "precision.rollout=nvfp4_w4a4"],
    "mxfp4": ["precision.train=mxfp4", "precision.rollout=mxfp4_w4a4"],
    "nvfp4-train-fp8-rollout": ["precision.train=nvfp4", "precision.rollout=fp8_per_tensor"],
}
TABLES = ("rollouts", "scores", "token_stats", "steps", "bounds", "evals", "eval_scores")


def _context(tmp_path, cfg, name="r"):
    return _Run(*open_micro_run(tmp_path, cfg, name))


def _step(ctx, step):
    ctx(run_rollout, step)
    ctx(run_score, step)
    out = ctx(run_train, step)
    if is_calibration_step(ctx.env.cfg, step):
        ctx(run_calibrate, step)
    return out


@pytest.mark.parametrize("mode", sorted(FP4_MODES))
def test_one_full_step_in_each_fp4_precision_writes_every_table(tmp_path, mode):
    ctx = _context(tmp_path, micro_config(*FP4_MODES[mode]))
    try:
        out = _step(ctx, 1)
        ctx(run_evaluate, 1)
        ctx(run_checkpoint, 1, metrics={})
    finally:
        ctx.close()
    con = connect(tmp_path / "r")
    for table in TABLES:
        n = query(con, f"SELECT count(*) AS n FROM {table}").column("n")[0].as_py()
        assert n > 0, f"{mode}: {table} is empty"
    t = query(
        con,
        "SELECT count(*) AS n, count(ratio_fp8) AS r8, count(ratio_bf16) AS r16, "
        "avg(abs(logp_fp8 - logp_bf16)) AS gap FROM token_stats",
    ).to_pylist()[0]
    assert t["n"] == t["r8"] == t["r16"]
    assert t["gap"] > 0  # the low-precision pass differs from the BF16 shadow
    m = out["metrics"]
    assert math.isfinite(m["loss"]) and m["skipped_updates"] == 0
    # FP4 vs BF16 probabilities differ; ratios may not yet on step 1: MXFP4 has no batch-wide scale, and
    # one micro update at lr 1e-4 moves neither the FP4 nor the BF16-cast weights, so r8 = r16 = 1 is possible
    assert m["prob_nmae"] > 0 and m["ratio_nmae"] >= 0
    s = query(con, "SELECT garbled_share, garbled_heuristic_share FROM steps").to_pylist()[0]
    responses = query(con, "SELECT response FROM rollouts").column("response").to_pylist()
    # docs/method.md: garbled = the task's answer parser cannot read it (the micro model garbles plenty)
    assert s["garbled_share"] == pytest.approx(sum(extract_answer(r) is None for r in responses) / len(responses))
    assert s["garbled_heuristic_share"] is not None
    rollout_precision = query(con, "SELECT DISTINCT precision FROM rollouts").column("precision").to_pylist()
    assert rollout_precision == [FP4_MODES[mode][1].split("=")[1]]


def test_fp4_resume_from_checkpoint_equals_the_uninterrupted_run(tmp_path):
    """Run a: steps 1-2. Run b: step 1, checkpoint, a fresh process state restored from it, step 2.
    The stochastic-rounding generator is in the checkpoint, so b's weights equal a's."""
    cfg = micro_config(*FP4_MODES["nvfp4"])
    ctx = _context(tmp_path, cfg, "a")
    try:
        _step(ctx, 1)
        _step(ctx, 2)
        uninterrupted = {k: v.clone() for k, v in ctx.state.policy.state_dict().items()}
    finally:
        ctx.close()
    ctx = _context(tmp_path, cfg, "b")
    try:
        _step(ctx, 1)
        path = ctx(run_checkpoint, 1)["outputs"][0]
        torch.rand(1000)  # the interrupted process drew more random numbers before dying
    finally:
        ctx.close()
    fresh = _Run(*open_run(cfg, tmp_path / "b"))
    try:
        step, fresh.state = restore(fresh.env, fresh.state, path)
        assert step == 1
        _step(fresh, 2)
        resumed = fresh.state.policy.state_dict()
    finally:
        fresh.close()
    for k, v in resumed.items():
        assert torch.equal(v, uninterrupted[k]), k
