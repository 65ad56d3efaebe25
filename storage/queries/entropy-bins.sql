-- name: entropy-bins
-- description: Clip shares by token-entropy bin over all steps: where in the distribution does clipping hit?
-- param: bin_width = 0.25 : width of an entropy bin (nats)
-- param: max_entropy = 4.0 : tokens above this entropy share the last bin (nats)
--
-- From `token_stats`, one row per run and entropy bin [entropy_from,
-- entropy_from + bin_width), all steps together.
--   lower_clip_share / upper_clip_share   as in clip-shares-by-sign
--   overclip_share       over-clipped tokens (see overclip-origin) among the
--                        bin's tokens with a shadow pass
--   mean_abs_log_ratio_error  |log r8 - log r16|, the FP8 ratio noise in the bin
-- FP8 noise, and hence over-clipping, concentrates on high-entropy tokens.
SELECT
    run_id,
    -- CASE rather than least(): DuckDB's least/greatest are several times slower
    floor((CASE WHEN entropy < getvariable('max_entropy') THEN entropy ELSE getvariable('max_entropy') END)
          / getvariable('bin_width')) * getvariable('bin_width') AS entropy_from,
    count(*) AS tokens,
    avg(clipped_lower::INTEGER) AS lower_clip_share,
    avg(clipped_upper::INTEGER) AS upper_clip_share,
    avg(overclipped::INTEGER) AS overclip_share,
    avg(abs((logp_fp8 - old_logp_fp8) - (logp_bf16 - old_logp_bf16))) AS mean_abs_log_ratio_error
FROM token_stats
WHERE entropy IS NOT NULL
GROUP BY ALL
ORDER BY run_id, entropy_from;
