"""The tables of a campaign: one explicit pyarrow schema each, column by column.

Every row carries ``run_id`` (the run directory's id), ``step`` (int64, the RL
step that produced it) and ``variant`` ('main' for the campaign itself, another
name for a re-run of a stage written beside the original — e.g. a what-if
calibration — so both can be compared in one SQL query).

The column contract (docs/method.md, "Tables and the column contract") is a floor: saved queries rely on those
names, so they are never renamed; more columns may be added at any time. Old
files lacking a newer column read as NULL there (the catalog unions files by
name and adds the schema's columns, typed, to every view).

Type choices keep the big table small. ``token_stats`` holds one row per
response token of a calibration step, i.e. tens of millions of rows per run:

- log-probs and entropy are float32, written with Parquet's BYTE_STREAM_SPLIT
  encoding (zstd then compresses the sign/exponent byte planes) — float32 is
  exactly what the trainer computes, so nothing is lost;
- ids and positions are int32 (dictionary/RLE-encoded: a sample id repeats for
  every token of its sequence and costs ~0.03 byte/row);
- per-step constants (bounds in force) repeat and cost ~0 bytes;
- the ratios r8 and r16 are *derived*, not stored: r = exp(clamp(logp − old_logp,
  −20, 20)) is the definition of docs/method.md, so the catalog computes them from the
  stored log-probs. Storing them would add ~7 bytes/row of incompressible
  mantissa for no information (writers may pass them; they are dropped);
- the clip flags (clipped_lower/upper, bf16_clipped_lower/upper) *are* stored:
  booleans, mostly false, cost ~0.05 byte/row, and spare every clip-share query
  an exp() per row (computed by the writer when the trainer does not pass them).

Measured on realistic data this is ~19 bytes/row on disk (budget: 20).

The machinery (columns, table specs, schema versions, names that go into paths)
is :mod:`storage.tables.spec`; the derived ratios and clip flags of ``token_stats``
are :mod:`storage.tables.clip_flags`.
"""

from __future__ import annotations

import re

import pyarrow as pa

from storage.errors import SchemaError
from storage.tables.clip_flags import fill_clip_flags, ratio_sql
from storage.tables.spec import Column, TableSpec, key_columns

_F32 = pa.float32()
_F64 = pa.float64()

ROLLOUTS = TableSpec(
    "rollouts",
    "One row per generated sample (response) of a step.",
    key_columns()
    + (
        Column("sample_id", pa.int32(), "Index of the sample in the step's batch; joins scores and token_stats.", True),
        Column("prompt_id", pa.string(), "Id of the problem in its dataset (stable across steps)."),
        Column("sample_index", pa.int16(), "Index of the sample within its prompt's group (0..G-1)."),
        Column("generation_round", pa.int16(), "DAPO dynamic-sampling refill round (0 = first generation)."),
        Column("dataset", pa.string(), "Dataset / data source the prompt came from."),
        Column("prompt", pa.string(), "Prompt text as given to the model.", encoding="plain"),
        Column("response", pa.string(), "Generated text (decoded response tokens).", encoding="plain"),
        Column(
            "reference_answer",
            pa.string(),
            "Ground truth for the verifier (so scoring can be re-run).",
            encoding="plain",
        ),
        Column("prompt_token_ids", pa.list_(pa.int32()), "Token ids of the prompt.", encoding="plain"),
        Column("response_token_ids", pa.list_(pa.int32()), "Token ids of the response.", encoding="plain"),
        Column(
            "rollout_logp",
            pa.list_(_F32),
            "Per response token: log-prob under the rollout engine (nats).",
            encoding="plain",
        ),
        Column("response_length", pa.int32(), "Number of response tokens."),
        Column("finish_reason", pa.string(), "'stop' (EOS / stop string) or 'length' (hit the max length)."),
        Column(
            "policy_version",
            pa.int64(),
            "The policy version (the step whose update the weights hold) that sampled it; its lag is "
            "step − 1 − this: 0 in lockstep, rollout.max_staleness with it (less in the first steps).",
        ),
        Column("precision", pa.string(), "Rollout precision: 'bf16', 'fp8_per_tensor', 'fp8_per_block'."),
        Column(
            "top_token_ids",
            pa.list_(pa.list_(pa.int32())),
            "Per response token: the K most likely tokens of the distribution it was sampled from, most likely "
            "first (algorithm.score_centering_k = K; NULL when off, and in runs written before).",
            encoding="plain",
        ),
        Column(
            "top_logprobs",
            pa.list_(pa.list_(_F32)),
            "Per response token: the log-probs of top_token_ids under the rollout engine (nats).",
            encoding="plain",
        ),
        Column(
            "train_logp",
            pa.list_(_F32),
            "Per response token: log-prob under the trainer's policy in the training precision with the weights "
            "that sampled it, computed right after sampling (nats); with token_stats.old_logp_fp8 and rollout_logp "
            "it splits the behaviour weight into lag and rollout mismatch. NULL without rollout.max_staleness, "
            "under several ranks, with an engine that generates apart (vLLM's own process, a server), and in "
            "runs written before.",
            encoding="plain",
        ),
    ),
)

