"""``fp8rl run``, ``fp8rl resume`` and ``fp8rl rerun``.

Every user error (unknown config key, missing data file, a run directory from
another config) is one line on stderr and exit code 2, before anything is
written. Prefect is imported only once the inputs are known to be good.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from datetime import datetime
from enum import Enum
from pathlib import Path

import typer

from flows.campaign.configuration import ConfigError, dump_config, load_config
from flows.commands.common import fail as _fail
from flows.commands.common import io_errors
from fp8rl_core.config.campaign import CampaignConfig
from fp8rl_core.config.stage_kinds import STAGES


def _stage_choices(name: str, stages: tuple[str, ...]) -> type[Enum]:
    return Enum(name, {s: s for s in stages}, type=str)


FromStage = _stage_choices("FromStage", STAGES.names())  # ``resume --from``: every stage, in step order
RerunStage = _stage_choices("RerunStage", STAGES.rerunnable())  # ``rerun --stage``: the table's rerun rows


STAGES_FOR_FROM = tuple(s.value for s in FromStage)


@contextmanager
def _locked(run_dir: Path):
    """Hold the run's single-writer lock (re-entrant); a run locked by a live process is one line, exit 2."""
    from storage.errors import RunLocked
    from storage.run import lock

    try:
        with io_errors(run_dir):
            lock.acquire(run_dir)
    except RunLocked as err:
        raise _fail(str(err)) from None
    try:
        yield
    finally:
        lock.release(run_dir)


def preflight(cfg: CampaignConfig, nproc_per_node: int = 1) -> None:
    """Check every input the campaign will read (data files, benchmarks) and that the trainer
    can run on ``nproc_per_node`` ranks, up front."""
    from flows.orchestration.preflight import ServerUnavailable, check_temporary_server
    from stages.data.prompts import make_source
    from stages.evaluate import check_benchmarks

    try:
        check_temporary_server()  # its database and ports, before the run directory exists
    except ServerUnavailable as err:
        raise _fail(str(err))
    _check_device(cfg.device)
    _warn_clip_mode_cost(cfg)
    _check_compile_numerics(cfg)
    if nproc_per_node > 1:
        from stages.trainer.batch import check_world_size

        try:
            check_world_size(cfg, nproc_per_node)
            _check_one_sender(cfg, nproc_per_node)
        except ValueError as err:
            raise _fail(str(err))

    try:
        make_source(cfg.task)
    except (FileNotFoundError, ValueError, OSError) as err:
        raise _fail(f"task data: {err}")
    try:
        check_benchmarks(cfg)
    except (FileNotFoundError, ValueError, OSError, KeyError) as err:
        raise _fail(f"evaluation data: {str(err).strip(chr(39))}")


def _check_one_sender(cfg: CampaignConfig, nproc_per_node: int) -> None:
    """A vLLM engine per rank synced by NCCL would make every rank the sender of a group of its own: refused
    (the engine would refuse it at its start; here it is one line before the run directory exists)."""
    from fp8rl_core.config.engine_kinds import ENGINE_KINDS
    from stages.engines.vllm_options import SEVERAL_SENDERS

    r = cfg.rollout
    if r.weight_sync == "nccl" and ENGINE_KINDS.get(r.engine).fixed_sync is None:
        raise ValueError(SEVERAL_SENDERS.format(ranks=nproc_per_node))


def _warn_clip_mode_cost(cfg: CampaignConfig) -> None:
    """A clip mode meant for CPU experiments (its record states a cost: the oracle) says what it costs, in one
    line, where the run is on a GPU: ``device: cuda``, or ``auto`` on a machine with one."""
    from fp8rl_core.config.clip_mode_kinds import cost_warning

    on_gpu = cfg.device.startswith("cuda")
    if cfg.device == "auto":
        import torch

        on_gpu = torch.cuda.is_available()
    line = cost_warning(cfg, on_gpu=on_gpu)
    if line:
        typer.echo(f"warning: {line}", err=True)


