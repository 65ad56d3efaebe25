"""Which linears of a converted policy train in FP8 and which stay in BF16, and why.

``convert_for_training`` converts every decoder linear the kernel can take and
keeps the rest in high precision: the output embedding (lm_head) and the
embeddings always (docs/method.md, "Precision modes"), and any linear whose shape or bias the
kernel rejects (``torch._scaled_mm`` needs dims divisible by 16; torchao's
blockwise kernels need multiples of 128 and take no bias, so Qwen2.5's biased
q/k/v projections stay BF16 under ``fp8_blockwise``). A "full FP8" run is then
partly BF16; :func:`layer_precision` says how much, by parameter count, and
:func:`precision_line` says it in one line (the run's console, ``run.json``,
``fp8rl plan``).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def layer_precision(model: nn.Module, report: Any) -> dict:
    """JSON-ready summary of ``report`` (a ``ConversionReport``) on ``model``.

    Keys: ``mode``, ``backend``, ``fp8_linears`` (count), ``fp8_params``,
    ``bf16_linears`` (count), ``bf16_params``, ``fp8_share`` (of the decoder
    linears' weights), ``kept_bf16`` (one entry per reason: its layer-name
    patterns, count and parameters) and ``high_precision`` (output embedding names).
    """

    def numel(name: str) -> int:
        return sum(p.numel() for p in model.get_submodule(name).parameters(recurse=False))

    groups: dict[str, dict] = {}  # by reason
    for name, why in report.skipped:
        g = groups.setdefault(why, {"layers": [], "count": 0, "params": 0, "reason": why})
        if _pattern(name) not in g["layers"]:
            g["layers"].append(_pattern(name))
        g["count"] += 1
        g["params"] += numel(name)
    fp8 = sum(numel(n) for n in report.converted)
    bf16 = sum(g["params"] for g in groups.values())
    return {
        "mode": report.mode,
        "backend": report.backend,
        "fp8_linears": len(report.converted),
        "fp8_params": fp8,
        "bf16_linears": len(report.skipped),
        "bf16_params": bf16,
        "fp8_share": fp8 / (fp8 + bf16) if fp8 + bf16 else 0.0,
        "kept_bf16": list(groups.values()),
        "high_precision": list(report.kept_high_precision),
    }


def compile_note(summary: dict) -> str:
    """``; decoder blocks compiled|eager (...)`` when the summary records the run's compile choice
    (``stages.trainer.block_compile.CompileChoice.as_dict``), else nothing."""
    c = summary.get("compile")
    if not c:
        return ""
    how = "torch.compile per block" if c["enabled"] else "eager"
    return f"; decoder blocks {how} (precision.compile {c['setting']}: {c['reason']})"


def precision_line(summary: dict) -> str:
    """One line: FP8 and BF16 linears, with the reason each BF16 group stays in BF16, and whether the
    decoder blocks run compiled."""
    return _linears_line(summary) + compile_note(summary)


def _linears_line(summary: dict) -> str:
    mode = summary["mode"]
    fmt = mode.split("_")[0].upper() if "fp4" in mode else "FP8"  # nvfp4 -> NVFP4, mxfp4 -> MXFP4
    head = (
        f"precision {mode} ({summary['backend']}): {summary['fp8_linears']} linears in {fmt} "
        f"({100 * summary['fp8_share']:.1f}% of decoder-linear weights)"
    )
    if summary["mode"] == "bf16":
        return f"precision bf16: every linear in BF16; high precision: {', '.join(summary['high_precision']) or '-'}"
    kept = "; ".join(f"{g['count']} ({', '.join(g['layers'])}): {g['reason']}" for g in summary["kept_bf16"])
    tail = f"; kept BF16: {kept}" if kept else "; no decoder linear kept in BF16"
    return f"{head}{tail}; high precision: {', '.join(summary['high_precision']) or '-'} (output embedding, by design)"


__all__ = ["compile_note", "layer_precision", "precision_line"]
