-- name: guard-events
-- description: Every guard trip: what tripped, where, the checkpoint it rolled back to and the remedy.
--
-- One row per live `guard` ledger record (flows.campaign.guard). The record sits at the
-- step of the restored checkpoint (rollback) or at the detection step (stop).
--   kind            entropy_surge | garbled_surge | reward_collapse | non_finite
--   detected_step   the step whose row completed the detection
--   first_bad_step  the first step of the surge / collapse
--   rollback_to     checkpoint step restored (NULL when the guard stopped)
--   action          rollback | stop
SELECT
    run_id,
    step,
    status,
    json_extract_string(info, '$.kind') AS kind,
    CAST(json_extract(info, '$.detected_step') AS INTEGER) AS detected_step,
    CAST(json_extract(info, '$.first_bad_step') AS INTEGER) AS first_bad_step,
    CAST(json_extract(info, '$.rollback_to') AS INTEGER) AS rollback_to,
    json_extract_string(info, '$.action') AS action,
    json_extract_string(info, '$.remedy') AS remedy,
    json_extract_string(info, '$.detail') AS detail,
    CAST(json_extract(info, '$.set_aside_files') AS INTEGER) AS set_aside_files
FROM ledger
WHERE stage = 'guard'
ORDER BY run_id, step;
