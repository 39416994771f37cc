"""Second-order (adjacent-sibling) projective dependency-tree CRF."""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from .._precision import autocast_widened
from .._validation import check_potentials
from ..semirings import LogSemiring, Semiring
from ..structs.dependency import tree_score
from ..structs.second_order import (
    second_order_inside,
    second_order_kbest,
    second_order_log_partition,
    second_order_map,
    sibling_indicators,
    sibling_score,
)
from ..trees import crossing_free
from .base import cached_property, tempered_inputs
from .dependency import TreeCRFBase

__all__ = ["SecondOrderDependencyCRF"]


@lru_cache(maxsize=32)
def _sibling_reach(size: int, device: torch.device) -> Tensor:
    """LongTensor [N, N, N]: max(h, m, s), so ``reach < length`` keeps an item's triples."""
    with torch.inference_mode(False), torch.no_grad():
        index = torch.arange(size, device=device)
        return torch.maximum(
            torch.maximum(index.view(-1, 1, 1), index.view(1, -1, 1)), index.view(1, 1, -1)
        )


class SecondOrderDependencyCRF(TreeCRFBase):
    r"""CRF over projective dependency trees with adjacent-sibling scores (second-order
    Eisner, McDonald & Pereira 2006; the model of supar's ``Dependency2oCRF``).

    .. math:: p(z) \propto \exp\Big(\sum_{(h \to m) \in z} \text{arc}[h, m]
              + \sum_{(h \to s, h \to m) \text{ adjacent}} \text{sib}[h, m, s]\Big)

    where (h -> s, h -> m) are adjacent siblings when s and m lie on the same side of h, s
    between h and m, and no other child of h lies between them. The child of h closest to h
    on each side has no sibling score.

    Args:
        arc_scores: [B, N, N]; position 0 is ROOT; ``arc_scores[b, h, m]`` scores h -> m.
            Column 0 and the diagonal are ignored.
        sibling_scores: [B, N, N, N]; ``sibling_scores[b, h, m, s]`` scores h taking m right
            after s on the same side (only h, m, s with s strictly between h and m are read).
            supar's ``Dependency2oCRF`` takes ``s_sib[b, m, h, s]``, i.e.
            ``sibling_scores.permute(0, 2, 1, 3)``, and arcs ``s_arc[b, m, h]``.
        lengths: LongTensor [B] of positions including ROOT, in 2..N (``None`` = all N).
        multiroot: if False, ROOT has exactly one child (so ROOT's sibling scores are unused).
        validate_args: check shapes, dtypes and values (one host sync); default True.

    ``log_partition``, ``marginals`` (arcs [B, N, N]) and ``sibling_marginals``
    ([B, N, N, N]), ``entropy``, ``sample(n)`` and ``log_prob(heads)`` (heads LongTensor
    [B, N], ``-1`` at ROOT and padding), all from one inside pass
    (:func:`structattn.structs.second_order.second_order_inside`): log Z's backward (the
    marginals) is a hand-written outside pass
    (:func:`structattn.structs.second_order.second_order_log_partition`), differentiable
    marginals (scores that require grad) are autograd's through the inside pass; ``argmax``
    and ``max_score``: the same pass in the max semiring without autograd, backtracked by
    hand (:func:`structattn.structs.second_order.second_order_map`). Time O(B N^3), N
    sequential steps; memory O(B N^3) (the sibling scores and their gradient).
    ``topk(k)``: the exact k best trees.

    Example:
        >>> arcs, sibs = torch.randn(2, 6, 6), torch.randn(2, 6, 6, 6)
        >>> tree = SecondOrderDependencyCRF(arcs, sibs, lengths=torch.tensor([6, 4]))
        >>> torch.allclose(tree.marginals.sum(1)[1, 1:4], torch.ones(3))
        True
        >>> bool((tree.log_prob(tree.argmax) <= 0).all())
        True
    """

    def __init__(
        self,
        arc_scores: Tensor,
        sibling_scores: Tensor,
        lengths: Tensor | None = None,
        multiroot: bool = True,
        validate_args: bool = True,
        *,
        temperature: float = 1.0,
    ) -> None:
        if validate_args:
            check_potentials("arc_scores", arc_scores, rank=3)
        arc_scores, sibling_scores = autocast_widened(arc_scores, sibling_scores)
        super().__init__(arc_scores, lengths, multiroot, validate_args, temperature=temperature)
        if validate_args:
            check_potentials("sibling_scores", sibling_scores, rank=4)
            size = arc_scores.shape[-1]
            if sibling_scores.shape != (arc_scores.shape[0], size, size, size):
                raise ValueError(
                    "`sibling_scores` must have shape [B, N, N, N] = "
                    f"{(arc_scores.shape[0], size, size, size)}, got {tuple(sibling_scores.shape)}"
                )
            if sibling_scores.dtype != arc_scores.dtype:
                raise ValueError("`sibling_scores` must have the dtype of `arc_scores`")
            if sibling_scores.device != arc_scores.device:
                raise ValueError("`sibling_scores` must be on the device of `arc_scores`")
        (sibling_scores,) = tempered_inputs(self.temperature, sibling_scores)
        self.sibling_scores = sibling_scores
        self._raw = (self.arc_scores, sibling_scores)
        self._by_autograd = False  # log Z by autograd's inside pass (differentiable marginals)

    def _parts(self, *raw: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        arc_scores, sibling_scores = raw
        (arcs,) = super()._parts(arc_scores)
        if self.lengths is not None:  # padding -> 0
            keep = _sibling_reach(sibling_scores.shape[-1], sibling_scores.device)
            keep = keep < self.lengths.view(-1, 1, 1, 1)  # [B, N, N, N]
            sibling_scores = sibling_scores.masked_fill(~keep, 0.0)
        if not self.multiroot:  # ROOT takes only its first child
            sibling_scores = sibling_scores.clone()
            sibling_scores[:, 0] = float("-inf")
        return arcs, sibling_scores

    def _inside(
        self, semiring: type[Semiring], parts: tuple[Tensor, ...], lengths: Tensor | None
    ) -> Tensor:
        if semiring is LogSemiring and not self._by_autograd:
            # the hand-written outside pass as the backward
            return second_order_log_partition(parts[0], parts[1], lengths)
        return second_order_inside(parts[0], parts[1], lengths, semiring)

    @cached_property
    def _marginals_tuple(self) -> tuple[Tensor, ...]:
        if not self._differentiable():  # the marginals by the hand-written outside pass
            return super()._marginals_tuple
        # differentiable marginals (create_graph): autograd through the inside pass, whose
        # graph the double backward needs anyway
        self._by_autograd = True
        try:
            return super()._marginals_tuple
        finally:
            self._by_autograd = False

    def _to_structure(self, *indicators: Tensor) -> Tensor:
        return super()._to_structure(indicators[0])

    def _valid(self, heads: Tensor) -> Tensor:
        return super()._valid(heads) & crossing_free(heads, self._lengths_full)

    def _tree_score(self, heads: Tensor) -> Tensor:
        words = self.mask.clone()
        words[:, 0] = False  # ROOT has no head
        arcs, sibs = self._parts(*self._raw)
        score = tree_score(arcs, heads, words) + sibling_score(sibs, heads, words)
        return score.masked_fill(~self._valid(heads), float("-inf"))

    @property
    def marginals(self) -> Tensor:
        """p(arc h -> m), shape [B, N, N]; columns 1..len-1 sum to 1."""
        return self._marginals_tuple[0]

    @property
    def sibling_marginals(self) -> Tensor:
        """p(h takes m right after s on the same side), shape [B, N, N, N] (0 where unread)."""
        return self._marginals_tuple[1]

    @cached_property
    def argmax(self) -> Tensor:
        """Heads of the highest-scoring tree, LongTensor [B, N] (``-1`` at ROOT, padding and
        for an item with no tree): the max-plus pass and a hand-written backtrack
        (:func:`structattn.structs.second_order.second_order_map`; ties as the max
        semiring's gradient)."""
        arcs, sibs = self._parts(self.arc_scores.detach(), self.sibling_scores.detach())
        score, heads = second_order_map(arcs, sibs, self.lengths)
        return self._invalidate(heads, score)

    def _part_argmax(self, parts: tuple[Tensor, ...], lengths: Tensor | None) -> tuple[Tensor, ...]:
        # the hand-written MAP pass (SparseMAP's oracle): arc and sibling indicators
        score, heads = second_order_map(parts[0], parts[1], lengths)
        heads = self._invalidate(heads, score)
        dtype = parts[0].dtype
        return self._indicators(heads).to(dtype), sibling_indicators(heads).to(dtype)

    def topk(self, k: int) -> tuple[Tensor, Tensor]:
        """The k best trees, exactly, best first: (scores [k, B], heads LongTensor [k, B, N])
        by second-order Eisner in the k-best semiring
        (:func:`structattn.structs.second_order.second_order_kbest`). Rank 0 is ``argmax``
        (ties: moved first). Missing ranks (fewer than k trees of finite score): ``-inf``
        and ``-1``. The scores are recomputed from the potentials, so their gradient is the
        trees' arc and sibling indicators."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"`k` must be a positive int, got {k!r}")
        with torch.no_grad():
            arcs, sibs = self._parts(self.arc_scores.detach(), self.sibling_scores.detach())
            heads = second_order_kbest(arcs, sibs, self.lengths, k)  # [k, B, N]
        score = torch.stack([self._tree_score(h) for h in heads])  # [k, B]
        score = score.masked_fill(heads[..., 1] < 0, float("-inf"))
        return self._argmax_first(score, heads, self.argmax)