SCORES = TableSpec(
    "scores",
    "One row per sample: verifier outcome, shaped reward, advantage, DAPO filtering.",
    key_columns()
    + (
        Column("sample_id", pa.int32(), "Sample in the step's batch (joins rollouts.sample_id).", True),
        Column("prompt_id", pa.string(), "Problem id (the GRPO group)."),
        Column("score", _F32, "Raw verifier score (1.0 correct, 0.0 wrong unless the verifier grades partially)."),
        Column("correct", pa.bool_(), "Verifier judged the final answer correct."),
        Column("overlong_penalty", _F32, "DAPO overlong shaping R_len (<= 0; 0 when disabled)."),
        Column("reward", _F32, "Reward used for the advantage: score plus penalties."),
        Column("group_reward_mean", _F32, "Mean reward of the sample's group."),
        Column("group_reward_std", _F32, "Unbiased std of the group's rewards (1 for a group of one)."),
        Column("advantage", _F32, "Sequence advantage (GRPO: (R − mean)/(std + 1e-6); Dr.GRPO: R − mean)."),
        Column("kept", pa.bool_(), "Kept for training (False: dropped by DAPO dynamic sampling)."),
        Column(
            "tests_passed_fraction", _F32, "Code tasks: share of the response's test cases passed (NULL otherwise)."
        ),
    ),
)

TOKEN_STATS = TableSpec(
    "token_stats",
    "One row per valid response token of a step with shadow passes: FP8 and BF16 log-probs, entropy.",
    key_columns()
    + (
        Column("sample_id", pa.int32(), "Sample in the step's batch (joins rollouts/scores).", True, "delta"),
        Column("position", pa.int32(), "Token position within the response (0-based).", True, "delta"),
        Column("epoch", pa.int16(), "PPO epoch over the batch (0-based; key with sample_id, position)."),
        Column("minibatch", pa.int16(), "Mini-batch index within the epoch."),
        Column("advantage", _F32, "Per-token advantage A (the sequence's, repeated)."),
        Column("logp_fp8", _F32, "log π_θ(token) from the FP8 training forward (nats).", encoding="bss"),
        Column("old_logp_fp8", _F32, "log π_old(token) from the FP8 old-policy forward (nats).", encoding="bss"),
        Column("logp_bf16", _F32, "log π_θ from the BF16 shadow forward; NULL without shadow pass.", encoding="bss"),
        Column(
            "old_logp_bf16", _F32, "log π_old from the BF16 shadow forward; NULL without shadow pass.", encoding="bss"
        ),
        Column(
            "entropy", _F32, "Entropy of the policy's next-token distribution at this position (nats).", encoding="bss"
        ),
        Column("lower_bound", _F32, "FP8 lower clip bound L in force at this step."),
        Column("upper_bound", _F32, "FP8 upper clip bound H in force at this step."),
        Column("standard_lower", _F32, "Standard lower bound 1 − ε_low (what BF16 clips at)."),
        Column("standard_upper", _F32, "Standard upper bound 1 + ε_high."),
        Column("clipped_lower", pa.bool_(), "A<0 and r8 < L: FP8 zeroes the gradient (computed if not given)."),
        Column("clipped_upper", pa.bool_(), "A>0 and r8 > H (computed if not given)."),
        Column("bf16_clipped_lower", pa.bool_(), "A<0 and r16 < 1 − ε_low: BF16 would clip; NULL without shadow pass."),
        Column("bf16_clipped_upper", pa.bool_(), "A>0 and r16 > 1 + ε_high; NULL without shadow pass."),
    ),
    fill=fill_clip_flags,
    derived=(
        (
            "ratio_fp8",
            ratio_sql("logp_fp8", "old_logp_fp8"),
            "r8 = exp(clamp(logp_fp8 − old_logp_fp8, −20, 20)) (docs/method.md).",
        ),
        (
            "ratio_bf16",
            ratio_sql("logp_bf16", "old_logp_bf16"),
            "r16, the same from the BF16 shadow log-probs; NULL without shadow pass.",
        ),
        (
            "overclipped",
            "CASE WHEN bf16_clipped_lower IS NOT NULL THEN clipped_lower AND NOT bf16_clipped_lower END",
            "BF16 would not clip, FP8 does: A<0, r16 >= 1−ε_low, r8 < L (NULL without shadow pass).",
        ),
        (
            "underclipped",
            "CASE WHEN clipped_lower IS NOT NULL THEN bf16_clipped_lower AND NOT clipped_lower END",
            "BF16 would clip, FP8 does not: A<0, r16 < 1−ε_low, r8 >= L (NULL without shadow pass).",
        ),
    ),
)

