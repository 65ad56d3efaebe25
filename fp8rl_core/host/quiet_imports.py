"""Log filters for the known import-time noise of torchao (torch-free, so the CLI can
install them before any command parses its arguments).

transformers imports torchao when a model class is imported; on a CPU build torchao
0.18 logs that its optional C++ kernels (mxfp8, cutlass sm90a) cannot be loaded, and
torch logs a deprecation notice for torchao registering Enums as pytree constants.
Neither is actionable. The filters drop exactly those two messages and nothing else.
"""

from __future__ import annotations

import logging

_NEEDLES = ("Could not load this library", "is an Enum subclass and is now natively supported")
_LOGGERS = ("torchao", "torch.utils._pytree")


class TorchaoImportNoise(logging.Filter):
    """Drops the two known import-time messages (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(n in msg for n in _NEEDLES)


def silence_torchao_import_noise() -> None:
    """Install the filter on the two loggers involved (idempotent, touches nothing else).

    Call before importing transformers (entry points do; importing
    :mod:`fp8rl_core.precision.conversion` does too).
    """
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, TorchaoImportNoise) for f in logger.filters):
            logger.addFilter(TorchaoImportNoise())
