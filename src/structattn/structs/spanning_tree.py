"""Maximum-weight spanning tree of an undirected complete graph (Prim's algorithm).

The interaction maps of mean-field attention (Liu et al., section 3.3) show the spanning
tree of largest total |J_ij| over the N inputs: the most significant interactions.

This is the undirected problem. :func:`~structattn.structs.nonprojective.chu_liu_edmonds`
solves the directed one (the best arborescence under a ROOT); on symmetric weights the two
have the same optimum (orient any spanning tree away from node 0), but Prim's algorithm
needs a single O(N^2) pass instead of up to N - 1 contraction rounds, runs on one [N, N]
matrix without a ROOT position, and breaks ties deterministically (lowest index first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

__all__ = ["maximum_spanning_tree"]


def _as_weights(weights: object) -> Tensor:
    """A finite float64 [N, N] tensor (N >= 1) from a tensor, array or nested list."""
    if isinstance(weights, Tensor):
        w = weights.detach().to("cpu", torch.float64)
    else:
        try:
            w = torch.as_tensor(weights, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError("`weights` must be a tensor, array or nested list of numbers") from err
    if w.dim() != 2 or w.shape[0] != w.shape[1] or w.shape[0] == 0:
        raise ValueError(
            f"`weights` must be a non-empty square [N, N] matrix, got shape {tuple(w.shape)}"
        )
    if not bool(torch.isfinite(w).all()):
        raise ValueError("`weights` must be finite (no NaN or inf)")
    return w


def maximum_spanning_tree(weights: Tensor | ArrayLike) -> list[tuple[int, int]]:
    """Maximum-weight spanning tree of the complete graph on N nodes (Prim's algorithm).

    ``weights`` [N, N] is read as symmetric ((W + W^T) / 2; the diagonal is ignored); any
    sign is allowed. For the most significant interactions of a mean-field J, pass |J|.
    O(N^2) time; ties go to the lower index, so the result is deterministic.

    Args:
        weights: [N, N] tensor, NumPy array or nested list, N >= 1, finite.

    Returns:
        The N - 1 edges ``(i, j)`` with i < j, sorted.

    Raises:
        ValueError: if ``weights`` is not a finite, non-empty square matrix.

    Example:
        >>> maximum_spanning_tree([[0, 3, 1], [3, 0, 2], [1, 2, 0]])
        [(0, 1), (1, 2)]
    """
    w = _as_weights(weights)
    n = w.shape[0]
    w = (w + w.T) / 2.0  # [N, N]
    in_tree = torch.zeros(n, dtype=torch.bool)  # [N]
    in_tree[0] = True
    best = w[0].clone()  # [N] weight of the best edge from the tree to each node
    parent = torch.zeros(n, dtype=torch.long)  # [N] the tree end of that edge
    edges = []
    for _ in range(n - 1):
        # torch.argmax returns the first maximum: the lowest index on ties
        j = int(best.masked_fill(in_tree, float("-inf")).argmax())
        i = int(parent[j])
        edges.append((min(i, j), max(i, j)))
        in_tree[j] = True
        closer = ~in_tree & (w[j] > best)  # [N] nodes for which j offers a better edge
        best = torch.where(closer, w[j], best)
        parent = torch.where(closer, j, parent)
    return sorted(edges)
