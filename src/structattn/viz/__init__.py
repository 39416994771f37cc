"""Plots of attention weights and latent structures (the figures of the papers).

* :func:`attention_heatmap` -- queries x memory weights (Kim et al. 2017, Figures 3-4);
* :func:`dependency_arcs` -- a MAP dependency parse as arcs, with other likely arcs;
* :func:`fact_chain_graph` -- fact-sequence marginals of :class:`MemoryCRFAttention` (Figure 5);
* :func:`bracketed_tree` -- a binary constituency tree from :func:`split_tree` (PRPN);
* :func:`interaction_map` -- mean-field interactions J and their maximum-|J| spanning tree
  (Liu et al., section 3.3);
* :func:`maximum_spanning_tree` -- the spanning-tree helper (Prim's algorithm, no matplotlib);
* :func:`depth_curves` -- a metric against depth per model, ours beside the paper's.

Every plotting function takes plain tensors / arrays / lists (index one batch item first),
writes the figure to ``path`` (parent folders are created; PNG unless the suffix names
another format matplotlib writes, such as ``.pdf`` or ``.svg``) and returns the
:class:`pathlib.Path`. matplotlib is an optional dependency, imported only when a plot is
drawn. Figures are built with :class:`matplotlib.figure.Figure` on an Agg canvas, never
through ``pyplot``: no global backend switch (notebooks keep theirs) and no figure left
registered, so nothing leaks when many plots are written.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch import Tensor

from ..structs.stick_breaking import Tree, tree_to_brackets

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "attention_heatmap",
    "bracketed_tree",
    "depth_curves",
    "dependency_arcs",
    "fact_chain_graph",
    "grouped_bars",
    "interaction_map",
    "maximum_spanning_tree",
]

ArrayLike = Tensor | np.ndarray | Sequence[Any]

_FONT = 10  # base font size (points)
_SMALL = 8  # annotations: probabilities on arcs, edges and nodes
_MAX_INCHES = 40.0  # cap on either side of a figure
_MAX_TICKS = 60  # label at most this many ticks on a heatmap axis
_MAP_COLOR = "#1f3b73"  # MAP structures (dark blue)
_ALT_COLOR = "#e07b39"  # alternatives (orange)
_RC = {
    "font.size": _FONT,
    "axes.titlesize": _FONT + 2,
    "axes.labelsize": _FONT,
    "xtick.labelsize": _FONT - 1,
    "ytick.labelsize": _FONT - 1,
    "legend.fontsize": _SMALL + 1,
    "figure.titlesize": _FONT + 3,
    "savefig.dpi": 150,
}


# ---- matplotlib and files ---------------------------------------------------------------------
def _matplotlib() -> Any:
    """The matplotlib module, or an ImportError that says how to install it."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(
            "structattn.viz needs matplotlib to draw plots: pip install matplotlib"
        ) from err
    return matplotlib


def _output_path(path: str | Path) -> tuple[Path, str]:
    """``path`` as a Path and the file format from its suffix (``png`` without one)."""
    _matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    if not isinstance(path, (str, Path)):
        raise ValueError(f"`path` must be a str or pathlib.Path, got {type(path).__name__}")
    out = Path(path)
    fmt = out.suffix[1:].lower() if out.suffix else "png"
    if fmt not in FigureCanvasBase.get_supported_filetypes():
        raise ValueError(f"`path` must end in .png (or .pdf, .svg, ...), got {str(path)!r}")
    return out, fmt


def _new_figure(width: float, height: float, **kwargs: Any) -> Figure:
    """A Figure of about ``width`` x ``height`` inches on an Agg canvas, without pyplot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    size = (min(max(width, 2.5), _MAX_INCHES), min(max(height, 1.5), _MAX_INCHES))
    fig = Figure(figsize=size, **kwargs)
    FigureCanvasAgg(fig)
    return fig


def _rc_context() -> Any:
    """Font sizes and resolution of every plot, restored on exit."""
    return _matplotlib().rc_context(cast(Any, _RC))


def _save(fig: Figure, out: Path, fmt: str) -> Path:
    """Write ``fig`` to ``out`` (creating parent folders), then release it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out, format=fmt, bbox_inches="tight", pad_inches=0.15, facecolor="white")
    finally:
        fig.clear()  # "close": the figure is not registered with pyplot, so this frees it
    return out