_STEP_METRICS = (
    ("reward_mean", "Mean reward over the step's samples."),
    ("entropy_mean", "Mean token entropy of the policy over valid response tokens (nats)."),
    ("clipfrac", "Share of valid tokens clipped: clipfrac_lower + clipfrac_upper."),
    ("clipfrac_lower", "Share of valid tokens with A<0 and r < L."),
    ("clipfrac_upper", "Share of valid tokens with A>0 and r > H."),
    ("lower_bound", "Lower clip bound L in force."),
    ("upper_bound", "Upper clip bound H in force."),
    ("ppo_kl", "mean(old_logp − logp) over valid tokens."),
    ("step_seconds", "Wall time of the whole step (s)."),
    ("dualclip_frac", "Share of valid tokens with A<0 and r > dual-clip c."),
    ("accuracy", "Share of the step's samples judged correct."),
    ("response_length_mean", "Mean response length (tokens)."),
    ("pg_loss", "Policy-gradient loss (aggregated as configured)."),
    ("grad_norm", "Gradient norm before clipping."),
    ("learning_rate", "Learning rate used at this step."),
    ("prob_nmae", "NMAE of FP8 vs BF16 token probabilities (shadow steps)."),
    ("ratio_nmae", "NMAE of r8 vs r16 (shadow steps); / prob_nmae = noise amplification."),
    (
        "rollout_gpu_gib_before_sleep",
        "GPU memory in use (GiB, all processes) just before the vLLM engine slept after rollout; null off GPU.",
    ),
    ("rollout_gpu_gib_after_sleep", "GPU memory in use (GiB) just after the vLLM engine slept; null off GPU."),
    # BAPO as published (calibration.mode = bapo): bounds re-picked before every update
    ("bapo_lower_mean", "BAPO: mean over the step's updates of c_low (NULL in other modes)."),
    ("bapo_lower_min", "BAPO: smallest c_low of the step's updates."),
    ("bapo_lower_max", "BAPO: largest c_low of the step's updates."),
    ("bapo_upper_mean", "BAPO: mean over the step's updates of c_high."),
    ("bapo_upper_min", "BAPO: smallest c_high of the step's updates."),
    ("bapo_upper_max", "BAPO: largest c_high of the step's updates."),
    ("bapo_rho_mean", "BAPO: mean positive share rho = S+/(S+ + S-) at the chosen bounds (over all ranks' tokens)."),
    ("bapo_rho_min", "BAPO: smallest rho of the step's updates."),
    ("bapo_rho_max", "BAPO: largest rho of the step's updates."),
    ("bapo_iterations_mean", "BAPO: mean number of bound moves per update."),
    # the oracle (calibration.mode = oracle): each token's clip decision taken on its BF16 ratio, epoch 0
    ("decided_clipfrac", "Oracle: share of valid tokens it clipped: decided_clipfrac_lower + _upper (NULL otherwise)."),
    ("decided_clipfrac_lower", "Oracle: share of valid tokens with A<0 and r16 < 1 − ε_low."),
    ("decided_clipfrac_upper", "Oracle: share of valid tokens with A>0 and r16 > 1 + ε_high."),
    ("decided_dualclip_frac", "Oracle: share of valid tokens with A<0 and r16 > dual-clip c."),
    ("amplification", "ratio_nmae / prob_nmae (shadow steps)."),
    ("old_prob_nmae", "NMAE of FP8 vs BF16 old-policy token probabilities (shadow steps)."),
    ("lower_clip_share_neg_fp8", "Share of A<0 tokens FP8 clips below L (denominator: A<0 tokens)."),
    ("lower_clip_share_neg_bf16", "Share of A<0 tokens BF16 clips below 1 − ε_low (denominator: A<0 tokens)."),
    ("overclipped_share", "Share of A<0 tokens FP8 clips and BF16 would not (shadow steps)."),
    ("underclipped_share", "Share of A<0 tokens BF16 would clip and FP8 does not (shadow steps)."),
    ("pg_clipfrac", "Share of valid tokens whose loss term the clip made constant (as the loss saw it)."),
    ("ratio_mean", "Mean r over valid tokens."),
    ("ratio_min", "Min r over valid tokens."),
    ("ratio_max", "Max r over valid tokens."),
    ("loss", "Policy loss (same as pg_loss; the trainer's name)."),
    ("lr", "Learning rate (same as learning_rate; the trainer's name)."),
    ("grad_norm_max", "Largest gradient norm over the step's updates."),
    ("updates", "Optimizer updates in the step."),
    ("skipped_updates", "Updates skipped for a non-finite gradient."),
    ("n_tokens", "Valid response tokens trained on."),
    ("is_weight_mean", "Mean importance weight of the loss (TIS / CISPO)."),
    ("tis_weight_mean", "Mean truncated-IS weight (rollout vs train policy)."),
    ("tis_weight_min", "Min truncated-IS weight."),
    ("tis_capped_share", "Share of tokens whose TIS weight hit its cap."),
    ("rollout_train_logp_abs_diff", "Mean |logp_rollout − old_logp_train| over valid tokens."),
    ("kept_share", "Share of samples kept by dynamic sampling."),
    ("shadow", "1 on steps with the BF16 shadow pass, else 0."),
    ("train_tokens_per_second", "Valid tokens trained per second of update."),
    ("garbled_share", "Share of the step's responses the task's answer parser cannot read (docs/method.md)."),
    ("garbled_heuristic_share", "Share of responses the text heuristic diagnostics.garbled_score flags (>= 0.5)."),
    ("seq_clipfrac_lower", "GSPO: share of sequences with A<0 and sequence ratio s < L (sequence level)."),
    ("seq_clipfrac_upper", "GSPO: share of sequences with A>0 and s > H."),
    ("seq_ratio_mean", "GSPO: mean sequence ratio s = exp(mean(logp - old_logp))."),
    ("seq_ratio_min", "GSPO: smallest sequence ratio."),
    ("seq_ratio_max", "GSPO: largest sequence ratio."),
    (
        "token_multiple",
        "Token-count multiple every FP8 micro-batch was padded to (16 tensorwise/rowwise, 128 blockwise, 1 bf16).",
    ),
    ("world_size", "Ranks that trained the step (FSDP2 under torchrun; 1 = one process)."),
    (
        "drift_signal",
        "KS distance of this step's A<0 FP8 ratios vs the last calibration step's (0 on calibration steps).",
    ),
    ("ratio_noise_nmae", "Shadow steps: NMAE of r8 vs r16 (training noise in the ratio)."),
    ("tis_weight_nmae", "Shadow steps: NMAE of the TIS weight from FP8 vs BF16 pi_old (against rollout log-probs)."),
    (
        "rollout_bf16_prob_nmae",
        "Shadow steps: NMAE of rollout-engine probabilities vs BF16 pi_old (the mismatch itself).",
    ),
    ("rollout_bf16_tis_nmae", "Shadow steps: NMAE of 1 vs the TIS weight from BF16 pi_old (what TIS corrects)."),
    ("rollout_fp8_prob_nmae", "Shadow steps: NMAE of rollout probabilities vs FP8 pi_old."),
)

