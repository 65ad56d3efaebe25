"""The DAG as data: a stage, an engine and a precision mode added the way docs/architecture.md's
"Where to add …" says, each working with no other edit; the runner's hops to each stage.

Each addition is undone after its test (``monkeypatch`` on the registries' entries).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import micro_config

import flows.campaign.flow as campaign
from fp8rl_core.config.engine_kinds import ENGINE_KINDS, EngineKind
from fp8rl_core.config.precision_kinds import PRECISION_MODES, PrecisionMode
from fp8rl_core.config.stage_kinds import STAGES, Ranks, StageSpec, When
from stages.context import TrainState, is_calibration_step
from stages.dag import BINDINGS, StageBinding
from stages.result import StageResult
from storage.ledger.events import Ledger
from storage.run.layout import create_run

AUDITED: list[int] = []


def run_audit(env, state, step, *, attempt: int = 0):
    """The new stage's function (``"test_dag_table:run_audit"``)."""
    AUDITED.append(step)
    return StageResult(info={"audited": step}), state


@pytest.fixture
def audit_stage(monkeypatch):
    """A stage added as the docs say: a row in the table (before checkpoint) and its binding."""
    spec = StageSpec("audit", Ranks.MAIN, 1, When.STEP, replays=False, syncs_engine=False,
                     reads=("steps",), writes=(), limit_s=123.0)  # fmt: skip
    STAGES.add(spec, before="checkpoint")
    monkeypatch.setitem(BINDINGS._items, "audit", StageBinding("test_dag_table:run_audit"))
    AUDITED.clear()
    yield spec
    STAGES.remove("audit")


def _recording_tasks(monkeypatch, calls: list):
    """Stage tasks that record the call, then run the bound stage function (one process)."""

    def stage_task(spec):
        fn = BINDINGS.get(spec.name).fn()

        def task(env, state, step, **kw):
            calls.append((spec.name, step))
            if spec.name == "train":
                return StageResult(metrics={}, shadow=is_calibration_step(env.cfg, step)), state
            if spec.name in ("audit",):
                return fn(env, state, step, attempt=0, **kw)
            return StageResult(), state

        task.with_options, task.peer_body = (lambda retries: task), task
        return task

    monkeypatch.setattr(campaign, "stage_task", stage_task)
    monkeypatch.setattr(campaign, "sync_engine", lambda *a, **k: None)
    monkeypatch.setattr(campaign, "_REPORTS", {})


def test_a_new_stage_runs_in_its_place_with_its_default_limit_and_is_a_cli_choice(audit_stage, tmp_path, monkeypatch):
    from flows.commands.run import _stage_choices

    run = create_run(tmp_path, "r").root
    env = SimpleNamespace(cfg=micro_config(), ledger=Ledger(run), variant="main", run_id="r", is_main=True,
                          world_size=1, rank=0)  # fmt: skip
    calls: list = []
    _recording_tasks(monkeypatch, calls)
    state = TrainState(policy=None, optimizer=None, scheduler=None, calibrator=None)
    progress = campaign.Progress(env.cfg, 0, echo=lambda line: None)
    campaign.run_step(env, state, 2, progress)
    assert [s for s, _ in calls] == ["rollout", "score", "train", "evaluate", "audit", "checkpoint"]
    assert AUDITED == [2]
    assert env.cfg.timeouts.stage_s("audit") == 123.0  # no timeouts field: the table's default
    assert "audit" in [c.value for c in _stage_choices("FromStage", STAGES.names())]


def test_a_stage_outside_the_table_cannot_be_bound() -> None:
    from stages.dag import bind_stage

    with pytest.raises(KeyError, match="unknown stage 'nope'"):
        bind_stage("nope", StageBinding("test_dag_table:run_audit"))


def test_a_new_engine_kind_is_validated_built_and_planned(monkeypatch) -> None:
    """A row in ENGINE_KINDS plus a class registered in the module it names: the config accepts the
    name, ``make_engine`` builds it (importing the module), and the memory plan reads the kind."""
    from flows.plan.memory import engine_weight_bytes
    from stages.engines.base import ENGINES, RolloutEngine, make_engine, register_engine

    kind = EngineKind(__name__, False, False, True, False, ("trainer",), ("bf16",))
    monkeypatch.setitem(ENGINE_KINDS._items, "echo", kind)

    class Echo(RolloutEngine):
        def __init__(self, **kw):
            self.kw = kw

        def generate(self, prompt_ids, request):
            raise NotImplementedError

        def load_weights(self, train_model):
            pass

    monkeypatch.setitem(ENGINES._items, "echo", None)  # undone after the test
    del ENGINES._items["echo"]
    register_engine("echo")(Echo)
    cfg = micro_config("rollout.engine=echo", "precision.rollout=bf16")
    assert make_engine("echo", model=None, tokenizer=None, precision=cfg.precision, config=cfg.rollout).name == "echo"
    assert engine_weight_bytes(cfg, 1000) == 2000.0  # weights on the device, in bf16
    with pytest.raises(ValueError, match="does not serve precision.rollout 'fp8_per_tensor'"):
        micro_config("rollout.engine=echo", "precision.rollout=fp8_per_tensor")


