"""Helpers shared by the attention layers: query/mask handling and masked normalisers."""

from __future__ import annotations

import torch
from torch import Tensor

from .._validation import length_mask


def as_queries(query: Tensor, name: str = "query") -> tuple[Tensor, bool]:
    """Accept [B, D] (one query per item) or [B, Q, D]; return [B, Q, D] and whether Q was added."""
    if not isinstance(query, Tensor) or query.dim() not in (2, 3):
        shape = tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__
        raise ValueError(f"`{name}` must have shape [B, D] or [B, Q, D], got {shape}")
    return (query.unsqueeze(1), True) if query.dim() == 2 else (query, False)


def check_memory(memory: Tensor, name: str = "memory") -> Tensor:
    if not isinstance(memory, Tensor) or memory.dim() != 3 or not memory.is_floating_point():
        shape = tuple(memory.shape) if isinstance(memory, Tensor) else type(memory).__name__
        raise ValueError(f"`{name}` must be a float tensor of shape [B, N, D], got {shape}")
    return memory


def check_mask(mask: Tensor | None, batch: int, size: int, device: torch.device) -> Tensor:
    """BoolTensor [B, N] (True = real position); all True when ``mask`` is None."""
    if mask is None:
        return torch.ones(batch, size, dtype=torch.bool, device=device)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != (batch, size):
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(
            f"`mask` must be a BoolTensor of shape ({batch}, {size}) with True at real "
            f"positions, got {shape}"
        )
    return mask.to(device)


def check_attention_inputs(
    query: Tensor, memory: Tensor, mask: Tensor | None, values: Tensor | None
) -> tuple[Tensor, bool, Tensor, Tensor, Tensor]:
    """The shared checks of memory-attention layers.

    Returns (queries [B, Q, Dq], whether Q was added, memory [B, N, Dm], mask [B, N],
    values [B, N, Dv] (``memory`` when None)); ValueError naming the argument otherwise.
    """
    query3, single = as_queries(query)
    memory = check_memory(memory)
    batch, n, _ = memory.shape
    if query3.shape[0] != batch:
        raise ValueError(f"`query` has batch {query3.shape[0]}, `memory` has {batch}")
    values = memory if values is None else check_memory(values, "values")
    if values.shape[:2] != (batch, n):
        raise ValueError(f"`values` must have shape [{batch}, {n}, Dv]")
    return query3, single, memory, check_mask(mask, batch, n, memory.device), values


def prefix_lengths(mask: Tensor, minimum: int = 1) -> Tensor:
    """Lengths [B] of a padding mask whose real positions come first (required by chains and
    trees, whose structure depends on position order). Raises ValueError otherwise."""
    lengths = mask.sum(-1)
    if not torch.equal(length_mask(lengths, mask.shape[0], mask.shape[1], mask.device), mask):
        raise ValueError(
            "`mask` must be a prefix mask (real positions first, padding at the end) for "
            "structured attention"
        )
    if bool((lengths < minimum).any()):
        raise ValueError(f"`mask` must leave at least {minimum} real position(s) per item")
    return lengths


def masked_softmax(scores: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    """Softmax over ``dim`` ignoring masked entries (weight 0); all-masked rows give zeros."""
    scores = scores.masked_fill(~mask, float("-inf"))
    scores = scores.masked_fill(~mask.any(dim, keepdim=True), 0.0)  # no NaN for empty rows
    weights = torch.softmax(scores, dim)
    return weights.masked_fill(~mask, 0.0)
