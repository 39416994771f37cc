"""What every plot shares: loading matplotlib (an optional dependency), figures on an Agg
canvas without pyplot, saving, and the input checks that name the faulty argument."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

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


_INSTALL = 'pip install "structattn[viz]"'  # the extra that brings matplotlib
_MIN_VERSION = (3, 5)  # Figure(layout=...), set_xticks(ticks, labels)


# ---- matplotlib and files ---------------------------------------------------------------------
def _matplotlib() -> Any:
    """The matplotlib module, or an ImportError that says how to install it."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(f"structattn.viz needs matplotlib to draw plots: {_INSTALL}") from err
    found = re.match(r"(\d+)\.(\d+)", str(getattr(matplotlib, "__version__", "")))
    if found is None or (int(found[1]), int(found[2])) < _MIN_VERSION:
        version = getattr(matplotlib, "__version__", "unknown")
        raise ImportError(
            f"structattn.viz needs matplotlib >= {_MIN_VERSION[0]}.{_MIN_VERSION[1]} to draw "
            f"plots, found {version}: {_INSTALL.replace('install', 'install -U')}"
        )
    return matplotlib


def require_matplotlib() -> None:
    """Check up front that plots can be drawn: call it before long work that ends in plots.

    Importing :mod:`structattn.viz` never imports matplotlib; each plot does when it is
    drawn. A command that trains for minutes and then plots calls this first, so a missing
    matplotlib stops it at once with the same one-line message as a plot would give.

    Raises:
        ImportError: if matplotlib is missing or older than 3.5; the message names the
            extra to install (``pip install "structattn[viz]"``).
    """
    _matplotlib()


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
