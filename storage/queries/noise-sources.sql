-- name: noise-sources
-- description: Ratio noise (training quantization) vs TIS-weight noise and the rollout-vs-BF16 mismatch, per calibration step.
--
-- Shadow (calibration) steps only; every column an NMAE against the BF16
-- reference over valid tokens (fp8rl_core.noise_sources):
--   ratio_noise_nmae        r8 vs r16: the only noise in the PPO ratio (pi_old is
--                           recomputed in the training precision)
--   tis_weight_nmae         TIS weight from FP8 pi_old vs from BF16 pi_old
--   rollout_bf16_prob_nmae  rollout-engine probabilities vs BF16 pi_old
--   rollout_bf16_tis_nmae   the TIS weight that mismatch implies, vs 1
--   rollout_fp8_prob_nmae   rollout probabilities vs FP8 pi_old (what TIS sees)
--   tis_over_ratio          tis_weight_nmae / ratio_noise_nmae
SELECT
    run_id,
    step,
    ratio_noise_nmae,
    tis_weight_nmae,
    rollout_bf16_prob_nmae,
    rollout_bf16_tis_nmae,
    rollout_fp8_prob_nmae,
    tis_weight_nmae / nullif(ratio_noise_nmae, 0) AS tis_over_ratio
FROM steps
WHERE ratio_noise_nmae IS NOT NULL
ORDER BY run_id, step;
