r"""PRPN's Parsing Network and gated self-attention (Shen et al., 2018).

:class:`ParsingNetwork` maps token vectors to syntactic distances d [B, T] and, for every
query step t, to the expected gates E[g_i(l_t)] [B, T, T] of an attention limit l_t;
:class:`GatedSelfAttention` computes a causal dot-product attention over the previous memories
and renormalises it by those gates (eq. 6):

.. math:: s_{t,i} = \frac{E[g_i(l_t)] \tilde s_{t,i}}{\sum_{j<t} E[g_j(l_t)] \tilde s_{t,j}},
          \qquad c_t = \sum_{i<t} s_{t,i} m_i .

The maths (stick-breaking and Bradley-Terry gates, padding conventions) lives in
:mod:`structattn.structs.stick_breaking`.

Example:
    >>> parser, attend = ParsingNetwork(8, 16), GatedSelfAttention(8)
    >>> x = torch.randn(2, 6, 8)
    >>> out = attend(x, parser(x).expected_gates)
    >>> out.context.shape, out.weights.shape
    (torch.Size([2, 6, 8]), torch.Size([2, 6, 6]))
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .._validation import check_mask, check_potentials
from ..names import GATE_KINDS, GateKind
from ..structs.stick_breaking import (
    bradley_terry_gates,
    expected_gates,
    gated_attention_weights,
    stick_breaking_distribution,
    stick_breaking_gates,
)

__all__ = ["GatedAttentionOutput", "GatedSelfAttention", "ParsingNetwork", "ParsingOutput"]


def _check_inputs(name: str, x: object, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Validate x [B, T, D] and mask [B, T]; return (x, mask) with mask all True if None."""
    x = check_potentials(name, x, rank=3, allow_neg_inf=False)
    return x, check_mask("mask", mask, tuple(x.shape[:2]), x.device)


class ParsingOutput(NamedTuple):
    """Output of :class:`ParsingNetwork` (B batch, T steps)."""

    distances: Tensor  #: [B, T] syntactic distances d > 0 (0 at padding)
    alpha: Tensor  #: [B, T, T] continue-probabilities alpha[b, t, k], k < t (0 elsewhere)
    expected_gates: Tensor  #: [B, T, T] E[g_i(l_t)] = P(l_t <= i), i < t (0 elsewhere)
    distribution: Tensor  #: [B, T, T] p(l_t = k), rows sum to 1 over k < t (0 for t = 0)


