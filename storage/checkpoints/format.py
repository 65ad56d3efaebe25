"""The files of a checkpoint folder, and the stream that hashes them as they are written.

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
with the checkpoint folder (:mod:`storage.checkpoints.store`).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

MANIFEST, STATE, RNG, OPTIMIZER, MODEL_DIR = "manifest.json", "state.json", "rng.json", "optimizer.pt", "model"
DCP_DIR = ".dcp"
DCP_METADATA = ".metadata"
CHECKPOINT_FORMAT = 1
STEP_DIR = re.compile(r"^step_(\d+)$")


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
    """A fresh temporary folder for a DCP save of ``step`` (renamed into place on save)."""
    return checkpoints / DCP_DIR / f".tmp-step_{int(step)}-{secrets.token_hex(4)}"


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes (hex), read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder: so a rename inside it is durable)."""
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
