-- name: eval-best-average
-- description: Per run, the evaluation step with the best benchmark average, against the first evaluation.
-- param: metric = avg@k : eval_scores.metric to average ('avg@k', 'pass@k', 'maj@k')
--
-- From `eval_scores`: per benchmark the value of the largest k evaluated,
-- averaged over benchmarks per step. Only steps that evaluated as many
-- benchmarks as the run's fullest evaluation compete (a partial evaluation
-- cannot win by skipping a hard benchmark).
--   best_step / best_average   the winner (earliest step on ties)
--   initial_step / initial_average   the run's first full evaluation
--   gain                best_average - initial_average (a share: 0.10 = 10 points)
WITH per_benchmark AS (
    SELECT run_id, step, benchmark, arg_max(value, k) AS value
    FROM eval_scores
    WHERE metric = getvariable('metric')
    GROUP BY run_id, step, benchmark
), per_step AS (
    SELECT run_id, step, avg(value) AS average, count(*) AS benchmarks
    FROM per_benchmark
    GROUP BY run_id, step
), full_steps AS (
    SELECT * FROM per_step
    QUALIFY benchmarks = max(benchmarks) OVER (PARTITION BY run_id)
), ranked AS (
    SELECT
        *,
        first_value(step) OVER (PARTITION BY run_id ORDER BY step) AS initial_step,
        first_value(average) OVER (PARTITION BY run_id ORDER BY step) AS initial_average,
        row_number() OVER (PARTITION BY run_id ORDER BY average DESC, step) AS rank
    FROM full_steps
)
SELECT
    run_id,
    step AS best_step,
    average AS best_average,
    initial_step,
    initial_average,
    average - initial_average AS gain,
    benchmarks
FROM ranked
WHERE rank = 1
ORDER BY best_average DESC, run_id;
