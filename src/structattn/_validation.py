"""Input checks shared by distributions and layers: clear ``ValueError`` naming the argument."""

from __future__ import annotations

import torch
from torch import Tensor


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
    if batch:
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
