"""The trainer on explicit devices, kernel shape contracts, and FSDP2 data parallelism.

* every forward of a train step (π_old, π_θ, both shadow passes) runs through the
  one log-prob path: under the BF16 autocast of its inputs' device, with position
  ids counted over real tokens (the old π_θ forward had neither the device-aware
  autocast nor position ids: this test fails on it);
* strict emulation rejects the token counts torchao's kernels reject, and every
  micro-batch the trainer builds passes;
* a 2-rank gloo run (FSDP2, 1 thread each) and a 1-process run of the same
  global batch give the same losses, grad norms and per-token log-probs, also
  when the batch is not a multiple of the mini-batch (a partial last mini-batch
  leaves one rank fewer micro-batches or none: it runs padding micro-batches, or
  the FSDP collectives deadlock).
"""

from __future__ import annotations

import pytest
import torch

from fp8rl_core.objective.logprobs import position_ids_from_mask
from fp8rl_core.precision.conversion import convert_for_training
from fp8rl_core.precision.fp8_linear import KernelShapeError, set_strict_shapes
from stages.trainer.optimizer import make_optimizer
from stages.trainer.update import UpdateSpec, policy_update
from tests.scaleout_common import rendezvous, small_batch, small_cfg, small_model, spawn_ranks

# --------------------------------------------------------------------------- one forward path


def test_every_train_forward_runs_under_its_devices_autocast_with_position_ids():
    cfg = small_cfg()
    model = small_model("fp8_rowwise")
    opt, sched = make_optimizer(model, cfg)
    batch = small_batch()
    seen = []

    def hook(mod, args, kwargs):
        ids = kwargs["input_ids"]
        dev = ids.device.type
        seen.append(
            {
                "autocast": torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) == torch.bfloat16,
                "positions": kwargs.get("position_ids") is not None
                and torch.equal(kwargs["position_ids"], position_ids_from_mask(kwargs["attention_mask"])),
                "grad": torch.is_grad_enabled(),
            }
        )

    model.register_forward_pre_hook(hook, with_kwargs=True)
    policy_update(model, opt, sched, batch, cfg, UpdateSpec(bounds=(0.8, 1.28), shadow=True, seed=0))
    # π_old: 4 micro-batches, π_old shadow: 4, per mini-batch shadow: 4, π_θ: 4 (with grad)
    assert len(seen) == 16
    assert sum(s["grad"] for s in seen) == 4
    assert all(s["autocast"] for s in seen), seen
    assert all(s["positions"] for s in seen), seen


# --------------------------------------------------------------------------- kernel shape contracts


def test_token_multiples_of_each_mode():
    from stages.trainer.forward import padded_width, token_multiple

    assert token_multiple("bf16") == 1
    assert token_multiple("fp8_tensorwise") == token_multiple("fp8_rowwise") == 16
    assert token_multiple("fp8_blockwise") == 128
    # smallest width with rows * width a multiple
    assert padded_width(4, 13, 16) == 16 and padded_width(8, 13, 16) == 14 and padded_width(3, 13, 128) == 128
    assert padded_width(16, 13, 128) == 16


@pytest.mark.parametrize(
    "mode,bad,good", [("fp8_tensorwise", 15, 16), ("fp8_rowwise", 24, 32), ("fp8_blockwise", 64, 128)]
)
def test_strict_emulation_rejects_what_the_kernel_rejects(mode, bad, good):
    """The weight-gradient matmul contracts over the tokens: torch._scaled_mm needs a multiple
    of 16, torchao's blockwise backward 128. Strict mode raises there; forward-only passes."""
    lin = torch.nn.Sequential(torch.nn.Linear(128, 128, bias=False))
    convert_for_training(lin, mode)
    prev = set_strict_shapes(True)
    try:
        with torch.no_grad():
            lin(torch.randn(bad, 128))  # forward alone: the kernels take any token count
        with pytest.raises(KernelShapeError, match=str(bad)):
            lin(torch.randn(bad, 128)).sum().backward()
        lin(torch.randn(good, 128)).sum().backward()
        set_strict_shapes(False)
        lin(torch.randn(bad, 128)).sum().backward()  # lenient emulation pads internally
    finally:
        set_strict_shapes(prev)


