"""Binary constituency trees, e.g. from :func:`~structattn.trees.split_tree` (PRPN)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..trees import Tree, tree_to_brackets
from ._common import (
    _FONT,
    _MAP_COLOR,
    _MAX_INCHES,
    _as_labels,
    _new_figure,
    _output_path,
    _rc_context,
    _save,
)

__all__ = ["bracketed_tree"]


def _tree_layout(tree: Tree) -> tuple[list[Tree], list[tuple[float, float]], list[tuple[int, int]]]:
    """Leaves in order, node positions (leaves at y = 0, parents one above their highest
    child, x = mean of the children) and parent -> child edges (indices into positions)."""
    leaves: list[Tree] = []
    positions: list[tuple[float, float]] = []
    edges: list[tuple[int, int]] = []

    def walk(node: Tree) -> int:
        if isinstance(node, tuple):
            if len(node) != 2:
                raise ValueError(f"`tree` nodes must be pairs, got a tuple of length {len(node)}")
            left, right = walk(node[0]), walk(node[1])
            (xl, yl), (xr, yr) = positions[left], positions[right]
            positions.append(((xl + xr) / 2.0, max(yl, yr) + 1.0))
            edges.extend([(len(positions) - 1, left), (len(positions) - 1, right)])
        else:
            if node is None:
                raise ValueError("`tree` leaves must be tokens, got None")
            positions.append((float(len(leaves)), 0.0))
            leaves.append(node)
        return len(positions) - 1

    walk(tree)
    return leaves, positions, edges


def _relabel(tree: Tree, names: list[str]) -> Tree:
    """The same tree with the leaves, in order, replaced by ``names``."""
    counter = iter(names)

    def walk(node: Tree) -> Tree:
        if isinstance(node, tuple):
            return (walk(node[0]), walk(node[1]))
        return next(counter)

    return walk(tree)


def bracketed_tree(
    tree: Tree,
    path: str | Path,
    tokens: Sequence[object] | None = None,
    title: str | None = None,
) -> Path:
    """A binary constituency tree (e.g. from :func:`split_tree`), leaves at the bottom.

    Internal nodes sit one level above their highest child and centred over their two
    children; the bracket string (:func:`tree_to_brackets`) is printed under the title.

    Args:
        tree: nested 2-tuples with tokens (str or int) as leaves, as returned by
            :func:`split_tree`.
        path: output file (PNG unless the suffix says ``.pdf``/``.svg``); folders are made.
        tokens: optional T labels for the leaves, in left-to-right order (e.g. the words of
            a tree built over positions 0..T-1); default: the leaves themselves.
        title: figure title.

    Returns:
        The path written.

    Raises:
        ValueError: if ``tree`` has a node that is not a pair, or ``tokens`` does not have
            one entry per leaf.
    """
    leaves, positions, edges = _tree_layout(tree)
    names = _as_labels(tokens, len(leaves), "tokens", "one per leaf of `tree`")
    if tokens is None:
        names = [str(leaf) for leaf in leaves]
    brackets = tree_to_brackets(_relabel(tree, names))
    depth = max(y for _, y in positions)
    token_w = max(0.55, 0.085 * max(len(name) for name in names) + 0.2)
    width = len(leaves) * token_w + 0.6
    level_h = float(np.clip(3.2 / max(depth, 1), 0.3, 0.55))  # inches per tree level
    leaf_h = 0.4  # inches below y = 0 for the leaf labels
    out, fmt = _output_path(path)
    with _rc_context():
        fig = _new_figure(width, depth * level_h + leaf_h + 0.9)
        ax = fig.add_subplot()
        for parent, child in edges:
            (x0, y0), (x1, y1) = positions[parent], positions[child]
            ax.plot([x0, x1], [y0, y1], color=_MAP_COLOR, linewidth=1.3, zorder=1)
        internal = np.array([positions[p] for p, _ in edges[::2]]).reshape(-1, 2)
        ax.scatter(internal[:, 0], internal[:, 1], s=22, color=_MAP_COLOR, zorder=2)
        for i, name in enumerate(names):
            ax.text(
                i,
                -0.08,
                name,
                ha="center",
                va="top",
                fontsize=_FONT + 1,
                zorder=3,
                bbox={"boxstyle": "round,pad=0.25", "fc": "#eef2fa", "ec": "none"},
            )
        ax.set_xlim(-0.6, len(leaves) - 0.4)
        ax.set_ylim(-leaf_h / level_h, depth + 0.3)
        ax.axis("off")
        chars = max(30, int(min(width, _MAX_INCHES) * 72 / (0.6 * (_FONT - 0.5))))
        subtitle = textwrap.fill(brackets, width=chars)
        heading = f"{title}\n" if title else ""
        ax.set_title(heading, fontsize=_FONT + 2, loc="center")
        ax.text(
            0.5,
            1.0,
            subtitle,
            transform=ax.transAxes,
            ha="center",
            va="bottom",
            fontsize=_FONT - 0.5,
            family="monospace",
            color="0.25",
        )
        return _save(fig, out, fmt)