# ---- input checks -----------------------------------------------------------------------------
def _as_array(x: object, name: str, ndim: int) -> np.ndarray:
    """A finite float64 array of rank ``ndim`` from a tensor, array or nested list."""
    if isinstance(x, Tensor):
        array = x.detach().to("cpu", torch.float64).numpy()
    else:
        try:
            array = np.asarray(x, dtype=np.float64)
        except (TypeError, ValueError) as err:
            raise ValueError(f"`{name}` must be a tensor, array or nested list of numbers") from err
    if array.ndim != ndim:
        raise ValueError(f"`{name}` must have {ndim} dimensions, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError(f"`{name}` must be finite (no NaN or inf)")
    return array


def _as_ints(x: object, name: str) -> list[int]:
    """A 1-d integer sequence (tensor, array or list) as a list of ints."""
    if isinstance(x, Tensor):
        if x.is_floating_point() or x.is_complex():
            raise ValueError(f"`{name}` must hold integers, got dtype {x.dtype}")
        array = x.detach().cpu().numpy()
    else:
        array = np.asarray(x)
        if array.size and not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"`{name}` must hold integers, got {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"`{name}` must be one-dimensional, got shape {array.shape}")
    return [int(v) for v in array]


def _as_labels(labels: Sequence[object] | None, n: int, name: str, what: str) -> list[str]:
    """``n`` strings (the positions 0..n-1 when ``labels`` is None)."""
    if labels is None:
        return [str(i) for i in range(n)]
    if isinstance(labels, str):
        raise ValueError(f"`{name}` must be a sequence of {n} labels, not a single string")
    out = [str(label) for label in labels]
    if len(out) != n:
        raise ValueError(f"`{name}` must have {n} entries ({what}), got {len(out)}")
    return out


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def _text_inches(labels: Sequence[str], fontsize: float) -> float:
    """Rough width in inches of the longest label (0.6 em per character)."""
    longest = max((len(label) for label in labels), default=1)
    return 0.6 * fontsize / 72.0 * longest


def _thin_ticks(n: int) -> list[int]:
    """At most ``_MAX_TICKS`` evenly spaced tick positions out of ``n``."""
    step = max(1, math.ceil(n / _MAX_TICKS))
    return list(range(0, n, step))


def _label_heatmap_axes(
    ax: Axes, row_labels: list[str], col_labels: list[str], fontsize: float
) -> None:
    """Token labels on both axes of an imshow, thin white lines between the cells."""
    rows, cols = _thin_ticks(len(row_labels)), _thin_ticks(len(col_labels))
    ax.set_yticks(rows, [row_labels[i] for i in rows], fontsize=fontsize)
    rotate = max((len(label) for label in col_labels), default=0) > 2
    ax.set_xticks(
        cols,
        [col_labels[i] for i in cols],
        fontsize=fontsize,
        rotation=60 if rotate else 0,
        ha="right" if rotate else "center",
        rotation_mode="anchor",
    )
    ax.set_xticks(np.arange(len(col_labels) + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(len(row_labels) + 1) - 0.5, minor=True)
    thin = max(len(row_labels), len(col_labels)) > 30
    ax.grid(which="minor", color="white", linewidth=0.25 if thin else 0.6)
    ax.tick_params(which="minor", length=0)
    ax.tick_params(which="major", length=2)
    for spine in ax.spines.values():
        spine.set_visible(False)


def _cell_inches(n: int) -> float:
    """Side of a heatmap cell: 0.4 in for small maps, shrinking to 0.12 in for large ones."""
    return float(np.clip(5.0 / max(n, 1), 0.12, 0.4))


def _fmt_prob(p: float) -> str:
    """Compact probability: ``.42``, ``1``, ``0`` (below 0.005)."""
    if abs(p) < 0.005:
        return "0"
    if 0 < p < 0.995:
        return f"{p:.2f}"[1:]
    return f"{p:.2g}"


# ---- 1. attention heatmap ---------------------------------------------------------------------
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


# ---- 2. dependency arcs -----------------------------------------------------------------------
def _arc_height(distance: int) -> float:
    """Apex height of an arc spanning ``distance`` tokens: increasing, sublinear."""
    return 0.35 + 0.55 * distance**0.8


def _draw_arc(
    ax: Axes, head: float, mod: float, height: float, **style: Any
) -> tuple[float, float]:
    """A half-ellipse-like cubic Bezier from ``head`` to ``mod``, arrowhead at ``mod``.

    Returns the apex (x, y)."""
    from matplotlib.patches import FancyArrowPatch
    from matplotlib.path import Path as MplPath

    base = 0.08  # arcs start and end just above the tokens
    start = head + 0.12 * np.sign(mod - head)  # outgoing arcs leave beside the centre
    control = base + 4.0 / 3.0 * (height - base)  # a cubic with these controls peaks at height
    verts = [(start, base), (start, control), (mod, control), (mod, base)]
    codes = [MplPath.MOVETO, MplPath.CURVE4, MplPath.CURVE4, MplPath.CURVE4]
    ax.add_patch(FancyArrowPatch(path=MplPath(verts, codes), **style))
    return (start + mod) / 2.0, height


def dependency_arcs(
    heads: ArrayLike,
    tokens: Sequence[object],
    path: str | Path,
    marginals: ArrayLike | None = None,
    title: str | None = None,
    *,
    threshold: float = 0.05,
) -> Path:
    """A dependency parse drawn as arcs above the sentence (head -> modifier).

    The MAP tree (e.g. ``SyntacticAttention.parse``) is drawn in dark blue, one arc per
    word from its head with the arrowhead at the word. With ``marginals``, every other arc
    whose marginal p(h -> m) exceeds ``threshold`` is drawn in orange with line width and
    opacity proportional to p, and each MAP arc is labelled with its own p(h -> m).

    Conventions follow :class:`SyntacticAttention`: position 0 is ROOT; ``heads[0] = -1``
    and padding positions (trailing ``-1``) are dropped.

    Args:
        heads: [N] integers, ``heads[m]`` the head of position m; -1 at ROOT (m = 0) and at
            padding (which must come after the last word).
        tokens: the tokens, with ROOT first (e.g. ``["$", "The", "men", ...]``): either one
            per position of ``heads`` (N, tokens at padding positions are ignored) or one
            per real position (L = N minus the padding).
        path: output file (PNG unless the suffix says ``.pdf``/``.svg``); folders are made.
        marginals: optional [N, N] (or [L, L]) arc marginals, ``marginals[h, m] = p(h -> m)``
            (``out.marginals[b]`` of :class:`SyntacticAttention`).
        title: figure title.
        threshold: smallest marginal of a non-MAP arc that is drawn.

    Returns:
        The path written.

    Raises:
        ValueError: naming ``heads``, ``tokens`` or ``marginals`` when they are malformed or
            inconsistent (heads out of range, a self-loop, -1 before the last word, ...).
    """
    head_list = _as_ints(heads, "heads")
    n = len(head_list)
    if n < 2:
        raise ValueError(f"`heads` must have ROOT and at least one word, got {n} entries")
    if head_list[0] != -1:
        raise ValueError(f"`heads[0]` must be -1 (ROOT has no head), got {head_list[0]}")
    real = [m for m in range(1, n) if head_list[m] != -1]
    length = (max(real) + 1) if real else 1  # L: ROOT + words
    if length == 1:
        raise ValueError("`heads` has no word with a head (all entries are -1)")
    for m in range(1, length):
        h = head_list[m]
        if h == -1:
            raise ValueError(
                f"`heads[{m}]` is -1 but position {length - 1} has a head: padding (-1) must "
                "come after the last word"
            )
        if not 0 <= h < length:
            raise ValueError(
                f"`heads[{m}]` = {h} is out of range: heads must be in [0, {length - 1}] "
                f"(ROOT = 0, {length - 1} words) or -1"
            )
        if h == m:
            raise ValueError(f"`heads[{m}]` = {m}: a word cannot be its own head")
    if isinstance(tokens, str) or not isinstance(tokens, Sequence):
        raise ValueError("`tokens` must be a sequence of strings (ROOT first)")
    if len(tokens) not in (n, length):
        raise ValueError(
            f"`tokens` must have {n} entries (one per entry of `heads`) or {length} (ROOT and "
            f"the words, without padding), got {len(tokens)}"
        )
    words = [str(t) for t in tokens[:length]]
    probs: np.ndarray | None = None
    if marginals is not None:
        probs = _as_array(marginals, "marginals", 2)
        if probs.shape not in ((n, n), (length, length)):
            raise ValueError(
                f"`marginals` must have shape ({n}, {n}) or ({length}, {length}), got {probs.shape}"
            )
        probs = probs[:length, :length]
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"`threshold` must be in [0, 1], got {threshold}")

    map_arcs = {(head_list[m], m) for m in range(1, length)}
    alternatives = []
    if probs is not None:
        for h in range(length):
            for m in range(1, length):
                if h != m and (h, m) not in map_arcs and probs[h, m] > threshold:
                    alternatives.append((h, m, float(probs[h, m])))
    max_span = max(abs(h - m) for h, m in map_arcs | {(h, m) for h, m, _ in alternatives})
    top = _arc_height(max_span)
    longest = max(len(w) for w in words)
    token_w = max(0.7, 0.1 * longest + 0.3)  # inches per token
    out, fmt = _output_path(path)
    with _rc_context():
        fig = _new_figure(length * token_w + 0.6, 0.55 * top + 1.4)
        ax = fig.add_subplot()
        from matplotlib.lines import Line2D

        # other likely arcs first (below), width and opacity proportional to p(h -> m)
        for h, m, p in sorted(alternatives, key=lambda arc: arc[2]):
            _draw_arc(
                ax,
                h,
                m,
                _arc_height(abs(h - m)),
                arrowstyle="-|>",
                mutation_scale=6 + 6 * p,
                color=_ALT_COLOR,
                linewidth=0.4 + 3.0 * p,
                alpha=0.25 + 0.65 * p,
                zorder=1,
            )
        for m in range(1, length):
            h = head_list[m]
            x, y = _draw_arc(
                ax,
                h,
                m,
                _arc_height(abs(h - m)),
                arrowstyle="-|>",
                mutation_scale=11,
                color=_MAP_COLOR,
                linewidth=1.6,
                zorder=3,
            )
            if probs is not None:
                ax.text(
                    x,
                    y,
                    f"{probs[h, m]:.2f}",
                    ha="center",
                    va="center",
                    fontsize=_SMALL,
                    color=_MAP_COLOR,
                    zorder=4,
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.9},
                )
        for i, word in enumerate(words):
            ax.text(
                i,
                -0.05,
                word,
                ha="center",
                va="top",
                fontsize=_FONT + 1,
                fontstyle="italic" if i == 0 else "normal",
                color="0.35" if i == 0 else "black",
            )
            ax.text(i, -0.62, str(i), ha="center", va="top", fontsize=_SMALL - 1, color="0.55")
        ax.set_xlim(-0.6, length - 0.4)
        ax.set_ylim(-0.95, top + 0.35)
        ax.axis("off")
        handles = [Line2D([], [], color=_MAP_COLOR, linewidth=1.6, label="MAP parse")]
        if probs is not None:
            handles[0].set_label("MAP parse (label: p(head \u2192 word))")
            handles.append(
                Line2D(
                    [],
                    [],
                    color=_ALT_COLOR,
                    linewidth=2.0,
                    alpha=0.7,
                    label=f"other arcs with p > {threshold:g} (width \u221d p)",
                )
            )
        ax.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, 0.0),
            ncol=len(handles),
            frameon=False,
            handlelength=2.5,
        )
        if title:
            ax.set_title(title)
        return _save(fig, out, fmt)


