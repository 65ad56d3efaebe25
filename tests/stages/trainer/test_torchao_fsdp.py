"""torchao's own float8 training modules (emulated on CPU) under FSDP2 on gloo, as a tensorwise GPU run uses them.

A tensorwise FP8 run on several GPUs trains torchao's ``Float8Linear`` with float8
all-gather (``stages.trainer.distributed.shard_policy``): FSDP2 hands each linear the
all-gathered float8 payload, not BF16 weights. torchao's ``emulate=True`` runs the same
modules and the same FSDP2 hooks on CPU; gloo moves the float8 payloads as bytes.
"""

from __future__ import annotations

import pytest
import torch

from tests.scaleout_common import SMALL, rendezvous, small_batch, spawn_ranks

pytestmark = pytest.mark.timeout(240)


def _fp8_model(seed: int = 0, mode: str = "fp8_tensorwise", backend: str = "torchao"):
    from fp8rl_core.precision.conversion import convert_for_training
    from fp8rl_core.tasks.tiny_model import build_tiny_model

    torch.manual_seed(seed)
    m = build_tiny_model(SMALL)
    report = convert_for_training(m, mode, backend=backend, emulate=True)
    assert report.backend == ("torchao" if backend == "torchao" else "fp8rl-emulated") and report.converted
    return m


def _bf16_model(seed: int = 0):
    from fp8rl_core.tasks.tiny_model import build_tiny_model

    torch.manual_seed(seed)
    return build_tiny_model(SMALL)


def _shadow_rank(rank: int, store: str, world: int, out: str, mode: str, backend: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from stages.trainer.distributed import shard_policy, uses_fsdp_float8
    from stages.trainer.forward import ForwardSpec, policy_logprobs

    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        fp8 = shard_policy(_fp8_model(mode=mode, backend=backend), mesh=mesh)
        assert uses_fsdp_float8(fp8) == (mode == "fp8_tensorwise" and backend == "torchao")
        ref = shard_policy(_bf16_model(), mesh=mesh)
        b = small_batch(n=4)
        with torch.no_grad():
            lp8, _ = policy_logprobs(fp8, b.input_ids, b.attention_mask, ForwardSpec(mode))
            lp_shadow, _ = policy_logprobs(fp8, b.input_ids, b.attention_mask, ForwardSpec(mode, shadow=True))
            lp16, _ = policy_logprobs(ref, b.input_ids, b.attention_mask, ForwardSpec("bf16"))
        torch.save({"fp8": lp8, "shadow": lp_shadow, "bf16": lp16}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world, mode, backend",
    [
        (1, "fp8_tensorwise", "torchao"),
        (2, "fp8_tensorwise", "torchao"),
        (2, "fp8_rowwise", "torchao"),
        (2, "fp8_blockwise", "emulated"),
    ],
)
def test_shadow_pass_under_fsdp2_is_the_bf16_forward(tmp_path, world, mode, backend):
    """The BF16 shadow pass under FSDP2 computes the bf16 mode's forward on the same masters, bit for bit:
    torchao's tensorwise modules with float8 all-gather (it used to fail on the float8 payload), torchao's
    rowwise ones and the blockwise emulation (bf16 all-gather)."""
    spawn_ranks(_shadow_rank, (rendezvous(), world, str(tmp_path), mode, backend), nprocs=world)
    for rank in range(world):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(r["shadow"], r["bf16"])
        assert not torch.equal(r["fp8"], r["bf16"])  # the FP8 forward is FP8: the comparison can fail


def _train_rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from stages.trainer.collective import DistCollective
    from stages.trainer.distributed import shard_policy
    from stages.trainer.optimizer import make_optimizer
    from stages.trainer.update import UpdateSpec, policy_update
    from tests.scaleout_common import small_cfg

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    try:
        cfg = small_cfg("fp8_tensorwise")
        model = shard_policy(_fp8_model())
        opt, sched = make_optimizer(model, cfg)
        b = small_batch()
        res = policy_update(
            model, opt, sched, b, cfg, UpdateSpec(bounds=(0.8, 1.28), shadow=True, seed=0), collective=DistCollective()
        )
        scales = [
            m.weight._local_tensor._precomputed_scale for m in model.modules() if type(m).__name__ == "Float8Linear"
        ]
        torch.save(
            {
                "grads": [n for n, p in model.named_parameters() if p.grad is not None],
                "scales": [s is not None for s in scales],
                "old16": res.old_logp_bf16,
                "logp16": res.logp_bf16,
                "mask": b.response_mask,
                "updates": res.metrics["updates"] - res.metrics["skipped_updates"],
            },
            f"{out}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_a_shadow_step_trains_torchaos_tensorwise_modules_on_two_ranks_and_frees_the_gradients(tmp_path):
    """The trainer's update with its BF16 shadow passes, on torchao's tensorwise modules with float8
    all-gather: every update applied, the scales precomputed for the next all-gather, BF16 log-probs on
    every response token, and no gradient left behind on any rank."""
    spawn_ranks(_train_rank, (rendezvous(), str(tmp_path)))
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        m = r["mask"] > 0
        assert r["updates"] == 2 and r["scales"] and all(r["scales"])
        assert torch.isfinite(r["old16"][m]).all() and torch.isfinite(r["logp16"][m]).all()
        assert r["grads"] == []
