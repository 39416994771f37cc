"""Result plots: a metric against depth, grouped bars beside the paper's numbers, and
training curves from runs' ``metrics.jsonl``; and the Markdown table our result tables are
printed as (:func:`markdown_table`, no matplotlib)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._common import _SMALL, _new_figure, _output_path, _rc_context, _save

__all__ = [
    "bar_axis_top",
    "depth_curves",
    "grouped_bars",
    "line_curves",
    "markdown_table",
    "training_curves",
]

# matplotlib's tab10: one colour per model or run (the first five were the original list)
_COLORS = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A right-aligned Markdown table."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


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
        for i, (name, curve) in enumerate(results.items()):
            depths = sorted(curve)
            color = _COLORS[i % len(_COLORS)]
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


def line_curves(
    series: Mapping[str, Mapping[Any, float]],
    path: str | Path,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    log_y: bool = False,
) -> Path:
    """One line per entry of ``series`` (``{name: {x: y}}``), e.g. a test metric against
    the input length (Liu et al., Figure 1) or a free energy against the iteration.

    Args:
        series: the curves; NaN or missing points leave gaps.
        path: output file.
        xlabel, ylabel: axis labels. title: figure title.
        log_y: logarithmic y axis (for positive values).
    """
    if not series:
        raise ValueError("`series` must name at least one curve")
    out, fmt = _output_path(path)
    with _rc_context():
        fig = _new_figure(6.0, 4.0)
        ax = fig.add_subplot()
        for i, (name, curve) in enumerate(series.items()):
            xs = sorted(curve)
            marker = "o-" if len(xs) <= 30 else "-"
            ax.plot(xs, [curve[x] for x in xs], marker, color=_COLORS[i % len(_COLORS)],
                    label=name, markersize=3)  # fmt: skip
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=_SMALL)
        if title:
            ax.set_title(title)
        return _save(fig, out, fmt)


def bar_axis_top(series: Sequence[Sequence[float | None]], ylabel: str) -> float:
    """The y-axis top of :func:`grouped_bars`: 100 for percentages (a ``ylabel`` with "%")
    up to 100, else 10% above the largest value (perplexities, BLEU) so that no bar or tick
    is cut off."""
    values = [v for values in series for v in values if v is not None]
    largest = max(values, default=0.0)
    if "%" in ylabel and largest <= 100:
        return 100.0
    return 1.1 * largest if largest > 0 else 1.0


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
        width = 0.8 / len(results)
        for i, (name, values) in enumerate(results.items()):
            xs = [g + (i - (len(results) - 1) / 2) * width for g in range(len(labels))]
            color = _COLORS[i % len(_COLORS)]
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
        long = len(labels) > 4 and max(len(label) for label in labels) > 6
        ax.set_xticks(
            range(len(labels)), labels, rotation=25 if long else 0, ha="right" if long else "center"
        )
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, bar_axis_top([*results.values(), *(reference or {}).values()], ylabel))
        ax.grid(alpha=0.3, axis="y")
        below = -0.32 if long else -0.1  # under the (rotated) group labels
        ax.legend(
            fontsize=8, ncol=len(results) + 1, loc="upper center", bbox_to_anchor=(0.5, below)
        )
        if title:
            ax.set_title(title)
        return _save(fig, out, fmt)


# ---- training curves from metrics.jsonl -------------------------------------------------------
RunPath = str | os.PathLike[str]


@dataclass
class _Curves:
    """The plottable series of one run; x -> y dicts, so a repeated x keeps its last value."""

    step_loss: dict[float, float] = field(default_factory=dict)  # logged step -> loss
    epoch_loss: dict[float, float] = field(default_factory=dict)  # epoch's last step -> mean
    lr: dict[float, float] = field(default_factory=dict)  # step -> learning rate
    valid: dict[str, dict[float, float]] = field(default_factory=dict)  # key -> epoch -> value
    # key -> step -> value, from the "eval" and "epoch" records
    valid_at_step: dict[str, dict[float, float]] = field(default_factory=dict)
    evals_between_epochs: bool = False  # validated every N steps (records of kind "eval")


def _number(value: object) -> float | None:
    """``value`` as a float when it is a JSON number (not a bool), else None; NaN and
    +-Infinity (which json writes) become NaN: a gap in the line."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else math.nan


def _metrics_file(run: RunPath) -> Path:
    """``run/metrics.jsonl`` for a run directory, ``run`` itself for a file."""
    path = Path(run)
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no metrics file (a run directory holds metrics.jsonl)")
    return file


