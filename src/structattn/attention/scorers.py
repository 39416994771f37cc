"""Scorers: potentials theta[b, q, i] = score(memory_i, query_q).

Every scorer maps ``memory`` [B, N, Dm] and ``query`` [B, Q, Dq] to scores [B, Q, N].
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["BilinearScorer", "DotScorer", "MLPScorer", "Scorer", "make_scorer"]


class Scorer(nn.Module):
    """Base class: ``forward(memory [B, N, Dm], query [B, Q, Dq]) -> scores [B, Q, N]``."""

    def forward(self, memory: Tensor, query: Tensor) -> Tensor:  # pragma: no cover
        raise NotImplementedError


class DotScorer(Scorer):
    """theta_i = x_i^T q (optionally divided by sqrt(D)); needs Dm == Dq."""

    def __init__(self, scaled: bool = False) -> None:
        super().__init__()
        self.scaled = scaled

    def forward(self, memory: Tensor, query: Tensor) -> Tensor:
        if memory.shape[-1] != query.shape[-1]:
            raise ValueError(
                f"dot scorer needs equal memory and query sizes, got {memory.shape[-1]} "
                f"and {query.shape[-1]}"
            )
        scores = torch.bmm(query, memory.transpose(1, 2))  # [B, Q, N]
        return scores / math.sqrt(query.shape[-1]) if self.scaled else scores


class BilinearScorer(Scorer):
    """theta_i = x_i^T W q with W [Dm, Dq]."""

    def __init__(self, memory_dim: int, query_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(query_dim, memory_dim, bias=False)  # W q

    def forward(self, memory: Tensor, query: Tensor) -> Tensor:
        return torch.bmm(self.proj(query), memory.transpose(1, 2))  # [B, Q, N]


class MLPScorer(Scorer):
    """theta_i = v^T tanh(W_m x_i + W_q q + b) (Bahdanau-style)."""

    def __init__(self, memory_dim: int, query_dim: int, hidden_dim: int | None = None) -> None:
        super().__init__()
        hidden_dim = hidden_dim or memory_dim
        self.memory_proj = nn.Linear(memory_dim, hidden_dim, bias=True)
        self.query_proj = nn.Linear(query_dim, hidden_dim, bias=False)
        self.v = nn.Linear(hidden_dim, 1, bias=False)

    def forward(self, memory: Tensor, query: Tensor) -> Tensor:
        hidden = self.memory_proj(memory).unsqueeze(1) + self.query_proj(query).unsqueeze(2)
        return self.v(torch.tanh(hidden)).squeeze(-1)  # [B, Q, N, H] -> [B, Q, N]


def make_scorer(
    scorer: str | Scorer, memory_dim: int, query_dim: int, hidden_dim: int | None = None
) -> Scorer:
    """A scorer by name (``"dot"``, ``"scaled-dot"``, ``"bilinear"``, ``"mlp"``) or as given."""
    if isinstance(scorer, nn.Module):
        return scorer
    if scorer == "dot":
        return DotScorer()
    if scorer == "scaled-dot":
        return DotScorer(scaled=True)
    if scorer == "bilinear":
        return BilinearScorer(memory_dim, query_dim)
    if scorer == "mlp":
        return MLPScorer(memory_dim, query_dim, hidden_dim)
    raise ValueError(
        f"`scorer` must be 'dot', 'scaled-dot', 'bilinear', 'mlp' or a Scorer, got {scorer!r}"
    )
