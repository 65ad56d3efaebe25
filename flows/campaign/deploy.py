"""A campaign as a Prefect deployment: run on a work pool, from a server, on demand or on a schedule.

A deployment is the server's record of *what* to run (:func:`deployed_campaign`,
loaded from the project directory by its entrypoint
``flows/campaign/deploy.py:deployed_campaign``), *where* (a work pool: a ``process``
pool runs each flow run as a subprocess of a worker on a machine holding the
project) and *when* (a cron schedule, or on demand with ``prefect deployment
run``). Two equivalent ways to make one:

- ``fp8rl deploy [CONFIG] [--set k=v ...] [--pool P] [--cron "..."]``
  (:mod:`flows.commands.deploy`): checks the config, creates the process pool if it
  is missing, then calls :func:`deploy_campaign`;
- ``prefect deploy --name tiny-cpu`` with ``prefect.yaml`` at the project root.

Each flow run of a deployment takes the preset and overrides as parameters (so
the UI shows, and ``--param`` changes, what runs), checks them, makes or
reopens a run directory, and calls :func:`flows.campaign.flow.campaign_flow` as a
subflow: the stages' tasks, retries, logs and artifacts appear under it on the
server, and the run directory's ledger stays the truth for resume.

Run directories, like ``fp8rl run``'s:

============================== ===============================================
parameters                     what a flow run does
============================== ===============================================
no ``run_dir``                 starts ``<runs_root>/<name>-<time>-<flow run>``
``run_dir`` absent             starts a campaign there
``run_dir`` holding a run      resumes it if ``resume`` (config must match),
                               else fails: nothing is overwritten
============================== ===============================================

so a fixed ``run_dir`` with ``resume=true`` is "start, or continue where the
last flow run stopped" — the way to restart a crashed or cancelled flow run of
a long campaign. Relative paths resolve against the flow run's working
directory, which is the project directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID

from flows.campaign.configuration import DEFAULT_PRESET, ConfigError, dump_config, load_config
from flows.orchestration.env import configure_prefect_env
from fp8rl_core.config.campaign import CampaignConfig

configure_prefect_env()

from prefect import flow, get_run_logger  # noqa: E402

PROJECT_ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = "flows/campaign/deploy.py:deployed_campaign"
FLOW_NAME = "fp8rl"  # deployments read "fp8rl/<deployment name>"
DEFAULT_POOL = "fp8rl"


class DeploymentInputError(ValueError):
    """A flow-run parameter or input file that cannot work; the message is one line."""


def check_inputs(cfg: CampaignConfig) -> None:
    """Load the task's prompts and every benchmark once, so a missing file fails before anything is written."""
    from stages.data.prompts import make_source
    from stages.evaluate import check_benchmarks

    try:
        make_source(cfg.task)
        check_benchmarks(cfg)
    except (FileNotFoundError, KeyError, OSError, ValueError) as err:
        raise DeploymentInputError(f"input data: {str(err).strip(chr(39))}") from None


def prepare_run_dir(cfg: CampaignConfig, run_dir: str | None, resume: bool, *, run_name: str) -> tuple[Path, bool]:
    """Create (or reopen, to resume) the run directory of one flow run; return it and whether to resume."""
    from storage.errors import StorageError
    from storage.run.layout import create_run

    if run_dir is None:
        if resume:
            raise DeploymentInputError("resume=true needs run_dir: the run directory to continue")
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path(cfg.storage.runs_root) / f"{cfg.name}-{stamp}-{run_name}"
    else:
        path = Path(run_dir)
    path = path.expanduser().resolve()
    exists = (path / "run.json").exists()
    if exists and not resume:
        raise DeploymentInputError(
            f"{path} already holds a run; run with resume=true to continue it, or another run_dir"
        )
    try:  # with exist_ok, a run made by another config is an error naming both hashes
        create_run(path.parent, path.name, config=dump_config(cfg), exist_ok=True)
    except StorageError as err:
        raise DeploymentInputError(str(err)) from None
    return path, exists


@flow(name=FLOW_NAME, persist_result=False, log_prints=False)
def deployed_campaign(
    config: str = DEFAULT_PRESET,
    overrides: list[str] | None = None,
    run_dir: str | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Run a campaign from a preset and ``key=value`` overrides, in a new run directory or in ``run_dir``.

    Args:
        config: preset name in ``configs/`` or a YAML path (absolute, or relative to the project).
        overrides: ``--set``-style ``key=value`` strings applied on top of the preset.
        run_dir: run directory; default a new one under ``storage.runs_root``.
        resume: continue ``run_dir`` from its ledger if it already holds a run.
    """
    from prefect.runtime import flow_run

    from flows.campaign.flow import campaign_flow

    logger = get_run_logger()
    try:
        cfg = load_config(config, list(overrides or []))
    except ConfigError as err:
        raise DeploymentInputError(str(err)) from None
    check_inputs(cfg)
    path, resuming = prepare_run_dir(cfg, run_dir, resume, run_name=flow_run.get_name() or "run")
    logger.info("%s campaign %r in %s", "resuming" if resuming else "starting", cfg.name, path)
    return campaign_flow(str(path), resume=resuming)


# --------------------------------------------------------------------------- deploying


def ensure_process_pool(name: str) -> bool:
    """Make sure work pool ``name`` exists and is of type ``process``; return True if it was created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            template = ProcessWorker.get_default_base_job_template()
            client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template))
            return True
    if pool.type != "process":
        raise DeploymentInputError(
            f"work pool {name!r} is of type {pool.type!r}; a campaign deploys from the local project "
            "directory, which needs a 'process' pool (pick another --pool)"
        )
    return False


@dataclass(frozen=True)
class CampaignParameters:
    """The parameters every flow run of a deployment gets (those of :func:`deployed_campaign`)."""

    config: str
    overrides: tuple[str, ...] = ()
    run_dir: str | None = None
    resume: bool = False

    def as_dict(self) -> dict:
        return {
            "config": self.config, "overrides": list(self.overrides), "run_dir": self.run_dir, "resume": self.resume
        }


def deploy_campaign(
    *,
    name: str,
    params: CampaignParameters,
    work_pool: str = DEFAULT_POOL,
    cron: str | None = None,
    timezone: str | None = None,
    source: Path = PROJECT_ROOT,
) -> UUID:
    """Create or update deployment ``fp8rl/<name>`` of :func:`deployed_campaign` on ``work_pool``; return its id.

    The flow is loaded from ``source`` (the project directory) and the
    deployment records a pull step that makes it the flow run's working
    directory, so a worker on this machine runs the code of this checkout as it
    is when the run starts. A schedule is added when ``cron`` is given.
    """
    from prefect.client.schemas.schedules import CronSchedule

    schedules = [CronSchedule(cron=cron, timezone=timezone)] if cron else None
    deployable = deployed_campaign.from_source(source=str(source), entrypoint=ENTRYPOINT)
    return deployable.deploy(
        name=name,
        work_pool_name=work_pool,
        parameters=params.as_dict(),
        schedules=schedules,
        description=f"fp8rl campaign: {params.config} {' '.join(params.overrides)}".strip(),
        tags=["fp8rl"],
        print_next_steps=False,
        ignore_warnings=True,  # the "process pool: consider .serve" hint; we do want a worker here
    )
