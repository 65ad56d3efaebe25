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
   :func:`stages.engines.weight_transfer.bf16_logprob_tolerance` and the
   engine's log-probs must have moved by more than ten times it.

Written for vLLM 0.32 on CUDA; not yet run on a GPU in this project.
"""

from __future__ import annotations

import tempfile
import time
from typing import Callable

QWEN3_06B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
)
FIXED = [[1] + list(range(40, 100)), [1] + list(range(200, 230)) * 2]


def _policy(folder: str, shapes: dict):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fp8rl_core.tiny_model import build_tokenizer

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(
        Qwen3Config(**shapes, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    ).float()
    model.save_pretrained(folder)
    tok = build_tokenizer(folder)  # ids < 128; the engine never detokenizes
    return model, tok


def _engine(model, tok, folder: str, *, sleep: bool, memory: float):
    from fp8rl_core.config import PrecisionConfig, RolloutConfig
    from stages.engines import make_engine

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
        max_model_len=512,
    )


def _trainer_logprobs(model, rows, device: str):
    import torch

    from stages.trainer.forward import policy_logprobs

    ids = torch.tensor(rows[:1], device=device), torch.tensor(rows[1:], device=device)
    out, zmax = [], 0.0
    with torch.no_grad():
        for t in ids:
            lp, _ = policy_logprobs(model, t, torch.ones_like(t), mode="bf16")
            out.append(lp[0, 1:].tolist())
            with torch.autocast(device, dtype=torch.bfloat16):
                zmax = max(zmax, float(model(input_ids=t).logits.float().abs().max()))
    return out, zmax


def _engine_logprobs(engine, rows):
    sp = engine._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
    outs = engine.llm.generate([{"prompt_token_ids": r} for r in rows], [sp] * len(rows), use_tqdm=False)
    return [[float(step[tok].logprob) for step, tok in zip(o.prompt_logprobs[1:], r[1:])] for o, r in zip(outs, rows)]


def _gap(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _train_step(model, device: str) -> None:
    import torch

    from stages.trainer.forward import policy_logprobs

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # a large step: the sync must visibly move the engine
    ids = torch.tensor(FIXED[:1], device=device)
    lp, _ = policy_logprobs(model, ids, torch.ones_like(ids), mode="bf16")
    (-lp.mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del opt


def run(emit: Callable[[str], None], *, device: str = "cuda", shapes: dict | None = None) -> None:
    """The cycle on ``device`` (``"cpu"`` with small ``shapes``: a smoke run of this code on vLLM's CPU build,
    which has no sleep mode)."""
    shapes = shapes or QWEN3_06B
    try:
        import vllm
    except Exception as err:  # noqa: BLE001 - any failure to import means no real engine here
        emit(f"[5] vLLM cycle: SKIP (import vllm failed: {type(err).__name__}: {str(err)[:160]})")
        return
    from stages.engines.weight_transfer import bf16_logprob_tolerance

    emit(
        f"[5] vLLM {vllm.__version__}: colocated rollout -> train -> sync -> rollout on {device}, "
        f"{shapes['num_hidden_layers']} layers x {shapes['hidden_size']}, random init"
    )
    folder = tempfile.mkdtemp(prefix="fp8rl-gpucheck-vllm-")
    model, tok = _policy(folder, shapes)
    t0 = time.perf_counter()
    on_gpu = device != "cpu"
    # built before the trainer's weights reach the GPU (vLLM's start-up check wants the memory free)
    engine = _engine(model, tok, folder, sleep=on_gpu, memory=0.35 if on_gpu else 0.1)
    client = type(engine.llm.llm_engine.engine_core).__name__
    emit(f"    engine built in {time.perf_counter() - t0:.1f} s (client {client})")
    try:
        model.to(device)
        engine.load_weights(model)  # step 0: the engine takes the trainer's weights (first sync is verified)
        gen = dict(n=4, temperature=1.0, top_p=1.0, max_new_tokens=32)
        batch = engine.generate([FIXED[0][:8], FIXED[1][:8]], seed=0, **gen)
        before = _engine_logprobs(engine, FIXED)
        engine.sleep()
        _train_step(model, device)
        t1 = time.perf_counter()
        engine.load_weights(model)
        sync_s = time.perf_counter() - t1
        engine.generate([FIXED[0][:8]], seed=1, **gen)
        after = _engine_logprobs(engine, FIXED)
        trainer, zmax = _trainer_logprobs(model, FIXED, device)
        tol = bf16_logprob_tolerance(zmax, 2 * shapes["num_hidden_layers"])
        gap, moved = _gap(after, trainer), _gap(after, before)
        verdict = "PASS" if gap <= tol and moved > 10 * tol else "FAIL"
        emit(f"    rollout {batch.generated_tokens} tokens; sync {sync_s * 1e3:.0f} ms; events {engine.events}")
        emit(
            f"    synced engine vs trainer BF16 log-probs: max gap {gap:.4f} (tolerance {tol:.4f}); "
            f"moved by the step {moved:.4f} -> {verdict}"
        )
    finally:
        engine.close()
