"""``weight_sync: nccl`` with vLLM's real transfer engines on a CPU, run in ``.venv-vllm`` by
tests/stages/engines/test_nccl_sync.py.

``python tests/nccl_sync_checks.py ranks OUT_DIR`` writes ``OUT_DIR/result.json``.
Every process involved runs with ``FP8RL_TEST_NCCL_STANDIN=1`` and ``tests/vllm_site`` on
its path: vLLM's NCCL communicator is the gloo stand-in
(``tests/vllm_site/fp8rl_nccl_standin.py``), everything else is vLLM's code —
``NCCLTrainerWeightTransferEngine`` on the trainer, ``NCCLWeightTransferEngine`` in the
worker, the packed producer and consumer, the TCP rendezvous.

* ``ranks``: two trainer ranks (forked, gloo, an FSDP2-sharded tiny policy), each with a
  ``vllm_http`` engine, sync twice to one receiving worker (vLLM's worker engine, NCCL rank
  1, in rank 0's process behind the server's routes answered in-process): who opened the
  trainer endpoint and who called the server, what the worker holds after each sync, one
  stream pass per rank per sync, the bytes on the wire, and that rank 1 left its sync only
  after rank 0 had resumed the server.

The campaigns (``fp8rl run``) that sync by NCCL, to an engine in its own process and to a
``vllm serve``, are in tests/flows/campaign/test_vllm_campaign.py and tests/stages/engines/test_vllm_http_real.py.

vLLM spawns helper processes: the entry point is guarded by ``__main__``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 40, 41, 42], [1, 60, 61], [1, 70, 71, 72, 73, 74]]


def wire_file(out_dir: Path) -> Path:
    return out_dir / "wire.jsonl"


def sent_bytes(out_dir: Path, pid: int) -> dict[str, int]:
    """Bytes the trainer's process (``pid``) broadcast as NCCL rank 0, per dtype."""
    from fp8rl_nccl_standin import wire_bytes

    return wire_bytes(wire_file(out_dir), pid=pid, rank=0)


# ------------------------------------------------------------------ two trainer ranks
class Worker:
    """One inference worker's side: vLLM's ``NCCLWeightTransferEngine`` over a model that keeps what it loads."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        import torch
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        self.loaded: dict[str, torch.Tensor] = {}
        worker = self

        class Model:
            def load_weights(self, weights):
                for name, tensor in weights:
                    worker.loaded[name] = tensor.clone()

        parallel = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
        vllm_config = SimpleNamespace(parallel_config=parallel, model_config=None)
        self.engine = NCCLWeightTransferEngine(
            WeightTransferConfig(backend="nccl"), vllm_config, torch.device("cpu"), Model()
        )


class Client:
    """vLLM's four-method client protocol, answered by :class:`Worker` (``None``: a client never to be called)."""

    def __init__(self, worker: Worker | None) -> None:
        self.worker, self.calls, self.finished_at = worker, [], []

    def _worker(self, call: str) -> Worker:
        self.calls.append(call)
        if self.worker is None:
            raise RuntimeError(f"{call} on a trainer rank that is not the sender")
        return self.worker

    def init_weight_transfer_engine(self, init_info):
        w = self._worker("init_weight_transfer_engine").engine
        self.init_info = dict(init_info)
        w.init_transfer_engine(w.parse_init_info(init_info))

    def start_weight_update(self):
        self._worker("start_weight_update").loaded.clear()

    def update_weights(self, update_info):
        w = self._worker("update_weights").engine
        self.update_info = dict(update_info)
        w.receive_weights(w.parse_update_info(update_info))

    def finish_weight_update(self, weight_version=None):
        self._worker("finish_weight_update")
        time.sleep(0.5)  # a slow engine: no trainer rank may go on before the server is back

    def repack_tied_head(self) -> bool:
        """A server started with our worker extension (``/collective_rpc``): the tied policy's head, re-processed."""
        self._worker("repack_tied_head")
        return True

    def pause(self):
        self._worker("pause")

    def resume(self):
        self._worker("resume")
        self.finished_at.append(time.time())


