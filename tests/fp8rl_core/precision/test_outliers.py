"""``model.outliers``: activation outliers that low-precision passes see, while BF16 passes keep the plain
model's bits and training sees the plain parameters."""

from __future__ import annotations

import copy

import pytest
import torch

from fp8rl_core.precision.outliers import FEEDS, inject_outliers, outlier_channels

pytestmark = pytest.mark.timeout(120)


def _tiny():
    from transformers import Qwen3ForCausalLM

    from fp8rl_core.tasks.tiny_config import tiny_qwen3_config

    torch.manual_seed(0)
    cfg = tiny_qwen3_config(
        intermediate_size=256, max_position_embeddings=32768, pad_token_id=None, bos_token_id=None, eos_token_id=None
    )
    return Qwen3ForCausalLM(cfg).float().eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(3))  # [B, T]


def _converted(model, mode: str, log2_scale: int = 0):
    """A copy of ``model`` converted for ``mode``, with 4 outlier channels x 2**log2_scale (0: none)."""
    from fp8rl_core.precision.conversion import convert_for_training

    model = copy.deepcopy(model)
    convert_for_training(model, mode, emulate=True)
    if log2_scale:
        inject_outliers(model, channels=4, log2_scale=log2_scale, seed=0)
    return model


def _logprobs(model, mode: str, *, shadow: bool = False, gemm: str = "native") -> torch.Tensor:
    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
    from stages.trainer.forward import ForwardSpec, policy_logprobs

    ids = _ids()
    with torch.no_grad(), cpu_bf16_gemm(gemm):
        lp, _ = policy_logprobs(model, ids, torch.ones_like(ids), ForwardSpec(mode, shadow=shadow))
    return lp  # [B, T-1]


def _folded(plain, log2_scale: int):
    """The lever as stored weights: each fed norm's weight times s, the projections' input columns over s."""
    model = copy.deepcopy(plain)
    idx = torch.tensor(outlier_channels(128, 4, 0))
    with torch.no_grad():
        for block in model.model.layers:
            for norm, projections in FEEDS.items():
                getattr(block, norm).weight[idx] *= 2.0**log2_scale
                for path in projections:
                    block.get_submodule(path).weight[:, idx] /= 2.0**log2_scale
    return model


def test_bf16_passes_keep_the_plain_bits_and_fp8_sees_the_outliers():
    for gemm in ("portable", "native"):  # the tiny presets' exact GEMMs, whose per-row grid an outlier coarsens
        _bits_and_noise(_tiny(), gemm)
    assert inject_outliers(_tiny(), channels=0, log2_scale=6, seed=0) == []


def _bits_and_noise(plain, gemm: str) -> None:
    ref = _logprobs(_converted(plain, "bf16"), "bf16", gemm=gemm)
    assert torch.equal(_logprobs(_converted(plain, "bf16", 16), "bf16", gemm=gemm), ref)  # BF16 training
    spiked = _converted(plain, "fp8_tensorwise", 16)
    assert torch.equal(_logprobs(spiked, "fp8_tensorwise", shadow=True, gemm=gemm), ref)  # the BF16 shadow
    fp8 = _logprobs(spiked, "fp8_tensorwise", gemm=gemm)
    err = {
        "plain": (_logprobs(_converted(plain, "fp8_tensorwise"), "fp8_tensorwise", gemm=gemm) - ref).abs().mean(),
        "spiked": (fp8 - ref).abs().mean(),
    }
    assert err["spiked"] > 2 * err["plain"], err  # the outlier channels set the per-tensor scales (0.060 vs 0.013)
    # what FP8 quantizes is the folded model's (norm weight x s, input columns / s): the same FP8 bits
    assert torch.equal(fp8, _logprobs(_converted(_folded(plain, 16), "fp8_tensorwise"), "fp8_tensorwise", gemm=gemm))


def test_training_sees_the_plain_parameters_and_gradients():
    from fp8rl_core.precision.autocast import autocast_context

    plain = _tiny()
    spiked = _converted(plain, "fp8_tensorwise", 14)
    assert spiked.state_dict().keys() == plain.state_dict().keys()  # the scale is not in a checkpoint
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in spiked.state_dict().items())
    ids = _ids()

    def grads(model):
        model.zero_grad()
        with autocast_context("fp8_tensorwise"):
            model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    g_plain, g_spiked = grads(_converted(plain, "fp8_tensorwise")), grads(spiked)
    chosen = outlier_channels(128, 4, 0)
    for name, g in g_spiked.items():
        if name.endswith(("q_proj.weight", "gate_proj.weight")):  # the outlier columns: plain size, FP8 noise
            ratio = g[:, chosen].norm() / g_plain[name][:, chosen].norm()
            assert 0.5 < ratio < 2.0, (name, ratio)  # folded into the weights it was 2**14
        if name.endswith("layernorm.weight"):
            assert torch.allclose(g, g_plain[name], rtol=0.5, atol=1e-3), name
    assert all(n not in dict(spiked.named_buffers()) for n in spiked.state_dict())


