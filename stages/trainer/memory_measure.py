"""A measured memory plan: one train step of the real architecture on fake tensors, tracked by FSDP2's tracker.

No weights and no GPU: the policy is built from its transformers config on the
meta device, converted to the training precision as a run converts it,
FSDP2-sharded by :func:`stages.trainer.distributed.shard_policy` (bf16 all-gather, fp32
reduction) over a ``"fake"`` process group of N ranks (``FakeStore``) on a CPU
mesh (FSDP2 asks ``torch.cuda`` for its device on a CUDA mesh), materialized with
``to_empty`` under ``FakeTensorMode(allow_non_fake_inputs=True)`` (shapes and
dtypes only, no bytes), and then one micro-batch forward, backward and AdamW step
of the trainer's own forward path (:func:`stages.trainer.forward.policy_logprobs`) runs
under ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``, which counts
every tensor the step allocates by kind: sharded and unsharded parameters,
gradients, optimizer state, activations, temporaries, all-gather and
reduce-scatter buffers. Rank 0's view; every rank holds the same shapes.

Depth: a few decoder layers are measured, twice (``depths``, e.g. 3 and 4), and
every kind is extrapolated linearly in the number of layers,
``m(L) = m(d1) + (L - d1) * (m(d2) - m(d1)) / (d2 - d1)``: parameters, gradients,
optimizer state and stored activations grow by one block per layer; the gathered
blocks, the logits and the all-gather buffers do not, and the difference says so.
Both depths must hold a block that is neither the first nor the last (3 layers or
more): the last block is not resharded after its forward and the first has no
block to prefetch in the backward, so at 2 layers a phase's peak can fall at a
different moment (the backward's peak lacks the prefetched block's all-gather
buffer), and the difference from 2 to 3 layers is not one block's.
:func:`linearity_error` checks a fit against a third depth.

What the tracker cannot see: the CUDA context and NCCL buffers (about 1-2 GiB a
GPU), allocator fragmentation (the plan's headroom covers both), and kernels that
allocate differently on the GPU (the CPU's attention kernels: see
docs/trainer-at-scale.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from stages.trainer.distributed import forget_sharding_decisions

GiB = 1024**3
KINDS = (
    "Sharded Param",
    "Unsharded Param",
    "Buffer",
    "Sharded Grad",
    "Unsharded Grad",
    "Activation",
    "Temp",
    "All Gather",
    "Reduce Scatter",
    "OptState",
    "Inputs",
)


@dataclass
class StepMemory:
    """Bytes of one tracked train step on rank 0, by tracker kind, at each phase's peak."""

    layers: int
    tokens: int
    phases: dict[str, dict[str, int]] = field(default_factory=dict)  # phase -> kind -> bytes
    sync_bytes: int = 0  # a weight sync's peak: the largest full bf16 parameter it streams to the engine

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())


