-- name: calibration-history
-- description: Every calibration of every run: alpha, raw and smoothed L/H, target and achieved balance.
--
-- One row per calibration (view `bounds`, variant 'main'), by run and step.
-- The bounds computed at step t are used from step t + 1.
--   alpha                  share of A<0 tokens BF16 clips at 1 - eps_low
--   raw_lower / raw_upper  before smoothing and clamping
--   lower / upper          in force from the next step
--   lower_change / upper_change   against the run's previous calibration
--   target_balance         BF16 Pos/Neg at the standard bounds
--   balance_before/after   FP8 Pos/Neg with the previous / new bounds
-- For a what-if re-run, query `bounds_variants` and compare by variant.
SELECT
    run_id,
    step,
    mode,
    alpha,
    raw_lower,
    lower,
    lower - lag(lower) OVER w AS lower_change,
    raw_upper,
    upper,
    upper - lag(upper) OVER w AS upper_change,
    target_balance,
    balance_before,
    balance_after,
    lower_clip_share_neg_before,
    lower_clip_share_neg_after,
    tokens
FROM bounds
WINDOW w AS (PARTITION BY run_id ORDER BY step)
ORDER BY run_id, step;
