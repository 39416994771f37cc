"""The recipe record: what a paper experiment gives the shared runner and the command line.

A recipe is a flat module (config dataclass, data, build, train, evaluate, table, plots)
that ends with one :class:`Recipe` record of its functions; :mod:`structattn.recipes`
registers it by name, and ``structattn data|train|eval|reproduce|viz|parse <name>`` are
generated from the record (:mod:`structattn.cli`); run directories, seeded runs in parallel,
resume, best-run selection, results files and tables come from :mod:`structattn.recipes.runs`.

The core record is what every recipe has; two optional sub-records hold the rest::

    Recipe(name, summary, config, presets, grid, train, score, evaluate,
           cell_dir=None, resumable=frozenset(), needs={"viz": ("matplotlib",)},
           report=Reporting(select, summarize, table, paper, plots, reproduce_also),
           tools=Tools(eval_options, viz, viz_options, parse, data, data_options))

Protocol of one run (``train`` then ``score``, driven by the runner)::

    train(config, run_dir, resume) -> dict   fit() one model into run_dir (seed:
                                             config.train.seed); returns fit's summary
    score(config, run_dir) -> dict           {"valid": {...}, "test": {...}} of the trained
                                             run; writes run_dir/test_predictions.jsonl

A config with a ``runs`` field makes a *multi-run* recipe: a cell is ``runs`` seeded runs
(``<out>/run_NN``) and :class:`Reporting` picks the best on validation and summarises them
(the defaults are in :mod:`structattn.recipes.tables`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from .tables import best_on_validation, best_run_scores, scores_table

if TYPE_CHECKING:
    from ..training import TrainConfig

__all__ = [
    "RESUMABLE",
    "GridAxis",
    "NoOptions",
    "Preset",
    "Recipe",
    "RecipeConfig",
    "Record",
    "Reporting",
    "Results",
    "Tools",
]


class RecipeConfig(Protocol):
    """What the runner reads of every recipe's config: a dataclass with training settings."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]  # a dataclass

    @property
    def train(self) -> TrainConfig: ...


C = TypeVar("C", bound=RecipeConfig)  # a recipe's config dataclass

#: a finished run's record (its ``done.json``)
Record = Mapping[str, Any]
#: ``reproduce``'s results: a cell's grid values -> its summary
Results = Mapping[tuple[Any, ...], Mapping[str, Any]]


@dataclass(frozen=True)
class Preset(Generic[C]):
    """A named config of a recipe (``--preset NAME``)."""

    config: C  # the recipe's config dataclass instance
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


@dataclass(frozen=True)
class NoOptions:
    """A command without flags of its own."""


@dataclass(frozen=True)
class Reporting(Generic[C]):
    """How a cell's runs are ranked and summarised, and how ``reproduce`` shows the grid::

    select(record) -> float                 a finished run's validation score (its
                                            done.json), higher is better
    summarize(config, records) -> dict      one cell's summary from its finished runs'
                                            records, best first (what the table shows)
    table(results) -> str                   our table beside the paper's, Markdown
    plots(results, out) -> [Path]           reproduce's result plots (skipped with a
                                            notice without matplotlib)
    """

    select: Callable[[Record], float] = best_on_validation  # ranks a cell's runs
    summarize: Callable[[C, Sequence[Record]], dict[str, Any]] = best_run_scores  # per cell
    table: Callable[[Results], str] | None = None  # None: scores_table(results, paper)
    paper: Mapping[str, Any] = field(default_factory=dict)  # the paper's table as JSON
    plots: Callable[[Results, Path], list[Path]] | None = None  # None: no plots
    reproduce_also: tuple[str, ...] = ()  # recipes `reproduce` runs too, into <out>/<name>

    def format_table(self, results: Results) -> str:
        """Our table beside the paper's (Markdown)."""
        return self.table(results) if self.table is not None else scores_table(results, self.paper)


@dataclass(frozen=True)
class Tools:
    """The commands besides ``train`` and ``reproduce``; one whose function is ``None`` is not
    generated. Each ``..._options`` is a dataclass whose fields are the command's flags::

        viz(checkpoint, options, out) -> [Path]     plots of a trained model; files written
        parse(run, sentences, device, options) -> [str]   one output per tokenised sentence
        data(options)                               writes a generated data set
    """

    eval_options: type = NoOptions  # the flags of `eval` (Recipe.evaluate's `options`)
    viz: Callable[[Path, Any, Path | None], list[Path]] | None = None  # `structattn viz`
    viz_options: type = NoOptions  # the flags of `viz`
    parse: Callable[[Path, Sequence[Sequence[str]], str, Any], list[str]] | None = None  # `parse`
    parse_options: type = NoOptions  # the flags of `parse`
    data: Callable[[Any], None] | None = None  # `structattn data`
    data_options: type = NoOptions  # the flags of `data`


def _viz_needs() -> dict[str, tuple[str, ...]]:
    return {"viz": ("matplotlib",)}


@dataclass(frozen=True)
class Recipe(Generic[C]):
    """A paper experiment as a record of functions (see the module docstring)."""

    name: str  # command-line name, e.g. "tree-transduction"
    summary: str  # one line: paper, section, what is measured
    config: type[C]  # config dataclass: paper defaults, `train: TrainConfig`, maybe `runs: int`
    presets: Mapping[str, Preset[C]]  # at least "paper", "cpu" and "quick"
    grid: tuple[GridAxis, ...]  # reproduce's grid; its last axis is the model variant
    train: Callable[[C, Path, bool], dict[str, Any]]  # (config, run_dir, resume) -> fit summary
    score: Callable[[C, Path], dict[str, Any]]  # (config, run_dir) -> {"valid", "test"}
    evaluate: Callable[[Path, Any, str, Path | None], str]  # (run, options, device, jsonl) -> text
    cell_dir: Callable[[C], str] | None = None  # config -> dir below --out (None: the variant)
    resumable: frozenset[str] = frozenset()  # what `--resume` may change besides RESUMABLE
    needs: Mapping[str, tuple[str, ...]] = field(default_factory=_viz_needs)  # command -> modules
    report: Reporting[C] = field(default_factory=Reporting)  # selection, summaries, tables, plots
    tools: Tools = field(default_factory=Tools)  # eval's flags; viz, parse, data commands

    def __post_init__(self) -> None:
        missing = {"paper", "cpu", "quick"} - set(self.presets)
        if missing:
            raise ValueError(f"recipe {self.name!r}: presets {sorted(missing)} are missing")
        names = {f.name for f in fields(self.config)}
        if not self.grid or any(axis.field not in names for axis in self.grid):
            raise ValueError(f"recipe {self.name!r}: every `grid` axis must name a config field")
        if "train" not in names:
            raise ValueError(f"recipe {self.name!r}: the config needs a `train: TrainConfig`")

    @property
    def variant(self) -> GridAxis:
        """The config field that selects the model and its values: the grid's last axis."""
        return self.grid[-1]

    @property
    def multi_run(self) -> bool:
        """A cell is ``config.runs`` seeded runs (``run_NN``): the config has a ``runs`` field."""
        return any(f.name == "runs" for f in fields(self.config))

    def cell(self, config: C) -> str:
        """The directory of ``config``'s cell below an output directory."""
        if self.cell_dir is not None:
            return self.cell_dir(config)
        return str(getattr(config, self.variant.field))
