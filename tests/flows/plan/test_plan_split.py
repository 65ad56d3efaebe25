"""``fp8rl plan --rollout-gpus R``: a split placement's memory per GPU and expected step time."""

from __future__ import annotations

import pytest

from flows.campaign.configuration import load_config
from flows.plan.memory import GiB, arch_of, total_params
from flows.plan.split import GPU_RATES, split_plan

pytestmark = pytest.mark.timeout(60)

SPLIT = ["rollout.engine=vllm_http", "rollout.server_url=http://rollout:8000", "rollout.weight_sync=nccl",
         "rollout.gpu_memory_utilization=0.9", "rollout.max_staleness=1"]


def plan(gpus=4, rollout_gpus=4, *extra, **kw):
    cfg = load_config("qwen3-8b-grpo-deepscaler", [*SPLIT, *extra])
    return cfg, split_plan(cfg, gpus=gpus, rollout_gpus=rollout_gpus, gpu_memory_gib=80.0, **kw)


def test_training_gpus_hold_no_engine_and_rollout_gpus_hold_its_weights_and_kv_cache():
    cfg, p = plan()
    names = [name for name, _ in p.train_rows]
    assert not any("engine" in n for n in names) and names[-1] == "weight sync peak (vLLM, nccl)"
    assert dict(p.train_rows)[names[-1]] > 1.0  # vLLM's packed broadcast buffers (1 GiB each)
    params = total_params(arch_of(cfg))
    weights = dict(p.rollout_rows)["engine weights (fp8_per_block, TP 1)"]
    assert weights == pytest.approx(params * 1 / GiB)  # FP8: one byte per weight, the whole model per engine
    assert p.rollout_gib == pytest.approx(0.9 * 80.0)  # the engine's reservation, awake all the time
    assert p.engines == 4 and p.fits


def test_an_overlapped_step_takes_the_longer_side_plus_the_sync():
    _, p = plan(response_fill=0.35)
    assert p.overlapped_s == pytest.approx(max(p.rollout_s, p.train_s) + p.sync_s)
    assert p.lockstep_s == pytest.approx(p.rollout_s + p.train_s + p.sync_s) and p.lockstep_s > p.overlapped_s
    assert p.sync_s == pytest.approx(2 * total_params(arch_of(plan()[0])) / (GPU_RATES["h100"].link_gbps * 1e9))


def test_more_rollout_gpus_shorten_the_rollout_and_more_training_gpus_the_training():
    _, base = plan(4, 4, response_fill=0.35)
    _, more_rollout = plan(4, 8, response_fill=0.35)
    _, more_train = plan(8, 4, response_fill=0.35)
    assert more_rollout.rollout_s < 0.6 * base.rollout_s and more_rollout.train_s == base.train_s
    assert more_train.train_s == pytest.approx(base.train_s / 2) and more_train.rollout_s == base.rollout_s
    _, full = plan(4, 4)
    assert full.rollout_s > base.rollout_s  # every response at its budget: the upper bound


@pytest.mark.parametrize("sets, says", [
    ([], "needs the engine in processes of its own on other GPUs"),
    (["rollout.vllm_process=separate", "rollout.weight_sync=path"], "set rollout.weight_sync: nccl"),
])
def test_a_config_that_cannot_split_is_refused_in_one_line(sets, says):
    cfg = load_config("qwen3-8b-grpo-deepscaler", sets)
    with pytest.raises(ValueError, match=says) as err:
        split_plan(cfg, gpus=4, rollout_gpus=4, gpu_memory_gib=80.0)
    assert "\n" not in str(err.value)


def test_the_command_prints_both_gpus_and_both_schedules(tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    args = ["plan", "qwen3-8b-grpo-deepscaler", "--gpus", "4", "--rollout-gpus", "4", "--response-fill", "0.35"]
    r = CliRunner().invoke(app, [*args, *[x for s in SPLIT for x in ("--set", s)]])
    assert r.exit_code == 0, r.output
    for line in ("per training GPU:", "per rollout GPU:", "lockstep (max_staleness 0)", "overlapped", "fits"):
        assert line in r.output
    r = CliRunner().invoke(app, [*args, "--gpu-kind", "a100", *[x for s in SPLIT for x in ("--set", s)]])
    assert r.exit_code != 0 and "--gpu-kind must be one of h100, h200" in r.output
