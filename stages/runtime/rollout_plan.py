"""Which rank generates which prompts of a step: blocks of whole groups, engines that exist, balanced work.

A rollout draws ``P`` prompts (the sampler's global order, the same on every
rank); an evaluation has its benchmarks' problems. Generation is cut into
*blocks*, each one ``engine.generate`` call of whole groups of ``G`` samples
(``B = max(1, generation_batch_size // G)`` prompts at most, so
``B * G <= generation_batch_size`` sequences), with the prompts stable-sorted
by token length (the transformers engine's own bucketing, so a block's prompts
keep their order inside the engine). Every prompt carries its own seed
(``SamplingRequest.seeds``), :func:`stages.runtime.seeds.rollout_seed` of its global index; a block
carries the first one as its call seed.

**Engines** (:class:`EngineLayout`, :func:`engine_layout`). Requests go to the
engines that exist, and every rank of one engine submits the same requests:

* the transformers engine: one per rank;
* vLLM ``per_rank``: ``W / TP`` replicas; ranks ``e*TP .. e*TP + TP - 1`` are the
  tensor-parallel group of replica ``e`` (vLLM's external launcher takes the
  data-parallel rank as ``rank // TP``);
* vLLM ``shared_tp``: one engine over all ``W`` ranks;
* vLLM in its own processes (``vllm_process: separate``): one per rank, whatever its
  tensor-parallel size (its workers are its own, not torchrun ranks).

**Two ways to cut the blocks.**

* *Dealt* (the transformers engine, which seeds per block: one
  ``torch.Generator`` per call): the sorted prompts are cut into blocks of
  ``B`` without reference to ``W``, and block ``k`` goes to engine ``k % E``.
  A block's rows, padding width and sampling stream are the same whichever
  rank runs it, so the samples are bit-identical for any ``W``.
* *Balanced* (vLLM, which seeds per prompt: one seeded request per prompt, so
  a prompt's samples do not depend on the call it rides in): every prompt
  weighs its *expected generated tokens*, ``G x max_new_tokens`` (the budget:
  nothing is known of a response's length before it is generated, and one
  benchmark's or one step's prompts share the budget), and goes to the engine
  with the least expected tokens so far (ties: the lowest engine); an
  evaluation carries these loads from one benchmark to the next. Each engine's
  prompts are then cut into blocks of ``B``. The busiest engine's expected
  tokens exceed the mean by at most one prompt's weight; only the assignment
  depends on ``E``, never a sample's seed.

**Lockstep.** Every rank makes the same number of ``generate`` calls per round
(:func:`calls_per_rank`): a rank whose engine has fewer blocks than the busiest
makes padding calls (one prompt, one token) whose output is discarded. vLLM's
data-parallel replicas under the external launcher synchronize their group at
every engine step, so a rank that stops calling ``generate`` while another
still does would leave that one waiting forever.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from fp8rl_core.config.engine_kinds import ENGINE_KINDS
from stages.runtime.seeds import rollout_seed


@dataclass(frozen=True)
class GenerationBlock:
    """One ``engine.generate`` call: ``prompts`` (global indices into the step's draw, in
    generation order), the call's ``seed``, each prompt's own seed, and the engine that runs it
    (``None``: dealt, engine ``index % E``)."""

    index: int
    prompts: tuple[int, ...]
    seed: int
    prompt_seeds: tuple[int, ...]
    engine: int | None = None


@dataclass(frozen=True)
class EngineLayout:
    """The rollout engines of a job: ``engines`` of ``ranks_per_engine`` ranks each (a tensor-parallel
    group submits the same requests); ``balanced``: blocks cut per engine by expected tokens."""

    engines: int
    ranks_per_engine: int = 1
    balanced: bool = False

    def engine_of(self, rank: int) -> int:
        """The engine rank ``rank`` drives."""
        return (rank // self.ranks_per_engine) % self.engines


def engine_layout(rollout: Any, world_size: int) -> EngineLayout:
    """The engines of a ``W``-rank job under this rollout config (module docstring)."""
    if not ENGINE_KINDS.get(rollout.engine).tensor_parallel:
        return EngineLayout(world_size)
    if world_size == 1:
        return EngineLayout(1, 1, balanced=True)
    if rollout.vllm_process == "separate":  # each rank's engine is a whole vLLM in its own processes
        return EngineLayout(world_size, 1, balanced=True)
    if rollout.data_parallel == "shared_tp":
        return EngineLayout(1, world_size, balanced=True)
    tp = rollout.tensor_parallel_size
    if world_size % tp:
        raise ValueError(f"rollout.tensor_parallel_size={tp} does not divide the torchrun world size {world_size}")
    return EngineLayout(world_size // tp, tp, balanced=True)


def expected_tokens(samples: int, max_new_tokens: int) -> int:
    """A prompt's expected generated tokens: its samples times the response budget."""
    return samples * max_new_tokens


def _sorted_prompts(prompt_lengths: list[int]) -> list[int]:
    return sorted(range(len(prompt_lengths)), key=lambda p: prompt_lengths[p])  # stable


