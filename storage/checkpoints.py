"""Checkpoints: everything needed to continue a campaign bit-for-bit from a step.

``checkpoints/step_<n>/`` holds::

    model/            model.save_pretrained (safetensors + config.json) and the
                      tokenizer if given: ``AutoModelForCausalLM.from_pretrained(model/)`` loads it
    optimizer.pt      optimizer.state_dict() (torch.save; loaded with weights_only=True)
    rng.json          python, numpy (legacy global) and torch (CPU, CUDA) RNG states
    state.json        step, sampler position, calibrator state, config, metrics, extra
    manifest.json     every other file's size and sha256, and those of the sharded
                      (DCP) model + optimizer state it names; written last

The sharded state of a checkpoint (``torch.distributed.checkpoint``) lives in
``checkpoints/.dcp/step_<n>/``, written by every rank into a temporary
``.dcp/.tmp-step_<n>-<hex>/`` folder through :class:`HashingStream` (sizes and
hashes are computed as the bytes are written) and renamed into place together
with the checkpoint folder, so a half-written DCP folder is never part of a
complete checkpoint. The manifest lists its files under ``"dcp"``.

Atomicity: everything is written into ``checkpoints/.tmp-step_<n>-<hex>/``,
fsynced, and the folder renamed to ``step_<n>``. A checkpoint is *complete* iff
its folder has that name and its manifest verifies (every file it lists, the
DCP shards included, present with its size; and, where hashes are checked, its
sha256); ``latest_complete`` skips any other (half-written, truncated,
bit-rotted) and :func:`set_aside_broken` moves those newer than the newest
complete one under ``superseded/``. Re-checkpointing a step sets the old
folder aside under ``superseded/``.

Retention (``apply_retention``) keeps the last k complete checkpoints plus the
best one by a metric recorded in ``state.json``, and deletes the rest: unlike
table parts, old checkpoints are large and reproducible from the ledger.

torch is imported inside the functions that need it so that the catalog and
``fp8rl doctor`` stay quick to start.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from storage.errors import CheckpointError
from storage.layout import RunLayout

MANIFEST, STATE, RNG, OPTIMIZER, MODEL_DIR = "manifest.json", "state.json", "rng.json", "optimizer.pt", "model"
DCP_DIR = ".dcp"
DCP_METADATA = ".metadata"
CHECKPOINT_FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class HashingStream:
    """A binary file opened for writing whose size and sha256 are computed as it is written.

    Writes are sequential (``seek`` is refused); ``on_close(size, sha256)`` is
    called once, when the file is closed without an error.
    """

    def __init__(self, raw: Any, on_close: Callable[[int, str], None]) -> None:
        self.raw, self._on_close = raw, on_close
        self._hash, self.size, self.closed = hashlib.sha256(), 0, False

    def write(self, data: Any) -> int:
        n = self.raw.write(data)
        view = memoryview(data).cast("B")
        n = view.nbytes if n is None else n
        self._hash.update(view[:n])
        self.size += n
        return n

    def tell(self) -> int:
        return self.size

    def seek(self, *_: Any) -> int:
        raise OSError("a hashing stream is written front to back; seek is not supported")

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.raw.close()
            self._on_close(self.size, self._hash.hexdigest())

    def __enter__(self) -> "HashingStream":
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            self.close()
        else:
            self.closed = True
            self.raw.close()


def dcp_dir(checkpoints: Path, step: int) -> Path:
    """Where the sharded state of the checkpoint of ``step`` lives."""
    return checkpoints / DCP_DIR / f"step_{int(step)}"


def new_dcp_tmp_dir(checkpoints: Path, step: int) -> Path:
    """A fresh temporary folder for a DCP save of ``step`` (renamed into place by :func:`save_checkpoint`)."""
    return checkpoints / DCP_DIR / f".tmp-step_{int(step)}-{secrets.token_hex(4)}"


@dataclass
class Checkpoint:
    """What ``load_checkpoint`` restored (the model and optimizer are loaded in place)."""

    path: Path
    step: int
    model_dir: Path | None
    sampler_state: Any = None
    calibrator_state: dict | None = None
    config: dict | None = None
    metrics: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    created_at: str = ""


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray) or (hasattr(x, "detach") and hasattr(x, "tolist")):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"{type(x).__name__} is not JSON-serializable; pass plain numbers, lists, dicts")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def capture_rng_state() -> dict:
    """Global RNG states of python ``random``, numpy (legacy) and torch (CPU + CUDA), JSON-able."""
    import torch

    py = random.getstate()
    npst = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of :func:`capture_rng_state` (CUDA states only where CUDA is present)."""
    import torch

    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
        )