STEPS = TableSpec(
    "steps",
    "One row per (run, step, variant): every scalar metric of the step. Open-ended: any other "
    "numeric metric a stage passes becomes a float64 column (e.g. 'rollout_seconds').",
    key_columns() + tuple(Column(n, _F64, d) for n, d in _STEP_METRICS),
    extra_type=_F64,
    # timings of stages and phases; clip shares per entropy bin (diagnostics)
    extra_pattern=re.compile(r"^([a-z][a-z0-9_]*_(seconds|s)|clipfrac_(lower|upper)_entropy_bin\d+)$"),
    merge_rows=True,
)

BOUNDS = TableSpec(
    "bounds",
    "Calibration history: one row per calibration; the bounds apply from step + 1.",
    key_columns()
    + (
        Column("mode", pa.string(), "Clip-bound policy: 'calibrated', 'standard', 'relaxed_lower', 'bapo', ..."),
        Column("alpha", _F64, "Share of A<0 tokens that BF16 clips at 1 − ε_low."),
        Column("raw_lower", _F64, "L before smoothing and clamping (α-quantile of FP8 ratios of A<0 tokens)."),
        Column("raw_upper", _F64, "H before smoothing (smallest grid H reaching the target balance)."),
        Column("lower", _F64, "L after smoothing and clamping: the bound used from the next step."),
        Column("upper", _F64, "H after smoothing and clamping."),
        Column("target_balance", _F64, "BF16 Pos/Neg balance at the standard bounds (the target)."),
        Column("balance_before", _F64, "FP8 balance with the previous bounds."),
        Column("balance_after", _F64, "FP8 balance with the new bounds."),
        # Shares of the A<0 (A>0) tokens, not of all tokens: named apart from steps.clipfrac_lower/upper.
        Column("lower_clip_share_neg_before", _F64, "Share of A<0 tokens FP8 clips below the previous L."),
        Column("lower_clip_share_neg_after", _F64, "Share of A<0 tokens FP8 clips below the new L."),
        Column("lower_clip_share_neg_applied", _F64, "Share of A<0 tokens FP8 clips below the L applied next step."),
        Column("lower_clip_share_neg_bf16", _F64, "Share of A<0 tokens BF16 clips below 1 − ε_low (= alpha's target)."),
        Column("upper_clip_share_pos_before", _F64, "Share of A>0 tokens FP8 clips above the previous H."),
        Column("upper_clip_share_pos_after", _F64, "Share of A>0 tokens FP8 clips above the new H."),
        Column("upper_clip_share_pos_bf16", _F64, "Share of A>0 tokens BF16 clips above 1 + ε_high."),
        Column("balance_applied", _F64, "FP8 balance with the bounds applied next step (after smoothing)."),
        Column("previous_lower", _F64, "L in force before this calibration."),
        Column("previous_upper", _F64, "H in force before this calibration."),
        Column("tokens", pa.int64(), "Valid tokens the calibration used."),
        Column("negative_tokens", pa.int64(), "Of which with A < 0."),
        Column("nonfinite_tokens", pa.int64(), "Tokens with a non-finite ratio, left out of the calibration."),
        Column("status", pa.string(), "Calibration outcome ('ok', or why the previous bounds were kept)."),
        # subsampled shadow passes (fp8rl_core.calibration.subsample)
        Column("shadow_sequences", pa.int64(), "Sequences the BF16 shadow passes ran on (m)."),
        Column("total_sequences", pa.int64(), "Sequences of the batch (N); m = N: full shadow."),
        Column(
            "alpha_level_error",
            _F64,
            "Stated error of the subset's L in quantile levels (Hoeffding-Serfling, sequences as unit).",
        ),
        Column(
            "lower_error_bound",
            _F64,
            "Stated bound on |L_subset - L_full| (ratio units), holds with prob >= 1 - shadow_failure_prob.",
        ),
        Column(
            "lower_error_bootstrap",
            _F64,
            "Bootstrap (over sequences) (1 - delta)-quantile of the L error: tighter, approximate.",
        ),
        Column("shadow_failure_prob", _F64, "delta of the stated bounds."),
        # the raw-L estimator (fp8rl_core.calibration.estimators); NULL in runs written before it was recorded
        Column(
            "estimator",
            pa.string(),
            "Raw-L estimator (calibration.estimator): 'quantile' (the paper's rule), 'pooled', ...",
        ),
        Column(
            "lower_level",
            _F64,
            "Quantile level of the A<0 FP8 ratios the raw L aims at (pooled level for pooled estimators).",
        ),
        Column("lower_ci_low", _F64, "Lower end of the estimator's confidence interval for raw L (NULL: it has none)."),
        Column("lower_ci_high", _F64, "Upper end of that interval (level calibration.estimator_ci_level)."),
        Column(
            "estimator_shadow_tokens", pa.int64(), "Shadow-passed tokens the raw L rests on (pooled steps included)."
        ),
        Column("pooled_steps", pa.int64(), "Calibration steps the raw L pooled (1 = this step only)."),
        # the mismatch correction (algorithm.correction); thresholds NULL unless calibrated, all NULL in older runs
        Column("correction", pa.string(), "Mismatch correction in force (algorithm.correction.mode; NULL: tis off)."),
        Column("correction_lower", _F64, "Calibrated lower threshold, in force from the next step."),
        Column("correction_upper", _F64, "Calibrated upper threshold (cap), in force from the next step."),
        Column("correction_reference_lower", _F64, "The configured lower threshold it was calibrated against."),
        Column("correction_reference_upper", _F64, "The configured upper threshold it was calibrated against."),
        Column("correction_units", pa.int64(), "Units (tokens or sequences) with a BF16 shadow pass it used."),
        Column("correction_outside_share_bf16", _F64, "Share of units outside the configured thresholds, BF16 pi_old."),
        Column(
            "correction_outside_share_fp8_before", _F64, "The same share with FP8 pi_old (what FP8 noise adds)."
        ),
        Column("correction_outside_share_fp8_after", _F64, "Share with FP8 pi_old outside the calibrated thresholds."),
    ),
)

