"""House rules on capabilities as records: no decision reads an engine's, a stage's or a precision
mode's name, and the tables (``fp8rl_core/config/*_kinds.py``) hold the same names as their registries."""

from __future__ import annotations

import ast

import pytest
from test_house import ROOT, _sources

# modules allowed to spell the names of a kind: where its table is, and (precision) the room that implements the modes
_KIND_HOMES = {
    "engine": ("fp8rl_core/config/engine_kinds.py", "fp8rl_core/precision/"),  # the latter: vLLM's scale rule
    "stage": ("fp8rl_core/config/stage_kinds.py",),
    "precision mode": ("fp8rl_core/config/precision_kinds.py", "fp8rl_core/precision/"),
}


def _kind_names() -> dict[str, set[str]]:
    from fp8rl_core.config.engine_kinds import ENGINE_KINDS
    from fp8rl_core.config.precision_kinds import PRECISION_MODES
    from fp8rl_core.config.stage_kinds import STAGES

    return {
        "engine": set(ENGINE_KINDS.names()),
        "stage": set(STAGES.names()),
        "precision mode": set(PRECISION_MODES.names()),
    }


def _string_constants(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for e in node.elts for v in _string_constants(e)]
    return []


def _name_decisions(source: str, rel: str, kinds: dict[str, set[str]]) -> list[str]:
    """Comparisons of an engine, stage or precision-mode name as a string: ``x == "vllm"``,
    ``x in ("score", "train")``, ``mode.startswith("fp8")``, ``mode.endswith("rowwise")``."""
    bad = []
    for node in ast.walk(ast.parse(source, rel)):
        if isinstance(node, ast.Compare):
            spelled = [v for side in (node.left, *node.comparators) for v in _string_constants(side)]
            for kind, names in kinds.items():
                bad += [f"{rel}:{node.lineno} compares with the {kind} {v!r}" for v in spelled if v in names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("startswith", "endswith"):
            pieces = [v for a in node.args for v in _string_constants(a)]
            for kind, names in kinds.items():
                if kind == "stage":  # a stage name is a word of English: only its whole spelling counts
                    continue
                hit = [p for p in pieces if len(p) >= 3 and any(getattr(n, node.func.attr)(p) for n in names)]
                bad += [f"{rel}:{node.lineno} reads a {kind} from its name: .{node.func.attr}({p!r})" for p in hit]
    return bad


def test_no_capability_decision_compares_an_engine_stage_or_precision_name() -> None:
    """What an engine, a stage or a precision mode can do is read from its record (``engine_kinds``,
    ``stage_kinds``, ``precision_kinds``), never from its spelling. ``gpu_check/`` runs without the
    package and keeps its own vocabulary."""
    kinds, bad = _kind_names(), []
    for f in _sources(("fp8rl_core", "stages", "flows", "storage")):
        rel = str(f.relative_to(ROOT))
        found = _name_decisions(f.read_text(), rel, kinds)
        bad += [b for b in found if not any(rel.startswith(h) for k, hs in _KIND_HOMES.items() if k in b for h in hs)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "planted",
    [
        'if cfg.rollout.engine == "vllm":\n    pass\n',
        'if stage in ("score", "calibrate"):\n    pass\n',
        'q = 1 if cfg.precision.rollout.startswith("fp8") else 2\n',
        'm = 16 if mode.endswith("rowwise") else 1\n',
        'if "train" != name:\n    pass\n',
    ],
)
def test_the_name_rule_catches_a_planted_comparison(planted: str) -> None:
    assert _name_decisions(planted, "<planted>", _kind_names())


def _table_mismatches() -> list[str]:
    """Every registered precision mode has a record and every record a mode; every engine kind a class
    (imported from the kind's module) and every class a kind; every stage a binding and every binding a
    stage; every rerun row a rerun hook; the config's stage limits are fields named after the table."""
    import importlib

    from flows.campaign.rerun import RERUN_HOOKS
    from fp8rl_core.config.engine_kinds import ENGINE_KINDS
    from fp8rl_core.config.precision_kinds import PRECISION_MODES
    from fp8rl_core.config.stage_kinds import STAGES
    from fp8rl_core.config.timeouts import TimeoutConfig
    from fp8rl_core.precision.conversion import TRAIN_PRECISIONS
    from fp8rl_core.precision.rollout import ROLLOUT_PRECISIONS
    from stages.dag import BINDINGS
    from stages.engines.base import ENGINES

    for name in ENGINE_KINDS.names():
        importlib.import_module(ENGINE_KINDS.get(name).module)
    pairs = {
        "training precision records / TRAIN_PRECISIONS": (
            {n for n in PRECISION_MODES.names() if PRECISION_MODES.get(n).trains}, set(TRAIN_PRECISIONS.names())),
        "rollout precision records / ROLLOUT_PRECISIONS": (
            {n for n in PRECISION_MODES.names() if PRECISION_MODES.get(n).rolls_out}, set(ROLLOUT_PRECISIONS.names())),
        "ENGINE_KINDS / ENGINES": (set(ENGINE_KINDS.names()), set(ENGINES.names())),
        "STAGES / BINDINGS": (set(STAGES.names()), set(BINDINGS.names())),
        "rerun rows / RERUN_HOOKS": (set(STAGES.rerunnable()), set(RERUN_HOOKS.names())),
        "STAGES / timeouts fields": (
            set(STAGES.names()),
            {f[: -len("_s")] for f in TimeoutConfig.model_fields if f not in ("process_group_s", "heartbeat_s")}),
    }  # fmt: skip
    return [f"{what}: {sorted(a ^ b)}" for what, (a, b) in pairs.items() if a != b]


def test_the_tables_and_their_registries_hold_the_same_names() -> None:
    from fp8rl_core.config.stage_kinds import STAGES
    from fp8rl_core.config.timeouts import TimeoutConfig

    assert not _table_mismatches(), "\n".join(_table_mismatches())
    assert all(TimeoutConfig().stage_s(s.name) == s.limit_s for s in STAGES)


def test_the_table_rule_catches_a_record_without_its_mode(monkeypatch) -> None:
    from fp8rl_core.config.precision_kinds import PRECISION_MODES, PrecisionMode

    monkeypatch.setitem(PRECISION_MODES._items, "fp5_planted", PrecisionMode("fp5", 0.625, 1, (10, 0), True, False))
    assert any("fp5_planted" in m for m in _table_mismatches())