@pytest.mark.parametrize("mode", ["fp8_tensorwise", "fp8_blockwise"])
def test_every_micro_batch_the_trainer_builds_passes_strict_mode(mode):
    cfg = small_cfg(mode, micro_batch_size=2, ppo_mini_batch_size=4)
    model = small_model(mode)
    opt, sched = make_optimizer(model, cfg)
    prev = set_strict_shapes(True)
    try:
        res = policy_update(
            model, opt, sched, small_batch(n=16, p=5, r=4), cfg, UpdateSpec(bounds=(0.8, 1.28), shadow=True, seed=1)
        )
    finally:
        set_strict_shapes(prev)
    assert res.skipped_updates == 0 and res.metrics["updates"] == 4


def test_padding_leaves_bf16_logprobs_unchanged():
    from stages.trainer.forward import ForwardSpec, policy_logprobs

    model = small_model("bf16")
    b = small_batch(n=3)
    with torch.no_grad():
        lp, _ = policy_logprobs(model, b.input_ids, b.attention_mask, ForwardSpec("bf16"))
        # same rows through fp8_blockwise's padding rule (to 128 tokens), in the shadow (bf16) path
        ids = torch.nn.functional.pad(b.input_ids, (0, 30))
        am = torch.nn.functional.pad(b.attention_mask, (0, 30))
        lp2, _ = policy_logprobs(model, ids, am, ForwardSpec("bf16"))
    m = b.response_mask > 0
    assert torch.allclose(lp[m], lp2[:, : lp.shape[1]][m], atol=2e-2)


# --------------------------------------------------------------------------- FSDP2, 2 ranks vs 1 process


def _rank_main(
    rank: int, world: int, port: str, mode: str, steps: int, out: str, n: int = 16, kw: dict | None = None
) -> None:
    import torch.distributed as dist

    from stages.trainer.collective import DistCollective
    from stages.trainer.distributed import full_model_state, shard_policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=port, rank=rank, world_size=world)
    try:
        cfg = small_cfg(mode, **(kw or {}))
        model = shard_policy(small_model(mode))
        opt, sched = make_optimizer(model, cfg)
        results = []
        for step in range(steps):
            res = policy_update(
                model,
                opt,
                sched,
                small_batch(n=n, seed=step),
                cfg,
                UpdateSpec(bounds=(0.8, 1.28), shadow=step == 0, seed=step),
                collective=DistCollective(),
            )
            results.append(res)
        state = full_model_state(model)
        if rank == 0:
            torch.save(
                {"results": [(r.metrics, r.logp_fp8, r.old_logp_fp8, r.logp_bf16) for r in results], "state": state},
                out,
            )
    finally:
        dist.destroy_process_group()


def _one_process(mode: str, steps: int, n: int = 16, kw: dict | None = None):
    torch.set_num_threads(1)
    cfg = small_cfg(mode, **(kw or {}))
    model = small_model(mode)
    opt, sched = make_optimizer(model, cfg)
    results = [
        policy_update(
            model, opt, sched, small_batch(n=n, seed=s), cfg, UpdateSpec(bounds=(0.8, 1.28), shadow=s == 0, seed=s)
        )
        for s in range(steps)
    ]
    return [(r.metrics, r.logp_fp8, r.old_logp_fp8, r.logp_bf16) for r in results], model.state_dict()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["bf16", "fp8_rowwise", "fp8_blockwise", "fp8_tensorwise"])
