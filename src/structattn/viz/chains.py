"""Fact-sequence marginals of a K-step memory CRF (Kim et al. 2017, Figure 5)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ._common import (
    _ALT_COLOR,
    _FONT,
    _SMALL,
    ArrayLike,
    _as_array,
    _as_ints,
    _as_labels,
    _fmt_prob,
    _new_figure,
    _output_path,
    _rc_context,
    _save,
    _shorten,
    _text_inches,
)

__all__ = ["fact_chain_graph"]


def _check_sequences(
    top_sequences: Sequence[tuple[object, float]] | None, steps: int, facts: int
) -> list[tuple[list[int], float]]:
    if top_sequences is None:
        return []
    out = []
    for r, entry in enumerate(top_sequences):
        try:
            sequence, prob = entry
            prob = float(prob)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"`top_sequences[{r}]` must be a pair (sequence of {steps} fact indices, "
                "probability)"
            ) from err
        seq = _as_ints(sequence, f"top_sequences[{r}]")
        if len(seq) != steps:
            raise ValueError(f"`top_sequences[{r}]` must have {steps} fact indices, got {len(seq)}")
        if prob == 0.0 and -1 in seq:  # a missing k-best entry of LinearChainCRF.topk
            continue
        if not all(0 <= i < facts for i in seq):
            raise ValueError(f"`top_sequences[{r}]` has a fact index outside [0, {facts - 1}]")
        if not 0.0 <= prob <= 1.0 + 1e-6:
            raise ValueError(f"`top_sequences[{r}]` probability must be in [0, 1], got {prob}")
        out.append((seq, prob))
    return out


def fact_chain_graph(
    marginals: ArrayLike,
    edge_marginals: ArrayLike,
    path: str | Path,
    fact_labels: Sequence[object] | None = None,
    top_sequences: Sequence[tuple[object, float]] | None = None,
    question: str | None = None,
    answer: str | None = None,
    title: str | None = None,
    *,
    min_mass: float = 0.01,
    edge_threshold: float = 0.01,
) -> Path:
    """Fact-sequence marginals of a K-step memory CRF (Kim et al. 2017, Figure 5).

    One column per inference step k = 1..K and one row per fact i; the node (k, i) is
    shaded by p(z_k = i) and each edge (k, i) -> (k+1, j) has a width proportional to
    p(z_k = i, z_{k+1} = j) (edges below ``edge_threshold`` are skipped). The facts' text
    is on the left; below, a box lists ``top_sequences`` with their probabilities (the best
    one is also traced in orange) and the question and answer. Fact indices are 0-based,
    as in :meth:`MemoryCRFAttention.topk`.

    Args:
        marginals: [K, n] node marginals p(z_k = i) (``out.marginals[b]``).
        edge_marginals: [K-1, n, n] edge marginals (``out.edge_marginals[b]``).
        path: output file (PNG unless the suffix says ``.pdf``/``.svg``); folders are made.
        fact_labels: n fact texts (shortened to 60 characters); None for no text.
        top_sequences: (sequence of K fact indices, probability) pairs, best first; from
            ``probs, seqs = attn.topk(query, keys, k, mask)`` take
            ``list(zip(seqs[:, b].tolist(), probs[:, b].tolist()))``. Missing k-best
            entries (indices -1, probability 0) are skipped.
        question, answer: printed under the graph.
        title: figure title.
        min_mass: hide the facts whose largest p(z_k = i) over k is below this (padding
            facts have zero mass); facts on a listed sequence are always shown. 0 shows all.
        edge_threshold: smallest edge marginal that is drawn.

    Returns:
        The path written.

    Raises:
        ValueError: naming the argument whose shape or values are inconsistent.
    """
    node = _as_array(marginals, "marginals", 2)
    steps, facts = node.shape
    if steps == 0 or facts == 0:
        raise ValueError(f"`marginals` must be non-empty, got shape {node.shape}")
    edge = _as_array(edge_marginals, "edge_marginals", 3)
    if edge.shape != (steps - 1, facts, facts):
        raise ValueError(
            f"`edge_marginals` must have shape ({steps - 1}, {facts}, {facts}) to match "
            f"`marginals` {node.shape}, got {edge.shape}"
        )
    if (node < -1e-6).any() or (node > 1 + 1e-6).any():
        raise ValueError("`marginals` must be probabilities in [0, 1]")
    if (edge < -1e-6).any() or (edge > 1 + 1e-6).any():
        raise ValueError("`edge_marginals` must be probabilities in [0, 1]")
    labels = None
    if fact_labels is not None:
        labels = _as_labels(fact_labels, facts, "fact_labels", "one per fact")
    sequences = _check_sequences(top_sequences, steps, facts)
    if not 0.0 <= min_mass <= 1.0:
        raise ValueError(f"`min_mass` must be in [0, 1], got {min_mass}")
    if not 0.0 <= edge_threshold <= 1.0:
        raise ValueError(f"`edge_threshold` must be in [0, 1], got {edge_threshold}")

    keep = node.max(axis=0) >= min_mass
    for seq, _ in sequences:
        keep[seq] = True
    if not keep.any():
        keep[:] = True
    shown = [int(i) for i in np.flatnonzero(keep)]  # fact indices, top to bottom
    row = {fact: r for r, fact in enumerate(shown)}
    hidden = facts - len(shown)
    tick_labels = [
        f"{i}: {_shorten(labels[i], 60)}" if labels is not None else f"fact {i}" for i in shown
    ]

    footer = []
    if sequences:
        footer.append("Most likely fact sequences:")
        for seq, prob in sequences:
            chain = " \u2192 ".join(str(i) for i in seq)
            footer.append(f"   p(z = {chain}) = {prob:.4f}")
    if question is not None:
        footer.extend(textwrap.wrap(f"Question: {question}", 80, subsequent_indent="  "))
    if answer is not None:
        footer.extend(textwrap.wrap(f"Answer: {answer}", 80, subsequent_indent="  "))
    if hidden:
        plural = "s" if hidden > 1 else ""
        footer.append(f"({hidden} fact{plural} with max p(z_k = i) < {min_mass:g} not shown)")

    row_h = 0.38
    graph_w = max(2.2, 1.25 * steps)
    label_w = _text_inches(tick_labels, _FONT - 1)
    footer_h = 0.22 * len(footer) + (0.2 if footer else 0.0)
    out, fmt = _output_path(path)
    with _rc_context():
        from matplotlib.lines import Line2D

        fig = _new_figure(
            label_w + graph_w + 1.6, row_h * len(shown) + 1.1 + footer_h, layout="constrained"
        )
        if footer:
            grid = fig.add_gridspec(2, 1, height_ratios=[row_h * len(shown) + 0.6, footer_h])
            ax = fig.add_subplot(grid[0])
            box = fig.add_subplot(grid[1])
            box.axis("off")
            box.text(
                0.0,
                1.0,
                "\n".join(footer),
                ha="left",
                va="top",
                fontsize=_FONT - 0.5,
                family="monospace",
                transform=box.transAxes,
                linespacing=1.45,
            )
        else:
            ax = fig.add_subplot()
        # edges (k, i) -> (k + 1, j), width proportional to the edge marginal
        for k in range(steps - 1):
            for i in shown:
                for j in shown:
                    p = float(edge[k, i, j])
                    if p < edge_threshold or p <= 0.0:
                        continue
                    ax.plot(
                        [k, k + 1],
                        [row[i], row[j]],
                        color="0.25",
                        linewidth=0.3 + 9.0 * p,
                        alpha=0.25 + 0.6 * p,
                        solid_capstyle="round",
                        zorder=1,
                    )
        if sequences:  # trace the best sequence
            best = sequences[0][0]
            ax.plot(
                range(steps),
                [row[i] for i in best],
                color=_ALT_COLOR,
                linewidth=1.4,
                linestyle=(0, (4, 2)),
                zorder=2,
            )
        xs = np.repeat(np.arange(steps), len(shown))
        ys = np.tile(np.arange(len(shown)), steps)
        values = node[:, shown].reshape(-1)
        dots = ax.scatter(
            xs,
            ys,
            c=values,
            cmap="Blues",
            vmin=0.0,
            vmax=1.0,
            s=330,
            edgecolors="0.3",
            linewidths=0.8,
            zorder=3,
        )
        for x, y, p in zip(xs.tolist(), ys.tolist(), values.tolist(), strict=True):
            if p >= 0.005:
                ax.text(
                    x,
                    y,
                    _fmt_prob(float(p)),
                    ha="center",
                    va="center",
                    fontsize=_SMALL - 1,
                    color="white" if p > 0.55 else "black",
                    zorder=4,
                )
        ax.set_xlim(-0.3, steps - 0.7)
        ax.set_ylim(len(shown) - 0.5, -0.6)
        ax.set_xticks(range(steps), [f"$z_{{{k + 1}}}$" for k in range(steps)])
        ax.xaxis.tick_top()
        ax.set_yticks(range(len(shown)), tick_labels)
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        colorbar = fig.colorbar(dots, ax=ax, fraction=0.06, pad=0.02, shrink=0.8)
        colorbar.set_label("$p(z_k = i)$", fontsize=_SMALL + 1)
        colorbar.ax.tick_params(labelsize=_SMALL)
        colorbar.outline.set_visible(False)
        handles = [
            Line2D(
                [], [], color="0.25", linewidth=0.3 + 9.0 * p, alpha=0.25 + 0.6 * p, label=f"{p:g}"
            )
            for p in (0.1, 0.5)
        ]
        if sequences:
            handles.append(
                Line2D(
                    [],
                    [],
                    color=_ALT_COLOR,
                    linewidth=1.4,
                    linestyle=(0, (4, 2)),
                    label="best sequence",
                )
            )
        ax.legend(
            handles=handles,
            title="edges: $p(z_k, z_{k+1})$",
            loc="upper center",
            bbox_to_anchor=(0.5, 0.0),
            ncol=len(handles),
            frameon=False,
            fontsize=_SMALL,
            title_fontsize=_SMALL,
            handlelength=1.6,
        )
        if title:
            ax.set_title(title, pad=22)
        return _save(fig, out, fmt)
