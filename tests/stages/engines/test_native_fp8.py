"""Native FP8 transfer: the trainer quantizes on the engine's grid and the engine loads the values as sent."""

from __future__ import annotations

import copy

import pytest
import torch

from fp8rl_core.config.model import ModelConfig
from fp8rl_core.precision.fp8_linear import Fp8RolloutLinear
from fp8rl_core.precision.rollout import convert_for_rollout
from fp8rl_core.tasks.tiny_model import build_tiny_model
from stages.engines.native_fp8 import (
    load_native_fp8,
    quantize_fused,
    quantized_groups,
    stream_native_fp8_weights,
    vllm_native_fp8_options,
)

MODES = ["fp8_per_tensor", "fp8_per_block"]


@pytest.fixture(scope="module")
def trainer():
    torch.manual_seed(3)
    m = build_tiny_model(ModelConfig())
    with torch.no_grad():  # unequal ranges inside the fused layers, as trained projections have
        for layer in m.model.layers:
            layer.self_attn.k_proj.weight.mul_(3.0)
            layer.mlp.up_proj.weight.mul_(0.5)
    return m.float().eval()


def reference_fp8(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's rule written out: s = amax / 448 in float32, values fp8(w * (1 / s)), per tensor or 128 x 128 block."""
    if mode == "fp8_per_tensor":
        s = w.abs().amax() / 448.0
        return (w * (1.0 / s)).to(torch.float8_e4m3fn), s
    r, c = w.shape
    v = w.reshape(r // 128, 128, c // 128, 128)
    s = v.abs().amax(dim=(1, 3), keepdim=True) / 448.0
    return (v * (1.0 / s)).reshape(r, c).to(torch.float8_e4m3fn), s[:, 0, :, 0]


@pytest.mark.parametrize("mode", MODES)
def test_payload_is_the_engine_grid_of_the_fp32_masters(trainer, mode):
    payload = dict(stream_native_fp8_weights(trainer, mode))
    state = trainer.state_dict()
    scale = "weight_scale" if mode == "fp8_per_tensor" else "weight_scale_inv"
    for group in quantized_groups(trainer):
        fused = torch.cat([state[f"{m}.weight"] for m in group])
        values, s = reference_fp8(fused, mode)
        row = 0
        for m in group:
            sent = payload[f"{m}.weight"]
            n = sent.shape[0]
            assert sent.dtype == torch.float8_e4m3fn
            assert torch.equal(sent.view(torch.uint8), values[row : row + n].view(torch.uint8)), m
            want_s = s if mode == "fp8_per_tensor" else s[row // 128 : (row + n) // 128]
            torch.testing.assert_close(payload[f"{m}.{scale}"], want_s, rtol=2**-23, atol=0)  # 1/(1/s): an ulp
            row += n
    assert payload["model.norm.weight"].dtype == torch.bfloat16
    assert not any(k.startswith("lm_head") and "scale" in k for k in payload)  # the head stays high precision


@pytest.mark.parametrize("mode", MODES)
def test_engine_loads_what_the_trainer_emulates_bit_for_bit(trainer, mode):
    """The loaded weights equal the trainer-side native emulation's, and so does a forward with them."""
    emulated = convert_for_rollout(trainer, mode, dtype=torch.bfloat16, weight_format="native_fp8")
    torch.manual_seed(99)
    engine = convert_for_rollout(build_tiny_model(ModelConfig()).float(), mode, dtype=torch.bfloat16)
    load_native_fp8(engine, stream_native_fp8_weights(trainer, mode))
    pairs = [(n, m, dict(emulated.named_modules())[n]) for n, m in engine.named_modules()]
    fp8_pairs = [(n, a, b) for n, a, b in pairs if isinstance(a, Fp8RolloutLinear)]
    assert len(fp8_pairs) == 14
    for name, got, want in fp8_pairs:
        assert torch.equal(got.weight_values, want.weight_values), name
        assert torch.equal(got.weight_post, want.weight_post), name
    ids = torch.randint(4, trainer.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(engine(input_ids=ids).logits, emulated(input_ids=ids).logits)
    bf16_sent = convert_for_rollout(trainer, mode, dtype=torch.bfloat16)  # today's transfer: another grid
    today = [m for m in bf16_sent.modules() if isinstance(m, Fp8RolloutLinear)]
    assert any(not torch.equal(a.weight_values, b.weight_values) for (_, a, _), b in zip(fp8_pairs, today))


def test_bad_payloads_and_modes_are_refused(trainer):
    engine = convert_for_rollout(trainer, "fp8_per_tensor", dtype=torch.bfloat16)
    payload = list(stream_native_fp8_weights(trainer, "fp8_per_tensor"))
    with pytest.raises(KeyError, match="no FP8 weights"):
        load_native_fp8(engine, [(n, t) for n, t in payload if "layers.1.mlp.down_proj" not in n])
    with pytest.raises(KeyError, match="no place"):
        load_native_fp8(engine, payload + [("model.extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="whole 128-row blocks"):
        quantize_fused([torch.randn(64, 128), torch.randn(128, 128)], "fp8_per_block")
    with pytest.raises(ValueError, match="FP8 rollout mode"):
        quantize_fused([torch.randn(128, 128)], "nvfp4_w4a4")
    opts = vllm_native_fp8_options("fp8_per_block")
    assert opts["quantization"] == "fp8"
    assert opts["hf_overrides"]["quantization_config"]["weight_block_size"] == [128, 128]
    assert "weight_block_size" not in vllm_native_fp8_options("fp8_per_tensor")["hf_overrides"]["quantization_config"]


def test_payload_leaves_the_trainer_untouched(trainer):
    before = copy.deepcopy(trainer.state_dict())
    list(stream_native_fp8_weights(trainer, "fp8_per_block"))
    assert all(torch.equal(before[k], v) for k, v in trainer.state_dict().items())


def test_vllm_engine_settings_and_checkpoint_for_native_fp8(trainer, tmp_path):
    """What the vLLM engine is given: the serialized-FP8 quantization and a checkpoint holding the payload."""
    import json

    from safetensors.torch import load_file

    from fp8rl_core.config.method import PrecisionConfig
    from fp8rl_core.config.pipeline import RolloutConfig
    from stages.engines.native_fp8 import write_native_fp8_checkpoint
    from stages.engines.vllm_options import build_llm_kwargs

    def kwargs(rollout: str, weight_sync: str) -> dict:
        return build_llm_kwargs(
            RolloutConfig(weight_format="native_fp8"),
            PrecisionConfig(rollout=rollout),
            model_path="/c",
            seed=0,
            logprobs_mode="raw",
            weight_sync=weight_sync,
        )

    kw = kwargs("fp8_per_block", "tensors")
    assert kw["quantization"] == "fp8"
    assert kw["hf_overrides"]["quantization_config"]["weight_block_size"] == [128, 128]
    with pytest.raises(ValueError, match="tensors or path"):
        kwargs("fp8_per_tensor", "ipc")
    path = write_native_fp8_checkpoint(trainer, "fp8_per_tensor", tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic"}
    stored = load_file(str(path))
    payload = dict(stream_native_fp8_weights(trainer, "fp8_per_tensor"))
    assert stored.keys() == payload.keys()
    for k, v in payload.items():
        assert stored[k].dtype == v.dtype and torch.equal(stored[k].float(), v.float()), k
