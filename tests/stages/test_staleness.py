"""``rollout.max_staleness``: a fixed lag between the policy that samples and the policy that trains.

With k ≥ 1 step t trains on rows sampled by policy version t − 1 − k; the rollout
side's stages run for step t + k before step t trains (``stages.dag.stage_runs``),
one step after another, so the schedule is deterministic and resumable:

* the schedule: k = 0 is the lockstep table order; k = 1 runs step 1's and 2's rollout
  side at step 1, then step t + 1's at step t;
* the refusals, each one line: no behaviour weight (``algorithm.tis: false``), an engine
  colocated with training on a GPU;
* a 3-step k = 1 campaign, its rollout side in a worker process beside training: every row's
  lag is exactly k after the first step; two runs are identical, and equal to the same
  schedule run in lockstep order; a SIGKILL during step 3's rollout (beside step 2's
  training) then a resume gives the uninterrupted run's tables; the named query reads the
  behaviour weight by lag and splits it into lag and rollout mismatch (the lag part exactly 0
  at lag 0, with rowwise FP8 training);
* under torchrun (2 ranks) the same schedule in lockstep order: the one-process run's rows;
* the trainer's log-probs the rollout side records (``rollouts.train_logp``) on a hand-built
  batch are the train stage's pi_old on the same rows, bit for bit, at the right positions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MICRO_OVERRIDES

from flows.campaign.configuration import ConfigError, load_config
from storage.queries.catalog import connect, query

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from compare_runs import KEYS, compare  # noqa: E402

LAGGED = [
    *MICRO_OVERRIDES, "threads=1", "rollout.max_staleness=1", "checkpoint.interval=1", "precision.train=fp8_rowwise",
    # overlong shaping: the barely-bootstrapped micro policy's groups get non-zero advantages, so it moves
    "algorithm.overlong_shaping=true", "algorithm.overlong_max_len=12", "algorithm.overlong_cache_len=8",
    "rollout.generation_batch_size=16",  # 2 generation blocks a step: one per rank under torchrun
]  # fmt: skip


def _schedule(cfg, step: int, shadow: bool = False) -> list[tuple[str, int]]:
    from stages.dag import StepContext, stage_runs
    from stages.result import StageResult

    ctx = StepContext(trained=StageResult(shadow=shadow))
    return [(spec.name, at) for spec, at in stage_runs(cfg, step, ctx)]


def test_the_schedule_runs_the_rollout_side_k_steps_ahead():
    lockstep = load_config("tiny-cpu", [*MICRO_OVERRIDES, "steps=4"])
    assert _schedule(lockstep, 1) == [("rollout", 1), ("score", 1), ("train", 1)]
    assert _schedule(lockstep, 0) == [("evaluate", 0)]
    lagged = load_config("tiny-cpu", [*LAGGED, "steps=4"])
    assert _schedule(lagged, 0) == [("evaluate", 0)]
    assert _schedule(lagged, 1)[:5] == [("rollout", 1), ("score", 1), ("rollout", 2), ("score", 2), ("train", 1)]
    # step t offers t … t + 1 (the runner skips what the ledger has); nothing past the last step
    ahead = [("rollout", 3), ("score", 3), ("rollout", 4), ("score", 4)]
    assert _schedule(lagged, 3, shadow=True)[:6] == [*ahead, ("train", 3), ("calibrate", 3)]
    assert [s for s in _schedule(lagged, 4) if s[0] in ("rollout", "score")] == [("rollout", 4), ("score", 4)]


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["rollout.max_staleness=2", "algorithm.tis=false"], "trains on rows sampled 2 policy versions back: the"),
        (["rollout.max_staleness=1", "device=cuda"], "runs in the trainer's process and shares its GPU (colocated)"),
    ],
)  # fmt: skip
def test_a_lag_without_its_correction_or_with_a_colocated_gpu_engine_is_refused_in_one_line(sets, says):
    with pytest.raises(ConfigError) as err:
        load_config("tiny-cpu", sets)
    assert says in str(err.value) and len(str(err.value).splitlines()) == 1


def test_a_colocated_gpu_preset_with_a_lag_is_refused():
    with pytest.raises(ConfigError, match="cannot overlap"):
        load_config("qwen3-8b-grpo-deepscaler", ["rollout.max_staleness=1"])


def _run(run_dir: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "flows.cli", args[0]]
    if args[0] == "run":
        cmd += ["tiny-cpu", "--run-dir", str(run_dir)]
        for o in LAGGED:
            cmd += ["--set", o]
    cmd += args[1:]
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def lagged(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("lag") / "a"
    r = _run(d, "run")
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def _same_tables(a: Path, b: Path) -> None:
    for table in KEYS:
        assert compare(a, b, table) == [], table


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_row_is_sampled_k_versions_back_and_the_query_reads_the_weight_by_lag(lagged):
    rows = query(connect(lagged), "SELECT DISTINCT step, policy_version FROM rollouts ORDER BY step").to_pylist()
    assert [(r["step"], r["policy_version"]) for r in rows] == [(1, 0), (2, 0), (3, 1)]  # lag 0, 1, 1
    out = subprocess.run([sys.executable, "-m", "flows.cli", "query", str(lagged), "--named", "behaviour-by-lag",
                          "--format", "json"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    by_lag = {r["lag"]: r for r in json.loads(out.stdout)}
    assert sorted(by_lag) == [0, 1] and all(r["split_tokens"] == r["tokens"] > 0 for r in by_lag.values())
    # at lag 0 the trainer's log-prob at the sampling weights is pi_old itself (rowwise scales: per token)
    assert by_lag[0]["mean_abs_lag_part"] == 0.0 and by_lag[1]["mean_abs_lag_part"] > 0.0
    assert by_lag[0]["mean_abs_mismatch_part"] > 0.0  # the engine's rounding, not the trainer's


def test_the_rollout_sides_trainer_log_probs_are_the_train_stages_on_the_same_rows():
    """``response_logprobs`` on a hand-built batch (unequal prompts and responses, one empty response):
    its rows laid out as the train stage lays them (``build_batch``), so on the same rows in the same
    micro-batches it gives the train stage's pi_old bit for bit (the lag part is then exactly 0 at lag 0);
    and each value sits at its response token's own position (an fp32 forward's log-softmax, within BF16
    rounding)."""
    import pyarrow as pa

    from fp8rl_core.config.model import ModelConfig
    from fp8rl_core.precision.conversion import convert_for_training
    from fp8rl_core.tasks.tiny_model import build_tiny_model
    from stages.train import build_batch
    from stages.trainer.forward import ForwardSpec, policy_logprobs, response_logprobs

    torch.manual_seed(0)
    prompts, responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[20, 21, 22, 23], [24], []]
    fp8 = build_tiny_model(ModelConfig())
    convert_for_training(fp8, "fp8_rowwise", emulate=True)
    got = response_logprobs(fp8, prompts, responses, mode="fp8_rowwise", micro_batch_size=2, pad_id=0)
    rows = pa.table({"sample_id": [0, 1, 2], "prompt_token_ids": prompts, "response_token_ids": responses,
                     "rollout_logp": [[0.0] * len(r) for r in responses]})  # fmt: skip
    scores = pa.table({"sample_id": [0, 1, 2], "kept": [True] * 3, "advantage": [1.0, -1.0, 0.5]})
    batch = build_batch(rows, scores, pad_id=0)
    with torch.no_grad():
        spec = ForwardSpec("fp8_rowwise", micro_batch_size=2)
        old = policy_logprobs(fp8, batch.input_ids, batch.attention_mask, spec)[0]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        assert got[i] == old[i][batch.response_mask[i] > 0].tolist() and len(got[i]) == len(r)
    plain = build_tiny_model(ModelConfig())
    got = response_logprobs(plain, prompts, responses, mode="bf16", micro_batch_size=None, pad_id=0)
    for p, r, lp in zip(prompts, responses, got):
        with torch.no_grad():
            logits = plain(torch.tensor([p + r])).logits[0].float()
        ref = [torch.log_softmax(logits[len(p) + j - 1], -1)[tok].item() for j, tok in enumerate(r)]
        assert np.allclose(lp, ref, atol=0.05), (lp, ref)  # BF16 casts of the weights: ~1e-2 nats here


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_lagged_runs_are_identical_and_equal_the_lockstep_order(lagged, tmp_path):
    """The overlapped run (the engine in a worker, the rollout side in a thread beside training) twice, and
    the same schedule run in lockstep order in one thread (rollout.overlap: false)."""
    r = _run(tmp_path / "b", "run")
    assert r.returncode == 0, r.stderr[-3000:]
    _same_tables(lagged, tmp_path / "b")
    r = _run(tmp_path / "c", "run", "--set", "rollout.overlap=false")
    assert r.returncode == 0, r.stderr[-3000:]
    _same_tables(lagged, tmp_path / "c")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_during_the_overlapped_rollout_then_resume_equals_the_uninterrupted_run(lagged, tmp_path):
    d = tmp_path / "killed"
    r = _run(d, "run", env={"FP8RL_FAULT": "rollout@3:start=kill"})  # step 3's rows, sampled at step 2
    assert r.returncode != 0
    done = query(connect(d), "SELECT step, stage FROM ledger WHERE status = 'done' ORDER BY step").to_pylist()
    assert {"step": 2, "stage": "score"} in done and {"step": 2, "stage": "train"} not in done
    r = _run(d, "resume", str(d))
    assert r.returncode == 0, r.stderr[-3000:]
    trains = query(connect(d), "SELECT step FROM ledger WHERE stage = 'train' AND status = 'done' ORDER BY step")
    assert trains.column("step").to_pylist() == [1, 2, 3]  # from step 1's checkpoint: its sampler past step 2's rows
    _same_tables(lagged, d)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_keep_the_lockstep_order_and_sample_the_same_rows(lagged, tmp_path):
    """Under torchrun the rollout side does not overlap (its gathers would interleave with FSDP's
    collectives): the same schedule in lockstep order gives the one-process run's rows and token stats,
    without the trainer's log-probs at the sampling weights (a sharded forward the rollout side cannot
    start alone)."""
    d = tmp_path / "two-ranks"
    r = _run(d, "run", "--nproc-per-node", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = "SELECT step, sample_id, response_token_ids, rollout_logp, policy_version FROM rollouts ORDER BY 1, 2"
    assert query(connect(d), rows).to_pylist() == query(connect(lagged), rows).to_pylist()
    computed = query(connect(d), "SELECT count(*) AS n FROM rollouts WHERE train_logp IS NOT NULL")
    assert computed.column("n").to_pylist() == [0]
    assert compare(lagged, d, "token_stats") == [] and compare(lagged, d, "scores") == []
