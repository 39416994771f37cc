"""The recipe record: what a paper experiment gives the shared runner and the command line.

A recipe is a flat module (config dataclass, data, build, train, evaluate, table, plots)
that ends with one :class:`Recipe` record of its functions; :mod:`structattn.recipes`
registers it by name, and ``structattn data|train|eval|reproduce|viz <name>`` are generated
from the record (:mod:`structattn.cli`); run directories, seeded runs in parallel, resume,
best-run selection, results files and tables come from :mod:`structattn.recipes.runs`.

Protocol of one run (``train`` then ``score``, driven by the runner)::

    train(config, run_dir, resume) -> dict   fit() one model into run_dir (seed:
                                             config.train.seed); returns fit's summary
    score(config, run_dir) -> dict           {"valid": {...}, "test": {...}} of the trained
                                             run; writes run_dir/test_predictions.jsonl
    select(record) -> float                  validation score of a finished run's record
                                             (done.json), higher is better
    summarize(config, records) -> dict       one cell's summary from its finished runs'
                                             records, best first (what the table shows)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = [
    "RESUMABLE",
    "GridAxis",
    "NoOptions",
    "Preset",
    "Recipe",
    "accuracy_metric",
    "best_on_validation",
    "best_run_scores",
    "load_vocabulary_run",
    "mean_std_text",
    "seed_spread",
    "seed_summary",
    "valid_accuracy",
    "markdown_table",
    "scores_table",
]


@dataclass(frozen=True)
class Preset:
    """A named config of a recipe (``--preset NAME``)."""

    config: Any  # the recipe's config dataclass instance
    description: str  # one line for ``structattn list``
    jobs: int = 1  # default ``--jobs`` (runs trained in parallel processes)


@dataclass(frozen=True)
class GridAxis:
    """One axis of ``reproduce``'s grid: ``--<flag> a,b,c`` sweeps the config field ``field``."""

    flag: str  # reproduce's flag, e.g. "variants" (--variants none,simple)
    field: str  # the config field it sets, e.g. "attention"
    values: tuple[Any, ...]  # default values (the paper's table)


#: config fields (paths) a ``--resume`` may change: training length, logging, the device
RESUMABLE = frozenset(
    {"train.epochs", "train.progress", "train.log_every", "train.epoch_lines", "train.name",
     "train.checkpoint_every", "train.device"}
)  # fmt: skip


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A right-aligned Markdown table."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


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


