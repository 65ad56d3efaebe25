"""The ``fp8rl`` command line.

Subcommands are contributed by modules that expose ``register(app)``; each
imports its heavy dependencies (torch, Prefect, DuckDB) only when its command
runs, so ``fp8rl --help`` imports none of them. User errors, usage errors
included, exit with code 2 and one line on stderr.
"""

from __future__ import annotations

import importlib
import sys

import typer

try:  # recent typer vendors click
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - older typer on top of click
    from click.exceptions import UsageError

from flows.commands.common import fail

app = typer.Typer(
    name="fp8rl",
    help="FP8 end-to-end RL (GRPO/DAPO) with Calibrated Clipping: run, resume, query, report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Modules contributing commands, in help order.
_COMMAND_MODULES = (
    "flows.commands.run",  # run, resume, rerun
    "flows.commands.deploy",  # deploy
    "flows.commands.storage",  # query, doctor
    "flows.commands.report",  # report, sweep
    "flows.commands.plan",  # plan
    "flows.cluster.cli",  # submit
)


@app.callback()
def _root(ctx: typer.Context) -> None:
    """FP8 end-to-end RL (GRPO/DAPO) with Calibrated Clipping."""
    # Before any command imports transformers (which imports torchao). Log filters only:
    # torch-free, so `--help` and usage errors (`fp8rl run --bogus`) never import torch.
    from fp8rl_core.host.quiet_imports import silence_torchao_import_noise

    silence_torchao_import_noise()


def _register_all() -> None:
    """Import every command module; a missing one is an error (a typo must not drop commands)."""
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(app)


@app.command("config")
def show_config(
    preset: str = typer.Argument("tiny-cpu", help="Preset name in configs/ or a YAML path."),
    set_: list[str] = typer.Option([], "--set", help="Override, e.g. calibration.interval=10 (repeatable)."),
) -> None:
    """Print the resolved configuration of a preset (after overrides)."""
    from flows.campaign.configuration import ConfigError, dump_config, load_config

    try:
        cfg = load_config(preset, set_)
    except ConfigError as err:
        raise fail(str(err))
    typer.echo(dump_config(cfg))


_register_all()


def main(argv: list[str] | None = None) -> None:
    """The ``fp8rl`` entry point: usage errors are one line (not a box), exit 2."""
    from fp8rl_core.host.cpu_env import pin_cpu_numerics
    from fp8rl_core.host.cpu_malloc import keep_freed_memory

    pin_cpu_numerics()  # before torch: the same numbers on every x86-64 CPU (fp8rl_core/host/cpu_env.py)
    keep_freed_memory()  # freed tensors' memory reused, not returned to the kernel (fp8rl_core/host/cpu_malloc.py)
    from flows.process.shutdown import RunEnded, exit_now

    try:
        code = app(args=argv, prog_name="fp8rl", standalone_mode=False)
    except RunEnded as end:  # SIGINT / SIGTERM: every process of the run ended (flows.process.shutdown)
        exit_now(end)
    except UsageError as err:
        message = " ".join(err.format_message().replace("Value error, ", "").split())
        if message:  # (no_args_is_help has printed the help and has no message)
            where = err.ctx.command_path if err.ctx is not None else "fp8rl"
            typer.echo(f"error: {message} (see `{where} --help`)", err=True)
        sys.exit(2)
    except typer.Abort:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
