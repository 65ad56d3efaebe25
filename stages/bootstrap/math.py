"""Bootstrap stage: supervised warm start of the tiny policy, cached by config hash.

RL needs a policy that is right sometimes but far from always. The tiny Qwen3
model (``fp8rl_core.tasks.tiny_model``) is trained by next-token cross-entropy on the
synthetic task's worked solutions (``fp8rl_core.tasks.synthetic``) in two phases
(:class:`NoisyTeacher`):

1. *exact teacher*, until the running training loss drops below
   ``switch_loss`` (the model has learned column addition) or until
   ``steps - noisy_steps`` steps. Where the learning jump comes depends on the
   seeds and on ``lr``: at 1e-3 it came at steps 341/421/466 for three seeds;
   at 3e-3 at 556 for one seed and after 1150 for another (6e-3 was slower
   still), so use ``bootstrap.lr = 1e-3``;
2. *noisy teacher*, ``noisy_steps`` more steps: every carry of a demonstration
   is dropped with probability ``carry_drop`` and the rest of the work follows.
   Within ~50 steps the clone adopts the slip: sampled at temperature 1 it is
   right ~``E[(1 - carry_drop) ** n_carries]`` of the time (42-47 % at
   difficulty 1, ``carry_drop`` 0.45), though it still knows the procedure.

RL from the verifier's reward then has a single, shared behaviour to unlearn —
"forget the carry" — and does so fast (measured when the bootstrap was tuned: +40 points in
10 GRPO steps of 64x8). A noisy teacher from step 0 instead stalled the
learning jump (5 % accuracy at step 800, measured).

Training: AdamW (betas 0.9/0.95, no weight decay), gradient-norm clip 1.0, loss
on response tokens only (the prompt is context); ``lr`` after a linear warmup
in phase 1, cosine decay to 10 % of it over phase 2. Batch ``i`` of step ``s``
is made of train-split problems ``s * batch_size + i``, so the data order
depends on nothing but the configs; with the model seed, a teacher RNG seeded by
``bootstrap.seed`` and a fixed thread count the run is bit-reproducible on a CPU.

Output: a Hugging Face directory (model, tokenizer, ``bootstrap.json`` with the
measured base accuracy — sampled and greedy over :data:`EVAL_SIZE` test
problems — the config hash and timings), named by a hash of everything that
shapes the weights (model config, task difficulty and seed, bootstrap config
except its thread count, the teacher, :data:`BOOTSTRAP_VERSION`, the CPU-numerics
variables of ``fp8rl_core.host.cpu_env`` where set). A second
call with the same inputs returns the cached directory without training. The
directory appears atomically: it is written under a temporary name and renamed.
Callers that ask for one uncached directory at once train it once: the first
holds a lock beside it, the others wait and then read it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import random
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch

from fp8rl_core.config.model import BootstrapConfig, ModelConfig, TaskConfig
from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
from fp8rl_core.host.cpu_env import cpu_numerics_env
from fp8rl_core.tasks.kinds import procedural_task
from fp8rl_core.tasks.synthetic import exact_verify
from fp8rl_core.tasks.tiny_model import build_tiny_model, build_tokenizer
from stages.bootstrap.integrity import DIGEST_KEY, META_FILE, entry_digest, verified_entry

log = logging.getLogger(__name__)

BOOTSTRAP_VERSION = "3"  # bump when the training recipe, its numerics or the task format changes
EVAL_SIZE = 1000  # test problems of the base-accuracy measurement (~1.4 points of noise)
BASE_BAND = (0.2, 0.6)  # sampled base accuracy that leaves RL headroom


@dataclass(frozen=True)
class NoisyTeacher:
    """Who writes the demonstrations (values are our choice; candidates for
    ``BootstrapConfig`` fields).

    The exact teacher writes until the running (EMA 0.9) training loss drops
    below ``switch_loss`` — the model has learned column addition; the jump
    moves by hundreds of steps between seeds, so a fixed switch step either
    wastes time or switches before the jump (measured: a fixed switch at 700
    caught one seed on its plateau, 6 % final accuracy). Then a teacher
    that drops each carry with probability ``carry_drop`` (< 0.5, so the
    clone's mode keeps carrying) writes for ``noisy_steps`` more steps."""

    carry_drop: float = 0.45
    noisy_steps: int = 200
    switch_loss: float = 0.02

    def __post_init__(self) -> None:
        if not 0.0 <= self.carry_drop < 0.5:
            raise ValueError(
                f"carry_drop={self.carry_drop} must be in [0, 0.5) so that keeping the carry stays the mode"
            )
        if self.noisy_steps < 0:
            raise ValueError(f"noisy_steps={self.noisy_steps} must be >= 0")
        if self.switch_loss <= 0:
            raise ValueError(f"switch_loss={self.switch_loss} must be > 0")


def default_cache_root() -> Path:
    """``$XDG_CACHE_HOME/fp8rl/bootstrap`` (``~/.cache/fp8rl/bootstrap``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fp8rl" / "bootstrap"


def config_hash(model_cfg: ModelConfig, task_cfg: TaskConfig, boot_cfg: BootstrapConfig, teacher: NoisyTeacher) -> str:
    """Hex digest of the inputs that determine the bootstrapped weights."""
    payload = {
        "version": BOOTSTRAP_VERSION,
        "model": model_cfg.model_dump(mode="json", exclude={"outliers"}),  # applied after the bootstrap
        "task": {"difficulty": task_cfg.difficulty, "seed": task_cfg.seed}
        | ({"kind": task_cfg.kind} if task_cfg.kind != TaskConfig().kind else {}),  # the default: older caches
        "bootstrap": boot_cfg.model_dump(mode="json", exclude={"threads"}),
        "teacher": asdict(teacher),
    }
    pinned = {k: v for k, v in cpu_numerics_env().items() if v}  # the CPU kernels shape the weights too
    if pinned:
        payload["cpu_numerics"] = pinned
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


MAX_THREADS_ENV = "FP8RL_MAX_THREADS"


def capped_threads(n: int) -> int:
    """``n`` intra-op threads, at most ``$FP8RL_MAX_THREADS`` when set.

    The test suite sets it to 1: its two workers share two cores, and a 2-thread
    torch process beside another one oversubscribes them (OpenMP barriers spin).
    The thread count changes no result that a test compares across runs (both
    sides run capped), and the bootstrap cache key ignores it.
    """
    cap = os.environ.get(MAX_THREADS_ENV)
    return min(n, max(1, int(cap))) if cap else n


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(capped_threads(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _batch(
    step: int, boot: BootstrapConfig, task: TaskConfig, carry_drop: float, rng: random.Random, vocab: dict[str, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[B, T]`` and labels ``[B, T]`` (-100 on prompt and padding)."""
    bos, eos, pad = vocab["<bos>"], vocab["<eos>"], vocab["<pad>"]
    t = procedural_task(task.kind)
    n_prompt = 1 + t.prompt_length(task.difficulty)
    rows = []
    for i in range(boot.batch_size):
        p = t.make_problem(step * boot.batch_size + i, "train", task.difficulty, task.seed)
        target = t.demonstration(p, task.difficulty, carry_drop, rng)
        rows.append([bos] + [vocab[c] for c in p.prompt + target] + [eos])
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)  # right padding: causal attention never sees it
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    labels = ids.clone()
    labels[:, :n_prompt] = -100
    labels[ids == pad] = -100
    return ids, labels


