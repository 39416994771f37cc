r"""Attention-limit gates of PRPN (Shen et al., 2018): stick-breaking and Bradley-Terry.

Every query step t of a sequence of length T owns a latent l_t in {0, ..., t-1}: the leftmost
memory that step t may read. The hard gates are g_i(l_t) = 1(l_t <= i) and the attention is the
raw attention s~ (a softmax over the memories i < t) renormalised by the gates (eq. 3)

.. math:: s_i(l_t) = g_i(l_t) \tilde s_i / \sum_j g_j(l_t) \tilde s_j .

**Stick-breaking** (eq. 4). Gates alpha_k in [0, 1] ("the stick continues past k") give

.. math:: p(l_t = k) = (1 - \alpha_k) \prod_{j=k+1}^{t-1} \alpha_j  \quad (1 <= k <= t-1),
          \qquad p(l_t = 0) = \prod_{j=1}^{t-1} \alpha_j ,

so the expected gates are the CDF of l_t (eq. 5), telescoping the sum over k <= i:

.. math:: E[g_i(l_t)] = P(l_t <= i) = \prod_{j=i+1}^{t-1} \alpha_j .

PRPN uses E[g] in place of g in eq. 3 (eq. 6, :func:`gated_attention_weights`) with

.. math:: \alpha_k = (\mathrm{hardtanh}(2 (d_t - d_k) / \tau + 1) + 1) / 2
          = \mathrm{clamp}(1 + (d_t - d_k) / \tau, 0, 1)      \quad (eq. 7)

from syntactic distances d (:func:`stick_breaking_gates`): the gate is fully open when
d_k <= d_t and closed when d_k >= d_t + tau.

**Bradley-Terry** (notes, section 5.3). Independent alpha'_i ~ Bern(d_i / (d_t + d_i)) and
l_t = max{i : alpha'_i = 1} (0 when no i >= 1 fires). Since "stop at i" has probability
d_i / (d_t + d_i), this is exactly stick-breaking with the continue-probability

.. math:: \alpha_i = 1 - p(\alpha'_i = 1) = d_t / (d_t + d_i)

(:func:`bradley_terry_gates`), so the same two functions give its exact distribution and CDF.

Conventions (all functions batched, every step t at once):

* Tensors over (query, key) pairs are [B, T, T]: ``x[b, t, k]`` belongs to query step t and
  key/memory k; only k < t is meaningful, every other entry is 0 on output.
* Position 0 is a sentinel: alpha_0 is never used (p(l_t = 0) is the mass left when the stick
  survives every j >= 1). With a ``mask`` (BoolTensor [B, T], True = real token) padded keys
  are transparent (alpha = 1, zero mass) and the first *real* position plays the sentinel, so a
  padded sequence gives exactly the values of the same sequence without its padding, wherever
  the padding is. Rows of padded queries are 0.
* Step t = 0 (and any step with no real memory before it) has an all-zero row: no memory, so
  p(l_t) and E[g] are empty there, and the gated attention is 0 (see
  :func:`gated_attention_weights` for rows whose gated mass vanishes).
* Products are computed with :func:`torch.cumprod`, whose backward is exact when some alpha is
  exactly 0 or 1 (hardtanh saturates): no logs, no NaN in values or gradients.

Tree extraction (notes, section 4) needs no dynamic program and lives in :mod:`structattn.trees`:
:func:`~structattn.trees.split_tree` greedily splits a span at the argmax of the distances;
:func:`~structattn.trees.tree_to_brackets` and :func:`~structattn.trees.tree_spans` serialise
the result (all three, and ``Tree``, are re-exported here under their old import path).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from .._validation import check_mask, check_potentials
from ..trees import Tree, split_tree, tree_spans, tree_to_brackets  # re-exported (old path)

__all__ = [
    "Tree",
    "bradley_terry_distribution",
    "bradley_terry_expected_gates",
    "bradley_terry_gates",
    "expected_gates",
    "gated_attention_weights",
    "split_tree",
    "stick_breaking_distribution",
    "stick_breaking_gates",
    "tree_spans",
    "tree_to_brackets",
]


# ---- validation and masks ----------------------------------------------------------------------
def _check_pairwise(name: str, x: object) -> Tensor:
    """A finite floating tensor [B, T, T]."""
    x = check_potentials(name, x, rank=3, allow_neg_inf=False)
    if x.shape[1] != x.shape[2]:
        raise ValueError(f"`{name}` must have shape [B, T, T], got {tuple(x.shape)}")
    return x


def _check_distances(distances: object) -> Tensor:
    """A finite floating tensor [B, T]."""
    return check_potentials("distances", distances, rank=2, allow_neg_inf=False)


def _check_query(query_distances: Tensor | None, distances: Tensor) -> Tensor:
    """``query_distances`` (default ``distances``), a finite tensor of the shape of d [B, T]."""
    if query_distances is None:
        return distances
    query = check_potentials("query_distances", query_distances, rank=2, allow_neg_inf=False)
    if query.shape != distances.shape:
        raise ValueError(
            f"`query_distances` must have the shape of `distances` {tuple(distances.shape)}, "
            f"got {tuple(query.shape)}"
        )
    return query


def _pair_mask(mask: Tensor) -> Tensor:
    """BoolTensor [B, T, T]: True where key k < query t and both are real tokens."""
    n = mask.shape[-1]
    steps = torch.arange(n, device=mask.device)
    causal = steps.unsqueeze(-1) > steps  # [T, T], key k < query t (cheaper than bool tril)
    return causal & mask.unsqueeze(-1) & mask.unsqueeze(-2)  # [B, T, T]


def _sentinel(mask: Tensor) -> Tensor:
    """BoolTensor [B, T]: True at the first real position of each sequence."""
    return mask & (mask.long().cumsum(-1) == 1)


# ---- gates and distributions ------------------------------------------------------------------
def stick_breaking_gates(
    distances: Tensor,
    tau: float,
    mask: Tensor | None = None,
    query_distances: Tensor | None = None,
) -> Tensor:
    r"""PRPN's stick-breaking gates (eq. 7) for every query step at once.

    .. math:: \alpha[b, t, k] = (\mathrm{hardtanh}(2 (d_t - d_k) / \tau + 1) + 1) / 2,
              \qquad k < t

    Args:
        distances: [B, T] syntactic distances d (any real values; PRPN's are >= 0).
        tau: temperature > 0 (PRPN's ``resolution``); alpha goes linearly from 1 at
            d_k = d_t to 0 at d_k = d_t + tau.
        mask: BoolTensor [B, T], True at real tokens.
        query_distances: [B, T] distances q used on the query side instead of d
            (alpha[b, t, k] from q_t - d_k), e.g. PRPN's predicted distance of the next token
            for its Predict Network; default d itself.

    Returns:
        alpha [B, T, T]; entries with k >= t or a padded t or k are 0 (they are ignored by
        :func:`expected_gates` and :func:`stick_breaking_distribution`, which take any alpha
        in [0, 1], e.g. a hand-made one).

    Example:
        >>> d = torch.tensor([[0.7, 0.6, 0.3, 0.4, 0.5]])
        >>> stick_breaking_gates(d, tau=1.0)[0, 4]
        tensor([0.8000, 0.9000, 1.0000, 1.0000, 0.0000])
    """
    distances = _check_distances(distances)
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 < tau < float("inf"):
        raise ValueError(f"`tau` must be a finite number > 0, got {tau!r}")
    batch, n = distances.shape
    mask = check_mask("mask", mask, (batch, n), distances.device)
    query = _check_query(query_distances, distances)
    diff = query.unsqueeze(-1) - distances.unsqueeze(-2)  # [B, T, T], d_t - d_k
    alpha = (F.hardtanh(2.0 * diff / tau + 1.0) + 1.0) / 2.0
    return alpha * _pair_mask(mask).to(alpha.dtype)


def bradley_terry_gates(
    distances: Tensor, mask: Tensor | None = None, query_distances: Tensor | None = None
) -> Tensor:
    r"""Bradley-Terry gates as stick-breaking continue-probabilities (notes, section 5.3).

    .. math:: \alpha[b, t, k] = 1 - p(\alpha'_k = 1) = d_t / (d_t + d_k), \qquad k < t

    where p(alpha'_k = 1) = d_k / (d_t + d_k) is the probability that l_t stops at k. Feed the
    result to :func:`stick_breaking_distribution` / :func:`expected_gates` (or use
    :func:`bradley_terry_distribution` / :func:`bradley_terry_expected_gates`).

    Args:
        distances: [B, T] scores d > 0 at every real position (padded entries are ignored
            but must be finite).
        mask: BoolTensor [B, T], True at real tokens.
        query_distances: [B, T] scores q > 0 used on the query side instead of d
            (alpha[b, t, k] = q_t / (q_t + d_k)); default d itself.

    Returns:
        alpha [B, T, T]; 0 where k >= t or t or k is padded.

    Raises:
        ValueError: if a real distance (or query distance) is <= 0.
    """
    distances = _check_distances(distances)
    batch, n = distances.shape
    mask = check_mask("mask", mask, (batch, n), distances.device)
    query = _check_query(query_distances, distances)
    if (distances[mask] <= 0).any() or (query[mask] <= 0).any():
        raise ValueError("`distances` must be > 0 at every real position for Bradley-Terry gates")
    safe = torch.where(mask, distances, torch.ones_like(distances))  # [B, T], padding -> 1
    d_query = torch.where(mask, query, torch.ones_like(query)).unsqueeze(-1)  # [B, T, 1], q_t
    d_key = safe.unsqueeze(-2)  # [B, 1, T], d_k
    alpha = d_query / (d_query + d_key)  # [B, T, T]
    return alpha * _pair_mask(mask).to(alpha.dtype)


def _prepare_alpha(alpha: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Validate ``alpha`` and return (alpha_hat, valid, sentinel, mask).

    ``alpha_hat`` [B, T, T] equals alpha at real keys k < t other than the sentinel and 1
    elsewhere, so that a product over j in (i, T) is the product over real j in (i, t).
    ``valid`` [B, T, T] marks real pairs k < t; ``sentinel`` [B, 1, T] the first real key.
    """
    alpha = _check_pairwise("alpha", alpha)
    if ((alpha < 0) | (alpha > 1)).any():
        raise ValueError("`alpha` must lie in [0, 1]")
    batch, n, _ = alpha.shape
    mask = check_mask("mask", mask, (batch, n), alpha.device)
    valid = _pair_mask(mask)  # [B, T, T]
    sentinel = _sentinel(mask).unsqueeze(-2)  # [B, 1, T]
    alpha_hat = torch.where(valid & ~sentinel, alpha, torch.ones_like(alpha))
    return alpha_hat, valid, sentinel, mask


def _suffix_products(alpha_hat: Tensor) -> Tensor:
    """[B, T, T]: ``out[..., i] = prod_{j > i} alpha_hat[..., j]`` (exclusive, empty = 1)."""
    inclusive = torch.cumprod(alpha_hat.flip(-1), dim=-1).flip(-1)  # prod_{j >= i}
    ones = torch.ones_like(alpha_hat[..., :1])
    return torch.cat([inclusive[..., 1:], ones], dim=-1)


def expected_gates(alpha: Tensor, mask: Tensor | None = None) -> Tensor:
    r"""Expected gates E[g_i(l_t)] = P(l_t <= i) = prod_{j=i+1}^{t-1} alpha_j (eq. 5).

    Args:
        alpha: [B, T, T] continue-probabilities in [0, 1], ``alpha[b, t, k]`` for key k < t
            (from :func:`stick_breaking_gates`, :func:`bradley_terry_gates` or by hand);
            entries with k >= t, k = 0 (the sentinel) or padded t, k are ignored.
        mask: BoolTensor [B, T], True at real tokens.

    Returns:
        E[g] [B, T, T], in [0, 1], non-decreasing in i up to ``E[g_{t-1}] = 1``; 0 for
        k >= t and at padding. Exact values and gradients for alpha exactly 0 or 1.

    Example:
        >>> a = torch.zeros(1, 5, 5)
        >>> a[0, 4, :4] = torch.tensor([0.0, 0.45, 0.6, 0.55])
        >>> expected_gates(a)[0, 4]
        tensor([0.1485, 0.3300, 0.5500, 1.0000, 0.0000])
    """
    alpha_hat, valid, _, _ = _prepare_alpha(alpha, mask)
    # [B, T, T]: product over real j in (i, t); keys before the sentinel are padding (invalid)
    return _suffix_products(alpha_hat) * valid.to(alpha_hat.dtype)


def stick_breaking_distribution(alpha: Tensor, mask: Tensor | None = None) -> Tensor:
    r"""p(l_t = k) of the stick-breaking process (eq. 4) for every step t.

    .. math:: p(l_t = k) = (1 - \alpha_k) \prod_{j=k+1}^{t-1} \alpha_j, \quad 1 <= k < t;
              \qquad p(l_t = 0) = \prod_{j=1}^{t-1} \alpha_j

    Args:
        alpha: [B, T, T] as in :func:`expected_gates`.
        mask: BoolTensor [B, T], True at real tokens (the first real position takes the role
            of position 0).

    Returns:
        p [B, T, T]; each row t sums to 1 over k < t when step t has a real memory before it,
        otherwise (t = 0, padded t) the row is 0.
    """
    alpha_hat, valid, sentinel, _ = _prepare_alpha(alpha, mask)
    survive = _suffix_products(alpha_hat)  # [B, T, T], prod_{j in (k, t)} alpha_j
    stop = torch.where(sentinel, torch.ones_like(alpha_hat), 1.0 - alpha_hat)  # 1 - alpha_k
    # padded keys (alpha_hat = 1) get stop = 0; the sentinel stops with probability 1
    return stop * survive * valid.to(survive.dtype)


def bradley_terry_distribution(distances: Tensor, mask: Tensor | None = None) -> Tensor:
    r"""Exact p(l_t = k) of the Bradley-Terry model (notes, section 5.3) for every step t.

    With independent alpha'_i ~ Bern(d_i / (d_t + d_i)) and
    l_t = max({0} U {i >= 1 : alpha'_i = 1}):

    .. math:: p(l_t = k) = \frac{d_k}{d_t + d_k} \prod_{j=k+1}^{t-1} \frac{d_t}{d_t + d_j},
              \quad 1 <= k < t; \qquad p(l_t = 0) = \prod_{j=1}^{t-1} \frac{d_t}{d_t + d_j}

    Args:
        distances: [B, T] scores d > 0 at real positions.
        mask: BoolTensor [B, T], True at real tokens.

    Returns:
        p [B, T, T], rows summing to 1 over k < t (0 rows as in
        :func:`stick_breaking_distribution`).

    Example:
        >>> d = torch.tensor([[0.7, 0.6, 0.3, 0.4, 0.5]], dtype=torch.float64)
        >>> (bradley_terry_distribution(d)[0, 4] * 792).round()
        tensor([125., 150., 165., 352.,   0.], dtype=torch.float64)
    """
    return stick_breaking_distribution(bradley_terry_gates(distances, mask), mask)


def bradley_terry_expected_gates(distances: Tensor, mask: Tensor | None = None) -> Tensor:
    r"""E[g_i(l_t)] = P(l_t <= i) = prod_{j=i+1}^{t-1} d_t / (d_t + d_j) under Bradley-Terry.

    Shapes and conventions as in :func:`expected_gates`; plug the result into
    :func:`gated_attention_weights`.
    """
    return expected_gates(bradley_terry_gates(distances, mask), mask)


def gated_attention_weights(
    raw_attention: Tensor, gates: Tensor, mask: Tensor | None = None
) -> Tensor:
    r"""Renormalise raw attention by (expected) gates, eq. 6, for every step at once.

    .. math:: s_{t,i} = \frac{E[g_i(l_t)] \tilde s_{t,i}}{\sum_{j<t} E[g_j(l_t)] \tilde s_{t,j}}

    Args:
        raw_attention: [B, T, T] non-negative raw attention s~, ``[b, t, i]`` for memory i < t
            (usually a causal softmax; only i < t at real positions is read).
        gates: [B, T, T] non-negative gates (hard 0/1 gates, :func:`expected_gates`, ...).
        mask: BoolTensor [B, T], True at real tokens.

    Returns:
        weights [B, T, T]: 0 for i >= t and at padding. A row whose gated mass
        sum_j E[g_j] s~_j is 0 (or below the dtype's smallest normal number) -- step t = 0, a
        padded step, or gates that close every memory with raw attention -- is all 0, i.e. the
        step reads nothing (context 0); it does not fall back to the raw attention, so a
        memory with gate 0 never gets weight. Gradients stay finite there. Every other row
        sums to 1. With all gates 1 the result is the raw attention renormalised over i < t
        (equal to it when the raw rows already sum to 1).

    Example:
        >>> raw = torch.zeros(1, 5, 5); raw[0, 4, :4] = torch.tensor([0.4, 0.1, 0.3, 0.2])
        >>> g = torch.zeros(1, 5, 5); g[0, 4, :4] = torch.tensor([0.0, 0.0, 1.0, 1.0])
        >>> gated_attention_weights(raw, g)[0, 4]
        tensor([0.0000, 0.0000, 0.6000, 0.4000, 0.0000])
    """
    raw_attention = _check_pairwise("raw_attention", raw_attention)
    gates = _check_pairwise("gates", gates)
    if gates.shape != raw_attention.shape:
        raise ValueError(
            f"`gates` must have the shape of `raw_attention` {tuple(raw_attention.shape)}, "
            f"got {tuple(gates.shape)}"
        )
    if (raw_attention < 0).any():
        raise ValueError("`raw_attention` must be non-negative")
    if (gates < 0).any():
        raise ValueError("`gates` must be non-negative")
    batch, n, _ = raw_attention.shape
    mask = check_mask("mask", mask, (batch, n), raw_attention.device)
    valid = _pair_mask(mask).to(raw_attention.dtype)  # [B, T, T]
    gated = gates * raw_attention * valid  # [B, T, T], E[g_i] s~_i
    total = gated.sum(-1, keepdim=True)  # [B, T, 1]
    positive = total >= torch.finfo(total.dtype).tiny
    safe_total = torch.where(positive, total, torch.ones_like(total))
    return torch.where(positive, gated / safe_total, torch.zeros_like(gated))
