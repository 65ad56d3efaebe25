"""vLLM's requests and outputs, both ways: per-prompt seeds and sampling parameters in, samples out.

* **Sampling.** One ``SamplingParams(n, temperature, top_p, max_tokens, seed,
  logprobs=0, detokenize=False, stop_token_ids)`` per prompt; ``logprobs=0``
  returns exactly the sampled token's log-prob (``logprobs=K`` the top ``K`` as
  well, for score centering), and the stop ids (the model's
  EOS and a chat template's end-of-turn) make vLLM stop there itself. vLLM gives
  the ``n`` children of a seeded request the seeds ``seed + 0 .. seed + n - 1``,
  so each prompt gets a distinct base seed ``seed * 1_000_003 + p * n`` and no
  two samples share a stream; with per-prompt ``seeds`` (the rollout stage passes
  them) the base is ``seeds[p] * 1_000_003``, so seeding is per prompt group and
  a group's samples do not depend on the call it rides in. top-k is left at
  vLLM's default (disabled).
* **Outputs.** ``RequestOutput.outputs[i]`` (a ``CompletionOutput``) carries
  ``index``, ``token_ids`` (the EOS token included), ``logprobs`` (one
  ``{token_id: Logprob}`` per generated token) and ``finish_reason``
  (``"stop"`` / ``"length"``).
"""

from __future__ import annotations

from typing import Any

from stages.engines.base import FinishReason, RolloutBatch, RolloutSample, SamplingRequest, truncate_at_eos


def prompt_seed(seed: int, prompt_index: int, n: int) -> int:
    """Base seed of one prompt's request; its ``n`` children use ``base + 0 .. base + n - 1``."""
    return (seed * 1_000_003 + prompt_index * n) % (2**63 - 1)


def request_seed(seed: int, seeds: list[int] | None, prompt_index: int, n: int) -> int:
    """Base seed of prompt ``p``'s request: from its own seed when ``seeds`` are given (then
    the prompt's samples depend on nothing else in the call), else from the call's ``seed``."""
    if seeds is None:
        return prompt_seed(seed, prompt_index, n)
    return prompt_seed(seeds[prompt_index], 0, n)


def sampling_params(vllm: Any, num_prompts: int, request: SamplingRequest, *, stop_ids: list[int]) -> list[Any]:
    """One ``vllm.SamplingParams`` per prompt (``[P]``), each seeded by :func:`request_seed`; ``request.top_k``
    log-probs per position besides the sampled token's (``logprobs=top_k``)."""
    n = request.n
    return [
        vllm.SamplingParams(
            n=n,
            temperature=request.temperature,
            top_p=request.top_p,
            max_tokens=request.max_new_tokens,
            seed=request_seed(request.seed, request.seeds, p, n),
            logprobs=request.top_k,
            detokenize=False,
            stop_token_ids=stop_ids,
        )
        for p in range(num_prompts)
    ]


def sampled_token_logprobs(completion: Any) -> list[float]:
    """The log-prob of each generated token of a ``CompletionOutput`` (``logprobs=0``)."""
    steps = completion.logprobs
    if steps is None:
        raise RuntimeError("vLLM returned no log-probs: SamplingParams(logprobs=0) must be set")
    token_ids = list(completion.token_ids)
    if len(steps) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(steps)} log-prob entries for {len(token_ids)} tokens")
    out = []
    for t, (step, tok) in enumerate(zip(steps, token_ids)):
        if tok not in step:
            raise RuntimeError(f"vLLM log-probs at position {t} lack the sampled token {tok} (keys {list(step)[:4]})")
        entry = step[tok]
        out.append(float(getattr(entry, "logprob", entry)))
    return out


def top_logprobs(completion: Any, top_k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The ``top_k`` most likely tokens at each generated position of a ``CompletionOutput``
    (``logprobs=top_k``) and their log-probs, most likely first. vLLM's entry for a position holds
    its top ``top_k`` and the sampled token besides when that one ranks lower."""
    ids, lps = [], []
    for t, step in enumerate(completion.logprobs or []):
        ranked = sorted(((int(tok), float(getattr(e, "logprob", e))) for tok, e in step.items()), key=lambda x: -x[1])
        top = ranked[:top_k]
        if len(top) != top_k:
            raise RuntimeError(f"vLLM returned {len(top)} top log-probs at position {t}, expected {top_k}")
        ids.append([tok for tok, _ in top])
        lps.append([lp for _, lp in top])
    return ids, lps


def batch_from_request_outputs(
    outputs: list[Any],
    *,
    n: int,
    eos_ids: frozenset[int],
    wall_seconds: float,
    engine: str,
    precision: str,
    top_k: int = 0,
) -> RolloutBatch:
    """Convert ``LLM.generate``'s ``RequestOutput`` list (one per prompt, in prompt order) to a batch."""
    samples: list[RolloutSample] = []
    for p, request in enumerate(outputs):
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise RuntimeError(f"vLLM returned {len(completions)} completions for prompt {p}, expected n={n}")
        for i, completion in enumerate(completions):
            ids = [int(t) for t in completion.token_ids]
            logps = sampled_token_logprobs(completion)
            kept, reason = truncate_at_eos(ids, eos_ids)
            if reason == "length":
                reason = _finish_reason(completion.finish_reason, p, i)
            top = (None, None)
            if top_k:
                top_ids, top_lps = top_logprobs(completion, top_k)
                top = (top_ids[: len(kept)], top_lps[: len(kept)])
            samples.append(RolloutSample(p, i, kept, logps[: len(kept)], reason, *top))
    return RolloutBatch(
        samples=samples,
        num_prompts=len(outputs),
        n=n,
        wall_seconds=wall_seconds,
        engine=engine,
        precision=precision,
    )


def _finish_reason(vllm_reason: Any, p: int, i: int) -> FinishReason:
    if vllm_reason in ("stop", "length"):
        return vllm_reason
    raise RuntimeError(f"vLLM sample ({p}, {i}) finished with {vllm_reason!r}; expected 'stop' or 'length'")
