"""Sharded state: distributed checkpoints across world sizes, and every rank holding its own shard.

* a 2-rank DCP checkpoint restores in one process and a 1-process one on 2 ranks, model and
  AdamW state equal;
* ranks forked from a process that sharded under another process group (a measured memory
  plan's fake world, a bare fake group) hold their own shards: DTensor's sharding caches are
  emptied; should a stale decision get through, the shard policy refuses it in one line.
"""

from __future__ import annotations

import pytest
import torch

from stages.trainer.optimizer import make_optimizer
from stages.trainer.update import UpdateSpec, policy_update
from tests.scaleout_common import rendezvous, small_batch, small_cfg, small_model, spawn_ranks


def _ckpt_rank(rank: int, world: int, port: str, path: str, mode: str, out: str) -> None:
    """Save (mode 'save': after one update) or load (mode 'load') a DCP checkpoint on ``world`` ranks."""
    import torch.distributed as dist

    from stages.trainer.distributed import full_model_state, load_sharded, save_sharded, shard_policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=port, rank=rank, world_size=world)
    try:
        from stages.trainer.collective import DistCollective

        cfg = small_cfg("bf16")
        model = shard_policy(small_model("bf16", seed=1 if mode == "load" else 0))
        opt, sched = make_optimizer(model, cfg)
        if mode == "save":
            policy_update(
                model,
                opt,
                sched,
                small_batch(),
                cfg,
                UpdateSpec(bounds=(0.8, 1.28), shadow=False, seed=0),
                collective=DistCollective(),
            )
            save_sharded(path, model, opt)
        else:
            load_sharded(path, model, opt)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        state = full_model_state(model)
        if rank == 0:
            torch.save({"model": state, "optim": osd}, out)
    finally:
        dist.destroy_process_group()


def _ckpt_one(path: str, mode: str):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from stages.trainer.distributed import load_sharded, save_sharded

    cfg = small_cfg("bf16")
    model = small_model("bf16", seed=1 if mode == "load" else 0)
    opt, sched = make_optimizer(model, cfg)
    if mode == "save":
        policy_update(model, opt, sched, small_batch(), cfg, UpdateSpec(bounds=(0.8, 1.28), shadow=False, seed=0))
        save_sharded(path, model, opt)
    else:
        load_sharded(path, model, opt)
    return {
        "model": model.state_dict(),
        "optim": get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True)),
    }


def _same_state(a, b):
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys() and len(sa) > 0
    for k in sa:
        for f in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(sa[k][f]).float(), torch.as_tensor(sb[k][f]).float()), (k, f)


def _stale_rank(rank: int, world: int, port: str, out: str) -> None:
    """Shard through the policy with the cache-forgetting switched off; write what it raised."""
    import torch.distributed as dist

    import stages.trainer.distributed as distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=port, rank=rank, world_size=world)
    try:
        distributed.forget_sharding_decisions = lambda: None
        try:
            distributed.shard_policy(small_model("bf16"))
            outcome = "sharded"
        except RuntimeError as e:
            outcome = str(e)
        torch.save(outcome, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_rank_holding_another_ranks_shard_is_refused_in_one_line(tmp_path):
    """Should a stale sharding decision get through again, the shard policy refuses it, naming the parameter."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from stages.trainer.distributed import forget_sharding_decisions, shard_policy

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        shard_policy(small_model("bf16"), mesh=init_device_mesh("cpu", (2,)))  # decisions cached as rank 0
    finally:
        dist.destroy_process_group()
    out = str(tmp_path / "outcome")
    try:
        spawn_ranks(_stale_rank, (2, rendezvous(), out))
    finally:
        forget_sharding_decisions()  # this worker's later tests start clean
    assert torch.load(f"{out}.0") == "sharded"
    message = torch.load(f"{out}.1")
    assert message.startswith("rank 1: parameter ") and "(0,)" in message and "(1,)" in message
    assert "\n" not in message


def _coordinate_rank(rank: int, world: int, port: str, out: str, through_policy: bool) -> None:
    """Shard a model on ``world`` gloo ranks and write the mesh coordinates its parameters carry."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from stages.trainer.distributed import shard_policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=port, rank=rank, world_size=world)
    try:
        model = small_model("bf16")
        if through_policy:
            shard_policy(model)
        else:
            fully_shard(model)
        coords = sorted({p.device_mesh.get_coordinate() for p in model.parameters()})
        torch.save(coords, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("route", ["measured in a fake world", "sharded under a bare fake group"])
def test_ranks_forked_after_sharding_elsewhere_hold_their_own_shards(tmp_path, route):
    """DTensor caches sharding decisions by mesh shape, with the rank inside: ranks forked from a process
    that sharded as rank 0 of a same-shaped group (a measured memory plan) all held rank 0's shard, and a
    2-rank checkpoint lost half of every tensor. The memory plan's fake world and the shard policy forget
    the cached decisions."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from stages.trainer.distributed import shard_policy
    from stages.trainer.memory_measure import fake_world

    model = small_model("bf16")
    if route == "measured in a fake world":
        with fake_world(2) as mesh:
            shard_policy(model, mesh=mesh)
            assert model.lm_head.weight.device_mesh.get_coordinate() == (0,)
    else:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        try:
            fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        finally:
            dist.destroy_process_group()
    out = str(tmp_path / "coords")
    spawn_ranks(_coordinate_rank, (2, rendezvous(), out, route != "measured in a fake world"))
    for rank in range(2):
        assert torch.load(f"{out}.{rank}") == [(rank,)], rank


def test_forgetting_sharding_decisions_works_without_torchs_one_call(monkeypatch):
    """On a torch without ``debug._clear_sharding_prop_cache`` the caches are emptied one by one: the
    same DTensor op that hit the fast path's cache before misses it after."""
    import torch.distributed as dist
    import torch.distributed.tensor.debug as dtensor_debug
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from stages.trainer.distributed import forget_sharding_decisions

    stats = torch._C._get_DTensor_sharding_propagator_cache_stats  # (hits, misses)

    def hit_or_miss(x) -> str:
        before = stats()
        torch.ops.aten.mul.Tensor(x, 2.0)
        after = stats()
        return "hit" if after[0] > before[0] and after[1] == before[1] else "miss"

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        x = DTensor.from_local(torch.ones(4, 4), init_device_mesh("cpu", (2,)), [Shard(0)])
        hit_or_miss(x)
        assert hit_or_miss(x) == "hit"
        monkeypatch.delattr(dtensor_debug, "_clear_sharding_prop_cache")
        forget_sharding_decisions()
        assert hit_or_miss(x) == "miss"
    finally:
        dist.destroy_process_group()
        forget_sharding_decisions()


@pytest.mark.timeout(240)
def test_two_rank_checkpoint_restores_in_one_process_and_the_reverse(tmp_path):
    # 2 ranks save -> 1 process loads
    out = str(tmp_path / "saved.pt")
    spawn_ranks(_ckpt_rank, (2, rendezvous(), str(tmp_path / "dcp2"), "save", out))
    saved2 = torch.load(out, weights_only=False)
    _same_state(saved2, _ckpt_one(str(tmp_path / "dcp2"), "load"))
    # 1 process saves -> 2 ranks load
    saved1 = _ckpt_one(str(tmp_path / "dcp1"), "save")
    spawn_ranks(_ckpt_rank, (2, rendezvous(), str(tmp_path / "dcp1"), "load", out))
    _same_state(saved1, torch.load(out, weights_only=False))
