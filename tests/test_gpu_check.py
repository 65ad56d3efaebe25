"""``make gpu-check`` imports and exits cleanly where there is no GPU; its pieces work on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_check import main as gpu_check

pytestmark = pytest.mark.timeout(60)


def test_cpu_only_machine_gets_one_clear_line_and_exit_0(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("gpu-check: no CUDA device") and "nothing measured" in out[0]


def test_shapes_and_sqnr():
    c = gpu_check.model_config("Qwen2.5-32B", layers=2)
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers) == (5120, 27648, 40, 8, 2)
    c = gpu_check.model_config("Qwen3-14B", layers=1)
    assert (c.model_type, c.hidden_size, c.head_dim) == ("qwen3", 5120, 128)
    x = torch.randn(1000)
    assert gpu_check.sqnr_db(x, x) == math.inf
    assert gpu_check.sqnr_db(x, x + 0.01 * x) == pytest.approx(40.0, abs=1e-6)


def test_carried_wheels_go_on_sys_path(tmp_path, monkeypatch):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "torchao-0.0-py3-none-any.whl").write_bytes(b"")
    monkeypatch.setattr(gpu_check, "HERE", tmp_path)
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    assert gpu_check.add_paths() == [str(tmp_path / "wheels" / "torchao-0.0-py3-none-any.whl")]
    assert sys.path[0].endswith(".whl")
