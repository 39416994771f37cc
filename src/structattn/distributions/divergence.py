"""Cross-entropy and KL divergence between two structured distributions over the same
structures (same class, shapes, lengths and options), exact from marginals and log Z.

``torch.distributions.kl_divergence(p, q)`` works too: the structured distributions are
not :class:`torch.distributions.Distribution` subclasses (their ``entropy`` is a property
and ``sample`` takes a count, where ``Distribution`` has an ``entropy()`` method and
``sample(sample_shape)``), but torch's KL registry dispatches on any pair of classes, and
:func:`kl_divergence` is registered there for every pair of structured distributions (a
pair of different classes raises the ``ValueError`` of :meth:`kl_divergence`).
"""

from __future__ import annotations

import torch.distributions.kl
from torch import Tensor

from .base import StructuredDistribution

__all__ = ["cross_entropy", "kl_divergence"]


def cross_entropy(p: StructuredDistribution, q: StructuredDistribution) -> Tensor:
    """H(p, q) = -E_p[log q(z)] = log Z_q - E_p[score_q(z)], shape [B]
    (:meth:`StructuredDistribution.cross_entropy`): exact, differentiable in both."""
    return p.cross_entropy(q)


def kl_divergence(p: StructuredDistribution, q: StructuredDistribution) -> Tensor:
    """KL(p || q) = H(p, q) - H(p), shape [B] (:meth:`StructuredDistribution.kl_divergence`):
    exact, differentiable in both."""
    return p.kl_divergence(q)


def _register() -> bool:
    """Register :func:`kl_divergence` with ``torch.distributions.kl``; False if this torch
    refuses classes that are not ``Distribution`` subclasses (then only ours works)."""
    try:
        torch.distributions.kl.register_kl(StructuredDistribution, StructuredDistribution)(
            kl_divergence
        )
    except TypeError:  # pragma: no cover - a torch whose registry checks the classes
        return False
    return True


#: whether ``torch.distributions.kl_divergence`` accepts structured distributions
TORCH_KL_REGISTERED = _register()
