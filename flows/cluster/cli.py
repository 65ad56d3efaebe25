"""``fp8rl submit``: a campaign as a cluster job, supervised until it completes (docs/cluster.md).

Every check that can refuse the submission runs before anything is written or
submitted, and a refusal is one line, exit 2: an unknown backend, ``--nodes 0``, a run
directory outside ``cluster.shared_path``, more nodes than the partition has, a real
submission where ``sbatch`` is not installed. ``--dry-run`` prints the job and the
analytic memory plan and needs no scheduler.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime
from pathlib import Path

import typer

from flows.campaign.configuration import ConfigError, dump_config, load_config
from flows.commands.common import fail, io_errors


def _load(config: str, set_: list[str], nodes: int | None, gpus_per_node: int | None):
    extra = [*([f"cluster.nodes={nodes}"] if nodes is not None else []),
             *([f"cluster.gpus_per_node={gpus_per_node}"] if gpus_per_node is not None else [])]  # fmt: skip
    try:
        return load_config(config, [*set_, *extra])
    except ConfigError as err:
        raise fail(str(err))


def _run_dir(cfg, run_dir: Path | None) -> Path:
    """Where the run goes: ``--run-dir`` or ``<shared path>/<name>-<time>``; refused outside the shared path."""
    shared = Path(cfg.cluster.shared_path or cfg.storage.runs_root).expanduser().resolve()
    if run_dir is None:
        run_dir = shared / f"{cfg.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    run_dir = run_dir.expanduser().resolve()
    if cfg.cluster.shared_path and not run_dir.is_relative_to(shared):
        raise fail(
            f"run directory {run_dir} is outside cluster.shared_path {shared}: every node must see it; "
            "give a --run-dir under the shared path"
        )
    return run_dir


def _check_layout(cfg) -> None:
    """A rollout engine's tensor-parallel group stays inside one node: torchrun numbers a node's ranks
    consecutively, so ``gpus_per_node`` must be a multiple of the group; one engine over all ranks
    (``shared_tp``) would span nodes."""
    c, r = cfg.cluster, cfg.rollout
    if r.data_parallel == "shared_tp" and c.nodes > 1:
        raise fail(
            f"rollout.data_parallel shared_tp spreads one engine over all {c.nodes * c.gpus_per_node} ranks, across "
            f"{c.nodes} nodes: use per_rank with rollout.tensor_parallel_size <= cluster.gpus_per_node"
        )
    if c.gpus_per_node % r.tensor_parallel_size:
        raise fail(
            f"rollout.tensor_parallel_size={r.tensor_parallel_size} does not divide cluster.gpus_per_node="
            f"{c.gpus_per_node}: a tensor-parallel group would span two nodes"
        )


def _dry_run(cfg, backend_name: str, run_dir: Path) -> None:
    from flows.cluster.supervise import project_root

    if backend_name == "k8s":
        from flows.cluster.k8s_job import render as render_k8s

        typer.echo(render_k8s(cfg, run_dir, python=sys.executable, workdir=project_root()))
    else:
        from flows.cluster.slurm_script import render

        resume = (run_dir / "run.json").is_file()  # a run resubmitted: its job resumes
        typer.echo(render(cfg, run_dir, python=sys.executable, workdir=project_root(), resume=resume))
    from flows.plan.memory import format_plan, memory_plan

    gpus = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    typer.echo(f"# memory plan: {cfg.cluster.nodes} node(s) x {cfg.cluster.gpus_per_node} GPU(s) = {gpus} GPU(s)")
    try:
        typer.echo(format_plan(cfg, memory_plan(cfg, gpus=gpus, gpu_memory_gib=80.0, prompt_tokens=1024), gpus=gpus,
                               gpu_memory_gib=80.0))  # fmt: skip
    except ValueError as err:
        typer.echo(f"(no analytic memory plan for this model: {err})")


def _check_slurm(cfg) -> None:
    """Before anything is written: the scheduler's tools are here, and the partition has the nodes."""
    from flows.cluster import slurm
    from flows.cluster.backends import backend

    missing = slurm.missing_tools(backend("slurm").needs)
    if missing:
        raise fail(
            f"--backend slurm: {', '.join(missing)} not found on this machine; submit from a node with Slurm's "
            "client tools (or see the job with --dry-run)"
        )
    try:
        name, count = slurm.partition_nodes(cfg.cluster.partition)
    except slurm.SlurmError as err:
        raise fail(f"--backend slurm: {err}")
    if cfg.cluster.nodes > count:
        raise fail(f"cluster.nodes={cfg.cluster.nodes}: partition {name} has {count} node(s)")