def test_an_engine_class_that_contradicts_its_kind_is_refused_when_it_registers(monkeypatch) -> None:
    from stages.engines.base import RolloutEngine, register_engine

    monkeypatch.setitem(ENGINE_KINDS._items, "disk", EngineKind(__name__, True, True, True, True, ("trainer",), None))

    class NoPath(RolloutEngine):
        def __init__(self, **kw):
            pass

        def generate(self, prompt_ids, request):
            raise NotImplementedError

        def load_weights(self, train_model):
            pass

    with pytest.raises(TypeError, match="must take model_path"):
        register_engine("disk")(NoPath)
    with pytest.raises(KeyError, match="unknown rollout engine 'unlisted'"):
        register_engine("unlisted")


def test_a_new_precision_mode_is_read_from_its_record(monkeypatch) -> None:
    """A record in PRECISION_MODES and a conversion in the precision room's registry: the padding
    contract, the plan's bytes and the config read the record (an FP4 rollout counts half a byte)."""
    from flows.plan.memory import engine_weight_bytes
    from fp8rl_core.precision.conversion import TRAIN_PRECISIONS
    from stages.trainer.forward import token_multiple

    monkeypatch.setitem(PRECISION_MODES._items, "fp6_test", PrecisionMode("fp6", 0.75, 32, (10, 0), True, False))
    monkeypatch.setitem(TRAIN_PRECISIONS._items, "fp6_test", TRAIN_PRECISIONS.get("bf16"))
    assert token_multiple("fp6_test") == 32
    cfg = micro_config("precision.train=fp6_test")
    assert cfg.precision.train == "fp6_test"
    vllm = micro_config("rollout.engine=vllm", "precision.rollout=fp8_per_tensor")
    assert engine_weight_bytes(vllm, 1000) == 1000.0
    assert PRECISION_MODES.get("nvfp4_w4a4").bytes_per_weight == 0.5  # a 2-byte count got every FP4 mode wrong


HOPS: dict[str, list[str]] = {}
ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fp8rl_core", "stages", "flows", "storage")


def _fake_stage(name: str):
    """A stage function that records the repository's frames between ``run_step`` and itself."""

    def run(env, state, step, *, attempt: int = 0, **kw):
        chain, f = [f"run_{name}"], sys._getframe().f_back
        while f is not None and f.f_code.co_name != "run_step":
            if Path(f.f_code.co_filename).resolve().relative_to(ROOT).parts[0] in PACKAGES:
                chain.append(f.f_code.co_name)
            f = f.f_back
        HOPS[name] = chain[::-1]
        return StageResult(shadow=True), state

    return run


def _plain_task(**options):
    """Prefect's ``task`` without Prefect: its engine adds only library frames, which are not hops."""

    def deco(fn):
        def run(*a, **kw):
            return fn(*a, **kw)

        run.fn, run.with_options = fn, lambda **o: run
        return run

    return deco


def test_the_runner_reaches_every_stage_function_in_three_hops(tmp_path, monkeypatch) -> None:
    """run_step → the rank policy → the stage's task function → the stage function, for every stage."""
    for spec in STAGES:
        setattr(sys.modules[__name__], f"fake_{spec.name}", _fake_stage(spec.name))
        fake = dataclasses.replace(BINDINGS.get(spec.name), function=f"{__name__}:fake_{spec.name}")
        monkeypatch.setitem(BINDINGS._items, spec.name, fake)
    monkeypatch.setattr(campaign, "task", _plain_task)
    monkeypatch.setattr(campaign, "_TASKS", {})
    monkeypatch.setattr(campaign, "sync_engine", lambda *a, **k: None)
    monkeypatch.setattr(campaign, "_REPORTS", {})
    run = create_run(tmp_path, "r").root
    env = SimpleNamespace(cfg=micro_config(), ledger=Ledger(run), variant="main", run_id="r", is_main=True,
                          world_size=1, rank=0)  # fmt: skip
    state = TrainState(policy=None, optimizer=None, scheduler=None, calibrator=None)
    HOPS.clear()
    campaign.run_step(env, state, 2, campaign.Progress(env.cfg, 0, echo=lambda line: None))
    assert set(HOPS) == set(STAGES.names())
    for name, chain in HOPS.items():
        assert len(chain) <= 3, f"{name}: run_step → {' → '.join(chain)}"
        assert chain[-1] == f"run_{name}" and chain[-2] == "attempt_stage", chain