@contextlib.contextmanager
def fake_world(world_size: int):
    """A ``"fake"`` process group of ``world_size`` ranks (this process is rank 0) and its CPU mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already up: measure memory in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()
        forget_sharding_decisions()  # cached specs say "rank 0 of this fake world"


def _fake_mode():
    """``FakeTensorMode(allow_non_fake_inputs=True)`` that reads every number as 1 and every bool as False.

    A fake tensor has no values, so ``int(t)`` has none to give; the step reads a few
    (the label range check, transformers' "is there any padding" test, AdamW's step
    count) and only branches or scales with them. False takes the conservative branch
    (a padding mask is built); 1 is a valid label and a valid step count.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    class ZeroScalars(FakeTensorMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                t = args[0]
                return False if t.dtype == torch.bool else (1.0 if t.dtype.is_floating_point else 1)
            return super().__torch_dispatch__(func, types, args, kwargs)

    return ZeroScalars(allow_non_fake_inputs=True)


def _snapshot(tracker: Any, kind: str = "peak") -> dict[str, int]:
    snap = tracker.get_tracker_snapshot(kind)
    dev = next((d for d in snap if torch.device(d).type == "cpu"), None)
    raw = snap.get(dev, {}) if dev is not None else {}
    return {str(getattr(k, "value", k)): int(v) for k, v in raw.items() if str(getattr(k, "value", k)) in KINDS}


def _reset_peak(tracker: Any) -> None:
    """Start a new phase's peak at the current usage (the tracker keeps one running peak).

    The tracker compares each op's current total (the snapshot's ``"Total"`` entry) with
    ``_peak_mem``: that is what the reset sets, not the sum of the snapshot's entries (which
    counts every byte twice, kinds and total, and hid every later peak below twice the usage
    at the reset)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    current = tracker.get_tracker_snapshot("current")
    tracker._peak_mem = {d: v[_TOTAL_KEY] for d, v in current.items()}
    tracker._peak_mem_snap = current


def measure_step(
    hf_config: Any,
    *,
    layers: int,
    world_size: int,
    mode: str,
    micro_batch_size: int,
    seq_len: int,
    activation_checkpointing: bool,
    lr: float = 1e-6,
) -> StepMemory:
    """Track one forward, backward and AdamW step of a ``layers``-layer copy of ``hf_config``'s model."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from transformers import AutoModelForCausalLM

    from fp8rl_core.precision.bf16_pass import enable_activation_checkpointing
    from fp8rl_core.precision.conversion import convert_for_training
    from fp8rl_core.precision.fp8_operands import gpu_sized_chunks
    from stages.trainer.distributed import shard_policy
    from stages.trainer.forward import ForwardSpec, policy_logprobs, token_multiple

    fields = {k: v for k, v in hf_config.to_dict().items() if k != "layer_types"}  # per-layer list: rebuilt
    cfg = hf_config.__class__.from_dict({**fields, "num_hidden_layers": layers})
    with fake_world(world_size) as mesh:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        convert_for_training(model, mode, backend="emulated")
        if activation_checkpointing:
            enable_activation_checkpointing(model)
        shard_policy(model, mesh=mesh)
        with _fake_mode(), gpu_sized_chunks():
            model.to_empty(device="cpu")
            opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)  # as make_optimizer
            ids = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
            am = torch.ones(micro_batch_size, seq_len, dtype=torch.long)
            out = StepMemory(layers=layers, tokens=micro_batch_size * seq_len)
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs((ids, am))
            with tracker:
                lp, _ = policy_logprobs(model, ids, am, ForwardSpec(mode, with_entropy=True))
                out.phases["forward"] = _snapshot(tracker)
                _reset_peak(tracker)
                lp.sum().backward()
                out.phases["backward"] = _snapshot(tracker)
                _reset_peak(tracker)
                opt.step()
                out.phases["after step"] = _snapshot(tracker, "current")
                opt.zero_grad(set_to_none=True)
            out.phases["optimizer"] = {**out.phases["after step"], "OptState": _local_adamw_peak(model, lr)}
            del lp
            out.sync_bytes = _sync_bytes(model)
    assert token_multiple(mode) >= 1
    return out


def _local_adamw_peak(model: torch.nn.Module, lr: float) -> int:
    """Peak optimizer-state bytes of one foreach AdamW step over this rank's shards, as plain tensors.

    Tracked on the DTensors under fake tensors, the step also counts the sharding
    propagation's temporaries at the *global* shape (3 + 3 N states on N fake ranks,
    where a real 1-rank FSDP2 run of the same step shows 3: the two states and one
    foreach temporary); on the GPU that propagation allocates nothing. A DTensor's
    foreach step is the local tensors' step, so it is measured on those.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    shards = [torch.nn.Parameter(p.to_local().detach().clone()) for p in model.parameters()]
    for q in shards:
        q.grad = torch.zeros_like(q)
    opt = torch.optim.AdamW(shards, lr=lr, foreach=True)
    tracker = MemTracker()
    tracker.track_external(opt, *shards)
    with tracker:
        opt.step()
    snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return int(sum(v for k, v in snap.items() if "OPT" in str(k)))


def _sync_bytes(model: torch.nn.Module) -> int:
    """Peak bytes a weight sync gathers on the device: the sync streams one full bf16 parameter at a
    time (``stages.engines.weight_transfer.stream_trainer_weights``), so the largest one."""
    from stages.engines.weight_transfer import stream_trainer_weights

    return max((t.numel() * t.element_size() for _, t in stream_trainer_weights(model)), default=0)


def extrapolate(a: StepMemory, b: StepMemory, layers: int) -> StepMemory:
    """Every kind of every phase, linear in depth through the two measurements (see the module docstring)."""
    if a.layers == b.layers:
        raise ValueError("extrapolate needs two different depths")
    k = (layers - a.layers) / (b.layers - a.layers)
    out = StepMemory(layers=layers, tokens=a.tokens)
    for phase in a.phases:
        kinds = set(a.phases[phase]) | set(b.phases[phase])
        out.phases[phase] = {
            kind: int(
                round(a.phases[phase].get(kind, 0) + k * (b.phases[phase].get(kind, 0) - a.phases[phase].get(kind, 0)))
            )
            for kind in kinds
        }
    out.sync_bytes = max(a.sync_bytes, b.sync_bytes)  # the largest parameter does not grow with depth
    return out


def linearity_error(a: StepMemory, b: StepMemory, c: StepMemory) -> float:
    """Largest relative gap, over the phases' totals, between ``c`` measured and ``c`` extrapolated
    from ``a`` and ``b``: 0 when the depth fit holds exactly."""
    fit = extrapolate(a, b, c.layers)
    return max(abs(fit.total(ph) - c.total(ph)) / max(c.total(ph), 1) for ph in c.phases)


__all__ = ["GiB", "KINDS", "StepMemory", "extrapolate", "fake_world", "linearity_error", "measure_step"]
