"""Disaggregated rollout: an engine that talks to a running ``vllm serve`` over HTTP.

**Status: generation, seeds, stop tokens and retries run against a real ``vllm
serve`` (vLLM's CPU build, tests/stages/engines/test_vllm_http_real.py) and a loopback server that
speaks the same API (tests/stages/engines/test_http_engine.py); the NCCL weight sync runs against
the real server too, with vLLM's own transfer engines on both sides and a gloo
stand-in for its NCCL communicator (tests/vllm_site/fp8rl_nccl_standin.py). Nothing
here has run on a GPU.**

* **Generation** (vLLM 0.33's OpenAI-compatible ``POST /v1/completions``,
  ``entrypoints/openai/completion/protocol.py``): one request per prompt with
  ``prompt`` = the token ids, ``n``, ``temperature``, ``top_p``, ``max_tokens``,
  ``seed`` = :func:`~stages.engines.vllm_sampling.request_seed` (so the samples
  equal the in-process engine's), ``logprobs=0`` (the sampled token's log-prob
  only), ``return_token_ids=true`` and ``skip_special_tokens=false``. Each
  choice carries ``index``, ``token_ids``, ``logprobs.token_logprobs`` and
  ``finish_reason``. Start the server with ``--logprobs-mode
  processed_logprobs`` so the log-probs are those of the distribution sampled
  from (see :mod:`stages.engines.base`); the default ``raw_logprobs`` ignores
  temperature and top-p. Requests run concurrently (``max_concurrency``).
* **Failures.** A timeout, an HTTP 5xx, a refused or dropped connection is
  retried ``config.server_retries`` times with exponential backoff; then
  :class:`ServerError` says which URL failed how. Nothing is written before
  ``generate`` returns, so the rollout stage fails cleanly and the step is
  re-run on resume with the same seeds. HTTP 4xx is not retried (a bad request
  stays bad).
* **Weights** go the way vLLM 0.33 documents for servers
  (``entrypoints/rl/online/api_router.py``, ``distributed/weight_transfer/
  clients.py``): the control plane is HTTP — ``/pause?mode=wait``,
  ``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``, ``/resume`` (the server needs
  ``--weight-transfer-config '{"backend": "nccl"}'`` and ``VLLM_SERVER_DEV_MODE=1``,
  without which vLLM serves no RL route) — and the data plane is an NCCL
  broadcast from trainer rank 0 to the server's workers, driven by vLLM's own
  ``NCCLTrainerWeightTransferEngine`` (so vLLM must be importable on the trainer
  for ``load_weights``) through :class:`~stages.engines.nccl_sync.NcclSender`: bf16,
  one parameter gathered at a time, rendezvoused at
  ``rollout.weight_sync_rendezvous``. Every trainer rank calls ``load_weights``;
  rank 0 alone pauses and resumes the server and sends, the others gather with it
  and then wait for it. :class:`HTTPWeightSyncClient` is that control plane, the
  four-method protocol vLLM's trainer engines call.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import logging
import socket
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

from torch import nn

from stages.engines import weight_transfer as wt
from stages.engines.base import (
    EngineInputs,
    FinishReason,
    RolloutBatch,
    RolloutEngine,
    RolloutSample,
    SamplingRequest,
    register_engine,
    truncate_at_eos,
    validate_generate_args,
)
from stages.engines.nccl_sync import NcclRendezvous, NcclSender, as_rendezvous
from stages.engines.vllm_sampling import request_seed
from stages.engines.vllm_sync import SentNames
from stages.engines.vllm_worker_extension import REPACK_TIED_HEAD, WORKER_EXTENSION

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """The vLLM server did not answer usefully after every retry; ``status`` is the HTTP status of the last
    answer (``None`` when the last try got none: a timeout, a refused or dropped connection)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


_RETRYABLE = (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError)


