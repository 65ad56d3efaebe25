"""GPU check, trainer part: one full train step on CUDA with torchao's real FP8 kernels.

``run(emit)`` is called by the project's one GPU script (``make gpu-check``,
``gpu_check/main.py``); ``emit(line)`` prints a line. On a CUDA machine it

1. builds a random-init Qwen3 of ~0.5B parameters (hidden 1024, 24 layers,
   GQA 16/8, MLP 3072, vocabulary 151,936; ``transformers.Qwen3ForCausalLM``),
   1 rank, on the GPU;
2. for tensorwise and rowwise (torchao ``Float8Linear``, SM89+) and blockwise
   (torchao's blockwise prototype, SM90): converts a fresh copy with
   ``precision.emulate: false`` (no silent emulation), runs one full
   ``policy_update`` with the BF16 shadow pass on a padded batch (the kernel
   token contracts hold: strict shape checks on), then a calibration on the
   step's r8/r16, and prints loss, grad norm, the calibrated (L, H), seconds;
3. compares per-token log-probs of the real kernels with our CPU emulation's
   numerics run on the same GPU tensors (``backend="emulated"``): mean and max
   |Δ logp| over response tokens.

Without CUDA it prints one line saying so and returns. Nothing here has run on
a GPU yet (no GPU in the sessions that wrote it).
"""

from __future__ import annotations

import time
from typing import Callable

MODES = (("fp8_tensorwise", (8, 9)), ("fp8_rowwise", (8, 9)), ("fp8_blockwise", (9, 0)))


def _model(device):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=24,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).to(device=device, dtype=torch.float32)


def _batch(device, n=32, p=96, r=160):
    import torch

    from stages.train_core import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 150000, (n, p + r), generator=g)
    lens = torch.randint(r // 4, r + 1, (n,), generator=g)
    am = torch.zeros(n, p + r, dtype=torch.long)
    rm = torch.zeros(n, p + r)
    for i, ln in enumerate(lens.tolist()):
        am[i, : p + ln] = 1
        rm[i, p : p + ln] = 1
    return TrainBatch(ids * am, am, rm, -torch.rand(n, p + r, generator=g) * rm, torch.randn(n, generator=g),
                      torch.arange(n)).to(device)


def run(emit: Callable[[str], None]) -> None:
    import torch

    if not torch.cuda.is_available():
        emit("train_step: SKIP - no CUDA device on this machine (nothing ran on a GPU)")
        return
    from fp8rl_core.calibration import CalibratorState, calibrate
    from fp8rl_core.config import CampaignConfig
    from fp8rl_core.fp8_linear import set_strict_shapes
    from fp8rl_core.losses import importance_ratio
    from fp8rl_core.precision import convert_for_training
    from stages.context import check_no_silent_emulation
    from stages.train_core import make_optimizer, policy_logprobs, policy_update

    device = torch.device("cuda", torch.cuda.current_device())
    cap = torch.cuda.get_device_capability(device)
    emit(f"train_step: {torch.cuda.get_device_name(device)} SM{cap[0]}{cap[1]}, torch {torch.__version__}")
    batch = _batch(device)
    prev = set_strict_shapes(True)
    try:
        for mode, need in MODES:
            if cap < need:
                emit(f"train_step {mode}: SKIP - needs SM{need[0]}{need[1]}+ for the real kernel")
                continue
            cfg = CampaignConfig.model_validate({
                "rollout": {"prompts_per_step": 4, "samples_per_prompt": 8, "max_new_tokens": 160},
                "algorithm": {"ppo_mini_batch_size": 16, "micro_batch_size": 8, "lr": 1e-6},
                "precision": {"train": mode, "emulate": False}, "device": "cuda",
            })
            model = _model(device)
            report = convert_for_training(model, mode, emulate=False)
            check_no_silent_emulation(cfg, device, report)
            opt, sched = make_optimizer(model, cfg)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = policy_update(model, opt, sched, batch, cfg, bounds=(0.8, 1.28), shadow=True, seed=0)
            torch.cuda.synchronize()
            sec = time.perf_counter() - t0
            m = batch.response_mask.cpu() > 0
            r8 = importance_ratio(res.logp_fp8, res.old_logp_fp8)
            r16 = importance_ratio(res.logp_bf16, res.old_logp_bf16)
            adv = batch.advantages.cpu()[:, None].expand_as(r8)
            cal = calibrate(r8, r16, adv, m, eps_low=0.2, eps_high=0.28, config=cfg.calibration,
                            previous=CalibratorState.initial(eps_low=0.2, eps_high=0.28, config=cfg.calibration),
                            dual_clip=3.0)
            emit(f"train_step {mode}: backend {report.backend}, {len(report.converted)} FP8 linears; "
                 f"loss {res.metrics['loss']:.4f} grad_norm {res.metrics['grad_norm']:.3f} "
                 f"L {cal.lower:.4f} H {cal.upper:.4f} alpha {cal.alpha:.4f}; step {sec:.2f} s, "
                 f"peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
            # emulation vs kernel on the same weights and tokens
            emu = _model(device)
            emu.load_state_dict(model.state_dict())
            convert_for_training(emu, mode, emulate=True, backend="emulated")
            with torch.no_grad():
                lp_k, _ = policy_logprobs(model, batch.input_ids, batch.attention_mask, mode=mode, micro_batch_size=8)
                lp_e, _ = policy_logprobs(emu, batch.input_ids, batch.attention_mask, mode=mode, micro_batch_size=8)
            d = (lp_k - lp_e).abs()[batch.response_mask > 0]
            emit(f"train_step {mode}: emulation vs kernel |dlogp| mean {float(d.mean()):.2e} max {float(d.max()):.2e}")
            del model, emu, opt
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    finally:
        set_strict_shapes(prev)
