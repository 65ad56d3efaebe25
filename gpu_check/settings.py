"""The GPU check's settings and the torch it needs: pure Python, read before any section runs.

* :func:`parse_budgets`: the total and per-section budgets from ``--total S`` / ``--budget [4]=S`` and the
  ``GPU_CHECK_TOTAL_S`` / ``GPU_CHECK_BUDGETS`` variables, so a rerun can give a slow phase more time;
* :func:`torch_too_old` and :func:`blockwise_missing`: the torch every section needs, and the
  ``F.scaled_mm`` signature torchao's blockwise GEMM calls.
"""

from __future__ import annotations

NEEDS_TORCH = (2, 11)  # every section: torchao 0.18's float8 training and ``torch._scaled_mm``


def torch_too_old() -> str | None:
    """Why this torch cannot run the check (older than :data:`NEEDS_TORCH`), or None."""
    import torch

    have = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    need = ".".join(map(str, NEEDS_TORCH))
    return None if have >= NEEDS_TORCH else f"needs torch >= {need}, this is torch {torch.__version__}"


def blockwise_missing() -> str | None:
    """Why torchao's blockwise GEMM cannot run on this torch, or None: it calls
    ``F.scaled_mm(..., scale_recipe_a=...)``, a signature of torch 2.13."""
    import inspect

    import torch

    fn = getattr(torch.nn.functional, "scaled_mm", None)
    if fn is not None and "scale_recipe_a" in inspect.signature(fn).parameters:
        return None
    return f"torchao's blockwise GEMM calls F.scaled_mm(..., scale_recipe_a=...), which torch {torch.__version__} lacks"


USAGE = "usage: gpu_check/main.py [--cpu] [--total SECONDS] [--budget SECTION=SECONDS ...]"


def parse_budgets(
    argv: list[str], environ: dict[str, str], total_s: float, budgets: dict[str, float]
) -> tuple[float, dict[str, float]]:
    """The total and the sections' budgets from ``--total S`` / ``--budget [4]=S`` (repeatable; ``4=S`` too)
    and the ``GPU_CHECK_TOTAL_S`` / ``GPU_CHECK_BUDGETS`` ("[4]=120,[5]=150") variables, flags last; a
    budget of a section that does not exist, or not a positive number, raises ``ValueError`` in one line."""
    budgets = dict(budgets)
    items = [("--total", environ["GPU_CHECK_TOTAL_S"])] if environ.get("GPU_CHECK_TOTAL_S") else []
    items += [("--budget", b) for b in environ.get("GPU_CHECK_BUDGETS", "").split(",") if b.strip()]
    args = list(argv)
    while args:
        flag = args.pop(0)
        if flag not in ("--total", "--budget") or not args:
            raise ValueError(f"unknown or incomplete argument {flag!r}; {USAGE}")
        items.append((flag, args.pop(0)))
    for flag, value in items:
        key, _, seconds = value.partition("=") if flag == "--budget" else ("", "", value)
        try:
            secs = float(seconds)
        except ValueError:
            secs = -1.0
        if not secs > 0:
            raise ValueError(f"{flag} {value}: seconds must be a positive number")
        if flag == "--total":
            total_s = secs
            continue
        tag = key.strip() if key.strip().startswith("[") else f"[{key.strip()}]"
        names = [n for n in budgets if n.split()[0] == tag]
        if not names:
            raise ValueError(f"--budget {value}: no section {tag}; sections: {', '.join(budgets)}")
        budgets[names[0]] = secs
    return total_s, budgets
