"""Prefect's temporary server: each way it fails is one line, exit 2, no traceback, no process left.

The fault matrix of ``flows/orchestration/server.py``, ``flows/orchestration/preflight.py`` and the home per
Prefect version (``flows/orchestration/env.py``):

============================================ ============================================================
fault                                        what the command does
============================================ ============================================================
a database another (newer) Prefect migrated  refused before the run directory exists, naming the database,
in the home the user gave                    its revision and the fix (in-process; and with the older
                                             Prefect of ``.venv-vllm`` on a newer one's database)
both Prefect versions on one machine         each default home is its version's: the older runs beside a
                                             database the newer migrated
every port of the server's range taken       refused before the run directory exists; a start that finds
                                             them taken later says so and starts nothing
a server that never answers (the start-up    one line (cause, log, resume command), exit 2, nothing left
limit) or exits at start-up
two starts at once in one home               they take turns: the second waits while the first starts
a server killed mid-run                      one line within seconds, exit 2, nothing left; the resume
                                             gives the uninterrupted run's tables
============================================ ============================================================
"""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from contextlib import closing, contextmanager
from pathlib import Path

import pytest
from conftest import CliProcess, micro_args, tagged_pids
from integrity_helpers import cli, one_line_exit_2
from shared_prefect import without_server

ROOT = Path(__file__).resolve().parents[3]
TAG = "FP8RL_PREFECT_SERVER_TEST_TAG"  # in the environment of every process a case starts
RESUMABLE = "the run stays resumable: `fp8rl resume {}`"


@pytest.fixture
def own_env(monkeypatch):
    """The temporary server's settings as a user has them (no configured server); whatever the code under
    test sets in the environment is undone afterwards."""
    saved = dict(os.environ)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def no_flow(monkeypatch):
    """``fp8rl run`` up to the campaign flow, which is replaced: what the command checks first is the point."""
    import flows.commands.run as cc

    monkeypatch.setattr(cc, "_run_flow", lambda run_dir, resume, **kw: {})


def _migrated(home: Path, revision: str) -> Path:
    """A Prefect home whose database records ``revision`` as its schema (what the server's migrations
    leave in ``alembic_version``, the one row the check reads)."""
    home.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(home / "prefect.db")) as con:
        con.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL PRIMARY KEY)")
        con.execute("INSERT INTO alembic_version VALUES (?)", (revision,))
        con.commit()
    return home


def _head_revision() -> str:
    """The newest schema revision of this venv's Prefect: the one no migration script names as its parent."""
    import importlib.util
    import re

    prefect = Path(next(iter(importlib.util.find_spec("prefect").submodule_search_locations)))
    revisions, parents = set(), set()
    for script in (prefect / "server/database/_migrations/versions/sqlite").glob("*.py"):
        text = script.read_text()
        revisions.update(re.findall(r"""^revision\s*(?::[^=]*)?=\s*["'](\w+)["']""", text, re.M))
        parents.update(re.findall(r"""^down_revision\s*(?::[^=]*)?=\s*["'](\w+)["']""", text, re.M))
    heads = sorted(revisions - parents)
    assert len(heads) == 1, heads
    return heads[0]


# ------------------------------------------------------------------------- before the run directory exists


