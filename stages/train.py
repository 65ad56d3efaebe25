"""Train stage: the step's policy update, ``token_stats`` and the ``steps`` row.

Reads the step's ``rollouts`` and ``scores`` (kept samples only), builds padded
tensors, runs :func:`stages.trainer.update.policy_update` with the clip bounds in
force (from the calibrator state) and the BF16 shadow passes on calibration
steps, then writes

* ``token_stats``: every token on calibration steps (r8 and r16 both known),
  a seeded sample of ``algorithm.token_stats_sample`` of the tokens otherwise;
* ``steps``: every scalar of the step (loss, entropy, clip shares by sign,
  dual-clip share, ppo_kl, grad norm, lr, bounds, TIS stats, rollout-vs-train
  mismatch, reward, length, garbled share, NMAEs, tokens/s, stage timings).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pyarrow as pa
import torch

from fp8rl_core.calibration.shadow_metrics import shadow_metrics as shadow_noise
from fp8rl_core.objective.losses import importance_ratio
from fp8rl_core.signals.failure_signals import garbled_shares
from stages.context import RunEnv, TrainState
from stages.result import StageResult
from stages.runtime.io import read_step
from stages.runtime.seeds import step_seed
from stages.schedule.shadow import drift_metrics, shadow_plan
from stages.trainer.forward import token_multiple
from stages.trainer.types import TrainBatch, UpdateResult
from stages.trainer.update import UpdateSpec, policy_update
from storage import faults


def build_batch(rows: pa.Table, scores: pa.Table, pad_id: int, step: int = 0, *, top_k: int = 0) -> TrainBatch:
    """Padded ``[N, T]`` tensors of the kept samples, in sample order; an error naming ``step`` if none is kept.
    ``top_k``: score centering's ``[N, T, K]`` top-k ids and renormalized probabilities from the rows."""
    kept = np.asarray(scores.column("kept").to_numpy(zero_copy_only=False), dtype=bool)
    by_id = {int(s): i for i, s in enumerate(rows.column("sample_id").to_pylist())}
    score_ids = scores.column("sample_id").to_pylist()
    adv_all = scores.column("advantage").to_numpy()
    sel = [(by_id[int(sid)], float(adv_all[j]), int(sid)) for j, sid in enumerate(score_ids) if kept[j]]
    prompts = rows.column("prompt_token_ids").to_pylist()
    responses = rows.column("response_token_ids").to_pylist()
    rlogp = rows.column("rollout_logp").to_pylist()
    n = len(sel)
    if n == 0:
        raise RuntimeError(f"step {step}: no kept samples to train on (all groups dropped by dynamic sampling)")
    width = max((len(prompts[i]) + len(responses[i]) for i, _, _ in sel), default=1)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    am = torch.zeros((n, width), dtype=torch.long)
    rmask = torch.zeros((n, width), dtype=torch.float32)
    rlp = torch.zeros((n, width), dtype=torch.float32)
    for r, (i, _, _) in enumerate(sel):
        p, y = prompts[i], responses[i]
        lp, ly = len(p), len(y)
        ids[r, : lp + ly] = torch.tensor(p + y, dtype=torch.long)
        am[r, : lp + ly] = 1
        rmask[r, lp : lp + ly] = 1.0
        rlp[r, lp : lp + ly] = torch.tensor(rlogp[i], dtype=torch.float32)
    adv = torch.tensor([a for _, a, _ in sel], dtype=torch.float32)
    sids = torch.tensor([s for _, _, s in sel], dtype=torch.long)
    center = centering_tensors(rows, [(i, len(prompts[i])) for i, _, _ in sel], width, top_k, step) if top_k else ()
    return TrainBatch(ids, am, rmask, rlp, adv, sids, *center)