def _check_inputs(cfg) -> None:
    """The campaign's own inputs, as ``fp8rl run`` checks them, for the job's world size."""
    from stages.data.prompts import make_source
    from stages.evaluate import check_benchmarks
    from stages.trainer.batch import check_world_size

    try:
        check_world_size(cfg, cfg.cluster.nodes * cfg.cluster.gpus_per_node)
        make_source(cfg.task)
        check_benchmarks(cfg)
    except (FileNotFoundError, ValueError, OSError, KeyError) as err:
        raise fail(str(err).strip("'"))


def _create(cfg, run_dir: Path) -> None:
    """The run directory, made once on the shared path before the job is submitted."""
    from flows.commands.run import check_new_run_dir
    from storage.errors import StorageError
    from storage.run import lock
    from storage.run.layout import create_run

    run_dir = check_new_run_dir(run_dir, None)
    with io_errors(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
        with lock.run_lock(run_dir):
            try:
                create_run(run_dir.parent, run_dir.name, config=dump_config(cfg))
            except StorageError as err:
                raise fail(str(err))


def _supervise(run_dir: Path) -> dict:
    from flows.campaign.launch import until_signal
    from flows.cluster.supervise import JobsFailed, supervise_flow

    user_api = os.environ.get("PREFECT_API_URL")

    def body(start_server) -> dict:
        from flows.orchestration.env import quiet_console_failures

        start_server()
        quiet_console_failures()
        return supervise_flow(str(run_dir), user_api_url=user_api)

    try:
        return until_signal(body, resume=f"fp8rl submit {run_dir}")
    except JobsFailed as err:
        raise fail(f"{err}; `fp8rl submit {run_dir}` resubmits it to resume") from None


def submit(
    config: str = typer.Argument(..., help="Preset name, YAML file, or a run directory to resubmit (resume)."),
    backend: str = typer.Option("slurm", "--backend", help="local, slurm or k8s (k8s: --dry-run only)."),
    nodes: int | None = typer.Option(None, "--nodes", min=1, help="Nodes of the job (default: cluster.nodes)."),
    gpus_per_node: int | None = typer.Option(
        None, "--gpus-per-node", min=1, help="Ranks per node (default: cluster.gpus_per_node)."
    ),
    set_: list[str] = typer.Option([], "--set", help="Override a config value (repeatable)."),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Run directory, under cluster.shared_path."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the job and the memory plan; submit nothing."),
) -> None:
    """Run a campaign as a cluster job: render it, submit it, resubmit it to resume when it fails."""
    from flows.cluster.backends import backend as backend_of

    try:
        kind = backend_of(backend)
    except ValueError as err:
        raise fail(str(err))
    existing = Path(config).expanduser()
    if (existing / "run.json").is_file():  # a run to resubmit: its own config, as recorded
        if set_ or nodes or gpus_per_node or run_dir:
            raise fail(f"{existing} is a run directory: it is resubmitted with its own config (no --set/--nodes)")
        cfg, run_dir = _load(str(existing / "config.yaml"), [], None, None), existing.resolve()
    else:
        cfg = _load(config, set_, nodes, gpus_per_node)
        run_dir = _run_dir(cfg, run_dir)
    _check_layout(cfg)
    if dry_run:
        if kind.renders is None:
            raise fail("--backend local runs here: there is no job to show (`fp8rl plan` shows its memory)")
        _dry_run(cfg, kind.name, run_dir)
        return
    if not kind.submits:
        raise fail(kind.why_not)
    if kind.name == "local":
        from flows.commands.run import resume, run

        if cfg.cluster.nodes > 1:
            raise fail(f"--backend local runs on this machine alone; cluster.nodes={cfg.cluster.nodes} needs slurm")
        if (run_dir / "run.json").is_file():
            return resume(run_dir, None, None, None, [], cfg.cluster.gpus_per_node, False)
        return run(config, [*set_, *([f"cluster.gpus_per_node={gpus_per_node}"] if gpus_per_node else [])],
                   run_dir, cfg.cluster.gpus_per_node, False)  # fmt: skip
    _check_slurm(cfg)
    if not (run_dir / "run.json").is_file():
        _check_inputs(cfg)
        _create(cfg, run_dir)
    typer.echo(f"run directory: {run_dir}")
    result = _supervise(run_dir)
    typer.echo(f"run finished: {run_dir}")
    for k, v in (result.get("last_eval") or {}).items():
        typer.echo(f"  final {k}: {100 * v:.1f}%")
    typer.echo(f'attempts: fp8rl query {run_dir} "SELECT * FROM job_attempts ORDER BY attempt"')


def register(app: typer.Typer) -> None:
    app.command("submit")(submit)
