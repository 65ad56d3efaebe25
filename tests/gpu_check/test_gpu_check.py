"""``make gpu-check`` imports and exits cleanly where there is no GPU; its pieces work on CPU."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

from gpu_check import main as gpu_check
from gpu_check import sections

pytestmark = pytest.mark.timeout(60)


def test_cpu_only_machine_gets_one_clear_line_and_exit_0(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("gpu-check: no CUDA device") and "nothing measured" in out[0]


def test_shapes_and_sqnr():
    c = sections.model_config("Qwen2.5-32B", layers=2)
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers) == (
        5120,
        27648,
        40,
        8,
        2,
    )
    c = sections.model_config("Qwen3-14B", layers=1)
    assert (c.model_type, c.hidden_size, c.head_dim) == ("qwen3", 5120, 128)
    x = torch.randn(1000)
    assert sections.sqnr_db(x, x) == math.inf
    assert sections.sqnr_db(x, x + 0.01 * x) == pytest.approx(40.0, abs=1e-4)


def test_carried_wheels_go_on_sys_path(tmp_path, monkeypatch):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "torchao-0.0-py3-none-any.whl").write_bytes(b"")
    monkeypatch.setattr(gpu_check, "HERE", tmp_path)
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    assert gpu_check.add_paths() == [str(tmp_path / "wheels" / "torchao-0.0-py3-none-any.whl")]
    assert sys.path[0].endswith(".whl")


def test_real_scaled_mm_rollout_linear_matches_the_emulation_on_cpu():
    """gpu-check's real-kernel path (torch._scaled_mm, vLLM's scheme), run on CPU, layer by layer.

    Same FP8 weight values and fused scale, activations quantized by vLLM's rule:
    the outputs differ by the bf16 rounding of the emulation's output only (it
    rounds the matmul, then the rescaled value; the kernel rounds once). Over a
    whole model those last-bit differences flip FP8 roundings downstream, so
    model log-probs differ by as much as the emulation in bf16 differs from
    itself in float32 (~0.01 nats on the tiny model), which gpu-check reports.
    """
    from fp8rl_core.config.model import ModelConfig
    from fp8rl_core.precision.rollout import convert_for_rollout
    from fp8rl_core.tasks.tiny_model import build_tiny_model
    from gpu_check.rollout_kernels import scaled_mm_forward, use_scaled_mm

    torch.manual_seed(0)
    model = build_tiny_model(ModelConfig()).eval()
    emu = convert_for_rollout(model, "fp8_per_tensor", dtype=torch.bfloat16)
    for name in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        lin = emu.get_submodule(name)
        x = torch.randn(3, 7, lin.in_features).to(torch.bfloat16)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            want = lin(x).float()
        got = scaled_mm_forward(lin, x).float()
        rel = ((got - want).abs() / want.abs().clamp(min=1e-3 * want.abs().max())).max().item()
        assert rel < 2**-6, (name, rel)  # a couple of bf16 ulps
    assert use_scaled_mm(emu) == sum(1 for n, _ in emu.named_modules() if n.endswith("_proj"))


class PhaseLines(list):
    """A section's printed lines, its phase-time lines (``    phase import: 0.1 s``) kept apart in ``phases``."""

    def __init__(self) -> None:
        super().__init__()
        self.phases: list[str] = []

    def append(self, line: str) -> None:
        (self.phases if line.startswith("    phase ") else super()).append(line)


