"""gpu-check's vLLM section: one colocated rollout -> train -> sync -> rollout cycle on a real vLLM.

``run(emit)`` prints ``SKIP`` with the reason where ``import vllm`` fails
(vLLM is not assumed on the GPU machine). Otherwise, on a random-init Qwen3 of
Qwen3-0.6B's shapes (~0.6 B parameters; no download):

1. the project's ``vllm`` engine is built first, in this process (BF16, sleep
   mode, ``weight_sync: tensors``), while the trainer holds nothing on the GPU;
2. the trainer's fp32 policy goes to the GPU; rollout (``generate``), sleep;
3. one train step (the trainer's BF16 forward, backward, AdamW);
4. ``load_weights``: wake the weights, stream the bf16 parameters in-process,
   release the trainer's cache, wake the KV cache; rollout again;
5. the engine's teacher-forced log-probs of fixed sequences against the
   trainer's BF16 log-probs of the new weights: the gap must be within
   :func:`stages.engines.weight_transfer.bf16_sync_tolerance` (twice the
   trainer's own BF16-vs-float32 gap on those tokens), the engine before the
   sync must be farther than that from the trainer's new log-probs (the check
   can fail), and a sync that leaves one layer (the last, by default) at its
   pre-step weights must fail it (the check catches a partial sync).

The engine runs eagerly (``enforce_eager``): no graph capture or compilation
in the check's budget; the sync, not the engine's speed, is what it checks.
Written for vLLM 0.32 on CUDA; not yet run on a GPU in this project.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

from gpu_check.shapes import QWEN3_06B

FIXED = [[1] + list(range(40, 100)), [1] + list(range(200, 230)) * 2]
# Qwen3-0.6B's depth at a narrow width: the section's code on vLLM's CPU build (``--cpu``) in minutes
NARROW_28 = dict(
    QWEN3_06B,
    hidden_size=128,
    intermediate_size=384,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=1024,
)


def _policy(folder: str, shapes: dict):
    import torch
    from transformers import Qwen3ForCausalLM

    from fp8rl_core.tasks.tiny_config import tiny_qwen3_config
    from fp8rl_core.tasks.tiny_model import build_tokenizer

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_qwen3_config(**shapes, max_position_embeddings=1024)).float()
    model.save_pretrained(folder)
    tok = build_tokenizer(folder)  # ids < 128; the engine never detokenizes
    return model, tok


def _engine(model, tok, folder: str, *, sleep: bool, memory: float):
    from fp8rl_core.config.method import PrecisionConfig
    from fp8rl_core.config.pipeline import RolloutConfig
    from stages.engines import make_engine
    from stages.engines.vllm_options import VLLMSettings

    cfg = RolloutConfig(
        engine="vllm",
        sleep_between_steps=sleep,
        sleep_level=1,
        gpu_memory_utilization=memory,
        weight_sync="tensors",
        verify_sync="first",
    )
    return make_engine(
        "vllm",
        model=model,
        tokenizer=tok,
        precision=PrecisionConfig(rollout="bf16"),
        config=cfg,
        model_path=folder,
        settings=VLLMSettings(max_model_len=512, llm_options={"enforce_eager": True}),
    )


def _trainer_logprobs(model, rows, device: str) -> tuple[list[list[float]], list[list[float]]]:
    """The trainer's log-probs of every token of ``rows`` after the first: its BF16 forward (the bf16 casts
    of the fp32 masters under autocast, as it trains) and the float32 forward (exact to 2^-24)."""
    import torch

    from stages.trainer.forward import ForwardSpec, policy_logprobs

    bf16, fp32 = [], []
    with torch.no_grad():
        for r in rows:
            t = torch.tensor([r], device=device)  # [1, T]
            lp, _ = policy_logprobs(model, t, torch.ones_like(t), ForwardSpec("bf16"))
            bf16.append(lp[0, 1:].tolist())
            logits = model(input_ids=t).logits.float()[0, :-1]  # [T-1, V], no autocast: float32
            fp32.append(logits.log_softmax(-1).gather(-1, t[0, 1:, None])[:, 0].tolist())
    return bf16, fp32


def _engine_logprobs(engine, rows):
    sp = engine._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
    outs = engine.llm.generate([{"prompt_token_ids": r} for r in rows], [sp] * len(rows), use_tqdm=False)
    return [[float(step[tok].logprob) for step, tok in zip(o.prompt_logprobs[1:], r[1:])] for o, r in zip(outs, rows)]


def _gap(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _train_step(model, device: str) -> None:
    import torch

    from stages.trainer.forward import ForwardSpec, policy_logprobs

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # a large step: the sync must visibly move the engine
    ids = torch.tensor(FIXED[:1], device=device)
    lp, _ = policy_logprobs(model, ids, torch.ones_like(ids), ForwardSpec("bf16"))
    (-lp.mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del opt


def _layer_params(model, layer: int) -> dict:
    return {n: p for n, p in model.named_parameters() if f".layers.{layer}." in n}


def _gap_with_stale_layer(engine, model, old: dict, trainer: list[list[float]]) -> float:
    """The engine's gap to ``trainer`` after a sync that leaves one layer at its ``old`` (pre-step) weights."""
    import torch

    params = {n: p for n, p in model.named_parameters() if n in old}
    new = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(old[n])
        try:
            engine.load_weights(model)
        finally:
            for n, p in params.items():
                p.copy_(new[n])
    return _gap(_engine_logprobs(engine, FIXED), trainer)


