"""Recipe: natural language inference with syntactic attention (Kim et al. 2017, sec. 4.4,
Table 5 and Appendix A.5).

Decomposable attention (Parikh et al. 2016; :class:`~structattn.models.DecomposableAttention`)
over fixed, unit-normalised GloVe vectors (unknown words hashed to one of 100 Gaussian
vectors, :mod:`structattn.data.embeddings`), with five variants of the input representation:

* ``none``: the words alone;
* ``hard-parent``: [x_j; x_head(j)] with heads from a trained ``parser`` run (pipeline);
* ``simple``: softmax intra-sentence attention over the parsing BiLSTM's scores;
* ``structured``: soft parents from a projective dependency-tree CRF (syntactic attention);
* ``pretrained``: ``structured`` with the projection, ROOT vector and arc scorer taken from a
  trained ``parser`` run, then trained end to end.

Data sets: ``sick`` (train TRAIN, select on TRIAL, report TEST) and ``snli-small`` (SNLI 1.0
dev as training data with 10% held out, SNLI test for the report; the SNLI training set is
not available here, so the numbers are not comparable with published SNLI results). Each cell
is ``runs`` seeded runs; the summary has the mean and spread of test accuracy over seeds, and
the table a paired bootstrap of each variant against ``none`` over the test pairs.
"""

from __future__ import annotations

import random
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.classification import (
    NLI_LABELS,
    ClassificationExample,
    LabelVocabulary,
    WordVocabulary,
    length_buckets,
)
from ..data.conllu import branching_heads, default_ud_data_dir, read_conllu, uas_beside_branching
from ..data.embeddings import EmbeddingMatrix, embedding_table
from ..data.nli import (
    EncodedPairs,
    load_nli_splits,
    nli_vocabulary,
    pair_sentences,
    write_nli_predictions,
)
from ..metrics import count_correct_runs
from ..models.nli import DecomposableAttention, forward_batch, predict_pairs, sentence_tree
from ..models.nli import induced_heads as model_induced_heads
from ..models.parser import copy_parser_layer, parse_sentences
from ..training import Task, TrainConfig, fit, load_model_state
from ..viz.nli import DATASETS, NAMES, PAPER_TABLE5, VARIANTS, format_table, plot_results
from . import runs
from ._parsing import epoch_seconds, load_parser_run, load_pretrained_layer
from .base import GridAxis, Preset, Recipe, Reporting, Tools
from .config import config_from_dict, config_to_dict, replace_path
from .tables import accuracy_metric, valid_accuracy

__all__ = [
    "PAPER_TABLE5",
    "RECIPE",
    "VARIANTS",
    "NLIConfig",
    "branching_heads",
    "build_model",
    "evaluate",
    "induced_heads",
    "load_data",
    "load_pretrained_parser",
    "load_trained",
    "prepare",
    "score",
    "syntax_report",
    "train",
]

#: Appendix A.5: Adagrad 0.05 (accumulator 0.1), 100 epochs, gradient norm 5, batch 32
PAPER_TRAIN = TrainConfig(
    epochs=100,
    lr=0.05,
    optimizer="adagrad",
    initial_accumulator_value=0.1,
    max_grad_norm=5.0,
    log_every=100,
)


