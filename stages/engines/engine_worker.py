"""The transformers engine in a process of its own: the rollout side of an overlapped CPU campaign.

With ``rollout.max_staleness`` k ≥ 1 step t + k's rollout runs while step t trains
(``flows/campaign/flow.py``). On a CPU both are compute: in one process they would share
one interpreter and one set of cores. :class:`WorkerEngine` keeps the engine (a
:class:`~stages.engines.hf_engine.TransformersEngine`, built in the trainer's process
exactly as without a worker) in a child process and answers the engine interface by
messages over a local socket:

* **Weights** go over as the trainer's full fp32 state at each push (``sync_policy``),
  copied when sent, so the trainer may update its own weights at once; the worker
  loads them with the in-process engine's own ``sync_rollout_weights``: the same
  inference copy, bit for bit. It also holds a copy of the trainer's policy (in the
  training precision), loaded with the same state: :meth:`WorkerEngine.train_logprobs`
  gives the trainer's log-probs of the rows it sampled, at the sampling weights.
* **Generation** is the engine's own ``generate`` in the worker. The worker runs
  under the run's CPU GEMM mode (``precision.cpu_bf16_gemm``) and on its own thread
  count, so its samples equal those of the in-process engine on as many threads.
* **Processes.** The worker ends with its parent (``PR_SET_PDEATHSIG``), ignores the
  terminal's SIGINT (the run ends it, :mod:`flows.process.shutdown`), and is ended by
  :meth:`close`. An error in the worker is raised in the caller as a
  :class:`WorkerError` with the worker's traceback; a worker that died is one line.

One caller at a time: the stages call the engine from one thread (the rollout side's,
or the step's own), never both at once.
"""

from __future__ import annotations

import copy
import os
import pickle
import signal
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

from stages.engines.base import RolloutBatch, RolloutEngine, SamplingRequest

__all__ = ["WorkerEngine", "WorkerError"]

START_TIMEOUT_S = 300.0


class WorkerError(RuntimeError):
    """The engine worker failed a request, or ended."""


class WorkerEngine(RolloutEngine):
    """``engine`` (built in this process) moved into a worker process; see the module docstring."""

    holds_trainer_copy = True

    def __init__(self, engine: RolloutEngine, *, gemm: str, threads: int = 1, trainer: torch.nn.Module) -> None:
        self.name = engine.name
        self.policy_version = engine.policy_version
        self._lock = threading.Lock()
        key = os.urandom(16)
        with Listener(family="AF_UNIX", authkey=key) as listener:
            cmd = [sys.executable, "-m", "stages.engines.engine_worker", listener.address]
            env = dict(os.environ, FP8RL_ENGINE_WORKER_KEY=key.hex())
            self._proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
            self._conn: Connection | None = _accept(listener, self._proc)
        self._call("start", _without_local_hooks(engine), _without_local_hooks(trainer), gemm, threads)

    # the engine interface
    def generate(self, prompt_ids: list[list[int]], request: SamplingRequest) -> RolloutBatch:
        return self._call("generate", prompt_ids, request)

    def train_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]], **kw: Any) -> list:
        """:func:`stages.trainer.forward.response_logprobs` on the worker's copy of the trainer's policy, at the
        weights of the last push (the version that sampled), while the trainer's own weights move on."""
        return self._call("train_logprobs", prompt_ids, response_ids, kw)

    def load_weights(self, train_model: torch.nn.Module) -> None:
        from stages.engines.hf_engine import full_view

        state = {name: t.detach().cpu() for name, t in full_view(train_model).state_dict().items()}
        self._call("weights", state)  # pickled, so copied, before this returns

    def close(self) -> None:
        if self._conn is None:
            return
        try:
            self._call("close")
        except WorkerError:
            pass
        finally:
            self._conn.close()
            self._conn = None
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def _call(self, what: str, *args: Any) -> Any:
        with self._lock:
            if self._conn is None:
                raise WorkerError("the engine worker was closed")
            try:
                _send(self._conn, (what, args))
                ok, value = _recv(self._conn)
            except (EOFError, OSError):
                code = self._proc.poll()
                raise WorkerError(f"the engine worker ended (exit code {code}) during {what}") from None
        if not ok:
            raise WorkerError(f"the engine worker failed {what}: {value}")
        return value


