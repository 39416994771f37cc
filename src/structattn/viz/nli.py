"""Natural language inference (Kim et al. 2017, sec. 4.4): our test accuracy beside the
paper's Table 5, as the markdown table the ``nli`` recipe prints (with a paired bootstrap of
each variant against ``none``), and its bar figure. Plain values in (the cells' summaries,
``results[(dataset, attention)]``: ``accuracy_mean``, ``accuracy_std``, ``runs``,
``correct_runs`` of :func:`~structattn.metrics.count_correct_runs`, ``seconds_per_epoch``),
text or files out."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..metrics import correct_run_fractions, paired_bootstrap
from .results import grouped_bars, markdown_table

__all__ = ["DATASETS", "NAMES", "PAPER_TABLE5", "VARIANTS", "format_table", "plot_results"]

#: the intra-sentence attention variants (the table's rows)
VARIANTS = ("none", "hard-parent", "simple", "structured", "pretrained")
NAMES = {
    "none": "No Attention",
    "hard-parent": "No Attention + Hard parent",
    "simple": "Simple Attention",
    "structured": "Structured Attention",
    "pretrained": "Pretrained Structured Attention",
}
#: SNLI test accuracy of Table 5 (Kim et al. 2017)
PAPER_TABLE5 = {
    "none": 85.8,
    "hard-parent": 86.1,
    "simple": 86.2,
    "structured": 86.8,
    "pretrained": 86.5,
}
#: the data sets (the table's columns, in this order)
DATASETS = ("sick", "snli-small")


def _mean_correct(summary: Mapping[str, Any]) -> list[float]:
    """Per test pair, the fraction of the cell's runs that got it right."""
    return correct_run_fractions(summary["correct_runs"], summary["runs"])


def format_table(results: Mapping[tuple[Any, ...], Mapping[str, Any]]) -> str:
    """Table 5: our test accuracy (mean +- std over seeds, per data set) beside the paper's
    SNLI numbers, with a paired bootstrap of each variant against ``none`` (over the test
    pairs, per-pair correctness averaged over seeds)."""
    datasets = sorted({key[0] for key in results}, key=DATASETS.index)
    header = ["Model", *(f"{d} (ours)" for d in datasets), "SNLI (paper)"]
    rows = []
    notes = []
    for variant in VARIANTS:
        cells = []
        for d in datasets:
            s = results.get((d, variant))
            if s is None:
                cells.append("-")
                continue
            text = f"{s['accuracy_mean']:.1f} +- {s['accuracy_std']:.1f} ({s['runs']})"
            base = results.get((d, "none"))
            if base is not None and variant != "none":
                boot = paired_bootstrap(_mean_correct(s), _mean_correct(base), samples=2000)
                text += f" [{100 * boot.difference:+.1f}, p {boot.p_value:.2f}]"
            cells.append(text)
            if s.get("seconds_per_epoch"):
                notes.append(f"{d} {variant}: {s['seconds_per_epoch']:.1f} s/epoch")
        if any(c != "-" for c in cells):
            rows.append([NAMES[variant], *cells, f"{PAPER_TABLE5[variant]:.1f}"])
    table = markdown_table(header, rows)
    return (
        table + "\n\nCells: test accuracy %, mean +- std over seeds (runs); [difference to No "
        "Attention in points, one-sided paired-bootstrap p]. The paper's column is SNLI test "
        "(549k training pairs); ours are trained on SICK TRAIN or SNLI dev.\n"
        + ("Time: " + "; ".join(notes) if notes else "")
    )


def plot_results(results: Mapping[tuple[Any, ...], Mapping[str, Any]], out: Path) -> list[Path]:
    """``accuracy.png`` in ``out``: each variant's test accuracy (mean over seeds) per data
    set as bars (nothing, with a message, without matplotlib). Returns the files written."""
    datasets = sorted({key[0] for key in results}, key=DATASETS.index)
    shown = [v for v in VARIANTS if any((d, v) in results for d in datasets)]
    ours = {
        d: [results[(d, v)]["accuracy_mean"] if (d, v) in results else None for v in shown]
        for d in datasets
    }
    try:
        return [
            grouped_bars(
                [NAMES[v] for v in shown],
                ours,
                out / "accuracy.png",
                title="NLI test accuracy, mean over seeds",
                ylabel="accuracy %",
            )
        ]
    except ImportError as error:
        print(f"no plots: {error}", file=sys.stderr)
        return []