# ---- 3. fact chains (memory CRF) --------------------------------------------------------------
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


# ---- 4. binary constituency trees -------------------------------------------------------------
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


# ---- 5. mean-field interactions ---------------------------------------------------------------
def maximum_spanning_tree(weights: ArrayLike) -> list[tuple[int, int]]:
    """Maximum-weight spanning tree of the complete graph on N nodes (Prim's algorithm).

    ``weights`` [N, N] is read as symmetric ((W + W^T) / 2; the diagonal is ignored); any
    sign is allowed. For the most significant interactions of a mean-field J, pass |J|.
    O(N^2) time; ties go to the lower index, so the result is deterministic.

    Args:
        weights: [N, N] tensor, array or nested list, N >= 1, finite.

    Returns:
        The N - 1 edges ``(i, j)`` with i < j, sorted.

    Example:
        >>> maximum_spanning_tree([[0, 3, 1], [3, 0, 2], [1, 2, 0]])
        [(0, 1), (1, 2)]
    """
    w = _as_array(weights, "weights", 2)
    n = w.shape[0]
    if w.shape != (n, n) or n == 0:
        raise ValueError(f"`weights` must be a non-empty square [N, N] matrix, got {w.shape}")
    w = (w + w.T) / 2.0
    in_tree = np.zeros(n, dtype=bool)
    in_tree[0] = True
    best = w[0].copy()  # [N] best weight of an edge from the tree to each node
    parent = np.zeros(n, dtype=np.int64)
    edges = []
    for _ in range(n - 1):
        candidates = np.where(in_tree, -np.inf, best)
        j = int(np.argmax(candidates))  # first maximum: lowest index on ties
        edges.append((min(int(parent[j]), j), max(int(parent[j]), j)))
        in_tree[j] = True
        closer = ~in_tree & (w[j] > best)
        best[closer] = w[j][closer]
        parent[closer] = j
    return sorted(edges)


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


