"""The figures of ``fp8rl report``: one SQL query and a panel layout each.

A figure is data, not code: the SQL (over the catalog's views, see
``storage.queries.catalog``) returns ``run_id``, ``step`` and one column per plotted
quantity, ordered by run and step; each :class:`Panel` draws the columns whose
names match its regex, one colour per run and one line style per column. The
same SQL is printed under the figure in the report and saved next to it, so a
reader can re-run or adapt it with ``fp8rl query RUN_DIR "$(cat report/<name>.sql)"``.

Which quantities, and why (docs/method.md, the paper's figures):

- reward, evaluation, entropy, response length, garbled share: the collapse
  the paper describes for vanilla FP8 — entropy surges, responses lengthen
  and turn to garbage, reward and accuracy fall;
- clip shares by advantage sign: FP8 noise pushes negative-advantage tokens
  under L, where their gradient is zeroed (bad outputs stop being penalized);
- calibrated bounds and α: what Calibrated Clipping does about it;
- probability vs ratio NMAE and their quotient: the noise amplification
  (1.7×–2.9× in the paper), measured on BF16 shadow steps only;
- over-clipped share and lower-clip share of A<0 tokens, FP8 vs BF16;
- clip shares by token-entropy bin: where the noise bites;
- stage timings: what a step costs, from the ledger.

Columns that a run lacks (e.g. a run without shadow steps) make a panel or the
whole figure "no data" with the reason; nothing renders empty axes.

The comparison table (the ``paper-table`` named query) is printed as markdown
by :func:`paper_table_markdown`, shared by ``fp8rl report`` and ``fp8rl sweep``.
"""

from __future__ import annotations

import re
from typing import Any

from flows.report.spec import Figure, Panel

# Edges of the token-entropy bins (nats), the same as stages/train.py's
# ENTROPY_BIN_EDGES so the figure and the trainer's per-bin metrics agree.
_ENTROPY_BINS_SQL = """\
-- Clip shares per token-entropy bin and step, from token_stats (every token on
-- shadow steps, a seeded sample on the others). Bins in nats: edit the CASE.
PIVOT (
    SELECT
        run_id,
        step,
        CASE WHEN entropy < 0.1 THEN 'H<0.1' WHEN entropy < 0.5 THEN '0.1-0.5'
             WHEN entropy < 1.0 THEN '0.5-1' WHEN entropy < 2.0 THEN '1-2' ELSE 'H>=2' END AS bin,
        avg(clipped_lower::INTEGER) AS lower,
        avg(clipped_upper::INTEGER) AS upper
    FROM token_stats
    WHERE entropy IS NOT NULL
    GROUP BY ALL
)
ON bin IN ('H<0.1', '0.1-0.5', '0.5-1', '1-2', 'H>=2')
USING first(lower) AS lower, first(upper) AS upper
ORDER BY run_id, step"""

