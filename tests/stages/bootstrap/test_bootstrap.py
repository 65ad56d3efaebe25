"""Bootstrap stage: reproducible for a seed, cached by config hash (measured),
atomic, and — full size, marked slow — lands in the RL band."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file

from fp8rl_core.config.model import BootstrapConfig, ModelConfig, TaskConfig
from fp8rl_core.tasks.tiny_model import load_policy
from stages.bootstrap.math import NoisyTeacher, bootstrap, config_hash, read_meta

# end to end on a shared 2-core machine: a module fixture's campaign counts in its first test
pytestmark = pytest.mark.timeout(900)

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
SHORT = BootstrapConfig(steps=15, batch_size=16, warmup_steps=5, threads=1)
TASK = TaskConfig(difficulty=1)


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def test_reproducible_cached_and_atomic(tmp_path):
    t0 = time.perf_counter()
    first = bootstrap(TINY, TASK, SHORT, tmp_path / "a", eval_size=200)
    cold = time.perf_counter() - t0
    t1 = time.perf_counter()
    again = bootstrap(TINY, TASK, SHORT, tmp_path / "a", eval_size=200)
    warm = time.perf_counter() - t1
    assert again == first
    assert warm < 0.1 and warm < cold / 10, (cold, warm)  # a cache hit does not train
    print(f"bootstrap cold {cold:.2f}s, cached {warm * 1000:.1f}ms")

    other_root = bootstrap(TINY, TASK, SHORT, tmp_path / "b", eval_size=200)  # same config, fresh cache
    wa, wb = _weights(first), _weights(other_root)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    meta = read_meta(first)
    assert meta["config_hash"] == config_hash(TINY, TASK, SHORT, NoisyTeacher(**meta["teacher"]))
    assert 0.0 <= meta["base_accuracy_sampled"] <= 1.0 and 0.0 <= meta["base_accuracy_greedy"] <= 1.0
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".tmp")]  # nothing half-written left

    model, tok = load_policy(first)
    assert model.dtype == torch.float32 and tok.eos_token_id == 2


def test_hash_covers_what_shapes_the_weights():
    t = NoisyTeacher()
    base = config_hash(TINY, TASK, SHORT, t)
    assert config_hash(TINY, TASK, SHORT.model_copy(update={"threads": 2}), t) == base
    assert config_hash(TINY, TASK.model_copy(update={"train_size": 10}), SHORT, t) == base
    assert config_hash(TINY, TASK, SHORT.model_copy(update={"seed": 1}), t) != base
    assert config_hash(TINY, TASK.model_copy(update={"difficulty": 2}), SHORT, t) != base
    assert config_hash(TINY.model_copy(update={"seed": 3}), TASK, SHORT, t) != base
    assert config_hash(TINY, TASK, SHORT, NoisyTeacher(carry_drop=0.3)) != base
    assert config_hash(TINY, TASK, SHORT, NoisyTeacher(noisy_steps=5)) != base
    assert config_hash(TINY, TASK, SHORT, NoisyTeacher(switch_loss=0.1)) != base


def test_teacher_validation():
    with pytest.raises(ValueError, match="mode"):
        NoisyTeacher(carry_drop=0.6)
    with pytest.raises(ValueError, match="switch_loss"):
        NoisyTeacher(switch_loss=0.0)


def test_real_checkpoint_is_not_bootstrapped(tmp_path):
    with pytest.raises(ValueError, match="model.path"):
        bootstrap(ModelConfig(path="Qwen/Qwen3-0.6B"), TASK, SHORT, tmp_path)


def test_two_processes_asking_at_once_train_once(tmp_path, monkeypatch):
    """Two callers of one uncached config at the same moment (two sweep cells, two test workers): one
    trains, the other waits for its checkpoint instead of training the same weights beside it."""
    import threading

    import stages.bootstrap.math as boot

    calls, real = [], boot.train_policy

    def slow_train(*args, **kwargs):
        calls.append(threading.get_ident())
        time.sleep(1.0)  # both callers are past the cache check before either publishes
        return real(*args, **kwargs)

    monkeypatch.setattr(boot, "train_policy", slow_train)
    out: list = []
    callers = [
        threading.Thread(target=lambda: out.append(bootstrap(TINY, TASK, SHORT, tmp_path, eval_size=50)))
        for _ in range(2)
    ]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=300)
    assert len(calls) == 1, f"{len(calls)} trainings of one cache entry"
    assert len(out) == 2 and out[0] == out[1] and (out[0] / "bootstrap.json").is_file()