# ---- 6. accuracy per depth --------------------------------------------------------------------
def depth_curves(
    results: dict[str, dict[int, float]],
    path: str | Path,
    reference: dict[str, dict[int, float]] | None = None,
    title: str | None = None,
    ylabel: str = "% correct before first error",
) -> Path:
    """One line per model of a metric against formula depth (tree transduction, Table 1).

    Args:
        results: ``{model name: {depth: value}}`` (our measurements; solid lines).
        path: output file.
        reference: the same for published numbers (dashed lines in the same colours).
        title: figure title.
        ylabel: y-axis label.
    """
    if not results:
        raise ValueError("`results` must name at least one model")
    out, fmt = _output_path(path)
    with _rc_context():
        fig = _new_figure(6.0, 4.0)
        ax = fig.add_subplot()
        colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
        for i, (name, curve) in enumerate(results.items()):
            depths = sorted(curve)
            color = colors[i % len(colors)]
            ax.plot(depths, [curve[d] for d in depths], "o-", color=color, label=f"{name} (ours)")
            if reference and name in reference:
                ref = reference[name]
                ref_depths = sorted(ref)
                ax.plot(
                    ref_depths,
                    [ref[d] for d in ref_depths],
                    "s--",
                    color=color,
                    alpha=0.55,
                    label=f"{name} (paper)",
                )
        ax.set_xticks(sorted({d for curve in results.values() for d in curve}))
        ax.set_xlabel("depth")
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend()
        if title:
            ax.set_title(title)
        return _save(fig, out, fmt)


