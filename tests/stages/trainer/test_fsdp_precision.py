"""FSDP2 as torchao and torchtitan run it: bf16 parameter all-gather, fp32 gradient reduction, FP8 all-gather.

* Every sharded module (each decoder block and the root) all-gathers its parameters
  in bf16 and reduces gradients in fp32: checked on the FSDP state and, during a
  forward, on the unsharded weight a linear actually receives; the gradients the
  optimizer sees are fp32 shards.
* torchao's float8 all-gather is switched on for tensorwise torchao linears (flag
  and the ``WeightWithDynamicFloat8CastTensor`` weight the FSDP hooks need) and for
  nothing else (rowwise, our emulated linears). On CPU: the configuration, not the
  kernel.
"""

from __future__ import annotations

import torch

from fp8rl_core.precision.conversion import convert_for_training
from fp8rl_core.tasks.tiny_model import build_tiny_model
from stages.trainer.distributed import RESHARD_AFTER_FORWARD, decoder_blocks, enable_float8_all_gather, shard_policy
from tests.scaleout_common import SMALL, rendezvous, spawn_ranks


def _check_sharded(rank: int, port: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=port, rank=rank, world_size=1)
    try:
        torch.manual_seed(0)
        model = build_tiny_model(SMALL)
        convert_for_training(model, "fp8_rowwise")
        shard_policy(model)
        seen = {}
        q = decoder_blocks(model)[0].self_attn.q_proj
        q.register_forward_pre_hook(lambda mod, args: seen.update(q_proj=mod.weight.dtype))  # returns None
        mods = [*decoder_blocks(model), model]
        policies = [
            (
                m._get_fsdp_state()._fsdp_param_group.mp_policy,
                m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None,
            )
            for m in mods
        ]
        ids = torch.randint(4, 60, (2, 16))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids).logits.float().sum().backward()
        grads = {p.grad.dtype for p in model.parameters()}
        torch.save(
            {
                "policies": [(str(p.param_dtype), str(p.reduce_dtype), r) for p, r in policies],
                "q_proj": str(seen["q_proj"]),
                "grads": sorted(map(str, grads)),
                "master": sorted({str(p.dtype) for p in model.parameters()}),
            },
            out,
        )
    finally:
        dist.destroy_process_group()


def test_sharded_modules_all_gather_bf16_and_reduce_fp32(tmp_path):
    out = str(tmp_path / "fsdp.pt")
    spawn_ranks(_check_sharded, (rendezvous(), out), nprocs=1)
    got = torch.load(out)
    blocks = got["policies"][:-1]
    assert all(p[:2] == ("torch.bfloat16", "torch.float32") for p in got["policies"])
    assert [r for _, _, r in blocks] == [True] * (len(blocks) - 1) + [False]  # see RESHARD_AFTER_FORWARD
    assert got["policies"][-1][2] is True and "last block: no" in RESHARD_AFTER_FORWARD
    assert got["q_proj"] == "torch.bfloat16"  # what the linear computes with, during the forward
    assert got["grads"] == ["torch.float32"] and got["master"] == ["torch.float32"]


def test_float8_all_gather_is_configured_for_tensorwise_torchao_linears_only():
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    torch.manual_seed(0)
    tensorwise = build_tiny_model(SMALL)
    report = convert_for_training(tensorwise, "fp8_tensorwise", backend="torchao")  # emulate=True on CPU
    switched = enable_float8_all_gather(tensorwise)
    assert switched and sorted(switched) == sorted(report.converted)
    for name in switched:
        lin = tensorwise.get_submodule(name)
        assert lin.config.enable_fsdp_float8_all_gather
        assert isinstance(lin.weight.data, WeightWithDynamicFloat8CastTensor) and lin.weight.requires_grad
    assert enable_float8_all_gather(tensorwise) == []  # idempotent
    for mode, backend in (("fp8_rowwise", "torchao"), ("fp8_tensorwise", "emulated"), ("bf16", "auto")):
        other = build_tiny_model(SMALL)
        convert_for_training(other, mode, backend=backend)
        assert enable_float8_all_gather(other) == [], (mode, backend)