class ParsingNetwork(nn.Module):
    r"""Syntactic distances from a causal convolution, and PRPN's attention-limit gates.

    .. math:: h_k = \mathrm{ReLU}(\mathrm{Conv1d}(x_{k-L+1}, \dots, x_k)), \qquad
              d_k = \mathrm{softplus}(w^\top \mathrm{dropout}(h_k) + b) + \epsilon

    The convolution (kernel width L) is causal: the sequence is left-padded with L - 1 zero
    vectors, and padded tokens are zeroed before it, so left padding is indistinguishable
    from the sequence start. ``softplus + min_distance`` keeps d strictly positive (PRPN uses
    a ReLU; Bradley-Terry needs d > 0). From d, for every step t and key k < t:

    * ``gate="stick-breaking"`` (eq. 7):
      alpha_k = (hardtanh(2 (d_t - d_k) / tau + 1) + 1) / 2,
    * ``gate="bradley-terry"`` (section 5.3): alpha_k = d_t / (d_t + d_k) = 1 - p(stop at k)
      (``tau`` is unused),

    then p(l_t = k) = (1 - alpha_k) prod_{j=k+1}^{t-1} alpha_j (eq. 4) and
    E[g_i(l_t)] = prod_{j=i+1}^{t-1} alpha_j (eq. 5).

    Args:
        embed_dim: D, size of the input vectors.
        hidden_dim: channels of the convolution.
        kernel_size: L, number of tokens x_{k-L+1..k} that d_k sees (5 in the notes).
        dropout: dropout on the inputs and on the hidden layer.
        gate: ``"stick-breaking"`` or ``"bradley-terry"``.
        tau: default temperature of the stick-breaking gates (PRPN's ``resolution``).
        min_distance: epsilon added to the softplus.

    Shapes: x [B, T, D], mask [B, T] (True = real token) -> :class:`ParsingOutput`.
    Cost O(B T L D H) for the distances and O(B T^2) for the gates.
    """

    def __init__(
        self,
        embed_dim: int,
        hidden_dim: int,
        kernel_size: int = 5,
        dropout: float = 0.0,
        gate: GateKind = "stick-breaking",
        tau: float = 1.0,
        min_distance: float = 1e-6,
    ) -> None:
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("hidden_dim", hidden_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        if not isinstance(kernel_size, int) or kernel_size < 1:
            raise ValueError(f"`kernel_size` must be a positive int, got {kernel_size!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must lie in [0, 1), got {dropout!r}")
        if gate not in GATE_KINDS:
            raise ValueError(f"`gate` must be 'stick-breaking' or 'bradley-terry', got {gate!r}")
        if not tau > 0:
            raise ValueError(f"`tau` must be > 0, got {tau!r}")
        if not min_distance > 0:
            raise ValueError(f"`min_distance` must be > 0, got {min_distance!r}")
        self.embed_dim = embed_dim
        self.kernel_size = kernel_size
        self.gate = gate
        self.tau = float(tau)
        self.min_distance = float(min_distance)
        self.dropout = nn.Dropout(dropout)
        self.conv = nn.Conv1d(embed_dim, hidden_dim, kernel_size)
        self.proj = nn.Linear(hidden_dim, 1)

    def features(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Hidden layer h [B, T, H] of the causal convolution (0 rows not enforced at padding)."""
        x, mask = _check_inputs("x", x, mask)
        if x.shape[-1] != self.embed_dim:
            raise ValueError(f"`x` must have last dimension {self.embed_dim}, got {x.shape[-1]}")
        keep = mask.unsqueeze(-1).to(x.dtype)  # [B, T, 1]
        h = self.dropout(x * keep).transpose(1, 2)  # [B, D, T]
        h = F.pad(h, (self.kernel_size - 1, 0))  # [B, D, L - 1 + T], causal left padding
        return F.relu(self.conv(h)).transpose(1, 2)  # [B, T, H]

    def distances_from_features(
        self, h: Tensor, mask: Tensor | None = None, proj: nn.Linear | None = None
    ) -> Tensor:
        """d [B, T] = softplus(proj(dropout(h))) + epsilon from :meth:`features` h [B, T, H].

        ``proj`` (default the network's own head) lets a model read a second distance off the
        same features, e.g. PRPN's distance of the next token.
        """
        head = self.proj if proj is None else proj
        d = F.softplus(head(self.dropout(h)).squeeze(-1)) + self.min_distance  # [B, T]
        if mask is not None:
            d = d * mask.to(d.dtype)
        return d

    def distances(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Syntactic distances d [B, T] (> 0 at real tokens, 0 at padding)."""
        x, mask = _check_inputs("x", x, mask)
        return self.distances_from_features(self.features(x, mask), mask)

    def forward(
        self, x: Tensor, mask: Tensor | None = None, tau: float | None = None
    ) -> ParsingOutput:
        """Distances, gates alpha, expected gates and p(l_t) for input x [B, T, D].

        ``tau`` overrides the constructor's temperature (stick-breaking only).
        """
        d = self.distances(x, mask)
        if self.gate == "stick-breaking":
            alpha = stick_breaking_gates(d, self.tau if tau is None else tau, mask)
        else:
            alpha = bradley_terry_gates(d, mask)
        return ParsingOutput(
            distances=d,
            alpha=alpha,
            expected_gates=expected_gates(alpha, mask),
            distribution=stick_breaking_distribution(alpha, mask),
        )

    def extra_repr(self) -> str:
        return f"gate={self.gate!r}, tau={self.tau}, min_distance={self.min_distance}"


class GatedAttentionOutput(NamedTuple):
    """Output of :class:`GatedSelfAttention` (B batch, T steps, M memory size)."""

    context: Tensor  #: [B, T, M] c_t = sum_{i<t} s_{t,i} m_i (0 where the weights are 0)
    weights: Tensor  #: [B, T, T] gated attention s (eq. 6)
    raw_weights: Tensor  #: [B, T, T] raw causal attention s~ (softmax over real i < t)


class GatedSelfAttention(nn.Module):
    r"""Causal dot-product attention over previous memories, renormalised by gates (eq. 6).

    .. math:: q_t = W x_t + b, \qquad
              \tilde s_{t,\cdot} = \mathrm{softmax}_{i<t}(q_t^\top m_i / \sqrt{M}),
              \qquad s_{t,i} = \frac{g_{t,i} \tilde s_{t,i}}{\sum_{j<t} g_{t,j} \tilde s_{t,j}},
              \qquad c_t = \sum_{i<t} s_{t,i} m_i

    As in PRPN's Reading Network the query is a linear function of the input x_t and the
    keys are the memories themselves (``memory`` defaults to x). Only i < t is attended (no
    memory at t = 0: its weights and context are 0), padded memories get weight 0, and a step
    whose gated mass vanishes reads nothing (see
    :func:`~structattn.structs.stick_breaking.gated_attention_weights`).

    Args:
        embed_dim: D, size of x.
        memory_dim: M, size of the memories (default D).
        bias: bias of the query projection.

    Shapes: x [B, T, D], gates [B, T, T] (e.g. ``ParsingNetwork(...)(x).expected_gates``;
    None = no gating), mask [B, T], memory [B, T, M] -> :class:`GatedAttentionOutput`.
    """

    def __init__(self, embed_dim: int, memory_dim: int | None = None, bias: bool = True) -> None:
        super().__init__()
        memory_dim = embed_dim if memory_dim is None else memory_dim
        for name, value in (("embed_dim", embed_dim), ("memory_dim", memory_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        self.embed_dim = embed_dim
        self.memory_dim = memory_dim
        self.query = nn.Linear(embed_dim, memory_dim, bias=bias)

    def forward(
        self,
        x: Tensor,
        gates: Tensor | None,
        mask: Tensor | None = None,
        memory: Tensor | None = None,
    ) -> GatedAttentionOutput:
        x, mask = _check_inputs("x", x, mask)
        batch, n, dim = x.shape
        if dim != self.embed_dim:
            raise ValueError(f"`x` must have last dimension {self.embed_dim}, got {dim}")
        if memory is None:
            memory = x
        memory = check_potentials("memory", memory, rank=3, allow_neg_inf=False)
        if memory.shape != (batch, n, self.memory_dim):
            raise ValueError(
                f"`memory` must have shape ({batch}, {n}, {self.memory_dim}), "
                f"got {tuple(memory.shape)}"
            )
        steps = torch.arange(n, device=x.device)
        causal = steps.unsqueeze(-1) > steps  # [T, T], memory i < step t
        valid = causal & mask.unsqueeze(-1) & mask.unsqueeze(-2)  # [B, T, T]
        q = self.query(x)  # [B, T, M]
        scores = torch.bmm(q, memory.transpose(1, 2)) / math.sqrt(self.memory_dim)  # [B, T, T]
        # masked softmax over i < t; rows without any memory become 0 (not NaN)
        scores = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
        raw = torch.softmax(scores, dim=-1) * valid.to(scores.dtype)  # [B, T, T]
        if gates is None:
            gates = torch.ones_like(raw)
        weights = gated_attention_weights(raw, gates, mask)  # [B, T, T]
        context = torch.bmm(weights, memory)  # [B, T, M]
        return GatedAttentionOutput(context=context, weights=weights, raw_weights=raw)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, memory_dim={self.memory_dim}"