def run(
    emit: Callable[[str], None],
    *,
    device: str = "cuda",
    shapes: dict | None = None,
    skip_layers: tuple[int, ...] | None = None,
) -> dict | None:
    """The cycle on ``device`` (``"cpu"`` with small ``shapes``: this code on vLLM's CPU build, which has no
    sleep mode); returns its figures (None where vLLM does not import). ``skip_layers``: the layers each
    partial sync leaves stale, one at a time (default: the last)."""
    from gpu_check.phases import phase

    shapes = shapes or QWEN3_06B
    try:
        with phase("import vllm", emit):
            import vllm
    except Exception as err:  # noqa: BLE001 - any failure to import means no real engine here
        emit(f"[5] vLLM cycle: SKIP (import vllm failed: {type(err).__name__}: {str(err)[:160]})")
        return None
    emit(
        f"[5] vLLM {vllm.__version__}: colocated rollout -> train -> sync -> rollout on {device}, "
        f"{shapes['num_hidden_layers']} layers x {shapes['hidden_size']}, random init"
    )
    folder = tempfile.mkdtemp(prefix="fp8rl-gpucheck-vllm-")
    model, tok = _policy(folder, shapes)
    t0 = time.perf_counter()
    on_gpu = device != "cpu"
    # built before the trainer's weights reach the GPU (vLLM's start-up check wants the memory free)
    with phase("engine start", emit):
        engine = _engine(model, tok, folder, sleep=on_gpu, memory=0.35 if on_gpu else 0.1)
    client = type(engine.llm.llm_engine.engine_core).__name__
    emit(f"    engine built in {time.perf_counter() - t0:.1f} s (client {client})")
    skip = skip_layers if skip_layers is not None else (shapes["num_hidden_layers"] - 1,)
    try:
        return _cycle(engine, model, device, emit, skip)
    finally:
        engine.close()


def _cycle(engine, model, device: str, emit: Callable[[str], None], skip: tuple[int, ...]) -> dict:
    """Rollout, train step, sync, rollout; the synced engine judged against the trainer (see the module)."""
    from gpu_check.phases import phase
    from stages.engines import SamplingRequest
    from stages.engines.weight_transfer import bf16_sync_tolerance

    model.to(device)
    with phase("first sync", emit):
        engine.load_weights(model)  # step 0: the engine takes the trainer's weights (first sync is verified)
    gen = dict(n=4, temperature=1.0, top_p=1.0, max_new_tokens=32)
    with phase("first generate (JIT)", emit):
        batch = engine.generate([FIXED[0][:8], FIXED[1][:8]], SamplingRequest(seed=0, **gen))
        before = _engine_logprobs(engine, FIXED)
    engine.sleep()
    old = {layer: {n: p.detach().clone() for n, p in _layer_params(model, layer).items()} for layer in skip}
    with phase("train step", emit):
        _train_step(model, device)
    with phase("sync", emit):
        t1 = time.perf_counter()
        engine.load_weights(model)
        sync_s = time.perf_counter() - t1
    with phase("check", emit):
        engine.generate([FIXED[0][:8]], SamplingRequest(seed=1, **gen))
        after = _engine_logprobs(engine, FIXED)
        trainer, exact = _trainer_logprobs(model, FIXED, device)
        tol = bf16_sync_tolerance(trainer, exact)
        gap, stale = _gap(after, trainer), _gap(before, trainer)
        partial = {layer: _gap_with_stale_layer(engine, model, old[layer], trainer) for layer in skip}
    verdict = "PASS" if gap <= tol < stale and all(g > tol for g in partial.values()) else "FAIL"
    emit(f"    rollout {batch.generated_tokens} tokens; sync {sync_s * 1e3:.0f} ms; events {engine.events}")
    emit(
        f"    synced engine vs trainer BF16 log-probs: max gap {gap:.4f} (tolerance {tol:.4f}: twice the "
        f"trainer's BF16-vs-fp32 gap); engine before the sync {stale:.4f} off; "
        + "; ".join(f"layer {k} left stale {g:.4f} off" for k, g in partial.items())
        + f" -> {verdict}"
    )
    emit("    " + sync_margin(gap, tol, [stale, *partial.values()]))
    return {"gap": gap, "tolerance": tol, "stale": stale, "partial": partial, "verdict": verdict}


def sync_margin(gap: float, tolerance: float, stale_gaps: list[float]) -> str:
    """How far the synced engine's gap is from the tolerance, and the tolerance from the nearest stale gap:
    a pass by a hair reads differently from a pass by a mile."""
    nearest = min(stale_gaps) if stale_gaps else float("nan")
    under = tolerance / gap if gap > 0 else float("inf")
    over = nearest / tolerance if tolerance > 0 else float("inf")
    return (
        f"sync margin: gap {gap:.4f}, tolerance {tolerance:.4f} ({under:.1f}x the gap), nearest stale gap "
        f"{nearest:.4f} ({over:.1f}x the tolerance)"
    )


def main(argv: list[str] | None = None) -> int:
    """``python gpu_check/vllm_cycle.py --cpu [--json OUT] [--skip-layers 0,25,27]``: the section on vLLM's
    CPU build at :data:`NARROW_28`; its figures as JSON in OUT (``{"error": ...}`` if it could not run)."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(prog="gpu_check/vllm_cycle.py")
    ap.add_argument("--cpu", action="store_true", help="run on CPU at 28 layers x 128 (vLLM's CPU build)")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--skip-layers", default=None, help="comma-separated layers left stale, one sync each")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    skip = None if args.skip_layers is None else tuple(int(x) for x in args.skip_layers.split(","))
    try:
        result = run(
            print, device="cpu" if args.cpu else "cuda", shapes=NARROW_28 if args.cpu else None, skip_layers=skip
        )
        result = result if result is not None else {"error": "vLLM does not import here"}
    except Exception as err:  # noqa: BLE001 - reported in the figures
        result = {"error": f"{type(err).__name__}: {err}"}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result.get("verdict") == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
