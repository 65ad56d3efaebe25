"""Host/device discipline on one CPU: every tensor tagged *device* or *host*, and a mix is an error.

On a GPU a training step touches two memories: the accelerator's (the policy,
the batch it trains on, every activation) and the host's (index bookkeeping,
gathered per-token tables, grids built from Python lists). An op whose tensor
operands live in both fails on CUDA ("Expected all tensors to be on the same
device"); on the CPU, where every test runs, both memories are one and the same
mix runs silently. :class:`HostDeviceMode` gives the CPU the GPU's two memories
as tags, so a test run finds the mix the GPU would hit, naming the op and the
line.

The rule (kept small so that code written for the GPU follows it naturally):

* **device**: parameters and buffers of the models handed to the mode, their
  gradients (tagged as autograd accumulates them), every tensor created by a
  factory called with ``device=`` the step's device, every tensor moved with
  :func:`to_device` or ``Tensor.to(<the step's device>)``;
* **host**: every other tensor, and the result of ``Tensor.cpu()``;
* results inherit: an op with a device operand returns device tensors
  (``x[idx]`` takes the tag of ``x``), an op on host operands host tensors.

What CUDA accepts, the mode accepts: 0-dim host tensors beside device ones
(CUDA treats CPU scalars as wrapped numbers), a device tensor indexed with host
indices (``x[idx]``, ``x[idx] = v``), copies across (``copy_``, ``.to``,
``.cpu()``, ``float(t)``, ``t.item()``, ``t.tolist()``). Everything else with
operands of both tags raises :class:`HostDeviceMixError`. Ops run by the
autograd engine (the backward pass) mirror the forward and are not checked;
their results inherit as above.

The mode is a :class:`torch.overrides.TorchFunctionMode`: it sees calls as
Python made them, before ``Tensor.to`` short-circuits a move to the device a
tensor is already on (on the CPU every move is such a no-op, so a dispatch-level
mode could not see it). A move that would copy on the GPU returns a copy here
too, so the tag of the original never changes.
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

DEVICE, HOST = "device", "host"
_ACTIVE: list["HostDeviceMode"] = []
_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.arange,
    torch.linspace,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.eye,
    torch.empty_strided,
}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
_DEVICE_GETTER = torch._C.TensorBase.__dict__["device"]
_HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
}


class HostDeviceMixError(RuntimeError):
    """An op took both host and device tensors (on CUDA: 'Expected all tensors to be on the same device')."""


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on the step's ``device``: the one way the trainer moves a host tensor there (a device tensor after)."""
    mode = _ACTIVE[-1] if _ACTIVE else None
    if mode is None:
        return t.to(device)
    out = t.to(mode.device)
    if mode.tag_of(out) == HOST:
        out = out.clone() if out is t else out  # a copy on the GPU: the host original keeps its tag
        mode.tag(out, DEVICE)
    return out


