"""Report figures of the noise sources, the drift signal and guard trips (appended to ``FIGURES``)."""

from __future__ import annotations

from flows.report.spec import Figure, Panel

EXTRA_FIGURES: tuple[Figure, ...] = (
    Figure(
        "noise_sources",
        "Where the noise comes from",
        "Calibration steps: the ratio's training noise (r8 vs r16) next to the TIS weight's (weight from FP8 vs "
        "BF16 π_old, against the rollout log-probs), and the rollout-vs-BF16 mismatch TIS corrects; NMAEs.",
        "SELECT run_id, step, ratio_noise_nmae, tis_weight_nmae, rollout_bf16_prob_nmae, rollout_fp8_prob_nmae\n"
        "FROM steps\nWHERE ratio_noise_nmae IS NOT NULL\nORDER BY run_id, step",
        (
            Panel(
                "ratio_noise_nmae|tis_weight_nmae",
                "training noise: ratio vs TIS weight",
                "NMAE",
                labels=(("ratio_noise_nmae", "ratio r8 vs r16"), ("tis_weight_nmae", "TIS weight FP8 vs BF16")),
            ),
            Panel(
                "rollout_bf16_prob_nmae|rollout_fp8_prob_nmae",
                "rollout-vs-trainer mismatch",
                "NMAE",
                labels=(
                    ("rollout_bf16_prob_nmae", "rollout vs BF16 π_old"),
                    ("rollout_fp8_prob_nmae", "rollout vs FP8 π_old"),
                ),
            ),
        ),
        no_data="no calibration step with the noise columns in these runs",
        markers=True,
    ),
    Figure(
        "drift",
        "Drift signal and shadow steps",
        "KS distance of each step's A<0 FP8 ratios from the last calibration step's (0 on calibration steps); "
        "with calibration.schedule = drift a step recalibrates when the previous step's signal crosses the threshold.",
        "SELECT run_id, step, drift_signal, shadow\nFROM steps\nWHERE drift_signal IS NOT NULL\nORDER BY run_id, step",
        (Panel("drift_signal", "drift signal D", "KS distance"), Panel("shadow", "shadow passes ran", "0 / 1")),
        no_data="these runs record no drift_signal",
    ),
    Figure(
        "guard",
        "Guard trips",
        "Each point a guard trip (flows.campaign.guard): at the step it was detected, the checkpoint step it rolled "
        "back to "
        "(the stretch in between was set aside and replayed).",
        "SELECT run_id, CAST(json_extract(info, '$.detected_step') AS INTEGER) AS step,\n"
        "       CAST(json_extract(info, '$.rollback_to') AS DOUBLE) AS rollback_to,\n"
        "       CAST(json_extract(info, '$.first_bad_step') AS DOUBLE) AS first_bad_step\n"
        "FROM ledger\nWHERE stage = 'guard'\nORDER BY run_id, step",
        (
            Panel(
                "rollback_to|first_bad_step",
                "guard trips",
                "step",
                labels=(("rollback_to", "rolled back to"), ("first_bad_step", "first bad step")),
            ),
        ),
        no_data="the guard never tripped in these runs",
        markers=True,
    ),
)
