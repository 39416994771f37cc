"""The k best dependency trees, exactly: projective (k-best Eisner) and non-projective (Lawler's
partition of the trees, with Chu-Liu-Edmonds on every part), and the k best labellings of
given trees (labelled trees).

Shapes: ``arc_scores`` [B, N, N] (position 0 is ROOT, ``arc_scores[b, h, m]`` the arc
h -> m), ``lengths`` [B] counting ROOT; heads come back as LongTensor [k, B, N], best first,
``-1`` at ROOT and padding, and ``-1`` everywhere for a rank with no tree (an item with fewer
than k trees of finite score). The functions return structures only: the distributions
recompute the scores from the potentials, so that the scores' gradient is the structures'
indicators.

Ties are broken the same way as the MAP decoders, so that rank 0 is the tree that
``argmax`` returns: the k-best Eisner pass orders the alternatives of every chart cell by
(split point, rank of the left piece, rank of the right piece) and sorts stably, which for
k = 1 is the max semiring with the first split point winning, as in
:func:`structattn.structs.dependency.eisner_max`; Lawler's partition starts from
:func:`structattn.structs.nonprojective.chu_liu_edmonds` on the unconstrained scores.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .._precision import full_precision
from .._validation import last_index, length_mask
from .dependency import _arcs_by_width
from .nonprojective import chu_liu_edmonds

__all__ = ["arborescence_kbest", "eisner_kbest", "label_kbest"]

_NEG_INF = float("-inf")
# the largest k whose bit masks 2^0 + ... + 2^(k-1) a float holds exactly
_EXACT_BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


def _top(x: Tensor, k: int) -> Tensor:
    """The k largest entries of ``x`` along its last dimension, best first, equal values in
    index order (a stable sort; ``-inf`` fills a list shorter than k). Differentiable: the
    gradient reaches the entries chosen."""
    short = k - x.shape[-1]
    if short > 0:
        x = torch.cat([x, x.new_full((*x.shape[:-1], short), _NEG_INF)], -1)
    values, _ = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k]


@functools.lru_cache(maxsize=32)
def _rank_pairs(k: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The rank pairs (a, c) with (a + 1)(c + 1) <= k, in (a, c) order: the only sums of two
    sorted k-lists that can be among the k best (a sum of ranks a, c is beaten by the
    (a + 1)(c + 1) - 1 sums of ranks <= a, <= c), about k ln k of the k^2."""
    pairs = [(a, c) for a in range(k) for c in range(k // (a + 1))]
    index = torch.tensor(pairs, dtype=torch.long, device=device)
    return index[:, 0], index[:, 1]


def _times(a: Tensor, b: Tensor) -> Tensor:
    """The k-best semiring's product of the sorted k-lists ``a``, ``b`` [..., J, K] (J
    alternatives, e.g. split points): [..., J * P], the sums of the P rank pairs that can be
    among the k best, ordered by (j, rank in a, rank in b)."""
    first, second = _rank_pairs(a.shape[-1], a.device)
    # index_select, not a[..., first]: the advanced-indexing kernel stalls on a busy machine
    return (a.index_select(-1, first) + b.index_select(-1, second)).flatten(-2)


def _eisner_kbest_scores(arc_scores: Tensor, last: Tensor, multiroot: bool, k: int) -> Tensor:
    """The k best projective tree scores [B, K] by Eisner's algorithm in the k-best semiring
    (differentiable by autograd: the gradient of rank r is the r-th tree's arc indicators).

    The charts of :func:`structattn.structs.dependency.eisner_inside` with a k-list in every
    cell; stripes [B, 2, n, w, K] (n = N - w spans of width w, split j < w):
      comp_s = (complete[i+j, i], complete[i, i+j]); comp_e = (complete[i+w, i+1+j],
      complete[i+1+j, i+w]); inc_s[b, i, j] = incomplete[i, i+1+j]; inc_e[b, i, j] =
      incomplete[i+w, i+j] (no direction dimension for the last two).
    """
    batch, size, _ = arc_scores.shape
    device = arc_scores.device
    arcs = _arcs_by_width(arc_scores)  # per width [B, 2, n]: (s -> t, t -> s)
    unit = arc_scores.new_full((k,), _NEG_INF)
    unit[0] = 0.0  # a complete span of width 0: one derivation, score 0
    comp_s = unit.expand(batch, 2, size - 1, 1, k)
    comp_e = comp_s
    inc_s: Tensor | None = None
    inc_e: Tensor | None = None
    if not multiroot:
        widths = torch.arange(size, device=device)
        root_open = last.unsqueeze(0) != widths.unsqueeze(1)  # [N, B]
    tops = []
    for w in range(1, size):
        n = size - w
        # inner[b, s] = top-k over (j, a, c) of complete[s, s+j]_a + complete[t, s+j+1]_c
        inner = _top(_times(comp_s[:, 1], comp_e[:, 0]), k)  # [B, n, K]
        inc = inner.unsqueeze(1) + arcs[w].unsqueeze(-1)  # [B, 2, n, K]: (s -> t, t -> s)
        new_s = inc[:, 0].unsqueeze(2)  # [B, n, 1, K]
        new_e = inc[:, 1].unsqueeze(2)
        inc_s = new_s if inc_s is None else torch.cat([inc_s[:, :n], new_s], 2)
        inc_e = new_e if inc_e is None else torch.cat([new_e, inc_e[:, 1:]], 2)
        # left complete[t, s]: split k = s + j ascending (j = 0 is the arc t -> s itself);
        # right complete[s, t]: k = s + 1 + j ascending (j = w - 1 is the arc s -> t itself)
        left = _top(_times(comp_s[:, 0], inc_e), k)  # [B, n, K]
        right = _top(_times(inc_s, comp_e[:, 1]), k)
        if not multiroot:  # ROOT's right span is closed only at the sentence end
            right = right.clone()
            right[:, 0] = right[:, 0].masked_fill(root_open[w].unsqueeze(-1), _NEG_INF)
        comp = torch.stack([left, right], 1)  # [B, 2, n, K]
        tops.append(comp[:, 1, :1])  # [B, 1, K]: complete[0, w]
        if w < size - 1:
            comp_s = torch.cat([comp_s[:, :, : n - 1], comp[:, :, : n - 1, None]], 3)
            comp_e = torch.cat([comp[:, :, 1:, None], comp_e[:, :, 1:]], 3)
    top = torch.cat(tops, 1)  # [B, N-1, K]
    return top.gather(1, (last - 1).view(-1, 1, 1).expand(-1, 1, k)).squeeze(1)


def _rank_arcs(top: Tensor, leaf: Tensor) -> Tensor:
    """The arcs [K, B, N, N] (0/1) of the trees whose scores are ``top`` [B, K], a
    differentiable function of the arc scores ``leaf`` [B, N, N] (the k-best semiring's
    scores: the gradient of rank r is its tree's arcs)."""
    batch, k = top.shape
    if k <= _EXACT_BITS.get(top.dtype, 0):
        # one backward pass: seeding rank r with 2^r makes each arc's gradient the bit
        # mask of the trees that hold it (sums of distinct powers of two are exact)
        seed = 2.0 ** torch.arange(k, dtype=top.dtype, device=top.device)
        (grad,) = torch.autograd.grad(top, leaf, seed.expand(batch, k))
        bits = grad.detach().round().long()  # [B, N, N]
        rank = torch.arange(k, device=bits.device).view(-1, 1, 1, 1)
        return ((bits.unsqueeze(0) >> rank) & 1).to(top.dtype)
    # one backward pass per rank
    return torch.stack(
        [torch.autograd.grad(top[:, r].sum(), leaf, retain_graph=r < k - 1)[0] for r in range(k)]
    ).detach()


def _indicators_to_heads(arcs: Tensor, missing: Tensor) -> Tensor:
    """Heads [..., N] from arc indicators [..., N, N]; -1 at words without an arc and
    everywhere where ``missing`` [...]."""
    heads = arcs.argmax(-2)
    heads = heads.masked_fill(arcs.sum(-2) == 0, -1)
    return heads.masked_fill(missing.unsqueeze(-1), -1)


@full_precision
def eisner_kbest(arc_scores: Tensor, lengths: Tensor | None, multiroot: bool, k: int) -> Tensor:
    """Heads LongTensor [k, B, N] of the k best projective trees, best first (exact: Eisner's
    algorithm in the k-best semiring; every projective tree has one derivation, so the k best
    derivations are k distinct trees). ``arc_scores`` must already have ``-inf`` in column 0
    and on the diagonal. Time O(B N^3 k log k log(N k)), memory O(B N^3 k log k) (the
    sorted candidates of every width, kept for the backward pass). The trees are read off
    the gradient of the k scores seeded with 2^r: bit r of an arc's gradient says whether
    the r-th tree holds it (one backward pass; k of them above k = 24 in float32, 53 in
    float64). Ranks with no tree (fewer than k trees of finite score) are ``-1``
    everywhere."""
    batch, size, _ = arc_scores.shape
    last = last_index(lengths, batch, size, arc_scores.device)
    with torch.inference_mode(False), torch.enable_grad():
        leaf = arc_scores.detach().clone().requires_grad_(True)
        top = _eisner_kbest_scores(leaf, last, multiroot, k)  # [B, K]
        grads = _rank_arcs(top, leaf)
    return _indicators_to_heads(grads, torch.isneginf(top.detach()).t())


def _heads_score(scores: Tensor, heads: Tensor) -> Tensor:
    """Sum of ``scores`` [M, N, N] over the arcs heads[m] -> m, [M]; ``-inf`` where heads are
    -1 at word 1 (no tree)."""
    has = heads >= 0
    arcs = scores.gather(1, heads.clamp(min=0).unsqueeze(1)).squeeze(1)  # [M, N]
    total = arcs.masked_fill(~has, 0.0).sum(-1)
    return total.masked_fill(~has[:, 1], _NEG_INF)


@full_precision
def arborescence_kbest(
    arc_scores: Tensor, lengths: Tensor | None, multiroot: bool, k: int
) -> Tensor:
    """Heads LongTensor [k, B, N] of the k best non-projective trees, best first; exact.

    Lawler's (1972) partition of the solution space (as in Camerini et al. 1980, who
    refine the same scheme to O(k N^2)): a part is the set of trees that contain some
    arcs and avoid others; its best tree is Chu-Liu-Edmonds' on the scores with the avoided
    arcs and the rivals of the contained ones at ``-inf`` (exact: :func:`chu_liu_edmonds`
    treats ``-inf`` arcs exactly). Each round outputs the best tree of all parts, removes
    its part P and adds the n parts "P, with the heads of words 1..i-1 of that tree and
    without the head of word i" (i = 1..n), which together are P minus that tree. Batched:
    each round is one call of :func:`chu_liu_edmonds` on B n problems; k - 1 rounds, so time
    O(k B N^3) per round of contractions, memory O(k B N^3) bits for the parts' constraints.
    Ties between parts go to the part made first (the argmax tree is rank 0)."""
    batch, size, _ = arc_scores.shape
    device = arc_scores.device
    scores = arc_scores.detach()
    real = length_mask(lengths, batch, size, device)  # [B, N]
    best = chu_liu_edmonds(scores, lengths, multiroot)  # [B, N]
    pool_score = _heads_score(scores, best).unsqueeze(1)  # [B, P]
    pool_heads = best.unsqueeze(1)  # [B, P, N]
    pool_banned = torch.zeros(batch, 1, size, size, dtype=torch.bool, device=device)
    rows = torch.arange(size, device=device)
    words = torch.arange(1, size, device=device)  # i = 1..N-1, one child part each
    before = (rows.view(1, -1) < words.view(-1, 1)) & (rows.view(1, -1) >= 1)  # [N-1, N]: m < i
    at = rows.view(1, -1) == words.view(-1, 1)  # [N-1, N]: m == i
    out = []
    for r in range(k):
        pick = pool_score.argmax(1, keepdim=True)  # [B, 1], the first of equal parts
        score = pool_score.gather(1, pick).squeeze(1)
        heads = pool_heads.gather(1, pick.unsqueeze(-1).expand(-1, 1, size)).squeeze(1)
        missing = torch.isneginf(score)
        out.append(heads.masked_fill(missing.unsqueeze(-1), -1))
        if r == k - 1:
            break
        index = pick.view(batch, 1, 1, 1).expand(-1, 1, size, size)
        banned = pool_banned.gather(1, index).squeeze(1)  # [B, N, N]
        # removed (never chosen again while a tree is left)
        pool_score = pool_score.scatter(1, pick, _NEG_INF)
        # child i [B, N-1, N(h), N(m)]: keep the tree's arcs into words m < i, avoid its arc
        # into word i
        is_head = rows.view(1, 1, -1, 1) == heads.view(batch, 1, 1, size)  # [B, 1, N, N]
        child = banned.unsqueeze(1) | (before.view(1, -1, 1, size) & ~is_head)
        child = child | (at.view(1, -1, 1, size) & is_head)
        flat = scores.unsqueeze(1).masked_fill(child, _NEG_INF).view(-1, size, size)
        child_lengths = None if lengths is None else lengths.repeat_interleave(size - 1)
        child_heads = chu_liu_edmonds(flat, child_lengths, multiroot)  # [B (N-1), N]
        child_score = _heads_score(flat, child_heads).view(batch, size - 1)
        # no part for words beyond the item's length, nor below a part with no tree
        useless = ~real[:, 1:] | missing.unsqueeze(-1)
        child_score = child_score.masked_fill(useless, _NEG_INF)
        pool_score = torch.cat([pool_score, child_score], 1)
        pool_heads = torch.cat([pool_heads, child_heads.view(batch, size - 1, size)], 1)
        pool_banned = torch.cat([pool_banned, child], 1)
    return torch.stack(out)


def label_kbest(label_scores: Tensor, heads: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The k best labelled trees among the given trees with any labels: (scores [k, B] (no
    gradient), heads [k, B, N], labels [k, B, N]), best first, ``-1`` where missing.

    ``label_scores`` [B, N, N, L] (banned arcs ``-inf``), ``heads`` [T, B, N] (-1 at ROOT,
    padding and missing trees): the k best trees under the best-label arc scores
    ``label_scores.amax(-1)``. The k best labelled trees are among these trees' k best
    labellings (a labelled tree on a tree of rank > k is beaten by the best labellings of k
    better trees), and a tree's k best labellings are the k best sums of one label per word
    (k-best semiring over the words, O(N k^2 log k) per tree). Ties: tree rank first, then the
    labels' rank lists (best label first, in label order), so rank 0 is the argmax tree with
    each arc's first best label."""
    trees, batch, size = heads.shape
    num_labels = label_scores.shape[-1]
    kl = min(k, num_labels)
    with torch.no_grad():
        safe = heads.clamp_min(0)  # [T, B, N]
        # per word, the scores of its arc's labels [T, B, N, L]
        per_word = label_scores.unsqueeze(0).expand(trees, -1, -1, -1, -1)
        index = safe.view(trees, batch, 1, size, 1).expand(-1, -1, 1, -1, num_labels)
        per_word = per_word.gather(2, index).squeeze(2)
        values, order = torch.sort(per_word, dim=-1, descending=True, stable=True)
        values, order = values[..., :kl], order[..., :kl]  # [T, B, N, kl]
        unused = heads < 0  # ROOT, padding: the one derivation 0, label -1
        first = torch.zeros(kl, dtype=values.dtype, device=values.device)
        first[1:] = _NEG_INF
        values = torch.where(unused.unsqueeze(-1), first, values)
        acc = values.new_full((trees, batch, k), _NEG_INF)
        acc[..., 0] = 0.0
        acc[..., 0] = acc[..., 0].masked_fill(heads[..., 1] < 0, _NEG_INF)  # no tree
        pointers = []
        for m in range(1, size):
            cand = (acc.unsqueeze(-1) + values[:, :, m].unsqueeze(-2)).flatten(-2)  # [T,B,k kl]
            top, ptr = torch.sort(cand, dim=-1, descending=True, stable=True)
            acc = _pad_last(top[..., :k], k)
            pointers.append(_pad_last(ptr[..., :k], k, 0))
        # merge the trees: [B, T k] ordered by (tree rank, labelling rank)
        merged = acc.permute(1, 0, 2).reshape(batch, trees * k)
        best, pos = torch.sort(merged, dim=-1, descending=True, stable=True)
        best, pos = _pad_last(best[:, :k], k), _pad_last(pos[:, :k], k, 0)  # [B, k]
        tree = (pos // k).t()  # [k, B]
        rank = (pos % k).t()
        labels = heads.new_full((k, batch, size), -1)
        # flat gathers, not advanced indexing (its kernel stalls on a busy machine)
        row = tree * batch + torch.arange(batch, device=heads.device)  # [k, B]: (tree, item)
        for m in range(size - 1, 0, -1):
            flat = pointers[m - 1].reshape(-1).gather(0, (row * k + rank).flatten()).view(k, batch)
            rank, choice = flat // kl, flat % kl
            at = ((row * size + m) * kl + choice).flatten()
            labels[:, :, m] = order.reshape(-1).gather(0, at).view(k, batch)
        out_heads = heads.reshape(trees * batch, size).index_select(0, row.flatten())
        out_heads = out_heads.view(k, batch, size)
        missing = torch.isneginf(best.t())
        out_heads = out_heads.masked_fill(missing.unsqueeze(-1), -1)
        labels = labels.masked_fill((out_heads < 0), -1)
    return best.t(), out_heads, labels


def _pad_last(x: Tensor, k: int, fill: float = _NEG_INF) -> Tensor:
    """``x`` [..., j] padded to [..., k] with ``fill``."""
    short = k - x.shape[-1]
    if short <= 0:
        return x
    return torch.cat([x, x.new_full((*x.shape[:-1], short), fill)], -1)
