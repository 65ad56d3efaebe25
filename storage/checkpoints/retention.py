"""Checkpoint retention: keep the last k complete checkpoints and the best one, delete the rest, say so.

Unlike table parts, old checkpoints are large and reproducible from the
ledger, so :func:`apply_retention` deletes them; each deletion is recorded
first in ``checkpoints/pruned.jsonl`` (:func:`pruned_checkpoints`), so
``fp8rl doctor`` can tell a pruned checkpoint from a lost one.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path

from storage.checkpoints.format import STATE
from storage.checkpoints.verify import list_checkpoints, verify_checkpoint
from storage.run.layout import RunLayout


def apply_retention(
    run_dir: str | Path, *, keep_last: int, best_metric: str | None = None, higher_is_better: bool = True
) -> list[Path]:
    """Delete complete checkpoints except the last ``keep_last`` and the best by ``best_metric``.

    The best is read from each checkpoint's ``state.json`` metrics; ones
    without the metric never count as best. Incomplete folders are left for
    ``fp8rl doctor`` to report. Returns the deleted folders.
    """
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, got {keep_last}")
    complete = [(s, p) for s, p in list_checkpoints(run_dir) if not verify_checkpoint(p, hashes=False)]
    keep = (
        {p for _, p in complete[max(0, len(complete) - keep_last) :]} if keep_last else set()
    )  # fewer than keep_last: keep all
    if best_metric is not None:
        scored = []
        for s, p in complete:
            value = json.loads((p / STATE).read_text()).get("metrics", {}).get(best_metric)
            if isinstance(value, (int, float)) and value == value:
                scored.append((value if higher_is_better else -value, s, p))
        if scored:
            keep.add(max(scored)[2])
    removed = []
    for s, p in complete:
        if p not in keep:
            record_pruned(run_dir, s, p)  # first: a crash between the two leaves a record, not a mystery
            shutil.rmtree(p)
            removed.append(p)
    return removed


PRUNED_FILE = "pruned.jsonl"


def record_pruned(run_dir: str | Path, step: int, path: Path) -> None:
    """Append to ``checkpoints/pruned.jsonl`` that retention deletes the checkpoint of ``step``."""
    layout = RunLayout(Path(run_dir))
    rec = {
        "step": int(step),
        "path": layout.relative(path),
        "reason": "retention",
        "pruned_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    with open(layout.checkpoints / PRUNED_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def pruned_checkpoints(run_dir: str | Path) -> dict[str, dict]:
    """The checkpoints retention deleted: relative path -> record (a torn last line is ignored)."""
    path = RunLayout(Path(run_dir)).checkpoints / PRUNED_FILE
    out: dict[str, dict] = {}
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
            out[rec["path"]] = rec
        except (ValueError, KeyError, TypeError):
            continue
    return out