@torch.no_grad()
def measure_accuracy(model, tokenizer, task: TaskConfig, n: int = EVAL_SIZE, *, seed: int = 0) -> dict[str, float]:
    """Sampled (temperature 1, no top-k/top-p) and greedy accuracy on the first
    ``n`` test problems, one sample each. Prompts share one length: no padding."""
    model.eval()
    t = procedural_task(task.kind)
    problems = [t.make_problem(i, "test", task.difficulty, task.seed) for i in range(n)]
    prompt_ids = torch.tensor([tokenizer(p.prompt)["input_ids"] for p in problems])  # [n, P]
    max_new = t.response_cap(task.difficulty)
    out: dict[str, float] = {}
    for mode, kwargs in (
        ("sampled", dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)),
        ("greedy", dict(do_sample=False)),
    ):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            gen = model.generate(
                prompt_ids,
                attention_mask=torch.ones_like(prompt_ids),
                max_new_tokens=max_new,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **kwargs,
            )
        responses = gen[:, prompt_ids.shape[1] :]  # [n, <= max_new]
        correct = 0
        for p, row in zip(problems, responses.tolist()):
            if tokenizer.eos_token_id not in row:  # a response must end: no EOS, no reward
                continue
            text = tokenizer.decode(row[: row.index(tokenizer.eos_token_id)], skip_special_tokens=True)
            correct += exact_verify(text, p.answer)
        out[mode] = correct / n
    return out


