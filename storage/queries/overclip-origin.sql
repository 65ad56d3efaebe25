-- name: overclip-origin
-- description: Over- and under-clipped tokens per step, and whether FP8 error in pi_theta or pi_old caused them.
--
-- Steps with a BF16 shadow pass only. A token is over-clipped when BF16
-- would keep its gradient but FP8 zeroes it (A<0, r16 >= 1-eps_low, r8 < L),
-- under-clipped in the opposite case. The ratio error in log space splits
-- into the FP8 error of the current policy and of the old policy:
--   log r8 - log r16 = (logp_fp8 - logp_bf16) - (old_logp_fp8 - old_logp_bf16)
--   from_policy_share    share of over-clipped tokens where the pi_theta term
--                        is the larger in magnitude (else pi_old's)
--   policy_logp_error / old_logp_error   mean of each term over them
SELECT
    run_id,
    step,
    count(*) FILTER (WHERE advantage < 0) AS negative_tokens,
    count(*) FILTER (WHERE overclipped) AS overclipped,
    count(*) FILTER (WHERE underclipped) AS underclipped,
    count(*) FILTER (WHERE overclipped) / nullif(count(*) FILTER (WHERE advantage < 0), 0) AS overclip_of_negative,
    count(*) FILTER (WHERE underclipped) / nullif(count(*) FILTER (WHERE advantage < 0), 0) AS underclip_of_negative,
    count(*) FILTER (WHERE overclipped AND abs(logp_fp8 - logp_bf16) >= abs(old_logp_fp8 - old_logp_bf16))
        / nullif(count(*) FILTER (WHERE overclipped), 0) AS from_policy_share,
    avg(logp_fp8 - logp_bf16) FILTER (WHERE overclipped) AS policy_logp_error,
    avg(old_logp_fp8 - old_logp_bf16) FILTER (WHERE overclipped) AS old_logp_error
FROM token_stats
WHERE bf16_clipped_lower IS NOT NULL
GROUP BY run_id, step
ORDER BY run_id, step;
