-- name: bound-estimates
-- description: How each calibration estimated raw L, what it rested on, and how well the L it set held at the next calibration.
--
-- One row per calibration (view `bounds`, variant 'main'), by run and step.
--   estimator                 calibration.estimator ('quantile' = the paper's rule; NULL in runs
--                             written before the estimators were recorded)
--   bf16_clipped              A<0 tokens BF16 clips at 1 - eps_low on this step (alpha x negative_tokens):
--                             the k the paper's rule rests on
--   lower_level               the quantile level of the A<0 FP8 ratios raw L aims at
--   raw_lower, lower_ci_low, lower_ci_high, lower_ci_width
--                             raw L and its interval (harrell_davis; NULL for the others)
--   estimator_shadow_tokens, pooled_steps   the shadow tokens and calibration steps raw L rests on
--   lower                     the L in force from the next step (after smoothing and clamping)
--   next_calibration          the run's next calibration step (NULL for the last)
--   next_fp8_share            FP8's lower-clip share of the A<0 tokens there, under this L
--   next_bf16_share           BF16's share there, at 1 - eps_low
--   next_share_error          |next_fp8_share - next_bf16_share|: how well this L predicted BF16's
--                             clipping; its mean over a run, at calibration steps only, is the
--                             predictive clip-share error of benchmarks/schedule_replay.py
SELECT
    run_id,
    step,
    estimator,
    round(alpha * negative_tokens) AS bf16_clipped,
    negative_tokens,
    lower_level,
    raw_lower,
    lower_ci_low,
    lower_ci_high,
    lower_ci_high - lower_ci_low AS lower_ci_width,
    estimator_shadow_tokens,
    pooled_steps,
    lower,
    lead(step) OVER w AS next_calibration,
    lead(lower_clip_share_neg_before) OVER w AS next_fp8_share,
    lead(lower_clip_share_neg_bf16) OVER w AS next_bf16_share,
    abs(lead(lower_clip_share_neg_before) OVER w - lead(lower_clip_share_neg_bf16) OVER w) AS next_share_error
FROM bounds
WINDOW w AS (PARTITION BY run_id ORDER BY step)
ORDER BY run_id, step;
