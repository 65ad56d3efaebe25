"""The measured memory plan at a small depth, against hand-computed bytes and the analytic estimate.

A 2- to 5-layer Qwen3 (hidden 512, MLP 1536, GQA 4/2, vocabulary 1024) is sharded
over 4 fake ranks and one train step is tracked on fake tensors. Every dim is a
multiple of 4, so FSDP2 shards without padding and the bytes are exact:

* parameters and gradients: fp32 shards, 4 B x P / 4 each;
* AdamW state after the step: 8 B x P / 4 plus one fp32 step count per tensor;
  its peak inside the step: one more state-sized foreach temporary (12 B x P / 4);
* a weight sync's full state: 4 B x P;
* stored activations per layer with activation checkpointing: the block input in
  bf16, tokens x h x 2 B, exactly the analytic plan's term; without checkpointing
  within 20% below the analytic 34 h x 2 B per token (Korthikanti et al.: a GPT
  block with a 4h GELU MLP and dropout masks; Qwen3's SwiGLU MLP is 3h wide and has
  no dropout, and its RMSNorms save fp32 copies; measured 0.85 at this shape).
"""

from __future__ import annotations

import pytest
import torch

from flows.plan.memory import Arch, total_params
from stages.trainer.memory_measure import extrapolate, linearity_error, measure_step

ARCH = Arch(hidden=512, layers=3, heads=4, kv_heads=2, head_dim=128, intermediate=1536, vocab=1024, tied=False)
W, MB, SEQ = 4, 2, 256


def _measure(layers: int, checkpointing: bool, mode: str = "bf16"):
    from flows.plan.measured import hf_config

    torch.set_num_threads(1)
    return measure_step(
        hf_config(ARCH),
        layers=layers,
        world_size=W,
        mode=mode,
        micro_batch_size=MB,
        seq_len=SEQ,
        activation_checkpointing=checkpointing,
    )


@pytest.fixture(scope="module")
def runs():
    runs = {(L, ac): _measure(L, ac) for L in (2, 3) for ac in (False, True)}
    runs.update({(L, True): _measure(L, True) for L in (4, 5)})
    return runs


def test_parameters_gradients_and_adamw_state_are_the_hand_computed_bytes(runs):
    for (layers, _), m in runs.items():
        p = total_params(Arch(**{**ARCH.__dict__, "layers": layers}))
        tensors = 2 + layers * 11 + 1  # embeddings, lm_head; 7 linears + 4 norms a block; the final norm
        after = m.phases["after step"]
        assert after["Sharded Param"] == 4 * p // W and after["Sharded Grad"] == 4 * p // W
        assert after["OptState"] == 8 * p // W + 4 * tensors
        assert m.phases["optimizer"]["OptState"] == 12 * p // W + 4 * tensors
        assert m.sync_bytes == 2 * max(ARCH.vocab, ARCH.intermediate) * ARCH.hidden  # the largest parameter, bf16


def test_stored_activations_per_layer_against_the_analytic_estimate(runs):
    tokens, h = MB * SEQ, ARCH.hidden
    for ac, analytic, (lo, hi) in ((True, tokens * h * 2, (1.0, 1.0)), (False, tokens * 34 * h * 2, (0.8, 1.0))):
        per_layer = runs[(3, ac)].phases["forward"]["Activation"] - runs[(2, ac)].phases["forward"]["Activation"]
        assert lo <= per_layer / analytic <= hi, (ac, per_layer / analytic)


def test_depth_extrapolation_is_linear_per_kind(runs):
    a, b = runs[(2, True)], runs[(3, True)]
    assert extrapolate(a, b, 3).phases == b.phases and extrapolate(a, b, 2).phases == a.phases
    four = extrapolate(a, b, 4)
    step = b.phases["after step"]["OptState"] - a.phases["after step"]["OptState"]
    assert four.phases["after step"]["OptState"] == b.phases["after step"]["OptState"] + step
    with pytest.raises(ValueError, match="two different depths"):
        extrapolate(a, a, 5)


def test_the_plans_depths_fit_a_third_depth_and_two_layers_do_not(runs):
    """The plan extrapolates from DEPTHS and checks at CHECK_DEPTH: exact on the line. At 2 layers the
    backward's peak falls where no block is prefetched, so a fit through 2 and 3 layers overshoots."""
    from flows.plan.measured import CHECK_DEPTH, DEPTHS

    assert min(DEPTHS) >= 3
    fit = [runs[(d, True)] for d in (*DEPTHS, CHECK_DEPTH)]
    assert linearity_error(*fit) < 1e-9
    assert linearity_error(runs[(2, True)], runs[(3, True)], runs[(5, True)]) > 0.02


def test_each_phase_peak_is_the_largest_total_any_op_of_that_phase_saw(monkeypatch):
    """The backward's peak is the tracker's running peak restarted at the backward's start: it must be the
    largest total after any backward op (a restart at twice the usage hid every backward peak below that)."""
    from torch.distributed._tools import fsdp2_mem_tracker as fmt

    seen = {"forward": 0, "backward": 0}
    dispatch = fmt.FSDPMemTracker.__torch_dispatch__

    def spy(self, func, types, args=(), kwargs=None):
        out = dispatch(self, func, types, args, kwargs)
        total = max((v for d in self._curr_mem_snap.values() for k, v in d.items() if str(k) == "Total"), default=0)
        if self._mod_tracker.is_bw:
            seen["backward"] = max(seen["backward"], total)
        elif not seen["backward"]:  # the forward: every op before the backward's first
            seen["forward"] = max(seen["forward"], total)
        return out

    monkeypatch.setattr(fmt.FSDPMemTracker, "__torch_dispatch__", spy)
    from flows.plan.measured import hf_config

    wide_vocab = Arch(**{**ARCH.__dict__, "vocab": 65536})  # a preset's proportions: logits dominate the backward
    m = measure_step(
        hf_config(wide_vocab),
        layers=3,
        world_size=W,
        mode="bf16",
        micro_batch_size=1,
        seq_len=16384,
        activation_checkpointing=True,
    )
    assert m.total("forward") == seen["forward"] and m.total("backward") == seen["backward"]


def test_the_plans_forward_and_backward_hold_the_adamw_state_of_the_steps_before():
    """The tracked step is a run's first (no AdamW state before its update); from the second step on the
    state is resident through the forward and backward, and the plan's train phase counts it."""
    from flows.plan.measured import measured_plan
    from tests.conftest import micro_config

    cfg = micro_config()
    plan = measured_plan(cfg, gpus=2, gpu_memory_gib=80)
    state = plan.resident_gib - plan.train["optimizer"]["Sharded Param"]  # AdamW state after a step
    assert state > 0 and len(plan.depths) == 1  # the micro model is measured whole
    for ph in ("forward", "backward"):
        assert plan.train[ph]["OptState"] == pytest.approx(state, rel=1e-12)
    peak = max(sum(k.values()) for k in plan.train.values())
    assert plan.phases["train step (measured peak + sleeping engine)"] == pytest.approx(peak, rel=1e-12)
