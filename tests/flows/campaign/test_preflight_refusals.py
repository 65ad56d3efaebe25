"""Inputs a run cannot take are refused in one line before they cost anything.

Each test fails on the code before its fix. The CLI runs in-process (typer's
runner) only up to its refusal; no campaign runs.

| input                                                   | expected                                     |
|---------------------------------------------------------|----------------------------------------------|
| a run directory name over the file system's name limit  | one line, exit 2, nothing written            |
| resume --accept-config-change of a new score-centering K | one line, exit 2, nothing recorded           |
| a model the allocator cannot hold (--skip-memory-check)  | one line, exit 2, the run resumable          |
| a KV cache larger than the GPU, `fp8rl plan --analytic`  | "does NOT fit", as the measured plan says    |
| an empty / fully malformed / too-long benchmark file     | one line naming the file, exit 2, no run dir |
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import micro_config
from integrity_helpers import cli, one_line_exit_2, run_with_rows

from flows.campaign.configuration import dump_config


@pytest.fixture
def no_flow(monkeypatch):
    """The campaign flow replaced: what `run` and `resume` check before it is the point."""
    import flows.commands.run as cc

    calls = []
    monkeypatch.setattr(cc, "_run_flow", lambda run_dir, resume, **kw: calls.append(run_dir) or {})
    return calls


@pytest.mark.parametrize("length", [256, 300])
def test_a_run_directory_name_past_the_name_limit_is_refused_in_one_line(tmp_path: Path, no_flow, length: int) -> None:
    # over NAME_MAX the file system refuses even to look the name up: stat raised ENAMETOOLONG
    one_line_exit_2(cli("run", "tiny-cpu", "--run-dir", tmp_path / ("r" * length)), f"is {length} bytes")
    one_line_exit_2(cli("run", "tiny-cpu", "--run-dir", tmp_path / ("d" * length) / "run"), "name limit")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("before, after, refused", [(0, 2, True), (3, 2, True), (3, 0, False)])
def test_a_new_score_centering_k_is_refused_once_steps_were_rolled_out(
    tmp_path: Path, no_flow, before: int, after: int, refused: bool
) -> None:
    # the replayed steps' rollouts carry the old top-K: training them with another K failed, at every resume
    cfg = micro_config(f"algorithm.score_centering_k={before}")
    run = run_with_rows(tmp_path / "runs", "micro", config=dump_config(cfg))
    p = run / "config.yaml"
    p.write_text(p.read_text().replace(f"score_centering_k: {before}", f"score_centering_k: {after}", 1))
    r = cli("resume", run, "--accept-config-change")
    if not refused:  # turning it off needs nothing stored
        assert r.exit_code == 0 and no_flow == [run], r.stderr
        return
    one_line_exit_2(r, f"algorithm.score_centering_k ({before} -> {after}) cannot be taken", "steps 1 to 2")
    assert no_flow == [] and "config_changes" not in json.loads((run / "run.json").read_text())
    one_line_exit_2(cli("resume", run, "--accept-config-change"), "cannot be taken")  # the same line, again


def test_a_model_the_allocator_cannot_hold_is_one_line_and_the_run_stays_resumable(tmp_path: Path, monkeypatch) -> None:
    import flows.campaign.launch as rp

    def too_big(run_dir, *, resume, nproc_per_node=1):  # the allocator's own refusal, from inside the flow
        import torch

        torch.empty(1 << 60, dtype=torch.uint8)  # 1 EiB: refused at once, nothing touched

    monkeypatch.setattr(rp, "run_flow", too_big)
    run = tmp_path / "run"
    err = one_line_exit_2(
        cli("run", "tiny-cpu", "--skip-memory-check", "--run-dir", run), "out of memory", f"fp8rl resume {run}"
    )
    assert "can't allocate memory" in err
    monkeypatch.setattr(rp, "run_flow", lambda run_dir, *, resume, nproc_per_node=1: {})
    r = cli("resume", run)  # nothing lost: the lock is free and the run resumes
    assert r.exit_code == 0, r.stderr


def test_the_analytic_plan_counts_the_engines_reservation() -> None:
    from flows.plan.memory import format_plan, memory_plan

    vllm = ("rollout.engine=vllm", "rollout.vllm_process=trainer", "rollout.weight_sync=tensors")
    big = micro_config(*vllm, "rollout.kv_cache_gib=100")  # a KV cache larger than the 80 GiB GPU
    plan = memory_plan(big, gpus=1, gpu_memory_gib=80)
    assert not plan.fits and plan.rollout_gib > 100
    assert "does NOT fit: a smaller rollout.kv_cache_gib" in format_plan(big, plan, gpus=1, gpu_memory_gib=80)
    assert memory_plan(micro_config(*vllm, "rollout.kv_cache_gib=8"), gpus=1, gpu_memory_gib=80).fits
    small = micro_config(*vllm, "rollout.kv_cache_gib=0.8")  # on a 1 GiB GPU: 0.9 GiB after headroom
    assert memory_plan(small, gpus=1, gpu_memory_gib=1).fits  # a sleeping engine frees its cache for training
    awake = small.model_copy(update={"rollout": small.rollout.model_copy(update={"sleep_between_steps": False})})
    assert not memory_plan(awake, gpus=1, gpu_memory_gib=1).fits  # an awake one keeps it beside training


@pytest.mark.parametrize(
    "content, needle",
    [
        ("", "holds no usable problem (it is empty)"),
        ('not json\n{"answer": "1"}\n', "holds no usable problem (all 2 record(s) malformed"),
        (json.dumps({"problem": "1+" * 200 + "1?", "answer": "201"}) + "\n", "exceeds the model's context"),
    ],
    ids=["empty", "malformed", "too-long"],
)
def test_a_benchmark_the_model_cannot_run_is_refused_before_the_run_folder(
    tmp_path: Path, no_flow, content: str, needle: str
) -> None:
    (tmp_path / "data" / "amc23").mkdir(parents=True)
    (tmp_path / "data" / "amc23" / "test.jsonl").write_text(content)
    sets = [f"task.data_dir={tmp_path / 'data'}", "evaluation.benchmarks=[{name: amc23, k: 1, max_new_tokens: 12}]"]
    args = [a for s in sets for a in ("--set", s)]
    r = cli("run", "tiny-cpu", *args, "--run-dir", tmp_path / "run")
    one_line_exit_2(r, "evaluation data: benchmark amc23:", str(tmp_path / "data" / "amc23" / "test.jsonl"), needle)
    assert not (tmp_path / "run").exists() and no_flow == []