@dataclass(frozen=True)
class NLIConfig:
    """Settings of the NLI experiment (defaults: the paper's, Appendix A.5)."""

    dataset: Literal["sick", "snli-small"] = "sick"  # data set (see the module docstring)
    attention: Literal["none", "hard-parent", "simple", "structured", "pretrained"] = (
        "structured"  # the variant
    )
    hidden_dim: int = 300  # projected inputs and every MLP (paper: 300)
    parser_dim: int = 50  # arc scorer's LSTM (per direction) and MLP size (A.1: 50)
    parser_layers: int = 1  # BiLSTM layers of the arc scorer (A.1: 1; `pretrained` needs the
    # parser run's)
    dropout: float = 0.2  # dropout of the MLPs
    init_std: float = 0.01  # trained parameters ~ N(0, init_std^2) (0: PyTorch's defaults)
    children: bool = False  # structured / pretrained: also concatenate the soft children
    batch_size: int = 32  # pairs per batch
    runs: int = 1  # seeded runs per cell (train.seed, train.seed + 1, ...)
    data_dir: str = ""  # folder of SICK.txt or the SNLI s1/s2/labels files ("": shared data)
    embeddings: str = ""  # GloVe-format vectors ("": ../shared/data/glove/glove.6B.50d.10k.txt)
    normalize_embeddings: bool = True  # unit-normalise the pretrained vectors
    unknown_buckets: int = 100  # words without a vector: one of this many N(0, 1) vectors
    parser: str = ""  # a trained `parser` run (hard-parent: its heads; pretrained: its scorer)
    pretrained_parser: str = ""  # pretrained: the parser run whose scorer starts the layer
    # ("": `parser`); best one trained on the fixed word vectors alone (no --word-min-count,
    # --char-dim, --upos), the only inputs the NLI layer has
    max_train: int = 0  # use only the first this many training pairs (0: all)
    valid_fraction: float = 0.1  # snli-small: share of SNLI dev held out for validation
    train: TrainConfig = field(default_factory=lambda: PAPER_TRAIN)  # optimisation

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"`dataset` must be one of {DATASETS}, got {self.dataset!r}")
        if self.attention not in VARIANTS:
            raise ValueError(f"`attention` must be one of {VARIANTS}, got {self.attention!r}")
        for name in ("hidden_dim", "parser_dim", "parser_layers", "batch_size", "runs"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.dropout < 1 or self.init_std < 0 or self.max_train < 0:
            raise ValueError("`dropout` must be in [0, 1), `init_std` and `max_train` >= 0")
        if not 0 < self.valid_fraction < 1:
            raise ValueError(f"`valid_fraction` must be in (0, 1), got {self.valid_fraction}")
        if self.children and self.attention not in ("structured", "pretrained"):
            raise ValueError("`children` needs attention structured or pretrained")


# ---- data -----------------------------------------------------------------------------------
def load_data(config: NLIConfig) -> dict[str, list[ClassificationExample]]:
    """``{"train", "valid", "test"}`` pairs of ``config.dataset`` (``max_train`` applied;
    :func:`~structattn.data.nli.load_nli_splits`)."""
    return load_nli_splits(config.dataset, config.data_dir, config.max_train, config.valid_fraction)


# ---- model ----------------------------------------------------------------------------------
def build_model(config: NLIConfig, table: Tensor, seed: int | None = None) -> DecomposableAttention:
    """The model of ``config`` over the fixed ``table`` [V, E], initialised N(0, init_std^2)."""
    torch.manual_seed(config.train.seed if seed is None else seed)
    intra = "structured" if config.attention == "pretrained" else config.attention
    model = DecomposableAttention(
        table,
        config.hidden_dim,
        len(NLI_LABELS),
        intra,
        config.parser_dim,
        config.dropout,
        config.children,
        config.parser_layers,
    )
    if config.init_std > 0:
        model.init_normal(config.init_std)
    return model


def _parser_run(config: NLIConfig) -> str:
    """The parser run the variant reads: ``pretrained_parser`` (or ``parser``) for
    pretrained, ``parser`` for hard-parent."""
    if config.attention == "pretrained" and config.pretrained_parser:
        return config.pretrained_parser
    return config.parser


def _needs_parser(config: NLIConfig) -> None:
    run = _parser_run(config)
    if config.attention in ("hard-parent", "pretrained") and not (run and Path(run).exists()):
        raise ValueError(
            f"no parser run at {run!r}: "
            f"attention={config.attention} needs a trained parser: run `structattn train "
            "parser --out RUN` first and pass --parser RUN"
            + (" (or --pretrained-parser RUN)" if config.attention == "pretrained" else "")
        )


def load_pretrained_parser(model: DecomposableAttention, config: NLIConfig) -> None:
    """Copy the projection, ROOT vector and arc scorer of the ``pretrained_parser`` (or
    ``parser``) run into ``model`` (the ``pretrained`` variant); errors when the sizes or
    embeddings differ. The parser's own inputs (trained word vectors, character CNN, UPOS
    vectors) have no counterpart in the NLI layer and are not loaded: its scorer then reads
    the projected fixed vectors alone, which such a parser was not trained on (a warning
    says so; the 85.6-UAS cpu parser's scorer parses EWT dev at 18.4 UAS that way)."""
    parser = load_pretrained_layer(
        _parser_run(config),
        config.hidden_dim,
        config.parser_dim,
        config.parser_layers,
        config.embeddings,
        config.normalize_embeddings,
        config.unknown_buckets,
    )
    copy_parser_layer(model, parser)


def pipeline_heads(
    config: NLIConfig, splits: Mapping[str, Sequence[ClassificationExample]]
) -> dict[tuple[str, ...], list[int]] | None:
    """hard-parent: the heads (0 = ROOT, 1-based) of every sentence of ``splits`` from the
    parser run ``config.parser`` (Eisner MAP trees); ``None`` for the other variants."""
    if config.attention != "hard-parent":
        return None
    parser, _, parser_config = load_parser_run(config.parser, config.train.device)
    unique = sorted({s for split in splits.values() for s in pair_sentences(split)})
    heads = parse_sentences(parser, parser_config, unique, config.train.device)
    return dict(zip(unique, heads, strict=True))


# ---- evaluation -------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(
    model: DecomposableAttention,
    encoded: EncodedPairs,
    device: torch.device | str = "cpu",
    batch_size: int = 256,
    predictions: str | Path | None = None,
) -> dict[str, Any]:
    """Accuracy (%), mean NLL and per-pair correctness (a string of 0/1 in example order) of
    ``encoded``; optionally writes ``predictions`` (JSONL: index, premise, hypothesis, gold,
    predicted)."""
    predicted, total = predict_pairs(model, encoded, torch.device(device), batch_size)
    correct = [int(p == g) for p, g in zip(predicted, encoded.labels, strict=True)]
    if predictions is not None:
        write_nli_predictions(predictions, encoded.examples, predicted)
    n = max(len(encoded), 1)
    return {
        "accuracy": 100.0 * sum(correct) / n,
        "loss": total / n,
        "pairs": len(encoded),
        "correct": "".join(map(str, correct)),
    }


