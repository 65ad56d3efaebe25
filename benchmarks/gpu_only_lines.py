"""The code that runs only with CUDA, and how much of it no test executes: a coverage run, by piece.

    .venv/bin/python benchmarks/gpu_only_lines.py [--tests FILE ...] [--json OUT]

1. Runs a subset of the suite (:data:`DEFAULT_TESTS`: the tests that drive the GPU
   paths on CPU, listed below), then the GPU check's vLLM section on vLLM's CPU build in
   ``.venv-vllm`` as ``tests/gpu_check/test_gpu_check_vllm.py`` runs it (that venv needs coverage.py
   too; without it the script says so and counts the section as not executed), under
   coverage.py, subprocesses included
   (``patch = subprocess``: the GPU check's section processes and torchrun),
   single-process, pytest-timeout off (the tracer slows everything), with no
   exclusion: ``# pragma: no cover`` hides nothing.
   Forked ranks are measured too (``patch = _exit, fork``); a process killed
   by a signal (a section past its deadline) leaves no data.
2. Finds the GPU-only statements of ``fp8rl_core``, ``stages``, ``flows``,
   ``storage`` and ``gpu_check`` from their syntax: the branch of an ``if`` whose
   test names CUDA, NCCL, CUDA IPC or a device capability (``if
   torch.cuda.is_available():`` its body; ``if device.type != "cuda": return``
   the rest of its block), and the pieces listed in :data:`CUDA_ONLY`, whose
   guard is indirect (a flag resolved from the device, a transport's name, a
   section of the GPU check).
3. Prints, by piece (module and function), the GPU-only statements and those
   no test executed, and their total.

A count of statements as coverage.py counts them (one per logical line). Needs
coverage.py; without it the script says how to install it and exits 0.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("fp8rl_core", "stages", "flows", "storage", "gpu_check")
# The tests that drive GPU paths on the CPU: the GPU check and its rehearsal, torchao's float8 modules under
# FSDP2, the FP8 backends and device discipline, block compilation, the weight transfer and vLLM's stand-ins.
DEFAULT_TESTS = (
    "tests/gpu_check/test_gpu_check.py",
    "tests/gpu_check/test_gpu_check_cpu.py",
    "tests/stages/trainer/test_torchao_fsdp.py",
    "tests/stages/trainer/test_gradient_lifetime.py",
    "tests/stages/engines/test_native_fp8.py",
    "tests/fp8rl_core/host/test_device_discipline.py",
    "tests/stages/trainer/test_block_compile.py",
    "tests/stages/engines/test_weight_stream.py",
    "tests/stages/engines/test_vllm_standin.py",
    "tests/stages/engines/test_http_engine.py",
    "tests/flows/plan/test_cuda_queries.py",
    "tests/stages/engines/test_nccl_transport.py",
    "tests/stages/engines/test_vllm_separate.py",
    "tests/flows/plan/test_plan_split.py",
)
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"  # where gpu_check/vllm_cycle.py runs on vLLM's CPU build
GUARD = re.compile(r"cuda|nccl|\bipc\b|get_device_capability|is_sm_at_least")
# Pieces that run only with CUDA although no `if` names it: "path" (the whole module) or "path::Qual.name"
CUDA_ONLY = {
    "fp8rl_core/precision/conversion.py::_train_blockwise": "torchao's blockwise prototype: Triton kernels, SM90",
    "stages/trainer/distributed.py::enable_float8_all_gather": "float8 all-gather of FSDP2 (tensorwise on CUDA)",
    "stages/trainer/distributed.py::after_optimizer_step": "float8 scale precomputation for FSDP2",
    "stages/engines/vllm_sync.py::IpcTransport": "CUDA IPC handles of the trainer's GPU tensors",
    "stages/engines/vllm_sync.py::NcclTransport": "NCCL broadcast to an engine's GPU workers",
    "stages/engines/nccl_sync.py": "vLLM's NCCL weight transfer (on CPU: a gloo stand-in of its communicator)",
    "stages/engines/weight_transfer.py::cuda_ipc_handle": "CUDA IPC",
    "stages/engines/weight_transfer.py::current_gpu_uuid": "CUDA IPC",
    "stages/engines/weight_transfer.py::ipc_update_info": "CUDA IPC",
    "gpu_check/sections.py::time_train_step": "GPU check section 1",
    "gpu_check/sections.py::section_throughput": "GPU check section 1",
    "gpu_check/sections.py::section_sqnr": "GPU check section 2",
    "gpu_check/sections.py::section_rollout": "GPU check section 3",
    "gpu_check/sections.py::section_train_step": "GPU check section 4",
    "gpu_check/sections.py::section_vllm": "GPU check section 5",
    "gpu_check/main.py::main": "GPU check entry",
    "gpu_check/train_step.py": "GPU check section 4",
    "gpu_check/vllm_cycle.py": "GPU check section 5",
    "gpu_check/rollout_kernels.py": "GPU check section 3",
}
EXITS = (ast.Return, ast.Raise, ast.Continue, ast.Break)


def install_hint() -> str:
    return f"coverage.py is not installed: `{sys.executable} -m pip install coverage` (7.10 or newer), then rerun"


def _negative(test: ast.expr) -> bool:
    """Whether ``test`` holds where CUDA is absent (``not cuda``, ``!= "cuda"``, ``nccl is None``)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return True
    if isinstance(test, ast.Compare):
        ops = test.ops
        is_none = [
            isinstance(o, ast.Is) and isinstance(c, ast.Constant) and c.value is None
            for o, c in zip(ops, test.comparators)
        ]
        return all(isinstance(o, (ast.NotEq, ast.NotIn)) or n for o, n in zip(ops, is_none))
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        return all(_negative(v) for v in test.values)
    return False


