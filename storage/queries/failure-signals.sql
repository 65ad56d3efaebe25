-- name: failure-signals
-- description: One row per run: the failure's signals (docs/method.md, "Failure signals"): first entropy surge, garbled share, clip shares by sign, accuracy, noise amplification.
-- param: factor = 1.5 : surge threshold, a multiple of the median entropy of the previous 10 steps
--
-- Entropy surge (docs/method.md; fp8rl_core.failure_signals): a step whose
-- steps.entropy_mean exceeds factor x the median of the previous 10 steps and
-- stays above that threshold for at least 3 steps (10 and 3 are the defaults of
-- the surge.* config fields; this SQL fixes them, the Python function takes them).
-- first_surge_step is NULL when no step qualifies. garbled_share is the share of
-- responses the task's answer parser cannot read. Shares are in [0, 1].
--   surge_steps          steps that open a surge (overlapping onsets counted; the
--                        Python function counts each surge once)
--   garbled_peak / garbled_final   max / last steps.garbled_share
--   garbled_first10 / garbled_last10   mean garbled share of the first / last 10 steps
--                        (a rising garbled share: last10 well above first10)
--   clip_lower_mean / clip_upper_mean   mean share of tokens clipped with A<0 below L
--                        / with A>0 above H
--   accuracy_first10 / accuracy_last10   mean training accuracy of the first / last 10 steps
--   prob_nmae / ratio_nmae / amplification   as in paper-table (shadow steps)
WITH s AS (
    SELECT
        run_id, step, entropy_mean, garbled_share, clipfrac_lower, clipfrac_upper, accuracy, prob_nmae, ratio_nmae,
        median(entropy_mean) OVER w10 AS median10,
        count(entropy_mean) OVER w10 AS history,
        lead(entropy_mean, 1) OVER (PARTITION BY run_id ORDER BY step) AS next1,
        lead(entropy_mean, 2) OVER (PARTITION BY run_id ORDER BY step) AS next2,
        row_number() OVER (PARTITION BY run_id ORDER BY step) AS k,
        row_number() OVER (PARTITION BY run_id ORDER BY step DESC) AS k_desc
    FROM steps
    WINDOW w10 AS (PARTITION BY run_id ORDER BY step ROWS BETWEEN 10 PRECEDING AND 1 PRECEDING)
), flagged AS (
    SELECT *,
        history = 10
        AND entropy_mean > getvariable('factor') * median10
        AND next1 > getvariable('factor') * median10
        AND next2 > getvariable('factor') * median10 AS surge_onset
    FROM s
)
SELECT
    run_id,
    max(step) AS last_step,
    min(CASE WHEN surge_onset THEN step END) AS first_surge_step,
    sum(surge_onset::INTEGER) AS surge_steps,
    max(garbled_share) AS garbled_peak,
    arg_max(garbled_share, step) AS garbled_final,
    avg(CASE WHEN k <= 10 THEN garbled_share END) AS garbled_first10,
    avg(CASE WHEN k_desc <= 10 THEN garbled_share END) AS garbled_last10,
    avg(clipfrac_lower) AS clip_lower_mean,
    avg(clipfrac_upper) AS clip_upper_mean,
    avg(CASE WHEN k <= 10 THEN accuracy END) AS accuracy_first10,
    avg(CASE WHEN k_desc <= 10 THEN accuracy END) AS accuracy_last10,
    avg(prob_nmae) AS prob_nmae,
    avg(ratio_nmae) AS ratio_nmae,
    avg(ratio_nmae) / nullif(avg(prob_nmae), 0) AS amplification
FROM flagged
GROUP BY run_id
ORDER BY run_id;
