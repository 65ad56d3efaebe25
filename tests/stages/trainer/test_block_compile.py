"""``precision.compile``: torch.compile per decoder block where torchao's float8 recipes expect it.

The decision (auto: CUDA with torchao's ``Float8Linear`` only), the compiled path on
the CPU with a counting backend (every block compiled in place, one graph for all
blocks, values and gradients bit-equal to eager, activation checkpointing on), and a
run stating its choice in ``run.json`` and its console line.
"""

from __future__ import annotations

import json

import pytest
import torch

from fp8rl_core.precision.bf16_pass import enable_activation_checkpointing, recompute_like_forward
from stages.trainer.block_compile import compile_choice, compile_decoder_blocks, is_compiled

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize(
    "setting, device, backend, enabled",
    [
        ("auto", CUDA, "torchao", True),  # tensorwise / rowwise Float8Linear on a GPU
        ("auto", CUDA, "torchao-blockwise", False),
        ("auto", CUDA, "fp8rl-emulated", False),
        ("auto", CUDA, "none", False),
        ("auto", CPU, "torchao", False),  # eager stays the default on the CPU
        ("auto", CPU, "fp8rl-emulated", False),
        ("on", CPU, "fp8rl-emulated", True),
        ("off", CUDA, "torchao", False),
    ],
)
def test_compile_choice(setting, device, backend, enabled):
    choice = compile_choice(setting, device, backend)
    assert choice.enabled is enabled and choice.setting == setting and choice.reason
    assert ("torch.compile per decoder block" in choice.line()) is enabled


def test_a_bad_setting_is_refused_by_the_decision_and_the_config():
    from flows.campaign.configuration import ConfigError
    from tests.conftest import micro_config

    with pytest.raises(ValueError, match="precision.compile"):
        compile_choice("sometimes", CPU, "torchao")
    with pytest.raises(ConfigError):
        micro_config("precision.compile=sometimes")
    assert micro_config().precision.compile == "auto"
    assert micro_config("precision.compile=on").precision.compile == "on"  # YAML's bare on/off are bools
    assert micro_config("precision.compile=off").precision.compile == "off"


def _tiny_qwen3(layers: int):
    from transformers import Qwen3ForCausalLM

    from fp8rl_core.tasks.tiny_config import tiny_qwen3_config

    torch.manual_seed(0)
    cfg = tiny_qwen3_config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = Qwen3ForCausalLM(cfg).float().train()
    enable_activation_checkpointing(model)
    recompute_like_forward(model)  # one process: recompute on the bf16 casts, as open_run sets it
    return model


def test_every_block_is_compiled_in_place_one_graph_serves_all_and_values_are_unchanged():
    from stages.trainer.forward import ForwardSpec, policy_logprobs

    model = _tiny_qwen3(4)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[1, 20:] = 0

    def step():
        lp, _ = policy_logprobs(model, ids, am, ForwardSpec("bf16"))  # the trainer's forward: bf16 casts of the masters
        lp.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return lp.detach(), grads

    names = [n for n, _ in model.named_parameters()]
    ref_lp, ref_grads = step()
    graphs = []

    def counting_backend(gm, example_inputs):  # runs the captured graph as it is
        graphs.append(gm)
        return gm.forward

    assert compile_decoder_blocks(model, backend=counting_backend) == 4
    assert all(is_compiled(b) for b in model.model.layers) and not is_compiled(model)
    lp, grads = step()
    assert len(graphs) == 1  # the blocks share one compiled frame: no recompilation per block
    assert torch.equal(lp, ref_lp) and all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    assert [n for n, _ in model.named_parameters()] == names  # in place: no _orig_mod. prefix anywhere
    step()
    assert len(graphs) == 1


def test_a_run_states_its_compile_choice_and_compiles_when_asked(tmp_path, capsys):
    from fp8rl_core.precision.layers import precision_line
    from tests.conftest import micro_config, open_micro_run

    cfg = micro_config("precision.train=fp8_rowwise", "precision.compile=on")
    env, state = open_micro_run(tmp_path, cfg)
    env.close()
    lp = json.loads((tmp_path / "r" / "run.json").read_text())["layer_precision"]
    assert lp["compile"] == {"setting": "on", "enabled": True, "reason": "asked for"}
    assert all(is_compiled(b) for b in state.policy.model.layers)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("precision fp8_rowwise")]
    assert lines == [precision_line(lp)] and "decoder blocks torch.compile per block (precision.compile on" in lines[0]


def test_fp8rl_plan_states_the_gpu_compile_choice_of_the_preset():
    from flows.campaign.configuration import load_config
    from flows.plan.measured import plan_precision_line
    from stages.trainer.block_compile import gpu_backend

    assert [gpu_backend(m) for m in ("bf16", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "nvfp4")] == [
        "none",
        "torchao",
        "torchao",
        "torchao-blockwise",
        "fp8rl-emulated-fp4",
    ]
    line = plan_precision_line(load_config("qwen3-8b-grpo-deepscaler"))  # fp8_blockwise
    assert line.endswith(
        "decoder blocks eager (precision.compile auto: torchao's blockwise prototype quantizes "
        "in Triton kernels of its own, not custom ops torch.compile can trace)"
    )
    line = plan_precision_line(load_config("qwen3-8b-grpo-deepscaler", ["precision.train=fp8_rowwise"]))
    assert "decoder blocks torch.compile per block (precision.compile auto: backend torchao on CUDA" in line


def test_compile_on_with_a_cpu_gemm_mode_is_one_line_before_anything_runs(capsys):
    """The portable and fp32 CPU GEMMs are torch-function modes dynamo cannot build guards for: a
    2-rank campaign with ``precision.compile: on`` failed at its first compiled forward on every rank."""
    import typer

    from flows.commands.run import _check_compile_numerics
    from tests.conftest import micro_config

    for gemm in ("portable", "fp32"):
        with pytest.raises(typer.Exit) as err:
            _check_compile_numerics(micro_config("precision.compile=on", f"precision.cpu_bf16_gemm={gemm}"))
        assert err.value.exit_code == 2
        line = capsys.readouterr().err.strip()
        assert f"precision.cpu_bf16_gemm {gemm} on the CPU" in line and "\n" not in line
    _check_compile_numerics(micro_config("precision.compile=on", "precision.cpu_bf16_gemm=native"))
    _check_compile_numerics(micro_config())  # auto: never compiled on the CPU
