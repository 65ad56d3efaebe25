"""A 2-rank campaign under torchrun (gloo, 1 thread each) against the same campaign in 1 process.

Same config, seed and global batch; the 2 ranks together run the 1-process
micro-batches, and each rank generates one of the step's two generation blocks
(stages.runtime.rollout_plan). Checks: identical rollouts, although the 2-rank run
retried its first rollout on both ranks after a transient failure of rank 0's
write (the ledger records both attempts); the union of the ranks' token_stats
parts has exactly the 1-process rows; step metrics and calibrated bounds agree
(step 1 equal up to the gradient reduction's float rounding, see
tests/stages/trainer/test_train_scaleout.py for the derivation of the tolerances); a 2-rank run
SIGKILLed during train and resumed on 2 ranks ends with the same weights and
tables as the uninterrupted 2-rank run; a rank whose daemon thread is busy
with torch at exit still ends cleanly. Overlong shaping is on so that the
barely-bootstrapped micro model still gets non-zero advantages.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import last_checkpoint_weights, micro_args, run_rows

EXTRA = [
    "steps=2",
    "threads=1",
    "precision.train=fp8_rowwise",
    "algorithm.overlong_shaping=true",
    "rollout.generation_batch_size=16",  # 2 generation blocks of 4 prompts: one per rank
    "algorithm.overlong_max_len=12",
    "algorithm.overlong_cache_len=8",
]


def _run(run_dir: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    sets = micro_args(*EXTRA)
    e = dict(os.environ, OMP_NUM_THREADS="1", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300", **(env or {}))
    cmd = [sys.executable, "-m", "flows.cli", *args]
    if args[0] == "run":
        cmd += ["tiny-cpu", "--run-dir", str(run_dir), *sets]
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spmd")
    out = {"one": root / "one", "two": root / "two"}
    r = _run(out["one"], "run", "--nproc-per-node", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    # a transient failure of rank 0's rollouts write: every rank retries the rollout together
    fault = {"FP8RL_FAULT": "rollout@1:write:rollouts=transient", "FP8RL_FAULT_MARKER": str(root / "fault-fired")}
    r = _run(out["two"], "run", "--nproc-per-node", "2", env=fault)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (root / "fault-fired").exists(), "the transient fault was never injected"
    return out


@pytest.mark.timeout(1200)
def test_two_ranks_equal_one_process(runs):
    q_roll = "SELECT step, sample_id, response_token_ids, rollout_logp FROM rollouts ORDER BY step, sample_id"
    assert run_rows(runs["one"], q_roll) == run_rows(runs["two"], q_roll)
    q_tok = (
        "SELECT step, sample_id, position, logp_fp8, old_logp_fp8, logp_bf16, old_logp_bf16, entropy "
        "FROM token_stats ORDER BY step, sample_id, position"
    )
    t1, t2 = run_rows(runs["one"], q_tok), run_rows(runs["two"], q_tok)
    assert [(r["step"], r["sample_id"], r["position"]) for r in t1] == [
        (r["step"], r["sample_id"], r["position"]) for r in t2
    ]
    step1 = [(a, b) for a, b in zip(t1, t2) if a["step"] == 1]
    assert all(a == b for a, b in step1)  # step 1: identical inputs and weights, bit-equal log-probs
    q_steps = "SELECT step, loss, grad_norm, clipfrac, ppo_kl, entropy_mean, n_tokens FROM steps ORDER BY step"
    for a, b in zip(run_rows(runs["one"], q_steps), run_rows(runs["two"], q_steps)):
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["step"], k)
    q_b = "SELECT step, alpha, lower, upper FROM bounds ORDER BY step"
    for a, b in zip(run_rows(runs["one"], q_b), run_rows(runs["two"], q_b)):
        assert a == pytest.approx(b, rel=1e-6)
    w1, w2 = last_checkpoint_weights(runs["one"]), last_checkpoint_weights(runs["two"])
    for k in w1:
        assert np.allclose(w1[k].float().numpy(), w2[k].float().numpy(), rtol=0, atol=1e-6), k


def test_a_transient_failure_under_two_ranks_is_retried_on_all_ranks_and_recorded(runs):
    q = "SELECT attempt, status FROM ledger WHERE step = 1 AND stage = 'rollout' ORDER BY attempt"
    assert run_rows(runs["two"], q) == [{"attempt": 0, "status": "failed"}, {"attempt": 1, "status": "done"}]


@pytest.mark.timeout(1200)
def test_sigkill_of_a_two_rank_run_during_train_then_resume_equals_the_uninterrupted_run(runs, tmp_path):
    d = tmp_path / "killed"
    r = _run(d, "run", "--nproc-per-node", "2", env={"FP8RL_FAULT": "train@2:mb0=kill"})
    assert r.returncode != 0
    one = tmp_path / "killed-resumed-in-one-process"
    shutil.copytree(d, one)
    for run_dir, nproc in ((d, "2"), (one, "1")):
        r = subprocess.run(
            [sys.executable, "-m", "flows.cli", "resume", str(run_dir), "--nproc-per-node", nproc],
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert r.returncode == 0, r.stderr[-3000:]
    w1, w2 = last_checkpoint_weights(runs["two"]), last_checkpoint_weights(d)
    for k in w1:
        assert (w1[k] == w2[k]).all(), k
    q = "SELECT step, sample_id, position, logp_fp8, old_logp_fp8 FROM token_stats ORDER BY step, sample_id, position"
    assert run_rows(runs["two"], q) == run_rows(d, q)
    # resumed in 1 process: step 1 (whose 2 rank parts were written before the kill) is replayed by one
    # process; rank 1's old part used to stay live beside it and its rows were read twice
    keys = "SELECT step, sample_id, position FROM token_stats ORDER BY step, sample_id, position"
    assert run_rows(one, keys) == run_rows(runs["one"], keys)
    step1 = q.replace(" ORDER BY", " WHERE step = 1 ORDER BY")
    assert run_rows(one, step1) == run_rows(runs["one"], step1)  # the same rows as the 1-process run, bit for bit


@pytest.mark.timeout(300)
def test_a_rank_whose_library_thread_is_busy_at_exit_still_ends_cleanly(runs, tmp_path):
    """A daemon thread running torch ops when a rank ends (as a library's background thread may) used to
    abort the finished rank in the interpreter's teardown (SIGABRT): torchrun then reported the finished
    run as failed. Resuming a finished 2-rank run is the cheapest way through a rank's whole end."""
    d = tmp_path / "finished"
    shutil.copytree(runs["one"], d)
    site = str(Path(__file__).parents[2] / "busy_thread_site")
    env = dict(os.environ, OMP_NUM_THREADS="1", FP8RL_TEST_BUSY_THREAD="flows.spmd")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    r = subprocess.run(
        [sys.executable, "-m", "flows.cli", "resume", str(d), "--nproc-per-node", "2"],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "terminate called" not in r.stderr
