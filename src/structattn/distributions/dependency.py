"""Dependency-tree CRF distributions (projective; shared base for the non-projective one)."""

from __future__ import annotations

from functools import cached_property

import torch
from torch import Tensor

from .._precision import autocast_widened
from .._validation import (
    check_head_range,
    check_lengths,
    check_potentials,
    length_mask,
    tensor_cache,
)
from ..semirings import LogSemiring, MaxSemiring, Semiring
from ..structs.dependency import (
    eisner_argmax,
    eisner_inside,
    eisner_log_partition,
    eisner_max,
    tree_score,
)
from ..trees import crossing_free, is_projective, is_tree, projectivize
from .base import StructuredDistribution

# is_projective and projectivize live in structattn.trees (no dynamic program); re-exported here
__all__ = ["DependencyCRF", "TreeCRFBase", "is_projective", "projectivize"]


@tensor_cache(maxsize=32)
def _arc_fill(size: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(allowed BoolTensor [N, N]: not an arc into ROOT nor a self loop; fill [N, N]: -inf
    where not allowed, 0 elsewhere; reach LongTensor [N, N]: max(h, m) where allowed, N
    where not, so ``reach < length`` is an item's allowed arcs in one compare), cached per
    size, dtype and device (normal tensors even when first asked for under
    ``torch.inference_mode``: autograd may save them later)."""
    with torch.inference_mode(False), torch.no_grad():
        banned = torch.zeros(size, size, dtype=torch.bool, device=device)
        banned[:, 0] = True  # no arc into ROOT
        banned.fill_diagonal_(True)  # no self loops
        fill = torch.zeros(size, size, dtype=dtype, device=device)
        index = torch.arange(size, device=device)
        reach = torch.maximum(index.unsqueeze(-1), index).masked_fill(banned, size)
        return ~banned, fill.masked_fill(banned, float("-inf")), reach


class TreeCRFBase(StructuredDistribution):
    """Shared parts of the dependency-tree CRFs: validation, padding, heads <-> arcs."""

    def __init__(
        self,
        arc_scores: Tensor,
        lengths: Tensor | None = None,
        multiroot: bool = True,
        validate_args: bool = True,
    ) -> None:
        (arc_scores,) = autocast_widened(arc_scores)  # under autocast: inference in float32
        if validate_args:
            check_potentials("arc_scores", arc_scores, rank=3)
            batch, size, size2 = arc_scores.shape
            if size != size2 or size < 2:
                raise ValueError(
                    "`arc_scores` must have shape [B, N, N] with N >= 2 (position 0 is ROOT), "
                    f"got {tuple(arc_scores.shape)}"
                )
            lengths = check_lengths(lengths, batch, 2, size, arc_scores.device)
        self.arc_scores = arc_scores
        self.lengths = lengths
        self.multiroot = bool(multiroot)
        self._raw = (arc_scores,)

    @property
    def mask(self) -> Tensor:
        """BoolTensor [B, N]: True at real positions, ROOT (position 0) included."""
        batch, size, _ = self.arc_scores.shape
        return length_mask(self.lengths, batch, size, self.arc_scores.device)

    @property
    def _lengths_full(self) -> Tensor:
        batch, size, _ = self.arc_scores.shape
        if self.lengths is None:
            return torch.full((batch,), size, dtype=torch.long, device=self.arc_scores.device)
        return self.lengths

    def _parts(self, *raw: Tensor) -> tuple[Tensor]:
        (arc_scores,) = raw
        size = arc_scores.shape[-1]
        allowed, fill, reach = _arc_fill(size, arc_scores.dtype, arc_scores.device)  # [N, N]
        if self.lengths is not None:  # padding -> 0, banned -> -inf, in one op (and backward)
            allowed = reach < self.lengths.view(-1, 1, 1)  # [B, N, N]
        return (torch.where(allowed, arc_scores, fill),)

    def _to_structure(self, *indicators: Tensor) -> Tensor:
        (arc_ind,) = indicators  # [B, N, N]
        heads = arc_ind.argmax(1)  # [B, N]: the head of each modifier
        return heads.masked_fill(arc_ind.sum(1) == 0, -1)

    def _valid(self, heads: Tensor) -> Tensor:
        return is_tree(heads, self._lengths_full, self.multiroot)

    def _score(self, value: Tensor) -> Tensor:
        mask = self.mask.clone()
        mask[:, 0] = False  # ROOT has no head
        if not isinstance(value, Tensor) or value.shape != mask.shape:
            raise ValueError(f"`heads` must be a LongTensor of shape {tuple(mask.shape)}")
        if value.is_floating_point() or value.is_complex():
            raise ValueError(f"`heads` must be an integer tensor, got dtype {value.dtype}")
        heads = value.to(device=self.arc_scores.device, dtype=torch.long)
        check_head_range(heads, self._lengths_full, mask, allow_none=True)
        return self._tree_score(heads)

    def _tree_score(self, heads: Tensor) -> Tensor:
        """Score of ``heads`` LongTensor [B, N] (unchecked), [B]; ``-inf`` where not a valid
        tree of this distribution."""
        mask = self.mask.clone()
        mask[:, 0] = False  # ROOT has no head
        (arcs,) = self._parts(self.arc_scores)
        score = tree_score(arcs, heads, mask)
        return score.masked_fill(~self._valid(heads), float("-inf"))

    @property
    def marginals(self) -> Tensor:
        """p(arc h -> m), shape [B, N, N]; columns 1..len-1 sum to 1, column 0 and padding 0."""
        return self._marginals_tuple[0]

    def log_prob(self, heads: Tensor) -> Tensor:
        """log p(tree), shape [B]; ``heads`` LongTensor [B, N] (entries at ROOT and padding
        ignored). ``ValueError`` if a word's head is not a position of its item (negative,
        >= its length), except for an item with ``-1`` at every word (what ``argmax`` gives
        an item with no tree); ``-inf`` for such an item and when ``heads`` is not a valid
        tree of this distribution (a cycle; several children of ROOT under
        ``multiroot=False``; crossing arcs under :class:`DependencyCRF`):
        :func:`structured_nll` turns that into an error."""
        return super().log_prob(heads)

    @property
    def num_tokens(self) -> Tensor:
        """Words per item (positions without ROOT, which has no head), LongTensor [B]."""
        return self._lengths_full - 1

    def impossible_reason(self, value: Tensor, item: int) -> str:
        """Why heads ``value[item]`` have probability 0: no tree (``-1`` at every word), not a
        tree, several children of ROOT under ``multiroot=False``, else the base reasons."""
        heads = value[item : item + 1].to(device=self.arc_scores.device, dtype=torch.long)
        length = self._lengths_full[item : item + 1]
        if bool((heads[0, 1 : int(length[0])] == -1).all()):
            return "heads of -1 at every word (no tree)"
        if not bool(is_tree(heads, length, multiroot=True)[0]):
            return "not a tree (a cycle or a self-loop)"
        if not self.multiroot and not bool(is_tree(heads, length, multiroot=False)[0]):
            roots = int((heads[0, 1 : int(length[0])] == 0).sum())
            return f"{roots} children of ROOT (multiroot=False allows exactly one)"
        return super().impossible_reason(value, item)


class DependencyCRF(TreeCRFBase):
    r"""CRF over projective dependency trees (Eisner's algorithm).

    .. math:: p(z) \propto \exp\Big(\sum_{(h \to m) \in z} \text{arc\_scores}[h, m]\Big)

    Args:
        arc_scores: [B, N, N]; position 0 is the ROOT symbol; ``arc_scores[b, h, m]`` scores
            the arc head h -> modifier m. Column 0 and the diagonal are ignored.
        lengths: LongTensor [B] of positions including ROOT, in 2..N (``None`` = all N).
        multiroot: if False, ROOT has exactly one child.
        validate_args: check shapes, dtypes and values (one host sync); default True.

    ``argmax`` and samples are heads, LongTensor [B, N] (``-1`` at ROOT and padding).
    Time O(B N^3) (N sequential steps), memory O(B N^2).

    Example:
        >>> tree = DependencyCRF(torch.randn(2, 6, 6), lengths=torch.tensor([6, 4]))
        >>> torch.allclose(tree.marginals.sum(1)[1, 1:4], torch.ones(3))  # one head per word
        True
    """

    def _inside(
        self, semiring: type[Semiring], parts: tuple[Tensor, ...], lengths: Tensor | None
    ) -> Tensor:
        if semiring is LogSemiring:  # hand-written outside pass and Hessian-vector product
            return eisner_log_partition(parts[0], lengths, self.multiroot)
        if semiring is MaxSemiring:  # hand-written backtrack
            return eisner_max(parts[0], lengths, self.multiroot)
        return eisner_inside(parts[0], lengths, self.multiroot, semiring)

    def _valid(self, heads: Tensor) -> Tensor:
        return super()._valid(heads) & crossing_free(heads, self._lengths_full)

    @cached_property
    def argmax(self) -> Tensor:
        """The highest-scoring tree (MAP): heads LongTensor [B, N], ``-1`` at ROOT and
        padding (and everywhere for an item with no tree)."""
        best = eisner_argmax(self.arc_scores, self.lengths, self.multiroot)
        if best is None:  # the gradient of the max-plus inside pass
            return super().argmax
        score, heads = best
        return self._invalidate(heads, score)

    def impossible_reason(self, value: Tensor, item: int) -> str:
        """As :class:`TreeCRFBase`'s, and a valid tree with crossing arcs (non-projective)."""
        heads = value[item : item + 1].to(device=self.arc_scores.device, dtype=torch.long)
        length = self._lengths_full[item : item + 1]
        if bool(is_tree(heads, length, self.multiroot)[0]) and not bool(
            crossing_free(heads, length)[0]
        ):
            return (
                "a non-projective tree (DependencyCRF covers projective trees only: "
                "projectivize(heads) lifts crossing arcs, or use NonProjectiveDependencyCRF)"
            )
        return super().impossible_reason(value, item)
