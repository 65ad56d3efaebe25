"""Failures end every rank, never hang it: stage limits every rank enforces alike, the process group's from the config.

* the limits are per-preset settings: the process group's timeout must exceed
  every stage's (a rank waiting for a phase another rank runs alone is ended by
  that phase's limit, not by a collective), and the GPU presets set them;
* a stage past its limit ends the process with one line and exit status 124,
  from a timer, so a rank stuck where no exception can reach it ends too;
* the process group's timeout is the one given: a gloo collective waiting for
  a rank that does not come fails after it;
* a 2-rank campaign (torchrun, gloo, the tiny preset) whose rank 1 never
  finishes its rollout of step 1: every rank ends within a bounded time, each
  with at most one line of its own and no traceback, and ``fp8rl resume``
  on 2 ranks then completes the campaign.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.multiprocessing as tmp
from conftest import MICRO_OVERRIDES

from flows.campaign.configuration import ConfigError, load_config
from storage.queries.catalog import connect, query
from tests.scaleout_common import leave_rank

ROOT = Path(__file__).resolve().parents[3]


def test_the_process_group_must_outlast_every_stage_limit():
    with pytest.raises(ConfigError, match=r"timeouts.process_group_s=4500 must exceed .*timeouts.evaluate_s=5000"):
        load_config("tiny-cpu", ["timeouts.evaluate_s=5000", "timeouts.process_group_s=4500"])
    cfg = load_config("tiny-cpu", ["timeouts.rollout_s=5"])
    assert cfg.timeouts.stage_s("rollout") == 5.0


@pytest.mark.parametrize("preset", ["qwen3-8b-grpo-deepscaler", "qwen3-14b-dapo", "qwen2.5-32b-grpo"])
def test_the_gpu_presets_set_their_limits(preset):
    text = (ROOT / "configs" / f"{preset}.yaml").read_text()
    assert "timeouts:" in text and "process_group_s" in text
    load_config(preset)  # validates: the group outlasts every stage


def test_a_stage_past_its_limit_ends_the_process_with_one_line():
    code = textwrap.dedent(
        """
        import time
        from stages.runtime.deadline import stage_deadline
        with stage_deadline("rollout", 3, 0.5, rank=1):
            time.sleep(60)  # where no exception could reach: a collective, an engine loop
        print("not reached")
        """
    )
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert time.perf_counter() - start < 30
    assert r.returncode == 124 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank 1: rollout of step 3 ran past its limit of 0.5 s" in lines[0], r.stderr
    assert "timeouts.rollout_s" in lines[0] and "fp8rl resume RUN_DIR" in lines[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_rank(rank: int, port: int, out_dir: str) -> None:
    from stages.trainer.distributed import init_from_env

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    init_from_env(None, timeout_s=3)
    if rank == 1:  # never joins the broadcast; leaves once rank 0 is done
        Path(out_dir, "rank1").write_text("up")
        while not Path(out_dir, "rank0").exists():
            time.sleep(0.1)
        leave_rank()
    start = time.perf_counter()
    try:
        dist.broadcast_object_list([1], src=1)
        outcome = "returned"
    except Exception as err:  # gloo: the collective timed out
        outcome = type(err).__name__
    Path(out_dir, "rank0").write_text(f"{outcome} {time.perf_counter() - start:.1f}")
    leave_rank()


@pytest.mark.timeout(120)
def test_the_process_group_timeout_is_the_one_given(tmp_path):
    saved = os.environ.pop("WORLD_SIZE", None)
    try:
        tmp.spawn(_group_rank, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    finally:
        if saved is not None:
            os.environ["WORLD_SIZE"] = saved
    outcome, seconds = (tmp_path / "rank0").read_text().split()
    assert outcome != "returned" and 2.5 < float(seconds) < 30, (outcome, seconds)


HANG = textwrap.dedent(
    """
    # Test hook: rank 1 never finishes its rollout of step 1 (a rank stuck in its engine).
    import os
    if os.environ.get("RANK") == "1":
        import time
        import stages.rollout as _rollout
        _run = _rollout.run_rollout
        def run_rollout(env, state, step, **kw):
            if step == 1 and kw.get("round_", 0) == 0:
                open(os.environ["HANG_STARTED"], "w").write(repr(time.time()))
                time.sleep(3600)
            return _run(env, state, step, **kw)
        _rollout.run_rollout = run_rollout
    """
)
LIMIT_S = 10  # a rollout here takes about 1 s
EXTRA = [
    "steps=2", "threads=1", "rollout.generation_batch_size=16", f"timeouts.rollout_s={LIMIT_S}",
    "evaluation.benchmarks=[{name: synthetic, k: 1, limit: 4, max_new_tokens: 12}]",  # evaluation is not the point
]


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, OMP_NUM_THREADS="1", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300", **(env or {}))
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=e, capture_output=True, text=True)


@pytest.mark.timeout(1500)
def test_a_rank_past_its_stage_limit_ends_every_rank_then_resume_completes(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HANG)
    run_dir = tmp_path / "run"
    sets = [a for o in MICRO_OVERRIDES + EXTRA for a in ("--set", o)]
    started = tmp_path / "hang-started"
    hang = {"PYTHONPATH": str(hook), "HANG_STARTED": str(started)}
    r = _cli("run", "tiny-cpu", "--run-dir", str(run_dir), "--nproc-per-node", "2", *sets, env=hang)
    assert r.returncode != 0, r.stderr[-3000:]
    seconds = time.time() - float(started.read_text())
    # the limit, then torchrun's stop; without limits: gloo's 30 minutes, or for ever
    assert seconds < LIMIT_S + 120, f"the ranks took {seconds:.0f} s to end after rank 1 hung"
    said = [line for line in r.stderr.splitlines() if line.startswith("error: rank ")]
    expected = f"error: rank 1: rollout of step 1 ran past its limit of {LIMIT_S} s"
    assert any(line.startswith(expected) for line in said), said
    assert len({line.split(":")[0] + line.split(":")[1] for line in said}) == len(said), said  # one line per rank
    no_traceback = "stages/" not in r.stderr and "flows/campaign/flow.py" not in r.stderr  # of no rank
    assert no_traceback, r.stderr[-3000:]
    r = _cli("resume", str(run_dir), "--nproc-per-node", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    con = connect(run_dir)
    steps = query(con, "SELECT step FROM steps WHERE variant = 'main' ORDER BY step").column("step").to_pylist()
    assert steps == [1, 2]
    rollouts = query(con, "SELECT count(*) AS n FROM rollouts WHERE step = 1 AND variant = 'main'")
    assert rollouts.column("n").to_pylist() == [8 * 4]
