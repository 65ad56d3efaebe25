"""Put on ``PYTHONPATH`` of a child process the tests start, with ``FP8RL_TEST_CUDA_STANDIN=COUNT,TOTAL_GIB``:
the child's ``torch.cuda`` answers as a machine with COUNT devices of TOTAL_GIB each (free = total - 3 GiB),
and refuses a device index it does not have, as the real module does. Without the variable it does nothing."""

import os

_SPEC = os.environ.get("FP8RL_TEST_CUDA_STANDIN")
if _SPEC:
    import torch

    _count, _gib = (int(v) for v in _SPEC.split(","))

    def _index(device):
        index = 0 if device is None else (device if isinstance(device, int) else torch.device(device).index or 0)
        if not 0 <= index < _count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        return index

    def _mem_get_info(device=None):
        _index(device)
        return (_gib - 3) * 2**30, _gib * 2**30

    torch.cuda.is_available = lambda: _count > 0
    torch.cuda.device_count = lambda: _count
    torch.cuda.mem_get_info = _mem_get_info
    torch.cuda.get_device_name = lambda device=None: (_index(device), "NVIDIA H200 (stand-in)")[1]
