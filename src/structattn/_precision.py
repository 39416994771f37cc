"""Inference in full precision under ``torch.autocast`` (issue 38.6).

Autocast runs matrix products in half precision (bfloat16 on CPU, float16 on CUDA), which
the dynamic programs must not: their sums of exponentials and their hand-written backward
passes assume one floating dtype throughout. :func:`full_precision` runs a function with
autocast off for its tensors' device, its half-precision tensor arguments in float32 (the
result is float32, as autocast gives for the operations it keeps in float32)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

__all__ = ["autocast_widened", "full_precision"]

_F = TypeVar("_F", bound=Callable[..., Any])
_HALF = (torch.float16, torch.bfloat16)


def _widen(value: Any) -> Any:
    return value.float() if isinstance(value, Tensor) and value.dtype in _HALF else value


def _autocast_on(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (False for a type autocast does not know,
    such as ``meta``)."""
    if device_type == "meta":
        return False
    return torch.is_autocast_enabled(device_type)


def full_precision(fn: _F) -> _F:
    """Decorate ``fn`` so that under autocast it runs with autocast off and float32 inputs;
    outside autocast it is called as is (one check, about a microsecond)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        tensor = next((a for a in args if isinstance(a, Tensor)), None)
        if tensor is None or not _autocast_on(tensor.device.type):
            return fn(*args, **kwargs)
        args = tuple(_widen(a) for a in args)
        kwargs = {key: _widen(value) for key, value in kwargs.items()}
        with torch.autocast(tensor.device.type, enabled=False):
            return fn(*args, **kwargs)

    return cast(_F, call)


def autocast_widened(*tensors: Tensor) -> tuple[Tensor, ...]:
    """``tensors`` with half precision widened to float32 when autocast is on for the first
    one's device (a distribution built under autocast computes in float32), else as is."""
    if not tensors or not _autocast_on(tensors[0].device.type):
        return tensors
    return tuple(_widen(t) for t in tensors)
