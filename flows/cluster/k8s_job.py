"""A Kubernetes indexed Job for a campaign, rendered for ``fp8rl submit --backend k8s --dry-run`` only.

One pod per node (``completionMode: Indexed``, ``parallelism = completions = nodes``), each
running one ``torchrun`` agent with ``gpus_per_node`` ranks; the c10d rendezvous host is pod 0,
reached through a headless Service (``<job>-0.<job>``: the Job's ``subdomain``), or
``cluster.rendezvous_host``. ``backoffLimit: 0`` and ``podFailurePolicy`` leave restarts to
whoever resubmits with ``--resume``; the shared path is a ReadWriteMany volume claim named
``fp8rl-shared`` mounted at ``cluster.shared_path``.

Nothing submits or supervises this Job: the supervisor speaks Slurm only. The manifest is
checked by the tests as text; apply it with ``kubectl apply -f`` and resubmit by hand.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from flows.cluster.slurm_script import RESULT_FILE, job_name
from fp8rl_core.config.campaign import CampaignConfig


def render(cfg: CampaignConfig, run_dir: Path, *, python: str, workdir: Path) -> str:
    c = cfg.cluster
    name = job_name(run_dir).lower().replace("_", "-").replace(".", "-")[:52]
    host = c.rendezvous_host or f"{name}-0.{name}"
    shared = c.shared_path or str(run_dir.parent)
    command = " ".join(
        [shlex.quote(python), "-m flows.process.torchrun", f"--nnodes={c.nodes}", f"--nproc-per-node={c.gpus_per_node}",
         "--node-rank=$JOB_COMPLETION_INDEX", "--max-restarts=0", "--rdzv-backend=c10d",
         f"--rdzv-endpoint={host}:{c.rendezvous_port}", f"--rdzv-id={name}", "-m flows.spmd",
         shlex.quote(str(run_dir)), f"--result={shlex.quote(str(run_dir / RESULT_FILE))}"]
    )  # fmt: skip
    container = {
        "name": "ranks",
        "image": "REPLACE-WITH-YOUR-IMAGE",
        "workingDir": str(workdir),
        "command": ["bash", "-c", command],
        "resources": {"limits": {"nvidia.com/gpu": c.gpus_per_node}} if c.request_gpus else {},
        "volumeMounts": [{"name": "shared", "mountPath": shared}],
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "completionMode": "Indexed",
            "completions": c.nodes,
            "parallelism": c.nodes,
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "subdomain": name,
                    "restartPolicy": "Never",
                    "containers": [container],
                    "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": "fp8rl-shared"}}],
                }
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {"clusterIP": "None", "selector": {"job-name": name}, "ports": [{"port": c.rendezvous_port}]},
    }
    header = "# rendered by `fp8rl submit --backend k8s --dry-run`; not submitted or supervised by fp8rl\n"
    return header + "---\n".join(json.dumps(doc, indent=2) + "\n" for doc in (service, job))
