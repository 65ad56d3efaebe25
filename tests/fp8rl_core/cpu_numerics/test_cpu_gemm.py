"""BF16 GEMM numerics through FP32 GEMMs on CPU (fp8rl_core.cpu_numerics.cpu_gemm, ``precision.cpu_bf16_gemm``).

The reference is written out by hand: BF16 operands, an FP32 product, one rounding of
the output to BF16 -- and, in the backward, one rounding of every gradient to BF16.
PyTorch's own BF16 kernel (the ``native`` setting) must agree to BF16 resolution.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3ForCausalLM  # noqa: E402  (after precision: quiet torchao)

from flows.campaign.configuration import ConfigError, load_config
from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm, mm
from fp8rl_core.precision.autocast import autocast_context
from fp8rl_core.precision.conversion import convert_for_training
from fp8rl_core.tasks.tiny_config import tiny_qwen3_config

BF16_EPS = 2.0**-8  # relative spacing of BF16 (8 significand bits)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.bfloat16).float()


def _operands(m=96, k=64, n=48):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(m, k, generator=g).requires_grad_(),
        torch.randn(n, k, generator=g).requires_grad_(),
        torch.randn(n, generator=g).requires_grad_(),
        torch.randn(m, n, generator=g).to(torch.bfloat16),
    )


def test_linear_under_autocast_is_the_hand_written_rule_forward_and_backward():
    x, w, b, gy = _operands()
    with cpu_bf16_gemm("fp32") as mode, torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.linear(x, w, b)
    y.backward(gy)
    assert mode.calls == 1 and y.dtype == torch.bfloat16  # the dtype autocast gives
    ref = (_bf16(x) @ _bf16(w).t() + _bf16(b)).to(torch.bfloat16)
    assert torch.equal(y, ref)
    # gradients: FP32 GEMMs of the BF16 values, each rounded once to BF16 (as the BF16 kernel outputs)
    g = gy.float()
    assert torch.equal(x.grad, (g @ _bf16(w)).to(torch.bfloat16).float())
    assert torch.equal(w.grad, (g.t() @ _bf16(x)).to(torch.bfloat16).float())
    assert x.grad.dtype == torch.float32  # master tensors keep their dtype


def test_agrees_with_the_native_bf16_kernel_to_bf16_resolution():
    x, w, b, gy = _operands()
    outs = {}
    for kind in ("native", "fp32"):
        for t in (x, w, b):
            t.grad = None
        with cpu_bf16_gemm(kind), torch.autocast("cpu", dtype=torch.bfloat16):
            y = F.linear(x, w, b)
        y.backward(gy)
        outs[kind] = (y.float(), x.grad.clone(), w.grad.clone())
    for nat, emu in zip(outs["native"], outs["fp32"]):
        scale = nat.abs().max()
        err = (nat - emu).abs().max() / scale
        assert err <= 2 * BF16_EPS, float(err)  # one output rounding apart at most (accumulation order only)


def test_explicit_bf16_gemms_are_taken_fp32_ones_left_alone():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 16, generator=g), torch.randn(16, 8, generator=g)
    with cpu_bf16_gemm("fp32") as mode:
        plain = torch.mm(a, b)  # FP32 outside autocast: untouched, bit for bit
        assert mode.calls == 0 and torch.equal(plain, a @ b)
        low = torch.mm(a.bfloat16(), b.bfloat16())
        assert mode.calls == 1 and low.dtype == torch.bfloat16
        assert torch.equal(low, (_bf16(a) @ _bf16(b)).to(torch.bfloat16))
        assert torch.equal(mm(a.bfloat16(), b.bfloat16()), low)  # the helper of the emulated linears
    # outside the context the helper is torch.mm (PyTorch's BF16 kernel)
    assert torch.equal(mm(a.bfloat16(), b.bfloat16()), torch.mm(a.bfloat16(), b.bfloat16()))


def test_native_and_cuda_are_no_ops_and_bad_values_are_refused():
    with cpu_bf16_gemm("native") as mode:
        assert mode is None
    with cpu_bf16_gemm("fp32", "cuda") as mode:  # a GPU's BF16 GEMMs are the hardware's
        assert mode is None
    with pytest.raises(ValueError, match="cpu_bf16_gemm"):
        with cpu_bf16_gemm("fast"):
            pass
    with pytest.raises(ConfigError, match="cpu_bf16_gemm"):
        load_config(overrides=["precision.cpu_bf16_gemm=fast"])


def _tiny_qwen() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = tiny_qwen3_config(vocab_size=32, max_position_embeddings=64, bos_token_id=None, eos_token_id=None)
    return Qwen3ForCausalLM(cfg)


def _step(train: str, kind: str):
    ids = torch.randint(1, 32, (4, 32), generator=torch.Generator().manual_seed(2))
    model = _tiny_qwen()
    convert_for_training(model, train, emulate=True)
    with cpu_bf16_gemm(kind) as mode:
        with autocast_context(train):
            logits = model(ids).logits
        logits.float().logsumexp(-1).mean().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return logits.float().detach(), grads, mode


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("train", ["bf16", "fp8_tensorwise", "nvfp4"])
def test_a_model_step_takes_every_gemm_and_stays_at_bf16_resolution(train):
    """Every linear and attention GEMM of the forward is taken (the emulated FP8/FP4 linears'
    GEMMs through ``mm``). In BF16 the logits and gradients match the native kernels to BF16
    resolution. In FP8/FP4 no elementwise bound holds -- a one-ulp BF16 difference moves a
    value across an FP8/FP4 rounding boundary now and then, as a GPU's own accumulation order
    would -- so the check is that the format's noise against the BF16 model keeps its size."""
    ln, gn, _ = _step(train, "native")
    le, ge, mode = _step(train, "fp32")
    if train == "bf16":  # 2 layers x 7 linears + lm_head + 2 attentions
        assert mode.calls == 2 * 7 + 1 + 2
        assert _rel(le, ln) < 4 * BF16_EPS and _rel(ge, gn) < 4 * BF16_EPS
        return
    assert mode.calls == 1 + 2  # lm_head and attention; the converted linears go through mm
    # the format's noise against the BF16 model is the same size under either GEMM
    lb, gb, _ = _step("bf16", "native")
    for emu, nat, ref in ((le, ln, lb), (ge, gn, gb)):
        assert 0.75 < _rel(emu, ref) / _rel(nat, ref) < 1.33, (_rel(emu, ref), _rel(nat, ref))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_stage_of_a_campaign_runs_under_the_fp32_gemms(tmp_path, monkeypatch):
    """A micro campaign (in process, Prefect and all) with ``cpu_bf16_gemm: fp32``: every stage
    runs with the mode on its thread (a torch-function mode is thread-local: a stage on a
    Prefect worker thread would silently fall back to the slow kernels), and the mode is gone
    afterwards."""
    import contextlib

    from conftest import micro_config
    from torch.overrides import _get_current_function_mode_stack

    import storage.faults as faults
    from flows.campaign.configuration import dump_config
    from flows.campaign.flow import campaign_flow
    from fp8rl_core.cpu_numerics import cpu_gemm
    from storage.run.layout import create_run

    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "600")
    create_run(tmp_path, "run", config=dump_config(micro_config("steps=1", "precision.cpu_bf16_gemm=fp32")))
    seen: list[tuple[str, int, bool, bool]] = []
    real_scope = faults.stage_scope

    @contextlib.contextmanager
    def spy(stage: str, step: int):
        modes = _get_current_function_mode_stack()
        seen.append((stage, step, any(isinstance(m, cpu_gemm.Bf16GemmsInFp32) for m in modes), cpu_gemm._OPEN[0] == 1))
        with real_scope(stage, step):
            yield

    monkeypatch.setattr(faults, "stage_scope", spy)
    assert campaign_flow(str(tmp_path / "run"))["last_step"] == 1
    stages = {s for s, *_ in seen}
    assert {"rollout", "score", "train", "evaluate"} <= stages, stages
    assert all(mode and opened for _, _, mode, opened in seen), [s for s in seen if not (s[2] and s[3])]
    assert not _get_current_function_mode_stack() and cpu_gemm._OPEN[0] == 0
