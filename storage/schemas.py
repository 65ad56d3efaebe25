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

Schema versions: ``SCHEMA_VERSION`` is written into every Parquet file's
key-value metadata (``fp8rl.schema_version``) and into ``run.json``. Versions
from ``MIN_READABLE_SCHEMA_VERSION`` up to the current one read fine (changes
between them are additive); anything else fails with :class:`SchemaVersionError`
naming the file and the versions involved.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc

from storage.errors import SchemaError, SchemaVersionError

SCHEMA_VERSION = 1
MIN_READABLE_SCHEMA_VERSION = 1
META_VERSION = b"fp8rl.schema_version"
META_TABLE = b"fp8rl.table"
MAIN_VARIANT = "main"

# Stage names go into file names as a '-'-separated field: no '-' allowed.
STAGE_NAME = re.compile(r"^[A-Za-z0-9_.]+$")
# Variants and run ids go into paths: a conservative, shell-friendly alphabet.
VARIANT_NAME = re.compile(r"^[A-Za-z0-9_.+=-]+$")
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=-]*$")


@dataclass(frozen=True)
class Column:
    """One column: name, arrow type, meaning and how Parquet should encode it.

    ``encoding``: 'dict' (dictionary + RLE; low-cardinality values), 'bss'
    (BYTE_STREAM_SPLIT; noisy floats), 'delta' (DELTA_BINARY_PACKED; ids and
    positions that count up) or 'plain'.
    ``required``: the writer refuses rows without it (instead of writing NULLs).
    """

    name: str
    type: pa.DataType
    doc: str
    required: bool = False
    encoding: str = "dict"


@dataclass(frozen=True)
class TableSpec:
    """A table: its stored columns, the columns the catalog derives, its rules.

    Strict: a column a writer passes that the table does not declare is a
    :class:`SchemaError` naming it (a typo must not become a new column).
    Adding a column is one line here. ``extra_pattern`` declares a family of
    columns by name (``steps``: per-stage timings ``<stage>_seconds``), stored
    as ``extra_type``. ``merge_rows``: the view folds the rows written by
    different stages for one (run, step, variant) into a single row.
    ``stored``: False for the ledger (JSONL, not Parquet; the schema is its view's).
    ``fill``: completes conformed rows before writing (token_stats: clip flags).
    """

    name: str
    doc: str
    columns: tuple[Column, ...]
    derived: tuple[tuple[str, str, str], ...] = ()  # (name, SQL expression, doc)
    extra_type: pa.DataType | None = None
    extra_pattern: re.Pattern | None = None
    merge_rows: bool = False
    stored: bool = True
    fill: Callable[[pa.Table], pa.Table] | None = None
    _by_name: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name.update({c.name: c for c in self.columns})

    def column(self, name: str) -> Column | None:
        return self._by_name.get(name)

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def schema(self) -> pa.Schema:
        """The stored schema, with each column's doc and the version in the metadata."""
        fields = [pa.field(c.name, c.type, nullable=not c.required, metadata={"doc": c.doc}) for c in self.columns]
        return pa.schema(fields, metadata={META_VERSION: str(SCHEMA_VERSION).encode(), META_TABLE: self.name.encode()})


def _key_columns() -> tuple[Column, ...]:
    return (
        Column("run_id", pa.string(), "Run id (the run directory's name, from run.json).", required=True),
        Column("step", pa.int64(), "RL step that produced the row (0 = before any update).", required=True),
        Column("variant", pa.string(), "'main' for the campaign; another name for a re-run of a stage.", required=True),
    )


def _ratio_sql(logp: str, old_logp: str) -> str:
    # CASE with FLOAT literals, not least/greatest: those are ~7x slower in DuckDB
    # and skip NULLs (least(NULL, 20) = 20). A NULL difference falls to ELSE: NULL.
    d = f"({logp} - {old_logp})"
    return f"exp(CASE WHEN {d} > 20::FLOAT THEN 20::FLOAT WHEN {d} < -20::FLOAT THEN -20::FLOAT ELSE {d} END)::FLOAT"


def _ratio(logp: pa.ChunkedArray, old_logp: pa.ChunkedArray) -> pa.ChunkedArray:
    """float32 r = exp(clamp(logp − old_logp, −20, 20)); NULL where an input is NULL."""
    d = pc.subtract(logp, old_logp)
    lim = pa.scalar(20.0, pa.float32())
    d = pc.max_element_wise(pc.min_element_wise(d, lim, skip_nulls=False), pc.negate(lim), skip_nulls=False)
    return pc.exp(d)


