"""GPU check, trainer part: one full train step on CUDA with torchao's real FP8 kernels.

``run(emit)`` is called by the project's one GPU script (``make gpu-check``,
``gpu_check/main.py``); ``emit(line)`` prints a line. On a CUDA machine it

1. builds a random-init Qwen3 of ~0.5B parameters (hidden 1024, 24 layers,
   GQA 16/8, MLP 3072, vocabulary 151,936; ``transformers.Qwen3ForCausalLM``),
   1 rank, on the GPU;
2. for tensorwise and rowwise (torchao ``Float8Linear``, SM89+) and blockwise
   (torchao's blockwise prototype, SM90): converts a fresh copy with
   ``precision.emulate: false`` (no silent emulation), compiles each decoder
   block as ``precision.compile: auto`` does on CUDA (tensorwise and rowwise:
   torch.compile per block, the path torchao measures its recipes on;
   blockwise: eager; :mod:`stages.trainer.block_compile`), runs one full
   ``policy_update`` with the BF16 shadow pass on a padded batch (the kernel
   token contracts hold: strict shape checks on), then a calibration on the
   step's r8/r16, and prints loss, grad norm, the calibrated (L, H), seconds;
3. compares per-token log-probs of the real kernels with our CPU emulation's
   numerics run on the same GPU tensors (``backend="emulated"``): mean and max
   |Δ logp| over response tokens.

Imports: torch, transformers, torchao (the carried wheel) and this checkout;
no pydantic (the GPU machine has none): the step's config is the shipped
``step_config.json`` (:mod:`gpu_check.step_config`), and the trainer's numerics
import their config types for annotations only. Without CUDA it prints one line
saying so and returns. Nothing here has run on a GPU yet (no GPU in the
sessions that wrote it); :func:`step_and_calibrate` runs on the CPU in the
tests, under the host/device discipline mode.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from gpu_check.shapes import QWEN3_06B

MODES = (("fp8_tensorwise", (8, 9)), ("fp8_rowwise", (8, 9)), ("fp8_blockwise", (9, 0)))


def _model(device):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**dict(QWEN3_06B, num_hidden_layers=24, max_position_embeddings=4096))  # ~0.5 B parameters
    return Qwen3ForCausalLM(cfg).to(device=device, dtype=torch.float32)


def _batch(device, n=32, p=96, r=160, vocab=150000):
    import torch

    from stages.trainer.types import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab, (n, p + r), generator=g)
    lens = torch.randint(r // 4, r + 1, (n,), generator=g)
    am = torch.zeros(n, p + r, dtype=torch.long)
    rm = torch.zeros(n, p + r)
    for i, ln in enumerate(lens.tolist()):
        am[i, : p + ln] = 1
        rm[i, p : p + ln] = 1
    return TrainBatch(
        ids * am, am, rm, -torch.rand(n, p + r, generator=g) * rm, torch.randn(n, generator=g), torch.arange(n)
    ).to(device)


def step_and_calibrate(model, optimizer, scheduler, batch, cfg) -> tuple[Any, Any, float]:
    """One full train step (π_old, BF16 shadow, update) on ``batch`` (on the policy's device), then a
    calibration on the step's r8/r16 (on the host, as the trainer's calibration stage runs it).

    Returns ``(UpdateResult, CalibrationResult, seconds)``; ``res.timings`` has the step's phases.
    """
    import torch

    from fp8rl_core.calibration.calibrated_clipping import CalibratorState, StandardClip, calibrate
    from fp8rl_core.objective.losses import importance_ratio
    from stages.trainer.update import UpdateSpec, policy_update

    a = cfg.algorithm
    sync = torch.cuda.synchronize if batch.input_ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    res = policy_update(
        model, optimizer, scheduler, batch, cfg, UpdateSpec(bounds=(1 - a.eps_low, 1 + a.eps_high), shadow=True, seed=0)
    )
    sync()
    t1 = time.perf_counter()
    m = batch.response_mask.cpu() > 0
    r8 = importance_ratio(res.logp_fp8, res.old_logp_fp8)
    r16 = importance_ratio(res.logp_bf16, res.old_logp_bf16)
    adv = batch.advantages.cpu()[:, None].expand_as(r8)
    prev = CalibratorState.initial(eps_low=a.eps_low, eps_high=a.eps_high, config=cfg.calibration)
    cal = calibrate(
        r8,
        r16,
        adv,
        m,
        standard=StandardClip(a.eps_low, a.eps_high, a.dual_clip),
        config=cfg.calibration,
        previous=prev,
    )
    res.timings["calibration_s"] = time.perf_counter() - t1
    return res, cal, t1 - t0


def compile_as_configured(model, cfg, device, report) -> Any:
    """``precision.compile`` of the shipped config (auto: torch.compile per decoder block for torchao's
    Float8Linear on CUDA, eager otherwise) applied to ``model``; returns the ``CompileChoice``."""
    from stages.trainer.block_compile import compile_choice, compile_decoder_blocks

    choice = compile_choice(cfg.precision.compile, device, report.backend)
    if choice.enabled:
        import torch

        torch._dynamo.reset()  # each mode compiles afresh: no recompile budget carried over from the last one
        compile_decoder_blocks(model)
    return choice


def real_kernels(model, mode: str):
    """Convert ``model`` for ``mode`` with real FP8 kernels only (an error where that would emulate)."""
    from fp8rl_core.precision.conversion import convert_for_training

    report = convert_for_training(model, mode, emulate=False)
    if report.emulate or report.backend == "fp8rl-emulated":
        raise RuntimeError(f"train_step {mode}: backend {report.backend} would emulate FP8 on the GPU")
    return report


def _peak(device) -> str:
    import torch

    if device.type != "cuda":
        return "peak memory not measured on CPU"
    return f"peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"


def _one_mode(emit: Callable[[str], None], mode: str, device, batch, *, build=_model, convert=real_kernels) -> None:
    """Step, calibration and kernel-vs-emulation agreement of one FP8 mode: ``build(device)`` makes the
    policy, ``convert(model, mode)`` converts it (on the GPU: real kernels, no emulation)."""
    import torch

    from gpu_check.phases import phase

    with phase(f"{mode} import", emit):
        from fp8rl_core.precision.conversion import convert_for_training
        from gpu_check.step_config import load_step_config
        from stages.trainer.forward import ForwardSpec, policy_logprobs
        from stages.trainer.optimizer import make_optimizer

    cfg = load_step_config(mode)
    with phase(f"{mode} build and convert", emit):
        model = build(device)
        report = convert(model, mode)
        choice = compile_as_configured(model, cfg, device, report)
        opt, sched = make_optimizer(model, cfg)
    with phase(f"{mode} step{' (first: compiling)' if choice.enabled else ''}", emit):
        res, cal, sec = step_and_calibrate(model, opt, sched, batch, cfg)
    t = res.timings
    emit(
        f"train_step {mode}: backend {report.backend}, {len(report.converted)} FP8 linears, "
        f"{len(report.skipped)} kept BF16, {choice.line()}; loss {res.metrics['loss']:.4f} "
        f"grad_norm {res.metrics['grad_norm']:.3f} L {cal.lower:.4f} H {cal.upper:.4f} alpha {cal.alpha:.4f}"
    )
    first = " (first step: includes compiling)" if choice.enabled else ""
    emit(
        f"train_step {mode}: step{first} {sec:.2f} s (pi_old {t['old_logp_s']:.2f}, shadow {t['shadow_s']:.2f}, "
        f"update {t['update_s']:.2f}; calibration {t['calibration_s']:.2f}), "
        f"{_peak(device)}"
    )
    with phase(f"{mode} emulation vs kernel", emit):
        emu = build(device)  # emulation vs kernel on the same weights and tokens
        emu.load_state_dict(model.state_dict())
        convert_for_training(emu, mode, emulate=True, backend="emulated")
        with torch.no_grad():
            spec = ForwardSpec(mode, micro_batch_size=8)
            lp_k, _ = policy_logprobs(model, batch.input_ids, batch.attention_mask, spec)
            lp_e, _ = policy_logprobs(emu, batch.input_ids, batch.attention_mask, spec)
    d = (lp_k - lp_e).abs()[batch.response_mask > 0]
    emit(f"train_step {mode}: emulation vs kernel |dlogp| mean {float(d.mean()):.2e} max {float(d.max()):.2e}")


def run_modes(
    emit: Callable[[str], None],
    device,
    batch,
    *,
    deadline: float = float("inf"),
    missing: Callable[[tuple[int, int]], str | None] = lambda need: None,
    **one_mode,
) -> None:
    """Every FP8 mode in order under strict kernel shape checks, while ``time.monotonic()`` is before
    ``deadline`` (a mode that would start later is printed as skipped); ``missing(capability)`` names why a
    mode cannot run here (None: it can); ``one_mode``: :func:`_one_mode`'s ``build`` and ``convert``."""
    import torch

    from fp8rl_core.precision.fp8_linear import set_strict_shapes

    prev = set_strict_shapes(True)
    try:
        for mode, need in MODES:
            why = missing(need)
            if why:
                emit(f"train_step {mode}: SKIP - {why}")
                continue
            if time.monotonic() > deadline:
                emit(f"train_step {mode}: skipped (section budget reached)")
                continue
            t0 = time.monotonic()
            try:
                _one_mode(emit, mode, device, batch, **one_mode)
            except Exception as err:  # one failing mode (a compile error, say) must not hide the others
                emit(f"train_step {mode}: FAILED ({type(err).__name__}: {str(err)[:200]})")
            emit(f"train_step {mode}: {time.monotonic() - t0:.1f} s in all")
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
    finally:
        set_strict_shapes(prev)


def run(emit: Callable[[str], None], *, deadline: float = float("inf")) -> None:
    """The section: every FP8 mode the GPU has kernels for (:func:`run_modes`)."""
    import torch

    if not torch.cuda.is_available():
        emit("train_step: SKIP - no CUDA device on this machine (nothing ran on a GPU)")
        return
    device = torch.device("cuda", torch.cuda.current_device())
    cap = torch.cuda.get_device_capability(device)
    emit(f"train_step: {torch.cuda.get_device_name(device)} SM{cap[0]}{cap[1]}, torch {torch.__version__}")

    def missing(need: tuple[int, int]) -> str | None:
        return f"needs SM{need[0]}{need[1]}+ for the real kernel" if cap < need else None

    run_modes(emit, device, _batch(device), deadline=deadline, missing=missing)
