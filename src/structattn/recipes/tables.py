"""Selection, summaries and tables of finished runs, shared by the recipes.

A finished run's record is its ``done.json`` (written by :mod:`structattn.recipes.runs`: seed,
seconds, fit's summary under ``train``, ``valid`` and ``test`` scores). The functions here are
the defaults of a recipe's :class:`~structattn.recipes.base.Reporting` (``select``,
``summarize``, ``table``) and the pieces the recipes' own tables are made of::

    select(record) -> float               a run's validation score, higher is better
    summarize(config, records) -> dict     one cell's summary from its records, best first
    table(results) -> str                  our Markdown table beside the paper's

and what a summary reads of a run's own files (:func:`epoch_timing`: ``metrics.jsonl``).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..metrics import seed_spread
from ..viz.results import markdown_table  # re-exported: the recipes' tables use it

__all__ = [
    "accuracy_metric",
    "best_on_validation",
    "best_run_scores",
    "epoch_timing",
    "markdown_table",
    "mean_std_text",
    "scores_table",
    "seed_summary",
    "valid_accuracy",
]


# ---- selection: which run of a cell counts ----------------------------------------------------
def best_on_validation(record: Mapping[str, Any]) -> float:
    """Default ``select``: the validation ``metric`` of the run's best epoch (fit's summary)."""
    return float(record.get("train", {}).get("best", {}).get("metric", -math.inf))


def accuracy_metric(accuracy: float, loss: float) -> float:
    """Selection metric of the classification recipes: ``accuracy`` (a fraction or a
    percentage), ties broken by the lower NLL ``loss`` (its term stays below 1e-4, less than
    one accuracy step of any validation set here)."""
    return accuracy - 1e-6 * min(loss, 99.0)


def valid_accuracy(record: Mapping[str, Any], scale: float = 1.0) -> float:
    """``select`` of a run whose record has ``valid: {accuracy, loss}``: :func:`accuracy_metric`
    of ``scale * accuracy`` (-inf when the run has no validation accuracy)."""
    valid = record.get("valid") or {}
    if "accuracy" not in valid:
        return -math.inf
    return accuracy_metric(float(valid["accuracy"]) * scale, float(valid.get("loss", 0.0)))


# ---- summaries: one cell from its runs' records, best first -----------------------------------
def best_run_scores(config: Any, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Default ``summarize``: the validation and test scores of the best run."""
    return {"valid": records[0].get("valid"), "test": records[0].get("test")}


def seed_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A multi-run cell's ``summarize`` for accuracy recipes: ``test_mean`` / ``test_std`` /
    ``test_runs`` of the runs' test accuracy (:func:`~structattn.metrics.seed_spread`) and the
    best run's (``records[0]``) ``test``, ``valid`` and ``coverage``."""
    spread = seed_spread([r["test"]["accuracy"] for r in records])
    return {
        "test_mean": spread["mean"],
        "test_std": spread["std"],
        "test_runs": spread["runs"],
        "test": records[0]["test"],
        "valid": records[0]["valid"],
        "coverage": records[0].get("coverage"),
    }


# ---- speed: from a run's metrics.jsonl ----------------------------------------------------------
def epoch_timing(run_dir: Path, train_tokens: int) -> dict[str, float | None]:
    """Median seconds per epoch (validation included) and training target tokens per second,
    from the epochs logged in ``metrics.jsonl`` (across resumes: consecutive epochs only)."""
    path = run_dir / "metrics.jsonl"
    epochs = []
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("kind") == "epoch":
                epochs.append((record["epoch"], record["time"]))
    gaps = [
        t1 - t0
        for (e0, t0), (e1, t1) in zip(epochs, epochs[1:], strict=False)
        if e1 == e0 + 1 and t1 > t0
    ]
    if epochs and epochs[0][0] == 1:
        gaps.append(epochs[0][1])
    if not gaps:
        return {"seconds_per_epoch": None, "tokens_per_second": None}
    seconds = statistics.median(gaps)
    return {"seconds_per_epoch": seconds, "tokens_per_second": train_tokens / seconds}


# ---- tables ------------------------------------------------------------------------------------
def mean_std_text(summary: Mapping[str, Any]) -> str:
    """``"mean +- std (n=runs)"`` of a :func:`seed_summary`, for tables."""
    runs = len(summary["test_runs"])
    return f"{summary['test_mean']:.1f} +- {summary['test_std']:.1f} (n={runs})"


def _number(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, int | float) and not isinstance(value, bool) else "-"


def scores_table(
    results: Mapping[tuple[Any, ...], Mapping[str, Any]], paper: Mapping[str, Any]
) -> str:
    """Default ``table``: one row per cell, its numeric test scores, and beside them the
    paper's ``paper[cell label][score]`` where given."""
    keys = sorted(
        {k for s in results.values() for k, v in (s.get("test") or {}).items()
         if isinstance(v, int | float) and not isinstance(v, bool)}
    )  # fmt: skip
    header = ["Cell", *(f"{k} (ours)" for k in keys), *(f"{k} (paper)" for k in keys)]
    rows = []
    for cell, summary in results.items():
        label = " ".join(map(str, cell))
        test = summary.get("test") or {}
        reference = paper.get(label, {}) if isinstance(paper.get(label), Mapping) else {}
        rows.append(
            [
                label,
                *(_number(test.get(k)) for k in keys),
                *(_number(reference.get(k)) for k in keys),
            ]
        )
    return markdown_table(header, rows)