_BOUNDS_NAMES = [c.name for c in BOUNDS.columns]
BOUNDS_HEADLINE = tuple(_BOUNDS_NAMES[_BOUNDS_NAMES.index("mode") : _BOUNDS_NAMES.index("balance_after") + 1])
"""The calibration's own columns, ``mode`` through ``balance_after``: what a summary shows first."""

EVALS = TableSpec(
    "evals",
    "One row per evaluated sample: benchmark problem, sample index, correctness.",
    key_columns()
    + (
        Column("benchmark", pa.string(), "Benchmark name, e.g. 'aime24', 'math500'.", True),
        Column("problem_id", pa.string(), "Problem id within the benchmark.", True),
        Column("sample_index", pa.int16(), "Sample number for this problem (0..k-1)."),
        Column("correct", pa.bool_(), "Verifier judged the final answer correct."),
        Column("score", _F32, "Verifier score (1.0 / 0.0 unless partial)."),
        Column("predicted_answer", pa.string(), "Answer extracted from the response.", encoding="plain"),
        Column("response", pa.string(), "Generated text (may be NULL to save space).", encoding="plain"),
        Column("response_length", pa.int32(), "Response tokens."),
        Column("finish_reason", pa.string(), "'stop' or 'length'."),
        Column("temperature", _F32, "Sampling temperature."),
        Column(
            "tests_passed_fraction",
            _F32,
            "Code benchmarks: share of the response's test cases passed (NULL otherwise).",
        ),
    ),
)

