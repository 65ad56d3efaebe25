"""The rollout side of an overlapped step: step t + k's rollout and scoring beside step t's training.

With ``rollout.max_staleness`` k ≥ 1 (``stages.dag.stage_runs``) a step runs the
rollout side's stages for step t + k before training step t, in lockstep order; the
step's runner (``flows/campaign/flow.py``) can instead hand the ones for a later step
than its own to a :class:`RolloutSide`, which runs them in a thread of the step
while the trainer runs the stages the table marks ``beside_rollout`` (train,
calibrate), and is joined before any other (evaluate and checkpoint read the
engine and the sampler). Both orders give the same tables:

* the engine takes the policy of version t − 1 when the side starts, before step
  t's update touches the weights: a push copies them (:meth:`RolloutSide.start`);
* the side's stages run one after another, each the runner's own stage run (ledger
  record, Prefect task run, time limit, retries), with the state the step began
  with, under the step's CPU numerics (``precision.cpu_bf16_gemm``, a thread-local
  mode); only the sampler moves, and the joined state takes the side's sampler;
* an error on the side is raised by :meth:`RolloutSide.join`, in the step's thread.

The side overlaps only when the engine computes in a process of its own
(:func:`overlaps`): the transformers engine moved to a worker
(:mod:`stages.engines.engine_worker`, a CPU run in one process), or vLLM in its own
engine process or behind a server (``computes_apart``), whose weights the push
replaces while the trainer holds still. Under several ranks
the rollout side's gathers and broadcasts would interleave with FSDP's collectives
on the process group, so a multi-rank run keeps the lockstep order.
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
from typing import Any, Callable

from fp8rl_core.config.stage_kinds import StageSpec
from fp8rl_core.cpu_numerics.cpu_gemm import active_cpu_gemm, cpu_bf16_gemm
from stages.context import RunEnv, TrainState

__all__ = ["RolloutSide", "overlaps", "rollout_worker"]


def overlaps(env: RunEnv) -> bool:
    """Whether this run's rollout side runs beside its training (see the module docstring)."""
    r = env.cfg.rollout
    if not (r.max_staleness > 0 and r.overlap and env.world_size == 1):
        return False
    return env.engine.holds_trainer_copy or getattr(env.engine, "computes_apart", False)


def rollout_worker(env: RunEnv, state: TrainState, gemm: str) -> RunEnv:
    """``env`` with its transformers engine moved to a worker process, for a CPU run in one process with
    ``rollout.max_staleness`` ≥ 1; ``env`` unchanged otherwise. The trainer keeps the run's threads less
    one, the worker one (on two cores: one each)."""
    import torch

    from stages.engines.engine_worker import WorkerEngine
    from stages.engines.hf_engine import TransformersEngine

    cfg = env.cfg
    if not (cfg.rollout.max_staleness and cfg.rollout.overlap and env.world_size == 1 and env.device.type == "cpu"):
        return env
    if not isinstance(env.engine, TransformersEngine):
        return env
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads - 1))
    return dataclasses.replace(env, engine=WorkerEngine(env.engine, gemm=gemm, threads=1, trainer=state.policy))


StageRuns = Callable[[TrainState, list[tuple[StageSpec, int]]], TrainState]  # the step's runner, given its runs


class RolloutSide:
    """The rollout side's stage runs of one step, queued, then run in a thread; see the module docstring."""

    def __init__(self, env: RunEnv) -> None:
        self.env = env
        self.queued: list[tuple[StageSpec, int]] = []
        self._thread: threading.Thread | None = None
        self._out: dict[str, Any] = {}

    def queue(self, spec: StageSpec, at: int) -> None:
        self.queued.append((spec, at))

    def start(self, state: TrainState, run: StageRuns) -> None:
        """Push the policy to the engine (a copy, taken now), then run the queued stage runs in a thread."""
        if self._thread is not None or not self.queued:
            return
        engine = self.env.engine
        if engine.policy_version != state.policy_version:
            engine.sync_policy(state.policy, state.policy_version)
        runs, context = list(self.queued), contextvars.copy_context()  # the flow run's context (Prefect)
        gemm = active_cpu_gemm()  # the step's CPU numerics, which a thread does not inherit

        def side() -> None:
            side_state = state
            try:
                with cpu_bf16_gemm(gemm, self.env.device):
                    side_state = run(side_state, runs)
                self._out["state"] = side_state
            except BaseException as err:  # raised in the step's thread by join()
                self._out["error"] = err

        self._thread = threading.Thread(target=context.run, args=(side,), name="fp8rl-rollout-side", daemon=True)
        self._thread.start()

    def join(self, state: TrainState, run: StageRuns) -> TrainState:
        """Wait for the side (started first if it was not); ``state`` with the side's sampler. A no-op
        when nothing was queued."""
        if self._thread is None:
            if not self.queued:
                return state
            self.start(state, run)
        self._thread.join()
        self._thread = None
        self.queued.clear()
        if "error" in self._out:
            raise self._out.pop("error")
        return dataclasses.replace(state, sampler=self._out.pop("state").sampler)
