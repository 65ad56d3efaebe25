-- name: behaviour-by-lag
-- description: The behaviour weight pi_old/mu by lag (step - 1 - policy_version): how far the rows a step trains on sit from the policy that trains them.
--
-- One row per run and lag. The lag is 0 in lockstep and rollout.max_staleness
-- with it (less in the first steps). The behaviour weight of a token is
-- pi_old / mu: the proximal policy (recomputed by the trainer before the
-- update, in the training precision) over the engine's own log-prob of the
-- sampled token. It holds both the staleness and the rollout mismatch, and it
-- is what algorithm.tis truncates; the PPO clip acts on pi_theta / pi_old.
--   tokens              token_stats rows (every token on shadow steps, a sample
--                       of algorithm.token_stats_sample otherwise)
--   mean_log_weight     mean of log pi_old - log mu
--   mean_abs_log_weight mean of its magnitude
--   weight_above_2      share of tokens whose weight exceeds 2 (token TIS's default cap)
-- and its two parts, where the rows carry rollouts.train_logp (the trainer's
-- log-prob in the training precision at the weights that sampled the row:
-- rollout.max_staleness >= 1, one process):
--   mean_lag_part       mean of log pi_tr(v_t) - log pi_tr(v_s): the policy moved (0 at lag 0)
--   mean_mismatch_part  mean of log pi_tr(v_s) - log mu(v_s): trainer against engine, same weights
--   mean_abs_lag_part, mean_abs_mismatch_part   their magnitudes
--   split_tokens        tokens with both parts
-- and, from the steps table, the clipping FP8 noise decides at that lag:
--   shadow_steps        shadow (calibration) steps at that lag
--   overclipped_share   mean over them of the share of A<0 tokens FP8 clips and BF16 would not
WITH weights AS (
SELECT
    t.run_id,
    t.step - 1 - r.policy_version AS lag,
    count(DISTINCT t.step) AS steps,
    count(*) AS tokens,
    avg(t.old_logp_fp8 - r.rollout_logp[t.position + 1]) AS mean_log_weight,
    avg(abs(t.old_logp_fp8 - r.rollout_logp[t.position + 1])) AS mean_abs_log_weight,
    avg(CASE WHEN t.old_logp_fp8 - r.rollout_logp[t.position + 1] > ln(2) THEN 1.0 ELSE 0.0 END) AS weight_above_2,
    avg(t.old_logp_fp8 - r.train_logp[t.position + 1]) AS mean_lag_part,
    avg(r.train_logp[t.position + 1] - r.rollout_logp[t.position + 1]) AS mean_mismatch_part,
    avg(abs(t.old_logp_fp8 - r.train_logp[t.position + 1])) AS mean_abs_lag_part,
    avg(abs(r.train_logp[t.position + 1] - r.rollout_logp[t.position + 1])) AS mean_abs_mismatch_part,
    count(r.train_logp[t.position + 1]) AS split_tokens
FROM token_stats t
JOIN rollouts r USING (run_id, variant, step, sample_id)
GROUP BY t.run_id, lag
),
step_lag AS (
    SELECT run_id, variant, step, min(step - 1 - policy_version) AS lag FROM rollouts GROUP BY ALL
),
shadow AS (
    SELECT s.run_id, l.lag, count(*) AS shadow_steps, avg(s.overclipped_share) AS overclipped_share
    FROM steps s
    JOIN step_lag l USING (run_id, variant, step)
    WHERE s.overclipped_share IS NOT NULL
    GROUP BY s.run_id, l.lag
)
SELECT w.*, coalesce(h.shadow_steps, 0) AS shadow_steps, h.overclipped_share
FROM weights w
LEFT JOIN shadow h USING (run_id, lag)
ORDER BY w.run_id, w.lag;
