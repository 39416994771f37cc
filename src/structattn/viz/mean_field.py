"""Mean-field interactions J and their maximum-|J| spanning tree (Liu et al., section 3.3),
and :func:`mean_field_figures`: the figures of one trained model's attention on one example
(Figures 3-4 and section 3.3).

The spanning tree itself is computed in
:func:`structattn.structs.spanning_tree.maximum_spanning_tree` (re-exported here)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..structs.spanning_tree import maximum_spanning_tree
from ._common import (
    _FONT,
    _MAX_INCHES,
    _SMALL,
    ArrayLike,
    _as_array,
    _as_labels,
    _cell_inches,
    _label_heatmap_axes,
    _new_figure,
    _output_path,
    _rc_context,
    _save,
    _shorten,
    _text_inches,
)
from .heatmaps import attention_heatmap
from .results import line_curves

__all__ = ["interaction_map", "mean_field_figures"]


def _tidy_tree_layout(n: int, edges: list[tuple[int, int]], root: int) -> np.ndarray:
    """[N, 2] positions of a tree: root on top, one row per depth, leaves evenly spaced
    and each parent centred over its children."""
    children: list[list[int]] = [[] for _ in range(n)]
    adjacency: list[list[int]] = [[] for _ in range(n)]
    for i, j in edges:
        adjacency[i].append(j)
        adjacency[j].append(i)
    order, depth, seen = [root], [0] * n, {root}
    for node in order:  # breadth first
        for other in sorted(adjacency[node]):
            if other not in seen:
                seen.add(other)
                children[node].append(other)
                depth[other] = depth[node] + 1
                order.append(other)
    xs = [0.0] * n
    next_leaf = 0.0

    def place(node: int) -> None:  # post-order: a parent is centred over its children
        nonlocal next_leaf
        for child in children[node]:
            place(child)
        if children[node]:
            xs[node] = (xs[children[node][0]] + xs[children[node][-1]]) / 2.0
        else:
            xs[node] = next_leaf
            next_leaf += 1.0

    place(root)
    return np.array([[xs[i], -float(depth[i])] for i in range(n)])


def interaction_map(
    J: ArrayLike,
    labels: Sequence[object] | None,
    path: str | Path,
    spanning_tree: bool = True,
    title: str | None = None,
) -> Path:
    """Mean-field interactions J as a heatmap, and their maximum-|J| spanning tree.

    The interaction map of Liu et al. (section 3.3): the left panel shows J_ij with a
    diverging colormap centred at 0 (red: J > 0, the inputs tend to be attended together;
    blue: J < 0, they exclude each other). With ``spanning_tree``, the right panel shows the
    spanning tree of maximum total |J| over the N inputs (the paper's "minimum spanning
    tree on J" that shows the most significant interactions): edges coloured by the sign
    of J and as wide as |J|, laid out as a tree rooted at its best-connected input.

    Args:
        J: [N, N] interactions (``out.interactions[b, q]`` of :class:`MeanFieldAttention`;
            slice off padding, whose rows and columns are 0). A non-symmetric J is
            symmetrised as (J + J^T) / 2 for the tree.
        labels: N input labels; None for 0..N-1.
        path: output file (PNG unless the suffix says ``.pdf``/``.svg``); folders are made.
        spanning_tree: add the spanning-tree panel.
        title: figure title.

    Returns:
        The path written.

    Raises:
        ValueError: if ``J`` is not a finite square matrix or ``labels`` does not match it.
    """
    coupling = _as_array(J, "J", 2)
    n = coupling.shape[0]
    if coupling.shape != (n, n) or n == 0:
        raise ValueError(f"`J` must be a non-empty square [N, N] matrix, got {coupling.shape}")
    names = _as_labels(labels, n, "labels", f"one per row of `J` {coupling.shape}")
    scale = float(np.abs(coupling).max()) or 1.0
    cell = _cell_inches(n)
    fontsize = float(np.clip(cell * 24, 6, _FONT - 1))
    label_w = _text_inches(names, fontsize)
    heat_w = n * cell + label_w + 1.3
    heat_h = n * cell + label_w * 0.87 + 0.9
    draw_tree = spanning_tree and n > 1
    if draw_tree:
        symmetric = (coupling + coupling.T) / 2.0
        edges = maximum_spanning_tree(np.abs(symmetric))
        strength = np.zeros(n)  # total |J| of each node's tree edges
        for i, j in edges:
            strength[[i, j]] += abs(symmetric[i, j])
        pos = _tidy_tree_layout(n, edges, root=int(np.argmax(strength)))
        span_x, span_y = float(np.ptp(pos[:, 0])), float(np.ptp(pos[:, 1]))
        node_names = names
        if len(set(names)) < n:  # repeated tokens: tell the nodes apart by position
            node_names = [f"{name} ({i})" for i, name in enumerate(names)]
        node_w = min(
            1.2, 0.25 + 0.8 * _text_inches([_shorten(x, 14) for x in node_names], _SMALL + 1)
        )
        tree_w = float(np.clip((span_x + 1) * node_w + 0.6, 2.5, _MAX_INCHES / 2))
        heat_h = max(heat_h, 0.9 * span_y + 1.4)
    out, fmt = _output_path(path)
    with _rc_context():
        from matplotlib.colors import Normalize

        fig = _new_figure(heat_w + (tree_w if draw_tree else 0.0), heat_h, layout="constrained")
        if draw_tree:
            grid = fig.add_gridspec(1, 2, width_ratios=[heat_w, tree_w])
            ax = fig.add_subplot(grid[0])
        else:
            ax = fig.add_subplot()
        norm = Normalize(vmin=-scale, vmax=scale)  # centred at 0
        image = ax.imshow(coupling, cmap="RdBu_r", norm=norm, interpolation="nearest")
        _label_heatmap_axes(ax, names, names, fontsize)
        ax.set_title("interactions $J_{ij}$", fontsize=_FONT + 1)
        colorbar = fig.colorbar(image, ax=ax, fraction=0.05, pad=0.03, shrink=0.8)
        colorbar.ax.tick_params(labelsize=_SMALL)
        colorbar.outline.set_visible(False)
        if draw_tree:
            tree_ax = fig.add_subplot(grid[1])
            cmap = image.get_cmap()
            for i, j in sorted(edges, key=lambda e: abs(symmetric[e])):
                value = symmetric[i, j]
                tree_ax.plot(
                    pos[[i, j], 0],
                    pos[[i, j], 1],
                    color=cmap(norm(value)),
                    linewidth=1.0 + 5.0 * abs(value) / scale,
                    solid_capstyle="round",
                    zorder=1,
                )
                if n <= 16:
                    mid = pos[[i, j]].mean(axis=0)
                    tree_ax.text(
                        mid[0],
                        mid[1],
                        f"{value:.2g}",
                        ha="center",
                        va="center",
                        fontsize=_SMALL - 1,
                        color="0.2",
                        zorder=2,
                        bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none"},
                    )
            for i, name in enumerate(node_names):
                tree_ax.text(
                    pos[i, 0],
                    pos[i, 1],
                    _shorten(name, 14),
                    ha="center",
                    va="center",
                    fontsize=_SMALL + 1,
                    zorder=3,
                    bbox={"boxstyle": "round,pad=0.3", "fc": "#f4f4f4", "ec": "0.4", "lw": 0.8},
                )
            tree_ax.set_xlim(-0.6, span_x + 0.6)
            tree_ax.set_ylim(-span_y - 0.4, 0.4)
            tree_ax.axis("off")
            tree_ax.set_title("maximum-|J| spanning tree", fontsize=_FONT + 1)
        if title:
            fig.suptitle(title)
        return _save(fig, out, fmt)


def mean_field_figures(
    weights: ArrayLike,
    rows: Sequence[str],
    columns: Sequence[str],
    out: str | Path,
    tag: str,
    *,
    title: str,
    name: str,
    short_name: str,
    iterates: ArrayLike | None = None,
    couplings: ArrayLike | None = None,
    free_energy: ArrayLike | None = None,
) -> list[Path]:
    """The figures of one model's attention on one example, written to ``out``; returns the
    files in the order written.

    - ``{tag}_attention.png``: ``weights`` [Q, N] (rows = the Q queries, e.g. output steps;
      columns = the N inputs), titled ``title``;
    - with ``iterates`` [k + 1, Q, N] and k >= 1, ``{tag}_attention_iteration1.png``: the
      weights after the first mean-field update ("``name``: after iteration 1");
    - with ``couplings`` [Q, N, N], ``{tag}_interactions_step{q}.png`` for every query q
      (:func:`interaction_map` of J with its maximum spanning tree);
    - with ``free_energy`` [k + 1, Q], ``{tag}_free_energy.png``: F(q^(t)) against the
      iteration t, one line per query (Theorem 2: it should never rise).

    Cells are annotated with their values when there are at most 30 columns.
    """
    out = Path(out)
    annotate = len(columns) <= 30
    written = [
        attention_heatmap(weights, rows, columns, out / f"{tag}_attention.png", title,
                          annotate=annotate)
    ]  # fmt: skip
    if iterates is not None and len(iterates) > 1:
        first = _as_array(iterates, "iterates", 3)[1]  # [Q, N] after one update
        written.append(
            attention_heatmap(
                first, rows, columns, out / f"{tag}_attention_iteration1.png",
                f"{name}: after iteration 1", annotate=annotate,
            )
        )  # fmt: skip
    if couplings is not None:
        coupling = _as_array(couplings, "couplings", 3)
        for q, label in enumerate(rows):
            written.append(
                interaction_map(
                    coupling[q], columns, out / f"{tag}_interactions_step{q + 1}.png",
                    title=f"{short_name}: J at output step {q + 1} ({label})",
                )
            )  # fmt: skip
    if free_energy is not None:
        energy = _as_array(free_energy, "free_energy", 2)  # [k + 1, Q]
        curves = {
            f"step {q + 1}": {t: float(energy[t, q]) for t in range(energy.shape[0])}
            for q in range(len(rows))
        }
        written.append(
            line_curves(
                curves, out / f"{tag}_free_energy.png", "iteration", "free energy F(q)",
                f"{short_name}: mean-field free energy per iteration",
            )
        )  # fmt: skip
    return written
