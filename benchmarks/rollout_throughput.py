"""Rollout throughput: the transformers engine against a bare ``model.generate`` loop.

Question answered: does the engine's sampling loop (which also returns the
log-prob of every sampled token) add overhead over transformers' own generation
on the same model, batch and lengths? Goal: engine tokens/s / bare tokens/s
>= 0.9. It also reports what FP8 W8A8 emulation costs on CPU (time ratio
against the bf16 engine) — emulation quantizes and dequantizes in software, so
it is expected to be slower than bf16 here; the speed-up of FP8 rollout is a GPU
(vLLM) matter.

Both sides run on the engine's inference copy of the tiny Qwen3 policy under
the same BF16 autocast, with ``P * n`` sequences left-padded in chunks of
``generation_batch_size``, true sampling (``temperature=1``, ``top_p=1``,
``top_k=0``) and the same ``max_new_tokens``; tokens are counted the same way
(response tokens through the first EOS). With the untrained policy few rows stop
early, so the engine's dropping of finished rows barely matters here; on a
trained policy with short answers it is an extra gain. Runs are interleaved (the order rotates every
round) and repeated,
and medians are reported, because the CPUs are shared and timings are noisy.
Ratios are given per wall second and per CPU second of this process (the latter
is far less sensitive to other jobs on the machine; one thread by default so
that it is not inflated by idle OpenMP spinning).

    python benchmarks/rollout_throughput.py --repeats 7

With ``--vllm`` (run it with the interpreter of ``.venv-vllm``, where vLLM's CPU
build is installed: ``make venv-vllm``) it measures the real engine instead:
the project's ``vllm`` engine (BF16, in-process) against a bare ``LLM.generate``
of the same requests on the same ``LLM`` (goal >= 0.95: the adapter's request
building and output conversion cost nothing next to generation), and one weight
sync (``load_weights``: the in-process bf16 stream) against one train step on
the tiny policy (forward + backward + AdamW over a micro campaign's batch)::

    .venv-vllm/bin/python benchmarks/rollout_throughput.py --vllm --repeats 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from fp8rl_core.config.method import PrecisionConfig
from fp8rl_core.config.model import ModelConfig
from fp8rl_core.config.pipeline import RolloutConfig
from fp8rl_core.precision.autocast import autocast_context
from fp8rl_core.tasks.tiny_model import build_tiny_model
from stages.engines import SamplingRequest, TransformersEngine, make_engine

PAD, BOS, EOS = 0, 1, 2


def random_prompts(count: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of BOS + uniform-random tokens, lengths uniform in [lo, hi]."""
    rng = random.Random(seed)
    return [[BOS] + [rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi) - 1)] for _ in range(count)]


def bare_generate_tokens(
    model: torch.nn.Module, prompts: list[list[int]], *, n: int, max_new_tokens: int, batch: int, seed: int
) -> int:
    """``model.generate`` over the same expanded, left-padded chunks; returns response tokens."""
    torch.manual_seed(seed)
    rows = [p for p in sorted(prompts, key=len) for _ in range(n)]
    total = 0
    with torch.inference_mode(), autocast_context("bf16"):
        for lo in range(0, len(rows), batch):
            part = rows[lo : lo + batch]
            width = max(len(p) for p in part)
            ids = torch.full((len(part), width), PAD, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, p in enumerate(part):
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new_tokens,
                pad_token_id=PAD,
                eos_token_id=EOS,
            )
            new = out[:, width:]  # [B, <= max_new_tokens]
            is_eos = new == EOS
            lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, new.shape[1])
            total += int(lengths.sum())
    return total


