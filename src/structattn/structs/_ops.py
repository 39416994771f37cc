"""What the hand-written ``torch.autograd.Function`` nodes of :mod:`structattn.structs` share
to work under ``torch.func`` (issue 38.3) and without host synchronisation (38.5).

* **setup_context.** ``torch.func`` (grad, vjp, jacrev, vmap) needs every Function in the
  ``forward(*inputs)`` + ``setup_context(ctx, inputs, output)`` form. The dynamic programs'
  forward passes compute intermediates that their backward needs (charts, the scaled forward
  pass, the inverse Laplacian, opaque C++ state): ``forward`` puts them in a :class:`Stash`
  passed as its last input and ``setup_context`` moves them onto ``ctx``. Tensors among them
  are constants of the backward (never differentiated: each backward that is itself
  differentiated rebuilds what it needs from the saved inputs), which is what makes this
  exact under the transforms.
* **vmap.** Every Function is batched over dimension 0 of its tensor inputs already, so its
  ``vmap`` rule (:func:`vmap_by_folding`) folds the vmapped dimension into that batch
  dimension ([V, B, ...] -> [V * B, ...]), applies the Function once and unfolds the outputs:
  one call of the same kernel, no per-sample loop.
* **jvp under nested forward mode.** PyTorch runs a Function's ``jvp`` with forward-mode
  AD switched off, so an enclosing forward level (``jacfwd(jacfwd(f))``, nested
  ``torch.func.jvp``) would see the tangent as a constant: silently wrong second
  derivatives (pytorch/pytorch#197867). Every ``jvp`` here runs its body through
  :func:`outer_jvp` (defined in :mod:`structattn._validation`, for the semirings too),
  which removes the current ``torch.func`` level (unwrapping the saved tensors and
  tangents, as ``torch.func`` does for ``forward``) and switches forward mode back on, so
  the enclosing levels differentiate the body's operations; the bodies use differentiable
  nodes of the inputs (the marginals Function, the Hessian-vector product recomputed from
  the scores) where :func:`differentiated` says an enclosing level or autograd
  differentiates them.
* :func:`is_transformed` tells whether a tensor is a ``torch.func`` wrapper (vmap's
  BatchedTensor, grad's GradTrackingTensor) or a fake or meta tensor: data-dependent checks
  (validation) and host synchronisations are skipped for those.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from .._validation import differentiated, is_transformed, outer_jvp, tensor_cache

__all__ = [
    "Stash",
    "batch_dot",
    "is_batched",
    "differentiated",
    "is_transformed",
    "outer_jvp",
    "refuse_jit_trace",
    "reads_host",
    "sync_free",
    "tensor_cache",
    "vmap_by_folding",
]


def batch_dot(*pairs: tuple[Tensor, Tensor | None]) -> Tensor:
    """Sum over ``pairs`` of each item's inner product: ``sum_k <a_k[b], t_k[b]>`` [B] for
    ``(a_k, t_k)`` with ``a_k`` [B, ...]; pairs whose ``t_k`` is None (an input without
    tangent or gradient) add nothing. The jvp of a log partition function (the marginals
    against the tangents) and the gradient of a seed (the marginals against the incoming
    gradient) are this."""
    out = None
    for a, t in pairs:
        if t is not None:
            term = (a * t).flatten(1).sum(-1)
            out = term if out is None else out + term
    return pairs[0][0].new_zeros(pairs[0][0].shape[0]) if out is None else out


class Stash:
    """A mutable holder that carries a Function's intermediates from ``forward`` (which has
    no ``ctx`` in the ``setup_context`` form) to ``setup_context``."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Any = None


def is_batched(x: object) -> bool:
    """Whether ``x`` is a tensor being vmapped (a functorch BatchedTensor, at any level of its
    ``torch.func`` wrappers)."""
    functorch = torch._C._functorch
    while isinstance(x, Tensor) and functorch.is_functorch_wrapped_tensor(x):
        if functorch.is_batchedtensor(x):
            return True
        x = functorch.get_unwrapped(x)
    return False


def vmap_by_folding(
    function: Callable[..., Any],
    info: Any,
    in_dims: Sequence[int | None],
    args: Sequence[Any],
    batch_major: Sequence[bool],
) -> tuple[Any, Any]:
    """The ``vmap`` rule of a Function batched over dimension 0: the vmapped dimension of
    every batched argument moves to the front and folds into the batch dimension, unbatched
    batch-major tensors are repeated, ``function`` (the Function's ``apply`` or an equivalent)
    runs once, and each tensor output [V * B, ...] unfolds into [V, B, ...] (out dim 0).

    ``batch_major[i]``: argument i is a tensor [B, ...] (True) or anything else (False; it
    must not be vmapped).
    """
    size = info.batch_size
    folded: list[Any] = []
    for arg, dim, major in zip(args, in_dims, batch_major, strict=True):
        if not major or arg is None:
            if dim is not None:
                raise ValueError("vmap over this argument of a structattn dynamic program")
            folded.append(arg)
            continue
        x = arg.movedim(dim, 0) if dim is not None else arg.expand(size, *arg.shape)
        folded.append(x.reshape(size * x.shape[1], *x.shape[2:]))
    out = function(*folded)

    def unfold(y: Any) -> Any:
        if not isinstance(y, Tensor):
            return y
        return y.reshape(size, y.shape[0] // size, *y.shape[1:])

    if isinstance(out, tuple):
        return tuple(unfold(y) for y in out), tuple(
            0 if isinstance(y, Tensor) else None for y in out
        )
    return unfold(out), 0


#: set by :func:`sync_free` (tests): take the paths without host reads on CPU too
_SYNC_FREE = [False]


def reads_host(x: Tensor) -> bool:
    """Whether the dynamic programs may read values of ``x`` on the host to pick a faster
    path: only for plain CPU tensors, where reading a value is no device synchronisation.
    On CUDA, under ``torch.func`` transforms, ``torch.compile``/``torch.export`` tracing and
    on meta tensors they take paths without data-dependent control flow (issue 38.5):
    exact, sometimes slower (the log-space chain pass, every item's exact elimination)."""
    return x.device.type == "cpu" and not _SYNC_FREE[0] and not is_transformed(x)


@contextmanager
def sync_free() -> Iterator[None]:
    """Within this block CPU tensors take the paths without host reads too (what CUDA
    tensors always take): for tests that count host synchronisations on a CPU machine."""
    _SYNC_FREE[0] = True
    try:
        yield
    finally:
        _SYNC_FREE[0] = False


def refuse_jit_trace(what: str) -> None:
    """RuntimeError if ``torch.jit.trace`` or ``torch.onnx.export(..., dynamo=False)`` is
    tracing: they record the dynamic programs' autograd Functions, C++ kernels and Python
    control flow with the first inputs' lengths and masks as constants, a model that is wrong
    on new inputs (issue 38.2). A clear error instead of a wrong model."""
    if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
        raise RuntimeError(
            f"{what} cannot be traced by torch.jit.trace or exported by "
            "torch.onnx.export(dynamo=False): the trace would keep the lengths and masks of "
            "the example inputs as constants and be wrong on new inputs. Use "
            "torch.export.export (chains, projective and non-projective trees: README, "
            "'PyTorch features') or "
            "keep the module in Python."
        )
