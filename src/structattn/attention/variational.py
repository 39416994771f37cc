"""Variational attention (Bahuleyan, Mou, Vechtomova, Poupart 2018): a Gaussian context vector."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from ._common import check_attention_inputs
from .normalizers import softmax_weights
from .scorers import Scorer, make_scorer

__all__ = ["VariationalAttention", "VariationalAttentionOutput"]


class VariationalAttentionOutput(NamedTuple):
    """Outputs of :class:`VariationalAttention` ([B, ...] without Q for a [B, D] query)."""

    context: Tensor  # [B, Q, Dv]  a sample c ~ N(mu, sigma^2) in training, mu in eval mode
    weights: Tensor  # [B, Q, N]   the deterministic softmax attention a
    mean: Tensor  # [B, Q, Dv]     mu = sum_i a_i v_i
    log_variance: Tensor  # [B, Q, Dv]  log sigma^2
    kl: Tensor  # [B, Q]  KL(N(mu, sigma^2) || N(mean of the values, I))


class VariationalAttention(nn.Module):
    r"""Attention whose context vector is a Gaussian latent variable (variational attention).

    What is implemented (Bahuleyan et al. 2018, sec. 3, "variational attention" with the
    deterministic attention as the mean and the prior centred at the mean of the memory):

    .. math:: a = \text{softmax}_i(\text{score}(v_i, d_t)), \quad \mu = \sum_i a_i v_i, \quad
              \log \sigma^2 = W_2 \tanh(W_1 \mu + b_1) + b_2

    .. math:: c = \mu + \sigma \odot \epsilon, \ \epsilon \sim N(0, I) \ \text{(training; }
              c = \mu \text{ in eval mode)}, \quad
              KL = KL\big(N(\mu, \sigma^2) \,\|\, N(\bar v, I)\big), \ \bar v = \frac1N \sum_i v_i

    The KL of every forward call in training mode is accumulated; :meth:`penalty` returns
    ``kl_weight`` times their sum (over items and queries) and resets it, so that
    :meth:`~structattn.models.Seq2Seq.penalty` adds it to a summed loss once per batch.

    Args:
        memory_dim: size of the memory (and values). query_dim: size of d_t.
        scorer: scorer of the deterministic attention (default ``"mlp"``, Bahdanau's).
        hidden_dim: size of the variance network (default memory_dim).
        kl_weight: lambda of the KL term.
    """

    def __init__(
        self,
        memory_dim: int,
        query_dim: int | None = None,
        scorer: str | Scorer = "mlp",
        hidden_dim: int | None = None,
        kl_weight: float = 1.0,
    ) -> None:
        super().__init__()
        if kl_weight < 0:
            raise ValueError(f"`kl_weight` must be >= 0, got {kl_weight}")
        self.scorer = make_scorer(scorer, memory_dim, query_dim or memory_dim, None)
        hidden_dim = hidden_dim or memory_dim
        self.variance = nn.Sequential(
            nn.Linear(memory_dim, hidden_dim), nn.Tanh(), nn.Linear(hidden_dim, memory_dim)
        )
        self.kl_weight = kl_weight
        self._kl: Tensor | None = None  # KL summed since the last penalty() (training mode)

    def forward(
        self,
        query: Tensor,
        memory: Tensor,
        mask: Tensor | None = None,
        values: Tensor | None = None,
    ) -> VariationalAttentionOutput:
        query3, single, memory, mask, values = check_attention_inputs(query, memory, mask, values)
        scores = self.scorer(memory, query3)  # [B, Q, N]
        weights = softmax_weights(scores, mask.unsqueeze(1))  # [B, Q, N]
        mean = torch.bmm(weights, values)  # [B, Q, Dv]
        log_variance = self.variance(mean)  # [B, Q, Dv]
        keep = mask.unsqueeze(-1).to(values.dtype)  # [B, N, 1]
        prior = (values * keep).sum(1) / keep.sum(1).clamp(min=1.0)  # [B, Dv]
        kl = 0.5 * (
            log_variance.exp() + (mean - prior.unsqueeze(1)).pow(2) - 1.0 - log_variance
        ).sum(-1)  # [B, Q]
        if self.training:
            context = mean + torch.randn_like(mean) * (0.5 * log_variance).exp()
            self._kl = kl.sum() if self._kl is None else self._kl + kl.sum()
        else:
            context = mean
        out = VariationalAttentionOutput(context, weights, mean, log_variance, kl)
        if single:
            return VariationalAttentionOutput(*(t[:, 0] for t in out))
        return out

    def penalty(self) -> Tensor:
        """``kl_weight`` x the KL summed over the training-mode calls since the last call
        (a 0-dim tensor; 0 if none), and reset the sum."""
        kl, self._kl = self._kl, None
        if kl is None:
            return next(self.parameters()).new_zeros(())
        return self.kl_weight * kl
