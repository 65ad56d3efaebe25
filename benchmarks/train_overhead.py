"""Overhead of the train stage's update over the bare model passes it cannot avoid.

The update needs one forward without grad (π_old) and one forward+backward (π_θ)
of every micro-batch. This script times, side by side on the same batch and
precision, (a) ``policy_update`` (no shadow step: one mini-batch plan, loss,
clipping, optimizer step, step statistics) and (b) one bare no-grad forward plus
one bare forward+backward of the same micro-batches (autocast, no loss beyond a
sum of the logits' log-softmax at the labels), and prints (a) / (b). Goal <= 1.15.

    nice -n 15 python benchmarks/train_overhead.py [--rows 256] [--mode fp8_tensorwise] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256, help="sequences in the batch (tiny default: 512)")
    ap.add_argument("--mode", default="fp8_tensorwise")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from fp8rl_core.config.campaign import CampaignConfig
    from fp8rl_core.config.model import ModelConfig
    from fp8rl_core.objective.logprobs import token_logprobs_and_entropy
    from fp8rl_core.precision.autocast import autocast_context
    from fp8rl_core.precision.conversion import convert_for_training
    from fp8rl_core.tasks.tiny_model import build_tiny_model
    from stages.trainer.forward import pad_to_contract, token_multiple
    from stages.trainer.optimizer import make_optimizer
    from stages.trainer.types import TrainBatch
    from stages.trainer.update import UpdateSpec, policy_update

    cfg = CampaignConfig.model_validate(
        {
            "rollout": {"prompts_per_step": args.rows // 8, "samples_per_prompt": 8},
            "algorithm": {"ppo_mini_batch_size": args.rows, "micro_batch_size": args.rows},
            "precision": {"train": args.mode},
        }
    )
    torch.manual_seed(0)
    model = build_tiny_model(ModelConfig())
    convert_for_training(model, args.mode)
    opt, sched = make_optimizer(model, cfg)
    n, p, r = args.rows, 14, 12
    ids = torch.randint(4, 60, (n, p + r))
    am = torch.ones_like(ids)
    rm = torch.zeros(n, p + r)
    rm[:, p:] = 1
    batch = TrainBatch(ids, am, rm, -torch.rand(n, p + r) * rm, torch.randn(n), torch.arange(n))

    def bare() -> None:
        x, m = pad_to_contract(ids, am, token_multiple(args.mode))
        pos = (m.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad(), autocast_context(args.mode, x.device):
            model(input_ids=x, attention_mask=m, position_ids=pos, use_cache=False)
        with autocast_context(args.mode, x.device):
            logits = model(input_ids=x, attention_mask=m, position_ids=pos, use_cache=False).logits
        lp, _ = token_logprobs_and_entropy(logits[:, :-1], x[:, 1:])
        lp.sum().backward()
        model.zero_grad(set_to_none=True)

    def stage() -> None:
        policy_update(model, opt, sched, batch, cfg, UpdateSpec(bounds=(0.8, 1.28), shadow=False, seed=0))

    bare(), stage()  # warm-up
    t_bare, t_stage = [], []
    for _ in range(args.repeats):  # interleaved, so load changes hit both
        t0 = time.perf_counter()
        bare()
        t_bare.append(time.perf_counter() - t0)  # noqa: E702
        t0 = time.perf_counter()
        stage()
        t_stage.append(time.perf_counter() - t0)  # noqa: E702
    b, s = min(t_bare), min(t_stage)
    print(f"mode {args.mode}, {n} rows x {p + r} tokens, {args.threads} threads, best of {args.repeats}")
    print(f"bare fwd + fwd/bwd: {b:.3f} s   train update: {s:.3f} s   ratio: {s / b:.3f} (goal <= 1.15)")


if __name__ == "__main__":
    main()