def _check_compile_numerics(cfg: CampaignConfig) -> None:
    """``precision.compile: on`` on a CPU whose BF16 GEMMs go through a torch-function mode (``portable``,
    ``fp32``) is one line here: dynamo cannot build guards for the mode and every rank fails at its
    first compiled forward. A GPU never has the mode; ``auto`` never compiles on a CPU."""
    if cfg.precision.compile != "on":
        return
    from flows.campaign.cpu_numerics import gemm_choice
    from stages.context import resolve_device

    try:
        device = resolve_device(cfg.device)
    except ValueError:
        return  # _check_device says why
    kind = gemm_choice(cfg, device).kind
    if device.type == "cpu" and kind in ("portable", "fp32"):
        raise _fail(
            f"precision.compile: on with precision.cpu_bf16_gemm {kind} on the CPU: torch.compile cannot trace "
            "that GEMM mode; set precision.cpu_bf16_gemm=native (tables then depend on the CPU) "
            "or precision.compile=auto"
        )


def _check_device(device: str) -> None:
    """A CUDA device the machine does not have is one line here, not a traceback once the run folder exists."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise _fail(f"device {device}: this machine has no CUDA device torch can use; set device=cpu (or auto)")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise _fail(f"device {device}: this machine has {torch.cuda.device_count()} CUDA device(s) (cuda:0 first)")


# Below a run directory the longest path the writer makes (tables/<table>/run=<id>/step=<n>/part-….parquet,
# checkpoints/.dcp/…) is well under this many characters beyond the directory itself.
_PATH_BELOW_RUN = 200


def _check_run_dir_name(run_dir: Path) -> None:
    """A run directory the file system cannot hold (its name is also a partition folder, ``run=<name>``)
    is refused before anything is written."""
    from storage.tables.spec import RUN_ID

    name = run_dir.name
    if not RUN_ID.match(name):
        raise _fail(
            f"run directory name {name!r}: letters, digits and . _ + = - only, starting with a letter or digit "
            "(it is the run id)"
        )
    existing = next(p for p in [run_dir, *run_dir.parents] if _exists(p))
    try:
        name_max, path_max = os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    too_long = [p for p in run_dir.relative_to(existing).parts[:-1] if len(p.encode()) > name_max]
    if too_long:
        raise _fail(f"--run-dir folder {too_long[0][:24]!r}… is over this file system's {name_max}-byte name limit")
    if len(f"run={name}".encode()) > name_max:
        raise _fail(
            f"run directory name {name[:24]!r}… is {len(name.encode())} bytes; this file system holds names of at "
            f"most {name_max} bytes, and the tables use run=<name>: give a name of at most {name_max - 4} bytes"
        )
    if len(str(run_dir).encode()) + _PATH_BELOW_RUN > path_max:
        raise _fail(f"run directory {str(run_dir)[:40]}…: too long a path for this file system ({path_max} bytes)")


def _exists(path: Path) -> bool:
    """``path.exists()``, False for a name the file system refuses to look up (over its name limit)."""
    try:
        return path.exists()
    except OSError:
        return False


def check_memory_fit(cfg: CampaignConfig, nproc_per_node: int) -> None:
    """Refuse, in one line, a model whose training state cannot fit the device
    (:func:`flows.plan.fit.memory_refusal`), before anything is allocated or written."""
    from flows.plan.fit import memory_refusal

    line = memory_refusal(cfg, nproc_per_node)
    if line:
        raise _fail(line)


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
    typer.echo(f'  fp8rl query {root} "SELECT step, lower, upper, alpha FROM bounds ORDER BY step"')


def _run_flow(run_dir: Path, *, resume: bool, nproc_per_node: int = 1) -> dict:
    """The campaign flow under the run's single-writer lock; I/O failures are one line, exit 2;
    SIGINT and SIGTERM end every process of the run and are one line, exit 130 / 143
    (``flows.campaign.launch``, ``flows.process.shutdown``).

    With ``nproc_per_node > 1`` this process (the launcher) holds the lock while
    torchrun runs the ranks; the ranks are told so and do not take it.
    """
    from flows.campaign.launch import run_flow
    from storage.errors import StorageError

    with io_errors(run_dir, resume_hint=run_dir), _locked(run_dir):
        try:
            return run_flow(run_dir, resume=resume, nproc_per_node=nproc_per_node)
        except StorageError as err:  # a corrupt input file, a run directory that changed under us
            raise _fail(f"{err}; the run stays resumable: `fp8rl resume {run_dir}`") from None
        except (RuntimeError, MemoryError) as err:
            if type(err).__name__ == "GuardStop":  # (flows.campaign.guard imports torch: not imported to test the type)
                raise _fail(f"the guard stopped the campaign: {err}") from None
            if _out_of_memory(err):  # a model that cannot fit (``--skip-memory-check``, or activations)
                raise _fail(
                    f"out of memory: {' '.join(str(err).split())[:240]}; the model does not fit "
                    f"(`fp8rl plan` itemizes its memory); the run stays resumable: `fp8rl resume {run_dir}`"
                ) from None
            raise


def _out_of_memory(err: BaseException) -> bool:
    """An allocator's refusal: Python's MemoryError, torch's OutOfMemoryError (CUDA), or the CPU
    allocator's RuntimeError (``DefaultCPUAllocator: can't allocate memory``)."""
    text = str(err)
    return (
        isinstance(err, MemoryError)
        or type(err).__name__ == "OutOfMemoryError"
        or "can't allocate memory" in text
        or "out of memory" in text.lower()
    )


def check_new_run_dir(run_dir: Path, runs_root: Path | None) -> Path:
    """Where a new run may go: not inside a file or a system folder, not into a folder holding other files.

    ``runs_root`` given (the default place), the run directory must stay under it.
    """
    from storage.run import lock
    from storage.run.layout import RUN_FILE

    run_dir = run_dir.expanduser().resolve()
    if runs_root is not None and not run_dir.is_relative_to(runs_root.expanduser().resolve()):
        raise _fail(f"run directory {run_dir} would be outside the runs root {runs_root.resolve()}")
    _check_run_dir_name(run_dir)
    if (run_dir / RUN_FILE).exists():
        raise _fail(f"{run_dir} already holds a run; use `fp8rl resume {run_dir}` or another --run-dir")
    for p in [run_dir, *run_dir.parents]:
        if p.exists():
            if not p.is_dir():
                raise _fail(f"{p}: is a file, not a directory (in --run-dir {run_dir})")
            break
    if run_dir.is_relative_to("/proc") or run_dir.is_relative_to("/sys") or run_dir.is_relative_to("/dev"):
        raise _fail(f"{run_dir}: a kernel/device file system, not storage for a run")
    if run_dir.is_dir() and any(p.name != lock.LOCK_FILE for p in run_dir.iterdir()):
        raise _fail(f"{run_dir} is not empty and is not a run directory; give an empty or new --run-dir")
    return run_dir


NPROC_HELP = "Ranks on this node (torchrun --standalone); see flows/spmd.py for several nodes."


def run(
    config: str = typer.Argument("tiny-cpu", help="Preset name in configs/ or a YAML file."),
    set_: list[str] = typer.Option(
        [], "--set", help="Override a config value, e.g. calibration.interval=10 (repeatable)."
    ),
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Run directory (default: <storage.runs_root>/<name>-<time>)."
    ),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", min=1, help=NPROC_HELP),
    skip_memory_check: bool = typer.Option(
        False, "--skip-memory-check", help="Start even when the memory plan exceeds the device's memory."
    ),
) -> None:
    """Run a campaign (default: the tiny CPU preset) end to end."""
    from storage.errors import StorageError
    from storage.run.layout import create_run
    from storage.tables.spec import RUN_ID

    try:
        cfg = load_config(config, set_)
    except ConfigError as err:
        raise _fail(str(err))
    if not RUN_ID.match(cfg.name):
        raise _fail(
            f"name {cfg.name!r}: a run name is letters, digits and . _ + = - (no '/'), starting with a letter or digit"
        )
    preflight(cfg, nproc_per_node)
    if not skip_memory_check:
        check_memory_fit(cfg, nproc_per_node)
    default_root = None
    if run_dir is None:
        default_root = Path(cfg.storage.runs_root)
        run_dir = default_root / f"{cfg.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    run_dir = check_new_run_dir(run_dir, default_root)
    with io_errors(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
    with _locked(run_dir):  # before run.json: a second `run` or a `resume` of this directory is refused
        try:
            with io_errors(run_dir):
                create_run(run_dir.parent, run_dir.name, config=dump_config(cfg))
        except StorageError as err:
            raise _fail(str(err))
        typer.echo(f"run directory: {run_dir}")
        _echo_cpu_numerics(cfg)
        t0 = time.perf_counter()
        result = _run_flow(run_dir, resume=False, nproc_per_node=nproc_per_node)
    typer.echo(f"wall time: {time.perf_counter() - t0:.0f} s")
    _print_summary(run_dir, result)


def _echo_cpu_numerics(cfg: CampaignConfig) -> None:
    """The console's first lines say what the run computes with (the same record lands in run.json)."""
    from flows.campaign.cpu_numerics import describe, gemm_choice, summary_line
    from stages.bootstrap.math import capped_threads
    from stages.context import resolve_device

    choice = gemm_choice(cfg, resolve_device(cfg.device))
    typer.echo(summary_line(describe(choice, threads=capped_threads(cfg.threads))))


