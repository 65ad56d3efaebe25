"""``fp8rl submit`` before anything runs: the rendered job of the GPU presets, and the inputs refused in one line.

The sbatch scripts of the 8B and 32B presets are compared with committed references
(``tests/golden/submit-<preset>.sbatch``), the machine's paths replaced by placeholders; a
change of the job a user would submit shows here as a diff. Refusals: one line on stderr,
exit 2, nothing written (the run directory does not exist afterwards). The refusals that
need a scheduler to ask (more nodes than the partition has) are in test_cluster_campaign.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = Path(__file__).resolve().parents[2] / "golden"


@pytest.fixture
def submit(capsys):
    """``fp8rl submit ARGS`` in this process (the command's own entry point): exit code, stdout, stderr."""
    from flows import cli

    def run(*args: str) -> SimpleNamespace:
        saved = dict(os.environ)  # (main pins the CPU numerics' variables where torch is not imported yet)
        try:
            with pytest.raises(SystemExit) as end:
                cli.main(["submit", *args])
        finally:
            os.environ.clear()
            os.environ.update(saved)
        out = capsys.readouterr()
        return SimpleNamespace(returncode=end.value.code, stdout=out.out, stderr=out.err)

    return run


def _placeholders(text: str, run_dir: Path) -> str:
    return text.replace(str(run_dir), "RUN_DIR").replace(sys.executable, "PYTHON").replace(str(ROOT), "PROJECT")


@pytest.mark.parametrize(
    "preset, nodes, gpus",
    [("qwen3-8b-grpo-deepscaler", 1, 8), ("qwen2.5-32b-grpo", 4, 8)],
)
def test_dry_run_renders_the_presets_job_as_the_reference(submit, preset, nodes, gpus, tmp_path):
    run_dir = tmp_path / "shared" / "run-1"
    r = submit(preset, "--dry-run", "--run-dir", str(run_dir), "--set", f"cluster.shared_path={tmp_path / 'shared'}")
    assert r.returncode == 0, r.stderr[-2000:]
    script, _, plan = r.stdout.partition("# memory plan:")
    assert f"#SBATCH --nodes={nodes}\n" in script and f"--nproc-per-node={gpus} " in script
    assert f"{nodes} node(s) x {gpus} GPU(s) = {nodes * gpus} GPU(s)" in plan and "total per GPU" in plan
    reference = (GOLDEN / f"submit-{preset}.sbatch").read_text()
    assert _placeholders(script, run_dir).rstrip("\n") == reference.rstrip("\n")
    assert not run_dir.exists() and not (tmp_path / "shared").exists()  # a dry run writes nothing


def test_the_flags_override_the_presets_counts_and_the_k8s_job_renders(submit, tmp_path):
    r = submit(
        "qwen2.5-32b-grpo", "--dry-run", "--nodes", "2", "--gpus-per-node", "4", "--run-dir", str(tmp_path / "r")
    )
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=4\n" in r.stdout
    assert "2 node(s) x 4 GPU(s) = 8 GPU(s)" in r.stdout
    r = submit("qwen2.5-32b-grpo", "--backend", "k8s", "--dry-run", "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    assert '"completionMode": "Indexed"' in r.stdout and '"completions": 4' in r.stdout
    assert '"nvidia.com/gpu": 8' in r.stdout and "--node-rank=$JOB_COMPLETION_INDEX" in r.stdout


def test_a_set_rendezvous_host_replaces_the_lookup(submit, tmp_path):
    r = submit("tiny-cpu", "--dry-run", "--run-dir", str(tmp_path / "r"),
                "--set", "cluster.rendezvous_host=10.0.0.7", "--set", "cluster.rendezvous_port=29611")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "RDZV_HOST=10.0.0.7" in r.stdout and "RDZV_PORT=29611" in r.stdout and "scontrol" not in r.stdout


def test_a_run_directory_is_resubmitted_with_its_own_config_to_resume(submit, tmp_path):
    from flows.campaign.configuration import dump_config, load_config
    from storage.run.layout import create_run

    create_run(tmp_path, "r1", config=dump_config(load_config("tiny-cpu", ["cluster.nodes=2"])))
    r = submit(str(tmp_path / "r1"), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --nodes=2\n" in r.stdout and f"RUN_DIR={tmp_path / 'r1'}\n" in r.stdout
    assert r.stdout.split("# memory plan")[0].rstrip().endswith("--resume")
    _refused(submit(str(tmp_path / "r1"), "--nodes", "3", "--dry-run"), "its own config")


def test_the_heartbeat_must_outlast_every_stage_limit():
    from flows.campaign.configuration import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"heartbeat_s=3000 must exceed the longest stage limit, timeouts.rollout_s"):
        load_config("tiny-cpu", ["timeouts.heartbeat_s=3000"])
    with pytest.raises(ConfigError, match=r"retries.job"):
        load_config("tiny-cpu", ["retries.job=-1"])
    cfg = load_config("qwen2.5-32b-grpo")
    assert cfg.timeouts.heartbeat_s > max(cfg.timeouts.stage_s(s) for s in ("rollout", "evaluate", "train"))


def _refused(r: SimpleNamespace, *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_bad_input_is_one_line_and_writes_nothing(submit, tmp_path, monkeypatch):
    shared, outside = tmp_path / "shared", tmp_path / "elsewhere" / "r"
    _refused(submit("tiny-cpu", "--nodes", "0", "--dry-run"), "--nodes", "greater than or equal to 1")
    _refused(
        submit("tiny-cpu", "--run-dir", str(outside), "--set", f"cluster.shared_path={shared}"),
        "outside cluster.shared_path",
    )
    _refused(submit("tiny-cpu", "--backend", "k8s", "--run-dir", str(shared / "r")), "--dry-run only")
    _refused(submit("tiny-cpu", "--backend", "nomad", "--dry-run"), "local, slurm, k8s")
    _refused(submit("tiny-cpu", "--backend", "local", "--nodes", "2", "--run-dir", str(shared / "r")), "needs slurm")
    _refused(submit("tiny-cpu", "--set", "cluster.time=two days", "--dry-run"), "cluster.time")
    _refused(submit("qwen2.5-32b-grpo", "--gpus-per-node", "6", "--dry-run"), "tensor_parallel_size=4", "span two")
    _refused(submit("tiny-cpu", "--nodes", "2", "--set", "rollout.data_parallel=shared_tp", "--dry-run"), "shared_tp")
    # a real submission where Slurm is not installed: PATH without sbatch
    bare = tmp_path / "bin"
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    r = submit("tiny-cpu", "--run-dir", str(shared / "r"), "--set", f"cluster.shared_path={shared}")
    _refused(r, "sbatch", "not found")
    assert not outside.exists() and not shared.exists()


def test_job_attempts_are_recorded_in_the_ledger_and_run_json_and_read_with_sql(tmp_path):
    import json

    from flows.cluster.attempts import JobAttempt, record
    from storage.queries.catalog import connect, query
    from storage.run.layout import create_run

    create_run(tmp_path, "r1", config={"name": "r1"})
    run_dir = tmp_path / "r1"
    record(run_dir, JobAttempt(1, "slurm", "41", "n[1-2]", "CANCELLED", "heartbeat missed: ...", None, "t0", "t1"))
    record(run_dir, JobAttempt(2, "slurm", "42", "n[1-2]", "COMPLETED", "completed", 2, "t2", "t3"))
    rows = query(connect(tmp_path), "SELECT run_id, attempt, job_id, state, resumed_from_step FROM job_attempts")
    assert rows.to_pylist() == [
        {"run_id": "r1", "attempt": 1, "job_id": "41", "state": "CANCELLED", "resumed_from_step": None},
        {"run_id": "r1", "attempt": 2, "job_id": "42", "state": "COMPLETED", "resumed_from_step": 2},
    ]
    assert [a["job_id"] for a in json.loads((run_dir / "run.json").read_text())["job_attempts"]] == ["41", "42"]
    assert query(connect(tmp_path), "SELECT count(*) AS n FROM ledger").to_pylist() == [{"n": 0}]  # no stage rows
    from flows.report.page import build_report

    page = build_report([tmp_path], tmp_path / "report").index.read_text()
    assert "<h2>Cluster jobs</h2>" in page and "heartbeat missed" in page


def test_a_run_locked_by_a_cluster_job_names_the_job(tmp_path):
    import subprocess

    from storage.errors import RunLocked
    from storage.run import lock

    hold = "import sys; from storage.run import lock; lock.acquire(sys.argv[1]); print('held', flush=True); input()"
    env = dict(os.environ, SLURM_JOB_ID="4711", RANK="0")
    proc = subprocess.Popen(
        [sys.executable, "-c", hold, str(tmp_path)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked, match=r"\(Slurm job 4711\)"):
            lock.acquire(tmp_path)
    finally:
        proc.communicate("\n", timeout=30)
