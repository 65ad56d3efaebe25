"""The task-kind registry: each kind's source, generator, training set and bootstrap come from one entry."""

from __future__ import annotations

import pytest

from fp8rl_core.config.campaign import CampaignConfig
from fp8rl_core.config.model import TaskConfig
from fp8rl_core.registered import unknown_names
from fp8rl_core.tasks import stress, synthetic
from fp8rl_core.tasks.kinds import TASK_KINDS, TaskKind, procedural_task
from stages.data.prompts import make_source

pytestmark = pytest.mark.timeout(60)


def test_every_kind_names_how_its_prompts_are_made() -> None:
    assert TASK_KINDS.names() == sorted(
        [
            "synthetic",
            "stress",
            "deepscaler",
            "gsm8k",
            "dapo_math",
            "code_tiny",
            "leetcode",
            "taco",
            "apps",
            "eurus_code",
            "dataset",
        ]
    )
    for name in TASK_KINDS.names():
        kind = TASK_KINDS.get(name)
        assert kind.name == name
        assert kind.procedural == (kind.generator is not None)
        assert (kind.train_set is not None) == (kind.source in ("code", "math_file")), name
    assert TASK_KINDS.get("leetcode").train_set == "leetcode_train"
    assert [n for n in TASK_KINDS.names() if TASK_KINDS.get(n).bootstrap == "code"] == ["code_tiny"]


def test_procedural_kinds_draw_from_their_own_generator() -> None:
    assert procedural_task("synthetic") is synthetic and procedural_task("stress") is stress
    with pytest.raises(ValueError, match="'gsm8k' is not procedural; valid: stress, synthetic"):
        procedural_task("gsm8k")
    for kind, module in (("synthetic", synthetic), ("stress", stress)):
        src = make_source(TaskConfig(kind=kind, difficulty=1, seed=3))
        item, want = src[5], module.make_problem(5, "train", 1, 3)
        assert (item.prompt_id, item.prompt, item.answer) == (want.id, want.prompt, want.answer)
        assert src.dataset == f"{kind}-d1" and src.verifier == "synthetic"


def test_an_unknown_kind_is_one_line_naming_the_valid_ones() -> None:
    cfg = CampaignConfig(task=TaskConfig(kind="arithmetics"))
    (line,) = unknown_names(cfg)
    assert line.startswith("task.kind: unknown task kind 'arithmetics'; valid: apps, code_tiny, dapo_math")
    with pytest.raises(KeyError, match="unknown task kind 'arithmetics'"):
        make_source(cfg.task)


def test_a_generator_goes_with_a_procedural_source_only() -> None:
    with pytest.raises(ValueError, match="generator module goes with a procedural source only"):
        TaskKind("x", "code", generator="fp8rl_core.tasks.synthetic")
    with pytest.raises(ValueError, match="generator module goes with a procedural source only"):
        TaskKind("x", "procedural")
