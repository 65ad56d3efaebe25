"""Rollout and evaluation requests go to the engines that exist, balanced by expected generated tokens.

Each rank's requests are recorded by a stand-in engine (no model runs): the
rollout's through ``plan_rollout`` and ``generate_share``, the evaluation's
through ``eval_blocks`` and ``generate_eval_share``, one rank at a time as
every rank of a job would run them.

* tensor parallelism: every rank of a TP group submits the same requests
  (vLLM's external launcher: data-parallel rank = ``rank // TP``), the groups
  split the prompts, and under ``shared_tp`` every rank submits everything;
* every rank makes the same number of ``generate`` calls (vLLM's DP lockstep);
* the 8B and 32B presets: the busiest engine's expected generated tokens over
  the mean is at most 1.1, in rollout and in evaluation. The expected tokens
  are computed here from what each engine was asked for: a request of ``n``
  samples with budget ``max_new_tokens`` expects ``n * max_new_tokens``
  tokens; the benchmarks' sizes are their published test splits;
* with vLLM every prompt's seed is the same on any number of ranks (so only
  the assignment changes); the transformers engine, seeded per block, keeps
  its blocks and their dealing (block ``k`` to rank ``k % W``);
* ``fp8rl plan`` prints both figures.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from unittest import mock

import pytest

from flows.campaign.configuration import load_config
from stages.data.prompts import PromptItem
from stages.evaluate import eval_blocks, generate_eval_share
from stages.rollout import generate_share, plan_rollout
from stages.runtime.rollout_plan import engine_layout, generation_blocks
from tests.conftest import BENCHMARK_SIZES as PUBLISHED

PADDING_BUDGET = 1  # a padding call generates one token


class RecordingEngine:
    """Records every ``generate`` call: (prompt token ids, n, max_new_tokens, per-prompt seeds)."""

    name = "recording"
    policy_version = 0  # the weights are current: no sync
    weights_discarded = False

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[tuple[int, ...], ...], int, int, tuple[int, ...]]] = []

    def wake_up(self) -> None:
        pass

    def generate(self, prompts, request):
        self.calls.append(
            (tuple(tuple(p) for p in prompts), request.n, request.max_new_tokens, tuple(request.seeds or ()))
        )
        return SimpleNamespace(samples=[], wall_seconds=0.0)

    def requests(self) -> list[tuple[tuple[int, ...], int, int, int]]:
        """(prompt, n, budget, seed) of every real (non-padding) request, in call order."""
        return [
            (prompt, n, budget, seeds[j])
            for prompts, n, budget, seeds in self.calls
            if budget > PADDING_BUDGET
            for j, prompt in enumerate(prompts)
        ]


def _prompts(count: int, salt: int) -> list[list[int]]:
    """``count`` distinct prompts of uneven lengths (first token: the prompt's own id)."""
    return [[salt * 10_000 + i] + [7] * ((i * 37 + salt) % 23) for i in range(count)]


def _env(cfg, rank: int, world: int):
    return SimpleNamespace(cfg=cfg, engine=RecordingEngine(), rank=rank, world_size=world)


STATE = SimpleNamespace(policy_version=0, policy=None)


def _rollout_by_rank(cfg, world: int, prompt_ids: list[list[int]]) -> list[RecordingEngine]:
    """Every rank's rollout requests of step 1 (the plan from the prompts' token ids)."""
    engines = []
    for rank in range(world):
        env = _env(cfg, rank, world)
        items = [PromptItem(str(i), "", "", "synthetic") for i in range(len(prompt_ids))]
        with mock.patch("stages.rollout.encode_prompts", lambda env, prompts, state: prompt_ids):
            plan = plan_rollout(env, STATE, 1, items, round_=0)
        generate_share(env, STATE, plan, rank=rank, lanes=engine_layout(cfg.rollout, world))
        engines.append(env.engine)
    return engines


def _eval_by_rank(cfg, world: int) -> list[RecordingEngine]:
    """Every rank's evaluation requests at step 25 (each benchmark at its published size)."""
    engines = []
    for rank in range(world):
        env = _env(cfg, rank, world)
        loads = None
        for i, bench in enumerate(cfg.evaluation.benchmarks):
            prompt_ids = _prompts(PUBLISHED[bench.name], i + 1)
            blocks, loads = eval_blocks(env, prompt_ids, 25, bench, i, loads)
            generate_eval_share(env, STATE, prompt_ids, blocks, bench)
        engines.append(env.engine)
    return engines


def _expected_tokens(engine: RecordingEngine) -> int:
    return sum(n * budget for _, n, budget, _ in engine.requests())


def _check_engines(engines: list[RecordingEngine], tp: int, every_prompt: set) -> list[int]:
    """Ranks of one TP group asked for the same; groups disjoint, covering every prompt once; equal calls.
    Returns each engine's expected tokens."""
    assert len({len(e.calls) for e in engines}) == 1, [len(e.calls) for e in engines]  # DP lockstep
    groups = [engines[g : g + tp] for g in range(0, len(engines), tp)]
    seen: list = []
    for group in groups:
        assert all(e.calls == group[0].calls for e in group), "ranks of one TP group submitted different requests"
        seen += [prompt for prompt, *_ in group[0].requests()]
    assert sorted(seen) == sorted(every_prompt), "the engines' prompts are not the prompts, each once"
    return [_expected_tokens(group[0]) for group in groups]


def _busiest_over_mean(loads: list[int]) -> float:
    return max(loads) * len(loads) / sum(loads)


PRESETS = [("qwen3-8b-grpo-deepscaler", 8), ("qwen2.5-32b-grpo", 8), ("qwen2.5-32b-grpo", 32)]


@pytest.mark.parametrize("preset, world", PRESETS)
def test_rollout_of_the_gpu_presets_is_balanced_over_the_engines_that_exist(preset, world):
    cfg = load_config(preset)
    tp = cfg.rollout.tensor_parallel_size
    prompt_ids = _prompts(cfg.rollout.prompts_per_step, 0)
    engines = _rollout_by_rank(cfg, world, prompt_ids)
    loads = _check_engines(engines, tp, {tuple(p) for p in prompt_ids})
    assert len(loads) == world // tp
    assert _busiest_over_mean(loads) <= 1.1, loads
    assert sum(loads) == cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt * cfg.rollout.max_new_tokens


@pytest.mark.parametrize("preset, world", PRESETS)
def test_evaluation_of_the_gpu_presets_is_balanced_over_the_engines_that_exist(preset, world):
    cfg = load_config(preset)
    tp = cfg.rollout.tensor_parallel_size
    engines = _eval_by_rank(cfg, world)
    every = {tuple(p) for i, b in enumerate(cfg.evaluation.benchmarks) for p in _prompts(PUBLISHED[b.name], i + 1)}
    loads = _check_engines(engines, tp, every)
    assert _busiest_over_mean(loads) <= 1.1, loads
    expected = sum(PUBLISHED[b.name] * b.k * b.max_new_tokens for b in cfg.evaluation.benchmarks)
    assert sum(loads) == expected


def test_shared_tp_every_rank_submits_every_request():
    cfg = load_config("qwen3-8b-grpo-deepscaler", ["rollout.data_parallel=shared_tp"])
    engines = _eval_by_rank(cfg, 4)
    every = {tuple(p) for i, b in enumerate(cfg.evaluation.benchmarks) for p in _prompts(PUBLISHED[b.name], i + 1)}
    _check_engines(engines, 4, every)
    prompt_ids = _prompts(cfg.rollout.prompts_per_step, 0)
    _check_engines(_rollout_by_rank(cfg, 4, prompt_ids), 4, {tuple(p) for p in prompt_ids})


def _seeds(engines: list[RecordingEngine]) -> dict:
    out: dict = defaultdict(set)
    for e in engines:
        for prompt, n, budget, seed in e.requests():
            out[prompt].add((n, budget, seed))
    return out


def test_with_vllm_every_prompt_has_the_same_request_on_any_number_of_ranks():
    cfg = load_config("qwen3-8b-grpo-deepscaler", ["rollout.prompts_per_step=64"])
    prompt_ids = _prompts(64, 0)
    one = _seeds(_rollout_by_rank(cfg, 1, prompt_ids))
    assert all(len(v) == 1 for v in one.values())
    for world in (2, 8):
        assert _seeds(_rollout_by_rank(cfg, world, prompt_ids)) == one, f"rollout seeds differ on {world} ranks"
    small = load_config(
        "qwen3-8b-grpo-deepscaler",
        ["evaluation.benchmarks=[{name: aime24, k: 16, max_new_tokens: 64}, {name: gsm8k, k: 1, max_new_tokens: 8}]"],
    )
    assert _seeds(_eval_by_rank(small, 8)) == _seeds(_eval_by_rank(small, 1))


def test_the_transformers_engine_keeps_its_blocks_and_their_dealing():
    """Seeded per block, its samples depend on the blocks: they stay those of ``generation_blocks``
    without engines, block ``k`` on rank ``k % W`` (so the golden tables do not move)."""
    cfg = load_config("tiny-cpu", ["rollout.prompts_per_step=32", "rollout.generation_batch_size=48"])
    r = cfg.rollout
    prompt_ids = _prompts(32, 0)
    blocks = generation_blocks(
        [len(p) for p in prompt_ids],
        group_size=r.samples_per_prompt,
        generation_batch_size=r.generation_batch_size,
        seed=cfg.seed,
        step=1,
        round_=0,
    )
    world = 2
    engines = _rollout_by_rank(cfg, world, prompt_ids)
    for rank, engine in enumerate(engines):
        want = [b for b in blocks if b.index % world == rank]
        got = [(prompts, seeds) for prompts, _, budget, seeds in engine.calls if budget > PADDING_BUDGET]
        assert got == [(tuple(tuple(prompt_ids[p]) for p in b.prompts), b.prompt_seeds) for b in want]


def test_fp8rl_plan_prints_the_rollout_and_evaluation_balance():
    from typer.testing import CliRunner

    from flows.cli import app

    out = CliRunner().invoke(app, ["plan", "qwen3-8b-grpo-deepscaler", "--gpus", "8", "--analytic"])
    assert out.exit_code == 0, out.output
    assert "over 8 vllm engines" in out.output
    work = out.output.split("generation work")[1].splitlines()
    rollout = next(line for line in work if line.strip().startswith("rollout"))
    evaluation = next(line for line in work if line.strip().startswith("evaluation"))
    assert "1.00 x the mean" in rollout and "4046 samples" in evaluation, out.output
    assert float(evaluation.split(" x the mean")[0].split()[-1]) <= 1.1