def _write_hashed(path: Path, data: bytes, files: dict, root: Path) -> None:
    """Write ``data`` to ``path`` through a :class:`HashingStream`, fsync it, record it in ``files``."""
    rel = path.relative_to(root).as_posix()

    def record(size: int, sha: str) -> None:
        files[rel] = {"size": size, "sha256": sha}

    with HashingStream(open(path, "wb"), record) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _hash_rest(tmp: Path, files: dict) -> None:
    """Size and sha256 of the files written by libraries (``save_pretrained``, ``torch.save``), fsynced."""
    for p in sorted(tmp.rglob("*")):
        rel = p.relative_to(tmp).as_posix()
        if p.is_file() and rel not in files:
            _fsync(p)
            files[rel] = {"size": p.stat().st_size, "sha256": _sha256(p)}


def _commit(layout: RunLayout, tmp: Path, final: Path, dcp: tuple[Path, Path] | None) -> None:
    """Set the old checkpoint of the step aside, rename the DCP folder and then the checkpoint into place."""
    for old in (final, dcp[1] if dcp else None):
        if old is not None and old.exists():
            aside = layout.superseded_path(old)
            if aside.exists():
                aside = aside.with_name(f"{aside.name}-{secrets.token_hex(4)}")
            aside.parent.mkdir(parents=True, exist_ok=True)
            os.replace(old, aside)
    if dcp is not None:
        _fsync(dcp[0])
        os.replace(dcp[0], dcp[1])
        _fsync(dcp[1].parent)
    os.replace(tmp, final)
    _fsync(layout.checkpoints)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: Any = None,
    tokenizer: Any = None,
    optimizer: Any = None,
    sampler_state: Any = None,
    calibrator_state: dict | None = None,
    config: dict | None = None,
    metrics: dict | None = None,
    extra: dict | None = None,
    rng_state: dict | bool = True,
    dcp: tuple[Path, dict] | None = None,
) -> Path:
    """Write ``checkpoints/step_<step>/`` atomically and return its path.

    ``model``: a transformers ``PreTrainedModel`` (saved with ``save_pretrained``,
    safetensors). ``optimizer``: a torch optimizer (its ``state_dict()``) or a
    state dict. ``rng_state``: True captures the global RNGs now, a dict is
    stored as given, False stores none. ``dcp``: ``(temporary DCP folder, its
    files' sizes and hashes as written)``: the folder becomes ``.dcp/step_<step>``
    and the manifest lists its files. The other arguments must be JSON-able.
    """
    import torch

    layout = RunLayout(Path(run_dir))
    layout.checkpoints.mkdir(parents=True, exist_ok=True)
    final = layout.checkpoint_dir(step)
    tmp = layout.checkpoints / f".tmp-step_{int(step)}-{secrets.token_hex(4)}"
    tmp.mkdir()
    files: dict = {}
    try:
        if model is not None:
            model.save_pretrained(tmp / MODEL_DIR)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / MODEL_DIR)
        if optimizer is not None:
            torch.save(optimizer.state_dict() if hasattr(optimizer, "state_dict") else optimizer, tmp / OPTIMIZER)
        if rng_state:
            rng = capture_rng_state() if rng_state is True else rng_state
            _write_hashed(tmp / RNG, json.dumps(rng).encode(), files, tmp)
        state = {
            "format": CHECKPOINT_FORMAT,
            "step": int(step),
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "sampler_state": sampler_state,
            "calibrator_state": calibrator_state,
            "config": config,
            "metrics": metrics or {},
            "extra": extra or {},
        }
        _write_hashed(tmp / STATE, json.dumps(state, indent=1, default=_jsonable).encode(), files, tmp)
        _hash_rest(tmp, files)
        manifest: dict = {"format": CHECKPOINT_FORMAT, "step": int(step), "files": dict(sorted(files.items()))}
        if dcp is not None:
            manifest["dcp"] = {"dir": f"{DCP_DIR}/step_{int(step)}", "files": dict(sorted(dcp[1].items()))}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))  # last: it makes the folder a checkpoint
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
        _commit(layout, tmp, final, None if dcp is None else (Path(dcp[0]), dcp_dir(layout.checkpoints, step)))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _check_files(base: Path, files: dict, hashes: bool) -> list[str]:
    problems = []
    for rel, meta in files.items():
        p = base / rel
        if not p.is_file():
            problems.append(f"{p}: missing")
        elif p.stat().st_size != meta["size"]:
            problems.append(f"{p}: size {p.stat().st_size} != {meta['size']} in manifest")
        elif hashes and _sha256(p) != meta["sha256"]:
            problems.append(f"{p}: sha256 does not match the manifest")
    return problems


