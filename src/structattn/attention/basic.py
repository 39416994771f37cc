"""Attention over a memory with a pluggable scorer: softmax, sigmoid and segmentation (CRF).

All three layers share one call signature::

    out = layer(query, memory, mask=None, values=None)
    out.context  # [B, Q, Dv] (or [B, Dv] for a [B, D] query)
    out.weights  # [B, Q, N]  attention weights (0 at padding)
    out.scores   # [B, Q, N]  the potentials theta

``query`` [B, Dq] or [B, Q, Dq] (Q queries at once, e.g. all decoder steps), ``memory``
[B, N, Dm], ``mask`` BoolTensor [B, N] (True = real position), ``values`` [B, N, Dv]
(default: ``memory``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from .._validation import check_mask, prefix_lengths
from ..distributions import LinearChainCRF
from ..names import WeightKind
from ._common import (
    SegmentSelection,
    as_queries,
    check_attention_inputs,
    check_memory,
    refuse_scripting,
)
from ._weights import check_weights
from .normalizers import segmentation_crf, segmentation_weights, sigmoid_weights, softmax_weights
from .scorers import Scorer, make_scorer

__all__ = ["AttentionOutput", "SegmentationAttention", "SigmoidAttention", "SoftmaxAttention"]


class AttentionOutput(NamedTuple):
    """Context vectors, attention weights and the potentials that produced them."""

    context: Tensor
    weights: Tensor
    scores: Tensor


class _ScoredAttention(nn.Module):
    """Scorer + normaliser; subclasses implement ``normalize(scores, mask)``."""

    def __init__(
        self,
        memory_dim: int,
        query_dim: int | None = None,
        scorer: str | Scorer = "bilinear",
        hidden_dim: int | None = None,
        validate_args: bool = True,
    ) -> None:
        super().__init__()
        self.scorer = make_scorer(scorer, memory_dim, query_dim or memory_dim, hidden_dim)
        #: check the mask's values (a prefix mask: one host sync per call); False: no host read
        self.validate_args = validate_args

    def normalize(self, scores: Tensor, mask: Tensor) -> Tensor:
        """scores [B, Q, N], mask [B, N] -> weights [B, Q, N]."""
        raise NotImplementedError

    def forward(
        self,
        query: Tensor,
        memory: Tensor,
        mask: Tensor | None = None,
        values: Tensor | None = None,
    ) -> AttentionOutput:
        query3, single, memory, mask, values = check_attention_inputs(query, memory, mask, values)
        scores = self.scorer(memory, query3)  # [B, Q, N]
        weights = self.normalize(scores, mask)  # [B, Q, N]
        context = self.contextualize(weights, values)  # [B, Q, Dv]
        if single:
            return AttentionOutput(context[:, 0], weights[:, 0], scores[:, 0])
        return AttentionOutput(context, weights, scores)

    def contextualize(self, weights: Tensor, values: Tensor) -> Tensor:
        """c_q = sum_i weights[q, i] values_i, [B, Q, Dv]."""
        return torch.bmm(weights, values)


class SoftmaxAttention(_ScoredAttention):
    r"""Categorical (soft-selection) attention: p = softmax(theta), c = sum_i p_i v_i.

    Args:
        memory_dim: size Dm of the memory vectors x_i.
        query_dim: size Dq of the queries (default Dm).
        scorer: ``"dot"``, ``"scaled-dot"``, ``"bilinear"`` (x_i^T W q, default), ``"mlp"``
            or a :class:`~structattn.attention.scorers.Scorer`.

    Example:
        >>> attn = SoftmaxAttention(8)
        >>> out = attn(torch.randn(2, 8), torch.randn(2, 5, 8))
        >>> out.context.shape, out.weights.shape
        (torch.Size([2, 8]), torch.Size([2, 5]))
    """

    def normalize(self, scores: Tensor, mask: Tensor) -> Tensor:
        return softmax_weights(scores, mask.unsqueeze(1))


class SigmoidAttention(_ScoredAttention):
    r"""Bernoulli (multiple-selection) attention: p_i = sigmoid(theta_i), c = sum_i p_i v_i.

    Same arguments as :class:`SoftmaxAttention`. Weights do not sum to one.
    """

    def normalize(self, scores: Tensor, mask: Tensor) -> Tensor:
        return sigmoid_weights(scores, mask.unsqueeze(1))


class SegmentationAttention(_ScoredAttention, SegmentSelection):
    r"""Segmentation attention (Kim et al. 2017, sec. 3.2 and A.3): a 2-state linear-chain CRF
    over the N memory positions for every query.

    .. math:: \theta_i(1) = \text{score}(x_i, q),\quad \theta_i(0) = 0,\quad
              \theta_{i,i+1}(z_i, z_{i+1}) = \theta_i(z_i) + \theta_{i+1}(z_{i+1}) + b_{z_i z_{i+1}}

    The weights are the marginals p_i = p(z_i = 1 | x, q) (forward-backward). With
    ``normalize=True`` (the paper's setting) the context is
    ``c = sum_i p_i v_i / gamma`` with ``gamma = lambda^{-1} sum_i p_i``; otherwise
    ``c = sum_i p_i v_i``. All Q queries of a call share one batched chain computation.

    Args:
        memory_dim, query_dim, scorer: as for :class:`SoftmaxAttention`.
        normalize: divide by gamma (default True).
        lam: the paper's lambda (default 2).
        penalty: weight of the L2 penalty on b returned by :meth:`penalty` (default 0.005).
        validate_args: check that the mask puts padding at the end (one host
            synchronisation per call; default True). False skips it: no value is read on
            the host (no device synchronisation on CUDA).
        weights: ``"marginals"`` (default, p_i), ``"sparse"`` (SparseMAP's p_i: a mix of
            few segmentations) or ``"hard-st"`` (the Viterbi segmentation's z_i forward, the
            marginals' gradient backward).

    The mask must put padding at the end (the chain is ordered). Add :meth:`penalty` to the
    training loss. ``scores`` in the output are theta_i(1).

    Example:
        >>> attn = SegmentationAttention(8)
        >>> out = attn(torch.randn(2, 3, 8), torch.randn(2, 5, 8))  # 3 queries
        >>> out.weights.shape
        torch.Size([2, 3, 5])
    """

    __prepare_scriptable__ = refuse_scripting  # torch.jit.script: one clear error

    def __init__(
        self,
        memory_dim: int,
        query_dim: int | None = None,
        scorer: str | Scorer = "bilinear",
        hidden_dim: int | None = None,
        normalize: bool = True,
        lam: float = 2.0,
        penalty: float = 0.005,
        validate_args: bool = True,
        weights: WeightKind = "marginals",
    ) -> None:
        super().__init__(memory_dim, query_dim, scorer, hidden_dim, validate_args)
        self.weights_mode = check_weights(weights)
        self._init_selection(normalize, lam, penalty)  # b[z_i, z_{i+1}], lambda, penalty

    def crf(self, scores: Tensor, mask: Tensor) -> LinearChainCRF:
        """The chain for scores [B, Q, N] (one chain per query), batch B * Q."""
        lengths = (
            prefix_lengths("mask", mask, check=self.validate_args)
            .unsqueeze(1)
            .expand(scores.shape[:2])
        )  # [B, Q]
        return segmentation_crf(scores, lengths, self.transitions)

    def normalize(self, scores: Tensor, mask: Tensor) -> Tensor:
        lengths = (
            prefix_lengths("mask", mask, check=self.validate_args)
            .unsqueeze(1)
            .expand(scores.shape[:2])
        )  # [B, Q]
        return segmentation_weights(scores, lengths, self.transitions, self.weights_mode)

    def contextualize(self, weights: Tensor, values: Tensor) -> Tensor:
        return self.selection_context(weights, values)

    def decode(self, query: Tensor, memory: Tensor, mask: Tensor | None = None) -> Tensor:
        """MAP segmentation z (LongTensor [B, Q, N] or [B, N]; -1 at padding) by Viterbi."""
        query3, single = as_queries(query)
        memory = check_memory(memory)
        mask = check_mask("mask", mask, tuple(memory.shape[:2]), memory.device)
        scores = self.scorer(memory, query3)
        labels = self.crf(scores, mask).argmax.reshape(scores.shape)
        return labels[:, 0] if single else labels
