"""Mean-field CRF attention (Liu, Chen, Liang, Ueda; Algorithm 1)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from .._validation import check_mask
from ..structs.mean_field import mean_field_updates
from ._common import as_queries, check_attention_inputs, check_memory

__all__ = ["MeanFieldAttention", "MeanFieldAttentionOutput", "MeanFieldKeys"]


class MeanFieldAttentionOutput(NamedTuple):
    """Outputs of :class:`MeanFieldAttention` ([B, ...] without Q for a [B, D] query)."""

    context: Tensor  # [B, Q, Dv]    c = sum_i s_i v_i
    weights: Tensor  # [B, Q, N]     expected spins s_i = p(s_i = 1) (0 at padding)
    unary: Tensor  # [B, Q, N]       phi_i
    interactions: Tensor  # [B, Q, N, N]  J_ij (the interaction map; 0 at padding)


class MeanFieldKeys(NamedTuple):
    """The query-independent parts of :class:`MeanFieldAttention`'s potentials for one
    memory (:meth:`MeanFieldAttention.precompute`): computed once per sequence, passed as
    ``keys`` at every decoder step."""

    unary: Tensor  # [B, N, r]   W h_i + b
    pair: Tensor  # [B, N, r]    A h_i / r^(1/4) (0 at padding): J = (pair * gate) pair^T
    mask: Tensor  # [B, N]       True at real positions
    values: Tensor  # [B, N, Dv] v_i
    off_diagonal: Tensor  # [N, N] 1 - I (J_ii = 0), in the memory's dtype


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
        validate_args: accepted by every structured layer; this one checks no value on the
            host either way (any mask pattern is valid), so it never synchronises.

    Forward: ``query`` [B, Dq] or [B, Q, Dq], ``memory`` [B, N, Dm], ``mask`` [B, N]
    (True = real; any pattern), ``values`` [B, N, Dv] (default: memory); optionally
    ``keys`` = :meth:`precompute` of that memory, mask and values: decoders that attend to
    one memory at every step compute its projections once per sequence that way (the same
    numbers). The k updates are one autograd node with a hand-written backward
    (:func:`~structattn.structs.mean_field.mean_field_updates`).

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
        validate_args: bool = True,
    ) -> None:
        super().__init__()
        self.validate_args = validate_args  # nothing to check on the host (any mask)
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

    def precompute(
        self, memory: Tensor, mask: Tensor | None = None, values: Tensor | None = None
    ) -> MeanFieldKeys:
        """The query-independent projections of ``memory`` [B, N, Dm] (the ``keys`` of
        :meth:`forward`)."""
        memory = check_memory(memory)
        batch, n, _ = memory.shape
        values = memory if values is None else check_memory(values, "values")
        if values.shape[:2] != (batch, n):
            raise ValueError(f"`values` must have shape [{batch}, {n}, Dv]")
        mask = check_mask("mask", mask, (batch, n), memory.device)
        scale = mask.unsqueeze(-1).to(memory.dtype) / self.rank**0.25  # [B, N, 1], 0 at padding
        pair = self.pair_memory(memory) * scale  # [B, N, r]
        eye = torch.eye(n, dtype=memory.dtype, device=memory.device)
        return MeanFieldKeys(self.unary_memory(memory), pair, mask, values, 1 - eye)

    def _unary_and_gate(self, query: Tensor, keys: MeanFieldKeys) -> tuple[Tensor, Tensor]:
        """phi [B, Q, N] and the gate C d_t + c [B, Q, r] for queries [B, Q, Dq]."""
        if query.shape[0] != keys.unary.shape[0]:
            batch = keys.unary.shape[0]
            raise ValueError(f"`query` has batch {query.shape[0]}, `memory` has {batch}")
        hidden = keys.unary.unsqueeze(1) + self.unary_query(query).unsqueeze(2)  # [B, Q, N, r]
        unary = self.unary_out(torch.tanh(hidden)).squeeze(-1)  # [B, Q, N]
        gate = self.pair_query(query)  # [B, Q, r] (1 / sqrt(r) is in the keys)
        return unary, gate

    def _interactions(self, gate: Tensor, keys: MeanFieldKeys) -> Tensor:
        """J [B, Q, N, N] (zero rows/columns at padding, zero diagonal)."""
        a = keys.pair  # [B, N, r] A h_i / r^(1/4), 0 at padding
        batch, n, rank = a.shape
        scaled = a.unsqueeze(1) * gate.unsqueeze(2)  # [B, Q, N, r]
        # one bmm for all the queries (a 4-D matmul broadcasting a^T is slower; timed in
        # benchmarks/README.md, "Mean-field attention vs softmax attention")
        coupling = torch.bmm(scaled.reshape(batch, -1, rank), a.transpose(1, 2))  # [B, Q*N, N]
        return coupling.view(batch, -1, n, n) * keys.off_diagonal  # [B, Q, N, N]

    def _spins(self, unary: Tensor, coupling: Tensor, mask: Tensor) -> Tensor:
        """Expected spins [B, Q, N] after k mean-field updates (0 at padding) from phi
        [B, Q, N], J [B, Q, N, N] and the mask [B, N]."""
        keep = mask.unsqueeze(1).to(unary.dtype)  # [B, 1, N]
        if self.iterations == 0:  # sigmoid attention
            return torch.sigmoid(unary) * keep
        # J's columns are 0 at padding, so padded spins never reach the real ones
        return mean_field_updates(unary, coupling, self.iterations) * keep

    def potentials(self, query: Tensor, memory: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """phi [B, Q, N] and J [B, Q, N, N] (zero rows/columns at padding, zero diagonal)."""
        keys = self.precompute(memory, mask)
        unary, gate = self._unary_and_gate(query, keys)
        return unary, self._interactions(gate, keys)

    def forward(
        self,
        query: Tensor,
        memory: Tensor,
        mask: Tensor | None = None,
        values: Tensor | None = None,
        keys: MeanFieldKeys | None = None,
    ) -> MeanFieldAttentionOutput:
        if keys is None:
            query3, single, memory, mask, values = check_attention_inputs(
                query, memory, mask, values
            )
            keys = self.precompute(memory, mask, values)
        else:  # memory, mask and values are in the keys
            query3, single = as_queries(query)
        unary, gate = self._unary_and_gate(query3, keys)  # [B, Q, N], [B, Q, r]
        coupling = self._interactions(gate, keys)  # [B, Q, N, N]
        spins = self._spins(unary, coupling, keys.mask)  # [B, Q, N]
        context = torch.bmm(spins, keys.values)  # [B, Q, Dv]
        out = MeanFieldAttentionOutput(context, spins, unary, coupling)
        if single:
            return MeanFieldAttentionOutput(*(t[:, 0] for t in out))
        return out
