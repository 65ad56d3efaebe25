"""The generation work of a campaign per rollout engine, as ``fp8rl plan`` prints it.

A rank's share of a step's rollout and of an evaluation is decided by
:mod:`stages.runtime.rollout_plan`; this module runs that plan for ``--gpus N``
ranks without a model and sums each engine's *expected generated tokens*
(a prompt's samples times its response budget). The figure printed is the
busiest engine's expected tokens over the mean: the step waits for the busiest
engine, so 1.00 is a balanced node and 2.00 one where half the engines idle.

Prompt lengths are not known before the data is read, so every prompt counts
alike (the plan's assignment by expected tokens does not depend on them; only
the order inside an engine does). Benchmark sizes are the published test
splits' (the table in :mod:`stages.data.benchmarks`), capped by a benchmark's
``limit``; a benchmark read from another file counts only with a ``limit``.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8rl_core.config.campaign import CampaignConfig

BENCHMARK_RECORDS = {  # the published test splits (stages.data.benchmarks)
    "aime24": 30,
    "aime25": 30,
    "amc23": 40,
    "math500": 500,
    "minerva_math": 272,
    "olympiadbench": 675,
    "gsm8k": 1319,
}


@dataclass(frozen=True)
class WorkBalance:
    """Expected generated tokens per engine (``[E]``) of one step's rollout and of one evaluation."""

    engines: int
    ranks_per_engine: int
    rollout: list[int]
    evaluation: list[int]
    eval_samples: int
    unsized: tuple[str, ...]  # benchmarks left out: size unknown


def busiest_over_mean(loads: list[int]) -> float:
    """The busiest engine's load over the mean load (1.0 when there is none)."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0


def benchmark_size(bench) -> int | None:
    """Problems of a configured benchmark: its published size capped by ``limit``, else ``limit``."""
    published = BENCHMARK_RECORDS.get(bench.name) if bench.dataset is None else None
    if published is None:
        return bench.limit
    return min(published, bench.limit) if bench.limit is not None else published


def work_balance(cfg: CampaignConfig, *, gpus: int) -> WorkBalance:
    """Each engine's expected generated tokens under ``gpus`` ranks (module docstring)."""
    from stages.runtime.rollout_plan import (
        balanced_blocks,
        engine_layout,
        engine_token_loads,
        expected_tokens,
        generation_blocks,
    )

    r = cfg.rollout
    layout = engine_layout(r, gpus)
    rollout_blocks = generation_blocks(
        [0] * r.prompts_per_step,
        group_size=r.samples_per_prompt,
        generation_batch_size=r.generation_batch_size,
        seed=cfg.seed,
        step=1,
        round_=0,
        layout=layout,
        max_new_tokens=r.max_new_tokens,
    )
    per_prompt = expected_tokens(r.samples_per_prompt, r.max_new_tokens)
    rollout = engine_token_loads(rollout_blocks, layout.engines, per_prompt)
    loads, samples, unsized = [0] * layout.engines, 0, []
    for bench in cfg.evaluation.benchmarks:
        n = benchmark_size(bench)
        if n is None:
            unsized.append(bench.name)
            continue
        samples += n * bench.k
        tokens = expected_tokens(bench.k, bench.max_new_tokens)
        kw = dict(group_size=bench.k, generation_batch_size=r.generation_batch_size)
        if layout.balanced:
            seeding = (0, 0, 0)  # seeds do not move the assignment
            _, loads = balanced_blocks(
                [0] * n, layout=layout, tokens_per_prompt=tokens, seeding=seeding, loads=loads, **kw
            )
        else:
            blocks = generation_blocks([0] * n, seed=0, step=0, round_=0, **kw)
            loads = [a + b for a, b in zip(loads, engine_token_loads(blocks, layout.engines, tokens))]
    return WorkBalance(layout.engines, layout.ranks_per_engine, rollout, loads, samples, tuple(unsized))


def format_work_balance(cfg: CampaignConfig, *, gpus: int) -> str:
    """Two lines: the rollout's and the evaluation's busiest engine over the mean, in expected tokens."""
    w = work_balance(cfg, gpus=gpus)
    r = cfg.rollout
    engine = f"{r.engine} engine" + ("s" if w.engines > 1 else "")
    group = f" of {w.ranks_per_engine} ranks (tensor parallel)" if w.ranks_per_engine > 1 else ""
    head = f"generation work over {w.engines} {engine}{group}, in expected generated tokens (samples x budget):"
    lines = [
        head,
        f"  rollout     {r.prompts_per_step} prompts x {r.samples_per_prompt}: busiest engine "
        f"{max(w.rollout) / 1e6:.2f} M tokens, {busiest_over_mean(w.rollout):.2f} x the mean",
    ]
    if w.evaluation and sum(w.evaluation):
        lines.append(
            f"  evaluation  {w.eval_samples} samples: busiest engine {max(w.evaluation) / 1e6:.2f} M tokens, "
            f"{busiest_over_mean(w.evaluation):.2f} x the mean"
        )
    if w.unsized:
        lines.append(f"  (not counted, size unknown without a limit: {', '.join(w.unsized)})")
    return "\n".join(lines)
