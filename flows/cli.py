"""The ``fp8rl`` command line.

Subcommands are contributed by modules that expose ``register(app)``; a module
that fails to import for lack of an optional dependency does not take the
others down. User errors exit with code 2 and one line on stderr.
"""

from __future__ import annotations

import importlib
import sys

import typer

from fp8rl_core.precision import silence_torchao_import_noise

silence_torchao_import_noise()  # before transformers imports torchao

app = typer.Typer(
    name="fp8rl",
    help="FP8 end-to-end RL (GRPO/DAPO) with Calibrated Clipping: run, resume, query, report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Modules contributing commands, in help order.
_COMMAND_MODULES = (
    "flows.cli_campaign",  # run, resume, rerun
    "flows.cli_deploy",  # deploy
    "flows.cli_storage",  # query, doctor
    "flows.cli_report",  # report, sweep
    "flows.cli_world",  # bootstrap, benchmarks
    "flows.plan",  # plan (issue 11)
)


@app.callback()
def _root() -> None:
    """FP8 end-to-end RL (GRPO/DAPO) with Calibrated Clipping."""


def fail(message: str, code: int = 2) -> "typer.Exit":
    """Print one line to stderr and return the Exit to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _register_all() -> None:
    for name in _COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:
                continue  # not written yet / not shipped
            raise
        mod.register(app)


@app.command("config")
def show_config(
    preset: str = typer.Argument("tiny-cpu", help="Preset name in configs/ or a YAML path."),
    set_: list[str] = typer.Option([], "--set", help="Override, e.g. calibration.interval=10 (repeatable)."),
) -> None:
    """Print the resolved configuration of a preset (after overrides)."""
    from flows.configuration import ConfigError, dump_config, load_config

    try:
        cfg = load_config(preset, set_)
    except ConfigError as err:
        raise fail(str(err))
    typer.echo(dump_config(cfg))


_register_all()


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