def test_sections_run_end_to_end_on_a_tiny_config_on_cpu(monkeypatch):
    """The GPU sections' code paths, on CPU with a tiny Qwen3: FP8 cells fail cleanly (no FP8 kernels here)."""
    import time

    from gpu_check.cpu_mode import tiny_config

    tiny = tiny_config(num_key_value_heads=2, num_hidden_layers=1)
    lines = PhaseLines()
    monkeypatch.setattr(sections, "emit", lines.append)
    sections.section_throughput(
        time.monotonic() + 60, iters=1, warmup=0, models={"tiny": tiny}, tokens_list=(32,), device="cpu"
    )
    row = lines[-1]
    assert row.startswith("    tiny") and "bf16" in row and row.count("FAILED") == 3  # emulate=False needs CUDA
    lines.clear()
    sections.section_rollout(seqs=2, length=8, config=tiny, device="cpu")
    text = "\n".join(lines)
    assert "emulated fp8_per_tensor" in text and "real _scaled_mm" in text and "real kernel vs emulation" in text
    assert [p.split(":")[0] for p in lines.phases] == ["    phase import", "    phase import", "    phase bf16 forward"]
    lines.clear()  # past its deadline a section says so and stops; a failing recipe is one line
    sections.section_throughput(time.monotonic() - 1, models={"tiny": tiny}, tokens_list=(32,), device="cpu")
    assert lines[1:] == ["    (time budget reached; remaining shapes skipped)"]
    lines.clear()
    sections.section_sqnr(time.monotonic() - 1, tokens=8, config=tiny, real_device="cpu", label="tiny")
    assert lines[1:] == [f"    {m}: skipped (section budget reached)" for m in sections.RECIPES]

    def no_kernel(model, mode):
        raise RuntimeError(f"no {mode} kernel")

    lines.clear()
    sections.section_sqnr(tokens=8, config=tiny, real_device="cpu", convert_real=no_kernel, label="tiny")
    assert lines[1:] == [f"    {m}: FAILED (RuntimeError: no {m} kernel)" for m in sections.RECIPES]


def test_vllm_section_skips_with_the_reason_where_vllm_does_not_import(monkeypatch):
    import sys

    from gpu_check import vllm_cycle

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    lines = []
    vllm_cycle.run(lines.append)
    assert len(lines) == 1 and lines[0].startswith("[5] vLLM cycle: SKIP (import vllm failed: ")


_BLOCK_PYDANTIC = r"""
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("pydantic", "pydantic_core"):
            raise ImportError("the GPU machine has no " + name)

sys.meta_path.insert(0, Block())
"""

_TRAIN_STEP = r"""
import torch
from transformers import Qwen3ForCausalLM

from fp8rl_core.precision.conversion import convert_for_training
from fp8rl_core.tasks.tiny_config import tiny_qwen3_config
from gpu_check.step_config import load_step_config
from gpu_check.train_step import _batch, compile_as_configured, run, step_and_calibrate
from stages.trainer.optimizer import make_optimizer

torch.set_num_threads(1)
torch.manual_seed(0)
model = Qwen3ForCausalLM(tiny_qwen3_config(
    hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
    tie_word_embeddings=False, max_position_embeddings=32768, pad_token_id=None, bos_token_id=None, eos_token_id=None,
))
cfg = load_step_config("fp8_rowwise")
report = convert_for_training(model, "fp8_rowwise")
assert cfg.precision.compile == "auto"
assert not compile_as_configured(model, cfg, torch.device("cpu"), report).enabled  # auto: eager on the CPU
opt, sched = make_optimizer(model, cfg)
res, cal, sec = step_and_calibrate(model, opt, sched, _batch("cpu", n=32, p=8, r=16, vocab=128), cfg)
assert callable(run) and not [m for m in sys.modules if m.startswith("pydantic")]
print("STEP", res.metrics["updates"], res.timings["calibration_s"] >= 0, 0.6 <= cal.lower <= 1.0)
"""


