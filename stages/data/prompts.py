"""Training prompts: where they come from and which ones a step gets.

A :class:`PromptSource` maps an index to a problem (prompt text, gold answer,
id). Prompt sampling is a pure function of ``(seed, epoch, position)``: each
epoch is a seeded permutation of the source, and the :class:`SamplerState`
(epoch, position) is persisted with every rollout and checkpoint, so a resumed
campaign draws exactly the prompts an uninterrupted one would.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch

from fp8rl_core.config.campaign import CampaignConfig
from fp8rl_core.config.model import CodeConfig, TaskConfig
from fp8rl_core.tasks import code as code_task
from fp8rl_core.tasks.kinds import TASK_KINDS, procedural_task


@dataclass(frozen=True)
class PromptItem:
    prompt_id: str
    prompt: str
    answer: str
    dataset: str


@dataclass(frozen=True)
class SamplerState:
    """Where the next prompt comes from: ``permutation(seed, epoch)[position]``."""

    epoch: int = 0
    position: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "SamplerState":
        return cls(**d) if d else cls()


class PromptSource:
    """Indexable training problems plus the name of the verifier that grades them."""

    dataset: str = "?"
    verifier: str = "math"

    def __len__(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def __getitem__(self, index: int) -> PromptItem:  # pragma: no cover - interface
        raise NotImplementedError


class ProceduralSource(PromptSource):
    """A procedural task kind's train split, drawn lazily from its generator (the synthetic arithmetic,
    the long-chain stress task); every one is graded by the synthetic verifier."""

    verifier = "synthetic"

    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg
        self.generator = procedural_task(cfg.kind)
        self.dataset = f"{cfg.kind}-d{cfg.difficulty}"

    def __len__(self) -> int:
        return self.cfg.train_size

    def __getitem__(self, index: int) -> PromptItem:
        p = self.generator.make_problem(index, "train", self.cfg.difficulty, self.cfg.seed)
        return PromptItem(p.id, p.prompt, p.answer, self.dataset)


class ListSource(PromptSource):
    verifier = "math"

    def __init__(self, items: list[PromptItem], dataset: str) -> None:
        if not items:
            raise ValueError(f"training set {dataset!r} is empty")
        self.items, self.dataset = items, dataset

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]


def data_dir(cfg: TaskConfig) -> Path | None:
    """The task's data folder: ``task.data_dir``, else ``$FP8RL_DATA_DIR``, else ``None``."""
    from stages.data.benchmarks import resolve_data_dir

    return resolve_data_dir(cfg.data_dir or None)


def make_source(cfg: TaskConfig) -> PromptSource:
    """The training prompts of a task config, by its kind's source (``fp8rl_core.tasks.kinds``; a missing
    file is a clear error)."""
    return _SOURCES[TASK_KINDS.get(cfg.kind).source](cfg)


def _dataset_source(cfg: TaskConfig) -> PromptSource:
    """Any dataset by name or path (``stages.data.datasets_io``)."""
    from stages.data.benchmarks import render_prompt
    from stages.data.datasets_io import load_problems

    problems = load_problems(cfg.dataset, "dataset", data_dir(cfg))
    return ListSource([PromptItem(q.id, render_prompt(q), q.answer, "dataset") for q in problems], "dataset")


def _math_file_source(cfg: TaskConfig) -> PromptSource:
    from stages.data.benchmarks import load_train_prompts, render_prompt

    problems = load_train_prompts(TASK_KINDS.get(cfg.kind).train_set, cfg.path, data_dir(cfg), hub=cfg.hub)
    items = [PromptItem(q.id, render_prompt(q), q.answer, cfg.kind) for q in problems]
    return ListSource(items, cfg.kind)


@lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    # Not hash(): str hashing is randomized per process, and resume needs the same stream.
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch * 7_919 + 17) % (2**62))
    return torch.randperm(n, generator=g)


def draw_prompts(
    source: PromptSource, state: SamplerState, count: int, seed: int
) -> tuple[list[PromptItem], SamplerState]:
    """The next ``count`` prompts and the sampler state after them."""
    n = len(source)
    out: list[PromptItem] = []
    epoch, pos = state.epoch, state.position
    while len(out) < count:
        if pos >= n:
            epoch, pos = epoch + 1, 0
        perm = _permutation(n, seed, epoch)
        take = min(count - len(out), n - pos)
        out.extend(source[int(i)] for i in perm[pos : pos + take])
        pos += take
    return out, SamplerState(epoch, pos)


def make_code_source(cfg: CampaignConfig | TaskConfig, code: CodeConfig | None = None) -> PromptSource:
    """Training prompts of a code task kind (a ``stages.data.prompts.ListSource`` or the lazy tiny source)."""
    from stages.data.code_benchmarks import load_code_benchmark

    task = cfg.task if isinstance(cfg, CampaignConfig) else cfg
    code = code or (cfg.code if isinstance(cfg, CampaignConfig) else CodeConfig())
    if TASK_KINDS.get(task.kind).source == "code_tiny":

        class TinyCodeSource(PromptSource):
            verifier = "code_expr"
            dataset = "code_tiny"

            def __len__(self) -> int:
                return task.train_size

            def __getitem__(self, index: int) -> PromptItem:
                p = code_task.make_problem(index, "train", task.seed)
                spec = json.dumps({"style": "expression", "tests": json.loads(p.tests)})
                return PromptItem(p.id, p.prompt, spec, "code_tiny")

        return TinyCodeSource()
    name = TASK_KINDS.get(task.kind).train_set
    bs = load_code_benchmark(
        name, data_dir(task), None, task=task, code=code, path=task.path, hub=task.path is not None
    )
    src = ListSource([PromptItem(q.id, q.problem, q.answer, task.kind) for q in bs], task.kind)
    src.verifier = "code"
    return src


# how each source of fp8rl_core.tasks.kinds builds its prompts
_SOURCES = {
    "procedural": ProceduralSource,
    "code_tiny": make_code_source,
    "code": make_code_source,
    "math_file": _math_file_source,
    "dataset": _dataset_source,
}
