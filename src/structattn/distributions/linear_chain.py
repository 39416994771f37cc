"""Linear-chain CRF distribution."""

from __future__ import annotations

from functools import cached_property

import torch
from torch import Tensor

from .._precision import autocast_widened
from .._validation import check_lengths, check_potentials, length_mask
from ..semirings import LogSemiring, Semiring
from ..structs.linear_chain import (
    chain_inside,
    chain_kbest,
    chain_log_partition,
    chain_marginals,
    chain_score,
)
from .base import StructuredDistribution

__all__ = ["LinearChainCRF"]


class LinearChainCRF(StructuredDistribution):
    r"""Linear-chain CRF over label sequences z_1..z_N with C labels per position.

    .. math:: p(z) \propto \exp\Big(\sum_i \text{unary}_i(z_i)
              + \sum_{i<N} \text{pairwise}_i(z_i, z_{i+1})\Big)

    Args:
        unary: [B, N, C] node log-potentials.
        pairwise: [B, N-1, C, C] or [C, C] (shared by all positions and items);
            ``pairwise[..., i, a, b]`` scores (z_i = a, z_{i+1} = b). ``None`` means zeros
            (independent positions). Entries may be ``-inf`` (forbidden transitions).
        lengths: LongTensor [B] with values in 1..N (``None`` = all N).
        validate_args: check shapes, dtypes and values (one host sync); default True.

    Segmentation attention is C = 2 over N positions; the K-step fact CRF of bAbI is
    C = n facts over N = K steps. Time O(B N C^2), sequential in N. log Z and the marginals
    come from a forward-backward pass written by hand (see
    :mod:`structattn.structs.linear_chain`), and so do their gradients: a loss on the
    marginals back-propagates by a Hessian-vector product, not by a double backward.

    Example:
        >>> crf = LinearChainCRF(torch.randn(2, 5, 3), torch.randn(3, 3))
        >>> crf.marginals.shape, crf.argmax.shape
        (torch.Size([2, 5, 3]), torch.Size([2, 5]))
    """

    def __init__(
        self,
        unary: Tensor,
        pairwise: Tensor | None = None,
        lengths: Tensor | None = None,
        validate_args: bool = True,
    ) -> None:
        if pairwise is not None:  # under autocast: inference in float32
            unary, pairwise = autocast_widened(unary, pairwise)
        else:
            (unary,) = autocast_widened(unary)
        if validate_args:
            check_potentials("unary", unary, rank=3)
        batch, n, c = unary.shape
        if pairwise is None:
            pairwise = unary.new_zeros(c, c)
        if validate_args:
            check_potentials("pairwise", pairwise, rank=pairwise.dim())
            if pairwise.shape not in ((c, c), (batch, n - 1, c, c)):
                raise ValueError(
                    f"`pairwise` must have shape ({c}, {c}) or ({batch}, {n - 1}, {c}, {c}), "
                    f"got {tuple(pairwise.shape)}"
                )
            if pairwise.dtype != unary.dtype or pairwise.device != unary.device:
                raise ValueError("`pairwise` must have the dtype and device of `unary`")
            if n < 1 or c < 1:
                raise ValueError(f"`unary` needs N >= 1 and C >= 1, got shape {(batch, n, c)}")
            lengths = check_lengths(lengths, batch, 1, n, unary.device)
        self.unary = unary
        self.pairwise = pairwise
        self.lengths = lengths
        self._raw = (unary, pairwise)
        self.num_labels = c

    @property
    def mask(self) -> Tensor:
        """BoolTensor [B, N]: True at real positions."""
        batch, n, _ = self.unary.shape
        return length_mask(self.lengths, batch, n, self.unary.device)

    def _parts(self, *raw: Tensor) -> tuple[Tensor, Tensor]:
        unary, pairwise = raw
        batch, n, c = unary.shape
        pairwise = pairwise.expand(batch, n - 1, c, c)  # [B, N-1, C, C], a view
        return self._masked(unary), pairwise

    def _masked(self, unary: Tensor) -> Tensor:
        # padded steps are skipped by the dynamic programs (their gradients, i.e. the edge
        # marginals there, are exactly 0), so the transitions need no masking
        if self.lengths is None:
            return unary
        return unary.masked_fill(~self.mask.unsqueeze(-1), 0.0)

    def _inside(
        self, semiring: type[Semiring], parts: tuple[Tensor, ...], lengths: Tensor | None
    ) -> Tensor:
        unary, pairwise = parts
        if semiring is LogSemiring:
            return chain_log_partition(unary, pairwise, lengths)
        return chain_inside(unary, pairwise, lengths, semiring)

    @property
    def num_tokens(self) -> Tensor:
        """Positions per item, LongTensor [B] (``lengths``, or N for every item)."""
        if self.lengths is None:
            batch, n, _ = self.unary.shape
            return torch.full((batch,), n, dtype=torch.long, device=self.unary.device)
        return self.lengths

    def _to_structure(self, *indicators: Tensor) -> Tensor:
        unary_ind = indicators[0]  # [B, N, C]
        labels = unary_ind.argmax(-1)
        return labels.masked_fill(unary_ind.sum(-1) == 0, -1)

    def _score(self, value: Tensor) -> Tensor:
        unary, pairwise = self._parts(self.unary, self.pairwise)
        mask = self.mask
        if not isinstance(value, Tensor) or value.shape != mask.shape:
            raise ValueError(f"`labels` must be a LongTensor of shape {tuple(mask.shape)}")
        if value.is_floating_point() or value.is_complex():
            raise ValueError(f"`labels` must be an integer tensor, got dtype {value.dtype}")
        value = value.to(device=unary.device, dtype=torch.long)
        bad = ((value < 0) | (value >= self.num_labels)) & mask
        if bad.any():
            raise ValueError(f"`labels` must lie in [0, {self.num_labels}) at real positions")
        return chain_score(unary, pairwise, value, mask)

    # ---- chain-specific outputs -----------------------------------------------------------
    # log Z and the marginals take the transitions as given ([C, C] when shared: one matrix
    # for every step, and its gradient is accumulated without a [B, N-1, C, C] tensor)
    @cached_property
    def log_partition(self) -> Tensor:
        """log Z, shape [B]; ``-inf`` for an item with no valid label sequence."""
        # padding: ignored by chain_log_partition and chain_marginals (masked there only
        # where the PyTorch code reads it)
        return chain_log_partition(self.unary, self.pairwise, self.lengths)

    @cached_property
    def _marginals_tuple(self) -> tuple[Tensor, ...]:
        # forward-backward by hand; differentiable (a loss on it back-propagates by a
        # hand-written Hessian-vector product) exactly when the potentials require grad
        return chain_marginals(self.unary, self.pairwise, self.lengths, edges=True)

    @cached_property
    def _node_marginals(self) -> Tensor:
        if "_marginals_tuple" in self.__dict__:
            return self._marginals_tuple[0]
        return chain_marginals(self.unary, self.pairwise, self.lengths)[0]

    @property
    def marginals(self) -> Tensor:
        """p(z_i = c), shape [B, N, C] (0 at padding)."""
        return self._node_marginals

    @property
    def edge_marginals(self) -> Tensor:
        """p(z_i = a, z_{i+1} = b), shape [B, N-1, C, C] (0 at padding)."""
        return self._marginals_tuple[1]

    def topk(self, k: int) -> tuple[Tensor, Tensor]:
        """Exact k best label sequences: (scores [k, B], labels [k, B, N]), best first.

        Missing sequences (fewer than k with finite score) have score -inf and labels -1.
        """
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"`k` must be a positive int, got {k!r}")
        with torch.no_grad():
            unary, pairwise = self._parts(self.unary, self.pairwise)
            return chain_kbest(unary, pairwise, self.lengths, k)

    @cached_property
    def argmax(self) -> Tensor:
        """Viterbi labels, LongTensor [B, N] (-1 at padding and for items with no valid path)."""
        return self.topk(1)[1][0]

    def log_prob(self, labels: Tensor) -> Tensor:
        """log p(labels), shape [B]; ``labels`` LongTensor [B, N] (padding entries ignored)."""
        return super().log_prob(labels)