def centering_tensors(
    rows: pa.Table, placed: list[tuple[int, int]], width: int, k: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score centering's ``(ids, mu)`` ``[N, width, K]``: for batch row ``r`` = rollouts row ``placed[r][0]``
    (its response from column ``placed[r][1]``), each response token's top-``k`` ids and their probabilities
    under the rollout engine, renormalized over the ``k``; zeros elsewhere."""
    names = set(rows.column_names)
    top_ids = rows.column("top_token_ids").to_pylist() if "top_token_ids" in names else [None] * rows.num_rows
    top_lps = rows.column("top_logprobs").to_pylist() if "top_logprobs" in names else [None] * rows.num_rows
    ids = torch.zeros((len(placed), width, k), dtype=torch.long)
    lps = torch.full((len(placed), width, k), float("-inf"), dtype=torch.float32)
    for r, (i, start) in enumerate(placed):
        if top_ids[i] is None or any(len(t) != k for t in top_ids[i]):
            raise RuntimeError(
                f"step {step}: its rollouts carry no top-{k} log-probs (rolled out without "
                f"algorithm.score_centering_k={k}); score centering trains only on steps rolled out with it: "
                "start the run with the setting, or set algorithm.score_centering_k=0"
            )
        n = len(top_ids[i])
        ids[r, start : start + n] = torch.tensor(top_ids[i], dtype=torch.long).reshape(n, k)
        lps[r, start : start + n] = torch.tensor(top_lps[i], dtype=torch.float32).reshape(n, k)
    mu = torch.softmax(lps, dim=-1).nan_to_num_(0.0)  # rows of -inf (no response token) -> 0
    return ids, mu


def token_uniform(seed: int, sample_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A uniform [0, 1) number per (sample, position), from a hash of (seed, sample_id, position).

    Which tokens a sampled ``token_stats`` keeps then depends on nothing else: not
    on the batch's padding, the row order, or how rows are spread over ranks.
    """
    mask64 = (1 << 63) - 1
    x = (sample_ids.long() * 0x9E3779B1 + positions.long() * 0x85EBCA77 + (seed & 0xFFFFFFFF) * 0xC2B2AE3D) & mask64
    for mult in (0x7FEB352D, 0x846CA68B):  # integer mixing rounds (xorshift-multiply), in int64
        x = x ^ (x >> 15)
        x = (x * mult) & mask64
    x = x ^ (x >> 16)
    return (x & 0xFFFFFF).double() / float(1 << 24)


def token_rows(batch: TrainBatch, res: UpdateResult, *, bounds, standard, sample: float, seed: int,
               rows: torch.Tensor | None = None) -> pa.Table:
    """``token_stats`` rows of the batch rows ``rows`` (all by default): every valid token,
    or the ``sample`` share picked by :func:`token_uniform`."""
    mask = batch.response_mask > 0  # [N, T]
    first = mask.float().argmax(dim=1)  # first response column per row
    if rows is not None:
        keep_rows = torch.zeros(mask.shape[0], dtype=torch.bool)
        keep_rows[rows] = True
        mask = mask & keep_rows[:, None]
    if sample < 1.0:
        pos = torch.arange(mask.shape[1])[None, :] - first[:, None]
        mask = mask & (token_uniform(seed, batch.sample_ids[:, None], pos) < sample)
    rows_i, cols_i = mask.nonzero(as_tuple=True)
    n = rows_i.numel()

    def f32(t: torch.Tensor | None, nan_is_null: bool = False) -> pa.Array:
        if t is None:
            return pa.nulls(n, pa.float32())
        # NaN -> NULL: not shadowed
        return pa.array(t[rows_i, cols_i].float().numpy(), pa.float32(), from_pandas=nan_is_null)

    lo, hi = bounds
    if res.row_bounds is not None:  # bounds per update (BAPO): each row's own
        lo, hi = res.row_bounds[rows_i, 0].numpy(), res.row_bounds[rows_i, 1].numpy()
    return pa.table({
        "sample_id": pa.array(batch.sample_ids[rows_i].numpy().astype(np.int32)),
        "position": pa.array((cols_i - first[rows_i]).numpy().astype(np.int32)),
        "epoch": pa.array(np.zeros(n, np.int16)),
        "minibatch": pa.array(res.minibatch[rows_i].numpy().astype(np.int16)),
        "advantage": pa.array(batch.advantages[rows_i].numpy(), pa.float32()),
        "logp_fp8": f32(res.logp_fp8), "old_logp_fp8": f32(res.old_logp_fp8),
        "logp_bf16": f32(res.logp_bf16, True), "old_logp_bf16": f32(res.old_logp_bf16, True),
        "entropy": f32(res.entropy),
        "lower_bound": pa.array(np.full(n, lo, np.float32)), "upper_bound": pa.array(np.full(n, hi, np.float32)),
        "standard_lower": pa.array(np.full(n, standard[0], np.float32)),
        "standard_upper": pa.array(np.full(n, standard[1], np.float32)),
    })


def shadow_metrics(batch: TrainBatch, res: UpdateResult, bounds, standard, tis_cap: float = 2.0) -> dict[str, float]:
    """The shadow step's noise metrics (:func:`fp8rl_core.calibration.shadow_metrics.shadow_metrics`)."""
    return shadow_noise(res, advantages=batch.advantages, response_mask=batch.response_mask,
                        rollout_logp=batch.rollout_logp, bounds=bounds, standard=standard, tis_cap=tis_cap)


def run_train(env: RunEnv, state: TrainState, step: int, *, attempt: int = 0,
              timings: dict[str, float] | None = None) -> tuple[StageResult, TrainState]:
    """Update the policy on ``step``'s batch; write ``token_stats`` and ``steps``.

    ``timings``: the step's earlier stage times (``<stage>_seconds``), written in
    the ``steps`` row. Returns the state with ``policy_version = step`` (the
    policy and optimizer are updated in place).
    """
    t0 = time.perf_counter()
    cfg = env.cfg
    rows = read_step(env, "rollouts", step)
    scores = read_step(env, "scores", step)
    batch = build_batch(rows, scores, env.tokenizer.pad_token_id, step, top_k=env.cfg.algorithm.score_centering_k)
    # fixed K, drift, or a guard's remedy; on shadow steps the rows to shadow (None: all)
    shadow, shadow_rows = shadow_plan(env, state, step, batch.advantages, batch.response_mask)
    bounds = (state.calibrator.lower, state.calibrator.upper)  # in force this step
    standard = (1.0 - cfg.algorithm.eps_low, 1.0 + cfg.algorithm.eps_high)
    with faults.lr_surge(state.optimizer, state.scheduler, step, attempt):  # inert unless a test injects a surge
        spec = UpdateSpec(bounds=bounds, shadow=shadow, seed=step_seed(cfg.seed, step, 7), shadow_rows=shadow_rows,
                          correction_thresholds=state.calibrator.correction)
        res = policy_update(state.policy, state.optimizer, state.scheduler, batch, cfg, spec, collective=env.collective)
    state = dataclasses.replace(state, policy_version=step)
    # per-token rows: each rank writes the rows it trained, as its own part file
    tok = token_rows(batch, res, bounds=bounds, standard=standard,
                     sample=1.0 if shadow else cfg.algorithm.token_stats_sample, seed=step_seed(cfg.seed, step, 8),
                     rows=res.rows if env.world_size > 1 else None)
    part = "train" if env.rank == 0 else f"train_rank{env.rank}"
    outputs = [str(env.writer.write("token_stats", step, tok, stage=part, attempt=attempt, variant=env.variant))]
    if env.is_main and attempt > 0:  # a replay on fewer ranks than the first attempt: their parts must not stay live
        env.writer.retire_absent_ranks("token_stats", step, "train", env.world_size, variant=env.variant)
    if env.world_size > 1:
        import torch.distributed as dist

        dist.barrier(group=env.group)  # every rank's part is in place before anyone reads the step
    train_seconds = time.perf_counter() - t0
    timings = dict(timings or {})
    timings["train_seconds"] = train_seconds
    scores_all = scores.to_pydict()
    responses = rows.column("response").to_pylist()
    n_valid = float(batch.response_mask.sum())
    m = dict(res.metrics)
    m.update(shadow_metrics(batch, res, bounds, standard, cfg.algorithm.tis_cap))
    m.update(drift_metrics(env, state, step, importance_ratio(res.logp_fp8, res.old_logp_fp8),
                           batch.advantages[:, None].expand_as(res.logp_fp8), batch.response_mask > 0, shadow))
    m.update({
        "reward_mean": float(np.mean(scores_all["reward"])), "accuracy": float(np.mean(scores_all["correct"])),
        "response_length_mean": float(np.mean(rows.column("response_length").to_numpy())),
        # docs/method.md, "Failure signals": the share of responses the answer parser cannot read
        **garbled_shares(responses, env.answer_parser),
        "kept_share": float(np.mean(scores_all["kept"])), "shadow": float(shadow),
        "pg_loss": m.get("loss", 0.0), "learning_rate": m.get("lr", 0.0),
        "train_tokens_per_second": n_valid / max(res.timings.get("update_s", train_seconds), 1e-9),
        "token_multiple": float(token_multiple(cfg.precision.train)), "world_size": float(env.world_size),
        **{k: float(v) for k, v in res.timings.items()},
        **timings,
    })
    m["step_seconds"] = sum(v for k, v in timings.items() if k.endswith("_seconds"))
    steps_row = {k: [float(v)] for k, v in m.items() if isinstance(v, (int, float))}
    if env.is_main:  # per-step tables: rank 0 alone
        part = env.writer.write("steps", step, steps_row, stage="train", attempt=attempt, variant=env.variant)
        outputs.append(str(part))
    return StageResult(outputs=outputs, seconds=train_seconds, metrics=m, shadow=shadow), state