def test_a_database_another_prefect_migrated_is_refused_before_the_run_directory(tmp_path, own_env, no_flow):
    from flows.orchestration.env import default_home, prefect_version

    os.environ.pop("PREFECT_HOME", None)
    os.environ["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    assert default_home() == tmp_path / "cache" / "fp8rl" / "prefect" / prefect_version()  # one per version

    os.environ["PREFECT_HOME"] = str(_migrated(tmp_path / "home", "ffffffffffff"))
    run = tmp_path / "runs" / "r"
    r = cli("run", "tiny-cpu", "--run-dir", run)
    one_line_exit_2(
        r, f"the Prefect database {tmp_path / 'home' / 'prefect.db'}", "revision ffffffffffff", "unset PREFECT_HOME"
    )
    assert not run.exists()

    _migrated(tmp_path / "own", _head_revision())  # this Prefect's own schema passes
    os.environ["PREFECT_HOME"] = str(tmp_path / "own")
    assert cli("run", "tiny-cpu", "--run-dir", run).exit_code == 0


@contextmanager
def _taken_ports(n: int = 2):
    """``n`` consecutive ports on 127.0.0.1, each held by a listening socket: (first, last)."""
    for _ in range(50):
        held: list[socket.socket] = []
        try:
            first = None
            for i in range(n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", 0 if first is None else first + i))
                s.listen()
                first = s.getsockname()[1] if first is None else first
            yield first, first + n - 1
            return
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    pytest.fail("found no consecutive free ports")


def test_ports_all_taken_or_a_bad_server_setting_are_refused_before_the_run_directory(tmp_path, own_env, no_flow):
    from flows.orchestration import server as prefect_server
    from flows.orchestration.preflight import ServerUnavailable

    run = tmp_path / "runs" / "r"
    with _taken_ports() as (first, last):
        os.environ["FP8RL_PREFECT_PORTS"] = f"{first}-{last}"
        one_line_exit_2(
            cli("run", "tiny-cpu", "--run-dir", run), "no free port", f"{first}-{last}", "FP8RL_PREFECT_PORTS"
        )
        assert not run.exists()
        # taken between that check and the start: the start says so, and starts nothing
        base, own = prefect_server._server_class()
        earlier = base._instances.pop(None, None)  # a server an earlier test of this process started
        try:
            server = own()
            with pytest.raises(ServerUnavailable, match=f"no free port .* in {first}-{last}"):
                server.start()
            assert server.server_process is None and not server.running
        finally:
            base._instances.pop(None, None)
            if earlier is not None:
                base._instances[None] = earlier
    os.environ["FP8RL_PREFECT_PORTS"] = "9000-80"
    one_line_exit_2(cli("run", "tiny-cpu", "--run-dir", run), "FP8RL_PREFECT_PORTS='9000-80'", "FIRST-LAST")
    os.environ.pop("FP8RL_PREFECT_PORTS")
    os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "soon"  # Prefect: a traceback at import
    one_line_exit_2(cli("run", "tiny-cpu", "--run-dir", run), "TIMEOUT_SECONDS='soon'", "whole seconds")
    assert not run.exists()


@pytest.mark.vllm
def test_both_prefect_versions_on_one_machine_each_keep_their_own_home(tmp_path):
    """The older Prefect (``.venv-vllm``) beside a database the newer one (this venv) migrated: with the
    default homes both run; on a home the user gave both, the older refuses in one line, at once."""
    from real_vllm import skip_reason, vllm_python

    if (why := skip_reason()) is not None:
        pytest.skip(why)

    def version(python: str) -> str:
        code = "import importlib.metadata as m; print(m.version('prefect'))"
        return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()

    newer, older = version(sys.executable), version(str(vllm_python()))
    assert older != newer, "both venvs hold one Prefect: nothing to compare"
    cache = tmp_path / "cache"
    newest = _head_revision()
    # the newer Prefect's database where its home is, and where the one home of every version was
    home = _migrated(cache / "fp8rl" / "prefect" / newer, newest)
    _migrated(cache / "fp8rl" / "prefect", newest)
    env = {k: v for k, v in without_server(os.environ).items() if k != "PREFECT_HOME"}
    env.update(XDG_CACHE_HOME=str(cache), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="20")

    # a home the user gives both: the older refuses at once, in one line, before the run directory exists
    run = tmp_path / "runs" / "r"
    t0 = time.monotonic()
    r = subprocess.run(
        [str(vllm_python()), "-m", "flows.cli", "run", "tiny-cpu", "--run-dir", str(run)],
        cwd=ROOT,
        env={**env, "PREFECT_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, (r.returncode, err[-3000:])
    assert f"{home / 'prefect.db'} was migrated by another, newer Prefect (schema revision {newest}" in err, err
    assert f"unknown to the installed Prefect {older}" in err and "unset PREFECT_HOME" in err, err
    assert not run.exists() and time.monotonic() - t0 < 120

    # the default homes: the older Prefect's is its own, and its check passes beside the newer's database
    check = (
        "import os; from flows.orchestration.preflight import check_temporary_server; "
        "check_temporary_server(); print(os.environ['PREFECT_HOME'])"
    )
    r = subprocess.run([str(vllm_python()), "-c", check], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == str(cache / "fp8rl" / "prefect" / older), r.stderr[-2000:]


# ------------------------------------------------------------------------------ real runs, real servers


class Command(CliProcess):
    """One ``fp8rl`` command in a session of its own, its output in files, its processes tagged."""

    def __init__(self, args: list[str], *, temporary_server: bool, env: dict[str, str] | None = None) -> None:
        self.tag = uuid.uuid4().hex
        base = without_server(os.environ) if temporary_server else dict(os.environ)
        base = {k: v for k, v in base.items() if not k.startswith("FP8RL_FAULT")}
        super().__init__(args, {**base, TAG: self.tag, "OMP_NUM_THREADS": "1", **(env or {})})

    def left(self, grace_s: float = 3.0) -> list[int]:
        """Processes of the command alive ``grace_s`` after it ended (the server's watcher polls every 0.5 s)."""
        deadline = time.monotonic() + grace_s
        while (alive := tagged_pids(TAG, self.tag)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return alive


def _one_line(cmd: Command, code: int, *needles: str, within_s: float = 600) -> str:
    got, err = cmd.finish(timeout=within_s), cmd.stderr()
    assert got == code and len(err.strip().splitlines()) == 1 and err.startswith("error: "), (got, err[-3000:])
    for n in needles:
        assert n in err, (n, err)
    assert cmd.left() == []
    return err.strip()


@pytest.mark.slow
def test_a_server_that_never_answers_ends_the_command_in_one_line_leaving_nothing(tmp_path):
    run = tmp_path / "run"
    cmd = Command(
        ["run", "tiny-cpu", "--run-dir", str(run), *micro_args("steps=1")],
        temporary_server=True,
        env={"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "1"},  # shorter than any start-up
    )
    line = _one_line(
        cmd,
        2,
        "Prefect's temporary server did not answer within 1 s",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS",
        RESUMABLE.format(run),
    )
    assert Path(line.split("its log: ")[1].split(";")[0]).is_file()


def _with_in_environ(needle: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and needle.encode() in (d / "environ").read_bytes():
                out.append(int(d.name))
        except OSError:
            continue
    return out


def test_a_server_that_exits_at_start_up_says_why_at_once_and_leaves_nothing(tmp_path, own_env):
    """Prefect's own start waits out its whole limit (and restarts a server that exits with code 3
    forever); the start here ends when the server does, with the cause from its log."""
    from flows.orchestration import server as prefect_server
    from flows.orchestration.preflight import ServerUnavailable

    url = f"sqlite+aiosqlite:///{tmp_path}/missing/prefect.db"  # a folder that does not exist
    os.environ.update(PREFECT_SERVER_DATABASE_CONNECTION_URL=url, PREFECT_HOME=str(tmp_path / "home"))
    base, own = prefect_server._server_class()
    earlier = base._instances.pop(None, None)  # a server an earlier test of this process started
    try:
        server = own()
        with pytest.raises(ServerUnavailable) as failed:
            server.start(timeout=60)
    finally:
        base._instances.pop(None, None)
        if earlier is not None:
            base._instances[None] = earlier
    said = str(failed.value)
    assert said.startswith("Prefect's temporary server exited at start-up (exit code 3): "), said
    assert "unable to open database file" in said and len(said.splitlines()) == 1, said
    assert Path(said.split("its log: ")[1]).parent == tmp_path / "home"
    assert server.server_process is None and not server.running
    assert _with_in_environ(url) == []


def test_two_starts_in_one_home_take_turns(tmp_path, own_env):
    """Two campaigns started together in one Prefect home started two servers that migrated the home's
    database at once, and one failed (Alembic's version row, or a column added twice). A start now waits
    while another process's server is starting in the same home, then starts."""
    import fcntl

    from flows.process.child_guard import SERVER_MARK
    from flows.process.shutdown import descendants

    home = tmp_path / "home"
    home.mkdir()
    code = "from flows.orchestration import server as p; s = p.start(); print('up', flush=True); p.stop(s)"
    env = without_server(dict(os.environ, PREFECT_HOME=str(home)))
    with open(home / "temporary-server.start.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process's server is starting in this home
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        deadline = time.monotonic() + 10  # a server's process starts within 2-3 s of the command
        while time.monotonic() < deadline and proc.poll() is None:
            servers = [p for p in descendants(proc.pid) if SERVER_MARK.encode() in _cmdline(p)]
            assert servers == [], "a second server started while another was starting in its home"
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0 and out.split() == ["up"], err[-2000:]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _server_of(cmd: Command, marker: Path, timeout: float = 600) -> int:
    """Wait until the command holds at its ``wait`` fault; its temporary server's pid."""
    from flows.process.child_guard import SERVER_MARK
    from flows.process.shutdown import descendants

    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert cmd.proc.poll() is None, f"ended ({cmd.proc.returncode}) before the fault point: {cmd.stderr()}"
        assert time.monotonic() < deadline, "the fault point was never reached"
        time.sleep(0.1)
    servers = [p for p in descendants(cmd.proc.pid) if SERVER_MARK.encode() in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(servers) == 1, servers
    return servers[0]


@pytest.mark.slow
def test_a_server_killed_mid_run_stops_it_in_one_line_and_the_resume_gives_the_uninterrupted_tables(tmp_path):
    from benchmarks.compare_runs import KEYS, compare

    run, ref, marker = tmp_path / "run", tmp_path / "reference", tmp_path / "marker"
    reference = Command(["run", "tiny-cpu", "--run-dir", str(ref), *micro_args("steps=1")], temporary_server=False)
    cmd = Command(
        ["run", "tiny-cpu", "--run-dir", str(run), *micro_args("steps=1")],
        temporary_server=True,
        env={"FP8RL_FAULT": "train@1:mb1=wait", "FP8RL_FAULT_MARKER": str(marker)},
    )
    server = _server_of(cmd, marker)
    t0 = time.monotonic()
    os.kill(server, signal.SIGKILL)
    with open(marker, "a") as f:
        f.write("go\n")  # the run goes on into the dead server's hands
    line = _one_line(
        cmd,
        2,
        "Prefect's temporary server stopped during the run (killed by SIGKILL; its log: ",
        RESUMABLE.format(run),
        within_s=60,  # (it used to go on for minutes a step)
    )
    assert time.monotonic() - t0 < 10, f"{time.monotonic() - t0:.1f} s from the server's death to the end"
    assert "Traceback" not in line
    assert reference.finish() == 0, reference.stderr()[-3000:]
    resumed = Command(["resume", str(run)], temporary_server=False)
    assert resumed.finish() == 0, resumed.stderr()[-3000:]
    for table in KEYS:
        assert compare(ref, run, table) == [], f"{table} differs from the uninterrupted run"


@pytest.mark.timeout(60)
def test_an_engine_process_below_a_killed_command_is_stopped_by_its_watcher(tmp_path):
    """vLLM's engine core (``vllm_process: separate``) is a process of its own, grandchild or deeper of the
    ``fp8rl`` command, titled ``VLLM::EngineCore``; it does not notice its client's death. A command killed
    with SIGKILL cannot stop it: the command's watcher (:mod:`flows.process.child_guard`) does, as it does the
    temporary Prefect server. Here the engine is a process under that title two levels below a command
    that only starts the watcher."""
    from flows.process.child_guard import ENGINE_MARK

    pid_file = tmp_path / "engine.pid"
    code = (
        "import subprocess, sys, time\n"
        "from flows.process import child_guard\n"
        "child_guard.start()\n"
        # a helper that starts the engine and waits: the engine is the command's grandchild
        f"subprocess.Popen(['bash', '-c', 'exec -a VLLM::EngineCore sleep 300 & echo $! > {pid_file}; wait'])\n"
        "time.sleep(300)\n"
    )
    cmd = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        deadline = time.monotonic() + 20
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert time.monotonic() < deadline and cmd.poll() is None, "the stand-in engine never started"
            time.sleep(0.1)
        engine = int(pid_file.read_text())
        assert ENGINE_MARK.encode() in _cmdline(engine)
        time.sleep(1.5)  # the watcher notes what is below the command twice a second
        os.kill(cmd.pid, signal.SIGKILL)
        cmd.wait(timeout=10)
        deadline = time.monotonic() + 10
        while ENGINE_MARK.encode() in _cmdline(engine):
            assert time.monotonic() < deadline, "the engine outlived the killed command by 10 s"
            time.sleep(0.1)
    finally:
        if cmd.poll() is None:
            cmd.kill()