def _sft_step(model, opt, ids: torch.Tensor, labels: torch.Tensor, lr: float) -> float:
    for group in opt.param_groups:
        group["lr"] = lr
    loss = model(input_ids=ids, labels=labels).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def seeded_policy(model_cfg: ModelConfig, boot_cfg: BootstrapConfig, vocab_size: int) -> tuple:
    """The tiny policy at the bootstrap's seed, in train mode, and its AdamW (what both bootstraps start from)."""
    torch.manual_seed(boot_cfg.seed)
    model = build_tiny_model(model_cfg, vocab_size)
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=boot_cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)


def policy_stats(
    acc: dict[str, float], eval_size: int, switch_step: int, steps: int, losses: list[float], train_s: float
) -> dict:
    """What ``meta.json`` records of a bootstrapped policy: its accuracy, where the teacher switched, the loss."""
    return {
        "base_accuracy_sampled": acc["sampled"],
        "base_accuracy_greedy": acc["greedy"],
        "eval_size": eval_size,
        "switch_step": switch_step,
        "total_steps": steps,
        "final_loss": sum(losses[-50:]) / max(1, len(losses[-50:])),
        "train_seconds": round(train_s, 2),
    }



def train_policy(
    model_cfg: ModelConfig,
    task_cfg: TaskConfig,
    boot_cfg: BootstrapConfig,
    teacher: NoisyTeacher = NoisyTeacher(),
    eval_size: int = EVAL_SIZE,
):
    """Run the supervised bootstrap in memory; returns ``(model, tokenizer, stats)``.

    Phase 1 (exact teacher, lr: linear warmup then constant) runs until the
    running loss falls below ``teacher.switch_loss`` — the procedure is learned —
    or until ``boot.steps - teacher.noisy_steps`` steps; phase 2 (noisy
    teacher, lr: cosine to 10 %) runs ``teacher.noisy_steps`` steps. The switch
    step is a deterministic function of the seed, recorded in the stats.
    """
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab()
    max_clean = max(0, boot_cfg.steps - teacher.noisy_steps)
    # BF16 autocast with the CPU-independent GEMMs (fp8rl_core.cpu_numerics.portable_mode): the campaign's own rule,
    # and the same bootstrapped weights on every x86-64 CPU
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    with _threads(boot_cfg.threads), torch.random.fork_rng(devices=[]), cpu_bf16_gemm("portable"), bf16:
        model, opt = seeded_policy(model_cfg, boot_cfg, len(vocab))
        rng = random.Random(f"fp8rl-bootstrap-noise:{boot_cfg.seed}")
        t0, losses, ema, step = time.perf_counter(), [], None, 0
        while step < max_clean:  # phase 1: exact teacher
            ids, labels = _batch(step, boot_cfg, task_cfg, 0.0, rng, vocab)
            warm = min(1.0, (step + 1) / max(1, boot_cfg.warmup_steps))
            losses.append(_sft_step(model, opt, ids, labels, boot_cfg.lr * warm))
            ema = losses[-1] if ema is None else 0.9 * ema + 0.1 * losses[-1]
            step += 1
            if step % 100 == 0:
                log.info("bootstrap step %d (exact teacher) loss %.4f", step, sum(losses[-100:]) / 100)
            if step >= boot_cfg.warmup_steps and ema < teacher.switch_loss:
                break
        switch_step = step
        for k in range(teacher.noisy_steps):  # phase 2: noisy teacher
            ids, labels = _batch(step, boot_cfg, task_cfg, teacher.carry_drop, rng, vocab)
            decay = 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * k / max(1, teacher.noisy_steps)))
            losses.append(_sft_step(model, opt, ids, labels, boot_cfg.lr * decay))
            step += 1
            if step % 100 == 0:
                log.info("bootstrap step %d (noisy teacher) loss %.4f", step, sum(losses[-100:]) / 100)
        train_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        acc = measure_accuracy(model, tokenizer, task_cfg, eval_size, seed=boot_cfg.seed)
        eval_s = time.perf_counter() - t1
    stats = policy_stats(acc, eval_size, switch_step, step, losses, train_s) | {
        "eval_seconds": round(eval_s, 2),
        "seconds_per_step": round(train_s / max(1, step), 4),
    }
    if switch_step >= max_clean and ema is not None and ema >= teacher.switch_loss:
        log.warning(
            "bootstrap: the exact-teacher phase hit its cap (%d steps) with loss %.3f > %.3f; raise bootstrap.steps",
            max_clean,
            ema,
            teacher.switch_loss,
        )
    return model, tokenizer, stats