def _span(stmts: list[ast.stmt]) -> set[int]:
    return {n for s in stmts for n in range(s.lineno, (s.end_lineno or s.lineno) + 1)}


def _guarded(body: list[ast.stmt], source: str, out: set[int]) -> None:
    """Add to ``out`` the lines of ``body`` (a block, searched recursively) that run only with CUDA."""
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.If) and GUARD.search(ast.get_source_segment(source, stmt.test) or ""):
            if not _negative(stmt.test):
                out |= _span(stmt.body)
            else:
                out |= _span(stmt.orelse)
                if stmt.body and isinstance(stmt.body[-1], EXITS):
                    out |= _span(body[i + 1 :])
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(stmt, field, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], (ast.stmt, ast.excepthandler)):
                _guarded(inner, source, out)


def _pieces(tree: ast.Module) -> dict[int, str]:
    """Line -> the qualified name of the innermost function or class around it ("<module>" outside)."""
    where: dict[int, str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}" if prefix else child.name
                for n in range(child.lineno, (child.end_lineno or child.lineno) + 1):
                    where[n] = name
                visit(child, name)
            else:
                visit(child, prefix)

    visit(tree, "")
    return where


def gpu_only_lines(path: Path, rel: str) -> tuple[set[int], dict[int, str]]:
    """The GPU-only lines of one module and the piece of each line."""
    source = path.read_text()
    tree = ast.parse(source)
    where = _pieces(tree)
    lines: set[int] = set()
    _guarded(tree.body, source, lines)
    for piece in CUDA_ONLY:
        file, _, qual = piece.partition("::")
        if file == rel:
            total = len(source.splitlines())
            lines |= {n for n in range(1, total + 1) if not qual or where.get(n, "").startswith(qual)}
    return lines, where


