"""Linear-chain CRF distribution."""

from __future__ import annotations

import torch
from torch import Tensor

from .._precision import autocast_widened
from .._validation import check_lengths, check_potentials, last_index, length_mask
from ..semirings import LogSemiring, Semiring
from ..structs.linear_chain import (
    chain_argmax,
    chain_inside,
    chain_kbest,
    chain_log_partition,
    chain_marginals,
    chain_score,
)
from .base import StructuredDistribution, cached_property, check_temperature, tempered_inputs

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
        start_transitions: Tensor | None = None,
        end_transitions: Tensor | None = None,
        *,
        temperature: float = 1.0,
    ) -> None:
        self.temperature = check_temperature(temperature)
        ends = [t for t in (start_transitions, end_transitions) if t is not None]
        if pairwise is not None:  # under autocast: inference in float32
            unary, pairwise, *ends = autocast_widened(unary, pairwise, *ends)
        else:
            unary, *ends = autocast_widened(unary, *ends)
        if start_transitions is not None:
            start_transitions = ends.pop(0)
        if end_transitions is not None:
            end_transitions = ends.pop(0)
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
            for name, t in (
                ("start_transitions", start_transitions),
                ("end_transitions", end_transitions),
            ):
                if t is not None:
                    _check_end_scores(name, t, unary)
        if self.temperature != 1.0:  # every potential divided by t (#41.7)
            unary, pairwise = tempered_inputs(self.temperature, unary, pairwise)
            if start_transitions is not None:
                (start_transitions,) = tempered_inputs(self.temperature, start_transitions)
            if end_transitions is not None:
                (end_transitions,) = tempered_inputs(self.temperature, end_transitions)
        self.start_transitions = start_transitions
        self.end_transitions = end_transitions
        if start_transitions is not None or end_transitions is not None:
            unary = _fold_ends(unary, start_transitions, end_transitions, lengths)
        self.unary = unary
        self.pairwise = pairwise
        self.lengths = lengths
        self._raw = (unary, pairwise)
        self.num_labels = c

    @classmethod
    def from_hmm(
        cls,
        init: Tensor,
        transition: Tensor,
        emission: Tensor,
        observations: Tensor,
        lengths: Tensor | None = None,
        validate_args: bool = True,
    ) -> LinearChainCRF:
        r"""The posterior of a hidden Markov model over its hidden states given observations.

        .. math:: p(z, x) = \pi(z_1)\, e(x_1 \mid z_1) \prod_{i > 1} t(z_i \mid z_{i-1})\,
                  e(x_i \mid z_i)

        is a linear-chain CRF with ``unary[b, i, c] = emission[c, x_i]``,
        ``pairwise = transition`` and ``start_transitions = init``, so that ``log_partition``
        is :math:`\log p(x)` (the forward algorithm's likelihood), ``marginals`` the
        posteriors :math:`p(z_i \mid x)` and ``argmax`` the Viterbi states; differentiable in
        every parameter (and ``-log_partition`` is the HMM's negative log-likelihood).

        Args:
            init: [C] or [B, C], :math:`\log \pi(c)`.
            transition: [C, C] or [B, N-1, C, C], ``transition[..., a, c]`` =
                :math:`\log t(z_{i+1} = c \mid z_i = a)`.
            emission: [C, V] or [B, C, V], ``emission[..., c, v]`` =
                :math:`\log e(x_i = v \mid z_i = c)`.
            observations: LongTensor [B, N] of symbols in 0..V-1 (any value at padding).
            lengths: LongTensor [B] in 1..N (``None`` = all N).
            validate_args: check shapes and values; default True.

        The arguments are log-probabilities (normalisation is not checked: any scores give a
        valid CRF, whose log Z is then the log of the un-normalised total). ``-inf`` entries
        (impossible transitions or emissions) are allowed.

        Example:
            >>> hmm = LinearChainCRF.from_hmm(torch.tensor([0.6, 0.4]).log(),
            ...     torch.tensor([[0.7, 0.3], [0.4, 0.6]]).log(),
            ...     torch.tensor([[0.5, 0.4, 0.1], [0.1, 0.3, 0.6]]).log(),
            ...     torch.tensor([[0, 1, 2]]))
            >>> round(hmm.log_partition.exp().item(), 5)  # p(x = 0, 1, 2)
            0.03628
        """
        if validate_args:
            if not isinstance(observations, Tensor) or observations.dim() != 2:
                raise ValueError("`observations` must be a LongTensor of shape [B, N]")
            if observations.is_floating_point() or observations.is_complex():
                raise ValueError(
                    f"`observations` must be an integer tensor, got dtype {observations.dtype}"
                )
            check_potentials("emission", emission, rank=emission.dim())
            if emission.dim() not in (2, 3):
                raise ValueError(
                    f"`emission` must have shape [C, V] or [B, C, V], got {tuple(emission.shape)}"
                )
        batch, n = observations.shape
        symbols = emission.shape[-1]
        emission = emission.expand(batch, *emission.shape[-2:])  # [B, C, V]
        observations = observations.to(device=emission.device, dtype=torch.long)
        real = length_mask(lengths, batch, n, emission.device)
        if validate_args:
            lengths = check_lengths(lengths, batch, 1, n, emission.device)
            real = length_mask(lengths, batch, n, emission.device)
            bad = ((observations < 0) | (observations >= symbols)) & real
            if bool(bad.any()):
                raise ValueError(f"`observations` must lie in [0, {symbols}) at real positions")
        safe = observations.masked_fill(~real, 0).clamp(0, max(symbols - 1, 0))
        # unary[b, i, c] = emission[b, c, x_{b, i}]
        unary = emission.gather(2, safe.unsqueeze(1).expand(batch, emission.shape[1], n))
        return cls(
            unary.transpose(1, 2),
            transition,
            lengths,
            validate_args=validate_args,
            start_transitions=init,
        )

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
        Ties are broken the same way for every k, so ``topk(k)[1][0]`` is ``argmax`` for
        every k (see :func:`~structattn.structs.linear_chain.chain_kbest`). The scores are
        differentiable when the potentials require grad (the gradient of a sequence's score
        is its indicators: its labels and transitions).
        """
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"`k` must be a positive int, got {k!r}")
        with torch.no_grad():
            unary, pairwise = self._parts(self.unary, self.pairwise)
            scores, labels = chain_kbest(unary, pairwise, self.lengths, k)
        if self._differentiable():
            scores = torch.stack(
                [self._labels_score(z, s) for z, s in zip(labels, scores, strict=True)]
            )
        return scores, labels

    def _labels_score(self, labels: Tensor, best: Tensor) -> Tensor:
        """Differentiable score of label sequences [B, N] found by a k-best pass (unchecked),
        [B]; ``best`` [B] is their score from that pass (``-inf``: no sequence, kept)."""
        unary, pairwise = self._parts(self.unary, self.pairwise)
        score = chain_score(unary, pairwise, labels.clamp_min(0), self.mask)  # -1: no sequence
        return torch.where(torch.isneginf(best), best.detach(), score)

    @cached_property
    def _kernel_viterbi(self) -> tuple[Tensor, Tensor] | None:
        """(best score [B], labels [B, N]) from the C++ Viterbi kernel, or None where it does
        not serve these potentials (see :func:`~structattn.structs.linear_chain.chain_argmax`)."""
        with torch.no_grad():
            return chain_argmax(self.unary, self.pairwise, self.lengths)

    @cached_property
    def _viterbi(self) -> tuple[Tensor, Tensor]:
        """(best score [B], labels [B, N]), detached: the C++ Viterbi kernel where it applies,
        else the k-best pass with k = 1 (the same sequence and score)."""
        if self._kernel_viterbi is not None:
            return self._kernel_viterbi
        with torch.no_grad():
            unary, pairwise = self._parts(self.unary, self.pairwise)
            scores, labels = chain_kbest(unary, pairwise, self.lengths, 1)
        return scores[0], labels[0]

    @cached_property
    def max_score(self) -> Tensor:
        """Score of the best label sequence, shape [B] (``-inf`` if none is valid).

        Differentiable when the potentials require grad: its gradient is the indicators of
        ``argmax`` (its labels and transitions; 0 for an item with no valid sequence), so a
        perceptron or max-margin loss ``max_score - score(gold)`` trains through both terms.
        On CPU with the C++ kernels the Viterbi kernel finds the sequence (and, without
        gradients, gives the score: shared with ``argmax``, one pass for both)."""
        if not self._differentiable() and self._kernel_viterbi is not None:
            return self._kernel_viterbi[0]
        return super().max_score

    @cached_property
    def argmax(self) -> Tensor:
        """Viterbi labels, LongTensor [B, N] (-1 at padding and for items with no valid path);
        ties broken towards the lower label, from the last position backwards."""
        return self._viterbi[1]

    def _indicators(self, value: Tensor) -> Tensor:
        # labels [B, N] -> one-hot [B, N, C] (0 where -1: padding, no sequence)
        onehot = torch.nn.functional.one_hot(value.clamp_min(0), self.num_labels)
        return onehot * (value >= 0).unsqueeze(-1)

    def _map_score(self) -> Tensor:
        best, labels = self._viterbi
        return self._labels_score(labels, best)

    def log_prob(self, labels: Tensor) -> Tensor:
        """log p(labels), shape [B]; ``labels`` LongTensor [B, N] (padding entries ignored)."""
        return super().log_prob(labels)

    @cached_property
    def count(self) -> Tensor:
        """Number of label sequences with a finite score (no ``-inf`` label or transition),
        float64 [B]: the forward algorithm on 0/1 indicators in float64 (sums and products
        of integers), exact up to 2**53. Not differentiable."""
        with torch.no_grad():
            unary, pairwise = self._parts(self.unary.detach(), self.pairwise.detach())
            node = (~torch.isneginf(unary)).to(torch.float64)  # [B, N, C]
            edge = (~torch.isneginf(pairwise)).to(torch.float64)  # [B, N-1, C, C]
            batch, n, _ = node.shape
            alpha = node[:, 0]  # [B, C]
            for i in range(1, n):
                new = (alpha.unsqueeze(1) @ edge[:, i - 1]).squeeze(1) * node[:, i]
                alpha = (
                    new
                    if self.lengths is None
                    else torch.where((self.lengths > i).unsqueeze(-1), new, alpha)
                )
            return alpha.sum(-1)


def _check_end_scores(name: str, scores: Tensor, unary: Tensor) -> None:
    """ValueError naming ``name`` unless ``scores`` is [C] or [B, C] like ``unary``'s labels."""
    check_potentials(name, scores, rank=scores.dim())
    batch, _, c = unary.shape
    if scores.shape not in ((c,), (batch, c)):
        raise ValueError(
            f"`{name}` must have shape ({c},) or ({batch}, {c}), got {tuple(scores.shape)}"
        )
    if scores.dtype != unary.dtype or scores.device != unary.device:
        raise ValueError(f"`{name}` must have the dtype and device of `unary`")


def _fold_ends(
    unary: Tensor, start: Tensor | None, end: Tensor | None, lengths: Tensor | None
) -> Tensor:
    """``unary`` [B, N, C] with ``start`` ([C] or [B, C]) added at position 0 and ``end`` at
    each item's last position (differentiable in all three; the padding is left alone)."""
    batch, n, _ = unary.shape
    pos = torch.arange(n, device=unary.device)
    if start is not None:
        unary = torch.where((pos == 0).view(1, n, 1), unary + start.unsqueeze(-2), unary)
    if end is not None:
        last = last_index(lengths, batch, n, unary.device)
        is_last = (pos == last.unsqueeze(-1)).unsqueeze(-1)  # [B, N, 1]
        unary = torch.where(is_last, unary + end.unsqueeze(-2), unary)
    return unary
