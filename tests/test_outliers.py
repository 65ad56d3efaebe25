"""``model.outliers``: activation outliers that leave a BF16 forward's bits alone and cost FP8 precision."""

from __future__ import annotations

import copy

import pytest
import torch

from fp8rl_core.precision.outliers import inject_outliers, outlier_channels

pytestmark = pytest.mark.timeout(120)


def _tiny():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=32, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg).float().eval()


def _logprobs(model, mode: str) -> torch.Tensor:
    from fp8rl_core.precision.conversion import convert_for_training
    from stages.trainer.forward import policy_logprobs

    model = copy.deepcopy(model)
    if mode != "bf16":
        convert_for_training(model, mode, emulate=True)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        lp, _ = policy_logprobs(model, ids, torch.ones_like(ids), mode=mode)
    return lp


def test_bf16_computes_the_same_bits_and_per_tensor_fp8_loses_precision():
    plain = _tiny()
    spiked = copy.deepcopy(plain)
    chosen = inject_outliers(spiked, channels=4, log2_scale=16, seed=0)
    assert chosen == outlier_channels(128, 4, 0) and len(set(chosen)) == 4
    norm = spiked.model.layers[1].input_layernorm.weight
    assert torch.equal(norm[chosen], 2**16 * plain.model.layers[1].input_layernorm.weight[chosen])
    ref = _logprobs(plain, "bf16")
    assert torch.equal(_logprobs(spiked, "bf16"), ref)  # powers of two: exact in bf16
    err = {name: (_logprobs(m, "fp8_tensorwise") - ref).abs().mean().item() for name, m in (("plain", plain),
                                                                                         ("spiked", spiked))}
    assert err["spiked"] > 2 * err["plain"], err  # the outlier channels set the per-tensor scales (0.060 vs 0.013)
    assert inject_outliers(copy.deepcopy(plain), channels=0, log2_scale=6, seed=0) == []


def test_the_setting_is_checked_and_leaves_the_bootstrap_alone():
    from flows.configuration import ConfigError
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