class HTTPClient:
    """JSON POST with retries (timeouts, 5xx, refused / dropped connections)."""

    def __init__(self, base_url: str, *, timeout: float, retries: int, backoff: float = 0.5) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"server_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout, self.retries, self.backoff = timeout, retries, backoff

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        url = f"{self.base_url}/{path.lstrip('/')}"
        data = json.dumps(body if body is not None else {}).encode()
        last, status = "", None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(
                url, data=data, headers={"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
                return json.loads(raw) if raw else None
            except urllib.error.HTTPError as err:
                detail = err.read()[:200].decode(errors="replace")
                if err.code < 500:
                    raise ServerError(f"POST {url}: HTTP {err.code} {detail}", err.code) from None
                last, status = f"HTTP {err.code} {detail}", err.code
            except _RETRYABLE as err:
                reason = getattr(err, "reason", err)
                last, status = f"{type(reason).__name__}: {reason}", None
            except json.JSONDecodeError as err:
                last, status = f"unreadable JSON answer ({err})", None
        raise ServerError(
            f"POST {url} failed {self.retries + 1} times (timeout {self.timeout}s); last error: {last}", status
        )


class HTTPWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over the server's RL routes (mirrors ``HTTPVLLMWeightSyncClient``)."""

    def __init__(self, client: HTTPClient) -> None:
        self.client = client

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.client.post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.client.post("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.client.post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.post(
            "finish_weight_update", {"weight_version": weight_version} if weight_version is not None else None
        )

    def pause(self) -> None:
        self.client.post("pause?mode=wait")

    def resume(self) -> None:
        self.client.post("resume")

    def repack_tied_head(self) -> bool:
        """``/collective_rpc`` of our worker extension's ``fp8rl_repack_tied_head`` (vLLM's dev-mode route),
        with the client's retries. False when the server answers that it cannot: no such route (a server not
        in dev mode, HTTP 4xx), or an error on every try (its workers have no such method: a server started
        without ``--worker-extension-cls``). A server that does not answer at all raises
        :class:`ServerError`, as any other request does: the stage fails and is retried."""
        try:
            self.client.post("collective_rpc", {"method": REPACK_TIED_HEAD})
        except ServerError as err:
            if err.status is None:
                raise
            return False
        return True


def completion_request(
    prompt: list[int],
    *,
    model: str,
    n: int,
    temperature: float,
    top_p: float,
    max_tokens: int,
    seed: int,
    stop_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """The ``/v1/completions`` body for one prompt (token ids in, token ids and log-probs out); the
    server stops at ``stop_token_ids`` (vLLM's extra sampling parameter) instead of generating past them."""
    return {
        "stop_token_ids": sorted(int(t) for t in stop_token_ids or ()),
        "model": model,
        "prompt": [int(t) for t in prompt],
        "n": n,
        "temperature": temperature,
        "top_p": top_p,
        "max_tokens": max_tokens,
        "seed": seed,
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }


def samples_from_completion(
    response: dict[str, Any], *, p: int, n: int, eos_ids: frozenset[int]
) -> list[RolloutSample]:
    """The ``n`` samples of prompt ``p`` from a ``/v1/completions`` answer."""
    choices = sorted(response.get("choices") or [], key=lambda c: c["index"])
    if [c["index"] for c in choices] != list(range(n)):
        raise ServerError(
            f"prompt {p}: the server returned choices {[c['index'] for c in choices]}, expected 0..{n - 1}"
        )
    out = []
    for i, choice in enumerate(choices):
        ids = choice.get("token_ids")
        lp = (choice.get("logprobs") or {}).get("token_logprobs")
        if ids is None or lp is None:
            raise ServerError(
                f"prompt {p} sample {i}: no token_ids / token_logprobs (needs return_token_ids and logprobs=0)"
            )
        if len(ids) != len(lp) or any(v is None for v in lp):
            raise ServerError(f"prompt {p} sample {i}: {len(ids)} token ids but log-probs {lp[:4]}...")
        kept, reason = truncate_at_eos([int(t) for t in ids], eos_ids)
        if reason == "length":
            if choice.get("finish_reason") not in ("stop", "length"):
                raise ServerError(f"prompt {p} sample {i} finished with {choice.get('finish_reason')!r}")
            reason = choice["finish_reason"]
        reason_: FinishReason = reason  # type: ignore[assignment]
        out.append(RolloutSample(p, i, kept, [float(v) for v in lp[: len(kept)]], reason_))
    return out


@register_engine("vllm_http")
class VLLMHTTPEngine(RolloutEngine):
    """Rollouts from a running ``vllm serve`` (see the module docstring).

    Args:
        model, tokenizer, precision, config: as for every engine (``config.server_url``,
            ``server_timeout_s``, ``server_retries``).
        served_model: the ``model`` field of requests (the server's ``--served-model-name``).
        max_concurrency: requests in flight at once.
        nccl_master: where the server's workers reach the trainer for ``load_weights``, and this trainer
            rank (:class:`~stages.engines.nccl_sync.NcclRendezvous`; ``(address, port)``: one trainer rank
            beside ``tensor_parallel_size`` workers).
        backoff: first retry delay in seconds (doubles per retry).
    """

    def __init__(
        self,
        *,
        served_model: str = "policy",
        max_concurrency: int = 16,
        nccl_master: NcclRendezvous | tuple[str, int] | None = None,
        backoff: float = 0.5,
        **inputs: Unpack[EngineInputs],
    ) -> None:
        model, tokenizer, _, config = self._take_inputs(inputs)
        if not config.server_url:
            raise ValueError("rollout.engine=vllm_http needs rollout.server_url (the `vllm serve` base URL)")
        self.served_model = served_model
        self.max_concurrency = max_concurrency
        self.nccl_master = as_rendezvous(nccl_master, config)
        self.sent_names = SentNames()
        self.http = HTTPClient(
            config.server_url, timeout=config.server_timeout_s, retries=config.server_retries, backoff=backoff
        )
        self.weights = HTTPWeightSyncClient(self.http)
        gen_cfg = getattr(model, "generation_config", None)
        eos = {getattr(tokenizer, "eos_token_id", None)}
        gen_eos = getattr(gen_cfg, "eos_token_id", None)
        eos.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
        self.eos_ids = frozenset(int(e) for e in eos if e is not None)
        self._sender: Any | None = None
        self._repacks: bool | None = None  # does the server have our worker extension (None: not asked yet)
        self._closed = False
        self.computes_apart = True  # the server generates

    def generate(self, prompt_ids: list[list[int]], request: SamplingRequest) -> RolloutBatch:
        if self._closed:
            raise RuntimeError("this VLLMHTTPEngine was closed")
        if request.top_k:
            raise ValueError("the vllm_http engine does not request top-k log-probs (score centering needs them): "
                             "use rollout.engine transformers or vllm")
        validate_generate_args(prompt_ids, request)
        n = request.n
        start = time.perf_counter()

        def one(p: int) -> list[RolloutSample]:
            body = completion_request(
                prompt_ids[p],
                model=self.served_model,
                n=n,
                temperature=request.temperature,
                top_p=request.top_p,
                max_tokens=request.max_new_tokens,
                seed=request_seed(request.seed, request.seeds, p, n),
                stop_token_ids=sorted(self.eos_ids),
            )
            return samples_from_completion(self.http.post("v1/completions", body), p=p, n=n, eos_ids=self.eos_ids)

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(prompt_ids))) as pool:
            groups = list(pool.map(one, range(len(prompt_ids))))
        return self.batch([s for g in groups for s in g], len(prompt_ids), n, start)

    def load_weights(self, train_model: nn.Module) -> None:
        """Every trainer rank calls it: rank 0 pauses the server, sends (the other ranks gather with it),
        resumes it; then all ranks wait for rank 0 (:meth:`~stages.engines.nccl_sync.NcclSender.barrier`)."""
        if self.nccl_master is None:
            raise ValueError(
                "vllm_http load_weights needs nccl_master=(address, port) reachable from the server's workers"
            )
        if self._sender is None:
            self._sender = NcclSender(self.nccl_master, self.weights)
        sender = self._sender
        if sender.is_sender:
            self.weights.pause()
        try:
            sender.send(train_model, self.sent_names)
            if sender.is_sender and wt.is_tied(train_model) and self._repacks is not False:
                self._repack_tied_head()
        finally:
            if sender.is_sender:
                self.weights.resume()
        sender.barrier()

    def _repack_tied_head(self) -> None:
        """vLLM's CPU build keeps a private copy of a tied head that a weight update leaves stale
        (:func:`~stages.engines.vllm_worker_extension.repack_tied_head`); a GPU needs nothing. A server
        without our worker extension is told once, in the log, and not asked again."""
        self._repacks = self.weights.repack_tied_head()
        if not self._repacks:
            log.warning("the server at %s has no fp8rl worker extension: on vLLM's CPU build its tied lm_head "
                        "keeps the weights it started with (start vllm serve with --worker-extension-cls %s; a "
                        "GPU server needs nothing)", self.config.server_url, WORKER_EXTENSION)

    def close(self) -> None:
        self._closed = True
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()