def bootstrap(
    model_cfg: ModelConfig,
    task_cfg: TaskConfig,
    boot_cfg: BootstrapConfig,
    cache_root: str | Path | None = None,
    *,
    teacher: NoisyTeacher = NoisyTeacher(),
    eval_size: int = EVAL_SIZE,
) -> Path:
    """The bootstrapped checkpoint directory for these configs (trained on the
    first call, read from ``cache_root`` afterwards). Load it with
    ``fp8rl_core.tasks.tiny_model.load_policy``; its measured base accuracy is in
    :func:`read_meta`. ``eval_size`` only sizes that measurement (not hashed)."""
    if model_cfg.path is not None:
        raise ValueError(f"model.path={model_cfg.path!r} is set: there is nothing to bootstrap (use that checkpoint)")
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    digest = config_hash(model_cfg, task_cfg, boot_cfg, teacher)
    final = root / f"tiny-{digest[:16]}"
    if (final / META_FILE).is_file():
        log.info("bootstrap cache hit: %s", final)
        verified_entry(final)  # its files as published, or one line
        return final
    with sole_builder(final) as needed:
        if needed:
            _train_and_publish(final, digest, model_cfg, task_cfg, boot_cfg, teacher, eval_size)
    verified_entry(final)
    return final


def _train_and_publish(final, digest, model_cfg, task_cfg, boot_cfg, teacher, eval_size) -> None:
    log.info("bootstrapping the tiny policy (%d steps) into %s", boot_cfg.steps, final)
    model, tokenizer, stats = train_policy(model_cfg, task_cfg, boot_cfg, teacher, eval_size)
    lo, hi = BASE_BAND
    if not lo <= stats["base_accuracy_sampled"] <= hi:
        log.warning(
            "bootstrapped base accuracy %.3f (sampled) is outside the RL band [%.2f, %.2f]; adjust bootstrap.steps "
            "or the teacher's carry_drop",
            stats["base_accuracy_sampled"],
            lo,
            hi,
        )
    meta = {
        "config_hash": digest,
        "version": BOOTSTRAP_VERSION,
        "teacher": asdict(teacher),
        "model": model_cfg.model_dump(mode="json", exclude={"outliers"}),  # applied after the bootstrap
        "task": task_cfg.model_dump(mode="json"),
        "bootstrap": boot_cfg.model_dump(mode="json"),
        **stats,
    }
    publish_checkpoint(final, model, tokenizer, meta)
    if not (final / META_FILE).is_file():
        raise RuntimeError(f"bootstrap: {final} is incomplete (no {META_FILE}); delete it and rerun")


@contextmanager
def sole_builder(final: Path) -> Iterator[bool]:
    """One process at a time builds a cache entry: an exclusive ``flock`` on ``.<name>.lock`` beside
    ``final``, held for the block. Yields whether ``final`` still needs building once the lock is held,
    so a process that waited for another's build (two sweep cells, two test workers starting at once)
    finds it published and trains nothing. The kernel drops the lock when its holder dies; a build
    that crashed left no ``final`` (it is published by a rename), so the next holder builds it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.with_name(f".{final.name}.lock"), "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building %s; waiting for it", final)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield not (final / META_FILE).is_file()
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def publish_checkpoint(final: Path, model, tokenizer, meta: dict) -> None:
    """Write a bootstrapped policy to ``final`` atomically: saved with its ``bootstrap.json`` (which records
    the hash of the files beside it) into a temporary folder beside it, then renamed. Where another process
    published first, theirs is kept."""
    # host and pid: on a cache shared by several nodes two builders can have one pid
    tmp = final.with_name(f".tmp-{final.name}-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta = {**meta, DIGEST_KEY: entry_digest(tmp)}  # checked on every read (stages.bootstrap.integrity)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if not final.exists():
            try:
                os.replace(tmp, final)
            except OSError:  # another process finished first (non-empty target): keep theirs
                pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_meta(checkpoint: str | Path) -> dict:
    """The ``bootstrap.json`` of a bootstrapped checkpoint."""
    return json.loads((Path(checkpoint) / META_FILE).read_text())
