"""A 2-rank campaign through torchao's own float8 modules, the module stack a tensorwise GPU run trains.

``precision.backend: torchao`` with ``fp8_tensorwise`` puts torchao's ``Float8Linear`` (in its
``emulate`` mode on a CPU) where a GPU run has it; under ``--nproc-per-node 2`` FSDP2 shards it on
gloo with the bf16 mixed-precision policy and float8 all-gather (each linear receives the
all-gathered float8 payload and torchao precomputes the scales after every optimizer step), and
a shadow (BF16) step runs, whose forward must read the BF16 weights rather than the payload.
The run is SIGKILLed inside step 3's update; the checkpoint its two ranks wrote at step 2 then
resumes on 2 ranks and, from a copy, on 1, both to the end, and the checkpoints' exports are plain
state dicts (the bf16 model's names, shapes and dtypes, no float8 tensor), the way vLLM or
``from_pretrained`` read them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import micro_args, run_rows
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

EXTRA = [
    "threads=1",
    "precision.train=fp8_tensorwise",
    "precision.backend=torchao",
    "precision.emulate=true",
    "algorithm.overlong_shaping=true",  # non-zero advantages for the barely bootstrapped micro model
    "algorithm.overlong_max_len=12",
    "algorithm.overlong_cache_len=8",
    "rollout.generation_batch_size=16",
]


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, OMP_NUM_THREADS="1", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300", **(env or {}))
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], env=e, capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("torchao") / "run"
    sets = micro_args(*EXTRA)
    r = _cli("run", "tiny-cpu", "--run-dir", str(d), *sets, "--nproc-per-node", "2",
             env={"FP8RL_FAULT": "train@3:mb0=kill"})
    assert r.returncode != 0, "the fault hook did not end the run"
    return d


def test_two_ranks_train_torchaos_modules_with_float8_all_gather_and_a_shadow_step(killed):
    info = json.loads((killed / "run.json").read_text())
    assert info["layer_precision"]["backend"] == "torchao" and info["layer_precision"]["fp8_linears"] > 0
    assert info["sharding"] == {"ranks": 2, "float8_all_gather": True}
    steps = run_rows(killed, "SELECT step, shadow, world_size, loss FROM steps ORDER BY step")
    assert [(r["step"], r["world_size"]) for r in steps] == [(1, 2), (2, 2)]
    shadow_steps = [r["step"] for r in steps if r["shadow"]]
    assert shadow_steps, "no calibration (shadow) step ran"
    q = f"SELECT count(*) AS n, count(logp_bf16) AS bf16 FROM token_stats WHERE step = {shadow_steps[0]}"
    shadow = run_rows(killed, q)[0]
    assert shadow["n"] > 0 and shadow["bf16"] == shadow["n"], "the shadow step's BF16 log-probs are missing"
    assert all(r["loss"] == r["loss"] for r in steps), "a NaN loss"


def _export(run_dir: Path, step: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model" / "model.safetensors"))


def test_the_float8_all_gather_checkpoint_resumes_on_two_ranks_and_on_one(killed, tmp_path):
    one = tmp_path / "resumed-on-one-rank"
    shutil.copytree(killed, one)
    for run_dir, ranks in ((killed, 2), (one, 1)):
        r = _cli("resume", str(run_dir), "--nproc-per-node", str(ranks))
        assert r.returncode == 0, f"resume on {ranks} rank(s):\n{r.stderr[-3000:]}"
        steps = run_rows(run_dir, "SELECT step, world_size FROM steps ORDER BY step")
        assert [(s["step"], s["world_size"]) for s in steps] == [(1, 2), (2, 2), (3, ranks)]
        info = json.loads((run_dir / "run.json").read_text())
        assert info["sharding"] == {"ranks": ranks, "float8_all_gather": ranks > 1}
    for run_dir in (killed, one):
        for step in (2, 3):
            state = _export(run_dir, step)
            assert state and all(t.dtype.is_floating_point and t.dtype.itemsize >= 2 for t in state.values())
            assert not [k for k in state if "float8" in k or "_scale" in k or "_data" in k]
    # the files one process writes: a tied output embedding once, under the input embedding's name
    two_state, one_state = _export(killed, 3), _export(one, 3)
    assert {k: v.shape for k, v in two_state.items()} == {k: v.shape for k, v in one_state.items()}