def fill_clip_flags(t: pa.Table) -> pa.Table:
    """Compute token_stats' clip flags that the writer was not given (docs/method.md, "Clip metrics").

    clipped_lower = A<0 ∧ r8<L, clipped_upper = A>0 ∧ r8>H; the bf16 ones use
    r16 and the standard bounds. NULL propagates (no shadow pass → NULL), so
    overclipped/underclipped in the view are NULL rather than false there.
    """
    if t.column("clipped_lower").null_count < t.num_rows and t.column("bf16_clipped_lower").null_count < t.num_rows:
        return t  # given by the trainer
    adv = t.column("advantage")
    neg, pos = pc.less(adv, 0), pc.greater(adv, 0)
    for prefix, logp, old, lo, hi in (
        ("", "logp_fp8", "old_logp_fp8", "lower_bound", "upper_bound"),
        ("bf16_", "logp_bf16", "old_logp_bf16", "standard_lower", "standard_upper"),
    ):
        if t.column(f"{prefix}clipped_lower").null_count < t.num_rows:
            continue
        r = _ratio(t.column(logp), t.column(old))
        for name, flag in (
            (f"{prefix}clipped_lower", pc.and_(neg, pc.less(r, t.column(lo)))),
            (f"{prefix}clipped_upper", pc.and_(pos, pc.greater(r, t.column(hi)))),
        ):
            t = t.set_column(t.schema.get_field_index(name), t.schema.field(name), flag)
    return t


_F32 = pa.float32()
_F64 = pa.float64()

ROLLOUTS = TableSpec(
    "rollouts",
    "One row per generated sample (response) of a step.",
    _key_columns()
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
        Column("policy_version", pa.int64(), "Step of the weights that generated it (off-policy lag = step − this)."),
        Column("precision", pa.string(), "Rollout precision: 'bf16', 'fp8_per_tensor', 'fp8_per_block'."),
    ),
)

SCORES = TableSpec(
    "scores",
    "One row per sample: verifier outcome, shaped reward, advantage, DAPO filtering.",
    _key_columns()
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
    _key_columns()
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
            _ratio_sql("logp_fp8", "old_logp_fp8"),
            "r8 = exp(clamp(logp_fp8 − old_logp_fp8, −20, 20)) (docs/method.md).",
        ),
        (
            "ratio_bf16",
            _ratio_sql("logp_bf16", "old_logp_bf16"),
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
    _key_columns() + tuple(Column(n, _F64, d) for n, d in _STEP_METRICS),
    extra_type=_F64,
    # timings of stages and phases; clip shares per entropy bin (diagnostics)
    extra_pattern=re.compile(r"^([a-z][a-z0-9_]*_(seconds|s)|clipfrac_(lower|upper)_entropy_bin\d+)$"),
    merge_rows=True,
)

BOUNDS = TableSpec(
    "bounds",
    "Calibration history: one row per calibration; the bounds apply from step + 1.",
    _key_columns()
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

EVALS = TableSpec(
    "evals",
    "One row per evaluated sample: benchmark problem, sample index, correctness.",
    _key_columns()
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
    _key_columns()
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
    _key_columns()
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


def check_schema_version(version: int | str | None, where: str) -> int:
    """Return ``version`` as int if this code reads it, else raise a clear error about ``where``."""
    if version is None:
        raise SchemaVersionError(f"{where}: no fp8rl schema version recorded; not written by fp8rl storage")
    try:
        v = int(version)
    except (TypeError, ValueError):
        raise SchemaVersionError(f"{where}: schema version {version!r} is not an integer") from None
    if v > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{where}: written with schema version {v}, newer than this fp8rl's {SCHEMA_VERSION}; upgrade fp8rl to "
            f"read it"
        )
    if v < MIN_READABLE_SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{where}: schema version {v} is older than the oldest readable ({MIN_READABLE_SCHEMA_VERSION}); "
            "read it with the fp8rl release that wrote it"
        )
    return v


def check_name(kind: str, value: str, pattern: re.Pattern) -> str:
    """Validate a stage / variant / run id that ends up in a path."""
    if not isinstance(value, str) or not pattern.match(value):
        raise SchemaError(f"bad {kind} {value!r}: allowed characters are {pattern.pattern}")
    return value
