"""``fp8rl run``, ``fp8rl resume`` and ``fp8rl rerun``.

Every user error (unknown config key, missing data file, a run directory from
another config) is one line on stderr and exit code 2, before anything is
written. Prefect is imported only once the inputs are known to be good.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

import typer

from flows.configuration import ConfigError, dump_config, load_config
from fp8rl_core.config import CampaignConfig

STAGES_FOR_FROM = ("rollout", "score", "train", "calibrate", "evaluate", "checkpoint")


def _fail(msg: str) -> typer.Exit:
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(2)


def preflight(cfg: CampaignConfig) -> None:
    """Check every input the campaign will read (data files, benchmarks) up front."""
    from stages.evaluate import check_benchmarks
    from stages.prompts import make_source

    try:
        make_source(cfg.task)
    except (FileNotFoundError, ValueError, OSError) as err:
        raise _fail(f"task data: {err}")
    try:
        check_benchmarks(cfg)
    except (FileNotFoundError, ValueError, OSError, KeyError) as err:
        raise _fail(f"evaluation data: {str(err).strip(chr(39))}")


def _print_summary(run_dir: Path, result: dict) -> None:
    ev = result.get("last_eval") or {}
    typer.echo("")
    typer.echo(f"run finished: {run_dir}")
    for k, v in ev.items():
        typer.echo(f"  final {k}: {100 * v:.1f}%")
    root = run_dir.parent
    typer.echo("next:")
    typer.echo(f"  fp8rl report {run_dir}")
    typer.echo(f"  fp8rl query {root} --named eval-best-average")
    typer.echo(f"  fp8rl query {root} \"SELECT step, lower, upper, alpha FROM bounds ORDER BY step\"")


def _run_flow(run_dir: Path, *, resume: bool, nproc_per_node: int = 1) -> dict:
    if nproc_per_node > 1:  # SPMD under torchrun (issue 11)
        from flows.spmd import launch

        return launch(run_dir, resume=resume, nproc_per_node=nproc_per_node)
    from flows.campaign import campaign_flow

    return campaign_flow(str(run_dir), resume=resume)


NPROC_HELP = "Ranks on this node (torchrun --standalone); see flows/spmd.py for several nodes."


def run(
    config: str = typer.Argument("tiny-cpu", help="Preset name in configs/ or a YAML file."),
    set_: list[str] = typer.Option([], "--set", help="Override a config value, e.g. calibration.interval=10 (repeatable)."),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Run directory (default: <storage.runs_root>/<name>-<time>)."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", min=1, help=NPROC_HELP),
) -> None:
    """Run a campaign (default: the tiny CPU preset) end to end."""
    from storage.errors import StorageError
    from storage.layout import create_run

    try:
        cfg = load_config(config, set_)
    except ConfigError as err:
        raise _fail(str(err))
    preflight(cfg)
    if run_dir is None:
        run_dir = Path(cfg.storage.runs_root) / f"{cfg.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    run_dir = run_dir.resolve()
    if (run_dir / "run.json").exists():
        raise _fail(f"{run_dir} already holds a run; use `fp8rl resume {run_dir}` or another --run-dir")
    try:
        create_run(run_dir.parent, run_dir.name, config=dump_config(cfg))
    except StorageError as err:
        raise _fail(str(err))
    typer.echo(f"run directory: {run_dir}")
    t0 = time.perf_counter()
    result = _run_flow(run_dir, resume=False, nproc_per_node=nproc_per_node)
    typer.echo(f"wall time: {time.perf_counter() - t0:.0f} s")
    _print_summary(run_dir, result)


def _check_run_config(run_dir: Path, config: str | None, set_: list[str]) -> CampaignConfig:
    from storage.layout import config_hash, read_run_info
    from storage.errors import StorageError

    try:
        info = read_run_info(run_dir)
    except StorageError as err:
        raise _fail(str(err))
    try:
        stored = load_config(run_dir / "config.yaml")
    except ConfigError as err:
        raise _fail(str(err))
    if config is not None or set_:
        try:
            wanted = load_config(config or (run_dir / "config.yaml"), set_)
        except ConfigError as err:
            raise _fail(str(err))
        if config_hash(dump_config(wanted)) != info.config_hash:
            raise _fail(f"{run_dir} was made by another config (hash {str(info.config_hash)[:12]}…); "
                        "resume it without --config/--set or start a new run")
    return stored


def resume(
    run_dir: Path = typer.Argument(..., help="Run directory to resume."),
    from_stage: str | None = typer.Option(None, "--from", help=f"Restart at this stage ({', '.join(STAGES_FOR_FROM)})."),
    step: int | None = typer.Option(None, "--step", help="Step of --from."),
    config: str | None = typer.Option(None, "--config", help="Check the run against this config (must match)."),
    set_: list[str] = typer.Option([], "--set", help="Overrides for --config (must still match)."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", min=1, help=NPROC_HELP),
) -> None:
    """Resume a campaign from its ledger: restore the newest checkpoint, replay, continue."""
    from storage.writer import set_aside_from

    run_dir = run_dir.resolve()
    cfg = _check_run_config(run_dir, config, set_)
    preflight(cfg)
    if (from_stage is None) != (step is None):
        raise _fail("--from and --step go together")
    if from_stage is not None:
        if from_stage not in STAGES_FOR_FROM:
            raise _fail(f"unknown stage {from_stage!r}; valid: {', '.join(STAGES_FOR_FROM)}")
        later = list(STAGES_FOR_FROM[STAGES_FOR_FROM.index(from_stage):])
        if "score" in later:  # DAPO refill rounds belong to the score stage
            later += [f"rollout{r}" for r in range(1, cfg.algorithm.max_refill_rounds + 1)]
        moved = set_aside_from(run_dir, step=step, stages_at_step=later)
        typer.echo(f"set aside {len(moved.files)} table file(s), {len(moved.checkpoints)} checkpoint(s), "
                   f"{moved.ledger_records} ledger record(s)")
        typer.echo(f"set aside outputs from {from_stage} of step {step} on")
    t0 = time.perf_counter()
    result = _run_flow(run_dir, resume=True, nproc_per_node=nproc_per_node)
    typer.echo(f"wall time: {time.perf_counter() - t0:.0f} s")
    _print_summary(run_dir, result)


def rerun(
    run_dir: Path = typer.Argument(..., help="Run directory."),
    stage: str = typer.Option(..., "--stage", help="score, calibrate or evaluate."),
    steps: str = typer.Option(..., "--steps", help="Step range A:B (inclusive)."),
    set_: list[str] = typer.Option([], "--set", help="Config overrides for the re-run (e.g. calibration.max_delta=0.1)."),
    variant: str | None = typer.Option(None, "--variant", help="Name of the new version (default: <stage>-<time>)."),
) -> None:
    """Recompute one stage over a step range from persisted inputs, as a new version (variant)."""
    from flows.rerun import rerun_stage

    run_dir = run_dir.resolve()
    base = _check_run_config(run_dir, None, [])
    try:
        a, b = (int(x) for x in steps.split(":"))
    except ValueError:
        raise _fail(f"--steps {steps!r}: expected A:B, e.g. 1:20")
    if stage not in ("score", "calibrate", "evaluate"):
        raise _fail(f"--stage {stage!r}: valid: score, calibrate, evaluate")
    try:
        cfg = load_config(run_dir / "config.yaml", set_) if set_ else base
    except ConfigError as err:
        raise _fail(str(err))
    name = variant or f"{stage}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    written = rerun_stage(run_dir, cfg, stage, range(a, b + 1), variant=name)
    typer.echo(f"wrote variant {name!r}: {written} step(s) of {stage}")
    typer.echo(f"compare: fp8rl query {run_dir} \"SELECT variant, step, lower, upper FROM bounds_variants ORDER BY step, variant\"")


def register(app: typer.Typer) -> None:
    app.command("run")(run)
    app.command("resume")(resume)
    app.command("rerun")(rerun)
