"""vLLM 0.33's engine-core wire format, copied rule for rule (for the honest stand-in).

By default ``vllm.LLM`` runs its engine core in a *separate process*
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``). Every utility call the frontend makes —
``sleep``, ``wake_up``, ``reset_prefix_cache``, ``collective_rpc`` (and through
it ``reload_weights``, ``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``) — crosses that boundary as
msgpack. vLLM's own serializer cannot be imported beside our torch (the wheel
pins another torch and needs its compiled ops), so this module is a faithful
copy of its rules, from the vLLM 0.33.0 wheel:

* ``vllm/v1/engine/core_client.py`` ``SyncMPClient.call_utility``: a utility
  call is the tuple ``(client_idx=0, call_id, method, args)``, encoded with a
  ``MsgpackEncoder`` and sent as frames ``(identity, request_type, *bufs)``;
  ``collective_rpc(method, timeout, args, kwargs)`` is the utility
  ``"collective_rpc"`` with args ``(method, timeout, args, kwargs)``.
* ``vllm/v1/serial_utils.py`` ``MsgpackEncoder.enc_hook``: a ``torch.Tensor``
  becomes the plain tuple ``(dtype_str, shape, data)``, where ``data`` is a raw
  ``Ext(3)`` view below ``VLLM_MSGPACK_ZERO_COPY_THRESHOLD`` (256 bytes) and
  otherwise the *index of an extra frame* holding the bytes; numpy arrays
  likewise; anything else is a ``TypeError`` unless
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which pickles it into ``Ext(1)``.
* ``vllm/v1/engine/core.py`` ``EngineCoreProc.process_input_sockets``: utility
  requests are decoded by ``generic_decoder = MsgpackDecoder()`` — **no target
  type**. msgspec then returns tuples as lists and calls no ``dec_hook``, so an
  encoded tensor arrives as the bare list ``[dtype, shape, frame_index]`` (its
  bytes sit in a frame nobody reads) and an ``Ext(3)`` view as a ``memoryview``.
  ``_convert_msgspec_args`` converts an argument only when the target method
  annotates a ``msgspec.Struct`` — never for ``collective_rpc``'s ``args`` /
  ``kwargs``.
* Results come back as ``UtilityResult``: ``(None, result)`` unless insecure
  serialization is on, in which case type info travels alongside.

Consequence (the step-1 crash this project had): tensors passed through
``collective_rpc(..., kwargs={"weights_iterator": [(name, tensor), ...]})``
reach the worker as ``[name, [dtype, shape, index]]`` lists and
``model.load_weights`` fails. Only JSON-like control data may cross; weights go
through a data plane (CUDA IPC handles, NCCL broadcast, or files).
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Sequence

import msgspec
import numpy as np
import torch
from msgspec import msgpack

CUSTOM_TYPE_PICKLE = 1
CUSTOM_TYPE_CLOUDPICKLE = 2
CUSTOM_TYPE_RAW_VIEW = 3
ZERO_COPY_THRESHOLD = 256  # VLLM_MSGPACK_ZERO_COPY_THRESHOLD default (vllm/envs.py)


def allow_insecure() -> bool:
    """``VLLM_ALLOW_INSECURE_SERIALIZATION`` as vllm/envs.py reads it."""
    return bool(int(os.getenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")))


class UtilityResult:
    """Wrapper of a utility call's result (vllm/v1/serial_utils.py)."""

    def __init__(self, r: Any = None) -> None:
        self.result = r


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    # vllm.v1.utils.tensor_data: the contiguous CPU bytes of the tensor
    return memoryview(t.detach().cpu().contiguous().view(torch.uint8).numpy())