def _without_local_hooks(obj: Any) -> Any:
    """``obj`` (an engine, or the trainer's policy) with the module hooks that cannot leave this process
    removed from its model: training hooks (activation checkpointing's input hook, a closure), which do
    nothing in the worker's no-grad forwards."""
    if isinstance(obj, torch.nn.Module):
        obj = model = copy.deepcopy(obj)  # the trainer keeps its own hooks
    else:
        model = getattr(obj, "model", None)  # the engine's own copy, which the worker replaces
    if model is None:
        return obj
    for module in model.modules():
        for hooks in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks):
            for key, hook in list(hooks.items()):
                try:
                    pickle.dumps(hook)
                except (AttributeError, TypeError, pickle.PicklingError):
                    del hooks[key]
    return obj


def _send(conn: Connection, obj: Any) -> None:
    """By value (plain pickle): torch's multiprocessing pickler would share tensors by file descriptor,
    which needs a multiprocessing child; and a copy is what a weight push must be."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _accept(listener: Listener, proc: subprocess.Popen) -> Connection:
    """The worker's connection; a worker that exits before connecting is one line, not a hang."""
    done: list = []

    def accept() -> None:
        try:
            done.append(listener.accept())
        except OSError as err:  # the listener was closed: the worker never came
            done.append(err)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    t.join(START_TIMEOUT_S)
    if not done or isinstance(done[0], Exception):
        proc.kill()
        raise WorkerError(f"the engine worker did not start (exit code {proc.poll()})")
    return done[0]


# ----------------------------------------------------------------------------------------------- the worker


def _serve(conn: Connection) -> None:
    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
    from fp8rl_core.precision.rollout import sync_rollout_weights
    from stages.engines.hf_engine import _FullStateView
    from stages.trainer.forward import response_logprobs

    engine = trainer = None
    gemm_mode = None
    try:
        while True:
            try:
                what, args = _recv(conn)
            except EOFError:  # the trainer's end closed the socket
                return
            try:
                if what == "start":
                    engine, trainer, gemm, threads = args
                    torch.set_num_threads(threads)
                    gemm_mode = cpu_bf16_gemm(gemm, torch.device("cpu"))
                    gemm_mode.__enter__()  # for the worker's life, as the campaign loop holds it for its own
                    value = None
                elif what == "weights":
                    sync_rollout_weights(engine._require_model(), _FullStateView(args[0]))
                    trainer.load_state_dict(args[0])
                    value = None
                elif what == "train_logprobs":
                    prompt_ids, response_ids, kw = args
                    value = response_logprobs(trainer, prompt_ids, response_ids, **kw)
                elif what == "generate":
                    prompt_ids, request = args
                    value = engine.generate(prompt_ids, request)
                elif what == "close":
                    _send(conn, (True, None))
                    return
                else:
                    raise ValueError(f"unknown request {what!r}")
            except Exception as err:  # the caller raises it, with the worker's traceback
                _send(conn, (False, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
                continue
            _send(conn, (True, value))
    finally:
        if gemm_mode is not None:
            gemm_mode.__exit__(None, None, None)


def main(address: str) -> None:
    import ctypes

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the run's to handle
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG: end with the trainer
    key = bytes.fromhex(os.environ.pop("FP8RL_ENGINE_WORKER_KEY"))
    with Client(address, family="AF_UNIX", authkey=key) as conn:
        _serve(conn)


if __name__ == "__main__":  # the trainer's pinned CPU numerics reach it in the environment
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # no teardown: see flows.process.shutdown.end_process