def _run_without_pydantic(code: str) -> str:
    """``code``'s stdout, run in a fresh interpreter where pydantic cannot be imported."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", _BLOCK_PYDANTIC + code], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_train_step_section_imports_and_runs_without_pydantic():
    """The GPU machine has torch, transformers, pyarrow and pandas, no pydantic: the train-step section
    imports and runs its whole step (π_old, shadow, update, calibration) with pydantic unimportable."""
    assert "STEP 2.0 True True" in _run_without_pydantic(_TRAIN_STEP)


def test_the_tiny_qwen3_config_imports_without_pydantic():
    """gpu_check builds its tiny policies from ``fp8rl_core.tasks.tiny_config``, which needs no pydantic."""
    code = (
        "from gpu_check.cpu_mode import TINY, tiny_config\n"
        "from fp8rl_core.tasks.tiny_config import tiny_qwen3_config\n"
        "cfg = tiny_config()\n"
        "assert all(getattr(cfg, k) == v for k, v in TINY.items()) and tiny_qwen3_config().vocab_size == 128\n"
        "print('PYDANTIC', [m for m in sys.modules if m.startswith('pydantic')])\n"
    )
    assert "PYDANTIC []" in _run_without_pydantic(code)


def test_the_shipped_step_config_is_the_validated_campaign_config():
    """``gpu_check/step_config.json`` is what ``CampaignConfig`` makes of the check's overrides today
    (regenerate with ``python -m gpu_check.step_config`` when a default changes)."""
    import json

    from gpu_check.step_config import PATH, dump_step_config, load_step_config

    assert json.loads(PATH.read_text()) == dump_step_config()
    cfg = load_step_config("fp8_blockwise")
    assert cfg.precision.train == "fp8_blockwise" and cfg.algorithm.micro_batch_size == 8
    with pytest.raises(AttributeError, match="read-only"):
        cfg.algorithm.lr = 1.0


def test_the_budget_fits_five_minutes_and_each_section_has_a_share():
    assert gpu_check.TOTAL_BUDGET_S <= 300
    assert sum(gpu_check.SECTION_BUDGETS_S.values()) + 15 <= gpu_check.TOTAL_BUDGET_S
    assert [k.split()[0] for k in gpu_check.SECTION_BUDGETS_S] == ["[1]", "[2]", "[3]", "[4]", "[5]"]


def test_sections_get_their_share_print_their_wall_time_and_a_late_one_is_skipped(monkeypatch):
    import time

    lines, seen = [], {}
    monkeypatch.setattr(gpu_check, "emit", lines.append)
    monkeypatch.setattr(gpu_check, "SECTION_BUDGETS_S", {"[a] quick": 30.0, "[b] broken": 5.0, "[c] late": 20.0})

    def quick(deadline):
        seen["a"] = deadline - time.monotonic()

    def broken(deadline):
        raise RuntimeError("no kernel")

    start = time.monotonic()
    cells = gpu_check.run_sections(
        [("[a] quick", quick), ("[b] broken", broken), ("[c] late", lambda d: seen.setdefault("c", d))],
        start - 280.0,  # 20 s of a 300 s total left: [a] gets them, not its 30 s
        300.0,
    )
    assert 19.0 < seen["a"] <= 20.0 and seen["c"] <= start + 20.0  # [c] runs, capped at the total's deadline
    assert cells[0].startswith("[a] ") and cells[0].endswith(" s") and len(cells) == 3
    assert any(ln.startswith("[a] quick: ") and "(budget 30 s)" in ln for ln in lines)
    assert "    section FAILED: RuntimeError: no kernel" in lines and any(ln.startswith("[b] broken: ") for ln in lines)
    lines.clear()
    cells = gpu_check.run_sections([("[c] late", lambda d: None)], start - 295.0, 300.0)  # 5 s < 10 s left
    assert cells == ["[c] skipped"] and lines == ["[c] late: skipped (total budget of 300 s reached)"]


def test_the_alarm_stops_a_section_that_overruns_the_total():
    import time

    t0 = time.monotonic()
    with pytest.raises(gpu_check.BudgetExceeded):
        with gpu_check.alarm_at(0.2):
            try:
                while time.monotonic() - t0 < 10:
                    time.sleep(0.01)
            except Exception:  # a section's own handler must not swallow the budget
                pass
    assert time.monotonic() - t0 < 2


def test_the_sync_tolerance_passes_a_bf16_copy_of_the_weights_and_fails_one_with_a_stale_layer(tmp_path):
    """The sync check's tolerance, on the main venv without vLLM: the rollout engine is stood in for by the
    project's BF16 inference copy (every weight and the residual stream in BF16, like vLLM), at Qwen3-0.6B's
    depth (28 layers) and a narrow width. A copy synced after the train step is within the tolerance; one
    with the last layer's pre-step weights is outside it (and inside the worst-case bound, which let it pass)."""
    from fp8rl_core.precision.rollout import convert_for_rollout
    from gpu_check import vllm_cycle
    from stages.engines.weight_transfer import bf16_logprob_tolerance, bf16_sync_tolerance

    model, _ = vllm_cycle._policy(str(tmp_path), vllm_cycle.NARROW_28)
    last = vllm_cycle.NARROW_28["num_hidden_layers"] - 1
    old = {n: p.detach().clone() for n, p in vllm_cycle._layer_params(model, last).items()}
    vllm_cycle._train_step(model, "cpu")
    trainer, exact = vllm_cycle._trainer_logprobs(model, vllm_cycle.FIXED, "cpu")
    tol = bf16_sync_tolerance(trainer, exact)

    def engine_gap() -> float:
        copy = convert_for_rollout(model, "bf16", dtype=torch.bfloat16)
        rows = []
        with torch.no_grad():
            for r in vllm_cycle.FIXED:
                t = torch.tensor([r])
                lp = copy(input_ids=t).logits.float()[0, :-1].log_softmax(-1)
                rows.append(lp.gather(-1, t[0, 1:, None])[:, 0].tolist())
        return vllm_cycle._gap(rows, trainer)

    synced = engine_gap()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in old:
                p.copy_(old[n])
    stale = engine_gap()
    assert 0 < synced <= tol < stale
    assert stale < bf16_logprob_tolerance(1.0, 56)  # the worst-case bound, even at its smallest (max|z| <= 1)


