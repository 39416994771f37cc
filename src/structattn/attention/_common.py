"""Helpers shared by the attention layers: query/mask handling and masked normalisers."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._validation import check_mask


def refuse_scripting(module: object) -> object:
    """``__prepare_scriptable__`` of the structured layers: ``torch.jit.script`` runs it
    before compiling, so scripting one of them fails with this one clear error (TorchScript
    cannot compile their dynamic programs) instead of an error about a type annotation."""
    raise RuntimeError(
        f"{type(module).__name__} cannot be compiled by torch.jit.script (its dynamic programs "
        "are Python code and autograd Functions). Use torch.export.export or torch.compile "
        "(README, 'PyTorch features'), or keep the module in Python."
    )


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
    return query3, single, memory, check_mask("mask", mask, (batch, n), memory.device), values


def masked_softmax(scores: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    """Softmax over ``dim`` ignoring masked entries (weight 0); all-masked rows give zeros."""
    scores = scores.masked_fill(~mask, float("-inf"))
    scores = scores.masked_fill(~mask.any(dim, keepdim=True), 0.0)  # no NaN for empty rows
    weights = torch.softmax(scores, dim)
    return weights.masked_fill(~mask, 0.0)


class SegmentSelection:
    """What SAN's segmentation attention layers share (Kim et al. 2017, sec. 3.2):
    :class:`~structattn.attention.SegmentationAttention` (positions) and
    :class:`~structattn.attention.SemiMarkovSegmentationAttention` (segments). A mixin of
    an ``nn.Module``: the learned 2x2 ``transitions`` b between consecutive labels
    (0 = not selected, 1 = selected), the L2 :meth:`penalty` on b, and the context
    c = sum_k p_k v_k / gamma with gamma = lambda^{-1} sum_k p_k (``normalize=True``, the
    paper's setting) or c = sum_k p_k v_k."""

    transitions: nn.Parameter
    normalize_context: bool
    lam: float
    penalty_weight: float

    def _init_selection(self, normalize: bool, lam: float, penalty: float) -> None:
        """Call from ``__init__`` after ``nn.Module.__init__``."""
        self.transitions = nn.Parameter(torch.zeros(2, 2))  # b[previous label, label]
        self.normalize_context = normalize
        self.lam = lam
        self.penalty_weight = penalty

    def penalty(self) -> Tensor:
        """L2 penalty on the transitions b (add it to the loss)."""
        return self.penalty_weight * self.transitions.pow(2).sum()

    def selection_context(self, weights: Tensor, values: Tensor) -> Tensor:
        """Context [B, Q, Dv] of weights p [B, Q, N] and values [B, N, Dv]."""
        context = torch.matmul(weights, values)  # [B, Q, Dv]
        if not self.normalize_context:
            return context
        gamma = weights.sum(-1, keepdim=True) / self.lam  # [B, Q, 1]
        return context / gamma.clamp_min(torch.finfo(weights.dtype).tiny)