def verify_checkpoint(path: str | Path, *, hashes: bool = True) -> list[str]:
    """Problems of a checkpoint folder against its manifest ([] = complete).

    Its sharded (DCP) state is checked too. ``hashes=False`` checks presence and
    sizes only (fast for large models). A checkpoint written before the manifest
    listed the DCP files is checked for the DCP metadata file only.
    """
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        return [f"{path}: no {MANIFEST} (checkpoint incomplete)"]
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        dcp = manifest.get("dcp")
        dcp_files = None if dcp is None else (path.parent / dcp["dir"], dcp["files"])
    except (ValueError, KeyError, TypeError) as err:
        return [f"{mpath}: unreadable manifest ({err})"]
    problems = _check_files(path, files, hashes)
    if dcp_files is not None:
        problems += _check_files(*dcp_files, hashes)
    elif not problems:
        legacy = dcp_dir(path.parent, int(manifest.get("step", -1)))
        if legacy.is_dir() and not (legacy / DCP_METADATA).is_file():
            problems.append(f"{legacy / DCP_METADATA}: missing")
    return problems


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step_<n>`` folder, complete or not, by step."""
    base = RunLayout(Path(run_dir)).checkpoints
    if not base.is_dir():
        return []
    out = [(int(m.group(1)), d) for d in base.iterdir() if d.is_dir() and (m := _STEP_DIR.match(d.name))]
    return sorted(out)


VERIFIED_ENV = "FP8RL_HASHED_CHECKPOINT"
"""``<folder>|<fingerprint>`` of the checkpoint whose hashes ``fp8rl resume`` has just checked, so
the flow it starts (in this process or a child) does not hash the same bytes again."""


def fingerprint(path: str | Path) -> str | None:
    """The manifest's bytes and every listed file's size, mtime and inode, hashed (None: no manifest).

    Any write to the folder's files (a restore of old bytes included) changes it; it costs one
    ``stat`` per file, no reads. It stands for "nothing changed since the hashes were checked".
    """
    path = Path(path)
    try:
        raw = (path / MANIFEST).read_bytes()
        manifest = json.loads(raw)
        entries = [(path, manifest["files"])]
        if manifest.get("dcp"):
            entries.append((path.parent / manifest["dcp"]["dir"], manifest["dcp"]["files"]))
        h = hashlib.sha256(raw)
        for base, files in entries:
            for rel in sorted(files):
                st = (base / rel).stat()
                h.update(f"{base / rel}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}\n".encode())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return h.hexdigest()


def mark_hash_verified(path: str | Path) -> None:
    """Record in the environment that ``path``'s hashes were checked just now (see :data:`VERIFIED_ENV`)."""
    fp = fingerprint(path)
    if fp is not None:
        os.environ[VERIFIED_ENV] = f"{Path(path).resolve()}|{fp}"


def _hash_verified(path: Path) -> bool:
    mark = os.environ.get(VERIFIED_ENV, "")
    folder, _, fp = mark.rpartition("|")
    return bool(folder) and folder == str(path.resolve()) and fp == fingerprint(path)


