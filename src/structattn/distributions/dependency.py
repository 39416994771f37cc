"""Dependency-tree CRF distributions (projective; shared base for the non-projective one)."""

from __future__ import annotations

from typing import NamedTuple

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
from ..semirings import LogSemiring, MaxSemiring, Semiring, logsumexp
from ..structs.dependency import (
    eisner_argmax,
    eisner_inside,
    eisner_log_partition,
    eisner_marginals,
    eisner_max,
    tree_score,
)
from ..structs.kbest_trees import eisner_kbest, label_kbest
from ..trees import crossing_free, is_projective, is_tree, projectivize
from .base import (
    StructuredDistribution,
    cached_property,
    check_temperature,
    gumbel_like,
    tempered_inputs,
)

# is_projective and projectivize live in structattn.trees (no dynamic program); re-exported here
__all__ = ["DependencyCRF", "LabelledHeads", "TreeCRFBase", "is_projective", "projectivize"]


class LabelledHeads(NamedTuple):
    """Labelled trees: ``heads`` and ``labels``, LongTensors of one shape ([B, N], or
    [n, B, N] / [k, B, N] for samples and k-best lists); ``labels[..., m]`` is the label of the
    arc heads[m] -> m; both ``-1`` at ROOT, padding and missing trees."""

    heads: Tensor
    labels: Tensor


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
        *,
        temperature: float = 1.0,
    ) -> None:
        self.temperature = check_temperature(temperature)
        (arc_scores,) = autocast_widened(arc_scores)  # under autocast: inference in float32
        labelled = isinstance(arc_scores, Tensor) and arc_scores.dim() == 4
        if validate_args:
            check_potentials("arc_scores", arc_scores, rank=4 if labelled else 3)
            batch, size, size2 = arc_scores.shape[:3]
            if size != size2 or size < 2 or (labelled and arc_scores.shape[3] < 1):
                raise ValueError(
                    "`arc_scores` must have shape [B, N, N] or [B, N, N, L] (labelled) with "
                    f"N >= 2 (position 0 is ROOT) and L >= 1, got {tuple(arc_scores.shape)}"
                )
            lengths = check_lengths(lengths, batch, 2, size, arc_scores.device)
        (arc_scores,) = tempered_inputs(self.temperature, arc_scores)  # labels too (#41.7)
        #: labelled scores [B, N, N, L] as given (None for unlabelled trees)
        self.label_scores: Tensor | None = arc_scores if labelled else None
        if labelled:  # the labels summed out first: one tree pass, not L
            arc_scores = logsumexp(arc_scores, -1)
        #: arc scores [B, N, N] (for labelled trees: logsumexp over the labels)
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

    def tempered(self, temperature: float) -> StructuredDistribution:
        """As :meth:`StructuredDistribution.tempered`; labelled trees divide the label
        scores by t (their logsumexp over the labels is not homogeneous in them)."""
        if self.label_scores is None:
            return super().tempered(temperature)
        t = check_temperature(temperature)
        new = type(self)(
            self.label_scores, self.lengths, self.multiroot, validate_args=False, temperature=t
        )
        new.temperature = self.temperature * t
        return new

    def _score(self, value: Tensor | tuple[Tensor, Tensor]) -> Tensor:
        mask = self.mask.clone()
        mask[:, 0] = False  # ROOT has no head
        labels = None
        if self.label_scores is not None:
            if not isinstance(value, tuple) or len(value) != 2:
                raise ValueError(
                    "labelled trees: pass `heads` and `labels` (or one LabelledHeads), "
                    "LongTensors of shape " + str(tuple(mask.shape))
                )
            value, labels = value
        heads = self._check_index("heads", value, mask)
        check_head_range(heads, self._lengths_full, mask, allow_none=True)
        if labels is None:
            return self._tree_score(heads)
        labels = self._check_index("labels", labels, mask)
        num_labels = self.num_labels
        if bool((((labels < 0) | (labels >= num_labels)) & mask & (heads >= 0)).any()):
            raise ValueError(f"`labels` must lie in [0, {num_labels}) at the words")
        return self._labelled_score(heads, labels)

    def _check_index(self, name: str, value: object, mask: Tensor) -> Tensor:
        if not isinstance(value, Tensor) or value.shape != mask.shape:
            raise ValueError(f"`{name}` must be a LongTensor of shape {tuple(mask.shape)}")
        if value.is_floating_point() or value.is_complex():
            raise ValueError(f"`{name}` must be an integer tensor, got dtype {value.dtype}")
        return value.to(device=self.arc_scores.device, dtype=torch.long)

    def _tree_score(self, heads: Tensor) -> Tensor:
        """Score of ``heads`` LongTensor [B, N] (unchecked), [B]; ``-inf`` where not a valid
        tree of this distribution."""
        mask = self.mask.clone()
        mask[:, 0] = False  # ROOT has no head
        (arcs,) = self._parts(self.arc_scores)
        score = tree_score(arcs, heads, mask)
        return score.masked_fill(~self._valid(heads), float("-inf"))

    def _map_score(self) -> Tensor:
        # differentiable score of this class's own argmax (its gradient: the tree's arcs)
        return self._tree_score(self.argmax)

    def _indicators(self, value: Tensor) -> Tensor:
        # heads [B, N] -> arcs [B, N, N] (arc heads[m] -> m; none where heads[m] = -1);
        # LabelledHeads -> labelled arcs [B, N, N, L] (the shape of labelled ``marginals``)
        if isinstance(value, tuple):
            heads, labels = value
            arcs = self._indicators(heads)
            onehot = torch.nn.functional.one_hot(labels.clamp_min(0), self.num_labels)
            return arcs.unsqueeze(-1) * onehot.unsqueeze(-3)  # [B, N, N, L]
        size = self.arc_scores.shape[-1]
        arcs = torch.nn.functional.one_hot(value.clamp_min(0), size).transpose(1, 2)
        return arcs * (value >= 0).unsqueeze(1)

    @property
    def marginals(self) -> Tensor:
        """p(arc h -> m), shape [B, N, N]; columns 1..len-1 sum to 1, column 0 and padding 0.
        Labelled trees: p(arc h -> m with label l), shape [B, N, N, L] (the arc marginal times
        the softmax of the arc's label scores)."""
        arcs = self._marginals_tuple[0]
        if self.label_scores is None:
            return arcs
        return arcs.unsqueeze(-1) * self._label_probs

    @property
    def arc_marginals(self) -> Tensor:
        """p(arc h -> m) with the labels summed out, shape [B, N, N]."""
        return self._marginals_tuple[0]

    def log_prob(self, heads: Tensor, labels: Tensor | None = None) -> Tensor:
        """log p(tree), shape [B]; ``heads`` LongTensor [B, N] (entries at ROOT and padding
        ignored); labelled trees also take ``labels`` LongTensor [B, N] (or ``heads`` a
        :class:`LabelledHeads`, as ``argmax`` gives). ``ValueError`` if a word's head is not
        a position of its item (negative, >= its length), except for an item with ``-1`` at
        every word (what ``argmax`` gives an item with no tree), or a label is not in
        [0, L); ``-inf`` for such an item and when ``heads`` is not a valid tree of this
        distribution (a cycle; several children of ROOT under ``multiroot=False``; crossing
        arcs under :class:`DependencyCRF`): :func:`structured_nll` turns that into an
        error."""
        value = heads if labels is None else LabelledHeads(heads, labels)
        score = self._score(value)
        logz = self.log_partition
        return torch.where(torch.isneginf(score), score, score - logz)

    # ---- labelled trees: the labels are summed (maxed) out first, then one tree pass ------
    @property
    def num_labels(self) -> int:
        """L, the number of arc labels (1 for unlabelled trees)."""
        return 1 if self.label_scores is None else self.label_scores.shape[-1]

    def _label_parts(self) -> Tensor:
        """Label scores [B, N, N, L] with banned arcs ``-inf`` and padding 0 (as ``_parts``)."""
        assert self.label_scores is not None
        label_scores = self.label_scores
        size = label_scores.shape[1]
        allowed, fill, reach = _arc_fill(size, label_scores.dtype, label_scores.device)
        if self.lengths is not None:
            allowed = reach < self.lengths.view(-1, 1, 1)
        return torch.where(allowed.unsqueeze(-1), label_scores, fill.unsqueeze(-1))

    @cached_property
    def _label_probs(self) -> Tensor:
        """p(label | arc) [B, N, N, L]: softmax of each arc's label scores (0 for an arc whose
        labels are all ``-inf``)."""
        assert self.label_scores is not None
        lse = self.arc_scores.unsqueeze(-1)
        return (self.label_scores - lse.masked_fill(torch.isneginf(lse), 0.0)).exp()

    def _labelled_score(self, heads: Tensor, labels: Tensor) -> Tensor:
        """Score of labelled trees, heads and labels LongTensor [..., B, N] (unchecked),
        shape [..., B], ``-inf`` where not a valid tree; differentiable (its gradient is the
        trees' labelled-arc indicators)."""
        parts = self._label_parts()  # [B, N, N, L]
        batch, size, _, num_labels = parts.shape
        words = self.mask.clone()
        words[:, 0] = False
        lead = heads.shape[:-2]
        flat = parts.reshape(batch, size * size * num_labels)  # index (h, m, l)
        position = torch.arange(size, device=heads.device)
        index = (heads.clamp_min(0) * size + position) * num_labels + labels.clamp_min(0)
        index = index.reshape(-1, batch, size).masked_fill(~words, 0)  # [R, B, N]
        picked = flat.unsqueeze(0).expand(index.shape[0], -1, -1).gather(2, index)
        score = picked.masked_fill(~words, 0.0).sum(-1)  # [R, B]
        valid = torch.stack([self._valid(h) for h in heads.reshape(-1, batch, size)])
        return score.masked_fill(~valid, float("-inf")).reshape(*lead, batch)

    def _with_best_labels(self, heads: Tensor) -> LabelledHeads:
        """Heads [..., B, N] with each arc's best label (first of equal ones)."""
        assert self.label_scores is not None
        best = self.label_scores.argmax(-1)  # [B, N, N]
        return LabelledHeads(heads, self._gather_arcs(best, heads))

    @staticmethod
    def _gather_arcs(per_arc: Tensor, heads: Tensor) -> Tensor:
        """``per_arc[b, heads[..., b, m], m]`` for heads [..., B, N] (-1 where heads < 0)."""
        batch, size = heads.shape[-2:]
        flat = heads.reshape(-1, batch, size)
        table = per_arc.unsqueeze(0).expand(flat.shape[0], -1, -1, -1)
        out = table.gather(2, flat.clamp_min(0).unsqueeze(2)).squeeze(2)
        return out.masked_fill(flat < 0, -1).reshape(heads.shape)

    @cached_property
    def _max_view(self) -> TreeCRFBase:
        """The unlabelled distribution of the same class on each arc's best label score: its
        MAP (and k best) trees carry the labelled MAP (k best)."""
        assert self.label_scores is not None
        best = self.label_scores.detach().amax(-1)
        return type(self)(best, self.lengths, self.multiroot, validate_args=False)

    def _labelled_argmax(self) -> LabelledHeads:
        heads = self._max_view.argmax
        return self._with_best_labels(heads)

    @cached_property
    def max_score(self) -> Tensor:
        """Score of the highest-scoring tree, shape [B] (``-inf`` if none is valid)."""
        if self.label_scores is None:
            return super().max_score
        return self._labelled_max_score()

    def _labelled_max_score(self) -> Tensor:
        """The labelled MAP tree's score, [B], recomputed from the scores (its gradient is the
        tree's labelled-arc indicators)."""
        best = self._labelled_argmax()
        return self._labelled_score(best.heads, best.labels)

    @cached_property
    def entropy(self) -> Tensor:
        """Shannon entropy, shape [B]; labelled trees: the trees' entropy plus the expected
        entropy of the labels given the arcs."""
        trees = super().entropy
        if self.label_scores is None:
            return trees
        probs = self._label_probs
        log_probs = torch.log(probs).masked_fill(probs == 0, 0.0)
        per_arc = -(probs * log_probs).sum(-1)  # [B, N, N]
        return trees + (self.arc_marginals * per_arc).flatten(1).sum(-1)

    def _perturbed(self) -> StructuredDistribution:
        # labelled trees: the noise on every labelled arc (the arc scores are their logsumexp)
        if self.label_scores is None:
            return super()._perturbed()
        noisy = self.label_scores + gumbel_like(self.label_scores)
        return type(self)(noisy, self.lengths, self.multiroot, validate_args=False)

    def _sparsemap_parts(self) -> tuple[Tensor, ...]:
        # labelled trees: SparseMAP projects the labelled arcs [B, N, N, L]
        if self.label_scores is None:
            return super()._sparsemap_parts()
        return (self._label_parts(),)

    def _sparsemap_argmax(
        self, parts: tuple[Tensor, ...], lengths: Tensor | None
    ) -> tuple[Tensor, ...]:
        # labelled trees: the labels factor given the tree, so the MAP labelled tree is the
        # MAP tree under each arc's best label score, with that label (ties: the first)
        if self.label_scores is None:
            return super()._sparsemap_argmax(parts, lengths)
        best, label = parts[0].max(-1)  # [B, N, N] each
        (arcs,) = self._part_argmax((best,), lengths)
        onehot = torch.nn.functional.one_hot(label, self.num_labels).to(arcs.dtype)
        return (arcs.unsqueeze(-1) * onehot,)

    def _sample_labels(self, heads: Tensor) -> LabelledHeads:
        """Draw each arc's label from p(label | arc) (Gumbel-max, global RNG)."""
        assert self.label_scores is not None
        batch, size = heads.shape[-2:]
        flat = heads.reshape(-1, batch, size)
        logits = self.label_scores.detach()  # [B, N, N, L]
        num_labels = logits.shape[-1]
        table = logits.unsqueeze(0).expand(flat.shape[0], -1, -1, -1, -1)
        index = (
            flat.clamp_min(0).view(*flat.shape[:2], 1, size, 1).expand(-1, -1, 1, -1, num_labels)
        )
        word = table.gather(2, index).squeeze(2)  # [R, B, N, L]
        gumbel = -torch.empty_like(word).exponential_().log()
        labels = (word + gumbel).argmax(-1).masked_fill(flat < 0, -1)
        return LabelledHeads(heads, labels.reshape(heads.shape))

    # ---- k best trees -----------------------------------------------------------------------
    def _kbest_heads(self, k: int) -> Tensor:
        """Heads [k, B, N] of the k best unlabelled trees (-1 where missing)."""
        raise NotImplementedError

    def topk(self, k: int) -> tuple[Tensor, Tensor | LabelledHeads]:
        """The k best trees, exactly, best first: (scores [k, B], heads LongTensor [k, B, N]);
        labelled trees: (scores, :class:`LabelledHeads` of [k, B, N] each). Rank 0 is
        ``argmax`` (ties broken alike). An item with fewer than k trees of finite score gets
        ``-inf`` scores and ``-1`` heads (and labels) at the missing ranks. The scores are
        recomputed from the potentials (indicators times scores), so their gradient is the
        trees' (labelled-)arc indicators."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"`k` must be a positive int, got {k!r}")
        if self.label_scores is None:
            heads = self._kbest_heads(k)
            (arcs,) = self._parts(self.arc_scores)
            batch, size, _ = arcs.shape
            words = self.mask.clone()
            words[:, 0] = False
            flat_arcs = arcs.unsqueeze(0).expand(k, -1, -1, -1).reshape(k * batch, size, size)
            flat_words = words.repeat(k, 1)
            score = tree_score(flat_arcs, heads.reshape(k * batch, size), flat_words)
            score = score.view(k, batch)
            score = score.masked_fill(heads[..., 1] < 0, float("-inf"))
            return score, heads
        trees = self._max_view._kbest_heads(k)  # [k, B, N] under each arc's best label
        _, heads, labels = label_kbest(self._label_parts().detach(), trees, k)
        score = self._labelled_score(heads, labels)
        return score.masked_fill(heads[..., 1] < 0, float("-inf")), LabelledHeads(heads, labels)

    @property
    def num_tokens(self) -> Tensor:
        """Words per item (positions without ROOT, which has no head), LongTensor [B]."""
        return self._lengths_full - 1

    def impossible_reason(self, value: Tensor, item: int) -> str:
        """Why heads ``value[item]`` have probability 0: no tree (``-1`` at every word), not a
        tree, several children of ROOT under ``multiroot=False``, else the base reasons."""
        if isinstance(value, tuple):  # labelled: the labels can only hit a -inf score
            value = value[0]
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
    def _marginals_tuple(self) -> tuple[Tensor, ...]:
        if torch.compiler.is_compiling():  # one operator (no autograd.grad in a graph)
            return (eisner_marginals(*self._parts(*self._raw), self.lengths, self.multiroot),)
        return super()._marginals_tuple

    @cached_property
    def argmax(self) -> Tensor:
        """The highest-scoring tree (MAP): heads LongTensor [B, N], ``-1`` at ROOT and
        padding (and everywhere for an item with no tree). Labelled trees: a
        :class:`LabelledHeads` (heads and labels, LongTensors [B, N]): the best tree under each
        arc's best label score, with those labels (ties: the first label)."""
        if self.label_scores is not None:
            return self._labelled_argmax()  # type: ignore[return-value]
        best = eisner_argmax(self.arc_scores, self.lengths, self.multiroot)
        if best is None:  # the gradient of the max-plus inside pass
            return super().argmax
        score, heads = best
        return self._invalidate(heads, score)

    def sample(self, n: int = 1) -> Tensor:
        """``n`` exact samples of heads, LongTensor [n, B, N] (``-1`` at ROOT and padding);
        labelled trees: a :class:`LabelledHeads` of [n, B, N] each (each arc's label drawn
        from the softmax of its label scores). Uses the global torch RNG."""
        heads = super().sample(n)
        if self.label_scores is None:
            return heads
        return self._sample_labels(heads)  # type: ignore[return-value]

    def _kbest_heads(self, k: int) -> Tensor:
        (arcs,) = self._parts(self.arc_scores.detach())
        return eisner_kbest(arcs, self.lengths, self.multiroot, k)

    def _part_argmax(self, parts: tuple[Tensor, ...], lengths: Tensor | None) -> tuple[Tensor, ...]:
        # the C++ MAP kernel where it applies (no autograd round trip), else the max-plus
        # pass's gradient: the same tree
        best = eisner_argmax(parts[0], lengths, self.multiroot)
        if best is None:
            return super()._part_argmax(parts, lengths)
        score, heads = best
        return (self._indicators(self._invalidate(heads, score)).to(parts[0].dtype),)

    def impossible_reason(self, value: Tensor, item: int) -> str:
        """As :class:`TreeCRFBase`'s, and a valid tree with crossing arcs (non-projective)."""
        if isinstance(value, tuple):  # labelled: the labels can only hit a -inf score
            value = value[0]
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
