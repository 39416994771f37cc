"""Mean-field attention (Liu, Chen, Liang, Ueda; Table 1, Figure 1): our results beside the
paper's Table 1, as the markdown table the ``mfa`` recipe prints, and Figure 1 (the test
metric against the input length). Plain values in, text or files out: the cells' summaries
are made by the recipe (``summary["task"]``, ``["model"]``, ``["runs"]``, ``["runs_spread"]``
of each score as :func:`~structattn.metrics.mean_std_range`, ``["per_length"]``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .results import line_curves, markdown_table

__all__ = ["MODEL_NAMES", "PAPER_TABLE1", "TABLE_MODELS", "figure1", "format_table"]

#: Table 1's rows (and the k = 0 ablation) as the recipe's ``model`` values
TABLE_MODELS = ("rnn", "lstm", "bilstm", "attention", "vae", "mfa0", "mfa1", "mfa5")
MODEL_NAMES = {
    "rnn": "RNN",
    "lstm": "LSTM",
    "bilstm": "Bidirectional LSTM",
    "attention": "LSTM with Attention",
    "vae": "VAE Attention",
    "mfa0": "MFA_0 (sigmoid)",
    "mfa1": "MFA_1",
    "mfa5": "MFA_5",
}
#: Table 1 of the paper: model -> (counting MSE, sorting "NLL" as printed)
PAPER_TABLE1: dict[str, tuple[float | None, float | None]] = {
    "rnn": (720.32, -2.34),
    "lstm": (145.30, -9.13),
    "bilstm": (215.91, -8.53),
    "attention": (None, -18.43),
    "vae": (198.23, -8.44),
    "mfa1": (106.62, -20.76),
    "mfa5": (76.13, -25.12),
}


def _mean_std(spread: Mapping[str, float] | None, digits: int = 2) -> str:
    """``"mean ± std"`` of a score's spread over runs (``"-"`` without one)."""
    if not spread:
        return "-"
    return f"{spread['mean']:.{digits}f} ± {spread['std']:.{digits}f}"


def format_table(results: Mapping[tuple[Any, ...], Mapping[str, Any]]) -> str:
    """Table 1: per model, counting MSE and sorting NLL / accuracy (mean ± std over runs)
    beside the paper's numbers."""
    cells: dict[tuple[str, str], Mapping[str, Any]] = {}
    for summary in results.values():
        cells[(summary["task"], summary["model"])] = summary
    models = [m for m in TABLE_MODELS if any(k[1] == m for k in cells)]
    models += sorted({k[1] for k in cells} - set(models))
    header = ["Model", "Counting MSE (ours)", "(paper)", "Sorting NLL/seq (ours)",
              "Sorting exact % (ours)", "(paper)", "runs"]  # fmt: skip
    rows = []
    for m in models:
        count, sort = cells.get(("counting", m)), cells.get(("sorting", m))
        paper = PAPER_TABLE1.get(m, (None, None))
        spread_c = count["runs_spread"] if count else {}
        spread_s = sort["runs_spread"] if sort else {}
        n_runs = "/".join(str(c["runs"]) if c else "-" for c in (count, sort))
        rows.append(
            [
                MODEL_NAMES.get(m, m),
                _mean_std(spread_c.get("mse")),
                "-" if paper[0] is None else f"{paper[0]:.2f}",
                _mean_std(spread_s.get("nll"), 3),
                _mean_std(spread_s.get("accuracy"), 1),
                "-" if paper[1] is None else f"{paper[1]:.2f}",
                n_runs,
            ]
        )
    return markdown_table(header, rows)


def figure1(results: Mapping[tuple[Any, ...], Mapping[str, Any]], out: Path) -> list[Path]:
    """Figure 1: the test metric against the input length, one line per model, one figure
    per task (``figure1_counting.png``, ``figure1_sorting.png`` in ``out``). Returns the
    files written."""
    written = []
    for task, ylabel in (("counting", "test MSE"), ("sorting", "test NLL per sequence")):
        series = {
            MODEL_NAMES.get(s["model"], s["model"]): {int(n): v for n, v in s["per_length"].items()}
            for s in results.values()
            if s["task"] == task
        }
        if series:
            path = out / f"figure1_{task}.png"
            title = f"{task}: test error vs input length (mean over runs)"
            written.append(line_curves(series, path, "input length", ylabel, title, log_y=True))
    return written
