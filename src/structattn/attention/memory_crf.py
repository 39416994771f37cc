"""K-step CRF attention over n memory facts (Kim et al. 2017, sec. 4.3 and Appendix A.4)."""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
from torch import Tensor, nn

from .._validation import check_mask
from ..distributions import LinearChainCRF
from ..names import WeightKind
from ._common import masked_softmax
from ._weights import check_weights

__all__ = [
    "EDGE_UNARIES",
    "LINEAR_QUERY_MODES",
    "QUERY_MODES",
    "EdgeUnary",
    "MemoryCRFAttention",
    "MemoryCRFOutput",
    "QueryMode",
]

#: how q_{k+1} follows from q_k (MemoryCRFAttention's ``query_mode``)
QueryMode = Literal["linear", "memory", "hop", "both"]
QUERY_MODES: tuple[QueryMode, ...] = get_args(QueryMode)
#: the query modes with the learned map Q (``query_update``)
LINEAR_QUERY_MODES: tuple[QueryMode, ...] = ("linear", "both")
#: how often the binary model counts theta_k (MemoryCRFAttention's ``edge_unary``)
EdgeUnary = Literal["once", "per-edge"]
EDGE_UNARIES: tuple[EdgeUnary, ...] = get_args(EdgeUnary)


class MemoryCRFOutput(NamedTuple):
    """Outputs of :class:`MemoryCRFAttention`."""

    context: Tensor  # [B, D]   c = sum_k sum_i p(z_k = i) o_i^k
    marginals: Tensor  # [B, K, n] p(z_k = i)
    edge_marginals: Tensor  # [B, K-1, n, n] p(z_k = i, z_{k+1} = j)
    unary: Tensor  # [B, K, n] theta_k(i)
    pairwise: Tensor | None  # [B, K-1, n, n] (binary model) or None
    queries: Tensor  # [B, K, D] q_1..q_K
    distribution: LinearChainCRF  # the fact-sequence CRF (argmax, topk, entropy, samples)


