"""Pure dynamic programs over log-potentials (no parameters, no nn.Modules).

The tree utilities that need no dynamic program (bracketings, spans, head checks,
projectivity) live in :mod:`structattn.trees`, one floor below; they are re-exported here.

The optional C++ kernels (CPU, float32 / float64) are built on first use; from outside this
package: :func:`build_kernels` (build now or raise), :func:`kernels` (the compiled module if
it applies to a tensor and can be built, else None: the PyTorch code runs) and
:func:`kernels_disabled` (a block that runs the PyTorch code).
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
from ._extension import build_kernels, kernels, kernels_disabled

__all__ = [
    "Tree",
    "build_kernels",
    "crossing_free",
    "is_projective",
    "is_tree",
    "kernels",
    "kernels_disabled",
    "projectivize",
    "split_tree",
    "tree_spans",
    "tree_to_brackets",
]
