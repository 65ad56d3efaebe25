"""The bootstrap cache is checked: a changed entry is refused in one line, a resume refuses a base policy other
than the one its run started from, and ``doctor --deep`` names it (stages.bootstrap.integrity)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import micro_config

from flows.campaign.configuration import dump_config
from storage.run.layout import create_run

pytestmark = pytest.mark.timeout(300)


def _teacher(cfg):
    from stages.bootstrap.math import NoisyTeacher

    b = cfg.bootstrap
    return NoisyTeacher(carry_drop=b.carry_drop, noisy_steps=b.noisy_steps, switch_loss=b.switch_loss)


def _publish(cache: Path, cfg, seed: int = 0) -> Path:
    """An untrained tiny policy published as ``cfg``'s cache entry under ``cache`` (no training: seconds)."""
    from fp8rl_core.tasks.tiny_model import build_tiny_model, build_tokenizer
    from stages.bootstrap.integrity import META_FILE
    from stages.bootstrap.math import config_hash, publish_checkpoint

    digest = config_hash(cfg.model, cfg.task, cfg.bootstrap, _teacher(cfg))
    final = cache / f"tiny-{digest[:16]}"
    tokenizer = build_tokenizer()
    model = build_tiny_model(cfg.model.model_copy(update={"seed": seed}), len(tokenizer.get_vocab()))
    import shutil

    shutil.rmtree(final, ignore_errors=True)
    publish_checkpoint(final, model, tokenizer, {"config_hash": digest})
    assert (final / META_FILE).is_file()
    return final


def _flip_last_byte(path: Path) -> None:
    b = bytearray(path.read_bytes())
    b[-1] ^= 0x01  # a weight's low bits: the file still loads, the policy differs
    path.write_bytes(bytes(b))


def test_a_changed_cache_entry_is_refused_in_one_line_and_an_old_one_gets_its_hash(tmp_path, monkeypatch):
    from stages.bootstrap.integrity import DIGEST_KEY, BasePolicyChanged
    from stages.bootstrap.math import bootstrap
    from storage.errors import StorageError

    cfg = micro_config()
    entry = _publish(tmp_path / "cache", cfg)
    meta = json.loads((entry / "bootstrap.json").read_text())
    digest = meta.pop(DIGEST_KEY)  # recorded at publication

    def found() -> Path:
        return bootstrap(cfg.model, cfg.task, cfg.bootstrap, tmp_path / "cache", teacher=_teacher(cfg))

    (entry / "bootstrap.json").write_text(json.dumps(meta))  # an entry made before the hash existed
    assert found() == entry
    assert json.loads((entry / "bootstrap.json").read_text())[DIGEST_KEY] == digest  # recorded on first read
    _flip_last_byte(entry / "model.safetensors")
    with pytest.raises(BasePolicyChanged) as caught:
        found()
    msg = str(caught.value)
    assert isinstance(caught.value, StorageError)  # the CLI's one line, exit 2
    assert "\n" not in msg and "changed after it was built" in msg and f"rm -r {entry}" in msg, msg


def test_resume_refuses_another_base_policy_and_doctor_deep_names_it(tmp_path, monkeypatch):
    from stages.bootstrap.integrity import BasePolicyChanged
    from stages.context import open_run

    cache = tmp_path / "cache"
    monkeypatch.setenv("FP8RL_BOOTSTRAP_CACHE", str(cache))
    cfg = micro_config()
    entry = _publish(cache, cfg)
    run = create_run(tmp_path / "runs", "r", config=dump_config(cfg)).root
    env, _ = open_run(cfg, run)  # the first start records the base policy
    env.close()
    recorded = json.loads((run / "run.json").read_text())["base_policy"]
    assert recorded["path"] == str(entry) and len(recorded["weights_sha256"]) == 64
    env, _ = open_run(cfg, run)  # a resume from the same policy
    env.close()

    _publish(cache, cfg, seed=1)  # the entry rebuilt with other weights: consistent in itself
    with pytest.raises(BasePolicyChanged, match="started from the base policy") as caught:
        open_run(cfg, run)
    assert "\n" not in str(caught.value)
    doctor = subprocess.run(
        [sys.executable, "-m", "flows.cli", "doctor", "--deep", str(run)], capture_output=True, text=True, timeout=120
    )
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert "base policy changed" in doctor.stderr and "Traceback" not in doctor.stderr, doctor.stderr
