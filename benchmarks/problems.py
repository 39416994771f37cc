"""Benchmark problems in *our* parametrisation, and brute-force references for tiny ones.

Every library is fed the same problem: a peer adapter (``peers.py``) converts our tensors
to the peer's native layout. Conventions (ours, see ``structattn``):

* trees (projective and non-projective): ``arc_scores`` [B, N, N], position 0 is ROOT,
  ``arc_scores[b, h, m]`` scores head h -> modifier m; ``lengths`` [B] count positions
  *including* ROOT (so an item has ``lengths - 1`` words). N below is this N.
* chains: ``unary`` [B, N, C] and a shared ``pairwise`` [C, C] with ``pairwise[a, c]`` the
  score of (z_i = a, z_{i+1} = c); ``lengths`` [B] in 1..N. (A shared transition matrix is
  the only form every peer accepts: supar and pytorch-crf have no per-position one.)

``weight`` has the shape of the marginals (of the first tensor); the "marginals
forward+backward" measurement differentiates ``(marginals * weight).sum()``.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

__all__ = [
    "Problem",
    "brute_chain",
    "brute_tree",
    "make_chain",
    "make_tree",
]


_P = TypeVar("_P", bound="Problem")


@dataclass(frozen=True)
class Problem:
    """One batch of inputs in our parametrisation (float32, detached)."""

    kind: str  # "tree" (projective), "nonproj" or "chain"
    tensors: tuple[Tensor, ...]  # (arc_scores,) or (unary, pairwise)
    lengths: Tensor | None  # None = full lengths
    multiroot: bool
    weight: Tensor  # random weights of the linear loss on the marginals

    def to(self: _P, dtype: torch.dtype) -> _P:
        """The same problem (of the same class) with tensors and weights cast to ``dtype``."""
        tensors = tuple(t.to(dtype) for t in self.tensors)
        return dataclasses.replace(self, tensors=tensors, weight=self.weight.to(dtype))

    @property
    def batch(self) -> int:
        return self.tensors[0].shape[0]

    @property
    def size(self) -> int:
        """N: positions per item (ROOT included for trees)."""
        return self.tensors[0].shape[1]

    @property
    def num_labels(self) -> int:
        """C for chains (0 for trees)."""
        return self.tensors[0].shape[2] if self.kind == "chain" else 0

    @property
    def full_lengths(self) -> Tensor:
        """``lengths`` with None replaced by N everywhere."""
        if self.lengths is None:
            return torch.full((self.batch,), self.size, dtype=torch.long)
        return self.lengths

    @property
    def mask(self) -> Tensor:
        """BoolTensor [B, N]: real positions (ROOT included for trees)."""
        return torch.arange(self.size) < self.full_lengths.unsqueeze(-1)

    @property
    def modifier_mask(self) -> Tensor:
        """BoolTensor [B, N]: real modifiers of a tree (real positions without ROOT)."""
        mask = self.mask.clone()
        mask[:, 0] = False
        return mask


def _lengths(
    batch: int, size: int, variable: bool, low: int, gen: torch.Generator
) -> Tensor | None:
    """None (full), or lengths drawn uniformly from [max(low, N/2), N] with one item at N
    (torch-struct's linear chain requires max(lengths) == N)."""
    if not variable:
        return None
    lengths = torch.randint(max(low, size // 2), size + 1, (batch,), generator=gen)
    lengths[0] = size
    return lengths


def make_tree(
    batch: int, size: int, variable: bool, multiroot: bool, projective: bool = True, seed: int = 0
) -> Problem:
    """Random arc scores (standard normal) for a batch of trees with N = ``size``."""
    gen = torch.Generator().manual_seed(seed)
    arcs = torch.randn(batch, size, size, generator=gen)
    weight = torch.randn(batch, size, size, generator=gen)
    lengths = _lengths(batch, size, variable, 2, gen)
    kind = "tree" if projective else "nonproj"
    return Problem(kind, (arcs,), lengths, multiroot, weight)


def make_chain(batch: int, size: int, labels: int, variable: bool, seed: int = 0) -> Problem:
    """Random unary and shared pairwise scores (standard normal) for a batch of chains."""
    gen = torch.Generator().manual_seed(seed)
    unary = torch.randn(batch, size, labels, generator=gen)
    pairwise = torch.randn(labels, labels, generator=gen)
    weight = torch.randn(batch, size, labels, generator=gen)
    lengths = _lengths(batch, size, variable, 1, gen)
    return Problem("chain", (unary, pairwise), lengths, True, weight)


# ---- brute force (float64 enumeration; independent of every library) ---------------------
def _summarise(scores: Tensor, parts: Tensor) -> tuple[Tensor, Tensor]:
    """log Z and marginals from all structure scores [S] and part indicators [S, ...]."""
    logz = torch.logsumexp(scores, 0)
    probs = (scores - logz).exp()
    return logz, torch.einsum("s,s...->...", probs, parts)


def brute_chain(problem: Problem) -> tuple[Tensor, Tensor]:
    """log Z [B] and node marginals [B, N, C] by enumerating all label sequences."""
    unary, pairwise = (t.double() for t in problem.tensors)
    batch, size, labels = unary.shape
    logzs, margs = [], []
    for b in range(batch):
        n = int(problem.full_lengths[b])
        seqs = torch.tensor(list(itertools.product(range(labels), repeat=n)))  # [S, n]
        pos = torch.arange(n)
        scores = unary[b, pos, seqs].sum(-1)
        if n > 1:
            scores = scores + pairwise[seqs[:, :-1], seqs[:, 1:]].sum(-1)
        parts = torch.zeros(len(seqs), size, labels, dtype=torch.float64)
        parts[torch.arange(len(seqs)).unsqueeze(-1), pos, seqs] = 1.0
        logz, marg = _summarise(scores, parts)
        logzs.append(logz)
        margs.append(marg)
    return torch.stack(logzs), torch.stack(margs)


def _is_tree(heads: tuple[int, ...], multiroot: bool, projective: bool) -> bool:
    """heads[m - 1] is the head of word m; ROOT is 0."""
    n = len(heads)
    for m in range(1, n + 1):  # every word reaches ROOT (no cycle)
        node, steps = m, 0
        while node != 0 and steps <= n:
            node, steps = heads[node - 1], steps + 1
        if node != 0:
            return False
    if not multiroot and sum(h == 0 for h in heads) != 1:
        return False
    if projective:  # with ROOT leftmost, projective <=> no two arcs cross
        spans = [(min(h, m), max(h, m)) for m, h in enumerate(heads, start=1)]
        for (l1, r1), (l2, r2) in itertools.permutations(spans, 2):
            if l1 < l2 < r1 < r2:
                return False
    return True


def brute_tree(problem: Problem) -> tuple[Tensor, Tensor]:
    """log Z [B] and arc marginals [B, N, N] (ours layout) by enumerating all trees."""
    (arcs,) = (t.double() for t in problem.tensors)
    batch, size, _ = arcs.shape
    projective = problem.kind == "tree"
    logzs, margs = [], []
    for b in range(batch):
        words = int(problem.full_lengths[b]) - 1
        choices = [[h for h in range(words + 1) if h != m] for m in range(1, words + 1)]
        all_heads = [
            h for h in itertools.product(*choices) if _is_tree(h, problem.multiroot, projective)
        ]
        heads = torch.tensor(all_heads)  # [S, words]
        mods = torch.arange(1, words + 1)
        scores = arcs[b, heads, mods].sum(-1)
        parts = torch.zeros(len(heads), size, size, dtype=torch.float64)
        parts[torch.arange(len(heads)).unsqueeze(-1), heads, mods] = 1.0
        logz, marg = _summarise(scores, parts)
        logzs.append(logz)
        margs.append(marg)
    return torch.stack(logzs), torch.stack(margs)
