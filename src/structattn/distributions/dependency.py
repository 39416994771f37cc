"""Dependency-tree CRF distributions (projective; shared base for the non-projective one)."""

from __future__ import annotations

from functools import cached_property, lru_cache

import torch
from torch import Tensor

from .._precision import autocast_widened
from .._validation import check_lengths, check_potentials, length_mask
from ..semirings import LogSemiring, MaxSemiring, Semiring
from ..structs.dependency import (
    eisner_argmax,
    eisner_inside,
    eisner_log_partition,
    eisner_max,
    is_tree,
    tree_score,
)
from ..structs.dependency import is_projective as _crossing_free
from .base import StructuredDistribution

__all__ = ["DependencyCRF", "TreeCRFBase", "is_projective", "projectivize"]


def _check_heads(heads: object, lengths: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Check ``heads`` [B, N] (integers; at real words 1..len-1 in [0, len)) and ``lengths``;
    return (heads as LongTensor, lengths [B], real-word mask [B, N])."""
    if not isinstance(heads, Tensor) or heads.dim() != 2 or heads.shape[1] < 2:
        shape = tuple(heads.shape) if isinstance(heads, Tensor) else type(heads).__name__
        raise ValueError(f"`heads` must be a LongTensor [B, N] with N >= 2, got {shape}")
    if heads.is_floating_point() or heads.is_complex() or heads.dtype == torch.bool:
        raise ValueError(f"`heads` must be an integer tensor, got dtype {heads.dtype}")
    batch, size = heads.shape
    lengths = check_lengths(lengths, batch, 2, size, heads.device)
    if lengths is None:
        lengths = torch.full((batch,), size, dtype=torch.long, device=heads.device)
    heads = heads.long()
    real = length_mask(lengths, batch, size, heads.device)
    real[:, 0] = False  # ROOT has no head
    _check_head_range(heads, lengths, real)
    return heads, lengths, real


def _check_head_range(
    heads: Tensor, lengths: Tensor, real: Tensor, allow_none: bool = False
) -> None:
    """ValueError naming ``heads`` if a real word's head is not a position of its item.

    ``allow_none``: an item with ``-1`` at every word is accepted (the "no tree" that
    ``argmax`` and ``sample`` return for an item with no valid tree).
    """
    bad = ((heads < 0) | (heads >= lengths.unsqueeze(-1))) & real  # [B, N]
    if allow_none:
        none = ((heads == -1) | ~real).all(-1, keepdim=True)  # [B, 1]
        bad &= ~none
    if bool(bad.any()):
        item, word = (int(i) for i in bad.nonzero()[0].tolist())
        raise ValueError(
            f"`heads` out of range: heads[{item}, {word}] = {int(heads[item, word])}, but a "
            f"word's head must be a position of its item, in [0, {int(lengths[item])}) "
            f"(0 = ROOT; entries at position 0 and at padding are ignored); "
            f"{int(bad.sum())} such entries in all"
        )


def is_projective(heads: Tensor, lengths: Tensor | None = None) -> Tensor:
    """Whether each tree is projective: BoolTensor [B], True where no two arcs cross.

    Args:
        heads: LongTensor [B, N]; ``heads[b, m]`` is the head of word m (1..len-1), position
            0 the ROOT symbol; entries at position 0 and at padding are ignored.
        lengths: LongTensor [B] of positions including ROOT, in 2..N (``None`` = all N).

    Arcs ``h -> m`` are intervals ``[min(h, m), max(h, m)]`` of positions, ROOT = 0 included;
    two arcs cross if ``a < c < b < d``. For a tree this is the same as "every arc dominates
    the words between its ends", i.e. the tree has probability > 0 under
    :class:`DependencyCRF`. ``heads`` need not be a tree (only its arcs are looked at).
    Raises ``ValueError`` if a real word's head is not a position of its item.
    O(B N^2) time and memory.

    Example:
        >>> is_projective(torch.tensor([[-1, 2, 0, 2], [-1, 3, 0, 0]])).tolist()
        [True, False]
    """
    heads, lengths, _ = _check_heads(heads, lengths)
    return _crossing_free(heads, lengths)


def projectivize(heads: Tensor, lengths: Tensor | None = None) -> Tensor:
    """The projective tree nearest to each tree by *lifting* (Nivre & Nilsson 2005).

    An arc ``h -> m`` is non-projective if a word between h and m is not a descendant of h.
    While a tree has one, its shortest non-projective arc (ties: the leftmost modifier) is
    lifted to the head's head, ``head(h) -> m``, as in pseudo-projective parsing (Nivre &
    Nilsson 2005; Kübler, McDonald & Nivre 2009). Each lift keeps a tree (the new
    head is an ancestor of m) and lifting ends with a projective tree; projective trees are
    returned unchanged. Arcs from ROOT and from a sole child of ROOT are never
    non-projective, so a tree with one child of ROOT keeps one (``multiroot=False`` data
    stay valid). Lifting only moves a word up to an ancestor, so it is not the projective
    tree with the fewest changed heads in general (for 19% of the non-projective trees of 5
    words, counting multi-root ones, another projective tree changes 1-2 heads fewer); it is
    the standard transformation of treebanks for projective parsers.

    Use it to train :class:`DependencyCRF` on a treebank with crossing arcs (a
    non-projective gold tree has probability 0 under it); the evaluation should use the
    original trees.

    Args:
        heads: LongTensor [B, N] of trees (``heads[b, m]`` the head of word m, ROOT = 0);
            entries at position 0 and at padding are ignored and returned as given.
        lengths: LongTensor [B] of positions including ROOT, in 2..N (``None`` = all N).

    Returns:
        LongTensor [B, N]: the lifted heads.

    Raises ``ValueError`` if a head is out of range or an item is not a tree. Preprocessing:
    batched, one lift per item per step (as many steps as the item with the most lifts;
    each step O(A N^2) for the A items still lifting, one host sync), memory O(B N^2); it
    runs on the device of ``heads``.

    Example:
        >>> projectivize(torch.tensor([[-1, 0, 3, 0, 1]])).tolist()  # 1 -> 4 spans 3
        [[-1, 0, 3, 0, 0]]
    """
    heads, lengths, real = _check_heads(heads, lengths)
    batch, size = heads.shape
    device = heads.device
    trees = is_tree(heads, lengths, multiroot=True)
    if not bool(trees.all()):
        items = (~trees).nonzero().flatten().tolist()
        raise ValueError(
            f"`heads` must be trees rooted at position 0 (no cycles or self-loops); items "
            f"{items[:10]}{' ...' if len(items) > 10 else ''} are not"
        )
    pos = torch.arange(size, device=device)
    # a parent pointer for every position (ROOT and padding point to ROOT)
    parent = torch.where(real, heads, torch.zeros_like(heads))  # [B, N]
    # dominated[b, w, h]: h is w itself or an ancestor of w (depth < N: N pointer steps)
    dominated = torch.zeros(batch, size, size, dtype=torch.bool, device=device)
    node = pos.expand(batch, size)  # [B, N]: the ancestor of each word at this depth
    for _ in range(size):
        dominated.scatter_(2, node.unsqueeze(-1), True)
        node = parent.gather(1, node)
    active = torch.arange(batch, device=device)  # items that may still have a crossing
    while active.numel():
        par, dom, words = parent[active], dominated[active], real[active]  # [A, N], [A, N, N]
        # arc par[m] -> m spans the words w strictly between its two ends
        low = torch.minimum(par, pos)  # [A, N (m)]
        high = torch.maximum(par, pos)
        between = (low.unsqueeze(-1) < pos) & (pos < high.unsqueeze(-1))  # [A, N (m), N (w)]
        # covered[a, m, w]: the head of m dominates w, i.e. dom[a, w, par[a, m]]
        covered = dom.gather(2, par.unsqueeze(1).expand_as(dom)).transpose(1, 2)
        bad = (between & ~covered).any(-1) & words  # [A, N]: non-projective arcs
        lift = bad.any(-1)  # [A]
        active, bad, par, low, high = active[lift], bad[lift], par[lift], low[lift], high[lift]
        if not active.numel():
            break
        # the shortest non-projective arc of each item (argmin: the leftmost on ties) ...
        word = (high - low).masked_fill(~bad, size + 1).argmin(-1)  # [A]
        head = par.gather(1, word.unsqueeze(-1)).squeeze(-1)  # [A]
        # ... moves to its head's head; the subtree of the word loses the head as ancestor
        parent[active, word] = parent[active, head]
        subtree = dominated[active, :, word]  # [A, N]: w in the subtree of the word
        dominated[active, :, head] &= ~subtree
    return torch.where(real, parent, heads)


@lru_cache(maxsize=32)
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
        _check_head_range(heads, self._lengths_full, mask, allow_none=True)
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
        return super()._valid(heads) & _crossing_free(heads, self._lengths_full)

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
            _crossing_free(heads, length)[0]
        ):
            return (
                "a non-projective tree (DependencyCRF covers projective trees only: "
                "projectivize(heads) lifts crossing arcs, or use NonProjectiveDependencyCRF)"
            )
        return super().impossible_reason(value, item)