def _check_run_config(
    run_dir: Path, config: str | None, set_: list[str], *, accept_change: bool = False
) -> tuple[CampaignConfig, list[str] | None]:
    """The run's config, checked against what run.json records, and its changes (None: unchanged).

    An edited config.yaml is refused in one line naming the changed keys, unless
    ``accept_change`` (the caller then records it with :func:`_take_config_change`).
    """
    from flows.campaign.run_checks import config_drift, drift_message
    from storage.errors import StorageError
    from storage.run.layout import config_hash, read_run_info

    try:
        info = read_run_info(run_dir)
    except StorageError as err:
        raise _fail(str(err))
    try:
        stored = load_config(run_dir / "config.yaml")
        with io_errors(run_dir):
            text = (run_dir / "config.yaml").read_text(encoding="utf-8")
    except ConfigError as err:
        raise _fail(str(err))
    if info.uid is None:
        from storage.run.identity import no_uid_warning

        typer.echo(f"warning: {no_uid_warning(info)}", err=True)
    drift = config_drift(info, text, stored)
    if drift is not None and not accept_change:
        raise _fail(drift_message(run_dir, drift))
    if drift is not None:
        from flows.campaign.run_checks import RunMismatch, check_acceptable_change

        try:
            check_acceptable_change(run_dir, info, stored)
        except RunMismatch as err:
            raise _fail(str(err)) from None
    if config is not None or set_:
        try:
            wanted = load_config(config or (run_dir / "config.yaml"), set_)
        except ConfigError as err:
            raise _fail(str(err))
        if config_hash(dump_config(wanted)) != config_hash(dump_config(stored)):
            raise _fail(
                f"{run_dir} was made by another config (hash {str(info.current_config_hash)[:12]}…); "
                "resume it without --config/--set or start a new run"
            )
    return stored, drift