def test_the_rollout_copy_carries_the_lever():
    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
    from fp8rl_core.precision.autocast import autocast_context
    from fp8rl_core.precision.rollout import convert_for_rollout

    plain = _tiny()
    ids = _ids()

    def logits(model, rollout: str):
        copy_ = convert_for_rollout(model, rollout)
        with torch.inference_mode(), autocast_context(rollout), cpu_bf16_gemm("portable"):
            return copy_(input_ids=ids).logits.float()  # [B, T, V]

    spiked = _converted(plain, "fp8_tensorwise", 14)
    assert torch.equal(logits(spiked, "bf16"), logits(_converted(plain, "fp8_tensorwise"), "bf16"))
    fp8 = logits(spiked, "fp8_per_tensor")  # quantized as the folded model's copy quantizes (synced as W / s)
    assert torch.equal(fp8, logits(_converted(_folded(plain, 14), "fp8_tensorwise"), "fp8_per_tensor"))
    assert not torch.equal(fp8, logits(_converted(plain, "fp8_tensorwise"), "fp8_per_tensor"))


def test_the_setting_is_checked_and_leaves_the_bootstrap_alone():
    from flows.campaign.configuration import ConfigError
    from stages.bootstrap.math import NoisyTeacher, config_hash
    from tests.conftest import micro_config

    cfg = micro_config("model.outliers.channels=4")
    assert cfg.model.outliers.log2_scale == 14
    teacher = NoisyTeacher()
    assert config_hash(cfg.model, cfg.task, cfg.bootstrap, teacher) == config_hash(
        micro_config().model, cfg.task, cfg.bootstrap, teacher
    )  # put into the loaded policy: one cached bootstrap serves both
    with pytest.raises(ConfigError, match="exceeds model.hidden_size"):
        micro_config("model.outliers.channels=4096")
    with pytest.raises(ConfigError, match="rollout.engine vllm"):
        micro_config("model.outliers.channels=4", "rollout.engine=vllm")


BF16 = (
    "precision.train=bf16",
    "precision.rollout=bf16",
    "evaluation.benchmarks=[{name: synthetic, k: 2, limit: 8, max_new_tokens: 12}]",
)


TIMINGS = ("_seconds", "_s", "_per_second")  # train metrics that are wall times, not numbers of the run


def _three_bf16_steps(root, *extra: str) -> dict:
    """Steps 1-3 of the micro campaign in BF16 (train and rollout), under the CPU GEMMs a run picks:
    each step's mean reward, its train metrics, and the step-3 evaluation."""
    from conftest import StageRun, micro_config, open_micro_run

    from flows.campaign.cpu_numerics import gemm_choice
    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
    from stages.evaluate import run_evaluate
    from stages.rollout import run_rollout
    from stages.runtime.io import read_step
    from stages.score import run_score
    from stages.train import run_train

    cfg = micro_config(*BF16, *extra)
    run = StageRun(*open_micro_run(root, cfg))
    out: dict = {}
    try:
        with cpu_bf16_gemm(gemm_choice(cfg).kind):
            for step in (1, 2, 3):
                run(run_rollout, step)
                run(run_score, step)
                out[f"reward {step}"] = float(read_step(run.env, "scores", step).column("reward").to_numpy().mean())
                metrics = run(run_train, step).metrics
                out[f"train {step}"] = {k: v for k, v in metrics.items() if not k.endswith(TIMINGS)}
            out["eval 3"] = run(run_evaluate, 3).scores
    finally:
        run.close()
    return out


@pytest.mark.timeout(600)
def test_a_bf16_campaign_with_outliers_learns_as_one_without(tmp_path):
    """Tolerance zero: no BF16 pass applies the factors, so rewards, train metrics and evaluation are
    the plain campaign's to the bit (folded into the weights, the first update wrecked the policy)."""
    plain = _three_bf16_steps(tmp_path / "plain")
    spiked = _three_bf16_steps(tmp_path / "spiked", "model.outliers.channels=4")
    differ = {k: (spiked[k], plain[k]) for k in plain if spiked[k] != plain[k]}
    assert not differ, differ