def test_two_gloo_ranks_with_fsdp2_match_one_process(tmp_path, mode):
    """Same global batch and micro-batches: step 1 (index 0) is equal to float rounding of the
    gradient reduction; after 3 steps weights agree within a tolerance derived from it.

    Tolerance: per-token log-probs of step 1 come from identical inputs and identical
    (all-gathered) weights, so they are compared exactly. The gradient of a mini-batch is a
    sum of 2 micro-batch gradients in both runs (1 process: accumulation; 2 ranks:
    reduce-scatter), so it differs by at most one float32 rounding (rel 6e-8) per element;
    Adam's update divides by sqrt(v) ~ |g| which can amplify a relative change of the
    gradient into an absolute change of about lr * 1e-7 per update... we allow 1e-4 * lr
    per update on the weights and 1e-5 relative on losses/grad norms.
    """
    _two_ranks_match_one_process(tmp_path, mode)


def _two_ranks_match_one_process(tmp_path, mode: str, n: int = 16, kw: dict | None = None) -> None:
    """2 FSDP2 ranks vs 1 process, 3 steps on global batches of ``n`` rows, config ``small_cfg(mode, **kw)``
    (tolerances: see above)."""
    steps = 3
    out = str(tmp_path / "rank0.pt")
    spawn_ranks(_rank_main, (2, rendezvous(), mode, steps, out, n, kw))
    dist_res = torch.load(out, weights_only=False)
    ref, ref_state = _one_process(mode, steps, n, kw)
    (m1, lp1, old1, b1), (m2, lp2, old2, b2) = ref[0], dist_res["results"][0]
    assert torch.equal(old1, old2) and torch.equal(lp1, lp2) and torch.equal(b1, b2)
    bapo = sorted(k for k in m1 if k.startswith("bapo_"))  # BAPO: bounds of each update (global sums)
    for k in ("loss", "clipfrac", "clipfrac_lower", "ppo_kl", "entropy_mean", "n_tokens", *bapo):
        assert m1[k] == pytest.approx(m2[k], rel=1e-6, abs=1e-9), k
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    cfg = small_cfg(mode, **(kw or {}))
    lr, updates = cfg.algorithm.lr, steps * -(-n // cfg.algorithm.ppo_mini_batch_size)
    assert all(r[0]["updates"] == updates // steps for r in dist_res["results"])
    for k, v in ref_state.items():
        assert torch.allclose(v, dist_res["state"][k], rtol=0, atol=1e-4 * lr * updates + 1e-7), k


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["bf16", "fp8_rowwise"])
@pytest.mark.parametrize(
    "n,micro,calibration",
    [(19, 4, None), (17, 4, None), (6, 2, None), (3, 4, None), (17, 4, "bapo"), (3, 4, "bapo")],
    ids=[
        "2-full+3-rows",
        "2-full+1-row",
        "3-micros-2+1",
        "rank-1-owns-no-row",
        "2-full+1-row-bapo",
        "rank-1-owns-no-row-bapo",
    ],
)
def test_two_gloo_ranks_match_one_process_with_a_partial_mini_batch(tmp_path, mode, n, micro, calibration):
    """Global batch not a multiple of ppo_mini_batch_size = 8 (DAPO dynamic sampling keeps fewer rows).

    The last mini-batch is partial: 3 rows or 1 row after 2 full mini-batches (one micro-batch:
    rank 1 runs none), 6 rows in micro-batches of 2 (rank 0 runs 2, rank 1 one), or the whole
    step is 3 rows (rank 1 owns no row at all). The short rank runs padding micro-batches
    (forward and backward with loss mask 0; under BAPO also the no-grad ratio forward and the
    all-reduce of its bound sums, with zero contributions) so that the collectives match, and the result
    is the 1-process one within the tolerances above. On the trainer without padding the ranks'
    collectives do not match (2-full+1-row: hang). Full mini-batches keep 2 micro-batches, so
    each gradient is summed in the same order as in one process (with 4, (g1+g2)+(g3+g4) vs
    ((g1+g2)+g3)+g4 moves the weights by ~1e-9 and the bf16 forward amplifies it past the
    tolerance within 3 steps, padding or not).
    """
    _two_ranks_match_one_process(tmp_path, mode, n, {"micro_batch_size": micro, "calibration": calibration})


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["bf16", "fp8_rowwise"])
@pytest.mark.parametrize("n", [16, 19], ids=["full", "2-full+3-rows"])
def test_two_gloo_ranks_match_one_process_with_token_budget_micro_batches(tmp_path, mode, n):
    """``algorithm.max_tokens_per_micro_batch``: rows sorted by length, micro-batches trimmed to their own
    longest row. Budget 64 with rows of 9-13 tokens: 4 rows a micro-batch in bf16 (4 x 13 = 52), 4 x 16 = 64
    under rowwise's multiple of 16, so full mini-batches keep 2 micro-batches (the summation order of the
    tolerances above); the partial one is 3 rows. Same split on both sides, so the same results."""
    _two_ranks_match_one_process(tmp_path, mode, n, {"max_tokens_per_micro_batch": 64})


