"""Re-run one stage over a step range from persisted inputs, as a new version.

``fp8rl rerun RUN --stage calibrate --steps 1:40 --set calibration.max_delta=0.1``
recomputes the bounds of every calibration step in the range from the persisted
``token_stats`` with other hyperparameters and writes them under a new
``variant``, next to the original (``variant = 'main'``), so the two compare in
one SQL query. ``score`` re-grades persisted rollouts (e.g. after a verifier
fix); ``evaluate`` re-evaluates the checkpoints in the range. The campaign's own
outputs are never touched.

The what-if calibration chains its own calibrator state: it starts from the
bounds the campaign had in force at the first step of the range (read from the
campaign's ``bounds`` history) and feeds each result into the next. Which steps
calibrate is what the campaign recorded (``steps.shadow``: fixed K, drift, or a
guard's remedy), never a rule re-derived here. A range beyond the run, or with
no step holding what the stage reads, is an error (one line, exit 2), not an
empty variant.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fp8rl_core.calibration.calibrated_clipping import CalibratorState
from fp8rl_core.config.campaign import CampaignConfig
from fp8rl_core.config.stage_kinds import STAGES
from fp8rl_core.registry import Registry
from stages.context import MAIN, RunEnv, open_storage_only
from stages.runtime.io import shadow_steps
from storage.ledger.records import DONE


def _bounds_in_force(env: RunEnv, step: int) -> CalibratorState | None:
    """The campaign's calibrator state after its last calibration before ``step``."""
    from stages.runtime.io import read_step

    state = None
    for s in range(1, step):
        try:
            t = read_step(env, "bounds", s)  # reads the campaign's own ('main') bounds
        except FileNotFoundError:
            continue
        n = 1 if state is None else state.n_calibrations + 1
        state = CalibratorState(float(t.column("lower")[0].as_py()), float(t.column("upper")[0].as_py()), n, s)
    return state


def rerun_stage(run_dir: Path, cfg: CampaignConfig, stage: str, steps: range, *, variant: str) -> int:
    """Recompute ``stage`` for ``steps`` into ``variant``; returns how many steps were written.

    The stages that can be recomputed are the stage table's ``rerun`` rows, each with its hook
    in :data:`RERUN_HOOKS`."""
    if variant == MAIN:
        raise ValueError("a re-run must not write the campaign's own variant 'main'")
    if stage not in STAGES.rerunnable():
        raise ValueError(f"unknown stage {stage!r}; valid: {', '.join(STAGES.rerunnable())}")
    return RERUN_HOOKS.get(stage)(run_dir, cfg, steps, variant)


def _rerun_score(run_dir: Path, cfg: CampaignConfig, steps: range, variant: str) -> int:
    """Re-grade persisted rollouts (e.g. after a verifier fix)."""
    from stages.score import run_score

    env, state = open_storage_only(cfg, run_dir, variant=variant, input_variant=MAIN)
    needs = _check_span(env, steps, "score")
    if cfg.algorithm.dynamic_sampling:
        raise ValueError("re-scoring a DAPO run would need new refill rollouts; re-score with dynamic_sampling off")
    written = 0
    for s in steps:
        if s >= 1 and needs in env.ledger.done_stages(s):
            with env.ledger.stage(s, "score", variant=variant) as rec:
                summary, state = run_score(env, state, s)
                rec.outputs.extend(summary.outputs)
            written += 1
    return written


def _rerun_calibrate(run_dir: Path, cfg: CampaignConfig, steps: range, variant: str) -> int:
    """Recompute the bounds of the recorded shadow steps from persisted ``token_stats``."""
    from stages.calibrate import run_calibrate

    env, state = open_storage_only(cfg, run_dir, variant=variant, input_variant=MAIN)
    needs = _check_span(env, steps, "calibrate")
    todo = shadow_steps(env, steps)
    if not todo:
        raise ValueError(
            f"steps {_span(steps)}: no step ran the BF16 shadow passes, so none can calibrate "
            f"(shadow steps of the run: {_listing(shadow_steps(env, range(1, cfg.steps + 1)))})"
        )
    prev = _bounds_in_force(env, steps.start)
    if prev is not None:
        state = dataclasses.replace(state, calibrator=prev)
    written = 0
    for s in todo:
        if needs in env.ledger.done_stages(s):
            with env.ledger.stage(s, "calibrate", variant=variant) as rec:
                summary, state = run_calibrate(env, state, s)
                rec.outputs.extend(summary.outputs)
            written += 1
    return written


def _span(steps: range) -> str:
    return f"{steps.start}:{steps.stop - 1}"


def _listing(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:12])) + (", ..." if len(steps) > 12 else "") if steps else "none"


def _needs(stage: str) -> str:
    """The stage whose output a re-run of ``stage`` reads: the first writer of its first input table."""
    return STAGES.producer(STAGES.get(stage).reads[0]).name


def _check_span(env: RunEnv, steps: range, stage: str) -> str:
    """Refuse an empty range, or one reaching past the last step whose input stage is done; that stage."""
    needs = _needs(stage)
    done = sorted({s for (s, st), r in env.ledger.current(variant=MAIN).items() if st == needs and r.status == DONE})
    if not steps:
        raise ValueError(f"steps {_span(steps)}: an empty range")
    if not done or steps.stop - 1 > done[-1]:
        last = f"its last step with {needs} done is {done[-1]}" if done else f"no step has {needs} done"
        raise ValueError(f"steps {_span(steps)} go beyond the run: {last}")
    return needs


def _rerun_evaluate(run_dir: Path, cfg: CampaignConfig, steps: range, variant: str) -> int:
    """Re-evaluate the checkpoints in the range."""
    from flows.campaign.cpu_numerics import gemm_choice
    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
    from stages.checkpoint import restore
    from stages.context import open_run
    from stages.evaluate import run_evaluate
    from storage.checkpoints.verify import list_checkpoints

    todo = [(s, path) for s, path in list_checkpoints(run_dir) if s in steps]
    if not todo:
        raise ValueError(
            f"steps {_span(steps)}: no checkpoint to evaluate (checkpointed steps: "
            f"{_listing([s for s, _ in list_checkpoints(run_dir)])})"
        )
    env, state = open_run(cfg, run_dir, variant=variant)
    written = 0
    try:
        with cpu_bf16_gemm(gemm_choice(cfg, env.device).kind, env.device):
            for s, path in todo:
                _, state = restore(env, state, path)
                with env.ledger.stage(s, "evaluate", variant=variant) as rec:
                    summary, state = run_evaluate(env, state, s)
                    rec.outputs.extend(summary.outputs)
                written += 1
    finally:
        env.close()
    return written


RERUN_HOOKS: Registry = Registry("rerun hook")
"""``stage -> hook(run_dir, cfg, steps, variant) -> steps written``, one per ``rerun`` row of the stage table."""
RERUN_HOOKS.register("score")(_rerun_score)
RERUN_HOOKS.register("calibrate")(_rerun_calibrate)
RERUN_HOOKS.register("evaluate")(_rerun_evaluate)
