"""Padded-token share and train-step time: token-budget micro-batches vs fixed-row micro-batches.

Today's split cuts each mini-batch into micro-batches of ``micro_batch_size`` rows,
every one padded to the batch's longest row; ``algorithm.max_tokens_per_micro_batch``
sorts each mini-batch's rows by length and pads each micro-batch only to its own
longest row (``stages.trainer.batch.token_budget_micros``). Two length
distributions, one batch each, the stress preset's model and mini-batches:

* ``stress``: the stress world (``configs/stress-cpu.yaml``, difficulty 0): the
  worksheet prompt and the teacher's worked chains, lengths in characters (the
  tiny tokenizer is one token a character);
* ``spread16``: a synthetic long tail with a 16x spread, 32-token prompts and
  responses 32 x 16^(u^2) tokens, u uniform (32 to 512 tokens, median ~60).

Per world: padded share = padded tokens / tokens computed (both splits, kernel
multiple included) and the median wall time of ``policy_update`` (π_old and the
updates, no shadow) over ``--reps`` interleaved repetitions, 1 thread. The last
line prints the step-time ratio (budget / today) on the 16x spread.

    python benchmarks/padding_share.py [--reps 3] [--budget 1024] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def stress_lengths(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """(prompt, response) lengths of ``n`` stress-world samples (difficulty 0, the preset's)."""
    from fp8rl_core.tasks.stress import demonstration, format_prompt, make_problem

    rng = random.Random(seed)
    prompts, responses = [], []
    for i in range(n):
        p = make_problem(i, "train", 0, seed)
        prompts.append(len(format_prompt(p.operands, 0)))
        responses.append(len(demonstration(p, 0, 0.3, rng)) + 1)  # + EOS
    return prompts, responses


def spread_lengths(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return [32] * n, [int(32 * 16 ** (rng.random() ** 2)) for _ in range(n)]


def make_batch(prompts: list[int], responses: list[int], vocab: int, seed: int = 0):
    import torch

    from stages.trainer.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    n, t = len(prompts), max(p + r for p, r in zip(prompts, responses))
    ids = torch.randint(4, vocab, (n, t), generator=g)
    am, rm = torch.zeros(n, t, dtype=torch.long), torch.zeros(n, t)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        am[i, : p + r] = 1
        rm[i, p : p + r] = 1
    return TrainBatch(
        ids * am, am, rm, -torch.rand(n, t, generator=g) * rm, torch.randn(n, generator=g), torch.arange(n)
    )


def padded_share(batch, cfg, seed: int) -> float:
    """Padded tokens / computed tokens of the step's micro-batches (the kernel multiple included)."""
    from stages.trainer.batch import minibatch_plan, padded_tokens
    from stages.trainer.forward import token_multiple

    lengths = batch.attention_mask.sum(1)
    multiple = token_multiple(cfg.precision.train)
    budget = cfg.algorithm.max_tokens_per_micro_batch is not None
    plan = minibatch_plan(batch.size, cfg, seed, lengths=lengths, multiple=multiple)
    width = batch.input_ids.shape[1]
    computed = real = 0
    for micros in plan:
        for m in micros:
            computed += padded_tokens(m.numel(), int(lengths[m].max()) if budget else width, multiple)
            real += int(lengths[m].sum())
    return 1 - real / computed


def time_step(cfg, batch, seed: int) -> float:
    import torch

    from fp8rl_core.precision.conversion import convert_for_training
    from fp8rl_core.tasks.tiny_model import build_tiny_model
    from stages.trainer.optimizer import make_optimizer
    from stages.trainer.update import UpdateSpec, policy_update

    torch.manual_seed(0)
    model = build_tiny_model(cfg.model)
    convert_for_training(model, cfg.precision.train)
    opt, sched = make_optimizer(model, cfg)
    t0 = time.perf_counter()
    policy_update(model, opt, sched, batch, cfg, UpdateSpec(bounds=(0.8, 1.28), shadow=False, seed=seed))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", type=int, default=1024, help="max_tokens_per_micro_batch of the budgeted split")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override (repeatable)")
    args = ap.parse_args(argv)
    import torch

    from flows.campaign.configuration import load_config
    from fp8rl_core.tasks.tiny_model import VOCAB_SIZE

    torch.set_num_threads(1)
    base = ["model.max_position_embeddings=1024", *args.sets]
    today = load_config("stress-cpu", base)
    budgeted = load_config("stress-cpu", [*base, f"algorithm.max_tokens_per_micro_batch={args.budget}"])
    n = today.rollout.prompts_per_step * today.rollout.samples_per_prompt
    a = today.algorithm
    print(
        f"# {n} rows a step, mini-batches of {a.ppo_mini_batch_size}, micro-batches of {a.micro_batch_size} rows; "
        f"budget {args.budget} tokens; precision {today.precision.train}; {args.reps} reps, 1 thread"
    )
    ratio = float("nan")
    for world, lengths in (("stress", stress_lengths), ("spread16", spread_lengths)):
        batch = make_batch(*lengths(n), VOCAB_SIZE)
        times: dict[str, list[float]] = {"today": [], "budget": []}
        for _ in range(args.reps):  # interleaved: drift of a busy machine hits both alike
            times["today"].append(time_step(today, batch, seed=1))
            times["budget"].append(time_step(budgeted, batch, seed=1))
        t0, t1 = statistics.median(times["today"]), statistics.median(times["budget"])
        ratio = t1 / t0
        print(
            f"{world:9s} padded share today {padded_share(batch, today, 1):6.1%}  budget "
            f"{padded_share(batch, budgeted, 1):6.1%}   step today {t0:6.2f} s  budget {t1:6.2f} s  "
            f"ratio {ratio:.3f}"
        )
    print(f"step-time ratio (budget / today, 16x spread): {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
