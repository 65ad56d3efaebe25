"""The task kinds (``task.kind``): one registry says how each kind makes its training prompts,
which procedural generator it uses, which training set it reads and which bootstrap teaches
the tiny policy its format. Callers look a kind up here instead of comparing its name.

Sources (how the data stage builds a kind's prompts):

- ``procedural``: drawn lazily from a seeded generator module (``generator``) that offers
  ``make_problem``, ``demonstration``, ``prompt_length``, ``response_cap`` and the answer parser;
- ``code_tiny``: the embedded expression-code task, drawn lazily like a procedural one;
- ``code``: a code training set (``train_set``) graded in the sandbox;
- ``math_file``: a math training file or hub dataset in one of the known formats (``train_set``);
- ``dataset``: any dataset by name or path (``task.dataset``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

from fp8rl_core.registry import Registry

Source = Literal["procedural", "code_tiny", "code", "math_file", "dataset"]


@dataclass(frozen=True)
class TaskKind:
    name: str
    source: Source
    generator: str | None = None  # procedural: the module that generates its problems
    train_set: str | None = None  # code and math_file: the training set's name for the loaders
    bootstrap: Literal["math", "code"] = "math"  # which demonstrations teach the tiny policy the format

    def __post_init__(self) -> None:
        if (self.source == "procedural") != (self.generator is not None):
            raise ValueError(f"task kind {self.name!r}: a generator module goes with a procedural source only")

    @property
    def procedural(self) -> bool:
        return self.source == "procedural"


TASK_KINDS: Registry[TaskKind] = Registry("task kind")

for _kind in (
    TaskKind("synthetic", "procedural", generator="fp8rl_core.tasks.synthetic"),
    TaskKind("stress", "procedural", generator="fp8rl_core.tasks.stress"),
    TaskKind("deepscaler", "math_file", train_set="deepscaler"),
    TaskKind("gsm8k", "math_file", train_set="gsm8k"),
    TaskKind("dapo_math", "math_file", train_set="dapo_math"),
    TaskKind("code_tiny", "code_tiny", bootstrap="code"),
    TaskKind("leetcode", "code", train_set="leetcode_train"),
    TaskKind("taco", "code", train_set="taco"),
    TaskKind("apps", "code", train_set="apps"),
    TaskKind("eurus_code", "code", train_set="eurus_code"),
    TaskKind("dataset", "dataset"),
):
    TASK_KINDS.register(_kind.name)(_kind)


def procedural_task(kind: str) -> ModuleType:
    """The module generating a procedural task kind (``fp8rl_core.tasks.synthetic`` for ``synthetic``,
    ``fp8rl_core.tasks.stress`` for ``stress``); a kind that is not procedural is a ValueError."""
    task = TASK_KINDS.get(kind)
    if not task.procedural:
        valid = ", ".join(n for n in TASK_KINDS.names() if TASK_KINDS.get(n).procedural)
        raise ValueError(f"task kind {kind!r} is not procedural; valid: {valid}")
    return importlib.import_module(task.generator)