def run_suite(tests: list[str], work: Path) -> tuple[Path, int]:
    """The tests under coverage (subprocesses included); returns the rc file and pytest's exit status."""
    rc = work / "coveragerc"
    sources = ", ".join(str(ROOT / s) for s in SOURCES)
    rc.write_text(
        f"[run]\nparallel = True\npatch = _exit, fork, subprocess\nsource = {sources}\n"
        f"data_file = {work / '.coverage'}\n"
    )
    env = dict(os.environ, FP8RL_MAX_THREADS="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable,
        "-m",
        "coverage",
        "run",
        f"--rcfile={rc}",
        "-m",
        "pytest",
        *tests,
        "-q",
        "-p",
        "no:randomly",
        "-p",
        "no:timeout",
        "-n",
        "0",
        "-o",
        "addopts=",
    ]
    status = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    print(f"gpu_only_lines: {run_vllm_section(rc, work, env)}")
    subprocess.run([sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}", "-q"], cwd=ROOT, env=env)
    return rc, status


def run_vllm_section(rc: Path, work: Path, env: dict) -> str:
    """The GPU check's vLLM section as ``tests/gpu_check/test_gpu_check_vllm.py`` runs it (vLLM's CPU build, the
    28-layer narrow Qwen3), under coverage in the vLLM venv, into the same data; returns what happened."""
    if not VLLM_PY.exists():
        return "no .venv-vllm (`make venv-vllm`): gpu_check/vllm_cycle.py is counted as not executed"
    if subprocess.run([str(VLLM_PY), "-c", "import coverage"], capture_output=True).returncode:
        return f"the vLLM venv has no coverage.py (`{VLLM_PY} -m pip install coverage`): vllm_cycle.py not measured"
    env = dict(env, PYTHONPATH=str(ROOT), VLLM_CPU_OMP_THREADS_BIND="nobind")
    cmd = [str(VLLM_PY), "-m", "coverage", "run", f"--rcfile={rc}", "gpu_check/vllm_cycle.py", "--cpu"]
    proc = subprocess.run([*cmd, "--json", str(work / "vllm_cycle.json")], cwd=ROOT, env=env)
    return f"gpu_check/vllm_cycle.py --cpu in the vLLM venv, exit status {proc.returncode}"


def count(rc: Path) -> list[dict]:
    """Per piece: GPU-only statements and the ones no test executed (no exclusion applied)."""
    import coverage

    cov = coverage.Coverage(config_file=str(rc))
    cov.load()
    cov.clear_exclude()
    rows: dict[tuple[str, str], dict] = defaultdict(lambda: {"statements": 0, "unexecuted": 0, "lines": []})
    for package in SOURCES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            gpu, where = gpu_only_lines(path, rel)
            if not gpu:
                continue
            _, statements, _, missing, _ = cov.analysis2(str(path))
            missing = set(missing)
            for n in sorted(gpu & set(statements)):
                row = rows[(rel, where.get(n, "<module>"))]
                row["statements"] += 1
                if n in missing:
                    row["unexecuted"] += 1
                    row["lines"].append(n)
    return [{"module": m, "piece": p, **r} for (m, p), r in sorted(rows.items())]


def table(rows: list[dict]) -> str:
    out = ["| module | piece | GPU-only statements | executed by no test |", "|---|---|---:|---:|"]
    for r in sorted(rows, key=lambda r: (-r["unexecuted"], r["module"], r["piece"])):
        out.append(f"| {r['module']} | {r['piece']} | {r['statements']} | {r['unexecuted']} |")
    total = sum(r["statements"] for r in rows), sum(r["unexecuted"] for r in rows)
    out.append(f"| **total** | | {total[0]} | {total[1]} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/gpu_only_lines.py", description=__doc__.splitlines()[0])
    ap.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS), help="test files to run under coverage")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--keep", default=None, help="a folder for the coverage data (default: a temporary one)")
    args = ap.parse_args(argv)
    try:
        import coverage
    except ImportError:
        print(f"gpu_only_lines: SKIP - {install_hint()}")
        return 0
    if tuple(int(x) for x in coverage.__version__.split(".")[:2]) < (7, 10):
        print(f"gpu_only_lines: SKIP - coverage {coverage.__version__} cannot follow subprocesses; {install_hint()}")
        return 0
    work = Path(args.keep or tempfile.mkdtemp(prefix="fp8rl-gpu-only-"))
    work.mkdir(parents=True, exist_ok=True)
    rc, status = run_suite(args.tests, work)
    rows = count(rc)
    print(table(rows))
    print(f"tests: {' '.join(args.tests)} (pytest exit status {status}); coverage data in {work}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
