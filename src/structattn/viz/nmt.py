"""Japanese -> English NMT (Kim et al. 2017, sec. 4.2): our BLEU beside the paper's Table 3,
as the markdown table the ``nmt`` recipe prints, the paired-bootstrap significance of each
attention against ``simple``, and the result figures. Plain values in (the cells' summaries,
``results[(source, attention)]``; a ``reproduce`` directory's files), text or files out."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..io import atomic_write_text
from ..metrics import bleu_significance
from .results import grouped_bars, markdown_table, training_curves

__all__ = [
    "PAPER_TABLE",
    "SOURCES",
    "VARIANTS",
    "VARIANT_NAMES",
    "by_source",
    "format_table",
    "plot_results",
    "results_table",
    "significance_table",
]

#: the decoder attentions (the table's columns)
VARIANTS = ("simple", "sigmoid", "structured")
#: the source settings (the table's rows): characters or KyTea words
SOURCES = ("char", "word")
#: Table 3 of the paper (BLEU, WAT test set): source setting -> attention -> BLEU
PAPER_TABLE: dict[str, dict[str, float]] = {
    "char": {"simple": 12.6, "sigmoid": 13.1, "structured": 14.6},
    "word": {"simple": 14.1, "sigmoid": 13.8, "structured": 14.3},
}
#: the attentions' names in the paper's table
VARIANT_NAMES = {"simple": "Simple", "sigmoid": "Sigmoid", "structured": "Structured"}


def format_table(results: Mapping[str, Mapping[str, float | None]]) -> str:
    """Table 3: BLEU per source setting (rows) and attention (ours, then the paper's)."""
    header = ["Source", *(f"{VARIANT_NAMES[v]} (ours)" for v in VARIANTS)]
    header += [f"{VARIANT_NAMES[v]} (paper)" for v in VARIANTS]
    rows = []
    for source in SOURCES:
        if source not in results:
            continue
        ours = results[source]
        row = [source.upper()]
        row += [f"{ours[v]:.1f}" if ours.get(v) is not None else "-" for v in VARIANTS]
        row += [f"{PAPER_TABLE[source][v]:.1f}" for v in VARIANTS]
        rows.append(row)
    return markdown_table(header, rows)


def by_source(
    results: Mapping[tuple[Any, ...], Mapping[str, Any]], key: str = "bleu"
) -> dict[str, dict[str, Any]]:
    """``results[(source, attention)][key]`` (the runner's cells) as
    ``table[source][attention]``."""
    table: dict[str, dict[str, Any]] = {}
    for (source, attention), summary in results.items():
        table.setdefault(source, {})[attention] = summary.get(key)
    return table


def results_table(results: Mapping[tuple[Any, ...], Mapping[str, Any]]) -> str:
    """Table 3 (:func:`format_table`) of the runner's cells' summaries (their ``bleu``)."""
    return format_table(by_source(results))


def plot_results(results: Mapping[tuple[Any, ...], Mapping[str, Any]], out: Path) -> list[Path]:
    """In ``out`` (a ``reproduce`` directory): ``bleu.png``, our BLEU per source and attention
    as bars with the paper's as ticks; ``training_curves.png``, the validation perplexity of
    the cells' runs; and ``significance.md`` (:func:`significance_table`, also printed).
    Returns the files written."""
    table = by_source(results)
    sources = [s for s in SOURCES if s in table]
    ours = {VARIANT_NAMES[v]: [table[s].get(v) for s in sources] for v in VARIANTS}
    paper = {VARIANT_NAMES[v]: [PAPER_TABLE[s][v] for s in sources] for v in VARIANTS}
    written = [
        grouped_bars(
            [s.upper() for s in sources], ours, out / "bleu.png", reference=paper,
            title="NMT ja->en: BLEU (ours: small_parallel_enja; ticks: paper, WAT)",
            ylabel="BLEU",
        )
    ]  # fmt: skip
    run_dirs = {
        f"{s}-{v}": out / f"{s}-{v}"
        for (s, v) in results
        if (out / f"{s}-{v}" / "metrics.jsonl").exists()
    }
    if run_dirs:
        written.append(training_curves(run_dirs, out / "training_curves.png", ["perplexity"]))
    significance = significance_table(out)
    if significance:  # not a plot, but written and reported with them
        atomic_write_text(out / "significance.md", significance + "\n")
        print(significance)
        written.append(out / "significance.md")
    return written


def significance_table(out: str | Path, baseline: str = "simple") -> str:
    """Markdown: for each source setting under a ``reproduce`` directory ``out``, every
    attention's test BLEU, its 95% bootstrap interval and the paired-bootstrap p-value of
    its difference from ``baseline`` (``bleu_significance``; from the cells'
    ``test_predictions.jsonl``)."""
    rows = []
    for source in SOURCES:
        hyps: dict[str, list[str]] = {}
        refs: list[str] = []
        for attention in VARIANTS:
            path = Path(out) / f"{source}-{attention}" / "test_predictions.jsonl"
            if not path.exists():
                continue
            lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
            hyps[attention] = [x["hypothesis"] for x in lines]
            refs = [x["reference"] for x in lines]
        if baseline not in hyps or len(hyps) < 2:
            continue
        for name, r in bleu_significance(hyps, refs, baseline).items():
            p = "-" if r["p_value"] is None else f"{r['p_value']:.3f}"
            span = f"[{r['low']:.1f}, {r['high']:.1f}]"
            rows.append([source.upper(), VARIANT_NAMES[name], f"{r['bleu']:.2f}", span, p])
    header = ["Source", "Attention", "BLEU", "95% interval", f"p vs {VARIANT_NAMES[baseline]}"]
    return markdown_table(header, rows) if rows else ""
