"""The test hooks of ``storage.faults`` act only when the test suite arms them (``FP8RL_TEST_HOOKS=1``).

A user's environment with ``FP8RL_FAULT`` or ``FP8RL_INJECT_LR`` set, and no
arming, injects nothing; and no module outside ``storage/faults.py`` reads a
test hook's variable itself.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from storage import faults

ROOT = Path(__file__).resolve().parents[2]
PLAN = {faults.ENV: "train@3:mb1=enospc", faults.LR_ENV: "2:4=0.5"}


def test_unarmed_hooks_do_nothing() -> None:
    with faults.stage_scope("train", 3):
        faults.at("train", 3, "mb1", env=dict(PLAN))  # no FP8RL_TEST_HOOKS: nothing fires
        faults.at("train", 3, "mb1", env=dict(PLAN, **{faults.ARMED_ENV: "yes"}))  # only "1" arms them
    assert faults.injected_lr(3, env=dict(PLAN)) is None


def test_armed_hooks_fire() -> None:
    armed = dict(PLAN, **{faults.ARMED_ENV: "1"})
    with pytest.raises(OSError, match="No space left"):
        faults.at("train", 3, "mb1", env=armed)
    assert faults.injected_lr(3, env=armed) == 0.5 and faults.injected_lr(5, env=armed) is None


def test_point_inside_a_stage_obeys_the_arming(monkeypatch) -> None:
    monkeypatch.setenv(faults.ENV, "train@3:mb1=enospc")
    monkeypatch.delenv(faults.ARMED_ENV, raising=False)
    with faults.stage_scope("train", 3):
        faults.point("mb1")
    monkeypatch.setenv(faults.ARMED_ENV, "1")
    with faults.stage_scope("train", 3), pytest.raises(OSError, match="No space left"):
        faults.point("mb1")


def test_only_storage_faults_reads_the_hooks_variables() -> None:
    names = re.compile(r"[\"']FP8RL_(FAULT|INJECT_LR|TEST_HOOKS)")  # a string literal: a read, not a comment
    readers = []
    for top in ("fp8rl_core", "stages", "storage", "flows"):
        for path in (ROOT / top).rglob("*.py"):
            if path != ROOT / "storage" / "faults.py" and names.search(path.read_text(encoding="utf-8")):
                readers.append(str(path.relative_to(ROOT)))
    assert readers == [], readers
