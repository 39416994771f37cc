"""Brute-force oracles: enumerate every structure of a tiny problem (float64).

These are deliberately naive and independent of the library's dynamic programs and of its
tree checks: validity is decided from definitions (reachability, descendant sets).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch import Tensor


# ---- chains -------------------------------------------------------------------------------
def chains(n: int, c: int) -> list[tuple[int, ...]]:
    """All label sequences of length n over c labels."""
    return list(itertools.product(range(c), repeat=n))


def chain_score(unary: Tensor, pairwise: Tensor, z: tuple[int, ...]) -> Tensor:
    """unary [N, C], pairwise [N-1, C, C]; score of the label sequence z (length <= N)."""
    s = sum(unary[i, z[i]] for i in range(len(z)))
    s = s + sum(pairwise[i, z[i], z[i + 1]] for i in range(len(z) - 1))
    return torch.as_tensor(s, dtype=unary.dtype)


# ---- trees --------------------------------------------------------------------------------
def _reaches_root(heads: tuple[int, ...]) -> bool:
    """heads[m-1] is the head of word m (1-based); True iff every word reaches 0 (no cycle)."""
    n = len(heads)
    for m in range(1, n + 1):
        seen = set()
        node = m
        while node != 0:
            if node in seen:
                return False
            seen.add(node)
            node = heads[node - 1]
    return True


def _descendants(heads: tuple[int, ...], h: int) -> set[int]:
    out = {h}
    changed = True
    while changed:
        changed = False
        for m in range(1, len(heads) + 1):
            if m not in out and heads[m - 1] in out:
                out.add(m)
                changed = True
    return out


def _projective(heads: tuple[int, ...]) -> bool:
    """Every arc h -> m dominates all words strictly between h and m."""
    for m in range(1, len(heads) + 1):
        h = heads[m - 1]
        desc = _descendants(heads, h)
        lo, hi = min(h, m), max(h, m)
        if any(k not in desc for k in range(lo + 1, hi)):
            return False
    return True


def trees(n_words: int, projective: bool, multiroot: bool) -> Iterator[tuple[int, ...]]:
    """All trees over words 1..n_words with ROOT 0, as head tuples (word m -> heads[m-1])."""
    choices = [[h for h in range(n_words + 1) if h != m] for m in range(1, n_words + 1)]
    for heads in itertools.product(*choices):
        if not _reaches_root(heads):
            continue
        if not multiroot and sum(h == 0 for h in heads) != 1:
            continue
        if projective and not _projective(heads):
            continue
        yield heads


def tree_score(arc_scores: Tensor, heads: tuple[int, ...]) -> Tensor:
    """arc_scores [N, N] (ROOT = 0); sum of arc scores of the tree."""
    return sum(arc_scores[h, m] for m, h in enumerate(heads, start=1))  # type: ignore[return-value]


# ---- generic summaries over an enumerated support ------------------------------------------
def summarize(scores: Tensor) -> dict[str, Tensor]:
    """log Z, probabilities, max score, entropy of a Gibbs distribution given all scores [S]."""
    logz = torch.logsumexp(scores, 0)
    probs = (scores - logz).exp()
    finite = torch.isfinite(scores)
    entropy = -(probs[finite] * (scores[finite] - logz)).sum()
    return {"log_partition": logz, "probs": probs, "max_score": scores.max(), "entropy": entropy}


# ---- analytic counts ----------------------------------------------------------------------
def count_projective(n_words: int, multiroot: bool) -> int:
    """Projective trees with ROOT at the left: A001764 (multi-root) / A006013 (single root)."""
    from math import comb

    if multiroot:
        return comb(3 * n_words, n_words) // (2 * n_words + 1)
    return comb(3 * n_words - 2, n_words - 1) // n_words


def count_nonprojective(n_words: int, multiroot: bool) -> int:
    """Cayley: (n+1)^(n-1) rooted at ROOT with any number of children; n^(n-1) single root."""
    return (n_words + 1) ** (n_words - 1) if multiroot else n_words ** (n_words - 1)
