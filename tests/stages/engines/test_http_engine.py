"""The ``vllm_http`` engine against our own loopback server speaking vLLM's completions and RL routes."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fp8rl_core.config.method import PrecisionConfig
from fp8rl_core.config.model import ModelConfig
from fp8rl_core.config.pipeline import RolloutConfig
from fp8rl_core.tasks.tiny_model import build_tiny_model, build_tokenizer
from stages.engines import SamplingRequest, make_engine
from stages.engines.http_engine import HTTPClient, ServerError
from stages.engines.vllm_sampling import prompt_seed

pytestmark = pytest.mark.timeout(60)
EOS = 2


class FakeVLLMServer:
    """``/v1/completions`` sampling pseudo-random ids + awkward float log-probs from the seed; RL routes recorded.

    ``fail`` = (mode, count): the next ``count`` requests time out ("timeout"),
    answer 500 ("500"), or close the connection without answering ("drop").
    """

    def __init__(self):
        self.requests, self.responses, self.fail = [], [], (None, 0)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                outer.requests.append((self.path, body))
                mode, count = outer.fail
                if count > 0:
                    outer.fail = (mode, count - 1)
                    if mode == "timeout":
                        time.sleep(0.6)
                        return
                    if mode == "drop":
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b"engine dead")
                    return
                if self.path == "/v1/completions":
                    out = outer.complete(body)
                elif self.path == "/bad":
                    self.send_response(400)
                    self.end_headers()
                    return
                else:
                    out = {"message": "ok"}
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def complete(self, body):
        choices = []
        for i in range(body["n"]):
            rng = random.Random(body["seed"] + i)  # vLLM: child i of a seeded request uses seed + i
            ids, lps, reason = [], [], "length"
            for _ in range(body["max_tokens"]):
                ids.append(rng.randrange(3, 100) if rng.random() > 0.2 else EOS)
                lps.append(-rng.random() * 7.123456789012345)
                if ids[-1] == EOS:
                    reason = "stop"
                    break
            choices.append(
                {
                    "index": i,
                    "text": "",
                    "token_ids": ids,
                    "finish_reason": reason,
                    "logprobs": {"token_logprobs": lps, "tokens": [f"token_id:{t}" for t in ids], "top_logprobs": []},
                }
            )
        out = {"id": "cmpl", "object": "text_completion", "model": body["model"], "choices": choices[::-1]}
        self.responses.append((body["seed"], choices))
        return out

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server():
    s = FakeVLLMServer()
    yield s
    s.close()


@pytest.fixture(scope="module")
def policy():
    return build_tiny_model(ModelConfig())


def make(policy, url, **cfg):
    config = RolloutConfig(
        engine="vllm_http",
        server_url=url,
        server_timeout_s=cfg.pop("timeout", 5.0),
        server_retries=cfg.pop("retries", 2),
    )
    return make_engine(
        "vllm_http",
        model=policy,
        tokenizer=build_tokenizer(),
        precision=PrecisionConfig(rollout="fp8_per_tensor"),
        config=config,
        backoff=0.01,
    )


PROMPTS = [[1, 5, 6], [1, 7], [1, 9, 9, 9]]


def test_ids_and_logprobs_round_trip_exactly(policy, server):
    engine = make(policy, server.url)
    batch = engine.generate(PROMPTS, SamplingRequest(n=3, temperature=0.9, top_p=0.95, max_new_tokens=10, seed=4))
    assert [(s.prompt_index, s.sample_index) for s in batch.samples] == [(p, i) for p in range(3) for i in range(3)]
    sent = sorted((b for path, b in server.requests if path == "/v1/completions"), key=lambda b: b["seed"])
    by_seed = dict(server.responses)
    for p, prompt in enumerate(PROMPTS):
        body = next(b for b in sent if b["prompt"] == prompt)
        assert body == {
            "model": "policy",
            "prompt": prompt,
            "n": 3,
            "temperature": 0.9,
            "top_p": 0.95,
            "max_tokens": 10,
            "seed": prompt_seed(4, p, 3),
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stop_token_ids": sorted(engine.eos_ids),
        }
        for i, choice in enumerate(by_seed[body["seed"]]):
            s = batch.samples[p * 3 + i]
            assert s.response_ids == choice["token_ids"]
            assert s.response_logprobs == choice["logprobs"]["token_logprobs"]  # exact floats, not approx
            assert s.finish_reason == choice["finish_reason"]
    assert batch.engine == "vllm_http" and batch.generated_tokens > 0


@pytest.mark.parametrize("mode", ["timeout", "500", "drop"])
def test_failures_retry_then_fail_clearly_and_the_step_can_be_rerun(policy, server, mode):
    engine = make(policy, server.url, timeout=0.3, retries=2)
    request = SamplingRequest(n=2, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=1)
    healthy = engine.generate(PROMPTS[:1], request)
    server.requests.clear()
    server.fail = (mode, 3)  # more failures than retries
    with pytest.raises(ServerError, match=r"v1/completions failed 3 times .*last error"):
        engine.generate(PROMPTS[:1], request)
    assert len(server.requests) == 3  # one try + two retries
    server.fail = (mode, 2)  # transient: the retries absorb it
    again = engine.generate(PROMPTS[:1], request)
    assert again.samples == healthy.samples  # a re-run step gets the same samples


def test_client_errors_are_not_retried_and_urls_are_checked(server):
    client = HTTPClient(server.url, timeout=2, retries=3, backoff=0.01)
    with pytest.raises(ServerError, match="HTTP 400"):
        client.post("bad")
    assert len(server.requests) == 1
    with pytest.raises(ValueError, match="http://"):
        HTTPClient("localhost:8000", timeout=1, retries=0)
    with pytest.raises(ValueError, match="server_url"):
        make_engine(
            "vllm_http",
            model=build_tiny_model(ModelConfig()),
            tokenizer=None,
            precision=PrecisionConfig(),
            config=RolloutConfig(engine="vllm_http"),
        )


def test_the_tied_head_repack_is_not_given_up_on_one_failed_request(policy, server):
    """vLLM's CPU build needs the repack after every weight update; a transient failure must not turn it off
    for the rest of the run, and a server that does not answer fails the step instead of being read as one
    without the worker extension."""
    engine = make(policy, server.url, timeout=0.3, retries=2)
    server.fail = ("500", 1)  # one bad answer: the retry gets through
    assert engine.weights.repack_tied_head() is True
    assert [p for p, _ in server.requests] == ["/collective_rpc"] * 2
    server.fail = ("500", 3)  # an error on every try: the workers have no such method
    assert engine.weights.repack_tied_head() is False
    for mode in ("timeout", "drop"):  # no answer at all
        server.fail = (mode, 3)
        with pytest.raises(ServerError, match="collective_rpc failed 3 times"):
            engine.weights.repack_tied_head()


def test_weight_push_control_plane_uses_vllms_rl_routes(policy, server):
    engine = make(policy, server.url)
    w = engine.weights
    w.pause()
    w.init_weight_transfer_engine(
        {"master_address": "10.0.0.2", "master_port": 29500, "rank_offset": 1, "world_size": 2}
    )
    w.start_weight_update()
    w.update_weights({"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2, 2]]})
    w.finish_weight_update("step-3")
    w.resume()
    assert server.requests == [
        ("/pause?mode=wait", {}),
        (
            "/init_weight_transfer_engine",
            {"init_info": {"master_address": "10.0.0.2", "master_port": 29500, "rank_offset": 1, "world_size": 2}},
        ),
        ("/start_weight_update", {}),
        ("/update_weights", {"update_info": {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2, 2]]}}),
        ("/finish_weight_update", {"weight_version": "step-3"}),
        ("/resume", {}),
    ]