class MsgpackEncoder:
    """``vllm.v1.serial_utils.MsgpackEncoder`` (tensor / ndarray / UtilityResult rules)."""

    def __init__(self, size_threshold: int = ZERO_COPY_THRESHOLD) -> None:
        self.encoder = msgpack.Encoder(enc_hook=self.enc_hook)
        self.size_threshold = size_threshold
        self.aux_buffers: list[Any] | None = None

    def encode(self, obj: Any) -> list[bytes]:
        try:
            self.aux_buffers = bufs = [b""]
            bufs[0] = self.encoder.encode(obj)
            return [bytes(b) for b in bufs]
        finally:
            self.aux_buffers = None

    def enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._encode_tensor(obj)
        if isinstance(obj, np.ndarray) and obj.dtype.kind not in ("O", "V"):
            return self._encode_ndarray(obj)
        if isinstance(obj, slice):
            return tuple(int(v) if v is not None else None for v in (obj.start, obj.stop, obj.step))
        if isinstance(obj, UtilityResult):
            result = obj.result
            if not allow_insecure():
                return None, result
            return _encode_type_info_recursive(result), result
        if not allow_insecure():
            raise TypeError(
                f"Object of type {type(obj)} is not serializable"
                "Set VLLM_ALLOW_INSECURE_SERIALIZATION=1 to allow "
                "fallback to pickle-based serialization."
            )
        return msgpack.Ext(CUSTOM_TYPE_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def _encode_ndarray(self, obj: np.ndarray) -> tuple:
        assert self.aux_buffers is not None
        arr_data = obj.data if obj.flags.c_contiguous else obj.tobytes()
        if not obj.shape or obj.nbytes < self.size_threshold:
            data: Any = msgpack.Ext(CUSTOM_TYPE_RAW_VIEW, bytes(arr_data))
        else:
            data = len(self.aux_buffers)
            self.aux_buffers.append(arr_data)
        return obj.dtype.str, obj.shape, data

    def _encode_tensor(self, obj: torch.Tensor) -> tuple:
        assert self.aux_buffers is not None
        if obj.nbytes < self.size_threshold and obj.device.type == "cpu":
            data: Any = msgpack.Ext(CUSTOM_TYPE_RAW_VIEW, bytes(_tensor_bytes(obj)))
        else:
            data = len(self.aux_buffers)
            self.aux_buffers.append(_tensor_bytes(obj))
        return str(obj.dtype).removeprefix("torch."), tuple(obj.shape), data


def _encode_type_info_recursive(obj: Any) -> Any:
    if obj is None:
        return None
    if type(obj) is list:
        return [_encode_type_info_recursive(x) for x in obj]
    if type(obj) is dict:
        return {k: _encode_type_info_recursive(v) for k, v in obj.items()}
    return type(obj).__module__, type(obj).__qualname__


class MsgpackDecoder:
    """``vllm.v1.serial_utils.MsgpackDecoder``; ``t=None`` is the engine core's ``generic_decoder``."""

    def __init__(self, t: Any | None = None) -> None:
        args = () if t is None else (t,)
        self.decoder = msgpack.Decoder(*args, ext_hook=self.ext_hook, dec_hook=self.dec_hook)
        self.aux_buffers: Sequence[bytes] = ()

    def decode(self, bufs: Sequence[bytes]) -> Any:
        self.aux_buffers = bufs
        try:
            return self.decoder.decode(bufs[0])
        finally:
            self.aux_buffers = ()

    def dec_hook(self, t: type, obj: Any) -> Any:
        if isinstance(t, type):
            if issubclass(t, torch.Tensor):
                return self._decode_tensor(obj)
            if t is UtilityResult:
                result_type, result = obj
                if result_type is not None and not allow_insecure():
                    raise TypeError("VLLM_ALLOW_INSECURE_SERIALIZATION must be set to use custom utility result types")
                return UtilityResult(result)
        return obj

    def _decode_tensor(self, arr: Any) -> torch.Tensor:
        dtype, shape, data = arr
        buffer = self.aux_buffers[data] if isinstance(data, int) else data
        torch_dtype = getattr(torch, dtype)
        if not len(buffer):
            return torch.empty(shape, dtype=torch_dtype)
        return torch.frombuffer(bytearray(buffer), dtype=torch.uint8).view(torch_dtype).view(shape)

    def ext_hook(self, code: int, data: memoryview) -> Any:
        if code == CUSTOM_TYPE_RAW_VIEW:
            return data
        if allow_insecure() and code == CUSTOM_TYPE_PICKLE:
            return pickle.loads(data)
        raise NotImplementedError(f"Extension type code {code} is not supported")


# Result frames: EngineCoreOutputs(utility_output=UtilityOutput(call_id, failure_message, result))
class UtilityOutput(msgspec.Struct, array_like=True):
    call_id: int
    failure_message: str | None = None
    result: UtilityResult | None = None


def encode_utility_call(encoder: MsgpackEncoder, call_id: int, method: str, args: tuple) -> list[bytes]:
    """The frames ``SyncMPClient.call_utility`` sends (``(0, call_id, method, args)``)."""
    return encoder.encode((0, call_id, method, args))
