r"""Trees without dynamic programs: binary bracketings, their spans, head sequences, projectivity.

The ground floor under :mod:`structattn.structs` (it imports torch and the standard library
only), so that :mod:`structattn.data` and :mod:`structattn.viz` read a bracketing or check a
treebank without importing a dynamic program; :mod:`structattn.structs` and
:mod:`structattn.distributions` re-export these functions under their old names.

**Binary trees** (PRPN, notes section 4). A :data:`Tree` is a leaf (a token, ``str`` or
``int``) or a pair ``(left, right)`` of trees; every internal node has two children.

* :func:`split_tree` -- greedy SPLIT of syntactic distances [T] into a tree over T leaves;
* :func:`tree_to_brackets` -- the bracket string, ``(('a', 'b'), 'c')`` -> ``"((a b) c)"``;
* :func:`tree_spans` -- the constituents as spans ``(start, end)``, end exclusive, counted
  over leaves (the brackets of unlabeled F1).

>>> tree = split_tree([2, 0, 3, 1], tokens="a b c d".split())
>>> tree_to_brackets(tree), sorted(tree_spans(tree, include_root=True))
('((a b) (c d))', [(0, 2), (0, 4), (2, 4)])

**Dependency trees** as heads, LongTensor [B, N]: position 0 is the ROOT symbol,
``heads[b, m]`` is the head of word m (1..len-1) and ``lengths`` [B] counts positions
including ROOT; entries at position 0 and at padding are ignored.

* :func:`is_tree` -- BoolTensor [B]: a tree rooted at 0 (no cycle; one child of ROOT when
  ``multiroot=False``); unchecked input, O(B N log N);
* :func:`is_projective` -- BoolTensor [B]: no two arcs cross (checks its input);
  :func:`crossing_free` is the same test without the checks, O(B N^2);
* :func:`projectivize` -- the projective tree reached by lifting crossing arcs.

>>> heads = torch.tensor([[-1, 2, 0, 2], [-1, 3, 0, 0]])  # item 1: 3 -> 1 crosses ROOT -> 2
>>> is_tree(heads, torch.tensor([4, 4]), multiroot=True).tolist(), is_projective(heads).tolist()
([True, True], [True, False])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, TypeAlias

import torch
from torch import Tensor

from ._validation import check_heads

__all__ = [
    "Tree",
    "crossing_free",
    "is_projective",
    "is_tree",
    "projectivize",
    "split_tree",
    "tree_spans",
    "tree_to_brackets",
]

#: A binary tree: a leaf (token) or a pair (left, right) of trees.
Tree: TypeAlias = str | int | tuple["Tree", "Tree"]


# ---- binary trees: SPLIT, brackets, spans ------------------------------------------------------
def _as_floats(distances: Tensor | Sequence[float]) -> list[float]:
    if isinstance(distances, Tensor):
        if distances.dim() != 1:
            raise ValueError(
                f"`distances` must be one-dimensional, got shape {tuple(distances.shape)}"
            )
        values = [float(v) for v in distances.detach().tolist()]
    else:
        try:
            values = [float(v) for v in distances]
        except (TypeError, ValueError) as err:
            raise ValueError("`distances` must be a 1-d tensor or a sequence of numbers") from err
    if any(v != v for v in values):
        raise ValueError("`distances` contains NaN")
    return values


def split_tree(
    distances: Tensor | Sequence[float],
    tokens: Sequence[str] | Sequence[int] | None = None,
    attach: Literal["right", "left"] = "right",
) -> Tree:
    r"""Greedy recursive SPLIT (notes, section 4): a binary tree from syntactic distances.

    In a span x, choose i = argmax of d over the span (the leftmost one on ties) and return

    * ``attach="right"`` (the notes and PRPN): (SPLIT(x_{<i}), (x_i, SPLIT(x_{>i}))),
    * ``attach="left"``: ((SPLIT(x_{<i}), x_i), SPLIT(x_{>i})),

    where an empty part is dropped instead of kept as an empty node, so that ``(∅, y)`` becomes
    ``y`` and ``(x_i, ∅)`` becomes ``x_i``; every internal node has exactly two children.
    A one-token span is the token itself.

    This is exactly ``build_tree`` of PRPN's ``test_phrase_grammar.py`` (``numpy.argmax``
    picks the first maximum; empty parts are skipped): there too x_i opens the right part,
    i.e. d_i acts as the distance between x_{i-1} and x_i. PRPN parses with ``gates[1:-1]``,
    dropping the sentence-boundary tokens. ``attach="left"`` reads d_i as the distance
    between x_i and x_{i+1} instead.

    Args:
        distances: [T] distances (1-d tensor or sequence of numbers), T >= 1.
        tokens: T leaves (default: the positions 0, ..., T-1); leaves must not be tuples.
        attach: side of the split that the chosen token x_i joins.

    Returns:
        nested 2-tuples with the tokens as leaves (built without recursion: any T).

    Example:
        >>> split_tree([0.5, 0.1, 0.9, 0.2], tokens="a b c d".split())
        (('a', 'b'), ('c', 'd'))
    """
    values = _as_floats(distances)
    if not values:
        raise ValueError("`distances` must contain at least one value")
    leaves: list[str | int] = list(range(len(values))) if tokens is None else list(tokens)
    if len(leaves) != len(values):
        raise ValueError(f"`tokens` must have {len(values)} entries, got {len(leaves)}")
    if any(isinstance(leaf, tuple) for leaf in leaves):
        raise ValueError("`tokens` must not contain tuples (tuples are internal tree nodes)")
    if attach not in ("right", "left"):
        raise ValueError(f"`attach` must be 'right' or 'left', got {attach!r}")

    def join(left: Tree | None, right: Tree | None) -> Tree | None:
        if left is None:
            return right
        if right is None:
            return left
        return (left, right)

    # an explicit stack instead of recursion (a 1,000-word sentence is a 1,000-deep tree):
    # ("split", start, end) for the span [start, end), ("join", i) to combine the two
    # results on top of ``done`` around the chosen token i
    done: list[Tree | None] = []
    todo: list[tuple[str, int, int]] = [("split", 0, len(values))]
    while todo:
        kind, start, end = todo.pop()
        if kind == "join":
            right, left = done.pop(), done.pop()
            if attach == "right":
                done.append(join(left, join(leaves[start], right)))
            else:
                done.append(join(join(left, leaves[start]), right))
        elif start >= end:
            done.append(None)
        elif end - start == 1:
            done.append(leaves[start])
        else:
            i = max(range(start, end), key=lambda k: (values[k], -k))  # leftmost argmax
            todo += [("join", i, i), ("split", i + 1, end), ("split", start, i)]
    (tree,) = done
    assert tree is not None
    return tree


def tree_to_brackets(tree: Tree) -> str:
    """Bracket string of a binary tree: ``(('a', 'b'), 'c')`` -> ``"((a b) c)"``.

    A single leaf is returned without brackets (``"a"``).

    Example:
        >>> tree_to_brackets((("a", "b"), "c")), tree_to_brackets("a")
        ('((a b) c)', 'a')
    """
    parts: list[str] = []
    todo: list[tuple[bool, Tree | str]] = [(False, tree)]  # (literal text?, item); no recursion
    while todo:
        literal, node = todo.pop()
        if literal or not isinstance(node, tuple):
            parts.append(str(node))
            continue
        if len(node) != 2:
            raise ValueError(f"`tree` nodes must be pairs, got a tuple of length {len(node)}")
        todo += [(True, ")"), (False, node[1]), (True, " "), (False, node[0]), (True, "(")]
    return "".join(parts)


def tree_spans(
    tree: Tree, include_leaves: bool = False, include_root: bool = False
) -> set[tuple[int, int]]:
    """Constituent spans ``(start, end)`` (end exclusive, positions counted over leaves).

    The defaults give the brackets used for unlabeled F1 by PRPN's ``get_brackets``:
    every constituent of length >= 2 except the whole sentence. ``include_leaves`` adds
    the one-token spans, ``include_root`` the span of the whole tree.

    Example:
        >>> sorted(tree_spans((("a", "b"), ("c", "d"))))
        [(0, 2), (2, 4)]
    """
    spans: set[tuple[int, int]] = set()
    # post-order with an explicit stack (deep trees): a node is visited twice, first to
    # schedule its children, then (``closing``) to record its span [start, end)
    total = 0  # leaves seen so far
    todo: list[tuple[Tree, bool, int]] = [(tree, False, 0)]
    while todo:
        node, closing, start = todo.pop()
        if closing:
            if total - start > 1 or include_leaves:
                spans.add((start, total))
            continue
        if isinstance(node, tuple):
            if len(node) != 2:
                raise ValueError(f"`tree` nodes must be pairs, got a tuple of length {len(node)}")
            todo += [(node, True, total), (node[1], False, 0), (node[0], False, 0)]
        else:
            total += 1
            if include_leaves:
                spans.add((total - 1, total))
    if not include_root and total > 1:  # only the root spans every leaf
        spans.discard((0, total))
    return spans


# ---- dependency trees: heads [B, N], ROOT at 0 ------------------------------------------------
def is_tree(heads: Tensor, lengths: Tensor, multiroot: bool) -> Tensor:
    """BoolTensor [B]: ``heads`` [B, N] is a tree over positions 1..len-1 rooted at 0.

    Real modifiers are positions 1..lengths-1; entries at 0 and at padding are ignored.
    With ``multiroot=False`` exactly one modifier has head 0. Unchecked input (a head out
    of range makes the item False); O(B N log N) by pointer jumping.

    Example:
        >>> heads = torch.tensor([[-1, 2, 0, 2], [-1, 2, 1, 0], [-1, 0, 0, 0]])  # 1 <-> 2
        >>> is_tree(heads, torch.tensor([4, 4, 4]), multiroot=False).tolist()
        [True, False, False]
    """
    batch, size = heads.shape
    device = heads.device
    pos = torch.arange(size, device=device)
    real = (pos >= 1) & (pos < lengths.unsqueeze(-1))  # [B, N]
    in_range = (heads >= 0) & (heads < lengths.unsqueeze(-1)) & (heads != pos)
    ok = (in_range | ~real).all(-1)
    parent = torch.where(real & in_range, heads, torch.zeros_like(heads))
    for _ in range(max(1, math.ceil(math.log2(max(size, 2)))) + 1):
        parent = parent.gather(1, parent)  # pointer jumping: ancestor 2^k steps up
    ok &= ((parent == 0) | ~real).all(-1)  # every real node reaches ROOT: no cycle
    if not multiroot:
        ok &= ((heads == 0) & real).sum(-1) == 1
    return ok


def crossing_free(heads: Tensor, lengths: Tensor) -> Tensor:
    """BoolTensor [B]: no two arcs of ``heads`` [B, N] cross (ROOT at position 0 included).

    :func:`is_projective` without its input checks, for callers that checked ``heads`` and
    ``lengths`` [B] already (the distributions' ``log_prob``; no host sync). O(B N^2).

    Example:
        >>> crossing_free(torch.tensor([[-1, 2, 0, 2], [-1, 3, 0, 0]]), torch.tensor([4, 4]))
        tensor([ True, False])
    """
    size = heads.shape[1]
    pos = torch.arange(size, device=heads.device)
    real = (pos >= 1) & (pos < lengths.unsqueeze(-1))
    safe = heads.masked_fill(~real, 0)
    left = torch.minimum(safe, pos).unsqueeze(-1)  # [B, N, 1]
    right = torch.maximum(safe, pos).unsqueeze(-1)
    # arcs a (rows) and b (cols) cross if left_a < left_b < right_a < right_b
    cross = (
        (left < left.transpose(1, 2))
        & (left.transpose(1, 2) < right)
        & (right < right.transpose(1, 2))
    )
    both = real.unsqueeze(-1) & real.unsqueeze(1)
    return ~(cross & both).flatten(1).any(-1)


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
    heads, lengths, _ = check_heads(heads, lengths)
    return crossing_free(heads, lengths)


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
    heads, lengths, real = check_heads(heads, lengths)
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
