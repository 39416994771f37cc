"""A dependency parse as arcs above the sentence, with the other likely arcs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._common import (
    _ALT_COLOR,
    _FONT,
    _MAP_COLOR,
    _SMALL,
    ArrayLike,
    _as_array,
    _as_ints,
    _new_figure,
    _output_path,
    _rc_context,
    _save,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["dependency_arcs"]


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