# ---- one run ---------------------------------------------------------------------------------
def prepare(
    config: NLIConfig, words: WordVocabulary | None = None
) -> tuple[dict[str, list[ClassificationExample]], WordVocabulary, EmbeddingMatrix]:
    """The splits, the vocabulary (built from them unless given) and the fixed embedding
    table of a run."""
    _needs_parser(config)
    splits = load_data(config)
    words = words or nli_vocabulary(splits)
    counts = Counter(t for s in pair_sentences(splits["train"]) for t in s)
    table = embedding_table(
        words, config.embeddings, config.normalize_embeddings, config.unknown_buckets, counts
    )
    return splits, words, table


def train(config: NLIConfig, run_dir: str | Path, resume: bool = False) -> dict[str, Any]:
    """Train one run (seed ``config.train.seed``) into ``run_dir``; returns fit's summary."""
    run_dir = Path(run_dir)
    seed = config.train.seed
    words = None
    if resume:
        saved = load_model_state(run_dir, "checkpoint.pt")
        words = WordVocabulary.from_dict(saved["extra"]["vocab"])
    splits, words, table = prepare(config, words)
    labels = LabelVocabulary(NLI_LABELS)
    model = build_model(config, table.weight, seed)
    if config.attention == "pretrained":
        load_pretrained_parser(model, config)
    heads = pipeline_heads(config, splits)
    device = torch.device(config.train.device)
    train_set = EncodedPairs(splits["train"], words, labels, heads)
    valid_set = EncodedPairs(splits["valid"], words, labels, heads)

    def batches(epoch: int) -> list[list[int]]:
        # shuffled, then sorted by length within buckets of 50 batches (less padding)
        rng = random.Random(seed * 100_003 + epoch)
        lengths = [len(p) for p in train_set.premise]
        return length_buckets(lengths, config.batch_size, rng)

    def loss(m: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int, int]:
        logits = forward_batch(m, batch).logits
        n = int(batch["labels"].shape[0])
        return F.cross_entropy(logits, batch["labels"], reduction="sum"), n, n

    def validate(m: nn.Module) -> dict[str, float]:
        assert isinstance(m, DecomposableAttention)
        scores = evaluate(m, valid_set, device)
        # accuracy first, the NLL breaks ties (it stays below one accuracy step)
        metric = accuracy_metric(scores["accuracy"] / 100, scores["loss"])
        return {"metric": metric, "accuracy": scores["accuracy"], "loss": scores["loss"]}

    task = Task(
        model=model,
        batches=batches,
        collate=train_set.batch,
        loss=loss,
        validate=validate,
        config={"recipe": "nli", **config_to_dict(config), "run_seed": seed},
        extra={"vocab": words.to_dict(), "coverage": table.coverage.to_dict()},
    )
    name = config.train.name or f"{config.dataset} {config.attention} seed {seed}"
    return fit(task, replace(config.train, name=name), run_dir, resume=resume)