def timed(fn: Callable[[], int]) -> tuple[float, float, int]:
    """``(wall seconds, process CPU seconds, tokens)`` of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, tokens


def rounds(variants: dict[str, Callable[[], int]], repeats: int) -> dict[str, list[tuple[float, float, int]]]:
    """Warm every variant up, then ``repeats`` interleaved rounds (the order rotates): ``(wall, CPU, tokens)`` each."""
    names = list(variants)
    for name in names:
        variants[name]()
    out: dict[str, list[tuple[float, float, int]]] = {k: [] for k in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out[name].append(timed(variants[name]))
    return out


def _vllm_engine(policy: torch.nn.Module, args: argparse.Namespace):
    import tempfile

    from fp8rl_core.tasks.tiny_model import build_tokenizer
    from stages.engines.vllm_options import VLLMSettings

    folder = tempfile.mkdtemp(prefix="fp8rl-bench-vllm-")
    policy.save_pretrained(folder)
    tok = build_tokenizer(folder)
    cfg = RolloutConfig(engine="vllm", sleep_between_steps=False, gpu_memory_utilization=0.1, verify_sync="never")
    return make_engine(
        "vllm",
        model=policy,
        tokenizer=tok,
        precision=PrecisionConfig(rollout="bf16"),
        config=cfg,
        model_path=folder,
        settings=VLLMSettings(
            max_model_len=args.prompt_len[1] + args.max_new_tokens + 8,
            # above the batch: a split prefill of a seeded request crashes the CPU sampler (docs/vllm.md)
            llm_options={"enforce_eager": True, "max_num_batched_tokens": 16384},
        ),
    )


def _train_step(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, rows: int, width: int) -> int:
    """One forward + backward + AdamW step of the trainer's BF16 path over ``rows x width`` tokens."""
    from stages.trainer.forward import ForwardSpec, policy_logprobs

    ids = torch.randint(4, policy.config.vocab_size, (rows, width))
    lp, _ = policy_logprobs(policy, ids, torch.ones_like(ids), ForwardSpec("bf16"))
    (-lp.mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return rows * width


def vllm_report(args: argparse.Namespace) -> None:
    """Project engine vs bare ``LLM.generate``, and one weight sync vs one train step (module docstring)."""
    try:
        import vllm  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means: no real engine here
        print(f"SKIP vLLM section: import vllm failed ({type(err).__name__}: {err}); run with .venv-vllm/bin/python")
        return
    from stages.engines.vllm_sampling import request_seed

    policy = build_tiny_model(ModelConfig())
    prompts = random_prompts(args.prompts, *args.prompt_len, vocab=policy.config.vocab_size, seed=args.seed)
    seeds = list(range(len(prompts)))
    engine = _vllm_engine(policy, args)
    request = SamplingRequest(
        n=args.n, temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed, seeds=seeds
    )

    def bare() -> int:
        sps = [
            engine._vllm.SamplingParams(
                n=args.n,
                temperature=1.0,
                top_p=1.0,
                max_tokens=args.max_new_tokens,
                seed=request_seed(args.seed, seeds, p, args.n),
                logprobs=0,
                detokenize=False,
                stop_token_ids=sorted(engine.eos_ids),
            )
            for p in range(len(prompts))
        ]
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    variants: dict[str, Callable[[], int]] = {
        "vllm engine": lambda: engine.generate(prompts, request).generated_tokens,
        "bare LLM.generate": bare,
        "train step": lambda: _train_step(policy, optimizer, rows=32, width=40),
        "weight sync": lambda: engine.load_weights(policy) or 1,
    }
    got = rounds(variants, args.repeats)
    engine.close()
    walls = {k: [w for w, _, _ in v] for k, v in got.items()}
    tps = {k: [t / w for w, _, t in v] for k, v in got.items()}
    ratio = sorted(a / b for a, b in zip(tps["vllm engine"], tps["bare LLM.generate"]))
    print(
        f"vLLM {vllm.__version__} (CPU build), BF16, P={args.prompts} n={args.n} max_new_tokens={args.max_new_tokens}"
    )
    for name in ("vllm engine", "bare LLM.generate"):
        print(f"  {name:18s} median {statistics.median(tps[name]):8.0f} tok/s wall")
    print(
        f"project engine / bare vLLM generate tokens/s (goal >= 0.95): {statistics.median(ratio):.3f} "
        f"(rounds {ratio[0]:.3f}..{ratio[-1]:.3f})"
    )
    sync, step = statistics.median(walls["weight sync"]), statistics.median(walls["train step"])
    print(
        f"one weight sync {sync * 1e3:.1f} ms / one train step (32 x 40 tokens) {step * 1e3:.1f} ms = {sync / step:.3f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64, help="prompts per call (P)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--batch", type=int, default=512, help="generation_batch_size (sequences per chunk)")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(8, 32), metavar=("MIN", "MAX"))
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians are reported")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--copy-dtype", choices=("float32", "bfloat16"), default="float32", help="engine inference-copy dtype"
    )
    ap.add_argument("--no-fp8", action="store_true", help="skip the FP8 emulation variants")
    ap.add_argument("--vllm", action="store_true", help="measure the real vLLM engine instead (run in .venv-vllm)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.vllm:
        vllm_report(args)
        return

    policy = build_tiny_model(ModelConfig())
    prompts = random_prompts(args.prompts, *args.prompt_len, vocab=policy.config.vocab_size, seed=args.seed)
    rollout_cfg = RolloutConfig(generation_batch_size=args.batch, max_new_tokens=args.max_new_tokens)

    def engine(mode: str) -> TransformersEngine:
        return make_engine(
            "transformers",
            model=policy,
            tokenizer=None,
            precision=PrecisionConfig(rollout=mode),
            config=rollout_cfg,
            copy_dtype=getattr(torch, args.copy_dtype),
        )

    bf16 = engine("bf16")
    request = SamplingRequest(n=args.n, temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed)
    variants: dict[str, Callable[[], int]] = {
        "engine bf16": lambda: bf16.generate(prompts, request).generated_tokens,
        "bare generate bf16": lambda: bare_generate_tokens(
            bf16.model, prompts, n=args.n, max_new_tokens=args.max_new_tokens, batch=args.batch, seed=args.seed
        ),
    }
    if not args.no_fp8:
        for mode in ("fp8_per_tensor", "fp8_per_block"):
            eng = engine(mode)
            variants[f"engine {mode}"] = lambda eng=eng: (
                eng.generate(prompts, request).generated_tokens
            )

    names = list(variants)
    for name in names:  # warm-up
        variants[name]()
    walls: dict[str, list[float]] = {k: [] for k in names}
    cpus: dict[str, list[float]] = {k: [] for k in names}
    tokens: dict[str, list[int]] = {k: [] for k in names}
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            wall, cpu, tok = timed(variants[name])
            walls[name].append(wall)
            cpus[name].append(cpu)
            tokens[name].append(tok)

    print(
        f"P={args.prompts} n={args.n} (N={args.prompts * args.n} sequences) max_new_tokens={args.max_new_tokens} "
        f"batch={args.batch} prompt_len={tuple(args.prompt_len)} threads={args.threads} repeats={args.repeats} "
        f"copy_dtype={args.copy_dtype}"
    )
    for name in names:
        print(
            f"  {name:22s} median {statistics.median(t / w for t, w in zip(tokens[name], walls[name])):8.0f} tok/s wall"
            f"  {statistics.median(t / c for t, c in zip(tokens[name], cpus[name])):8.0f} tok/s CPU"
            f"   median wall {statistics.median(walls[name]):6.2f} s   tokens/run {statistics.median(tokens[name]):.0f}"
        )

    def paired(a: str, b: str, seconds: dict[str, list[float]]) -> str:
        """Median over rounds of (tokens/s of a) / (tokens/s of b), measured back to back."""
        ratios = sorted((ta / sa) / (tb / sb) for ta, sa, tb, sb in zip(tokens[a], seconds[a], tokens[b], seconds[b]))
        return f"{statistics.median(ratios):.2f} (rounds {ratios[0]:.2f}..{ratios[-1]:.2f})"

    def report(label: str, a: str, b: str) -> None:
        print(f"{label}: per CPU second {paired(a, b, cpus)}; per wall second {paired(a, b, walls)}")

    report("engine / bare generate tokens/s, bf16 (goal >= 0.9)", "engine bf16", "bare generate bf16")
    for mode in ("fp8_per_tensor", "fp8_per_block"):
        if f"engine {mode}" in variants:
            report(f"{mode} emulation / bf16 time per token", "engine bf16", f"engine {mode}")


if __name__ == "__main__":
    main()