EVAL_SCORES = TableSpec(
    "eval_scores",
    "Aggregated evaluation: one row per (benchmark, metric, k).",
    key_columns()
    + (
        Column("benchmark", pa.string(), "Benchmark name.", True),
        Column("metric", pa.string(), "'avg@k' (mean accuracy over k samples), 'pass@k', 'maj@k'.", True),
        Column("k", pa.int32(), "Samples per problem the metric uses.", True),
        Column("value", _F64, "The metric, a share in [0, 1].", True),
        Column("n_problems", pa.int32(), "Problems evaluated."),
    ),
)

LEDGER = TableSpec(
    "ledger",
    "Stage ledger (from ledger.jsonl): one row per (run, step, stage, attempt, variant).",
    key_columns()
    + (
        Column("stage", pa.string(), "Stage name: rollout, score, train, calibrate, evaluate, checkpoint, ...", True),
        Column("attempt", pa.int32(), "Attempt number (0 = first try; retries count up).", True),
        Column("status", pa.string(), "'running' (started, no outcome yet or crashed), 'done', 'failed'.", True),
        Column("started_at", pa.timestamp("us", tz="UTC"), "When the stage started (UTC)."),
        Column("finished_at", pa.timestamp("us", tz="UTC"), "When it finished or failed (UTC); NULL while running."),
        Column("seconds", _F64, "finished_at − started_at in seconds."),
        Column("outputs", pa.list_(pa.string()), "Files written, relative to the run directory."),
        Column("error", pa.string(), "One-line error of a failed attempt."),
        Column("host", pa.string(), "Host that ran the attempt."),
        Column("pid", pa.int32(), "Process id that ran the attempt."),
        Column("info", pa.string(), "JSON of the stage's recorded summary (e.g. why the guard rolled back)."),
    ),
    stored=False,
)

TABLES: dict[str, TableSpec] = {
    t.name: t for t in (ROLLOUTS, SCORES, TOKEN_STATS, STEPS, BOUNDS, EVALS, EVAL_SCORES, LEDGER)
}
STORED_TABLES = tuple(name for name, t in TABLES.items() if t.stored)


def get_table(name: str) -> TableSpec:
    """The spec of a table by name; an unknown name lists the valid ones."""
    try:
        return TABLES[name]
    except KeyError:
        raise SchemaError(f"unknown table {name!r}; tables: {', '.join(TABLES)}") from None
