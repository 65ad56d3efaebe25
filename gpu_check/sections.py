"""What each section of the GPU check measures (``gpu_check/main.py`` runs them under their budgets).

1. :func:`section_throughput`: forward + backward time of a few decoder layers of Qwen3-8B, Qwen3-14B and
   Qwen2.5-32B (shapes from their published configs, random weights), BF16 against torchao's float8 recipes.
2. :func:`section_sqnr`: one decoder layer's forward with the real FP8 kernels against the project's CPU
   emulation, SQNR in dB.
3. :func:`section_rollout`: teacher-forced log-probs of a Qwen3-8B-shaped policy in BF16, with torchao's FP8
   inference kernels, with vLLM's ``fp8_per_tensor`` scheme on ``torch._scaled_mm`` and with its emulation.
4. :func:`section_train_step`: the sharded trainer's step (``gpu_check/train_step.py``).
5. :func:`section_vllm`: one colocated vLLM cycle (``gpu_check/vllm_cycle.py``).

Every section takes its deadline and prints through :func:`emit`; ``gpu_check/cpu_mode.py`` calls sections 1-3
at tiny shapes with emulated kernels.
"""

from __future__ import annotations

import time
from typing import Callable

from gpu_check.settings import blockwise_missing

# Decoder shapes from the models' published config.json files.
MODELS: dict[str, dict] = {
    "Qwen3-8B": dict(
        arch="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "Qwen3-14B": dict(
        arch="qwen3",
        hidden_size=5120,
        intermediate_size=17408,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "Qwen2.5-32B": dict(
        arch="qwen2",
        hidden_size=5120,
        intermediate_size=27648,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
    ),
}
TOKENS = (8192, 16384)
RECIPES = ("fp8_tensorwise", "fp8_rowwise", "fp8_blockwise")



def emit(line: str) -> None:
    print(line, flush=True)



def sqnr_db(ref, x) -> float:
    """10 log10(|ref|^2 / |ref - x|^2) in dB (inf when equal)."""
    import math

    ref, x = ref.double(), x.double()
    noise = (ref - x).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


def model_config(name: str, *, layers: int, vocab: int = 1024):
    """A transformers config of ``name``'s decoder shape with ``layers`` layers and a small vocabulary."""
    from transformers import Qwen2Config, Qwen3Config

    spec = dict(MODELS[name])
    arch = spec.pop("arch")
    common = dict(num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=32768, tie_word_embeddings=False)
    if arch == "qwen3":
        return Qwen3Config(**spec, **common)
    spec.pop("head_dim")
    return Qwen2Config(**spec, **common)


def build(config, device):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.train()


def time_train_step(model, tokens: int, *, iters: int, warmup: int) -> float:
    """Median seconds of forward + backward of the decoder layers (embeddings and head excluded)."""
    import torch

    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = torch.randn(1, tokens, model.config.hidden_size, device=device)
    times = []
    for i in range(warmup + iters):
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            h = model.model(inputs_embeds=x).last_hidden_state
        h.float().pow(2).mean().backward()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2]


def section_throughput(
    deadline: float,
    *,
    layers: int = 2,
    iters: int = 4,
    warmup: int = 2,
    models=None,
    tokens_list=TOKENS,
    device: str = "cuda",
    convert: Callable | None = None,
) -> None:
    """``convert(model, mode)``: the FP8 conversion (default: real kernels only, no emulation)."""
    from gpu_check.phases import phase

    with phase("import", emit):
        import torch

        from fp8rl_core.precision.conversion import convert_for_training

    real = convert is None
    convert = convert or (lambda model, mode: convert_for_training(model, mode, emulate=False))
    emit(f"[1] train step, {layers} decoder layers, eager, time(bf16) / time(fp8): >1 = FP8 faster")
    lacking = blockwise_missing() if real else None
    if lacking:
        emit(f"    fp8_blockwise: SKIP - {lacking}")
    for name in models or MODELS:
        for tokens in tokens_list:
            if time.monotonic() > deadline:
                emit("    (time budget reached; remaining shapes skipped)")
                return
            cells, base = [], None
            for mode in ("bf16", *RECIPES):
                if mode == "fp8_blockwise" and lacking:
                    continue
                torch.manual_seed(0)
                config = models[name] if isinstance(models, dict) else model_config(name, layers=layers)
                model = build(config, device)
                try:
                    with phase(f"{name} {tokens} tokens {mode}", None):  # the cell's line says its time
                        report = convert(model, mode) if mode != "bf16" else None
                        t = time_train_step(model, tokens, iters=iters, warmup=warmup)
                    if mode == "bf16":
                        base = t
                        cells.append(f"bf16 {t * 1e3:.0f} ms")
                    else:
                        skipped = f" ({len(report.skipped)} kept bf16)" if report.skipped else ""
                        cells.append(f"{mode.removeprefix('fp8_')} {base / t:.2f}x{skipped}")
                except Exception as err:  # one failing recipe must not hide the others
                    cells.append(f"{mode.removeprefix('fp8_')} FAILED ({type(err).__name__}: {str(err)[:80]})")
                finally:
                    del model
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
            emit(f"    {name:12s} {tokens:6d} tokens: " + " | ".join(cells))