def load_trained(
    checkpoint: str | Path, device: str = "cpu"
) -> tuple[DecomposableAttention, WordVocabulary, NLIConfig]:
    """The best model of a run directory, or of a cell (its best run on validation)."""
    path = Path(checkpoint)
    if path.is_dir():
        path = runs.resolve_run(RECIPE, path)
    state = load_model_state(path)
    if state["config"].get("recipe") != "nli":
        raise ValueError(f"{path} is not an nli run (recipe {state['config'].get('recipe')!r})")
    config = config_from_dict(NLIConfig, state["config"])
    words = WordVocabulary.from_dict(state["extra"]["vocab"])
    table = state["model"]["embed.weight"]
    model = build_model(config, table)
    model.load_state_dict(state["model"])
    return model.to(device).eval(), words, config


def score(config: NLIConfig, run_dir: str | Path) -> dict[str, Any]:
    """Validation and test scores of a trained run; writes ``test_predictions.jsonl``."""
    run_dir = Path(run_dir)
    model, words, _ = load_trained(run_dir, config.train.device)
    splits = load_data(config)
    heads = pipeline_heads(config, splits)
    labels = LabelVocabulary(NLI_LABELS)
    device = config.train.device
    valid = evaluate(model, EncodedPairs(splits["valid"], words, labels, heads), device)
    valid.pop("correct")
    test = evaluate(
        model,
        EncodedPairs(splits["test"], words, labels, heads),
        device,
        predictions=run_dir / "test_predictions.jsonl",
    )
    test["seconds_per_epoch"] = epoch_seconds(run_dir)
    test["coverage"] = load_model_state(run_dir)["extra"].get("coverage")
    return {"valid": valid, "test": test}


def _select(record: Mapping[str, Any]) -> float:
    return valid_accuracy(record, scale=0.01)


