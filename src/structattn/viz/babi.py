"""bAbI (Kim et al. 2017, sec. 4.3): our results beside the paper's Table 4, as the
markdown table the ``babi`` recipe prints and as bar figures, and Figure 5 (a CRF model's
fact-sequence marginals for one question). Plain values in, files or text out: the model is
run by the caller (:func:`structattn.models.memory_qa.fact_chains`)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from ..data.babi import (
    FACT_EXCLUDED_TASKS,
    MODEL_NAMES,
    PAPER_HOPS,
    PAPER_TABLE4,
    PAPER_TABLE4_AVERAGE,
    TABLE_ORDER,
    BabiExample,
)
from .chains import fact_chain_graph
from .results import grouped_bars, markdown_table

__all__ = [
    "cells_table",
    "figure5",
    "format_runs",
    "format_table",
    "nested_results",
    "paper_record",
    "plot_cells",
    "plot_results",
]


def nested_results(
    results: Mapping[tuple[Any, ...], Mapping[str, Any]],
) -> dict[int, dict[str, dict[str, Any]]]:
    """``results[(task, model)]`` (the runner's cells) as ``results[task][model]``."""
    nested: dict[int, dict[str, dict[str, Any]]] = {}
    for (task, model), summary in results.items():
        nested.setdefault(task, {})[model] = dict(summary)
    return nested


def _cell(ans: float | None, fact: float | None) -> str:
    a = "-" if ans is None else f"{ans:.1f}"
    f = "-" if fact is None else f"{fact:.1f}"
    return f"{a} / {f}"


def format_table(results: dict[int, dict[str, dict[str, Any]]]) -> str:
    """Markdown table ``results[task][model] = summary``: ours beside Table 4 (Ans % / Fact %)."""
    models = [m for m in TABLE_ORDER if any(m in row for row in results.values())]
    header = ["Task", "K"]
    for m in models:
        header += [f"{MODEL_NAMES[m]} (ours)", f"{MODEL_NAMES[m]} (paper)"]
    rows = []
    sums: dict[str, dict[str, list[float]]] = {
        m: {"ans": [], "fact": [], "pans": [], "pfact": []} for m in models
    }
    for task in sorted(results):
        row = [str(task), str(PAPER_HOPS.get(task, "-"))]
        for m in models:
            ours = results[task].get(m)
            paper = PAPER_TABLE4[m.replace("-", "_")].get(task)
            row.append(_cell(ours["ans"], ours["fact"]) if ours else "-")
            row.append(_cell(*paper) if paper else "-")
            if ours and paper:
                sums[m]["ans"].append(ours["ans"])
                sums[m]["pans"].append(paper[0])
                if task not in FACT_EXCLUDED_TASKS and ours["fact"] is not None:
                    sums[m]["fact"].append(ours["fact"])
                    sums[m]["pfact"].append(paper[1] or 0.0)
        rows.append(row)

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    average = ["AVERAGE", "-"]
    for m in models:
        s = sums[m]
        average += [
            _cell(mean(s["ans"]), mean(s["fact"])),
            _cell(mean(s["pans"]), mean(s["pfact"])),
        ]
    rows.append(average)
    printed = ", ".join(
        f"{MODEL_NAMES[m]} {_cell(*PAPER_TABLE4_AVERAGE[m.replace('-', '_')])}" for m in models
    )
    note = (
        "Cells: Ans % / Fact %. AVERAGE: over the tasks in the table (Fact %: without tasks 7, "
        f"8); the paper's printed averages over its 12 tasks: {printed}."
    )
    return markdown_table(header, rows) + "\n\n" + note


def format_runs(results: dict[int, dict[str, dict[str, Any]]]) -> str:
    """Markdown table: runs finished per task and model, how many of them converged (final
    training loss below :data:`CONVERGED_LOSS`), and the mean seconds per run."""
    models = [m for m in TABLE_ORDER if any(m in row for row in results.values())]
    lines = [
        "| Task | " + " | ".join(f"{MODEL_NAMES[m]} runs, converged, s/run" for m in models) + " |",
        "|---|" + "---|" * len(models),
    ]
    for task in sorted(results):
        cells = []
        for m in models:
            r = results[task].get(m)
            if r is None:
                cells.append("-")
                continue
            done = "-" if r.get("converged") is None else str(r["converged"])
            cells.append(f"{r['runs']}, {done}, {r['seconds_per_run']:.1f}")
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_results(results: dict[int, dict[str, dict[str, Any]]], out_dir: str | Path) -> list[Path]:
    """``ans.png`` and ``fact.png`` in ``out_dir``: our Ans % / Fact % per task and model as
    bars, the paper's as black ticks (nothing, with a message, without matplotlib)."""
    tasks = sorted(results)
    models = [m for m in TABLE_ORDER if any(m in row for row in results.values())]
    written = []
    for index, key, what in ((0, "ans", "answer accuracy"), (1, "fact", "fact-sequence accuracy")):
        shown = [t for t in tasks if key == "ans" or t not in FACT_EXCLUDED_TASKS]
        if not shown:
            continue
        ours = {
            MODEL_NAMES[m]: [results[t][m][key] if m in results[t] else None for t in shown]
            for m in models
        }
        paper = {
            MODEL_NAMES[m]: [
                PAPER_TABLE4[m.replace("-", "_")].get(t, (None, None))[index] for t in shown
            ]
            for m in models
        }
        try:
            written.append(
                grouped_bars(
                    [f"task {t}" for t in shown],
                    ours,
                    Path(out_dir) / f"{key}.png",
                    reference=paper,
                    title=f"bAbI 1k, {what} (bars: ours; ticks: paper)",
                    ylabel="Ans %" if key == "ans" else "Fact %",
                )
            )
        except ImportError as error:
            print(f"no plots: {error}", file=sys.stderr)
            break
    return written


def cells_table(results: Mapping[tuple[Any, ...], Mapping[str, Any]]) -> str:
    """The runner's cells ``results[(task, model)]`` as :func:`format_table` (ours beside
    Table 4) followed by :func:`format_runs` (runs, converged, seconds)."""
    nested = nested_results(results)
    return format_table(nested) + "\n\n" + format_runs(nested)


def plot_cells(results: Mapping[tuple[Any, ...], Mapping[str, Any]], out: Path) -> list[Path]:
    """:func:`plot_results` of the runner's cells ``results[(task, model)]``."""
    return plot_results(nested_results(results), out)


def paper_record() -> dict[str, Any]:
    """Table 4 as ``results.json`` carries it beside ours (JSON keys: tasks as strings, cells
    as ``[Ans %, Fact %]`` lists per model of :data:`~structattn.data.babi.TABLE_ORDER`)."""
    return {
        "source": "Kim et al. 2017, Table 4 (Ans % / Fact %)",
        "hops": {str(t): k for t, k in PAPER_HOPS.items()},
        "cells": {
            m: {str(t): list(v) for t, v in PAPER_TABLE4[m.replace("-", "_")].items()}
            for m in TABLE_ORDER
        },
        "average": {m: list(PAPER_TABLE4_AVERAGE[m.replace("-", "_")]) for m in TABLE_ORDER},
    }


def figure5(
    example: BabiExample,
    marginals: Tensor,
    edges: Tensor,
    top: Sequence[tuple[Sequence[int], float]],
    predicted: str,
    path: str | Path,
    title: str,
) -> Path:
    """Figure 5 for one question: facts per step as nodes (``marginals`` [K, N]), edge
    marginals p(z_k, z_{k+1}) (``edges`` [K-1, N, N]) as edge widths, the ``top`` fact
    sequences with their probabilities; the question, gold and ``predicted`` answers and the
    supporting facts as the caption. Returns the file written."""
    labels = [
        f"{' '.join(words)} (line {line})"
        for line, words in zip(example.memory_lines, example.memory, strict=True)
    ]
    gold = " -> ".join("?" if i is None else str(i) for i in example.support)
    gold_lines = " -> ".join(str(s) for s in example.support_lines)
    return fact_chain_graph(
        marginals,
        edges,
        path,
        fact_labels=labels,
        top_sequences=list(top),
        question=" ".join(example.question) + "?",
        answer=f"{example.answer} (predicted {predicted}); supporting facts {gold} "
        f"(lines {gold_lines})",
        title=title,
    )