# --------------------------------------------------------------------------- devices


def test_device_setting_resolves_and_gpu_emulation_is_an_error_naming_the_layer():
    from types import SimpleNamespace

    from stages.context import check_no_silent_emulation, resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="no CUDA"):
            resolve_device("cuda")
    cfg = small_cfg("fp8_blockwise")
    report = SimpleNamespace(emulate=True, backend="fp8rl-emulated", converted=("model.layers.0.self_attn.q_proj", "x"))
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.self_attn\.q_proj.*SM90"):
        check_no_silent_emulation(cfg, torch.device("cuda"), report)
    check_no_silent_emulation(cfg, torch.device("cpu"), report)  # CPU: emulation is the point
    asked = cfg.model_copy(update={"precision": cfg.precision.model_copy(update={"emulate": True})})
    check_no_silent_emulation(asked, torch.device("cuda"), report)  # asked for explicitly


def test_gpu_presets_demand_real_kernels():
    from flows.campaign.configuration import load_config

    for name in ("qwen3-8b-grpo-deepscaler", "qwen3-14b-dapo", "qwen2.5-32b-grpo"):
        c = load_config(name)
        assert c.precision.emulate is False and c.device == "auto", name


def test_policy_and_batches_live_on_the_models_device():
    """policy_update moves the batch to the policy's device and returns CPU tensors for the tables."""
    cfg = small_cfg("bf16")
    model = small_model("bf16")
    opt, sched = make_optimizer(model, cfg)
    res = policy_update(model, opt, sched, small_batch(), cfg, UpdateSpec(bounds=(0.8, 1.28), shadow=False, seed=0))
    assert res.logp_fp8.device.type == "cpu"
    assert all(s["exp_avg"].device == p.device for p, s in opt.state.items())


# --------------------------------------------------------------------------- memory plan


@pytest.mark.parametrize(
    "preset,gpus", [("qwen3-8b-grpo-deepscaler", 8), ("qwen3-14b-dapo", 8), ("qwen2.5-32b-grpo", 32)]
)
def test_gpu_presets_fit_the_gpus_the_plan_names(preset, gpus):
    from flows.campaign.configuration import load_config
    from flows.plan.memory import memory_plan

    cfg = load_config(preset)
    assert memory_plan(cfg, gpus=gpus, gpu_memory_gib=80).fits
    assert not memory_plan(cfg, gpus=1, gpu_memory_gib=80).fits  # one GPU cannot hold the AdamW state
    off = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"activation_checkpointing": False})})
    assert not memory_plan(off, gpus=gpus, gpu_memory_gib=80).fits


def test_memory_plan_counts_qwen3_8b_parameters():
    from flows.plan.memory import ARCHITECTURES, total_params

    assert total_params(ARCHITECTURES["Qwen/Qwen3-8B"]) == pytest.approx(8.19e9, rel=0.005)  # published: 8.2B
    assert total_params(ARCHITECTURES["Qwen/Qwen2.5-32B"]) == pytest.approx(
        32.76e9, rel=0.005
    )  # published: 32.5B (rounded model card)
