"""Pure dynamic programs over log-potentials (no parameters, no nn.Modules).

The tree utilities that need no dynamic program (bracketings, spans, head checks,
projectivity) live in :mod:`structattn.trees`, one floor below; they are re-exported here.
"""

from ..trees import (
    Tree,
    crossing_free,
    is_projective,
    is_tree,
    projectivize,
    split_tree,
    tree_spans,
    tree_to_brackets,
)
from ._extension import build_kernels

__all__ = [
    "build_kernels",
    "Tree",
    "crossing_free",
    "is_projective",
    "is_tree",
    "projectivize",
    "split_tree",
    "tree_spans",
    "tree_to_brackets",
]
