"""Shared test set-up: an isolated Prefect home, a session bootstrap cache, the micro campaign.

Prefect settings must be in the environment before Prefect is imported, so they
are set at collection time. The micro campaign is the tiny default shrunk to
seconds per step: a barely-bootstrapped model (its accuracy is not the point
here), 8 prompts x 4 samples, two mini-batches of two micro-batches.

Beside them, what several test files share: the micro campaign opened in this process
(:func:`open_micro_run`) or run as an ``fp8rl`` command (:func:`micro_args`, :class:`CliProcess`),
a run's rows and weights, the sessions and tagged processes a command leaves, the engines'
tokenizer, policy and prompts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SESSION_TMP = Path(tempfile.mkdtemp(prefix="fp8rl-tests-"))  # removed at the end of the session
os.environ.setdefault("PREFECT_HOME", str(_SESSION_TMP / "prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")
os.environ.setdefault("FP8RL_BOOTSTRAP_CACHE", str(_SESSION_TMP / "bootstrap"))
# Campaigns and bootstraps the tests start run on one torch thread: two xdist workers
# share two cores (make test: -n 2), and 2-thread processes side by side spin in OpenMP barriers.
os.environ.setdefault("FP8RL_MAX_THREADS", "1")
# Strict FP8 shape contracts: the emulation rejects what the GPU kernels reject.
os.environ.setdefault("FP8RL_STRICT_FP8_SHAPES", "1")
# The test hooks of storage.faults (FP8RL_FAULT, FP8RL_INJECT_LR) act only when armed, here,
# for the session and every process its tests start; a user's environment alone arms nothing.
os.environ["FP8RL_TEST_HOOKS"] = "1"

MICRO_OVERRIDES = [
    "steps=3",
    "bootstrap.steps=40",
    "bootstrap.noisy_steps=10",
    "rollout.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=12",
    "algorithm.ppo_mini_batch_size=16",
    "algorithm.micro_batch_size=8",
    "algorithm.token_stats_sample=0.5",
    "calibration.interval=2",
    "evaluation.interval=2",
    "evaluation.benchmarks=[{name: synthetic, k: 2, limit: 24, max_new_tokens: 12}]",
    "checkpoint.interval=2",
    "checkpoint.keep_last=3",
]


def micro_config(*extra: str):
    from flows.campaign.configuration import load_config

    return load_config("tiny-cpu", MICRO_OVERRIDES + list(extra))


def peaked_policy():
    """A tiny Qwen3 whose next-token distributions are peaked (random init is nearly uniform,
    which would make log-prob comparisons toothless): the engines' tests' policy."""
    import torch

    from fp8rl_core.config.model import ModelConfig
    from fp8rl_core.tasks.tiny_model import build_tiny_model

    model = build_tiny_model(ModelConfig(seed=3))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15, generator=gen)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny policy's character-level tokenizer, one per test module."""
    from fp8rl_core.tasks.tiny_model import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def policy():
    """The :func:`peaked_policy`, one per test module (a module may define its own ``policy``)."""
    return peaked_policy()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Four prompts of unequal lengths (left padding must not change anything)."""
    return [tokenizer.encode(t) for t in ("12+7=", "3*4=", "a", "100-58=")]


class StageRun:
    """The explicit (environment, state) pair of a run, the state threaded through stage calls:
    ``run(run_train, step)`` calls ``run_train(env, state, step)`` and keeps the new state."""

    def __init__(self, env, state):
        self.env, self.state = env, state

    def __call__(self, stage, step, **kw):
        summary, self.state = stage(self.env, self.state, step, **kw)
        return summary

    def close(self):
        self.env.close()


def open_micro_run(root: Path, cfg, name: str = "r"):
    """Create run ``name`` under ``root`` with ``cfg`` and open it in this process: its (environment, state)."""
    from flows.campaign.configuration import dump_config
    from stages.context import open_run
    from storage.run.layout import create_run

    create_run(root, name, config=dump_config(cfg))
    return open_run(cfg, Path(root) / name)


def run_rows(run_dir: Path, sql: str) -> list[dict]:
    """The rows ``sql`` reads from a run's tables (through ``storage.queries.catalog``)."""
    from storage.queries.catalog import connect, query

    return query(connect(run_dir), sql).to_pylist()


def last_checkpoint_weights(run_dir: Path) -> dict:
    """The model weights (name -> tensor) of a run's latest checkpoint."""
    from safetensors.torch import load_file

    ck = sorted((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))[-1]
    return load_file(str(next((ck / "model").glob("*.safetensors"))))


def set_args(*overrides: str) -> list[str]:
    """The ``--set`` flags of ``overrides``, in order."""
    return [a for o in overrides for a in ("--set", o)]


def micro_args(*extra: str) -> list[str]:
    """The ``--set`` flags of the micro campaign (:data:`MICRO_OVERRIDES`), then of ``extra``."""
    return set_args(*MICRO_OVERRIDES, *extra)


def default_sigint() -> None:  # pragma: no cover - runs in the child
    """In a child (``preexec_fn``): SIGINT acts as at a terminal (a test runner or a background job may ignore it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kill_session(pid: int) -> None:
    """SIGKILL the session ``pid`` leads (orphans of a killed run included), if anything of it is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