FIGURES: tuple[Figure, ...] = (
    Figure(
        "reward",
        "Reward and training accuracy",
        "Mean reward and share of correct samples of each step's rollouts.",
        "SELECT run_id, step, reward_mean, accuracy\nFROM steps\nORDER BY run_id, step",
        (Panel("reward_mean", "mean reward", "reward"), Panel("accuracy", "training accuracy", "share correct")),
    ),
    Figure(
        "evaluation",
        "Evaluation scores",
        "Held-out benchmarks on evaluation steps (step 0 = the base model), one panel per benchmark and metric.",
        "PIVOT (\n    SELECT run_id, step, benchmark || ' ' || replace(metric, '@k', '@' || k) AS score, value\n"
        "    FROM eval_scores\n)\nON score USING avg(value)\nORDER BY run_id, step",
        (Panel(".*", ylabel="score", each=True),),
        no_data="no evaluation in these runs",
        markers=True,
    ),
    Figure(
        "entropy",
        "Policy entropy",
        "Mean token entropy of the policy over valid response tokens (nats). "
        "A mid-training surge is the FP8 collapse the paper describes. Dashed: the surge threshold, "
        "1.5x the median of the previous 10 steps (docs/method.md: a surge is 3+ steps above the "
        "threshold of its first step; the failure-signals query lists them).",
        "SELECT\n    run_id,\n    step,\n    entropy_mean,\n"
        "    CASE WHEN count(entropy_mean) OVER w10 = 10 THEN 1.5 * median(entropy_mean) OVER w10 END AS "
        "surge_threshold\n"
        "FROM steps\nWINDOW w10 AS (PARTITION BY run_id ORDER BY step ROWS BETWEEN 10 PRECEDING AND 1 PRECEDING)\n"
        "ORDER BY run_id, step",
        (Panel("entropy_mean|surge_threshold", "mean token entropy", "nats"),),
    ),
    Figure(
        "response_length",
        "Response length",
        "Mean response length (tokens) of each step's rollouts.",
        "SELECT run_id, step, response_length_mean\nFROM steps\nORDER BY run_id, step",
        (Panel("response_length_mean", "mean response length", "tokens"),),
    ),
    Figure(
        "clip_by_sign",
        "Clip shares by advantage sign",
        "Share of all valid tokens clipped below L with A<0 (gradient zeroed: a bad token goes "
        "unpenalized) and above H with A>0, with the bounds in force.",
        "SELECT run_id, step, clipfrac_lower, clipfrac_upper, lower_bound, upper_bound\nFROM steps\nORDER BY "
        "run_id, step",
        (
            Panel("clipfrac_lower", "A<0 and r < L", "share of tokens"),
            Panel("clipfrac_upper", "A>0 and r > H", "share of tokens"),
            Panel(
                "lower_bound|upper_bound",
                "bounds in force",
                "ratio",
                labels=(("lower_bound", "L"), ("upper_bound", "H")),
            ),
        ),
    ),
    Figure(
        "bounds",
        "Calibrated bounds and α",
        "Each calibration: the raw bounds (α-quantile L, balance-matching H) and the smoothed, clamped "
        "ones in force from the next step; α is the share of A<0 tokens BF16 clips at 1 − ε_low.",
        "SELECT run_id, step, lower, raw_lower, upper, raw_upper, alpha\nFROM bounds\nORDER BY run_id, step",
        (
            Panel("lower|raw_lower", "lower bound L", "ratio", labels=(("lower", "smoothed"), ("raw_lower", "raw"))),
            Panel("upper|raw_upper", "upper bound H", "ratio", labels=(("upper", "smoothed"), ("raw_upper", "raw"))),
            Panel("alpha", "α (BF16 lower-clip share of A<0 tokens)", "share"),
        ),
        no_data="no calibration in these runs",
        markers=True,
    ),
    Figure(
        "noise",
        "FP8 noise: probability vs ratio NMAE",
        "On BF16 shadow steps: NMAE of FP8 against BF16 token probabilities and importance ratios, and their "
        "quotient, the ratio-noise amplification (1.7×–2.9× in the paper).",
        "SELECT run_id, step, prob_nmae, ratio_nmae, ratio_nmae / nullif(prob_nmae, 0) AS amplification\n"
        "FROM steps\nWHERE prob_nmae IS NOT NULL\nORDER BY run_id, step",
        (
            Panel(
                "prob_nmae|ratio_nmae",
                "NMAE vs BF16",
                "NMAE",
                labels=(("prob_nmae", "probability"), ("ratio_nmae", "ratio")),
            ),
            Panel("amplification", "ratio NMAE / probability NMAE", "×"),
        ),
        no_data="no BF16 shadow steps in these runs (prob_nmae is NULL everywhere)",
        markers=True,
    ),
    Figure(
        "overclip",
        "Over-clipping",
        "On shadow steps: tokens FP8 clips below L although BF16 would not (over-clipped) and the reverse "
        "(under-clipped), as shares of all tokens; and the share of A<0 tokens clipped below the lower bound "
        "by FP8 and by BF16.",
        "SELECT\n    run_id,\n    step,\n    avg(overclipped::INTEGER) AS overclipped,\n"
        "    avg(underclipped::INTEGER) AS underclipped,\n"
        "    sum(clipped_lower::INTEGER) / nullif(sum((advantage < 0)::INTEGER), 0) AS fp8_lower_clip_of_negative,\n"
        "    sum(bf16_clipped_lower::INTEGER) / nullif(sum((advantage < 0)::INTEGER), 0) AS "
        "bf16_lower_clip_of_negative\n"
        "FROM token_stats\nWHERE bf16_clipped_lower IS NOT NULL\nGROUP BY run_id, step\nORDER BY run_id, step",
        (
            Panel("overclipped|underclipped", "over- / under-clipped tokens", "share of tokens"),
            Panel(
                ".*_lower_clip_of_negative",
                "lower-clip share of A<0 tokens",
                "share",
                labels=(
                    ("fp8_lower_clip_of_negative", "FP8 (r8 < L)"),
                    ("bf16_lower_clip_of_negative", "BF16 (r16 < 1-ε_low)"),
                ),
            ),
        ),
        no_data="no BF16 shadow steps in these runs",
        markers=True,
    ),
    Figure(
        "entropy_bins",
        "Clip shares by token-entropy bin",
        "Per entropy bin (nats), the share of the bin's tokens clipped below L with A<0 (solid) and above H "
        "with A>0 (dashed). FP8 noise, and hence clipping, concentrates on high-entropy tokens.",
        _ENTROPY_BINS_SQL,
        tuple(
            Panel(
                re.escape(b) + "_(lower|upper)",
                f"entropy {b} nats",
                "share of bin's tokens",
                labels=((f"{b}_lower", "A<0, r<L"), (f"{b}_upper", "A>0, r>H")),
            )
            for b in ("H<0.1", "0.1-0.5", "0.5-1", "1-2", "H>=2")
        ),
        no_data="no token_stats with entropy in these runs",
    ),
    Figure(
        "garbled",
        "Garbled outputs",
        "Share of each step's responses the garbled-output detector flags (the end state of an FP8 collapse).",
        "SELECT run_id, step, garbled_share\nFROM steps\nORDER BY run_id, step",
        (Panel("garbled_share", "garbled responses", "share"),),
        no_data="these runs record no garbled_share",
    ),
    Figure(
        "timings",
        "Stage timings",
        "Seconds per stage and step, from the ledger (all attempts of a stage summed; retries included).",
        "PIVOT (\n    SELECT run_id, step, stage, seconds\n    FROM ledger\n    WHERE seconds IS NOT NULL\n)\n"
        "ON stage USING sum(seconds)\nORDER BY run_id, step",
        (Panel(".*", ylabel="seconds", each=True),),
        no_data="the ledgers of these runs record no finished stage",
        markers=True,
    ),
)


