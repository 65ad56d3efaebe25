"""The GPU check's train-step config, without pydantic (the GPU machine has none).

The trainer reads its config as attributes (``cfg.algorithm.lr``); a typed,
validated ``CampaignConfig`` is built from YAML on the CPU side. The GPU script
needs the same values, so ``step_config.json`` beside this file is the
``CampaignConfig`` of :data:`OVERRIDES` dumped on a machine with pydantic
(``python -m gpu_check.step_config``), and :func:`load_step_config` reads it back
as nested read-only namespaces. A CPU test checks the file against a fresh dump,
so a changed default cannot drift past it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

PATH = Path(__file__).resolve().parent / "step_config.json"
# 4 prompts x 8 samples of 160 new tokens; mini-batches of 16 rows in micro-batches of 8
OVERRIDES: dict[str, Any] = {
    "rollout": {"prompts_per_step": 4, "samples_per_prompt": 8, "max_new_tokens": 160},
    "algorithm": {"ppo_mini_batch_size": 16, "micro_batch_size": 8, "lr": 1e-6},
    "precision": {"train": "fp8_tensorwise", "emulate": False},
    "device": "cuda",
}


class FrozenNamespace(SimpleNamespace):
    """A ``SimpleNamespace`` that refuses writes, like the frozen pydantic models it stands for."""

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"config field {name!r} is read-only")

    def replace(self, **changes: Any) -> "FrozenNamespace":
        return FrozenNamespace(**{**vars(self), **changes})


def _namespace(value: Any) -> Any:
    if isinstance(value, dict):
        return FrozenNamespace(**{k: _namespace(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_namespace(v) for v in value)
    return value


def dump_step_config() -> dict:
    """The validated ``CampaignConfig`` of :data:`OVERRIDES` as JSON data (needs pydantic)."""
    from fp8rl_core.config.campaign import CampaignConfig

    return json.loads(CampaignConfig.model_validate(OVERRIDES).model_dump_json())


def load_step_config(mode: str) -> FrozenNamespace:
    """The shipped config with ``precision.train = mode``, as read-only namespaces."""
    cfg = _namespace(json.loads(PATH.read_text()))
    return cfg.replace(precision=cfg.precision.replace(train=mode))


__all__ = ["OVERRIDES", "dump_step_config", "load_step_config"]

if __name__ == "__main__":
    PATH.write_text(json.dumps(dump_step_config(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {PATH}")