class CliProcess:
    """``python -m flows.cli ARGS`` from the repository root in a session of its own, its stderr in a file
    (orphans of a killed run would hold pipes open); :meth:`finish` leaves nothing of it running."""

    finish_s = 600.0  # how long :meth:`finish` waits by default

    def __init__(self, args: list[str], env: dict[str, str], *, stdout=subprocess.DEVNULL, sigint: bool = False):
        """``sigint``: SIGINT acts in the child as at a terminal (:func:`default_sigint`)."""
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", *args],
            cwd=ROOT,
            env=env,
            stdout=stdout,
            stderr=self.err,
            text=True,
            start_new_session=True,
            preexec_fn=default_sigint if sigint else None,
        )

    def finish(self, timeout: float | None = None) -> int:
        """The exit code (waiting ``timeout``, default :attr:`finish_s`); then SIGKILL what is left of the session."""
        try:
            return self.proc.wait(timeout=self.finish_s if timeout is None else timeout)
        finally:
            kill_session(self.proc.pid)  # nothing should be left; never leave it to the suite

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()


def tagged_pids(var: str, tag: str) -> list[int]:
    """The processes whose environment holds ``var=tag``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"{var}={tag}".encode() in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def app_with(register):
    """A Typer app with one command module's commands (``register``), exceptions plain."""
    import typer

    app = typer.Typer(pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:
        """test app"""

    register(app)
    return app


_PREFECT_SERVER: list = []  # this worker's shared Prefect server (tests/shared_prefect.py), once started


def _share_a_prefect_server(items) -> None:
    """Campaigns started as processes report to one Prefect server per worker (``tests/shared_prefect.py``),
    started when this worker collected a campaign test and no server is configured already."""
    if _PREFECT_SERVER or os.environ.get("PREFECT_API_URL"):
        return
    if not any(item.get_closest_marker("slow") or item.get_closest_marker("vllm") for item in items):
        return
    import shared_prefect

    started = shared_prefect.start(sys.executable, _SESSION_TMP / "prefect-server", _SESSION_TMP / "prefect-server.log")
    if started is not None:
        os.environ["PREFECT_API_URL"] = started[0]
        _PREFECT_SERVER.append(started[1])


def pytest_terminal_summary(terminalreporter) -> None:
    """The CPU the suite ran on, last: the golden tables and the primitive hashes are checked on it."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from flows.campaign.cpu_numerics import cpu_model

    flags = set()
    with contextlib.suppress(OSError):
        flags = set(next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    terminalreporter.write_line(f"CPU: {cpu_model()} ({', '.join(isa) or 'no AVX2'}), {os.cpu_count()} cores")


def pytest_unconfigure(config) -> None:
    """Stop the shared Prefect server; remove the session's temporary folder (Prefect home, bootstrap cache)."""
    if _PREFECT_SERVER:
        import shared_prefect

        shared_prefect.stop(_PREFECT_SERVER.pop())
        os.environ.pop("PREFECT_API_URL", None)
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)


@pytest.fixture(scope="session")
def session_tmp() -> Path:
    return _SESSION_TMP


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes: one intra-op torch thread is fastest and leaves the other core free.

    Only for test modules that use torch (imported at collection); others stay torch-free.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


BENCHMARK_SIZES = {  # the shipped benchmarks' published test splits, in problems
    "aime24": 30,
    "aime25": 30,
    "amc23": 40,
    "math500": 500,
    "minerva_math": 272,
    "olympiadbench": 675,
    "gsm8k": 1319,
}
DATA_DIR = os.environ.get("FP8RL_DATA_DIR")  # the folder of benchmark files, where this machine has it
needs_data = pytest.mark.skipif(
    not DATA_DIR or not Path(DATA_DIR).is_dir(), reason="FP8RL_DATA_DIR is not set to the folder of benchmark files"
)


@pytest.fixture
def data_dir() -> Path:
    d = os.environ.get("FP8RL_DATA_DIR")
    if not d or not Path(d).is_dir():
        pytest.skip("benchmark data folder absent: set FP8RL_DATA_DIR to the folder of benchmark files")
    return Path(d)


# ----------------------------------------------------------------- two workers (make test: -n 2)
# `make test` runs the suite on both cores with pytest-xdist (`-n 2 --dist loadfile
# --no-loadscope-reorder`): a file's tests run on one worker, so a module's fixtures (a
# reference campaign, a bootstrap) are built once, and files are handed out in the
# order below. Tests that watch machine-wide state keep to their own
# share of it (the sandbox tests count processes in a uid band of their own).
# Longest files first, so the two workers finish together instead of one waiting on a
# long file drawn last (measured with --durations on an idle 2-core machine).
_LONG_FIRST = (  # measured 2026-12-03 (seconds of test time per file, both workers busy)
    "test_vllm_campaign",  # ~400: campaigns through real vLLM (skipped without .venv-vllm)
    "test_campaign",  # ~390
    "test_signals",  # ~330: Prefect's temporary server on purpose
    "test_spmd_campaign",  # ~165
    "test_cluster_campaign",  # ~200: Slurm on localhost (measured 2026-12-06)
    "test_vllm_http_real",  # ~150
    "test_rank_failure",  # ~100
    "test_staleness",  # ~90 (measured 2026-12-06)
    "test_nccl_sync",  # ~90: vLLM's NCCL engines on the gloo stand-in
    "test_torchao_campaign",
    "test_golden_tables",
    "test_guard",
    "test_train_scaleout",
    "test_deploy",
    "test_gpu_check_vllm",
    "test_trackers",
    "test_gpu_check_cpu",
    "test_stages",
    "test_dp_lockstep",
    "test_rollout_ranks",
    "test_integrity",
    "test_one_line_errors",
    "test_bootstrap",
    "test_sandbox",
    "test_code_rl",
)


def pytest_collection_modifyitems(config, items) -> None:
    _share_a_prefect_server(items)
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(rank)))  # stable


@pytest.fixture
def micro_run(tmp_path: Path) -> Path:
    """A run directory made by the micro config (config.yaml + run.json), with a few table rows."""
    from integrity_helpers import run_with_rows

    from flows.campaign.configuration import dump_config

    return run_with_rows(tmp_path / "runs", "micro", config=dump_config(micro_config()))
