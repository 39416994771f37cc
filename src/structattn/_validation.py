"""Input checks shared by distributions and layers: clear ``ValueError`` naming the argument.

The checks of values (NaN, +inf, lengths' range, prefix masks, heads' range) read the data
on the host. They are skipped for tensors whose values cannot be read there: under the
``torch.func`` transforms (vmap, grad, jacrev, ...), while ``torch.compile`` or
``torch.export`` trace, and for meta tensors (:func:`is_transformed`); the checks of types,
ranks and shapes still run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch import Tensor


def is_transformed(x: object) -> bool:
    """Whether the values of ``x`` cannot be read on the host: a ``torch.func`` wrapper
    (vmap's BatchedTensor, grad's GradTrackingTensor), a meta tensor, or a tensor seen while
    ``torch.compile``/``torch.export`` trace (a fake tensor)."""
    if not isinstance(x, Tensor):
        return False
    if torch.compiler.is_compiling():  # first: Dynamo cannot trace the functorch query
        return True
    if x.is_meta or bool(torch._C._functorch.is_functorch_wrapped_tensor(x)):
        return True
    return type(x) is not Tensor and not isinstance(x, torch.nn.Parameter)


def outer_jvp(body: Callable[..., Any], *args: Any) -> Any:
    """``body(*args)`` for a Function's ``jvp`` (``args``: its saved tensors and tangents),
    computed so that enclosing ``torch.func`` levels differentiate it.

    PyTorch calls ``jvp`` with forward-mode AD off and the Function's own ``torch.func``
    level current: the tensors are wrapped at that level. Here that level is taken off the
    stack (as ``torch.func`` does around ``forward``), the tensors unwrapped from it,
    forward mode switched on for the enclosing levels, and the tensor outputs wrapped back.
    Without ``torch.func`` (``torch.autograd.forward_ad``: one dual level) ``body`` runs as
    called: forward mode stays off, autograd records it if grad mode is on."""
    functorch = torch._C._functorch
    if not torch._C._are_functorch_transforms_active():
        return body(*args)
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
    from torch.autograd.forward_ad import _set_fwd_grad_enabled
    from torch.utils._pytree import tree_map_only

    interpreter = retrieve_current_functorch_interpreter()
    if interpreter.key() != torch._C._functorch.TransformType.Jvp:
        return body(*args)
    level = interpreter.level()
    inner = tree_map_only(Tensor, lambda x: functorch._unwrap_for_grad(x, level), args)
    with interpreter.lower(), torch.enable_grad(), _set_fwd_grad_enabled(True):
        out = body(*inner)
    return tree_map_only(Tensor, lambda x: functorch._wrap_for_grad(x, level), out)


def differentiated(*tensors: Tensor | None) -> bool:
    """Whether one of ``tensors`` is being differentiated by an enclosing transform: wrapped
    at a ``torch.func`` grad or jvp level (vmap levels do not count), or requiring grad
    with grad mode on. In a ``jvp`` body (:func:`outer_jvp`) this means its result is
    differentiated again: it must come from differentiable operations of the inputs."""
    if torch.compiler.is_compiling():  # Dynamo cannot trace the functorch queries
        return torch.is_grad_enabled() and any(
            isinstance(x, Tensor) and x.requires_grad for x in tensors
        )
    functorch = torch._C._functorch
    for x in tensors:
        while isinstance(x, Tensor) and functorch.is_functorch_wrapped_tensor(x):
            if not functorch.is_batchedtensor(x):
                return True
            x = functorch.get_unwrapped(x)
        if isinstance(x, Tensor) and x.requires_grad and torch.is_grad_enabled():
            return True
    return False


def refuse_differentiated_backward(what: str, *tensors: Tensor | None) -> None:
    """RuntimeError if a Function's hand-written backward, about to compute from constants
    saved by its forward, runs at a ``torch.func`` grad level around which ``tensors`` are
    still differentiated (``jvp(grad(jvp(f)))``, ``grad(grad(grad(f)))``: a third
    derivative). Its result would be a constant for the enclosing level: a silently
    wrong value; this refuses instead."""
    if not torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
        return
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    interpreter = retrieve_current_functorch_interpreter()
    if interpreter.key() != torch._C._functorch.TransformType.Grad:
        return
    level = interpreter.level()
    unwrapped = [
        torch._C._functorch._unwrap_for_grad(x, level) if isinstance(x, Tensor) else x
        for x in tensors
    ]
    if differentiated(*unwrapped):
        raise RuntimeError(
            f"{what}: a third derivative under torch.func through the hand-written "
            "Hessian-vector product (an enclosing transform differentiates a backward "
            "computed from constants saved by the forward, e.g. jvp(grad(jvp(f))) or "
            "grad(grad(grad(f)))) is not supported; use jvp(jvp(jvp(f))), "
            "grad(jvp(jvp(f))) or torch.autograd.grad(create_graph=True) for third order "
            "(torch.func.hessian or jacrev(jacrev(f)) for second order)."
        )


def tracing() -> bool:
    """Whether tensors made now are a tracer's (``torch.compile``, ``torch.export``: fake,
    proxy or functional modes) rather than real ones."""
    if torch.compiler.is_compiling():
        return True
    keys = torch._C._TorchDispatchModeKey
    return any(
        torch._C._get_dispatch_mode(key) is not None
        for key in (keys.FAKE, keys.PROXY, keys.FUNCTIONAL)
    )


_F = TypeVar("_F", bound=Callable[..., Any])


def tensor_cache(maxsize: int) -> Callable[[_F], _F]:
    """``functools.lru_cache`` for functions that build constant tensors (index tables), by
    passed while a tracer runs: a cached fake tensor would otherwise reach later eager calls
    (and a traced graph must build its own constants)."""

    def decorate(fn: _F) -> _F:
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            inside = torch._C._functorch.peek_interpreter_stack() is not None  # torch.func
            return fn(*args) if inside or tracing() else cached(*args)

        call.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        return cast(_F, call)

    return decorate


def check_potentials(name: str, x: object, rank: int, allow_neg_inf: bool = True) -> Tensor:
    """Check that ``x`` is a floating tensor of the given rank with no NaN (and no +inf)."""
    if not isinstance(x, Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"`{name}` must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() != rank:
        raise ValueError(f"`{name}` must have {rank} dimensions, got shape {tuple(x.shape)}")
    # one reduction and one host sync on the valid path: the max is NaN if any entry is NaN
    # (max propagates NaN) and +inf if any is +inf; the message is worked out afterwards
    if is_transformed(x):
        return x
    if x.numel() and not bool(x.amax() < float("inf")):
        if torch.isnan(x).any():
            raise ValueError(f"`{name}` contains NaN")
        raise ValueError(f"`{name}` contains +inf")
    if not allow_neg_inf and torch.isneginf(x).any():
        raise ValueError(f"`{name}` contains -inf")
    return x


def check_lengths(
    lengths: Tensor | None, batch: int, low: int, high: int, device: torch.device
) -> Tensor | None:
    """Check a LongTensor[B] of lengths in ``[low, high]``; returns it on ``device``."""
    if lengths is None:
        return None
    if not isinstance(lengths, Tensor):
        raise ValueError(f"`lengths` must be a LongTensor, got {type(lengths).__name__}")
    if lengths.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValueError(f"`lengths` must be an integer tensor, got dtype {lengths.dtype}")
    if lengths.shape != (batch,):
        raise ValueError(f"`lengths` must have shape ({batch},), got {tuple(lengths.shape)}")
    if batch and not is_transformed(lengths):
        smallest, largest = (int(v) for v in torch.stack(torch.aminmax(lengths)).tolist())
        if smallest < low or largest > high:
            raise ValueError(
                f"`lengths` must lie in [{low}, {high}], got min {smallest} and max {largest}"
            )
    return lengths.to(device=device, dtype=torch.long)


def length_mask(lengths: Tensor | None, batch: int, size: int, device: torch.device) -> Tensor:
    """BoolTensor[B, size], True at positions ``< lengths[b]`` (all True if ``lengths`` is None)."""
    if lengths is None:
        return torch.ones(batch, size, dtype=torch.bool, device=device)
    return torch.arange(size, device=device) < lengths.unsqueeze(-1)


def last_index(lengths: Tensor | None, batch: int, size: int, device: torch.device) -> Tensor:
    """LongTensor[B]: index of each item's last real position (``size - 1`` if ``lengths`` is
    None)."""
    if lengths is None:
        return torch.full((batch,), size - 1, dtype=torch.long, device=device)
    return lengths - 1


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__


def check_mask(
    name: str,
    mask: object,
    shape: tuple[int, ...],
    device: torch.device | None,
    prefix: bool = False,
    min_length: int = 1,
) -> Tensor:
    """The one validator of boolean masks (True = real position); all True when ``None``.

    Returns ``mask`` as a BoolTensor of ``shape`` on ``device`` (kept where it is when
    ``device`` is None). With ``prefix=True`` the real positions must come first in the
    last dimension (chains and trees are ordered) and number at least ``min_length`` per
    row. ValueError naming the argument ``name`` otherwise.
    """
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != shape:
        raise ValueError(
            f"`{name}` must be a BoolTensor of shape {shape} with True at real positions, "
            f"got {_describe(mask)}"
        )
    if device is not None:
        mask = mask.to(device)
    if prefix and not is_transformed(mask):
        prefix_lengths(name, mask, min_length)
    return mask


def prefix_lengths(name: str, mask: Tensor, min_length: int = 1, check: bool = True) -> Tensor:
    """Lengths [*] of a boolean mask [*, N] (True = real) whose real positions come first;
    ValueError naming ``name`` if it is not such a mask or leaves fewer than ``min_length``
    real positions in a row. One host synchronisation (none where the values cannot be read:
    :func:`is_transformed`, nor with ``check=False``, a layer's ``validate_args=False``; the
    lengths are then returned unchecked)."""
    lengths = mask.sum(-1)
    if not check or is_transformed(mask):
        return lengths
    # a prefix mask is non-increasing along the last dimension
    gaps = (mask[..., 1:] & ~mask[..., :-1]).any() if mask.shape[-1] > 1 else mask.new_zeros(())
    short = (lengths < min_length).any() if lengths.numel() else mask.new_zeros(())
    gaps_b, short_b = torch.stack([gaps, short]).tolist()
    if gaps_b:
        raise ValueError(
            f"`{name}` must be a prefix mask (real positions first, padding at the end) for "
            "structured attention (chains and trees are ordered)"
        )
    if short_b:
        raise ValueError(f"`{name}` must leave at least {min_length} real position(s) per item")
    return lengths


def split_attention_mask(
    name: str,
    mask: object,
    shapes: tuple[tuple[int, ...], ...],
    dtype: torch.dtype,
    check: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """A mask in PyTorch's attention convention -> (allowed BoolTensor, additive bias or None).

    A boolean mask is True where attention is NOT allowed; a float mask is added to the
    scores, ``-inf`` entries meaning not allowed (as ``nn.MultiheadAttention`` treats both).
    ``mask`` must have one of ``shapes``. The bias is ``None`` for a boolean mask and 0 at
    not-allowed entries otherwise. ValueError naming ``name`` for other dtypes, shapes, NaN
    or +inf (the check of values, one host synchronisation, skipped with ``check=False``).
    """
    if not isinstance(mask, Tensor) or tuple(mask.shape) not in shapes:
        expected = " or ".join(str(s) for s in shapes)
        raise ValueError(f"`{name}` must have shape {expected}, got {_describe(mask)}")
    if mask.dtype == torch.bool:
        return ~mask, None
    if not mask.is_floating_point():
        raise ValueError(
            f"`{name}` must be a boolean (True = not allowed) or float (added to the scores) "
            f"tensor, got dtype {mask.dtype}"
        )
    values = check and mask.numel() and not is_transformed(mask)
    if values and not bool(mask.amax() < float("inf")):
        # NaN or +inf; one host sync
        raise ValueError(f"`{name}` contains NaN or +inf")
    allowed = mask != float("-inf")
    return allowed, mask.to(dtype).masked_fill(~allowed, 0.0)


def check_heads(heads: object, lengths: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Check ``heads`` [B, N] (integers; at real words 1..len-1 in [0, len)) and ``lengths``;
    return (heads as LongTensor, lengths [B], real-word mask [B, N])."""
    if not isinstance(heads, Tensor) or heads.dim() != 2 or heads.shape[1] < 2:
        shape = tuple(heads.shape) if isinstance(heads, Tensor) else type(heads).__name__
        raise ValueError(f"`heads` must be a LongTensor [B, N] with N >= 2, got {shape}")
    if heads.is_floating_point() or heads.is_complex() or heads.dtype == torch.bool:
        raise ValueError(f"`heads` must be an integer tensor, got dtype {heads.dtype}")
    batch, size = heads.shape
    lengths = check_lengths(lengths, batch, 2, size, heads.device)
    if lengths is None:
        lengths = torch.full((batch,), size, dtype=torch.long, device=heads.device)
    heads = heads.long()
    real = length_mask(lengths, batch, size, heads.device)
    real[:, 0] = False  # ROOT has no head
    check_head_range(heads, lengths, real)
    return heads, lengths, real


def check_head_range(
    heads: Tensor, lengths: Tensor, real: Tensor, allow_none: bool = False
) -> None:
    """ValueError naming ``heads`` if a real word's head is not a position of its item.

    ``allow_none``: an item with ``-1`` at every word is accepted (the "no tree" that
    ``argmax`` and ``sample`` return for an item with no valid tree).
    """
    bad = ((heads < 0) | (heads >= lengths.unsqueeze(-1))) & real  # [B, N]
    if allow_none:
        none = ((heads == -1) | ~real).all(-1, keepdim=True)  # [B, 1]
        bad &= ~none
    if not is_transformed(bad) and bool(bad.any()):
        item, word = (int(i) for i in bad.nonzero()[0].tolist())
        raise ValueError(
            f"`heads` out of range: heads[{item}, {word}] = {int(heads[item, word])}, but a "
            f"word's head must be a position of its item, in [0, {int(lengths[item])}) "
            f"(0 = ROOT; entries at position 0 and at padding are ignored); "
            f"{int(bad.sum())} such entries in all"
        )
