"""Prompt formatting for real checkpoints: chat template or plain text, and the end-of-turn stop.

``model.path`` takes any ``from_pretrained`` directory (or hub id). How a
problem becomes token ids is ``prompt.format``:

- ``plain``: the problem text (with its answer-format instruction) tokenized
  as is — base models, as in the paper's Qwen3-8B-Base runs, and the embedded
  tiny model;
- ``chat``: ``tokenizer.apply_chat_template`` of ``[system?, user]`` with the
  generation prompt — instruct checkpoints (Qwen3 chat models);
- ``auto``: ``chat`` only when the checkpoint is an instruct model that has a
  template: the tokenizer carries a chat template *and* the checkpoint is not
  named as a base model (``…-Base``, ``…_base``). Qwen's base checkpoints ship
  a chat template too, so the template alone does not make an instruct model.

``prompt.system_prompt`` is the system message (chat only); ``prompt.instruction``
replaces the built-in step-by-step / ``\\boxed{}`` instruction of math problems
(the synthetic task's prompts are complete and are not touched).

Stopping: a chat model ends its turn with the template's end-of-turn token
(Qwen's ``<|im_end|>``), which often is not the tokenizer's EOS. The token is
found from the template itself — render a conversation with a known assistant
reply and take the first special token after it — and added to the policy's
``generation_config.eos_token_id``, the stop set both rollout engines read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from fp8rl_core.config.model import PromptConfig

_BASE_NAME = re.compile(r"(^|[-_./])base($|[-_./])", re.IGNORECASE)
_PROBE = "fp8rl-probe-reply-7319"


def checkpoint_name(tokenizer: Any, model: Any = None) -> str:
    for obj in (model, getattr(model, "config", None), tokenizer):
        name = getattr(obj, "name_or_path", None) or getattr(obj, "_name_or_path", None)
        if name:
            return str(name)
    return ""


def is_instruct(tokenizer: Any, model: Any = None) -> bool:
    """An instruct checkpoint with a chat template (see the module docstring)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    name = checkpoint_name(tokenizer, model).rstrip("/").split("/")[-1]
    return not _BASE_NAME.search(name)


def resolve_format(cfg: PromptConfig, tokenizer: Any, model: Any = None) -> str:
    if cfg.format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ValueError("prompt.format=chat, but the tokenizer has no chat template (use plain or auto)")
    if cfg.format != "auto":
        return cfg.format
    return "chat" if is_instruct(tokenizer, model) else "plain"


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The special token(s) the chat template puts right after an assistant reply."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": _PROBE}], tokenize=False
    )
    tail = text[text.rindex(_PROBE) + len(_PROBE) :]
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return [next(i for i in ids if i in special)] if any(i in special for i in ids) else []


@dataclass
class PromptFormatter:
    cfg: PromptConfig
    tokenizer: Any
    mode: str  # "chat" or "plain"

    def text(self, prompt: str) -> str:
        """The user message: the prompt with the configured instruction."""
        from stages.data.benchmarks import BOXED_INSTRUCTION

        if self.cfg.instruction is not None and prompt.endswith(BOXED_INSTRUCTION):
            prompt = prompt[: -len(BOXED_INSTRUCTION)].rstrip() + (
                " " + self.cfg.instruction if self.cfg.instruction else ""
            )
        return prompt

    def messages(self, prompt: str) -> list[dict]:
        msgs = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
        return msgs + [{"role": "user", "content": self.text(prompt)}]

    def encode(self, prompt: str) -> list[int]:
        if self.mode == "plain":
            return list(self.tokenizer(self.text(prompt), add_special_tokens=True)["input_ids"])
        kw = {} if self.cfg.enable_thinking is None else {"enable_thinking": self.cfg.enable_thinking}
        out = self.tokenizer.apply_chat_template(self.messages(prompt), add_generation_prompt=True, tokenize=True, **kw)
        if hasattr(out, "keys") and "input_ids" in out:  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return [int(i) for i in out]


def formatter(cfg: PromptConfig, tokenizer: Any, model: Any = None) -> PromptFormatter:
    """The (cached, per tokenizer and config) formatter."""
    cached = getattr(tokenizer, "_fp8rl_formatter", None)
    if cached is not None and cached.cfg == cfg:
        return cached
    f = PromptFormatter(cfg, tokenizer, resolve_format(cfg, tokenizer, model))
    try:
        tokenizer._fp8rl_formatter = f
    except AttributeError:  # pragma: no cover
        pass
    return f


def encode_prompts(env: Any, prompts: Sequence[str], state: Any = None) -> list[list[int]]:
    """Token ids of ``prompts`` in the run's prompt format (rollout and evaluation).

    ``env`` carries ``cfg`` and ``tokenizer`` (a ``RunEnv``); ``state.policy``, when
    given, names the checkpoint for ``prompt.format: auto``.
    """
    f = formatter(env.cfg.prompt, env.tokenizer, getattr(state, "policy", None))
    return [f.encode(p) for p in prompts]


def apply_stop_tokens(policy: Any, tokenizer: Any, cfg: PromptConfig) -> list[int]:
    """Add the template's end-of-turn token to the policy's stop set (chat format); returns the set."""
    gen = getattr(policy, "generation_config", None)
    if gen is None:
        return []
    have = gen.eos_token_id
    ids = [] if have is None else (list(have) if isinstance(have, (list, tuple)) else [have])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    if resolve_format(cfg, tokenizer, policy) == "chat":
        ids += [i for i in end_of_turn_ids(tokenizer) if i not in ids]
    if ids:
        gen.eos_token_id = ids if len(ids) > 1 else ids[0]
    return ids