def section_sqnr(
    deadline: float = float("inf"),
    tokens: int = 512,
    *,
    config=None,
    real_device: str = "cuda",
    convert_real: Callable | None = None,
    label: str = "Qwen3-8B",
) -> None:
    """``convert_real(model, mode)``: the "real" side's conversion (default: real kernels, no emulation),
    on ``real_device``; the other side is always the project's emulation on the CPU."""
    from gpu_check.phases import phase

    with phase("import", emit):
        import torch

        from fp8rl_core.precision.conversion import convert_for_training

    lacking = blockwise_missing() if convert_real is None else None
    convert_real = convert_real or (lambda model, mode: convert_for_training(model, mode, emulate=False))
    emit(
        f"[2] one forward of a {label} decoder layer ({tokens} tokens): real FP8 kernels (GPU) vs CPU emulation, "
        f"SQNR dB"
    )
    torch.manual_seed(0)
    config = config or model_config("Qwen3-8B", layers=1)
    x = torch.randn(1, tokens, config.hidden_size)
    ref_model = build(config, "cpu").eval()
    state = ref_model.state_dict()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = ref_model.model(inputs_embeds=x).last_hidden_state.float()
    for mode in RECIPES:
        if time.monotonic() > deadline:
            emit(f"    {mode}: skipped (section budget reached)")
            continue
        if mode == "fp8_blockwise" and lacking:
            emit(f"    {mode}: SKIP - {lacking}")
            continue
        real = build(config, real_device).eval()
        real.load_state_dict(state)
        emu = build(config, "cpu").eval()
        emu.load_state_dict(state)
        try:
            with phase(mode, None):
                convert_real(real, mode)
                convert_for_training(emu, mode, emulate=True)
            with torch.no_grad(), phase(f"{mode} forward", None):
                with torch.autocast(real_device, dtype=torch.bfloat16):
                    y_real = real.model(inputs_embeds=x.to(real_device)).last_hidden_state.float().cpu()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y_emu = emu.model(inputs_embeds=x).last_hidden_state.float()
            emit(
                f"    {mode.removeprefix('fp8_'):10s} real vs emulation {sqnr_db(y_real, y_emu):6.1f} dB | "
                f"real vs bf16 {sqnr_db(ref, y_real):5.1f} dB | emulation vs bf16 {sqnr_db(ref, y_emu):5.1f} dB"
            )
        except Exception as err:
            emit(f"    {mode}: FAILED ({type(err).__name__}: {str(err)[:100]})")
        finally:
            del real, emu
            torch.cuda.empty_cache()


def section_rollout(
    seqs: int = 4, length: int = 256, *, config=None, device: str = "cuda", label: str = "Qwen3-8B"
) -> None:
    from gpu_check.phases import phase

    with phase("import", emit):
        import copy

        import torch

        from fp8rl_core.precision.rollout import convert_for_rollout

    config = config or model_config("Qwen3-8B", layers=2, vocab=32768)
    emit(
        f"[3] rollout numerics, {label}-shaped policy ({config.num_hidden_layers} layers, vocab {config.vocab_size}), "
        f"teacher-forced log-probs of {seqs}x{length} tokens"
    )
    torch.manual_seed(0)
    base = build(config, device).eval()
    ids = torch.randint(0, config.vocab_size, (seqs, length), device=device)

    def logp(model, autocast=True):
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids).logits.float().log_softmax(-1)
        return out[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # log-prob of each next token

    with phase("bf16 forward", emit):
        results = {"bf16": logp(copy.deepcopy(base).to(torch.bfloat16), autocast=False)}
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

        # torchao pairs granularities: per-tensor = per-tensor activations too; per-row = per-token x per-row weights
        for label, gran in (("torchao per-tensor", PerTensor()), ("torchao per-row", PerRow())):
            m = copy.deepcopy(base).to(torch.bfloat16)
            quantize_(m.model, Float8DynamicActivationFloat8WeightConfig(granularity=gran))
            results[label] = logp(m, autocast=False)
            del m
    except Exception as err:
        emit(f"    torchao FP8 inference: FAILED ({type(err).__name__}: {str(err)[:100]})")
    results["emulated fp8_per_tensor (vLLM fused scales)"] = logp(
        convert_for_rollout(base, "fp8_per_tensor", dtype=torch.bfloat16)
    )
    from gpu_check.rollout_kernels import use_scaled_mm

    real = convert_for_rollout(base, "fp8_per_tensor", dtype=torch.bfloat16)
    use_scaled_mm(real)
    results["real _scaled_mm, vLLM's fp8_per_tensor scheme"] = logp(real)
    del real
    results["emulated fp8_per_block"] = logp(convert_for_rollout(base, "fp8_per_block", dtype=torch.bfloat16))
    ref = results["bf16"]
    for label, lp in results.items():
        if label != "bf16":
            emit(f"    {label:45s} mean |dlogp| vs bf16 {(lp - ref).abs().mean().item():.4f}")
    emu = results["emulated fp8_per_tensor (vLLM fused scales)"]
    gap = (results["real _scaled_mm, vLLM's fp8_per_tensor scheme"] - emu).abs().mean().item()
    emit(f"    real kernel vs emulation, same scheme: mean |dlogp| {gap:.5f}")


def section_train_step(deadline: float) -> None:
    from gpu_check.train_step import run

    emit("[4] sharded trainer step (gpu_check/train_step.py)")
    run(emit, deadline=deadline)


def section_vllm(deadline: float) -> None:
    """One colocated rollout -> train -> sync -> rollout cycle on a real vLLM (SKIP where ``import vllm`` fails)."""
    from gpu_check.vllm_cycle import run

    run(emit)