def grouped_bars(
    groups: Sequence[object],
    results: Mapping[str, Sequence[float | None]],
    path: str | Path,
    reference: Mapping[str, Sequence[float | None]] | None = None,
    title: str | None = None,
    ylabel: str = "%",
) -> Path:
    """Grouped bars: one group per entry of ``groups`` (e.g. bAbI tasks), one bar per model.

    Args:
        groups: the group labels (x axis).
        results: ``{model name: one value per group}`` (ours; solid bars; ``None`` = no bar).
        path: output file.
        reference: the same for published numbers (drawn as black ticks on the bars).
        title: figure title.
        ylabel: y-axis label.
    """
    if not results:
        raise ValueError("`results` must name at least one model")
    labels = [str(g) for g in groups]
    for name, values in {**results, **(reference or {})}.items():
        if len(values) != len(labels):
            raise ValueError(f"{name!r} has {len(values)} values for {len(labels)} groups")
    out, fmt = _output_path(path)
    with _rc_context():
        fig = _new_figure(max(6.0, 0.6 * len(labels) * len(results) ** 0.5 + 2), 4.0)
        ax = fig.add_subplot()
        colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
        width = 0.8 / len(results)
        for i, (name, values) in enumerate(results.items()):
            xs = [g + (i - (len(results) - 1) / 2) * width for g in range(len(labels))]
            color = colors[i % len(colors)]
            shown = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]
            ax.bar([x for x, _ in shown], [v for _, v in shown], width, color=color, label=name)
            ref = (reference or {}).get(name)
            if ref is not None:
                marks = [(x, v) for x, v in zip(xs, ref, strict=True) if v is not None]
                ax.scatter(
                    [x for x, _ in marks],
                    [v for _, v in marks],
                    marker="_",
                    s=(width * 120) ** 2 / 10,
                    color="black",
                    zorder=3,
                    label="paper" if i == 0 else None,
                )
        ax.set_xticks(range(len(labels)), labels)
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, ncol=len(results) + 1, loc="upper center", bbox_to_anchor=(0.5, -0.1))
        if title:
            ax.set_title(title)
        return _save(fig, out, fmt)
