"""``benchmarks/gpu_only_lines.py``: which statements it takes for CUDA-only, from the syntax alone."""

from __future__ import annotations

import ast
import sys

import pytest

pytestmark = pytest.mark.timeout(30)

SOURCE = """
def step(device, x):
    if device.type != "cuda" or not torch.cuda.is_available():
        return x
    y = kernel(x)
    return y


def sync(nccl_master, weights):
    prepare(weights)
    if nccl_master is None:
        return send_tensors(weights)
    group = nccl_group(nccl_master)
    group.broadcast(weights)


def peak(device):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    else:
        return 0


def plain(x):
    if x > 0:
        return x
    return -x
"""


def _module():
    from benchmarks import gpu_only_lines

    return gpu_only_lines


def test_a_guards_branch_and_the_rest_of_a_block_after_a_negated_early_exit_are_gpu_only(tmp_path):
    g = _module()
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    lines, where = g.gpu_only_lines(path, "m.py")
    text = SOURCE.splitlines()
    got = sorted(text[n - 1].strip() for n in lines)
    assert got == sorted(
        [
            "y = kernel(x)",
            "return y",
            "group = nccl_group(nccl_master)",
            "group.broadcast(weights)",
            "torch.cuda.synchronize()",
            "return torch.cuda.max_memory_allocated()",
        ]
    )
    assert {where[n] for n in lines} == {"step", "sync", "peak"}


def test_negated_tests():
    g = _module()
    neg = [
        'device.type != "cuda"',
        "not torch.cuda.is_available()",
        "nccl_master is None",
        'a != "cuda" or not b',
    ]
    pos = ['device.type == "cuda"', "torch.cuda.is_available()", "nccl_master is not None", 'a != "cuda" and b']
    assert all(g._negative(ast.parse(t, mode="eval").body) for t in neg)
    assert not any(g._negative(ast.parse(t, mode="eval").body) for t in pos)


def test_a_listed_piece_counts_whole_and_without_coverage_the_script_says_how_to_install_it(
    tmp_path, monkeypatch, capsys
):
    g = _module()
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    monkeypatch.setitem(g.CUDA_ONLY, "m.py::plain", "a test's piece")
    lines, where = g.gpu_only_lines(path, "m.py")
    assert {n for n in lines if where[n] == "plain"} == {n for n, w in where.items() if w == "plain"}
    monkeypatch.setitem(sys.modules, "coverage", None)
    assert g.main([]) == 0
    assert capsys.readouterr().out.startswith("gpu_only_lines: SKIP - coverage.py is not installed: ")
