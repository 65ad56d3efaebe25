"""``fp8rl deploy``: register a campaign as a Prefect deployment on a process work pool.

Needs a Prefect server (``PREFECT_API_URL``); without one, or with a bad
config, a bad cron string or an unreachable server, it prints one line and
exits with code 2 before anything is registered. The config is resolved here
only to check it: the deployment stores the preset and the overrides, and each
flow run resolves them again (see :mod:`flows.campaign.deploy`).
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from flows.campaign.configuration import ConfigError, load_config
from flows.commands.common import fail as _fail

NO_SERVER = (
    "PREFECT_API_URL is not set: a deployment lives on a Prefect server; start one with "
    "`prefect server start` and `export PREFECT_API_URL=http://127.0.0.1:4200/api`"
)


def _check_server(api_url: str) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        err = client.api_healthcheck()
    if err is not None:
        raise _fail(
            f"cannot reach the Prefect server at {api_url} ({type(err).__name__}: {err}); is `prefect "
            f"server start` running?"
        )


def deploy(
    config: str = typer.Argument("tiny-cpu", help="Preset name in configs/ or a YAML file."),
    set_: list[str] = typer.Option([], "--set", help="Override a config value, e.g. steps=200 (repeatable)."),
    pool: str = typer.Option("fp8rl", "--pool", help="Process work pool (created if missing)."),
    name: str | None = typer.Option(None, "--name", help="Deployment name (default: the config's name)."),
    cron: str | None = typer.Option(None, "--cron", help='Schedule, e.g. "0 2 * * *" (daily at 02:00).'),
    timezone: str | None = typer.Option(
        None, "--timezone", help="Time zone of --cron, e.g. Europe/Paris (default UTC)."
    ),
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Run every flow run in this directory (default: a new one per run)."
    ),
    resume: bool = typer.Option(False, "--resume", help="With --run-dir: continue the run there if it exists."),
) -> None:
    """Deploy a campaign to a Prefect work pool, to run on demand or on a --cron schedule."""
    api_url = os.environ.get("PREFECT_API_URL")
    if not api_url:
        raise _fail(NO_SERVER)
    if resume and run_dir is None:
        raise _fail("--resume needs --run-dir (the run directory to continue)")
    try:
        cfg = load_config(config, set_)
    except ConfigError as err:
        raise _fail(str(err))
    if Path(config).is_file():  # the worker runs from the project directory: pass the file absolutely
        config = str(Path(config).resolve())
    if cron is not None:
        from prefect.client.schemas.schedules import CronSchedule
        from pydantic import ValidationError

        try:
            CronSchedule(cron=cron, timezone=timezone)
        except ValidationError as err:
            where = f"--cron {cron!r}" + (f" --timezone {timezone!r}" if timezone else "")
            raise _fail(f"{where}: {err.errors()[0]['msg'].removeprefix('Value error, ')}")

    from flows.campaign.deploy import CampaignParameters, DeploymentInputError, deploy_campaign, ensure_process_pool

    _check_server(api_url)
    name = name or cfg.name
    try:
        if ensure_process_pool(pool):
            typer.echo(f"created work pool {pool!r} (type process)")
        params = CampaignParameters(
            config, tuple(set_), str(run_dir.expanduser().resolve()) if run_dir else None, resume
        )
        deploy_campaign(
            name=name,
            params=params,
            work_pool=pool,
            cron=cron,
            timezone=timezone,
        )
    except DeploymentInputError as err:
        raise _fail(str(err))
    full = f"fp8rl/{name}"
    typer.echo(f"deployed {full} on work pool {pool!r}" + (f", schedule {cron!r}" if cron else ""))
    typer.echo("next:")
    typer.echo(f"  prefect worker start --pool {pool} --limit 1      # on the machine that runs campaigns")
    typer.echo(f"  prefect deployment run {full}                     # one run now")
    typer.echo(f"  prefect deployment run {full} --param run_dir=DIR --param resume=true   # continue DIR")


def register(app: typer.Typer) -> None:
    app.command("deploy")(deploy)