_SECTION_CHILD = r"""
import signal, sys, time
sys.path.insert(0, {root!r})
from gpu_check import main as g
def slow(deadline):  # overruns inside its work: its own alarm stops it
    time.sleep(60)
def stuck(deadline):  # overruns where no alarm reaches it (as a kernel or a compilation that does not return)
    signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGALRM}})
    time.sleep(60)
def quick(deadline):
    print("quick section done", flush=True)
g.SECTIONS.update({{"[a] slow": slow, "[b] stuck": stuck, "[c] quick": quick}})
sys.exit(g.run_one_section(sys.argv[1], float(sys.argv[2])))
"""


@pytest.mark.timeout(60)
def test_each_section_runs_in_its_own_process_and_an_overrun_is_stopped_or_killed_within_the_budget(
    monkeypatch, capfd
):
    """Sections in processes of their own: one overrunning in Python is stopped by its own alarm at its
    deadline, one that the alarm cannot reach is killed a few seconds after it, the next still runs, and the
    whole check returns within its total budget + 10 s."""
    import sys
    import time
    from pathlib import Path

    from gpu_check import section_process

    code = _SECTION_CHILD.format(root=str(Path(__file__).resolve().parents[2]))
    lines = []
    monkeypatch.setattr(gpu_check, "emit", lines.append)
    monkeypatch.setattr(gpu_check, "SECTION_BUDGETS_S", {"[a] slow": 2.0, "[b] stuck": 2.0, "[c] quick": 10.0})

    def child(name):
        def run(deadline):
            argv = [sys.executable, "-c", code, name, f"{deadline - time.monotonic():.1f}"]
            section_process.run_in_process(name, deadline, lines.append, argv=argv)

        return run

    total = 20.0
    start = time.monotonic()
    cells = gpu_check.run_sections([(n, child(n)) for n in gpu_check.SECTION_BUDGETS_S], start, total)
    took = time.monotonic() - start
    assert took <= total + 10.0
    assert "    [a] slow: stopped at its deadline" in lines
    killed = f"    [b] stuck: killed {section_process.GRACE_S:.0f} s after its deadline (its own alarm did not stop it)"
    assert killed in lines
    assert [c.split()[0] for c in cells] == ["[a]", "[b]", "[c]"]
    assert "quick section done" in capfd.readouterr().out
    a, b = (float(c.split()[1]) for c in cells[:2])
    assert a < 2.0 + 2.0 and 2.0 + section_process.GRACE_S - 1 <= b < 2.0 + section_process.GRACE_S + 2.0