def rank_main(rank: int, store: str, out_dir: str) -> None:
    import fp8rl_nccl_standin
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    fp8rl_nccl_standin.install()
    import vllm.distributed.weight_transfer.nccl_engine as nccl_engine

    from fp8rl_core.config.method import PrecisionConfig
    from fp8rl_core.config.model import ModelConfig
    from fp8rl_core.config.pipeline import RolloutConfig
    from fp8rl_core.tasks.tiny_model import build_tiny_model
    from stages.engines import weight_transfer as wt
    from stages.engines.http_engine import VLLMHTTPEngine
    from stages.engines.nccl_sync import resolve_rendezvous
    from stages.trainer.distributed import shard_policy

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    out: dict = {"rank": rank, "pid": os.getpid()}
    try:
        policy = shard_policy(build_tiny_model(ModelConfig(seed=3)))
        rendezvous = resolve_rendezvous(RolloutConfig(), rank=rank, world_size=2)  # port null: rank 0 picks it
        out["port"] = rendezvous.port
        opened, streams, gathers = [], [], []
        real_open, real_stream = nccl_engine.open_trainer_endpoint, wt.stream_trainer_weights
        real_full = DTensor.full_tensor
        nccl_engine.open_trainer_endpoint = lambda info: opened.append(info.rank) or real_open(info)
        wt.stream_trainer_weights = lambda *a, **k: streams.append(1) or real_stream(*a, **k)
        DTensor.full_tensor = lambda self, **k: gathers.append(1) or real_full(self, **k)
        cfg = RolloutConfig(engine="vllm_http", server_url="http://127.0.0.1:9")
        engine = VLLMHTTPEngine(model=policy, tokenizer=None, precision=PrecisionConfig(), config=cfg,
                                nccl_master=rendezvous)
        client = engine.weights = Client(Worker() if rank == 0 else None)  # the server's RL routes, answered here
        per_sync, held_equal = [], []
        for sync in range(2):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.01 * (sync + 1))
            expected = {n: t.clone() for n, t in real_stream(policy)}  # a collective: both ranks, outside the count
            streams.clear(), gathers.clear()
            engine.load_weights(policy)
            per_sync.append({"streams": len(streams), "gathers": len(gathers), "left_at": time.time()})
            if rank == 0:
                held = client.worker.loaded
                held_equal.append(
                    held.keys() == expected.keys() and all(torch.equal(held[n], t) for n, t in expected.items())
                )
        nccl_engine.open_trainer_endpoint, wt.stream_trainer_weights = real_open, real_stream
        DTensor.full_tensor = real_full
        sharded = sum(isinstance(t, DTensor) for t in policy.state_dict().values())
        out.update(
            opened=opened, client_calls=client.calls, per_sync=per_sync, sharded_parameters=sharded,
            resumed_at=client.finished_at, held_equal=held_equal, is_sender=engine._sender.is_sender,
        )
        if rank == 0:
            out["update_dtypes"] = sorted(set(client.update_info["dtype_names"]))
            out["init_info"] = {k: v for k, v in client.init_info.items() if k != "master_address"}
            out["sent_numel"] = sum(t.numel() for t in expected.values())
            out["wire"] = sent_bytes(Path(out_dir), os.getpid())
            out["names"] = list(expected)
        engine.close()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_rank()


def leave_rank() -> None:
    """``tests.scaleout_common.leave_rank`` (which this venv cannot import: it has no pytest): a forked rank
    ends without the interpreter's teardown, where gloo's threads abort it one time in many."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def standin_rules() -> dict:
    """The stand-in keeps NCCL's rules: what each of two ranks (threads, one TCP rendezvous) is told."""
    import threading

    import fp8rl_nccl_standin
    import torch
    from vllm.distributed.device_communicators import pynccl
    from vllm.distributed.utils import StatelessProcessGroup

    from stages.engines.nccl_sync import free_port

    fp8rl_nccl_standin.install()
    port, said = free_port(), {0: [], 1: []}
    cases = [
        ("fine", lambda r: torch.arange(6.0), 0),
        ("strided", lambda r: torch.arange(12.0)[::2] if r == 0 else torch.zeros(6), 0),
        ("dtype", lambda r: torch.zeros(6, dtype=torch.bfloat16 if r else torch.float32), 0),
        ("numel", lambda r: torch.zeros(6 + r), 0),
        ("src", lambda r: torch.zeros(6), 2),
    ]

    def rank(r: int) -> None:
        comm = pynccl.PyNcclCommunicator(StatelessProcessGroup.create("127.0.0.1", port, r, 2), device=0)
        said[r].append(type(comm).__name__)
        for name, make, src in cases + [("destroyed", None, 0)]:
            if name == "destroyed":
                comm.destroy()
            tensor = make(r) if make else torch.zeros(6)
            try:
                comm.broadcast(tensor, src=src)
                said[r].append(f"{name}: holds {tensor.tolist()[:3]}")
            except RuntimeError as err:
                said[r].append(f"{name}: {err}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return said


def run_ranks(out_dir: Path) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    store = f"file://{tempfile.mkdtemp(prefix='fp8rl-store-')}/store"  # a group of their own, as the suite's ranks
    mp.start_processes(rank_main, args=(store, str(out_dir)), nprocs=2, join=True, start_method="fork")
    result = {f"rank{r}": json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)}
    result["rules"] = standin_rules()
    return result


def main(argv: list[str]) -> int:
    kind, out_dir = argv[1], Path(argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ["FP8RL_TEST_NCCL_WIRE"] = str(wire_file(out_dir))
    try:
        if kind != "ranks":
            raise ValueError(f"unknown check {kind!r} (only 'ranks')")
        result = run_ranks(out_dir)
    except Exception:
        result = {"error": traceback.format_exc()}
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "vllm_site")]
    sys.exit(main(sys.argv))