def _summarize(config: NLIConfig, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean and spread of test accuracy over the runs; per-pair correctness averaged over the
    runs (for the paired bootstrap between variants)."""
    accs = [float(r["test"]["accuracy"]) for r in records]
    per_epoch = [r["test"].get("seconds_per_epoch") for r in records]
    per_epoch_known = [s for s in per_epoch if s is not None]
    return {
        "dataset": config.dataset,
        "attention": config.attention,
        "accuracy_mean": statistics.fmean(accs),
        "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
        "accuracies": accs,
        "best_valid_run_accuracy": accs[0],
        "valid_accuracy_mean": statistics.fmean(float(r["valid"]["accuracy"]) for r in records),
        "seconds_per_epoch": statistics.fmean(per_epoch_known) if per_epoch_known else None,
        "coverage": records[0]["test"].get("coverage"),
        # per test pair, how many runs got it right, as one base-36 digit (at most 35 runs)
        "correct_runs": count_correct_runs([r["test"]["correct"] for r in records]),
    }


def _cell_dir(config: NLIConfig) -> str:
    return f"{config.dataset}/{config.attention}"


# ---- parses ----------------------------------------------------------------------------------
SAMPLE = "The men are fighting outside a deli ."


@dataclass(frozen=True)
class VizOptions:
    """``structattn viz nli``'s own flags (the paper's parse of a sentence)."""

    sentence: str = SAMPLE  # a tokenised sentence (spaces between tokens)


def visualize(checkpoint: str | Path, sentence: str, out: str | Path | None = None) -> list[Path]:
    """The Viterbi parse (dark arcs) and arc marginals (grey) of ``sentence`` from the model's
    syntactic attention layer; ``hard-parent`` / ``none`` models have none to draw."""
    from .. import viz

    model, words, config = load_trained(checkpoint)
    if model.syntactic is None:
        raise ValueError(f"a {config.attention} model has no intra-sentence attention to draw")
    tokens = sentence.split()
    if not tokens:
        raise ValueError("the sentence has no tokens")
    ids = torch.tensor([words.encode(tokens)])  # [1, N]
    mask = torch.ones_like(ids, dtype=torch.bool)
    heads, marginals = sentence_tree(model, ids, mask)  # [N+1] (-1 at ROOT), [N+1, N+1]
    folder = Path(out) if out else Path(checkpoint)
    path = folder / f"parse_{config.attention}.png"
    return [
        viz.dependency_arcs(
            heads[0].tolist(),
            ["$", *tokens],
            path,
            marginals=marginals[0],
            title=f"{NAMES[config.attention]} ({config.dataset}): Viterbi parse and marginals",
        )
    ]


def _viz(checkpoint: Path, options: VizOptions, out: Path | None) -> list[Path]:
    return visualize(checkpoint, options.sentence, out)


def induced_heads(
    model: DecomposableAttention,
    config: NLIConfig,
    sentences: Sequence[Sequence[str]],
    batch_size: int = 128,
) -> list[list[int]]:
    """The Viterbi trees (heads, 0 = ROOT) of the model's syntactic attention layer on any
    tokenised sentences (their words get vectors by the run's embedding settings)."""
    if model.syntactic is None:
        raise ValueError(f"a {config.attention} model has no syntactic attention layer")
    return model_induced_heads(
        model,
        sentences,
        config.embeddings,
        config.normalize_embeddings,
        config.unknown_buckets,
        batch_size,
    )


def syntax_report(
    checkpoint: str | Path, ewt_dir: str = "", split: str = "dev", initial: bool = False
) -> dict[str, Any]:
    """UAS (%, punctuation included and excluded) of the model's induced trees against the
    gold trees of EWT ``split``, beside right- and left-branching chains. ``initial``: the
    pretrained variant's layer before NLI training (the parser run's weights)."""
    model, _, config = load_trained(checkpoint)
    if initial:
        if config.attention != "pretrained":
            raise ValueError("`initial` needs a pretrained run")
        load_pretrained_parser(model, config)
    folder = Path(ewt_dir) if ewt_dir else default_ud_data_dir()
    sentences = read_conllu(folder / f"en_ewt-ud-{split}.conllu")
    sentences = [s for s in sentences if len(s) > 0]
    heads = induced_heads(model, config, [s.words for s in sentences])
    return uas_beside_branching(sentences, heads)


@dataclass(frozen=True)
class EvalOptions:
    """``structattn eval nli``'s own flags."""

    split: Literal["train", "valid", "test"] = "test"  # the split to score
    data_dir: str | None = field(default=None, metadata={"help": "default: the run's"})
    ewt: bool = False  # also: UAS of the induced trees on EWT dev (structured / simple models)
    initial: bool = False  # with --ewt on a pretrained run: its layer before NLI training


def _evaluate(run_dir: Path, options: EvalOptions, device: str, predictions: Path | None) -> str:
    model, words, config = load_trained(run_dir, device)
    if options.data_dir:
        config = replace(config, data_dir=options.data_dir)
    splits = load_data(config)
    heads = pipeline_heads(config, splits)
    encoded = EncodedPairs(splits[options.split], words, LabelVocabulary(NLI_LABELS), heads)
    scores = evaluate(model, encoded, device, predictions=predictions)
    text = (
        f"{config.dataset} {config.attention} ({options.split}, {scores['pairs']} pairs): "
        f"accuracy {scores['accuracy']:.2f}%  loss {scores['loss']:.4f}"
    )
    if options.ewt:
        report = syntax_report(run_dir, initial=options.initial)
        for name in ("model", "right-branching", "left-branching"):
            r = report[name]
            text += (
                f"\nEWT dev UAS ({report['sentences']} sentences), {name}: {r['uas']:.1f}% "
                f"(without punctuation {r['uas_no_punct']:.1f}%)"
            )
    return text


# ---- presets and the record -------------------------------------------------------------------
#: what fits 2 CPU cores: hidden 100, Adam 1e-3 from PyTorch's initialisation (the paper's
#: N(0, 0.01) with Adagrad 0.05 stays at the majority class for 12+ epochs on SICK's 4.4k
#: pairs), 25 epochs, 3 seeds; the parser of `structattn train parser --preset cpu`, whose
#: 3-layer scorer the syntactic layer copies (the paper's A.1 has 1 layer)
_CPU = replace_path(
    NLIConfig(hidden_dim=100, runs=3, init_std=0.0, parser="runs/parser/non-projective",
              parser_layers=3),
    {"train.epochs": 25, "train.log_every": 50, "train.optimizer": "adam", "train.lr": 1e-3,
     "train.initial_accumulator_value": 0.0},
)  # fmt: skip
_QUICK = replace_path(
    NLIConfig(hidden_dim=16, parser_dim=8, max_train=64, runs=1),
    {"train.epochs": 1, "train.progress": False, "train.log_every": 10},
)

RECIPE = Recipe(
    name="nli",
    summary="SAN 4.4, Table 5: NLI (decomposable attention) with none / hard-parent / simple "
    "/ structured / pretrained intra-sentence attention, on SICK or SNLI dev",
    config=NLIConfig,
    presets={
        "paper": Preset(
            NLIConfig(parser="runs/parser/non-projective"),
            "Appendix A.5: hidden 300, 100 epochs of Adagrad 0.05",
        ),
        "cpu": Preset(
            _CPU,
            "hidden 100, a 3-layer arc scorer (the parser cpu preset's), 25 epochs of Adam "
            "1e-3, 3 seeds per variant (SICK)",
        ),
        "quick": Preset(_QUICK, "seconds: 64 training pairs, 1 epoch, tiny model"),
    },
    grid=(
        GridAxis("datasets", "dataset", ("sick",)),
        GridAxis("variants", "attention", VARIANTS),
    ),
    train=train,
    score=score,
    evaluate=_evaluate,
    cell_dir=_cell_dir,
    report=Reporting(
        select=_select,
        summarize=_summarize,
        table=format_table,
        paper={"source": "Kim et al. 2017, Table 5 (SNLI test accuracy %)", "cells": PAPER_TABLE5},
        plots=plot_results,
    ),
    tools=Tools(eval_options=EvalOptions, viz=_viz, viz_options=VizOptions),
)
