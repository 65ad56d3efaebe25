"""Golden tables: a short default campaign gives the same numbers on every x86-64 CPU.

``tests/golden/micro_campaign.py`` runs a 2-step micro campaign of the default preset
(bootstrap, rollout, score, train with a calibration step, evaluation) in a fresh process and
prints its key table values: every ``steps`` metric of the column contract, the
``eval_scores``, a hash of every rollout (tokens and rollout log-probs) and a hash of every
``token_stats`` row (FP8 and BF16 log-probs, ratios). They must equal, bit for bit, the values
committed in ``tests/golden/micro_campaign.json``.

What was made CPU-independent, and how (``fp8rl_core/host/cpu_env.py``, docs/cpu.md):

* ATen's vectorized kernels (softmax, log-softmax, cross-entropy, SDPA's online softmax,
  every reduction): ``ATEN_CPU_CAPABILITY=avx2`` before torch, so AVX-512 CPUs run the
  same AVX2 code as AVX2-only ones (an AVX-512 Xeon otherwise differs in the last bits).
* MKL (FP32 GEMMs, large ``exp``): the campaign's default is ``MKL_CBWR=AVX2``, MKL's
  reproducible AVX2 branch on every Intel CPU with AVX2; MKL honours branches other than
  AUTO and COMPATIBLE on Intel CPUs only, so an AMD CPU runs its own branch. This test runs
  the campaign on ``MKL_CBWR=COMPATIBLE``, the branch MKL runs alike on every x86-64 vendor,
  so the committed values hold on Intel and AMD machines alike (docs/cpu.md: the default
  campaign is identical across Intel CPUs; across vendors with ``MKL_CBWR=COMPATIBLE``).
* BF16 GEMMs: ``precision.cpu_bf16_gemm: auto`` runs the tiny model's BF16 matmuls as FP32
  GEMMs on BF16 operands on every CPU, so oneDNN's ISA-dependent BF16 kernels (AMX,
  AVX512-BF16, AVX2) never run.
* Sampling (``torch.multinomial`` on the CPU generator) and thread count: the generator is
  seeded per prompt block and the run's thread count is fixed (one here).

Checked on a 2-core AMX Xeon (2026-12-02): the committed values again with MKL limited to AVX2
(``ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``) and to SSE4.2; without the pinning
the same (AVX-512) machine gives other values (another bootstrap, other entropies).
Regenerate after a deliberate change of
the default numerics (and commit the JSON):

    PYTHONPATH=$PWD .venv/bin/python tests/golden/micro_campaign.py --write
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest


def _cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _default_env() -> dict:
    """The environment of `fp8rl run`: no numerics variable of the caller's, no thread cap of the suite's."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "FP8RL_MAX_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[3]), env.get("PYTHONPATH", "")])
    return env


def _script(name: str, *args: str, timeout: int = 580) -> str:
    out = subprocess.run(
        [sys.executable, str(GOLDEN_DIR / name), *args],
        env=_default_env(),
        cwd=GOLDEN_DIR.parents[1],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "golden"

# The committed values are x86-64 values (ATen's AVX2 kernels); elsewhere `make run` works, these checks skip.
pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or "avx2" not in _cpu_flags(),
    reason="the golden values and primitive hashes are for x86-64 CPUs with AVX2",
)


def _diff(got: dict, want: dict, where: str = "") -> list[str]:
    if isinstance(want, dict) and isinstance(got, dict):
        return [d for k in sorted(set(got) | set(want)) for d in _diff(got.get(k), want.get(k), f"{where}.{k}")]
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in _diff(g, w, f"{where}[{i}]")]
    return [] if got == want else [f"{where}: {got!r} != golden {want!r}"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_micro_campaign_tables_equal_the_committed_golden_values():
    got = json.loads(_script("micro_campaign.py"))
    want = json.loads((GOLDEN_DIR / "micro_campaign.json").read_text())
    assert got["numerics"] == want["numerics"], "this process did not run with the pinned CPU numerics"
    differences = _diff(got, want)
    assert not differences, (
        "tables differ from the golden values on this CPU "
        "(regenerate only after a deliberate numerics change: "
        "tests/golden/micro_campaign.py --write):\n" + "\n".join(differences[:20])
    )


def _hash_lines(text: str) -> dict[str, str]:
    return dict(line.rsplit(None, 1) for line in text.splitlines() if line.strip() and not line.startswith("#"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_cpu_primitive_hashes_as_committed():
    """Each primitive of the default campaign (tests/golden/cpu_primitives.py), computed as the
    campaign computes it, gives the committed bits: a CPU that differs fails naming the primitives."""
    got = _hash_lines(_script("cpu_primitives.py", timeout=280))
    want = _hash_lines((GOLDEN_DIR / "cpu_primitive_hashes.txt").read_text())
    assert set(got) == set(want), f"primitives added or removed: regenerate ({sorted(set(got) ^ set(want))})"
    differ = [name for name in want if got[name] != want[name]]
    assert not differ, "these primitives give other bits on this CPU than on the one the hashes were made on:\n" + (
        "\n".join(differ)
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_two_step_campaign_dispatches_only_hashed_ops_and_no_cpu_dependent_library():
    """Every float ATen op the micro campaign dispatches on the CPU is covered by a primitive's hash
    (or moves values without arithmetic), and none reaches MKL's or oneDNN's CPU-chosen kernels."""
    sys.path.insert(0, str(GOLDEN_DIR))
    import cpu_primitives

    ops = json.loads(_script("micro_campaign.py", "--ops"))
    campaign = {tuple(x) for x in ops["campaign"]}
    assert len(campaign) > 50 and ("aten.mm", "float64") in campaign  # it saw the run and its exact GEMMs
    assert cpu_primitives.library_calls(campaign) == []
    assert cpu_primitives.unhashed(campaign, {tuple(x) for x in ops["hashed"]}) == []


def test_the_ops_check_names_a_library_call_and_an_unhashed_op():
    """The check itself: an MKL GEMM, a vector exp and an op no primitive covers are each named."""
    sys.path.insert(0, str(GOLDEN_DIR))
    import cpu_primitives

    seen = {("aten.mm", "float32"), ("aten.exp", "float64"), ("aten.mm", "float64"), ("aten.view", "float32")}
    assert cpu_primitives.library_calls(seen) == ["aten.exp float64", "aten.mm float32"]
    assert cpu_primitives.unhashed({("aten.lgamma", "float32"), ("aten.view", "float32")}, set()) == [
        "aten.lgamma float32"
    ]
    assert cpu_primitives.unhashed({("aten.log_softmax", "float32")}, {("aten._log_softmax", "float32")}) == []
