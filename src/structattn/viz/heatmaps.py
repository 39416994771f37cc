"""Attention weights as a heatmap (Kim et al. 2017, Figures 3-4)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ._common import (
    _FONT,
    _SMALL,
    ArrayLike,
    _as_array,
    _as_labels,
    _cell_inches,
    _fmt_prob,
    _label_heatmap_axes,
    _new_figure,
    _output_path,
    _rc_context,
    _save,
    _text_inches,
)

__all__ = ["attention_heatmap", "attention_panels", "translation_figures"]


def attention_heatmap(
    weights: ArrayLike,
    row_labels: Sequence[object] | None,
    col_labels: Sequence[object] | None,
    path: str | Path,
    title: str | None = None,
    *,
    cmap: str = "Blues",
    vmax: float | None = None,
    annotate: bool = False,
) -> Path:
    """Attention weights as a heatmap: one row per query, one column per memory position.

    Like Figures 3 and 4 of Kim et al. (2017): each row is the attention distribution (or
    the marginals of a structured layer) at one decoding step over the source tokens.

    Args:
        weights: [Q, N] tensor or array, e.g. ``out.weights[b]`` of any attention layer
            (slice off padding first: ``out.weights[b, :tgt_len, :src_len]``).
        row_labels: Q labels of the queries (target tokens); None for 0..Q-1.
        col_labels: N labels of the memory positions (source tokens); None for 0..N-1.
        path: output file (PNG unless the suffix says ``.pdf``/``.svg``); folders are made.
        title: figure title.
        cmap: matplotlib colormap name.
        vmax: top of the colour scale (default: the largest weight, at least 1e-12); the
            bottom is ``min(0, weights.min())``. Pass ``vmax=1`` to compare several plots.
        annotate: write each weight in its cell (readable up to ~30 x 30).

    Returns:
        The path written.

    Raises:
        ValueError: if ``weights`` is not 2-d and finite, or the labels do not match it.
    """
    w = _as_array(weights, "weights", 2)
    q, n = w.shape
    if q == 0 or n == 0:
        raise ValueError(f"`weights` must be non-empty, got shape {w.shape}")
    rows = _as_labels(row_labels, q, "row_labels", f"one per row of `weights` {w.shape}")
    cols = _as_labels(col_labels, n, "col_labels", f"one per column of `weights` {w.shape}")
    cell = _cell_inches(max(q, n))
    fontsize = float(np.clip(cell * 24, 6, _FONT - 1))
    label_w = _text_inches(rows, fontsize)
    label_h = _text_inches(cols, fontsize) * (0.87 if max(map(len, cols)) > 2 else 0.2)
    out, fmt = _output_path(path)
    with _rc_context():
        fig = _new_figure(n * cell + label_w + 1.4, q * cell + label_h + 0.9)
        ax = fig.add_subplot()
        low = min(0.0, float(w.min()))
        high = float(w.max()) if vmax is None else float(vmax)
        top = max(high, low + 1e-12)
        image = ax.imshow(
            w,
            cmap=cmap,
            vmin=low,
            vmax=top,
            aspect="auto",
            interpolation="nearest",
        )
        _label_heatmap_axes(ax, rows, cols, fontsize)
        ax.set_xlabel("memory")
        ax.set_ylabel("query")
        if annotate:
            for i in range(q):
                for j in range(n):
                    text = _fmt_prob(float(w[i, j]))
                    dark = (w[i, j] - low) / (top - low) > 0.6
                    ax.text(
                        j,
                        i,
                        text,
                        ha="center",
                        va="center",
                        fontsize=min(_SMALL, fontsize - 1),
                        color="white" if dark else ("0.6" if text == "0" else "black"),
                    )
        colorbar = fig.colorbar(
            image, ax=ax, fraction=0.05, pad=0.03, shrink=min(1.0, 0.3 + q / 10)
        )
        colorbar.ax.tick_params(labelsize=_SMALL)
        colorbar.outline.set_visible(False)
        if title:
            ax.set_title(title)
        return _save(fig, out, fmt)


def attention_panels(
    panels: Sequence[tuple[str, ArrayLike, Sequence[object]]],
    col_labels: Sequence[object] | None,
    path: str | Path,
    title: str | None = None,
    *,
    cmap: str = "Blues",
    vmax: float | None = 1.0,
) -> Path:
    """Several attention heatmaps side by side over the same memory (Figure 4 of Kim et al.
    2017: simple, sigmoid and structured attention over one source sentence).

    Args:
        panels: ``(panel title, weights [Q_k, N], Q_k row labels)`` per panel; the panels
            may have different rows (e.g. each model's own decoded target words) but all
            have the N columns.
        col_labels: N labels of the memory positions; None for 0..N-1.
        path: output file (PNG unless the suffix says ``.pdf``/``.svg``); folders are made.
        title: figure title.
        cmap: matplotlib colormap name.
        vmax: top of the shared colour scale (default 1; None: the largest weight).

    Returns:
        The path written.

    Raises:
        ValueError: if there are no panels, a panel is not 2-d and finite, or the labels do
            not match it.
    """
    if not panels:
        raise ValueError("`panels` must hold at least one (title, weights, row labels)")
    arrays = [_as_array(w, f"panels[{k}] weights", 2) for k, (_, w, _) in enumerate(panels)]
    n = arrays[0].shape[1]
    for k, w in enumerate(arrays):
        if w.shape[0] == 0 or w.shape[1] != n:
            raise ValueError(f"panel {k} has shape {w.shape}; every panel needs [Q > 0, {n}]")
    rows = [
        _as_labels(labels, w.shape[0], f"panels[{k}] row labels", "one per row")
        for k, ((_, _, labels), w) in enumerate(zip(panels, arrays, strict=True))
    ]
    cols = _as_labels(col_labels, n, "col_labels", f"one per column ({n})")
    q = max(w.shape[0] for w in arrays)
    cell = _cell_inches(max(q, n))
    fontsize = float(np.clip(cell * 24, 6, _FONT - 1))
    label_w = max(_text_inches(r, fontsize) for r in rows)
    label_h = _text_inches(cols, fontsize) * (0.87 if max(map(len, cols)) > 2 else 0.2)
    low = min(0.0, min(float(w.min()) for w in arrays))
    high = max(float(w.max()) for w in arrays) if vmax is None else float(vmax)
    top = max(high, low + 1e-12)
    out, fmt = _output_path(path)
    with _rc_context():
        width = len(arrays) * (n * cell + label_w + 0.6) + 1.2
        fig = _new_figure(width, q * cell + label_h + 1.2, layout="constrained")
        axes = fig.subplots(1, len(arrays), squeeze=False)[0]
        image = None
        for ax, (name, _, _), w, r in zip(axes, panels, arrays, rows, strict=True):
            image = ax.imshow(
                w, cmap=cmap, vmin=low, vmax=top, aspect="auto", interpolation="nearest"
            )
            _label_heatmap_axes(ax, r, cols, fontsize)
            ax.set_title(name)
        assert image is not None
        colorbar = fig.colorbar(image, ax=list(axes), fraction=0.02, pad=0.02)
        colorbar.ax.tick_params(labelsize=_SMALL)
        colorbar.outline.set_visible(False)
        if title:
            fig.suptitle(title)
        return _save(fig, out, fmt)


def translation_figures(
    panels: Sequence[tuple[str, ArrayLike, Sequence[object]]],
    col_labels: Sequence[object] | None,
    out: str | Path,
    segmentation: tuple[ArrayLike, Sequence[object]] | None = None,
) -> list[Path]:
    """Figure 4 of Kim et al. (2017) for one source sentence, written to the folder ``out``:
    ``figure4.png``, each model's source attention side by side (``panels``: (name, weights
    [T, N], its T target-word labels), :func:`attention_panels`), and with ``segmentation``
    (z [T, N] in {0, 1}, its T row labels) ``segmentation.png``, the structured model's
    Viterbi segmentation per target word. Returns the files written."""
    out = Path(out)
    written = [
        attention_panels(
            panels, col_labels, out / "figure4.png", title="source attention per target word"
        )
    ]
    if segmentation is not None:
        written.append(
            attention_heatmap(
                segmentation[0], segmentation[1], col_labels, out / "segmentation.png",
                title="structured: Viterbi segmentation z (1 = attended)", vmax=1.0,
            )
        )  # fmt: skip
    return written
