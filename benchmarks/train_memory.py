"""Peak memory of a train step grows with the micro-batch, not the mini-batch.

Each setting runs in a fresh subprocess: build the tiny policy (FP8 tensorwise,
emulated), a batch of 512 sequences (14 prompt + 10 response tokens), then one
``policy_update`` with a BF16 shadow pass; the peak RSS increase over the
pre-step high-water mark is the step's peak working memory. Mini-batch and
micro-batch sizes are varied independently, side by side.

    python benchmarks/train_memory.py
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, torch
from fp8rl_core.config.campaign import CampaignConfig
from fp8rl_core.config.model import ModelConfig
from fp8rl_core.precision.conversion import convert_for_training
from fp8rl_core.tasks.tiny_model import build_tiny_model
from stages.trainer.optimizer import make_optimizer
from stages.trainer.types import TrainBatch
from stages.trainer.update import UpdateSpec, policy_update
mini, micro = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0); torch.set_num_threads(1)
cfg = CampaignConfig.model_validate({"rollout": {"prompts_per_step": 64, "samples_per_prompt": 8},
    "algorithm": {"ppo_mini_batch_size": mini, "micro_batch_size": micro}})
model = build_tiny_model(ModelConfig())
convert_for_training(model, "fp8_tensorwise")
opt, sched = make_optimizer(model, cfg)
n, p, r = 512, 14, 10
ids = torch.randint(4, 120, (n, p + r)); am = torch.ones_like(ids)
rm = torch.zeros(n, p + r); rm[:, p:] = 1
batch = TrainBatch(ids, am, rm, torch.full((n, p + r), -1.0) * rm, torch.randn(n), torch.arange(n))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
policy_update(model, opt, sched, batch, cfg, UpdateSpec(bounds=(0.8, 1.28), shadow=True, seed=0))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"mini": mini, "micro": micro, "peak_mb": (after - before) / 1024}))
"""


def measure(mini: int, micro: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(mini), str(micro)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]


def main() -> None:
    settings = [(512, 32), (512, 64), (512, 128), (512, 256), (512, 512), (128, 32), (256, 32)]
    print(f"{'mini-batch':>10} {'micro-batch':>11} {'step peak MB':>13}")
    for mini, micro in settings:
        print(f"{mini:>10} {micro:>11} {measure(mini, micro):>13.1f}", flush=True)
    print("(peak RSS increase during one policy_update with a BF16 shadow pass, FP8 tensorwise, 512 sequences)")


if __name__ == "__main__":
    main()