def test_an_unknown_section_is_refused_in_one_line(capsys):
    assert gpu_check.main(["--section", "[9] nothing", "--seconds", "1"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "unknown section '[9] nothing'" in out.err


def test_the_train_step_section_names_each_mode_it_skips_or_fails_and_goes_on(monkeypatch):
    import time

    from gpu_check import train_step

    ran, lines = [], []

    def one_mode(emit, mode, device, batch, **kw):
        ran.append(mode)
        if mode == "fp8_rowwise":
            raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(train_step, "_one_mode", one_mode)
    need = dict(train_step.MODES)
    cpu = torch.device("cpu")
    sm90 = need["fp8_blockwise"]
    train_step.run_modes(lines.append, cpu, None, missing=lambda cap: "needs SM90+" if cap == sm90 else None)
    assert ran == ["fp8_tensorwise", "fp8_rowwise"]
    assert "train_step fp8_rowwise: FAILED (RuntimeError: no kernel for this shape)" in lines
    assert "train_step fp8_blockwise: SKIP - needs SM90+" in lines
    assert sum(ln.endswith(" s in all") for ln in lines) == 2  # the failed mode's time is printed too
    lines.clear()
    train_step.run_modes(lines.append, cpu, None, deadline=time.monotonic() - 1)
    assert lines == [f"train_step {m}: skipped (section budget reached)" for m, _ in train_step.MODES]


def test_the_gpu_entry_refuses_unknown_arguments_and_a_missing_torch_in_one_line(capsys, monkeypatch):
    import sys

    assert gpu_check.main(["--fast"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    from gpu_check.settings import USAGE

    assert err == [f"gpu-check: unknown or incomplete argument '--fast'; {USAGE}"]
    lines = []
    monkeypatch.setattr(gpu_check, "emit", lines.append)
    monkeypatch.setattr(gpu_check, "add_paths", lambda: [])
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    assert gpu_check.main([]) == 2
    assert lines == ["gpu-check: torch is not installed; it needs torch >= 2.11, transformers and pyarrow"]


def test_budgets_come_from_flags_and_the_environment_and_a_bad_one_is_one_line(capsys):
    total, budgets = gpu_check.parse_budgets(
        ["--budget", "[4]=120", "--total", "400"], {"GPU_CHECK_BUDGETS": "5=150,[1]=30", "GPU_CHECK_TOTAL_S": "350"},
        gpu_check.TOTAL_BUDGET_S, gpu_check.SECTION_BUDGETS_S,
    )
    assert total == 400.0  # the flag after the variable
    assert budgets["[4] trainer step"] == 120.0 and budgets["[5] vLLM cycle"] == 150.0
    assert budgets["[1] train-step throughput"] == 30.0 and budgets["[2] kernel vs emulation SQNR"] == 25.0
    assert gpu_check.SECTION_BUDGETS_S["[4] trainer step"] == 90.0  # the defaults are not changed
    for bad, needle in ((["--budget", "[9]=3"], "no section [9]"), (["--total", "-1"], "positive"),
                        (["--budget"], "incomplete"), (["--budget", "[4]=soon"], "positive")):
        assert gpu_check.main(bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_a_section_stopped_at_its_deadline_names_the_phase_it_was_in(capsys, monkeypatch):
    from gpu_check.phases import phase
    from gpu_check.section_process import STOPPED_EXIT

    def slow_engine(deadline):
        with phase("import"):
            pass
        with phase("engine start"):
            time.sleep(10)  # an engine that is still loading at the deadline

    monkeypatch.setitem(gpu_check.SECTIONS, "[9] stand-in", slow_engine)
    assert gpu_check.run_one_section("[9] stand-in", 0.5) == STOPPED_EXIT
    out = capsys.readouterr().out
    assert "    phase import: 0.0 s" in out
    assert "[9] stand-in: its 0 s ran out in phase engine start (0." in out, out


def test_the_sync_margin_says_how_close_the_gap_and_the_stale_gaps_are():
    from gpu_check.vllm_cycle import sync_margin

    assert sync_margin(0.01, 0.02, [0.5, 0.3]) == (
        "sync margin: gap 0.0100, tolerance 0.0200 (2.0x the gap), nearest stale gap 0.3000 (15.0x the tolerance)"
    )


def test_the_torch_each_section_needs_is_checked(monkeypatch):
    import torch

    assert gpu_check.blockwise_missing() is None and gpu_check.torch_too_old() is None  # torch 2.13 here

    def scaled_mm(mat_a, mat_b, scale_a, scale_b, bias=None, output_dtype=None):  # an older signature
        raise AssertionError

    monkeypatch.setattr(torch.nn.functional, "scaled_mm", scaled_mm)
    assert "scale_recipe_a" in gpu_check.blockwise_missing()
    monkeypatch.setattr(torch, "__version__", "2.10.1+cu128")
    assert gpu_check.torch_too_old() == "needs torch >= 2.11, this is torch 2.10.1+cu128"
