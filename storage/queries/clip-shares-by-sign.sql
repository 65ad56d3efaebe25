-- name: clip-shares-by-sign
-- description: Per step, the share of tokens clipped below L (A<0) and above H (A>0), FP8 vs BF16.
--
-- From `token_stats` (steps with token stats only), one row per run and step.
--   lower_clip_share     A<0 and r8 < L, as a share of all valid tokens
--                        (matches steps.clipfrac_lower)
--   upper_clip_share     A>0 and r8 > H, share of all valid tokens
--   lower_clip_of_negative / upper_clip_of_positive   the same, as a share of
--                        the tokens of that advantage sign
--   bf16_lower_clip_share / bf16_upper_clip_share   what BF16 clips at the
--                        standard bounds (NULL without shadow pass)
-- FP8 lower share far above the BF16 one is the over-clipping that stops
-- bad outputs from being penalized.
SELECT
    run_id,
    step,
    count(*) AS tokens,
    avg((advantage < 0)::INTEGER) AS negative_share,
    avg(clipped_lower::INTEGER) AS lower_clip_share,
    avg(clipped_upper::INTEGER) AS upper_clip_share,
    sum(clipped_lower::INTEGER) / nullif(sum((advantage < 0)::INTEGER), 0) AS lower_clip_of_negative,
    sum(clipped_upper::INTEGER) / nullif(sum((advantage > 0)::INTEGER), 0) AS upper_clip_of_positive,
    avg(bf16_clipped_lower::INTEGER) AS bf16_lower_clip_share,
    avg(bf16_clipped_upper::INTEGER) AS bf16_upper_clip_share
FROM token_stats
GROUP BY run_id, step
ORDER BY run_id, step;