def _take_config_change(run_dir: Path, cfg: CampaignConfig, drift: list[str]) -> None:
    """Record an accepted config edit (run.json and the ledger) and say so in one line."""
    from flows.campaign.run_checks import record_config_change
    from storage.run.layout import read_run_info

    with io_errors(run_dir):
        record_config_change(run_dir, read_run_info(run_dir), cfg, drift)
    typer.echo(f"warning: config change taken into the run: {'; '.join(drift)}", err=True)


def resume(
    run_dir: Path = typer.Argument(..., help="Run directory to resume."),
    from_stage: FromStage | None = typer.Option(
        None, "--from", help="Restart at this stage (its outputs and later ones are set aside)."
    ),
    step: int | None = typer.Option(None, "--step", help="Step of --from."),
    config: str | None = typer.Option(None, "--config", help="Check the run against this config (must match)."),
    set_: list[str] = typer.Option([], "--set", help="Overrides for --config (must still match)."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", min=1, help=NPROC_HELP),
    accept_config_change: bool = typer.Option(
        False,
        "--accept-config-change",
        help="Take an edit of RUN/config.yaml into the run (recorded in run.json and the ledger); "
        "without it an edited config is refused.",
    ),
) -> None:
    """Resume a campaign from its ledger: restore the newest checkpoint, replay, continue."""
    from flows.campaign.run_checks import RunMismatch, check_ledger, check_resume_point
    from storage.parts.writer import set_aside_from

    run_dir = run_dir.resolve()
    if (from_stage is None) != (step is None):
        raise _fail("--from and --step go together")
    cfg, drift = _check_run_config(run_dir, config, set_, accept_change=accept_config_change)
    preflight(cfg, nproc_per_node)
    with _locked(run_dir):
        try:
            with io_errors(run_dir):
                check_ledger(run_dir)
                if from_stage is not None:
                    check_resume_point(run_dir, cfg, from_stage.value, step)
        except RunMismatch as err:
            raise _fail(str(err)) from None
        if drift is not None:
            _take_config_change(run_dir, cfg, drift)
        if from_stage is not None:
            later = list(STAGES_FOR_FROM[STAGES_FOR_FROM.index(from_stage.value) :])
            if any(STAGES.get(s).refill_rounds for s in later):  # DAPO's refill rounds are recorded apart
                later += [f"rollout{r}" for r in range(1, cfg.algorithm.max_refill_rounds + 1)]
            with io_errors(run_dir):
                moved = set_aside_from(run_dir, step=step, stages_at_step=later)
            typer.echo(
                f"set aside {len(moved.files)} table file(s), {len(moved.checkpoints)} checkpoint(s), "
                f"{moved.ledger_records} ledger record(s)"
            )
            typer.echo(f"set aside outputs from {from_stage.value} of step {step} on")
        _report_broken_checkpoints(run_dir)  # hashes the newest complete checkpoint once, for the restore too
        t0 = time.perf_counter()
        _echo_cpu_numerics(cfg)
        try:
            result = _run_flow(run_dir, resume=True, nproc_per_node=nproc_per_node)
        finally:
            from storage.checkpoints.verify import VERIFIED_ENV

            os.environ.pop(VERIFIED_ENV, None)
    typer.echo(f"wall time: {time.perf_counter() - t0:.0f} s")
    _print_summary(run_dir, result)


def _report_broken_checkpoints(run_dir: Path) -> None:
    """Set aside the checkpoints newer than the newest that verifies (sizes and hashes, DCP shards
    included), one line each: resume restarts from that one."""
    from storage.checkpoints.verify import latest_complete, set_aside_broken

    with io_errors(run_dir, resume_hint=run_dir):
        moved = set_aside_broken(run_dir)
        newest = latest_complete(run_dir, hashes=False) if moved else None
    for path, why, aside in moved:
        typer.echo(
            f"warning: checkpoint {path.name} is incomplete or damaged ({why}); set aside to {aside}; "
            f"resume restarts from {newest.name if newest is not None else 'the start'}",
            err=True,
        )


def rerun(
    run_dir: Path = typer.Argument(..., help="Run directory."),
    stage: RerunStage = typer.Option(..., "--stage", help="Stage to recompute."),
    steps: str = typer.Option(..., "--steps", help="Step range A:B (inclusive)."),
    set_: list[str] = typer.Option(
        [], "--set", help="Config overrides for the re-run (e.g. calibration.max_delta=0.1)."
    ),
    variant: str | None = typer.Option(None, "--variant", help="Name of the new version (default: <stage>-<time>)."),
) -> None:
    """Recompute one stage over a step range from persisted inputs, as a new version (variant)."""
    from storage.tables.spec import MAIN_VARIANT, VARIANT_NAME

    run_dir = run_dir.resolve()
    base, _ = _check_run_config(run_dir, None, [])
    try:
        a, b = (int(x) for x in steps.split(":"))
    except ValueError:
        raise _fail(f"--steps {steps!r}: expected A:B, e.g. 1:20")
    if a < 0 or b < a:
        raise _fail(f"--steps {steps!r}: expected 0 <= A <= B")
    if variant is not None and (variant == MAIN_VARIANT or not VARIANT_NAME.match(variant)):
        raise _fail(
            f"--variant {variant!r}: "
            + (
                "'main' is the campaign itself; choose another name"
                if variant == MAIN_VARIANT
                else "letters, digits and . _ + = - only (it goes into file names)"
            )
        )
    try:
        cfg = load_config(run_dir / "config.yaml", set_) if set_ else base
    except ConfigError as err:
        raise _fail(str(err))
    name = variant or f"{stage.value}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    with _locked(run_dir):
        from flows.campaign.rerun import rerun_stage

        try:
            with io_errors(run_dir):
                written = rerun_stage(run_dir, cfg, stage.value, range(a, b + 1), variant=name)
        except ValueError as err:
            raise _fail(str(err)) from None
    typer.echo(f"wrote variant {name!r}: {written} step(s) of {stage.value}")
    typer.echo(
        f'compare: fp8rl query {run_dir} "SELECT variant, step, lower, upper FROM bounds_variants ORDER BY '
        f'step, variant"'
    )


def register(app: typer.Typer) -> None:
    app.command("run")(run)
    app.command("resume")(resume)
    app.command("rerun")(rerun)
