"""Checks shared by the span distributions (constituency, semi-Markov, split trees).

Their potentials have entries that are never read (below the diagonal, past an item's
length), so NaN or +inf is an error only where it is read; structures are 0/1 indicator
tensors of the potentials' shape.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._validation import is_transformed


def check_tensor(name: str, x: object, ranks: tuple[int, ...]) -> Tensor:
    """ValueError naming ``name`` unless ``x`` is a floating tensor of one of ``ranks``."""
    if not isinstance(x, Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"`{name}` must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() not in ranks:
        expected = " or ".join(str(r) for r in ranks)
        raise ValueError(f"`{name}` must have {expected} dimensions, got shape {tuple(x.shape)}")
    return x


def check_read_entries(name: str, x: Tensor, read: Tensor, allow_neg_inf: bool = True) -> None:
    """ValueError naming ``name`` if an entry of ``x`` where ``read`` (broadcast to the
    leading dimensions of ``x``) is True is NaN or +inf (or -inf, unless allowed).

    One reduction and one host sync on the valid path (over all of ``x`` first, the read
    entries only where that finds NaN or +inf: padding); skipped where values cannot be read
    on the host (``torch.func`` transforms, tracing, meta tensors: ``is_transformed``)."""
    if not x.numel() or is_transformed(x):
        return
    if allow_neg_inf and bool(x.amax() < float("inf")):  # no NaN or +inf at all: one pass
        return
    read = read.reshape(*read.shape, *([1] * (x.dim() - read.dim())))
    values = torch.where(read, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if not allow_neg_inf:
        values = values.abs()
    if bool(values.amax() < float("inf")):  # NaN and +inf fail the comparison
        return
    if torch.isnan(values).any():
        raise ValueError(f"`{name}` contains NaN")
    if not allow_neg_inf and torch.isneginf(torch.where(read, x, 0.0)).any():
        raise ValueError(f"`{name}` contains -inf")
    raise ValueError(f"`{name}` contains +inf")


def check_indicators(
    name: str, value: object, shape: tuple[int, ...], device: torch.device
) -> tuple[Tensor, Tensor]:
    """Check a structure given as 0/1 indicators of ``shape`` (integer or bool); an item
    with ``-1`` everywhere is "no structure" (what ``argmax`` gives an item without one).

    Returns (indicators LongTensor on ``device``, -1 items set to 0; BoolTensor [B], True at
    the "no structure" items). ValueError naming ``name`` otherwise.
    """
    if not isinstance(value, Tensor) or tuple(value.shape) != shape:
        got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"`{name}` must be a 0/1 tensor of shape {shape}, got {got}")
    if value.is_floating_point() or value.is_complex():
        raise ValueError(f"`{name}` must be an integer or bool tensor, got dtype {value.dtype}")
    ind = value.to(device=device, dtype=torch.long)
    flat = ind.reshape(shape[0], -1)
    none = (flat == -1).all(-1) if flat.shape[1] else flat.new_zeros(shape[0], dtype=torch.bool)
    bad = ((flat != 0) & (flat != 1)).any(-1) & ~none
    if bool(bad.any()):
        item = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"`{name}` must hold 0 and 1 only (or -1 everywhere for an item with no "
            f"structure); item {item} does not"
        )
    return ind.masked_fill(none.view(-1, *([1] * (ind.dim() - 1))), 0), none


def check_inside(name: str, ind: Tensor, read: Tensor, what: str) -> None:
    """ValueError naming ``name`` if an indicator is set outside the read entries."""
    read = read.reshape(*read.shape, *([1] * (ind.dim() - read.dim())))
    outside = ((ind != 0) & ~read).reshape(ind.shape[0], -1).any(-1)
    if bool(outside.any()):
        item = int(outside.nonzero()[0, 0])
        raise ValueError(f"`{name}` of item {item} marks {what}")
