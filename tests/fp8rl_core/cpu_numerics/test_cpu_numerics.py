"""``precision.cpu_bf16_gemm: auto`` and the CPU-numerics record (fp8rl_core.cpu_numerics.cpu_gemm, cpu_env;
flows.campaign.cpu_numerics).

The old default was ``native`` everywhere: 130x slower BF16 GEMMs on CPUs without BF16
instructions and ISA-dependent bits; ``test_auto_is_the_default`` fails on it.
"""

from __future__ import annotations

import json

import pytest
import torch

from flows.campaign.configuration import load_config
from flows.campaign.cpu_numerics import RUN_JSON_KEY, gemm_choice, record_cpu_numerics, summary_line
from fp8rl_core.cpu_numerics import cpu_gemm
from fp8rl_core.cpu_numerics.cpu_gemm import NATIVE_MIN_HIDDEN, resolve_cpu_bf16_gemm
from fp8rl_core.host.cpu_env import PINNED_ENV, pin_cpu_numerics


def test_auto_is_the_default():
    assert load_config("tiny-cpu").precision.cpu_bf16_gemm == "auto"


@pytest.mark.parametrize(
    "isa,hidden,kind",
    [
        (None, 128, "portable"),
        (None, 4096, "portable"),  # no fast BF16 kernel: always the CPU-independent exact GEMMs
        ("AMX-BF16", 128, "portable"),
        ("AMX-BF16", NATIVE_MIN_HIDDEN - 16, "portable"),  # too narrow to win
        ("AMX-BF16", NATIVE_MIN_HIDDEN, "native"),
        ("AVX512-BF16", 1024, "native"),
        ("AMX-BF16", None, "native"),  # a model.path checkpoint: taken as wide
    ],
)
def test_auto_takes_native_only_with_a_fast_kernel_and_a_wide_model(monkeypatch, isa, hidden, kind):
    monkeypatch.setattr(cpu_gemm, "fast_bf16_isa", lambda: isa)
    choice = resolve_cpu_bf16_gemm("auto", hidden)
    assert (choice.setting, choice.kind) == ("auto", kind)
    assert choice.reason


@pytest.mark.parametrize(
    "limit,amx,avx512bf16,isa",
    [
        (None, True, True, "AMX-BF16"),
        ("AVX2", True, True, None),  # oneDNN held to AVX2: its BF16 GEMMs are the slow path
        ("avx512_core", True, True, None),
        ("AVX512_CORE_BF16", True, True, "AVX512-BF16"),
        ("AVX512_CORE_AMX", True, True, "AMX-BF16"),
        ("ALL", False, True, "AVX512-BF16"),
        ("NOT_AN_ISA", True, False, "AMX-BF16"),  # oneDNN ignores an unknown limit
        (None, False, False, None),
    ],
)
def test_a_onednn_isa_limit_below_the_bf16_kernels_is_no_fast_kernel(monkeypatch, limit, amx, avx512bf16, isa):
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if limit is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", limit)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512bf16)
    assert cpu_gemm.fast_bf16_isa() == isa
    assert resolve_cpu_bf16_gemm("auto", 4096).kind == ("native" if isa else "portable")


def test_explicit_settings_and_cuda_are_kept(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "fast_bf16_isa", lambda: None)
    assert resolve_cpu_bf16_gemm("native", 128).kind == "native"
    assert resolve_cpu_bf16_gemm("fp32", 4096).kind == "fp32"
    assert resolve_cpu_bf16_gemm("auto", 128, "cuda").kind == "native"  # the hardware's BF16 GEMMs
    assert resolve_cpu_bf16_gemm("portable", 4096).kind == "portable"
    with pytest.raises(ValueError, match="valid: auto, native, fp32, portable"):
        resolve_cpu_bf16_gemm("fast", 128)


def test_the_tiny_preset_resolves_to_portable_on_every_cpu():
    assert gemm_choice(load_config("tiny-cpu")).kind == "portable"  # whatever this CPU has
    assert gemm_choice(load_config("tiny-cpu", ["precision.cpu_bf16_gemm=native"])).kind == "native"


def test_pinning_sets_what_is_unset_and_keeps_what_the_user_set():
    env = {"MKL_CBWR": "AVX2"}
    assert pin_cpu_numerics(env) == PINNED_ENV  # MKL's branch is MKL's: the portable path never asks it
    assert env == {"MKL_CBWR": "AVX2", "ATEN_CPU_CAPABILITY": PINNED_ENV["ATEN_CPU_CAPABILITY"]}
    user = {"ATEN_CPU_CAPABILITY": "avx512"}
    assert pin_cpu_numerics(user) == user  # a value the user set is kept


def test_run_json_records_the_choice_and_keeps_its_fields(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "r", "config_hash": "abc", "schema_version": 1}))
    record = record_cpu_numerics(tmp_path, resolve_cpu_bf16_gemm("fp32", 128))
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["run_id"] == "r" and info["config_hash"] == "abc"
    assert info[RUN_JSON_KEY] == record
    assert record["bf16_gemm"] == {"setting": "fp32", "kind": "fp32", "reason": "configured"}
    assert record["aten_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    line = summary_line(record)
    assert line.startswith("cpu numerics: bf16 gemm fp32 (fp32: configured); ATen ") and "; ;" not in line
    assert line.endswith(f"thread(s); {record['cpu']}")


def test_a_portable_run_says_whether_its_exact_gemm_kernels_are_compiled(tmp_path):
    from fp8rl_core.cpu_numerics import exact_kernels

    (tmp_path / "run.json").write_text(json.dumps({"run_id": "r"}))
    record = record_cpu_numerics(tmp_path, resolve_cpu_bf16_gemm("portable", 128))
    assert record["exact_gemm_kernels"] == exact_kernels.status()
    assert f"; exact GEMM kernels {exact_kernels.status()}; ATen " in summary_line(record)
    fp32 = record_cpu_numerics(tmp_path, resolve_cpu_bf16_gemm("fp32", 128))
    assert "exact_gemm_kernels" not in fp32 and "exact GEMM" not in summary_line(fp32)