def seed_spread(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample standard deviation (0 for one run) and the values of a cell's runs."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no runs to summarise")
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": spread, "runs": values}


def seed_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A multi-run cell's ``summarize`` for accuracy recipes: ``test_mean`` / ``test_std`` /
    ``test_runs`` of the runs' test accuracy (:func:`seed_spread`) and the best run's
    (``records[0]``) ``test``, ``valid`` and ``coverage``."""
    spread = seed_spread([r["test"]["accuracy"] for r in records])
    return {
        "test_mean": spread["mean"],
        "test_std": spread["std"],
        "test_runs": spread["runs"],
        "test": records[0]["test"],
        "valid": records[0]["valid"],
        "coverage": records[0].get("coverage"),
    }


def mean_std_text(summary: Mapping[str, Any]) -> str:
    """``"mean +- std (n=runs)"`` of a :func:`seed_summary`, for tables."""
    runs = len(summary["test_runs"])
    return f"{summary['test_mean']:.1f} +- {summary['test_std']:.1f} (n={runs})"


def load_vocabulary_run(
    run_dir: str | Path,
    device: str,
    recipe: str,
    config_class: type,
    build_model: Callable[[Any, int, int], Any],
) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The best model of a run of a recipe whose checkpoints keep its word vocabulary and
    embedding size in ``extra`` (``vocab``, ``embed_dim``): ``(model in eval mode on
    device, WordVocabulary, config, extra)`` from one read of ``model.pt``; ``ValueError``
    for another recipe's run. ``build_model(config, vocabulary size, embedding size)``."""
    from ..data.classification import WordVocabulary
    from ..training import load_model_state
    from .config import config_from_dict

    state = load_model_state(run_dir)
    if state["config"].get("recipe") != recipe:
        raise ValueError(f"{run_dir} is not an {recipe} run ({state['config'].get('recipe')!r})")
    config: Any = config_from_dict(config_class, state["config"])
    vocab = WordVocabulary.from_dict(state["extra"]["vocab"])
    model = build_model(config, len(vocab), int(state["extra"]["embed_dim"]))
    model.load_state_dict(state["model"])
    return model.to(device).eval(), vocab, config, state["extra"]


def best_on_validation(record: Mapping[str, Any]) -> float:
    """Default ``select``: the validation ``metric`` of the run's best epoch (fit's summary)."""
    return float(record.get("train", {}).get("best", {}).get("metric", -math.inf))


def best_run_scores(config: Any, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Default ``summarize``: the validation and test scores of the best run."""
    return {"valid": records[0].get("valid"), "test": records[0].get("test")}


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


@dataclass(frozen=True)
class NoOptions:
    """A command without flags of its own."""


@dataclass(frozen=True)
class Recipe:
    """A paper experiment as a flat record of functions (see the module docstring); the
    optional fields have generic defaults."""

    name: str  # command-line name, e.g. "tree-transduction"
    summary: str  # one line: paper, section, what is measured
    config: type  # config dataclass (paper defaults, a `train: TrainConfig` field)
    variant: str  # the config field that selects the model variant, e.g. "attention"
    variants: tuple[str, ...]  # its values
    presets: Mapping[str, Preset]  # at least "paper", "cpu" and "quick"
    train: Callable[[Any, Path, bool], dict[str, Any]]  # (config, run_dir, resume) -> fit summary
    score: Callable[[Any, Path], dict[str, Any]]  # (config, run_dir) -> {"valid", "test"}
    evaluate: Callable[[Path, Any, str, Path | None], str]  # (run, options, device, jsonl) -> text
    eval_options: type = NoOptions  # dataclass: eval's own flags
    select: Callable[[Mapping[str, Any]], float] = best_on_validation  # record -> valid. score
    summarize: Callable[[Any, Sequence[Mapping[str, Any]]], dict[str, Any]] = best_run_scores
    cell_dir: Callable[[Any], str] | None = None  # config -> dir below --out (default: variant)
    grid: tuple[GridAxis, ...] = ()  # reproduce's grid (default: --variants over the variants)
    table: Callable[[Mapping[tuple[Any, ...], Mapping[str, Any]]], str] | None = None  # ours
    # beside the paper's, Markdown (default: scores_table)
    paper: Mapping[str, Any] = field(default_factory=dict)  # the paper's table as JSON
    viz: Callable[[Path, Any, Path | None], list[Path]] | None = None  # (checkpoint, options,
    # out) -> files written
    viz_options: type = NoOptions  # dataclass: viz's own flags
    data: Callable[[Any], None] | None = None  # `structattn data <name>` (generated data sets)
    parse: Callable[[Path, Sequence[Sequence[str]], str], list[str]] | None = None  # `structattn
    # parse <name>`: (run, tokenised sentences, device) -> one output text per sentence
    data_options: type = NoOptions  # dataclass: data's flags
    multi_run: bool = False  # True: `train` trains config.runs seeded runs into out/run_NN
    plots: Callable[[Mapping[tuple[Any, ...], Mapping[str, Any]], Path], list[Path]] | None = (
        None  # reproduce's result plots (skipped with a notice without matplotlib)
    )
    needs: Mapping[str, tuple[str, ...]] = field(  # command -> modules it cannot run without
        default_factory=lambda: {"viz": ("matplotlib",)}
    )
    reproduce_also: tuple[str, ...] = ()  # recipes whose tables `reproduce` makes too, with the
    # same preset, into <out>/<name> (e.g. mfa -> mfa-lm: one command for the paper's tables)
    resumable: frozenset[str] = frozenset()  # config fields `--resume` may change besides
    # RESUMABLE's (e.g. how many runs, how the test set is scored)

    def __post_init__(self) -> None:
        missing = {"paper", "cpu", "quick"} - set(self.presets)
        if missing:
            raise ValueError(f"recipe {self.name!r}: presets {sorted(missing)} are missing")
        names = {f.name for f in fields(self.config)}
        if not self.variants or self.variant not in names:
            raise ValueError(f"recipe {self.name!r}: `variant` must name a config field")
        if "train" not in names:
            raise ValueError(f"recipe {self.name!r}: the config needs a `train: TrainConfig`")
        if self.multi_run and "runs" not in names:
            raise ValueError(f"recipe {self.name!r}: multi_run needs a `runs` config field")
        if self.cell_dir is None:
            variant = self.variant
            object.__setattr__(self, "cell_dir", lambda config: str(getattr(config, variant)))
        if not self.grid:
            axis = GridAxis("variants", self.variant, tuple(self.variants))
            object.__setattr__(self, "grid", (axis,))
        if self.table is None:
            paper = self.paper
            object.__setattr__(self, "table", lambda results: scores_table(results, paper))

    def cell(self, config: Any) -> str:
        """The directory of ``config``'s cell below an output directory."""
        assert self.cell_dir is not None
        return self.cell_dir(config)

    def format_table(self, results: Mapping[tuple[Any, ...], Mapping[str, Any]]) -> str:
        """Our table beside the paper's (Markdown)."""
        assert self.table is not None
        return self.table(results)
