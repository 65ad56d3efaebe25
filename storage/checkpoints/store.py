"""Checkpoints: everything needed to continue a campaign bit-for-bit from a step.

The files of ``checkpoints/step_<n>/`` and of the sharded state in
``checkpoints/.dcp/step_<n>/`` are listed in :mod:`storage.checkpoints.format`; every
rank writes the sharded state into a temporary folder through
:class:`storage.checkpoints.format.HashingStream`, renamed into place together with the
checkpoint folder, so a half-written DCP folder is never part of a complete checkpoint.

Atomicity: everything is written into ``checkpoints/.tmp-step_<n>-<hex>/``,
fsynced, and the folder renamed to ``step_<n>``. A checkpoint is *complete* iff
its folder has that name and its manifest verifies
(:mod:`storage.checkpoints.verify`). Re-checkpointing a step sets the old
folder aside under ``superseded/``.

Retention (:mod:`storage.checkpoints.retention`) keeps the last k complete
checkpoints plus the best one by a metric recorded in ``state.json``.

torch is imported inside the functions that need it so that the catalog and
``fp8rl doctor`` stay quick to start.
"""

from __future__ import annotations

import base64
import json
import os
import random
import secrets
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from storage.checkpoints.format import (
    CHECKPOINT_FORMAT,
    DCP_DIR,
    MANIFEST,
    MODEL_DIR,
    OPTIMIZER,
    RNG,
    STATE,
    HashingStream,
    dcp_dir,
    fsync_path,
    sha256_file,
)
from storage.checkpoints.verify import verify_checkpoint
from storage.errors import CheckpointError
from storage.run.layout import RunLayout


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


@dataclass(frozen=True)
class CheckpointState:
    """The JSON-able part of a checkpoint (``state.json``): the sampler's and the calibrator's state, the
    config, metrics (what retention ranks by) and whatever else a caller keeps (``extra``)."""

    sampler_state: Any = None
    calibrator_state: dict | None = None
    config: dict | None = None
    metrics: dict | None = None
    extra: dict | None = None


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray) or (hasattr(x, "detach") and hasattr(x, "tolist")):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"{type(x).__name__} is not JSON-serializable; pass plain numbers, lists, dicts")


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
            fsync_path(p)
            files[rel] = {"size": p.stat().st_size, "sha256": sha256_file(p)}


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
        fsync_path(dcp[0])
        os.replace(dcp[0], dcp[1])
        fsync_path(dcp[1].parent)
    os.replace(tmp, final)
    fsync_path(layout.checkpoints)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: Any = None,
    tokenizer: Any = None,
    optimizer: Any = None,
    state: CheckpointState = CheckpointState(),
    rng_state: dict | bool = True,
    dcp: tuple[Path, dict] | None = None,
) -> Path:
    """Write ``checkpoints/step_<step>/`` atomically and return its path.

    ``model``: a transformers ``PreTrainedModel`` (saved with ``save_pretrained``,
    safetensors). ``optimizer``: a torch optimizer (its ``state_dict()``) or a
    state dict. ``rng_state``: True captures the global RNGs now, a dict is
    stored as given, False stores none. ``dcp``: ``(temporary DCP folder, its
    files' sizes and hashes as written)``: the folder becomes ``.dcp/step_<step>``
    and the manifest lists its files. ``state``'s fields must be JSON-able.
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
        saved = {
            "format": CHECKPOINT_FORMAT,
            "step": int(step),
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "sampler_state": state.sampler_state,
            "calibrator_state": state.calibrator_state,
            "config": state.config,
            "metrics": state.metrics or {},
            "extra": state.extra or {},
        }
        _write_hashed(tmp / STATE, json.dumps(saved, indent=1, default=_jsonable).encode(), files, tmp)
        _hash_rest(tmp, files)
        manifest: dict = {"format": CHECKPOINT_FORMAT, "step": int(step), "files": dict(sorted(files.items()))}
        if dcp is not None:
            manifest["dcp"] = {"dir": f"{DCP_DIR}/step_{int(step)}", "files": dict(sorted(dcp[1].items()))}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))  # last: it makes the folder a checkpoint
        fsync_path(tmp / MANIFEST)
        fsync_path(tmp)
        _commit(layout, tmp, final, None if dcp is None else (Path(dcp[0]), dcp_dir(layout.checkpoints, step)))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


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
