"""vLLM's CPU tensor-parallel group names its shared memory after the torchrun job.

Under the external launcher vLLM named the segments ``/dev/shm/-tp:0-[0-1]-cpushm_<rank>``
for every job and never removed them: a second TP=2 campaign on a machine (at the same
time, or after one whose segments stayed) failed to start with ``create shm in SHMManager
failed. errno: 17``. The names now carry the job's id, and a rank removes its own segment
when its engine closes. Checked in the vLLM venv against vLLM's own naming function.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest
from real_vllm import ROOT, skip_reason, vllm_python

SNIPPET = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    from types import SimpleNamespace
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from stages.engines.vllm_options import SHM_SEGMENTS, job_unique_cpu_shm, remove_cpu_shm
    os.environ["VLLM_DIST_IDENT"] = "//"  # what vLLM's CPU worker sets from the external launcher's env://
    job_unique_cpu_shm()
    job_unique_cpu_shm()  # once per process, however many engines
    group = SimpleNamespace(unique_name="tp:0", ranks=[0, 1], rank=1)
    name = _CPUSHMDistributed.make_group_name(group)
    segment = Path("/dev/shm") / SHM_SEGMENTS[-1]
    segment.write_bytes(b"x")  # what vLLM's shm manager would have made for rank 1
    remove_cpu_shm()
    print(json.dumps({"name": name, "segments": str(segment.name), "removed": not segment.exists()}))
    """
)


@pytest.mark.vllm
@pytest.mark.timeout(180)
@pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
def test_each_torchrun_job_names_its_own_shared_memory_and_removes_it():
    names = []
    for job in ("job-a", "job-b"):
        env = dict(os.environ, PYTHONPATH=str(ROOT), TORCHELASTIC_RUN_ID=job)
        r = subprocess.run([str(vllm_python()), "-c", SNIPPET], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=150)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["name"] == f"fp8rl-{job}--tp:0-[0-1]-cpushm" and out["segments"] == f"{out['name']}_1"
        assert out["removed"]
        names.append(out["name"])
    assert names[0] != names[1]