# --------------------------------------------------------------------------- the comparison table, as text

# (paper-table column, markdown header, format): 'pct' a share shown in %, 'x' a quotient.
TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("best_eval_average", "best eval %", "pct"),
    ("initial_eval_average", "step-0 eval %", "pct"),
    ("late_eval_average", "2nd-half eval %", "pct"),
    ("final_eval_average", "final eval %", "pct"),
    ("final_entropy", "final entropy", "f3"),
    ("peak_entropy", "peak entropy", "f3"),
    ("prob_nmae", "prob NMAE", "g3"),
    ("ratio_nmae", "ratio NMAE", "g3"),
    ("amplification", "ratio/prob", "x"),
    ("lower_clip_vs_bf16", "A<0 lower-clip vs BF16", "x"),
    ("overclipped_share", "over-clipped %", "pct2"),
    ("mean_response_length", "mean length", "f1"),
    ("wall_seconds", "wall s", "f0"),
)


# (failure-signals column, markdown header, format): the failure's signals (docs/method.md,
# per run, from the ``failure-signals`` query; the sweep table shows them per cell.
FAILURE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("first_surge_step", "first entropy surge", "d"),
    ("garbled_peak", "garbled peak %", "pct"),
    ("garbled_last10", "garbled last-10 %", "pct"),
    ("clip_lower_mean", "A<0 clipped % (low)", "pct2"),
    ("clip_upper_mean", "A>0 clipped % (high)", "pct2"),
    ("accuracy_first10", "train acc first-10 %", "pct"),
    ("accuracy_last10", "train acc last-10 %", "pct"),
)


def _fmt(value: Any, kind: str) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "—"
    if kind == "d":
        return str(int(value))
    if kind == "s":  # text made elsewhere (a seed spread)
        return str(value)
    if kind == "pct":
        return f"{100 * value:.1f}"
    if kind == "pct2":
        return f"{100 * value:.2f}"
    if kind == "x":
        return f"{value:.2f}×"
    if kind == "g3":
        return f"{value:.3g}"
    return f"{value:.{int(kind[1:])}f}"


def paper_table_markdown(
    rows: list[dict], keys: list[str], columns: tuple[tuple[str, str, str], ...] = TABLE_COLUMNS
) -> str:
    """A GitHub-flavoured markdown table of ``rows``: ``keys`` first, then ``columns`` formatted."""
    head = keys + [h for _, h, _ in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(keys) + ["---:"] * len(columns)) + "|"]
    for r in rows:
        cells = [str(r.get(k, "")) for k in keys] + [_fmt(r.get(c), kind) for c, _, kind in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# noise sources, drift signal, guard trips (their own module; appended here)
from flows.report.figures_calibration import EXTRA_FIGURES  # noqa: E402  (it imports only flows.report.spec)

FIGURES = FIGURES + EXTRA_FIGURES
