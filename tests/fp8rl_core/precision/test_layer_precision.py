"""Every run states which linears train in FP8 and which stay BF16, and why.

Qwen2.5-32B has biases on q/k/v; torchao's blockwise kernels take no bias, so under
``fp8_blockwise`` 3 of the 7 linears of every block stay BF16. Checked at the
real width on the meta device (no weights) against hand-counted parameters, and on
the micro campaign: ``run.json`` records it and the console gets one line.
"""

from __future__ import annotations

import json

import pytest
import torch

from fp8rl_core.precision.conversion import convert_for_training
from fp8rl_core.precision.layers import layer_precision, precision_line


def _qwen25_32b_layers(n: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        return Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=152064,
                hidden_size=5120,
                intermediate_size=27648,
                num_hidden_layers=n,
                num_attention_heads=40,
                num_key_value_heads=8,
            )
        )


def test_blockwise_keeps_qwen25_biased_qkv_in_bf16_and_says_so():
    model = _qwen25_32b_layers(2)
    s = layer_precision(model, convert_for_training(model, "fp8_blockwise", backend="emulated"))
    h, kv, ff = 5120, 8 * 128, 27648
    qkv = (h * h + h) + 2 * (h * kv + kv)  # weights + biases of q, k, v
    rest = h * h + 3 * h * ff  # o_proj, gate/up/down
    assert (s["fp8_linears"], s["bf16_linears"]) == (2 * 4, 2 * 3)
    assert (s["fp8_params"], s["bf16_params"]) == (2 * rest, 2 * qkv)
    assert abs(s["fp8_share"] - rest / (rest + qkv)) < 1e-12 and 0.92 < s["fp8_share"] < 0.93
    (group,) = s["kept_bf16"]
    assert group["layers"] == [f"model.layers.*.self_attn.{p}_proj" for p in "qkv"] and "bias" in group["reason"]
    line = precision_line(s)
    assert "8 linears in FP8 (92.5%" in line and "6 (model.layers.*.self_attn.q_proj" in line and "lm_head" in line
    assert "\n" not in line
    model = _qwen25_32b_layers(1)  # rowwise and tensorwise take biases: every decoder linear in FP8
    s = layer_precision(model, convert_for_training(model, "fp8_rowwise", backend="emulated"))
    assert s["bf16_linears"] == 0 and s["fp8_share"] == 1.0 and "no decoder linear kept" in precision_line(s)


@pytest.mark.parametrize("mode,fmt", [("nvfp4", "NVFP4"), ("mxfp4", "MXFP4")])
def test_fp4_runs_say_fp4_not_fp8(mode, fmt):
    model = _qwen25_32b_layers(1)
    line = precision_line(layer_precision(model, convert_for_training(model, mode, backend="emulated")))
    assert f"7 linears in {fmt} (100.0%" in line and "FP8" not in line


def test_a_run_records_its_layer_precision_in_run_json_and_one_console_line(tmp_path, capsys):
    from tests.conftest import micro_config, open_micro_run

    cfg = micro_config("precision.train=fp8_blockwise")
    env, _ = open_micro_run(tmp_path, cfg)
    env.close()
    info = json.loads((tmp_path / "r" / "run.json").read_text())
    lp = info["layer_precision"]
    assert lp["mode"] == "fp8_blockwise" and lp["fp8_linears"] == 7 * cfg.model.num_layers and lp["bf16_linears"] == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("precision fp8_blockwise")]
    assert lines == [precision_line(lp)]
    assert lp["compile"]["enabled"] is False and "decoder blocks eager (precision.compile auto: cpu" in lines[0]