def _read_metrics(file: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a last line cut short (a crash, or a run still
    writing) is skipped, any other line that is not a JSON object is an error."""
    text = file.read_text()
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines) and not text.endswith("\n"):
                continue  # cut short while being written
            raise ValueError(f"{file}, line {number}: not valid JSON ({err.msg})") from err
        if not isinstance(record, dict):
            raise ValueError(
                f"{file}, line {number}: expected a JSON object, got {type(record).__name__}"
            )
        records.append(record)
    if not records:
        raise ValueError(f"{file} is empty: the run has not logged any metrics yet")
    return records


def _curves(records: list[dict[str, Any]], file: Path) -> _Curves:
    """The series of :func:`structattn.training.fit`'s records (``kind`` "train": ``step``,
    ``loss``, ``lr``; "eval" (every ``eval_every`` steps): ``step``, ``valid_*``; "epoch":
    ``epoch``, ``step``, ``train_loss``, ``lr``, ``valid_*``); records without a key are
    skipped for that key."""
    curves = _Curves()
    for record in records:
        step, epoch = _number(record.get("step")), _number(record.get("epoch"))
        kind = record.get("kind")
        if step is not None:
            loss, train_loss, lr = (
                _number(record.get(key)) for key in ("loss", "train_loss", "lr")
            )
            if loss is not None:
                curves.step_loss[step] = loss
            if train_loss is not None:
                curves.epoch_loss[step] = train_loss
            if lr is not None:
                curves.lr[step] = lr
        curves.evals_between_epochs |= kind == "eval"
        for key, value in record.items():
            number = _number(value)
            if not key.startswith("valid_") or number is None:
                continue
            if step is not None:
                curves.valid_at_step.setdefault(key, {})[step] = number
            if epoch is not None and kind != "eval":
                curves.valid.setdefault(key, {})[epoch] = number
    if not (
        curves.step_loss or curves.epoch_loss or curves.lr or curves.valid or curves.valid_at_step
    ):
        raise ValueError(
            f"{file} has no loss, learning rate or validation metric to plot (keys found: "
            f"{', '.join(sorted({key for record in records for key in record})) or 'none'})"
        )
    return curves


def _labelled_runs(
    runs: RunPath | Sequence[RunPath] | Mapping[str, RunPath],
) -> list[tuple[str, Path]]:
    """(label, metrics file) per run; labels are the mapping's keys or the run directories'
    names (the paths as given where two names coincide)."""
    if isinstance(runs, Mapping):
        pairs = [(str(label), run) for label, run in runs.items()]
    else:
        given = [runs] if isinstance(runs, str | os.PathLike) else list(runs)
        names = []
        for run in given:
            path = Path(run)
            names.append(path.name if path.is_dir() else path.parent.name or path.stem)
        pairs = [
            (name if names.count(name) == 1 else str(run), run)
            for name, run in zip(names, given, strict=True)
        ]
    if not pairs:
        raise ValueError("`runs` must name at least one run")
    return [(label, _metrics_file(run)) for label, run in pairs]


def _plot_series(ax: Any, series: Mapping[float, float], *args: Any, **kwargs: Any) -> None:
    xs = sorted(series)
    ax.plot(xs, [series[x] for x in xs], *args, **kwargs)


def training_curves(
    runs: RunPath | Sequence[RunPath] | Mapping[str, RunPath],
    path: str | Path,
    metrics: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Training curves of one or more runs, overlaid, from their ``metrics.jsonl``.

    One panel per quantity, one colour per run in every panel:

    * train loss against the optimiser step: the loss of every logged step (records of
      kind ``"train"``, thin line) and each epoch's mean (kind ``"epoch"``, ``train_loss``;
      dots at the epoch's last step);
    * learning rate against the step (log scale when it spans more than a factor 10);
    * one panel per validation metric (the ``valid_*`` keys) against the epoch, or against
      the step when a run validated every N steps (records of kind ``"eval"``,
      ``TrainConfig.eval_every``).

    The file format is the one :func:`structattn.training.fit` writes. Records without a
    key are skipped for that key, and a panel is left out when no run has its quantity
    (e.g. a run without validation).

    Args:
        runs: a run directory (holding ``metrics.jsonl``) or a metrics file; a sequence of
            them (labelled by their directory names); or ``{label: run directory or file}``.
        path: output file (PNG unless the suffix says ``.pdf``/``.svg``); folders are made.
        metrics: the validation metrics to show, with or without the ``valid_`` prefix
            (e.g. ``["metric", "valid_accuracy"]``); default: every ``valid_*`` number
            found, in the order first logged.
        title: figure title.

    Returns:
        The path written.

    Raises:
        FileNotFoundError: if a run directory has no ``metrics.jsonl``.
        ValueError: if ``runs`` is empty, a file is empty or has nothing to plot, a line is
            not a JSON object (the file and line are named; a last line cut short by a
            crash is skipped), or ``metrics`` names a metric that no run logged.

    Example::

        from structattn import viz

        viz.training_curves({"lr 1": "runs/a", "lr 0.5": "runs/b"}, "curves.png")
    """
    labelled = _labelled_runs(runs)
    data = [(label, _curves(_read_metrics(file), file)) for label, file in labelled]
    by_step = any(curves.evals_between_epochs for _, curves in data)
    valid = [curves.valid_at_step if by_step else curves.valid for _, curves in data]
    found = list(dict.fromkeys(key for series in valid for key in series))
    if metrics is None:
        valid_keys = found
    else:
        if isinstance(metrics, str):
            raise ValueError("`metrics` must be a sequence of names, not a single string")
        valid_keys = [name if name.startswith("valid_") else f"valid_{name}" for name in metrics]
        missing = [key for key in valid_keys if key not in found]
        if missing:
            raise ValueError(
                f"`metrics`: no run logged {', '.join(missing)}; found "
                f"{', '.join(found) or 'no validation metric'}"
            )
    panels = []
    if any(curves.step_loss or curves.epoch_loss for _, curves in data):
        panels.append("loss")
    if any(curves.lr for _, curves in data):
        panels.append("lr")
    panels.extend(valid_keys)
    if not panels:  # only validation metrics were logged and `metrics` selected none
        raise ValueError("nothing to plot: pass at least one name in `metrics`")
    columns = 2 if len(panels) in (2, 4) else min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    out, fmt = _output_path(path)
    with _rc_context():
        from matplotlib.lines import Line2D
        from matplotlib.ticker import MaxNLocator

        # a top row for the legend of the runs, then the panels
        legend_h = 0.3 * math.ceil(len(data) / 4) + 0.1
        fig = _new_figure(4.2 * columns, 3.0 * rows + legend_h + 0.4, layout="constrained")
        grid = fig.add_gridspec(rows + 1, columns, height_ratios=[legend_h] + [3.0] * rows)
        axes = {
            name: fig.add_subplot(grid[1 + i // columns, i % columns])
            for i, name in enumerate(panels)
        }
        for i, ((_, curves), series) in enumerate(zip(data, valid, strict=True)):
            color = _COLORS[i % len(_COLORS)]
            if "loss" in axes:
                ax = axes["loss"]
                if curves.step_loss:
                    _plot_series(ax, curves.step_loss, "-", color=color, linewidth=0.8, alpha=0.6)
                if curves.epoch_loss:
                    _plot_series(ax, curves.epoch_loss, "o--", color=color, markersize=4)
            if curves.lr:
                _plot_series(axes["lr"], curves.lr, "-", color=color, drawstyle="steps-post")
            for key in valid_keys:
                if key in series:
                    _plot_series(axes[key], series[key], "o-", color=color, markersize=3)
        if "loss" in axes:
            ax = axes["loss"]
            ax.set_xlabel("step")
            ax.set_ylabel("train loss")
            styles = []  # the kinds of loss drawn, in grey
            if any(curves.step_loss for _, curves in data):
                styles.append(Line2D([], [], color="0.3", linewidth=0.8, label="logged steps"))
            if any(curves.epoch_loss for _, curves in data):
                styles.append(
                    Line2D([], [], color="0.3", marker="o", linestyle="--", label="epoch mean")
                )
            ax.legend(handles=styles, fontsize=_SMALL, frameon=False)
        if "lr" in axes:
            ax = axes["lr"]
            rates = [v for _, curves in data for v in curves.lr.values() if math.isfinite(v)]
            if rates and min(rates) > 0 and max(rates) > 10 * min(rates):
                ax.set_yscale("log")
            ax.set_xlabel("step")
            ax.set_ylabel("learning rate")
        for key in valid_keys:
            ax = axes[key]
            ax.set_xlabel("step" if by_step else "epoch")
            ax.set_ylabel(f"validation {key[len('valid_') :]}")
            if not by_step:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for ax in axes.values():
            ax.grid(alpha=0.3)
        handles = [
            Line2D([], [], color=_COLORS[i % len(_COLORS)], linewidth=2, label=label)
            for i, (label, _) in enumerate(data)
        ]
        legend_ax = fig.add_subplot(grid[0, :])
        legend_ax.axis("off")
        legend_ax.legend(handles=handles, loc="center", ncol=min(len(handles), 4), frameon=False)
        if title:
            fig.suptitle(title)
        return _save(fig, out, fmt)
