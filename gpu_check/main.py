"""The project's one GPU check: ``make gpu-check`` (``python gpu_check/main.py``), <= 5 min on one H200.

Needs only torch >= 2.11, transformers and pyarrow installed, no network.
torchao travels beside this file as a wheel in ``gpu_check/wheels/``
(``make gpu-check-wheels`` fetches ``torchao==0.18.0``; the wheel is a zip put
on ``sys.path``, so its pure-Python float8 code imports without installing; its
compiled extras are optional and torchao runs without them). vLLM is not
assumed. The project's ``fp8rl_core`` (pure torch) comes from this checkout.

It prints (eagerly, but for section 4's tensorwise and rowwise steps, which run
compiled as ``precision.compile: auto`` runs them on CUDA):

1. **Train-step throughput**: forward + backward time of N decoder layers of
   Qwen3-8B, Qwen3-14B and Qwen2.5-32B (shapes from their published configs,
   random weights, fp32 masters under BF16 autocast as the trainer runs them),
   at 8K and 16K tokens, with torchao float8 tensorwise / rowwise and torchao's
   blockwise prototype, each as ``time(bf16) / time(fp8)`` (the paper's figure:
   tensorwise up to 1.5x BF16, blockwise +10-20%).
2. **Real kernel vs CPU emulation**: one forward of a Qwen3-8B layer with
   torchao's real FP8 kernels on the GPU and with ``fp8rl_core``'s emulation on
   the CPU, same weights and input; SQNR in dB of each against the other and
   against BF16.
3. **Rollout numerics**: teacher-forced log-probs of a Qwen3-8B-shaped policy
   (2 layers) in BF16, with torchao's real FP8 inference kernels
   (``Float8DynamicActivationFloat8WeightConfig``, per-tensor and per-row), with
   vLLM's ``fp8_per_tensor`` scheme on the real FP8 GEMM
   (``gpu_check/rollout_kernels.py``: ``torch._scaled_mm``, per-token
   activation scales, one fused weight scale) and with our emulation of it —
   mean |delta log-prob| against BF16, and real kernel vs emulation.
4. The sharded trainer's step (``gpu_check/train_step.py``, ``run(emit)``),
   where that module exists.
5. **vLLM cycle** (``gpu_check/vllm_cycle.py``), only where ``import vllm``
   succeeds (else one ``SKIP`` line with the reason): one colocated rollout ->
   train -> sync -> rollout cycle on a random-init Qwen3 of 0.6B's shapes,
   checking that the synced engine's log-probs match the trainer's.

Time: the whole check is budgeted at :data:`TOTAL_BUDGET_S` (5 minutes) and each
section at its share (:data:`SECTION_BUDGETS_S`, which leave 15 s for start-up and
imports). Every section runs in a process of its own
(``gpu_check/section_process.py``) with an alarm at its deadline inside its work,
and is killed a few seconds after it if still running, so the whole check returns
within its total budget plus those few seconds, and a CUDA error or a half-built
engine ends with its section. A section that loops also stops between items at its
deadline (the rest printed as skipped); a later section starts only with its
budget's time left. Each section's wall time and the total are printed. The
sections that run torchao's blockwise Triton kernels first bound their autotuning
(``gpu_check/autotune_bound.py``). The budget has not been checked on a GPU (as
of 2026-12-03: nothing here has run on one).

What each section measures is in ``gpu_check/sections.py``; this module runs them under their budgets.

On a machine without CUDA it prints one line saying so and exits 0. ``--cpu``
runs every section's code on the CPU, a rehearsal (``gpu_check/cpu_mode.py``).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script (``python gpu_check/main.py``): this checkout first
    sys.path.insert(0, str(ROOT))

from gpu_check.sections import (  # noqa: E402
    emit,
    section_rollout,
    section_sqnr,
    section_throughput,
    section_train_step,
    section_vllm,
)
from gpu_check.settings import blockwise_missing, parse_budgets, torch_too_old  # noqa: E402

TOTAL_BUDGET_S = 300.0  # the whole check, start-up included: an alarm stops the running section here
# Each section's share, in order; their sum leaves 15 s of the total for start-up and imports.
SECTION_BUDGETS_S = {
    "[1] train-step throughput": 60.0,
    "[2] kernel vs emulation SQNR": 25.0,
    "[3] rollout numerics": 20.0,
    "[4] trainer step": 90.0,
    "[5] vLLM cycle": 90.0,
}


class BudgetExceeded(BaseException):
    """Raised in the main thread by the alarm at :data:`TOTAL_BUDGET_S` (a ``BaseException``: the
    sections' ``except Exception`` around one failing cell must not swallow it)."""


def add_paths() -> list[str]:
    """Put the carried wheels and this checkout on ``sys.path``; returns the wheels found."""
    wheels = sorted(str(w) for w in (HERE / "wheels").glob("*.whl"))
    for entry in [str(ROOT), *wheels]:
        if entry not in sys.path:
            sys.path.insert(0, entry)
    return wheels


def run_sections(
    sections: list[tuple[str, Callable[[float], None]]],
    start: float,
    total_s: float,
    budgets: dict[str, float] | None = None,
) -> list[str]:
    """Run ``(name, fn(deadline))`` in order under the budgets; returns one ``name seconds`` cell per section.

    A section's deadline is its share of ``budgets`` (:data:`SECTION_BUDGETS_S`) from when it starts, capped at the
    total's; a section whose share no longer fits in what is left of the total is skipped. An
    exception (a :class:`BudgetExceeded` included) ends that section with one line.
    """
    total_deadline = start + total_s
    budgets = SECTION_BUDGETS_S if budgets is None else budgets
    cells = []
    for name, fn in sections:
        began = time.monotonic()
        share = budgets.get(name, 30.0)
        if total_deadline - began < min(share, 10.0):
            emit(f"{name}: skipped (total budget of {total_s:.0f} s reached)")
            cells.append(f"{name.split()[0]} skipped")
            continue
        try:
            fn(min(began + share, total_deadline))
        except BudgetExceeded:
            emit(f"    {name}: stopped at the total budget of {total_s:.0f} s")
        except Exception as err:  # one failing section must not hide the others
            emit(f"    section FAILED: {type(err).__name__}: {str(err)[:200]}")
        took = time.monotonic() - began
        emit(f"{name}: {took:.1f} s (budget {share:.0f} s)")
        cells.append(f"{name.split()[0]} {took:.0f} s")
    return cells


@contextlib.contextmanager
def alarm_at(seconds: float) -> Iterator[None]:
    """Raise :class:`BudgetExceeded` in the main thread after ``seconds`` (SIGALRM; none where it is missing)."""
    if not hasattr(signal, "SIGALRM") or seconds <= 0:
        yield
        return

    def ring(signum, frame):
        raise BudgetExceeded()

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


SECTIONS: dict[str, Callable[[float], None]] = {}  # name -> fn(deadline), filled below
AUTOTUNED = ("[1]", "[2]", "[4]")  # the sections that run torchao's blockwise Triton kernels


def run_one_section(name: str, seconds: float, cpu: bool = False) -> int:
    """The child's side: section ``name`` (its CPU rehearsal when ``cpu``) under an alarm at ``seconds`` from
    now (exit status 3 when it rang)."""
    add_paths()
    from gpu_check.section_process import STOPPED_EXIT

    if cpu:
        from gpu_check.cpu_mode import cpu_sections

        sections = cpu_sections(section_throughput, section_sqnr, section_rollout)
    else:
        sections = SECTIONS
    if name not in sections:
        print(f"gpu-check: unknown section {name!r}; valid: {', '.join(sections)}", file=sys.stderr)
        return 2
    from gpu_check import phases

    phases.reset()
    deadline = time.monotonic() + seconds
    with alarm_at(seconds):
        try:
            if cpu:
                from gpu_check.cpu_mode import strict_shapes

                strict_shapes()  # the shapes the GPU's kernels refuse are refused here too
            if name.split()[0] in AUTOTUNED:
                from gpu_check.autotune_bound import bound_blockwise_autotune

                emit("    " + bound_blockwise_autotune())
            sections[name](deadline)
        except BudgetExceeded:
            emit(f"    {name}: {_where_stopped(phases.stopped_in(), seconds)}")
            return STOPPED_EXIT
        except Exception as err:
            if time.monotonic() < deadline:
                raise
            # the alarm rang inside code that turned it into another error (an import half done, say)
            emit(f"    {name}: interrupted at its deadline ({type(err).__name__}: {str(err)[:100]}); "
                 + _where_stopped(phases.stopped_in(), seconds))
            return STOPPED_EXIT
    return 0


def _where_stopped(where: tuple[str, float] | None, seconds: float) -> str:
    if where is None:
        return f"its {seconds:.0f} s ran out outside every phase"
    return f"its {seconds:.0f} s ran out in phase {where[0]} ({where[1]:.1f} s into it)"


def in_own_process(name: str, cpu: bool = False, status: dict | None = None) -> Callable[[float], None]:
    """``fn(deadline)`` running section ``name`` in a process of its own (``gpu_check.section_process``);
    its exit status (None: killed) goes in ``status[name]``."""
    from gpu_check.section_process import run_in_process, section_argv

    def run(deadline: float) -> None:
        seconds = max(deadline - time.monotonic(), 0.0)
        rc = run_in_process(name, deadline, emit, argv=section_argv(name, seconds, cpu=cpu))
        if status is not None:
            status[name] = rc

    return run


def run_all(start: float, total_s: float, budgets: dict[str, float], *, cpu: bool = False) -> dict:
    """Every section of ``budgets`` in its own process under the total's alarm, then the total's line;
    returns each section's exit status (None: killed; absent: skipped or not reached)."""
    status: dict = {}
    sections = [(name, in_own_process(name, cpu=cpu, status=status)) for name in budgets]
    with alarm_at(start + total_s - time.monotonic()):
        try:
            cells = run_sections(sections, start, total_s, budgets)
        except BudgetExceeded:  # between two sections' bookkeeping
            cells = ["stopped at the total budget"]
    tail = "; a CPU rehearsal of the code paths, not GPU figures" if cpu else ""
    label = "gpu-check --cpu" if cpu else "gpu-check"
    emit(f"{label}: total {time.monotonic() - start:.0f} s (budget {total_s:.0f} s): " + ", ".join(cells) + tail)
    return status


def rehearse(total_s: float | None = None, budgets: dict[str, float] | None = None) -> int:
    """``--cpu``: every section's CPU rehearsal in its own process (``gpu_check/cpu_mode.py``); exit status 0
    when every section ran to its end."""
    start = time.monotonic()
    add_paths()
    from gpu_check.cpu_mode import CPU_SECTION_BUDGETS_S, CPU_TOTAL_BUDGET_S, HEADER, rehearsal_status

    budgets = budgets or CPU_SECTION_BUDGETS_S
    emit(HEADER)
    status = run_all(start, total_s or CPU_TOTAL_BUDGET_S, budgets, cpu=True)
    return rehearsal_status(status, budgets)


def main(argv: list[str] | None = None) -> int:
    import os

    argv = list(argv or [])
    cpu = "--cpu" in argv
    argv = [a for a in argv if a != "--cpu"]
    if argv[:1] == ["--section"] and len(argv) == 4 and argv[2] == "--seconds":
        return run_one_section(argv[1], float(argv[3]), cpu=cpu)
    if cpu:
        add_paths()
        from gpu_check.cpu_mode import CPU_SECTION_BUDGETS_S, CPU_TOTAL_BUDGET_S

        try:
            total_s, budgets = parse_budgets(argv, dict(os.environ), CPU_TOTAL_BUDGET_S, CPU_SECTION_BUDGETS_S)
        except ValueError as err:
            print(f"gpu-check: {err}", file=sys.stderr)
            return 2
        return rehearse(total_s, budgets)
    try:
        total_s, budgets = parse_budgets(argv, dict(os.environ), TOTAL_BUDGET_S, SECTION_BUDGETS_S)
    except ValueError as err:
        print(f"gpu-check: {err}", file=sys.stderr)
        return 2
    start = time.monotonic()
    wheels = add_paths()
    try:
        import torch
    except ImportError:
        emit("gpu-check: torch is not installed; it needs torch >= 2.11, transformers and pyarrow")
        return 2
    if not torch.cuda.is_available():
        emit(
            f"gpu-check: no CUDA device (torch {torch.__version__}); nothing measured. Run `make gpu-check` on a "
            f"GPU machine."
        )
        return 0
    old_torch = torch_too_old()
    if old_torch:
        emit(f"gpu-check: SKIP - {old_torch}; nothing measured")
        return 2
    try:
        import torchao

        ao = f"torchao {torchao.__version__}"
    except ImportError:
        ao = "torchao MISSING (run `make gpu-check-wheels`)"
    name = torch.cuda.get_device_name()
    emit(
        f"gpu-check: {name}, CUDA capability {torch.cuda.get_device_capability()}, torch {torch.__version__}, {ao}, "
        f"wheels: {[Path(w).name for w in wheels] or 'none'}"
    )
    lacking = blockwise_missing()
    shares = ", ".join(f"{n.split()[0]} {b:.0f} s" for n, b in budgets.items())
    blockwise = f"; fp8_blockwise skips: {lacking}" if lacking else ""
    emit(f"gpu-check: budgets {total_s:.0f} s in all, {shares}{blockwise}")
    run_all(start, total_s, budgets)
    return 0


SECTIONS.update(
    zip(
        SECTION_BUDGETS_S,
        (section_throughput, section_sqnr, lambda deadline: section_rollout(), section_train_step, section_vllm),
    )
)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
