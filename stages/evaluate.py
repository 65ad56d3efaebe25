"""Evaluate stage: k samples per problem per benchmark, graded, into ``evals`` and ``eval_scores``.

Generation goes through the campaign's rollout engine (so evaluation sees the
rollout precision the campaign trains with), seeded by ``(seed, step, benchmark)``.
Metrics per benchmark: avg@k (mean accuracy over the k samples), pass@k (the
unbiased estimator), maj@k (majority vote over extracted answers). The tiny
default evaluates on the synthetic test split, disjoint from training by
construction.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import pyarrow as pa

from fp8rl_core.config.campaign import CampaignConfig
from fp8rl_core.config.pipeline import BenchmarkEval
from stages.context import RunEnv, TrainState
from stages.data.prompts import PromptItem, data_dir
from stages.engines.base import RolloutBatch, RolloutSample, SamplingRequest
from stages.result import StageResult
from stages.runtime.seeds import step_seed

if TYPE_CHECKING:
    from stages.data.benchmarks import LoadReport


def eval_problems(cfg: CampaignConfig, bench: BenchmarkEval) -> tuple[list[PromptItem], str]:
    """(problems, verifier name) of a benchmark entry of the config."""
    items, verifier, _ = _eval_source(cfg, bench)
    return items, verifier


def _eval_source(cfg: CampaignConfig, bench: BenchmarkEval) -> tuple[list[PromptItem], str, LoadReport]:
    """(problems, verifier name, the loader's report: the file read and the records it skipped)."""
    from stages.data.benchmarks import load_benchmark, render_prompt, verifier_for
    from stages.data.code_benchmarks import CODE_BENCHMARKS, load_code_benchmark, verifier_of

    if bench.name in CODE_BENCHMARKS:  # code: the answer is a grading spec, graded in the sandbox
        code_set = load_code_benchmark(bench.name, data_dir(cfg.task), bench.limit, task=cfg.task, code=cfg.code)
        items = [PromptItem(q.id, q.problem, q.answer, bench.name) for q in code_set]
        return items, verifier_of(bench.name), code_set.report
    if bench.dataset is not None:  # a benchmark by dataset name or path (stages.data.datasets_io)
        from stages.data.datasets_io import load_problems

        problems = load_problems(bench.dataset, bench.name, data_dir(cfg.task), bench.limit)
    else:
        problems = load_benchmark(bench.name, data_dir(cfg.task), bench.limit, task=cfg.task)
    items = [PromptItem(q.id, render_prompt(q), q.answer, bench.name) for q in problems]
    verifier = verifier_for(problems[0]) if len(problems) else "math"
    return items, verifier, problems.report


def check_benchmarks(cfg: CampaignConfig) -> None:
    """Load every configured benchmark once, so what the step-0 evaluation cannot run fails before a run
    starts (ValueError naming the file): a missing file, one with no usable problem (empty, or every record
    malformed), or, for the embedded tiny model, a prompt that with the benchmark's ``max_new_tokens`` does
    not fit the model's context (``model.max_position_embeddings``; a checkpoint's engine checks at generate)."""
    encode = _tiny_model_encoder(cfg)
    for bench in cfg.evaluation.benchmarks:
        items, _, report = _eval_source(cfg, bench)
        where = report.path
        if not items:
            skipped = report.skipped
            why = f"all {len(skipped)} record(s) malformed, the first {skipped[0]}" if skipped else "it is empty"
            raise ValueError(f"benchmark {bench.name}: {where} holds no usable problem ({why})")
        if encode is None:
            continue
        longest = max(len(encode(it.prompt)) for it in items)
        context = cfg.model.max_position_embeddings
        if longest + bench.max_new_tokens > context:
            raise ValueError(
                f"benchmark {bench.name}: {where}: its longest prompt ({longest} tokens) + max_new_tokens "
                f"({bench.max_new_tokens}) exceeds the model's context (model.max_position_embeddings={context}); "
                "set the benchmark's limit, a smaller max_new_tokens or a longer context"
            )


def _tiny_model_encoder(cfg: CampaignConfig):
    """The run's prompt encoding for the embedded tiny model (its tokenizer is built, not loaded), else None."""
    if cfg.model.path is not None:
        return None
    from fp8rl_core.tasks.tiny_model import build_tokenizer
    from stages.data.prompt_format import formatter

    return formatter(cfg.prompt, build_tokenizer()).encode


def eval_blocks(
    env: RunEnv, prompt_ids: list[list[int]], step: int, bench: BenchmarkEval, salt: int, loads: list[int] | None = None
) -> tuple[list, list[int]]:
    """The benchmark's generation blocks (whole groups of ``k``, every prompt seeded on its own, independent
    of the rank count) for the job's engines, and the engines' expected tokens after them.

    ``loads``: the engines' expected tokens from the benchmarks before (vLLM's blocks are balanced
    over all of an evaluation's benchmarks together; the transformers engine's are dealt)."""
    from stages.runtime.rollout_plan import balanced_blocks, engine_layout, expected_tokens, generation_blocks

    cfg = env.cfg
    layout = engine_layout(cfg.rollout, env.world_size)
    seeding = (step_seed(cfg.seed, step, 1000 + salt), step, 0)
    lengths = [len(p) for p in prompt_ids]
    if not layout.balanced:
        blocks = generation_blocks(
            lengths,
            group_size=bench.k,
            generation_batch_size=cfg.rollout.generation_batch_size,
            seed=seeding[0],
            step=step,
            round_=0,
        )
        return blocks, list(loads or [0] * layout.engines)
    return balanced_blocks(
        lengths,
        layout=layout,
        group_size=bench.k,
        generation_batch_size=cfg.rollout.generation_batch_size,
        tokens_per_prompt=expected_tokens(bench.k, bench.max_new_tokens),
        seeding=seeding,
        loads=loads,
    )


def generate_eval_share(
    env: RunEnv, state: TrainState, prompt_ids: list[list[int]], blocks: list, bench: BenchmarkEval
) -> dict[int, RolloutBatch]:
    """This rank's engine's blocks of a benchmark (``{block index: batch}``), through the rollout's
    generation path (:func:`stages.rollout.generate_blocks`: padded to the busiest engine's call count;
    every rank of a tensor-parallel group submits the same blocks)."""
    from stages.rollout import generate_blocks
    from stages.runtime.rollout_plan import engine_layout

    request = SamplingRequest(
        n=bench.k, temperature=bench.temperature, top_p=bench.top_p, max_new_tokens=bench.max_new_tokens, seed=0
    )  # seed: each block's own
    layout = engine_layout(env.cfg.rollout, env.world_size)
    return generate_blocks(env, state, prompt_ids, blocks, rank=env.rank, lanes=layout, request=request)


def merged_batch(blocks: list, shares: list[dict[int, RolloutBatch]], num_prompts: int, k: int) -> RolloutBatch:
    """Every rank's blocks as one batch in the benchmark's prompt order (group layout)."""
    merged: dict[int, RolloutBatch] = {}
    for share in shares:  # a block every rank of a tensor-parallel group generated: rank 0's (the first)
        for i, b in share.items():
            merged.setdefault(i, b)
    groups: list[list[RolloutSample]] = [[] for _ in range(num_prompts)]
    for block in blocks:
        for j, p in enumerate(block.prompts):
            groups[p] = [dataclasses.replace(s, prompt_index=p) for s in merged[block.index].group(j)]
    samples = [s for g in groups for s in g]
    wall = sum(b.wall_seconds for b in merged.values())
    first = next(iter(merged.values()))
    return RolloutBatch(
        samples=samples, num_prompts=num_prompts, n=k, wall_seconds=wall, engine=first.engine, precision=first.precision
    )


def grade_benchmark(
    env: RunEnv, bench: BenchmarkEval, items: list[PromptItem], verifier: str, batch: RolloutBatch
) -> tuple[pa.Table, list[dict]]:
    """Grade one benchmark's samples: its ``evals`` rows and its metric rows."""
    from fp8rl_core.signals.eval_metrics import avg_at_k, maj_at_k, pass_at_k
    from stages.grade.pool import grade_batch

    responses = env.tokenizer.batch_decode([s.response_ids for s in batch.samples], skip_special_tokens=True)
    golds = [items[s.prompt_index].answer for s in batch.samples]
    ids = [f"{bench.name}:{items[s.prompt_index].prompt_id}#{s.sample_index}" for s in batch.samples]
    graded = grade_batch(ids, responses, golds, verifier=verifier, code_config=env.cfg.code)
    scores = [1.0 if g.correct else 0.0 for g in graded]
    predicted = [g.extracted for g in graded]
    rows = pa.table(
        {
            "benchmark": [bench.name] * len(responses),
            "problem_id": [items[s.prompt_index].prompt_id for s in batch.samples],
            "sample_index": pa.array([s.sample_index for s in batch.samples], pa.int16()),
            "correct": [sc >= 1.0 for sc in scores],
            "score": pa.array(scores, pa.float32()),
            "predicted_answer": predicted,
            "response": responses,
            "response_length": pa.array([len(s.response_ids) for s in batch.samples], pa.int32()),
            "finish_reason": [s.finish_reason for s in batch.samples],
            "temperature": pa.array([bench.temperature] * len(responses), pa.float32()),
            "tests_passed_fraction": pa.array([g.fraction for g in graded], pa.float32()),
        }
    )
    k = bench.k
    correct = [[scores[p * k + i] >= 1.0 for i in range(k)] for p in range(len(items))]
    answers = [[predicted[p * k + i] for i in range(k)] for p in range(len(items))]
    metric_rows = [
        {"benchmark": bench.name, "metric": "avg@k", "k": k, "value": avg_at_k(correct), "n_problems": len(items)},
        {"benchmark": bench.name, "metric": "pass@k", "k": k, "value": pass_at_k(correct, k), "n_problems": len(items)},
        {
            "benchmark": bench.name,
            "metric": "maj@k",
            "k": k,
            "value": maj_at_k(answers, correct),
            "n_problems": len(items),
        },
    ]
    return rows, metric_rows


def run_evaluate(env: RunEnv, state: TrainState, step: int, *, attempt: int = 0) -> tuple[StageResult, TrainState]:
    """Evaluate every configured benchmark at ``step``; write ``evals`` and ``eval_scores``.

    Every rank generates its engine's blocks of each benchmark (every prompt's seed the same on
    any number of ranks, every rank calling the engine equally often); rank 0
    gathers them, grades and writes."""
    from stages.data.prompt_format import encode_prompts
    from stages.runtime.stage_comm import from_main, together

    t0 = time.perf_counter()
    comm = env.stage_comm
    benches = list(env.cfg.evaluation.benchmarks)

    def local():
        plans, loads = [], None
        for i, bench in enumerate(benches):
            items, verifier = eval_problems(env.cfg, bench)
            prompt_ids = encode_prompts(env, [it.prompt for it in items], state)
            blocks, loads = eval_blocks(env, prompt_ids, step, bench, i, loads)
            plans.append((items, verifier, blocks, generate_eval_share(env, state, prompt_ids, blocks, bench)))
        return plans

    plans = together(comm, local)
    shares = comm.gather([share for *_, share in plans])  # [W][bench] on rank 0

    def write() -> StageResult:
        all_rows, all_metrics = [], []
        for b, (bench, (items, verifier, blocks, _)) in enumerate(zip(benches, plans)):
            batch = merged_batch(blocks, [rank_shares[b] for rank_shares in shares], len(items), bench.k)
            rows, metrics = grade_benchmark(env, bench, items, verifier, batch)
            all_rows.append(rows)
            all_metrics.extend(metrics)
        return _write_eval(env, step, attempt, all_rows, all_metrics, t0)

    return from_main(comm, write), state


def _write_eval(env: RunEnv, step: int, attempt: int, all_rows: list, all_metrics: list, t0: float) -> StageResult:
    outputs = [
        str(
            env.writer.write(
                "evals", step, pa.concat_tables(all_rows), stage="evaluate", attempt=attempt, variant=env.variant
            )
        ),
        str(
            env.writer.write(
                "eval_scores",
                step,
                pa.Table.from_pylist(all_metrics),
                stage="evaluate",
                attempt=attempt,
                variant=env.variant,
            )
        ),
    ]
    seconds = time.perf_counter() - t0
    scores = {f"{m['benchmark']}/{m['metric'][:-1]}{m['k']}": float(m["value"]) for m in all_metrics}
    scores.update(benchmark_average(all_metrics))
    return StageResult(outputs=outputs, seconds=seconds, scores=scores)


AVERAGE_KEY = "average/avg@k"


def benchmark_average(metrics: list[dict]) -> dict[str, float]:
    """``{"average/avg@k": mean over benchmarks of avg@k at each benchmark's largest k}``, the paper's
    selection figure (as the ``paper-table`` query's best_eval_average), so
    ``checkpoint.keep_best_metric: average/avg@k`` keeps the checkpoint the reported figure comes from."""
    best: dict[str, tuple[int, float]] = {}
    for m in metrics:
        if str(m["metric"]).startswith("avg@") and (m["benchmark"] not in best or m["k"] > best[m["benchmark"]][0]):
            best[m["benchmark"]] = (int(m["k"]), float(m["value"]))
    return {AVERAGE_KEY: sum(v for _, v in best.values()) / len(best)} if best else {}
