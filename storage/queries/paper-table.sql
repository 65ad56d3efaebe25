-- name: paper-table
-- description: One row per run: best eval average, entropy, FP8 noise (prob/ratio NMAE), lower-clip share vs BF16, over-clipping, length, wall time.
-- param: metric = avg@k : eval_scores.metric behind the evaluation average ('avg@k', 'pass@k', 'maj@k')
--
-- The comparison table of the paper (Chen et al. 2026), per run (= per setting
-- of a sweep). Shares are in [0, 1]; "shadow steps" are the steps with a BF16
-- shadow pass (calibration steps), where FP8 and BF16 can be compared.
--   clip_mode            bounds.mode of the run's calibrations
--   last_step            highest step with a steps row
--   best_eval_average / best_eval_step   best benchmark average (largest k per
--                        benchmark, averaged over benchmarks; only evaluations
--                        with as many benchmarks as the run's fullest one)
--   initial_eval_average the first such evaluation (step 0: the base model)
--   late_eval_average    mean of those evaluations in the run's second half (step
--                        >= half the last evaluated step): best-of-N evaluations is
--                        biased upward by evaluation noise, this mean is not
--   final_eval_average   the last such evaluation
--   final_entropy / peak_entropy   steps.entropy_mean at the last step / its max
--   prob_nmae / ratio_nmae   mean over shadow steps of the per-step NMAE of FP8
--                        vs BF16 token probabilities / importance ratios
--   amplification        ratio_nmae / prob_nmae (ratio-noise amplification; the
--                        paper measures 1.7x-2.9x); NULL when prob_nmae is 0 (BF16)
--   lower_clip_neg_fp8 / lower_clip_neg_bf16   on shadow-step tokens, the share
--                        of negative-advantage tokens clipped below L by FP8
--                        (r8 < L in force) / by BF16 (r16 < 1 - eps_low)
--   lower_clip_vs_bf16   their quotient: 1 = FP8 silences as many bad tokens as
--                        BF16 would; > 1 = over-clipping (what calibration fixes)
--   overclipped_share    over-clipped tokens (A<0, r16 >= 1-eps_low, r8 < L)
--                        among all shadow-step tokens
--   mean_response_length mean of steps.response_length_mean (tokens)
--   wall_seconds         sum of the ledger's stage seconds (all attempts)
WITH per_benchmark AS (
    SELECT run_id, step, benchmark, arg_max(value, k) AS value
    FROM eval_scores
    -- 'avg@k' matches metrics stored either generically ('avg@k') or with k filled in ('avg@4')
    WHERE regexp_replace(metric, '@[0-9]+$', '@k') = getvariable('metric')
    GROUP BY run_id, step, benchmark
), per_eval AS (
    SELECT run_id, step, avg(value) AS average, count(*) AS benchmarks
    FROM per_benchmark
    GROUP BY run_id, step
    QUALIFY benchmarks = max(benchmarks) OVER (PARTITION BY run_id)
), ranked AS (
    SELECT
        *,
        row_number() OVER (PARTITION BY run_id ORDER BY average DESC, step) AS rank,
        first_value(average) OVER (PARTITION BY run_id ORDER BY step) AS initial_eval_average
    FROM per_eval
), evals_summary AS (
    SELECT run_id, average AS best_eval_average, step AS best_eval_step, initial_eval_average
    FROM ranked
    WHERE rank = 1  -- earliest step on ties
), late_evals AS (
    SELECT
        run_id,
        avg(average) FILTER (WHERE 2 * step >= last_eval_step) AS late_eval_average,
        arg_max(average, step) AS final_eval_average
    FROM (SELECT *, max(step) OVER (PARTITION BY run_id) AS last_eval_step FROM per_eval)
    GROUP BY run_id
), steps_summary AS (
    SELECT
        run_id,
        max(step) AS last_step,
        arg_max(entropy_mean, step) AS final_entropy,
        max(entropy_mean) AS peak_entropy,
        avg(prob_nmae) AS prob_nmae,
        avg(ratio_nmae) AS ratio_nmae,
        avg(ratio_nmae) / nullif(avg(prob_nmae), 0) AS amplification,
        avg(response_length_mean) AS mean_response_length
    FROM steps
    GROUP BY run_id
), shadow_tokens AS (
    SELECT
        run_id,
        sum(clipped_lower::INTEGER) / nullif(sum((advantage < 0)::INTEGER), 0) AS lower_clip_neg_fp8,
        sum(bf16_clipped_lower::INTEGER) / nullif(sum((advantage < 0)::INTEGER), 0) AS lower_clip_neg_bf16,
        avg(overclipped::INTEGER) AS overclipped_share
    FROM token_stats
    WHERE bf16_clipped_lower IS NOT NULL
    GROUP BY run_id
), modes AS (
    SELECT run_id, string_agg(DISTINCT mode, '+' ORDER BY mode) AS clip_mode
    FROM bounds
    GROUP BY run_id
), wall AS (
    SELECT run_id, sum(seconds) AS wall_seconds
    FROM ledger
    GROUP BY run_id
)
SELECT
    r.run_id,
    m.clip_mode,
    s.last_step,
    e.best_eval_average,
    e.best_eval_step,
    e.initial_eval_average,
    l.late_eval_average,
    l.final_eval_average,
    s.final_entropy,
    s.peak_entropy,
    s.prob_nmae,
    s.ratio_nmae,
    s.amplification,
    t.lower_clip_neg_fp8,
    t.lower_clip_neg_bf16,
    t.lower_clip_neg_fp8 / nullif(t.lower_clip_neg_bf16, 0) AS lower_clip_vs_bf16,
    t.overclipped_share,
    s.mean_response_length,
    w.wall_seconds
FROM runs AS r
LEFT JOIN modes AS m USING (run_id)
LEFT JOIN steps_summary AS s USING (run_id)
LEFT JOIN evals_summary AS e USING (run_id)
LEFT JOIN late_evals AS l USING (run_id)
LEFT JOIN shadow_tokens AS t USING (run_id)
LEFT JOIN wall AS w USING (run_id)
ORDER BY r.run_id;