def _block(index: int, prompts: list[int], seeding: tuple[int, int, int], engine: int | None) -> GenerationBlock:
    seeds = tuple(rollout_seed(*seeding, p) for p in prompts)
    return GenerationBlock(index, tuple(prompts), seeds[0], seeds, engine)


def generation_blocks(
    prompt_lengths: list[int],
    *,
    group_size: int,
    generation_batch_size: int,
    seed: int,
    step: int,
    round_: int,
    layout: EngineLayout | None = None,
    max_new_tokens: int = 1,
) -> list[GenerationBlock]:
    """The round's blocks for prompts of these token lengths (``[P]``): dealt, or balanced over
    ``layout``'s engines when it says so (module docstring)."""
    if layout is not None and layout.balanced:
        blocks, _ = balanced_blocks(
            prompt_lengths,
            layout=layout,
            group_size=group_size,
            generation_batch_size=generation_batch_size,
            tokens_per_prompt=expected_tokens(group_size, max_new_tokens),
            seeding=(seed, step, round_),
        )
        return blocks
    per_block = max(1, generation_batch_size // group_size)
    order = _sorted_prompts(prompt_lengths)
    cuts = range(0, len(order), per_block)
    return [_block(k, order[lo : lo + per_block], (seed, step, round_), None) for k, lo in enumerate(cuts)]


def assign_engines(weights: list[int], loads: list[int]) -> tuple[list[int], list[int]]:
    """Each item (in order) to the engine with the least load so far (ties: the lowest engine).

    ``loads``: the engines' loads before (``[E]``). Returns (engine of each item, loads after)."""
    loads = list(loads)
    engines = []
    for w in weights:
        e = min(range(len(loads)), key=lambda i: (loads[i], i))
        loads[e] += w
        engines.append(e)
    return engines, loads


def balanced_blocks(
    prompt_lengths: list[int],
    *,
    layout: EngineLayout,
    group_size: int,
    generation_batch_size: int,
    tokens_per_prompt: int,
    seeding: tuple[int, int, int],
    loads: list[int] | None = None,
) -> tuple[list[GenerationBlock], list[int]]:
    """Blocks balanced over the engines by expected tokens, starting from the engines' ``loads``.

    ``seeding``: ``(seed, step, round)`` of :func:`stages.runtime.seeds.rollout_seed`. Blocks are
    numbered call by call (engine 0's first call, engine 1's first call, ...). Returns the blocks
    and the engines' loads after them."""
    order = _sorted_prompts(prompt_lengths)
    engine_of, after = assign_engines([tokens_per_prompt] * len(order), loads or [0] * layout.engines)
    per_engine: list[list[int]] = [[] for _ in range(layout.engines)]
    for p, e in zip(order, engine_of):
        per_engine[e].append(p)
    per_block = max(1, generation_batch_size // group_size)
    calls = [[prompts[lo : lo + per_block] for lo in range(0, len(prompts), per_block)] for prompts in per_engine]
    blocks: list[GenerationBlock] = []
    for c in range(max((len(x) for x in calls), default=0)):
        for e, engine_calls in enumerate(calls):
            if c < len(engine_calls):
                blocks.append(_block(len(blocks), engine_calls[c], seeding, e))
    return blocks, after


def _as_layout(lanes: int | EngineLayout) -> EngineLayout:
    return lanes if isinstance(lanes, EngineLayout) else EngineLayout(lanes)


def lane_of(block: GenerationBlock, engines: int) -> int:
    """The engine of ``block`` among ``engines``: its own, or dealt by its index."""
    return (block.engine if block.engine is not None else block.index) % engines


def blocks_of_rank(blocks: list[GenerationBlock], rank: int, lanes: int | EngineLayout) -> list[GenerationBlock]:
    """The blocks rank ``rank`` generates: its engine's (a number ``lanes`` means one rank per engine)."""
    layout = _as_layout(lanes)
    mine = layout.engine_of(rank)
    return [b for b in blocks if lane_of(b, layout.engines) == mine]


def calls_per_rank(blocks: list[GenerationBlock], lanes: int | EngineLayout) -> int:
    """``generate`` calls every rank makes in a round: the busiest engine's block count."""
    engines = _as_layout(lanes).engines
    return max(Counter(lane_of(b, engines) for b in blocks).values(), default=0)


def engine_token_loads(blocks: list[GenerationBlock], engines: int, tokens_per_prompt: int) -> list[int]:
    """Expected generated tokens of each engine (``[E]``) in these blocks."""
    loads = [0] * engines
    for b in blocks:
        loads[lane_of(b, engines)] += tokens_per_prompt * len(b.prompts)
    return loads


def padding_calls(engine: Any, prompt: list[int], count: int) -> None:
    """``count`` discarded one-token ``generate`` calls, so this rank keeps step with the busiest one."""
    from stages.engines.base import SamplingRequest

    request = SamplingRequest(n=1, temperature=1.0, top_p=1.0, max_new_tokens=1, seed=0)
    for _ in range(count):
        engine.generate([prompt], request)