def _call_site() -> str:
    """``file:line`` of the innermost frame outside torch and this module (the code that made the call)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        f = os.path.abspath(frame.filename)
        if f != _HERE and not f.startswith(_TORCH_DIR):
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
    return "<unknown>"


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _device_kwarg(func: Any, args: tuple, kwargs: dict) -> Any:
    if "device" in kwargs:
        return kwargs["device"]
    if func is torch.Tensor.to:  # .to(device), .to(device, dtype), .to(dtype) or .to(other)
        for a in args[1:]:
            if isinstance(a, (str, torch.device)):
                return a
    return None


class HostDeviceMode(TorchFunctionMode):
    """Tag tensors device/host and fail on any op that mixes them (see the module docstring).

    ``models``: their parameters, buffers and (as autograd fills them) gradients are
    device tensors. ``device``: the step's device (a factory with ``device=`` it, or a
    ``.to`` it, makes device tensors).
    """

    def __init__(self, models: Iterable[torch.nn.Module] = (), device: torch.device | str = "cpu") -> None:
        super().__init__()
        device = torch.device(device)
        self.device = torch.device("cpu", 0) if device.type == "cpu" else device
        self.tags: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.ops = 0
        self._hooks = []
        for m in models:
            for t in [*m.parameters(), *m.buffers()]:
                self.tags[t] = DEVICE
            for p in m.parameters():
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._tag_grad))

    def _tag_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.tags[p.grad] = DEVICE

    def tag(self, t: torch.Tensor, tag: str) -> None:
        self.tags[t] = tag

    def tag_of(self, t: torch.Tensor) -> str:
        return self.tags.get(t, HOST)

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return super().__exit__(*exc)

    def _is_step_device(self, d: Any) -> bool:
        try:
            d = torch.device(d)
        except (RuntimeError, TypeError):
            return False
        return d == self.device

    def _check(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        """The tag the op's results take (None: no tensor operand); raises on a mix."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not tensors:
            return None
        if func in _INDEXING:
            self_tag = self.tag_of(tensors[0])
            for t in tensors[1:]:  # indices may be host for a device tensor, never device for a host one
                tag = self.tag_of(t)
                if tag == DEVICE and self_tag == HOST and t.dim() > 0:
                    self._fail(func, tensors)
                is_value = func is torch.Tensor.__setitem__ and t is args[2]
                if is_value and tag != self_tag and t.dim() > 0:
                    self._fail(func, tensors)
            return self_tag
        tags = {self.tag_of(t) for t in tensors if t.dim() > 0 or self.tag_of(t) == DEVICE}
        if len(tags) > 1 and torch._C._current_graph_task_id() == -1 and func not in _HOST_READS:
            self._fail(func, tensors)
        return DEVICE if DEVICE in tags or DEVICE in {self.tag_of(t) for t in tensors} else HOST

    def _fail(self, func: Any, tensors: list[torch.Tensor]) -> None:
        shapes = ", ".join(f"{self.tag_of(t)} {tuple(t.shape)}" for t in tensors)
        raise HostDeviceMixError(f"{_name(func)} mixes host and device tensors ({shapes}) at {_call_site()}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if getattr(func, "__self__", None) is _DEVICE_GETTER:  # t.device: the step's device or the host's
            real = func(*args, **kwargs)
            return self.device if real.type == self.device.type and self.tag_of(args[0]) == DEVICE else real
        if func is torch.Tensor.cpu:
            src = args[0]
            out = func(*args, **kwargs)
            if self.tag_of(src) == DEVICE:
                out = out.clone() if out is src else out
            self.tags[out] = HOST
            return out
        to_tensor = func is torch.Tensor.to and any(isinstance(a, torch.Tensor) for a in args[1:])
        if func is torch.Tensor.copy_ or to_tensor:
            out = func(*args, **kwargs)  # a copy across, allowed: copy_ keeps self's tag, .to(other) takes other's
            src = args[0] if func is torch.Tensor.copy_ else next(a for a in args[1:] if isinstance(a, torch.Tensor))
            tag = self.tag_of(src)
            if out is args[0] and func is torch.Tensor.to and self.tag_of(out) != tag:
                out = out.clone()
            self.tags[out] = tag
            return out
        target = _device_kwarg(func, args, kwargs)
        moving = func is torch.Tensor.to and target is not None
        inherited = (
            None
            if func in _FACTORIES and not isinstance(args[0] if args else None, torch.Tensor)
            else self._check(func, args, kwargs)
        )
        out = func(*args, **kwargs)
        if moving:
            tag = DEVICE if self._is_step_device(target) else HOST
            if out is args[0] and self.tag_of(out) != tag:
                out = out.clone()
        elif inherited is None:
            tag = DEVICE if target is not None and self._is_step_device(target) else HOST
        else:
            tag = inherited
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                self.tags[t] = tag
        return out


__all__ = ["DEVICE", "HOST", "HostDeviceMixError", "HostDeviceMode", "to_device"]