def latest_complete(run_dir: str | Path, *, at_most: int | None = None, hashes: bool = True) -> Path | None:
    """Newest complete checkpoint (manifest verifies), optionally of a step <= ``at_most``.

    A checkpoint marked by :func:`mark_hash_verified` whose files have not changed since is
    checked for sizes only: its hashes were checked moments ago by the same ``resume``."""
    for step, path in reversed(list_checkpoints(run_dir)):
        if at_most is not None and step > at_most:
            continue
        if not verify_checkpoint(path, hashes=hashes and not _hash_verified(path)):
            return path
    return None


def set_aside_broken(run_dir: str | Path, *, hashes: bool = True) -> list[tuple[Path, str, Path]]:
    """Move the checkpoints newer than the newest complete one under ``superseded/``.

    Resume loads the newest complete checkpoint; the broken ones above it
    (truncated, bit-rotted, half-written) would otherwise be mistaken for the
    newest by a later reader. Returns ``(folder, first problem, where it went)``. The newest
    complete one is marked hash-verified (:func:`mark_hash_verified`) for the restore after it.
    """
    layout = RunLayout(Path(run_dir))
    out = []
    for step, path in reversed(list_checkpoints(run_dir)):
        why = verify_checkpoint(path, hashes=hashes)
        if not why:
            if hashes:
                mark_hash_verified(path)
            break
        moved = []
        for old in (path, dcp_dir(layout.checkpoints, step)):
            if old.exists():
                aside = layout.superseded_path(old)
                if aside.exists():
                    aside = aside.with_name(f"{aside.name}-{secrets.token_hex(4)}")
                aside.parent.mkdir(parents=True, exist_ok=True)
                os.replace(old, aside)
                moved.append(aside)
        out.append((path, why[0] + (f" (+{len(why) - 1} more)" if len(why) > 1 else ""), moved[0]))
    return out


def load_model_weights(model: Any, model_dir: str | Path, *, map_location: str = "cpu") -> None:
    """Load the safetensors of ``model_dir`` into ``model`` in place.

    Keys missing from the files are accepted only for tied parameters (e.g.
    lm_head sharing the embedding), which ``save_pretrained`` does not store.
    """
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights")
    sd = {}
    for f in files:
        sd.update(load_file(str(f), device=map_location))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected:
        raise CheckpointError(f"{model_dir}: weights not in the model: {', '.join(sorted(unexpected)[:5])}")
    own = model.state_dict()
    loaded_ptrs = {own[k].data_ptr() for k in sd if k in own}
    untied = [k for k in missing if own[k].data_ptr() not in loaded_ptrs]
    if untied:
        raise CheckpointError(f"{model_dir}: weights missing for {', '.join(sorted(untied)[:5])}")


def load_checkpoint(
    path: str | Path,
    *,
    model: Any = None,
    optimizer: Any = None,
    restore_rng: bool = True,
    map_location: str = "cpu",
    hashes: bool = False,
) -> Checkpoint:
    """Restore a checkpoint folder: weights into ``model``, state into ``optimizer``, the RNGs.

    The manifest is verified first (sizes; ``hashes=True`` for sha256 too) and
    a mismatch raises :class:`CheckpointError` naming the files.
    """
    import torch

    path = Path(path)
    problems = verify_checkpoint(path, hashes=hashes)
    if problems:
        raise CheckpointError(
            f"checkpoint {path} is incomplete or corrupt: {problems[0]}"
            + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
        )
    state = json.loads((path / STATE).read_text())
    model_dir = path / MODEL_DIR if (path / MODEL_DIR).is_dir() else None
    if model is not None:
        if model_dir is None:
            raise CheckpointError(f"{path}: holds no model weights")
        load_model_weights(model, model_dir, map_location=map_location)
    if optimizer is not None:
        if not (path / OPTIMIZER).is_file():
            raise CheckpointError(f"{path}: holds no optimizer state")
        optimizer.load_state_dict(torch.load(path / OPTIMIZER, map_location=map_location, weights_only=True))
    if restore_rng and (path / RNG).is_file():
        restore_rng_state(json.loads((path / RNG).read_text()))
    return Checkpoint(
        path=path,
        step=int(state["step"]),
        model_dir=model_dir,
        sampler_state=state.get("sampler_state"),
        calibrator_state=state.get("calibrator_state"),
        config=state.get("config"),
        metrics=state.get("metrics") or {},
        extra=state.get("extra") or {},
        created_at=state.get("created_at", ""),
    )


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
