"""Mean-field CRF attention (Liu, Chen, Liang, Ueda; Algorithm 1)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ._common import check_attention_inputs
from .normalizers import mean_field_weights

__all__ = ["MeanFieldAttention", "MeanFieldAttentionOutput"]


class MeanFieldAttentionOutput(NamedTuple):
    """Outputs of :class:`MeanFieldAttention` ([B, ...] without Q for a [B, D] query)."""

    context: Tensor  # [B, Q, Dv]    c = sum_i s_i v_i
    weights: Tensor  # [B, Q, N]     expected spins s_i = p(s_i = 1) (0 at padding)
    unary: Tensor  # [B, Q, N]       phi_i
    interactions: Tensor  # [B, Q, N, N]  J_ij (the interaction map; 0 at padding)


class MeanFieldAttention(nn.Module):
    r"""Attention weights from k mean-field iterations in a fully connected binary CRF.

    For every query d_t and memory h_1..h_N (Algorithm 1 of the paper):

    .. math:: \phi_i = D_{\text{unary}}(h_i, d_t) = v^\top \tanh(W h_i + U d_t + b)

    .. math:: J_{ij} = D_{\text{binary}}(h_i, h_j, d_t)
              = \frac{1}{\sqrt{r}} \sum_r (A h_i)_r\, (C d_t + c)_r\, (A h_j)_r,
              \quad J_{ii} = 0

    (a query-gated low-rank bilinear map: symmetric in i, j, either sign), then k parallel
    updates ``chi <- phi + J s``, ``s = sigmoid(chi)`` from ``chi = phi``, and
    ``c = sum_i s_i h_i``. With J = 0 the weights are sigmoid(phi).

    Args:
        memory_dim: size of h_i. query_dim: size of d_t (default memory_dim).
        hidden_dim: size of the unary MLP and rank r of J (default 32).
        iterations: k (default 3; the paper's MFA_k).

    Forward: ``query`` [B, Dq] or [B, Q, Dq], ``memory`` [B, N, Dm], ``mask`` [B, N]
    (True = real; any pattern), ``values`` [B, N, Dv] (default: memory).

    Example:
        >>> attn = MeanFieldAttention(8, iterations=2)
        >>> out = attn(torch.randn(2, 3, 8), torch.randn(2, 5, 8))
        >>> out.weights.shape, out.interactions.shape
        (torch.Size([2, 3, 5]), torch.Size([2, 3, 5, 5]))
    """

    def __init__(
        self,
        memory_dim: int,
        query_dim: int | None = None,
        hidden_dim: int = 32,
        iterations: int = 3,
    ) -> None:
        super().__init__()
        query_dim = query_dim or memory_dim
        if iterations < 0:
            raise ValueError(f"`iterations` must be >= 0, got {iterations}")
        self.iterations = iterations
        self.rank = hidden_dim
        self.unary_memory = nn.Linear(memory_dim, hidden_dim)  # W h_i + b
        self.unary_query = nn.Linear(query_dim, hidden_dim, bias=False)  # U d_t
        self.unary_out = nn.Linear(hidden_dim, 1, bias=False)  # v
        self.pair_memory = nn.Linear(memory_dim, hidden_dim, bias=False)  # A h_i
        self.pair_query = nn.Linear(query_dim, hidden_dim)  # C d_t + c

    def potentials(self, query: Tensor, memory: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """phi [B, Q, N] and J [B, Q, N, N] (zero rows/columns at padding, zero diagonal)."""
        hidden = self.unary_memory(memory).unsqueeze(1) + self.unary_query(query).unsqueeze(2)
        unary = self.unary_out(torch.tanh(hidden)).squeeze(-1)  # [B, Q, N]
        a = self.pair_memory(memory)  # [B, N, r]
        gate = self.pair_query(query)  # [B, Q, r]
        scaled = a.unsqueeze(1) * (gate / math.sqrt(self.rank)).unsqueeze(2)  # [B, Q, N, r]
        coupling = torch.matmul(scaled, a.transpose(1, 2).unsqueeze(1))  # [B, Q, N, N]
        n = memory.shape[1]
        keep = mask.unsqueeze(-1) & mask.unsqueeze(-2)  # [B, N, N]
        keep = keep & ~torch.eye(n, dtype=torch.bool, device=memory.device)
        return unary, coupling.masked_fill(~keep.unsqueeze(1), 0.0)

    def forward(
        self,
        query: Tensor,
        memory: Tensor,
        mask: Tensor | None = None,
        values: Tensor | None = None,
    ) -> MeanFieldAttentionOutput:
        query3, single, memory, mask, values = check_attention_inputs(query, memory, mask, values)
        unary, coupling = self.potentials(query3, memory, mask)  # [B, Q, N], [B, Q, N, N]
        spins = mean_field_weights(unary, coupling, mask.unsqueeze(1), self.iterations)
        context = torch.bmm(spins, values)  # [B, Q, Dv]
        out = MeanFieldAttentionOutput(context, spins, unary, coupling)
        if single:
            return MeanFieldAttentionOutput(*(t[:, 0] for t in out))
        return out
