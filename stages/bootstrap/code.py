"""Bootstrap of the tiny policy for the tiny code task (``task.kind = code_tiny``).

Same recipe and cache layout as :mod:`stages.bootstrap.math` (whose SFT step and
thread guard it reuses): SFT on ``prompt -> expression`` demonstrations, an
exact teacher until the running loss is below ``bootstrap.switch_loss``, then
``bootstrap.noisy_steps`` steps of a noisy teacher that writes the wrong
operator with probability ``bootstrap.carry_drop`` (here: the slip rate of
:func:`fp8rl_core.tasks.code.demonstration`), so the clone is right about
``1 - carry_drop`` of the time when sampled and RL has one behaviour to fix.

The base accuracy in ``bootstrap.json`` is measured without running model
output (``code_task.safe_verify`` evaluates the expression grammar by AST);
the campaign's rewards run every response in the sandbox.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from pathlib import Path

import torch

from fp8rl_core.config.model import BootstrapConfig, ModelConfig, TaskConfig
from fp8rl_core.tasks import code as code_task
from fp8rl_core.tasks.tiny_model import build_tokenizer
from stages.bootstrap.integrity import verified_entry
from stages.bootstrap.math import (
    META_FILE,
    _sft_step,
    _threads,
    default_cache_root,
    policy_stats,
    publish_checkpoint,
    seeded_policy,
    sole_builder,
)

log = logging.getLogger(__name__)
CODE_BOOTSTRAP_VERSION = "code-1"
EVAL_SIZE = 300


def _hash(model_cfg: ModelConfig, task_cfg: TaskConfig, boot_cfg: BootstrapConfig) -> str:
    payload = {
        "version": CODE_BOOTSTRAP_VERSION,
        "model": model_cfg.model_dump(mode="json", exclude={"outliers"}),  # applied after the bootstrap
        "task_seed": task_cfg.seed,
        "bootstrap": boot_cfg.model_dump(mode="json", exclude={"threads"}),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _batch(step: int, boot: BootstrapConfig, task: TaskConfig, slip: float, rng: random.Random, vocab: dict[str, int]):
    bos, eos, pad = vocab["<bos>"], vocab["<eos>"], vocab["<pad>"]
    rows, n_prompt = [], []
    for i in range(boot.batch_size):
        p = code_task.make_problem(step * boot.batch_size + i, "train", task.seed)
        target = code_task.demonstration(p, slip, rng)
        rows.append([bos] + [vocab[c] for c in p.prompt + target] + [eos])
        n_prompt.append(1 + len(p.prompt))
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, n_prompt[i] : len(row)] = ids[i, n_prompt[i] : len(row)]
    return ids, labels


@torch.no_grad()
def measure_accuracy(model, tokenizer, task: TaskConfig, n: int = EVAL_SIZE, *, seed: int = 0) -> dict[str, float]:
    model.eval()
    problems = [code_task.make_problem(i, "test", task.seed) for i in range(n)]
    out = {}
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(problems):
        by_len.setdefault(len(p.prompt), []).append(i)
    for mode, kwargs in (
        ("sampled", dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)),
        ("greedy", dict(do_sample=False)),
    ):
        correct = 0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for idx in by_len.values():
                ids = torch.tensor([tokenizer(problems[i].prompt)["input_ids"] for i in idx])
                gen = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=8,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    **kwargs,
                )
                texts = tokenizer.batch_decode(gen[:, ids.shape[1] :], skip_special_tokens=True)
                correct += sum(code_task.safe_verify(t, problems[i]) for t, i in zip(texts, idx))
        out[mode] = correct / n
    model.train()
    return out


def train_code_policy(
    model_cfg: ModelConfig, task_cfg: TaskConfig, boot_cfg: BootstrapConfig, eval_size: int = EVAL_SIZE
):
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab()
    slip = boot_cfg.carry_drop
    max_clean = max(0, boot_cfg.steps - boot_cfg.noisy_steps)
    with _threads(boot_cfg.threads), torch.random.fork_rng(devices=[]):
        model, opt = seeded_policy(model_cfg, boot_cfg, len(vocab))
        rng = random.Random(f"fp8rl-code-bootstrap:{boot_cfg.seed}")
        t0, losses, ema, step = time.perf_counter(), [], None, 0
        while step < max_clean:
            ids, labels = _batch(step, boot_cfg, task_cfg, 0.0, rng, vocab)
            warm = min(1.0, (step + 1) / max(1, boot_cfg.warmup_steps))
            losses.append(_sft_step(model, opt, ids, labels, boot_cfg.lr * warm))
            ema = losses[-1] if ema is None else 0.9 * ema + 0.1 * losses[-1]
            step += 1
            if step >= boot_cfg.warmup_steps and ema < boot_cfg.switch_loss:
                break
        switch_step = step
        for k in range(boot_cfg.noisy_steps):
            ids, labels = _batch(step, boot_cfg, task_cfg, slip, rng, vocab)
            decay = 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * k / max(1, boot_cfg.noisy_steps)))
            losses.append(_sft_step(model, opt, ids, labels, boot_cfg.lr * decay))
            step += 1
        train_s = time.perf_counter() - t0
        acc = measure_accuracy(model, tokenizer, task_cfg, eval_size, seed=boot_cfg.seed)
    return model, tokenizer, policy_stats(acc, eval_size, switch_step, step, losses, train_s)


def bootstrap_code(
    model_cfg: ModelConfig,
    task_cfg: TaskConfig,
    boot_cfg: BootstrapConfig,
    cache_root: str | Path | None = None,
    eval_size: int | None = None,
) -> Path:
    """The cached checkpoint for these configs (trained on first call); atomic like
    :func:`stages.bootstrap.math.bootstrap`."""
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    digest = _hash(model_cfg, task_cfg, boot_cfg)
    final = root / f"tiny-code-{digest[:16]}"
    if (final / META_FILE).is_file():
        verified_entry(final)  # its files as published, or one line
        return final
    with sole_builder(final) as needed:
        if needed:
            _train_and_publish(final, digest, model_cfg, task_cfg, boot_cfg, eval_size)
    verified_entry(final)
    return final


def _train_and_publish(final, digest, model_cfg, task_cfg, boot_cfg, eval_size) -> None:
    log.info("bootstrapping the tiny code policy (%d steps) into %s", boot_cfg.steps, final)
    model, tokenizer, stats = train_code_policy(model_cfg, task_cfg, boot_cfg, eval_size or EVAL_SIZE)
    meta = {
        "config_hash": digest,
        "version": CODE_BOOTSTRAP_VERSION,
        "task": task_cfg.model_dump(mode="json"),
        "bootstrap": boot_cfg.model_dump(mode="json"),
        "model": model_cfg.model_dump(mode="json", exclude={"outliers"}),  # applied after the bootstrap
        **stats,
    }
    publish_checkpoint(final, model, tokenizer, meta)