class MemoryCRFAttention(nn.Module):
    r"""Attention as an n-state, K-step linear-chain CRF over memory facts.

    z_k in {1..n} is the fact selected at inference step k. With per-step fact keys x_i^k,
    values o_i^k and queries q_{k+1} = Q q_k (``query_mode="linear"``, the paper's text) or
    q_{k+1} = sum_i theta_k(i) o_i^k over the real facts (``"memory"``: a fact-dependent
    linear map of q_k, M_k^T X_k q_k, as the SAN authors' released unary model computes its
    second query; it lets a later step's potentials depend on what the story says),
    q_{k+1} = q_k + sum_i softmax(theta_k)(i) o_i^k (``"hop"``: MemN2N's hop, so the CRF's
    unary potentials are MemN2N's attention scores and the pairwise ones come on top) or
    q_{k+1} = Q q_k + sum_i theta_k(i) o_i^k (``"both"``: the paper's and the authors' terms):

    .. math:: \theta_k(i) = (x_i^k)^\top q_k, \qquad
              \theta_{k,k+1}(i, j) = (x_i^k)^\top x_j^{k+1}\ \ (\text{binary model})

    and ``no_repeat`` sets theta_{k,k+1}(i, i) = -inf. The paper writes the binary edge
    potential as theta_k(i) + (x_i^k)^T x_j^{k+1} + theta_{k+1}(j): for K = 2 the same
    distribution, with the node terms kept as unary potentials here (for K > 2 a sum of the
    paper's edge potentials counts the inner steps' theta_k twice). The context is a single vector
    ``c = sum_k sum_i p(z_k = i | x, q) o_i^k`` (forward-backward marginals).

    Args:
        embed_dim: size D of keys, values and queries.
        steps: K >= 1 inference steps (K = 1 is softmax attention over the facts).
        binary: add the fact-to-fact pairwise potentials (default True).
        no_repeat: forbid selecting the same fact at consecutive steps (default: ``binary``).
        normalize_potentials: log-softmax the unary potentials over facts at each step.
        query_mode: ``"linear"`` (Q, a learned D x D map), ``"memory"`` (no parameters;
            the raw scores theta_k, before any log-softmax, weight the values), ``"hop"``
            (no parameters; q_k plus the values weighted by softmax(theta_k), MemN2N's hop)
            or ``"both"`` (Q q_k plus the ``"memory"`` term).
        edge_unary: ``"once"`` (each theta_k once) or ``"per-edge"`` (binary model: the
            paper's edge potentials summed, so the inner steps' theta_k count twice; the
            same as ``"once"`` for K <= 2).
        validate_args: accepted by every structured layer; this one checks no value on the
            host either way (any mask pattern is valid), so it never synchronises.
        weights: what ``marginals`` / ``edge_marginals`` (and the context) are:
            ``"marginals"`` (default, forward-backward), ``"sparse"`` (SparseMAP's: a mix of
            few fact sequences) or ``"hard-st"`` (the Viterbi sequence's indicators forward,
            the marginals' gradient backward: straight-through).

    Forward: ``query`` [B, D]; ``keys`` and ``values`` [B, K, n, D] (per step) or [B, n, D]
    (shared by all steps); ``mask`` BoolTensor [B, n] (True = real fact; any pattern);
    ``pairwise=False`` drops the binary model's fact-to-fact potentials for one call.
    :meth:`crf`, :meth:`decode` and :meth:`topk` need ``values`` in every mode but
    ``"linear"``.
    Items whose constraints leave no valid fact sequence (e.g. one fact with ``no_repeat``
    and K >= 2) get zero marginals and a zero context.

    Example:
        >>> attn = MemoryCRFAttention(20, steps=3)
        >>> out = attn(torch.randn(2, 20), torch.randn(2, 7, 20), torch.randn(2, 7, 20))
        >>> out.context.shape, out.marginals.shape, out.edge_marginals.shape
        (torch.Size([2, 20]), torch.Size([2, 3, 7]), torch.Size([2, 2, 7, 7]))
    """

    def __init__(
        self,
        embed_dim: int,
        steps: int,
        binary: bool = True,
        no_repeat: bool | None = None,
        normalize_potentials: bool = False,
        query_mode: QueryMode = "linear",
        edge_unary: EdgeUnary = "once",
        validate_args: bool = True,
        weights: WeightKind = "marginals",
    ) -> None:
        super().__init__()
        self.validate_args = validate_args  # nothing to check on the host (any mask)
        self.weights_mode = check_weights(weights)  # marginals, SparseMAP or hard-st
        if steps < 1:
            raise ValueError(f"`steps` must be >= 1, got {steps}")
        if query_mode not in QUERY_MODES:
            raise ValueError(f"`query_mode` must be one of {QUERY_MODES}, got {query_mode!r}")
        self.query_mode = query_mode
        if edge_unary not in EDGE_UNARIES:
            raise ValueError(f"`edge_unary` must be one of {EDGE_UNARIES}, got {edge_unary!r}")
        self.edge_unary = edge_unary
        self.embed_dim = embed_dim
        self.steps = steps
        self.binary = binary
        self.no_repeat = binary if no_repeat is None else no_repeat
        self.normalize_potentials = normalize_potentials
        # Q of q_{k+1} = Q q_k (+ the fact read in "both" mode)
        self.query_update = (
            nn.Linear(embed_dim, embed_dim, bias=False)
            if query_mode in LINEAR_QUERY_MODES
            else None
        )

    def _per_step(self, x: Tensor, name: str) -> Tensor:
        if x.dim() == 3:
            return x.unsqueeze(1).expand(-1, self.steps, -1, -1)  # [B, K, n, D]
        if x.dim() != 4 or x.shape[1] != self.steps:
            raise ValueError(
                f"`{name}` must have shape [B, n, D] or [B, {self.steps}, n, D], "
                f"got {tuple(x.shape)}"
            )
        return x

    def queries(self, query: Tensor) -> Tensor:
        """q_1..q_K, [B, K, D] (``"linear"`` mode: they do not depend on the facts)."""
        if self.query_mode != "linear" or self.query_update is None:
            raise ValueError(
                f"`queries` needs the facts in {self.query_mode!r} mode: use `crf(..., values)`"
            )
        out = [query]
        for _ in range(self.steps - 1):
            out.append(self.query_update(out[-1]))
        return torch.stack(out, dim=1)

    def _scores_and_queries(
        self, query: Tensor, keys: Tensor, values: Tensor | None, mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """(theta [B, K, n] raw, real facts only; queries [B, K, D])."""
        if self.query_mode == "linear":
            queries = self.queries(query)
            return torch.einsum("bknd,bkd->bkn", keys, queries), queries
        if values is None:
            raise ValueError(f"`values` are needed to form the queries in {self.query_mode!r} mode")
        values = self._per_step(values, "values")
        if values.shape[:3] != keys.shape[:3]:
            raise ValueError(f"`values` {tuple(values.shape)} must match `keys`' [B, K, n]")
        scores: list[Tensor] = []
        steps: list[Tensor] = []
        q = query
        for k in range(self.steps):  # sequential: q_{k+1} depends on step k's scores
            steps.append(q)
            theta = torch.einsum("bnd,bd->bn", keys[:, k], q).masked_fill(~mask, 0.0)
            scores.append(theta)
            if self.query_mode == "hop":  # MemN2N: q_{k+1} = q_k + sum_i p_k(i) o_i^k
                q = q + torch.einsum("bn,bnd->bd", masked_softmax(theta, mask), values[:, k])
            else:
                read = torch.einsum("bn,bnd->bd", theta, values[:, k])
                if self.query_mode == "both":  # Q q_k + the read
                    assert self.query_update is not None
                    read = self.query_update(q) + read
                q = read
        return torch.stack(scores, 1), torch.stack(steps, 1)

    def crf(
        self,
        query: Tensor,
        keys: Tensor,
        mask: Tensor | None = None,
        pairwise: bool = True,
        values: Tensor | None = None,
    ) -> tuple[LinearChainCRF, Tensor, Tensor | None, Tensor]:
        """The fact-sequence CRF and its (unary, pairwise, queries); ``pairwise=False`` leaves
        out the fact-to-fact potentials of the binary model for this call (``no_repeat`` is
        kept); ``values`` for every query mode but ``"linear"``."""
        if query.dim() != 2 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"`query` must have shape [B, {self.embed_dim}]")
        keys = self._per_step(keys, "keys")  # [B, K, n, D]
        batch, _, n, _ = keys.shape
        if n == 0:
            raise ValueError("`keys` must hold at least one memory fact, got 0")
        mask = check_mask("mask", mask, (batch, n), keys.device)
        unary, queries = self._scores_and_queries(query, keys, values, mask)  # theta_k(i)
        unary = unary.masked_fill(~mask.unsqueeze(1), float("-inf"))
        if self.normalize_potentials:
            unary = torch.log_softmax(unary, dim=-1).masked_fill(~mask.unsqueeze(1), float("-inf"))
        if self.binary and pairwise and self.edge_unary == "per-edge" and self.steps > 2:
            inner = torch.ones(self.steps, 1, dtype=unary.dtype, device=unary.device)
            inner[1:-1] = 2.0  # steps 2..K-1 sit on two edges
            unary = unary * inner
        edges = None
        chain_pairwise = unary.new_zeros(batch, self.steps - 1, n, n)
        if self.binary and pairwise:
            edges = torch.einsum("bkid,bkjd->bkij", keys[:, :-1], keys[:, 1:])
            chain_pairwise = edges
        if self.no_repeat:
            eye = torch.eye(n, dtype=torch.bool, device=keys.device)
            chain_pairwise = chain_pairwise.masked_fill(eye, float("-inf"))
        crf = LinearChainCRF(unary, chain_pairwise, validate_args=False)
        return crf, unary, edges, queries

    def forward(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor,
        mask: Tensor | None = None,
        pairwise: bool = True,
    ) -> MemoryCRFOutput:
        crf, unary, edges, queries = self.crf(query, keys, mask, pairwise, values)
        values = self._per_step(values, "values")  # [B, K, n, D]
        marginals, edge_marginals = self._weights(crf)  # [B, K, n], [B, K-1, n, n]
        context = torch.einsum("bkn,bknd->bd", marginals, values)
        return MemoryCRFOutput(context, marginals, edge_marginals, unary, edges, queries, crf)

    def _weights(self, crf: LinearChainCRF) -> tuple[Tensor, Tensor]:
        """(node, edge) weights of the chain under the ``weights`` option."""
        if self.weights_mode == "marginals":
            return crf.marginals, crf.edge_marginals
        if self.weights_mode == "sparse":
            node, edge = crf.sparsemap().parts
            return node, edge
        node = crf.straight_through()  # exactly 0/1 forward
        hard = node.detach()
        soft_edge = crf.edge_marginals
        hard_edge = hard[:, :-1, :, None] * hard[:, 1:, None, :]  # consecutive facts
        return node, hard_edge + (soft_edge - soft_edge.detach())

    @torch.no_grad()
    def decode(
        self, query: Tensor, keys: Tensor, mask: Tensor | None = None, values: Tensor | None = None
    ) -> Tensor:
        """MAP fact sequence, LongTensor [B, K] (0-based fact indices; -1 if none is valid)."""
        return self.crf(query, keys, mask, values=values)[0].argmax

    @torch.no_grad()
    def topk(
        self,
        query: Tensor,
        keys: Tensor,
        k: int,
        mask: Tensor | None = None,
        values: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The k most probable fact sequences: (probabilities [k, B], sequences [k, B, K])."""
        crf = self.crf(query, keys, mask, values=values)[0]
        scores, sequences = crf.topk(k)
        return (scores - crf.log_partition).exp(), sequences
