"""The structured training loss: negative log-likelihood of gold structures."""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor

from .base import StructuredDistribution

__all__ = ["structured_nll"]

Reduction = Literal["none", "sum", "mean", "token"]
_REDUCTIONS = ("none", "sum", "mean", "token")


@overload
def structured_nll(
    dist: StructuredDistribution,
    gold: Tensor,
    reduction: Reduction = ...,
    impossible: Literal["raise", "ignore"] = ...,
    return_ignored: Literal[False] = ...,
) -> Tensor: ...


@overload
def structured_nll(
    dist: StructuredDistribution,
    gold: Tensor,
    reduction: Reduction = ...,
    impossible: Literal["raise", "ignore"] = ...,
    *,
    return_ignored: Literal[True],
) -> tuple[Tensor, Tensor]: ...


def structured_nll(
    dist: StructuredDistribution,
    gold: Tensor,
    reduction: Reduction = "mean",
    impossible: Literal["raise", "ignore"] = "raise",
    return_ignored: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""Negative log-likelihood of gold structures, :math:`-\log p(z^*) = \log Z - s(z^*)`.

    The CRF training loss: its gradient with respect to the part scores is
    ``marginals - gold indicators`` (for trees: arc marginals minus the gold arcs).

    Args:
        dist: any structured distribution (:class:`DependencyCRF`,
            :class:`NonProjectiveDependencyCRF`, :class:`LinearChainCRF`, ...).
        gold: the gold structures in the encoding of ``dist.log_prob``: heads LongTensor
            [B, N] (ROOT at 0) for trees, labels [B, N] for chains; entries at padding (and
            at ROOT) are ignored. Heads or labels out of range raise ``ValueError``.
        reduction: ``"none"`` (per item, [B]), ``"sum"``, ``"mean"`` (over items) or
            ``"token"`` (the sum divided by the number of words of a tree (ROOT excluded)
            or positions of a chain, over the items kept).
        impossible: what to do with a gold structure of probability 0 (``log_prob`` is
            ``-inf``: e.g. a non-projective tree under :class:`DependencyCRF`, two
            children of ROOT under ``multiroot=False``, a cycle, a ``-inf`` part). ``"raise"``
            (the default): a ``ValueError`` naming the items and why (a loss of ``inf``
            whose gradient silently drops the gold term would train wrongly). ``"ignore"``:
            those items are left out of the loss (0 in ``"none"``, no gradient) and of the
            counts of ``"mean"`` and ``"token"``; pass ``return_ignored=True`` to get how
            many.
        return_ignored: also return the number of ignored items (LongTensor [], no host
            sync), as ``(loss, ignored)``.

    One host sync (the check for impossible items) unless ``impossible="ignore"``. With no
    item left, ``"mean"`` and ``"token"`` give 0 (still differentiable).

    Example:
        >>> from structattn import DependencyCRF
        >>> tree = DependencyCRF(torch.randn(2, 5, 5, requires_grad=True))
        >>> gold = torch.tensor([[-1, 2, 0, 2, 3], [-1, 0, 1, 1, 3]])
        >>> loss = structured_nll(tree, gold, reduction="token")
        >>> loss.backward()
        >>> bad = torch.tensor([[-1, 3, 0, 0, 1], [-1, 0, 1, 1, 3]])  # item 0: crossing arcs
        >>> loss, ignored = structured_nll(tree, bad, impossible="ignore", return_ignored=True)
        >>> int(ignored)
        1
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"`reduction` must be one of {_REDUCTIONS}, got {reduction!r}")
    if impossible not in ("raise", "ignore"):
        raise ValueError(f"`impossible` must be 'raise' or 'ignore', got {impossible!r}")
    log_prob = dist.log_prob(gold)  # [B]; ValueError for heads / labels out of range
    bad = torch.isneginf(log_prob)  # [B]
    if impossible == "raise" and bool(bad.any()):
        raise ValueError(_impossible_message(dist, gold, bad))
    keep = ~bad
    # where() and not a product: 0 * inf would be NaN; the gradient at ignored items is 0
    nll = torch.where(keep, -log_prob, torch.zeros_like(log_prob))  # [B]
    if reduction == "none":
        loss = nll
    elif reduction == "sum":
        loss = nll.sum()
    elif reduction == "mean":
        loss = nll.sum() / keep.sum().clamp_min(1)
    else:
        tokens = (dist.num_tokens.to(nll.device) * keep).sum()
        loss = nll.sum() / tokens.clamp_min(1)
    if return_ignored:
        return loss, bad.sum()
    return loss


def _impossible_message(dist: StructuredDistribution, gold: Tensor, bad: Tensor) -> str:
    items = bad.nonzero().flatten().tolist()
    reasons = "; ".join(f"item {item}: {dist.impossible_reason(gold, item)}" for item in items[:5])
    more = f"; ... ({len(items) - 5} more)" if len(items) > 5 else ""
    return (
        f"structured_nll: the gold structure of {len(items)} of {bad.numel()} items has "
        f"probability 0 under {type(dist).__name__} (log_prob = -inf, the loss would be inf "
        f"and its gradient would silently leave out the gold term): {reasons}{more}. "
        "Fix the data, or pass impossible='ignore' to leave such items out of the loss "
        "(return_ignored=True counts them)."
    )
