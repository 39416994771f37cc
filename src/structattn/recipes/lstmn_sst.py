"""Recipe: sentiment classification on the Stanford Sentiment Treebank with LSTMNs (Cheng et
al. 2016, sec. 5.2, Table 2).

Models: ``lstm``, ``lstm-2`` (2 layers), ``lstmn``, ``lstmn-2``; the average of the top
layer's hidden vectors into a 2-layer ReLU classifier (dropout 0.5), memory (hidden) size
168, Adam 2e-3 (betas 0.9 / 0.999, L2 1e-4), batch 5. Fine-grained (5 classes, 8,544 / 1,101
/ 2,210 sentences) and binary (neutral sentences dropped, 6,920 / 872 / 1,821); the label is
the root's. Word embeddings start from GloVe (the paper's 840B 300-d is not available here:
``--embeddings PATH`` takes any GloVe-format file, the default is the shipped 6B 50-d, 10k
words; words without a vector get hashed Gaussian vectors) and the gradient of the rows with
a GloVe vector is scaled by 0.35 in the first epoch, as in the paper. Each cell trains
``runs`` seeds: the table shows the mean and standard deviation of the test accuracy over
them, and the run best on validation.

``phrases`` (default False) also trains on every labelled phrase of the training trees (the
paper does not say; the phrase set is 37x larger for fine-grained, 318,582 nodes, and 98,794
non-neutral ones for binary, hence the default on a CPU).
"""

from __future__ import annotations

import functools
import math
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.classification import (
    SST_BINARY_LABELS,
    SST_FINE_LABELS,
    ClassificationBatch,
    ClassificationExample,
    LabelVocabulary,
    WordVocabulary,
    default_classification_data_dir,
    make_batches,
    read_sst,
)
from ..data.embeddings import build_embedding_matrix, default_glove_path, read_word_vectors
from ..io import check_splits
from ..models.lstmn_text import SentenceClassifier
from ..training import Task, TrainConfig, fit, load_model_state
from . import runs
from .base import GridAxis, Preset, Recipe, Reporting, Tools
from .config import config_to_dict, replace_path
from .runs import load_vocabulary_run
from .tables import accuracy_metric, markdown_table, mean_std_text, seed_summary, valid_accuracy

__all__ = [
    "MODELS",
    "PAPER_TABLE2",
    "RECIPE",
    "LSTMNSSTConfig",
    "build_model",
    "evaluate",
    "load_splits",
    "load_trained",
    "score",
    "train",
]

MODELS = ("lstm", "lstm-2", "lstmn", "lstmn-2")
NAMES = {"lstm": "LSTM", "lstm-2": "2-layer LSTM", "lstmn": "LSTMN", "lstmn-2": "2-layer LSTMN"}
TASKS = ("fine", "binary")
#: Table 2 of Cheng et al. (2016): accuracy % (fine-grained, binary)
PAPER_TABLE2: dict[str, tuple[float, float]] = {
    "lstm": (46.4, 84.9),
    "lstm-2": (46.0, 86.3),
    "lstmn": (47.6, 86.3),
    "lstmn-2": (47.9, 87.0),
}
SPLIT_FILES = {"train": "train.txt", "valid": "dev.txt", "test": "test.txt"}

#: sec. 5.2: Adam 2e-3 (0.9, 0.999), L2 1e-4, per-sentence mean loss (epochs: not given)
PAPER_TRAIN = TrainConfig(
    epochs=10, lr=2e-3, optimizer="adam", weight_decay=1e-4, log_every=200, max_grad_norm=None
)


@dataclass(frozen=True)
class LSTMNSSTConfig:
    """Settings of the SST experiment (defaults: the paper's, sec. 5.2)."""

    model: Literal["lstm", "lstm-2", "lstmn", "lstmn-2"] = "lstmn"  # the variant
    task: Literal["fine", "binary"] = "fine"  # 5 classes, or 2 without the neutral sentences
    phrases: bool = False  # also train on every labelled phrase of the training trees
    hidden_size: int = 168  # hidden ("memory") size of every layer
    dropout: float = 0.5  # dropout of the classifier
    embeddings: str = ""  # GloVe-format file ("" = ../shared/data/glove/glove.6B.50d.10k.txt)
    glove_scale: float = 0.35  # gradient scale of the GloVe rows in the first epoch
    batch_size: int = 5  # sentences per batch
    data_dir: str = ""  # directory with train/dev/test.txt trees ("" = ../shared/data/sst/trees)
    train_size: int = 0  # use the first N training examples (0 = all; quick runs)
    eval_size: int = 0  # likewise for validation and test
    runs: int = 5  # seeded runs per cell (train.seed, train.seed + 1, ...)
    train: TrainConfig = field(default_factory=lambda: PAPER_TRAIN)  # Adam 2e-3, 10 epochs

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"`model` must be one of {MODELS}, got {self.model!r}")
        if self.task not in TASKS:
            raise ValueError(f"`task` must be one of {TASKS}, got {self.task!r}")
        for name in ("hidden_size", "batch_size", "runs"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if self.train_size < 0 or self.eval_size < 0:
            raise ValueError("`train_size` and `eval_size` must be >= 0")
        if not 0.0 <= self.dropout < 1.0 or self.glove_scale < 0:
            raise ValueError("`dropout` must be in [0, 1) and `glove_scale` >= 0")


# ---- data -----------------------------------------------------------------------------------
def load_splits(config: LSTMNSSTConfig) -> dict[str, list[ClassificationExample]]:
    """Train (with phrases if asked) / valid / test examples of the task, cut to the sizes."""
    directory = Path(config.data_dir) if config.data_dir else default_classification_data_dir(
        "sst"
    ) / "trees"  # fmt: skip
    splits = {}
    for split, name in SPLIT_FILES.items():
        phrases = config.phrases and split == "train"
        examples = list(_read_sst(str(directory / name), config.task, phrases))
        size = config.train_size if split == "train" else config.eval_size
        splits[split] = examples[:size] if size else examples
    check_splits(splits, f"SST ({config.task}) in {directory}")
    return splits


@functools.lru_cache(maxsize=8)
def _read_sst(path: str, task: str, phrases: bool) -> tuple[ClassificationExample, ...]:
    """:func:`read_sst`, once per process (runs, scoring and eval read the same files)."""
    return tuple(read_sst(path, task, phrases=phrases))  # type: ignore[arg-type]


def labels_of(task: str) -> LabelVocabulary:
    """The label vocabulary of ``task`` (ids = class numbers)."""
    return LabelVocabulary(SST_FINE_LABELS if task == "fine" else SST_BINARY_LABELS)


def _embedding_table(
    config: LSTMNSSTConfig, vocab: WordVocabulary, train: Sequence[ClassificationExample]
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """(table [V, D], GloVe rows [V] bool, coverage) for the vocabulary."""
    path = config.embeddings or default_glove_path()
    vectors = read_word_vectors(path, words=vocab.tokens)
    counts = Counter(t for ex in train for t in ex.tokens)
    matrix = build_embedding_matrix(vocab, vectors, counts=counts, seed=0)
    return matrix.weight, matrix.pretrained, matrix.coverage.to_dict()


def build_model(
    config: LSTMNSSTConfig, vocab_size: int, embed_dim: int, pretrained: Tensor | None = None
) -> SentenceClassifier:
    """The classifier of ``config.model`` (seeded by ``config.train.seed``)."""
    torch.manual_seed(config.train.seed)
    return SentenceClassifier(
        "lstmn" if config.model.startswith("lstmn") else "lstm",
        vocab_size,
        embed_dim,
        config.hidden_size,
        classes=len(labels_of(config.task)),
        num_layers=2 if config.model.endswith("-2") else 1,
        dropout=config.dropout,
        pretrained=pretrained,
    )


# ---- evaluation -----------------------------------------------------------------------------
@torch.no_grad()
def evaluate(
    model: SentenceClassifier,
    examples: Sequence[ClassificationExample],
    vocab: WordVocabulary,
    labels: LabelVocabulary,
    predictions: str | Path | None = None,
    batch_size: int = 50,
) -> dict[str, Any]:
    """Accuracy (%) and mean NLL of ``examples``; optionally the predictions JSONL
    ``{"index", "sentence", "gold", "predicted"}`` (label ids) in the examples' order."""
    if not examples:
        raise ValueError("no sentences to evaluate")
    model.eval()
    device = next(model.parameters()).device
    predicted = [0] * len(examples)
    total = 0.0
    for batch in make_batches(examples, vocab, labels, batch_size, order="sorted"):
        tokens, mask = batch.tokens.to(device), batch.mask.to(device)
        logits = model(tokens, mask)
        total += float(F.cross_entropy(logits, batch.labels.to(device), reduction="sum"))
        for i, p in zip(batch.indices.tolist(), logits.argmax(-1).tolist(), strict=True):
            predicted[i] = p
    gold = [labels.encode(ex.label) for ex in examples]
    correct = sum(p == g for p, g in zip(predicted, gold, strict=True))
    if predictions is not None:
        runs.write_jsonl(
            predictions,
            (
                {"index": ex.index, "sentence": " ".join(ex.tokens), "gold": g, "predicted": p}
                for ex, g, p in zip(examples, gold, predicted, strict=True)
            ),
        )
    return {
        "accuracy": 100.0 * correct / len(examples),
        "loss": total / len(examples),
        "sentences": len(examples),
    }


# ---- one run --------------------------------------------------------------------------------
def train(config: LSTMNSSTConfig, run_dir: str | Path, resume: bool = False) -> dict[str, Any]:
    """Train one run (seed ``config.train.seed``) into ``run_dir``; returns fit's summary."""
    run_dir = Path(run_dir)
    splits = load_splits(config)
    labels = labels_of(config.task)
    vocab = WordVocabulary.build(splits["train"])
    if resume:
        vocab = WordVocabulary.from_dict(
            load_model_state(run_dir, "checkpoint.pt")["extra"]["vocab"]
        )
    table, glove_rows, coverage = _embedding_table(config, vocab, splits["train"])
    model = build_model(config, len(vocab), table.shape[1], table)
    train_set, valid = splits["train"], splits["valid"]
    seed = config.train.seed
    bs = config.batch_size

    def batches(epoch: int) -> list[ClassificationBatch]:
        return list(
            make_batches(train_set, vocab, labels, bs, order="bucket", seed=seed * 1000 + epoch)
        )

    def collate(batch: Sequence[Any], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        # the loop hands us rows of a ClassificationBatch (see `rows` below)
        tokens = torch.stack([row[0] for row in batch]).to(device)
        lengths = torch.stack([row[1] for row in batch])
        width = max(int(lengths.max()), 1)
        mask = (torch.arange(width) < lengths[:, None]).to(device)
        return tokens[:, :width], mask, torch.stack([row[2] for row in batch]).to(device)

    def rows(epoch: int) -> list[list[tuple[Tensor, Tensor, Tensor]]]:
        return [
            list(zip(b.tokens.unbind(0), b.lengths.unbind(0), b.labels.unbind(0), strict=True))
            for b in batches(epoch)
        ]

    def loss(m: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, int, int]:
        tokens, mask, gold = batch
        n = gold.shape[0]
        return F.cross_entropy(m(tokens, mask), gold, reduction="sum"), n, n

    def validate(m: nn.Module) -> dict[str, float]:
        assert isinstance(m, SentenceClassifier)
        scores = evaluate(m, valid, vocab, labels)
        return {"metric": accuracy_metric(scores["accuracy"], scores["loss"]), **scores}

    def on_epoch_start(m: nn.Module, epoch: int) -> None:
        assert isinstance(m, SentenceClassifier)
        first = torch.where(glove_rows, config.glove_scale, 1.0)
        m.embedding.set_gradient_scale(first if epoch == 1 else 1.0)

    task = Task(
        model=model,
        batches=rows,
        collate=collate,
        loss=loss,
        validate=validate,
        config={"recipe": "lstmn-sst", **config_to_dict(config), "run_seed": seed},
        extra={"vocab": vocab.to_dict(), "embed_dim": int(table.shape[1]), "coverage": coverage},
        on_epoch_start=on_epoch_start,
    )
    name = config.train.name or f"{config.task} {config.model} seed {seed}"
    train_config = replace(config.train, name=name)
    return fit(task, train_config, run_dir, resume=resume)


def load_trained(
    run_dir: str | Path, device: str = "cpu"
) -> tuple[SentenceClassifier, WordVocabulary, LSTMNSSTConfig]:
    """The best model of a run directory (``model.pt``), its vocabulary and config."""
    model, vocab, config, _ = _load(run_dir, device)
    return model, vocab, config


def _load(
    run_dir: str | Path, device: str
) -> tuple[SentenceClassifier, WordVocabulary, LSTMNSSTConfig, dict[str, Any]]:
    """:func:`load_trained` and the checkpoint's ``extra`` (one read of ``model.pt``)."""
    return load_vocabulary_run(run_dir, device, "lstmn-sst", LSTMNSSTConfig, build_model)


def score(config: LSTMNSSTConfig, run_dir: str | Path) -> dict[str, Any]:
    """Validation and test accuracy of a trained run; writes ``test_predictions.jsonl``."""
    run_dir = Path(run_dir)
    model, vocab, _, extra = _load(run_dir, config.train.device)
    splits = load_splits(config)
    labels = labels_of(config.task)
    return {
        "valid": evaluate(model, splits["valid"], vocab, labels),
        "test": evaluate(model, splits["test"], vocab, labels, run_dir / "test_predictions.jsonl"),
        "coverage": extra.get("coverage"),
    }


def _summarize(config: LSTMNSSTConfig, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean and standard deviation of the test accuracy over the runs; the best run's."""
    return {"model": config.model, "task": config.task, **seed_summary(records)}


def _table(results: Mapping[tuple[Any, ...], Mapping[str, Any]]) -> str:
    """Accuracy per model and task: mean +- std over runs (best run on valid), paper's."""
    rows = []
    for cell, summary in results.items():
        task, model = (
            (str(cell[0]), str(cell[1])) if cell[0] in TASKS else (str(cell[1]), str(cell[0]))
        )
        paper = PAPER_TABLE2.get(model, (math.nan, math.nan))[0 if task == "fine" else 1]
        rows.append(
            [
                NAMES.get(model, model),
                task,
                mean_std_text(summary),
                f"{summary['test']['accuracy']:.1f}",
                f"{paper:.1f}",
            ]
        )
    header = ["Model", "task", "test acc. mean +- std (ours)", "best-on-valid run", "paper"]
    return markdown_table(header, rows)


def _plots(results: Mapping[tuple[Any, ...], Mapping[str, Any]], out: Path) -> list[Path]:
    from .. import viz

    written = []
    for index, task in enumerate(TASKS):
        cells = {str(c[1]): s for c, s in results.items() if c[0] == task}
        if not cells:
            continue
        models = [m for m in MODELS if m in cells]
        try:
            written.append(
                viz.grouped_bars(
                    [NAMES[m] for m in models],
                    {"ours (mean)": [cells[m]["test_mean"] for m in models]},
                    out / f"sst_{task}.png",
                    reference={"ours (mean)": [PAPER_TABLE2[m][index] for m in models]},
                    title=f"SST {task}: test accuracy (bars: ours; ticks: paper)",
                )
            )
        except ImportError as error:
            print(f"no plots: {error}", file=sys.stderr)
            break
    return written


# ---- command-line options, viz -------------------------------------------------------------------
@dataclass(frozen=True)
class EvalOptions:
    """``structattn eval lstmn-sst``'s own flags."""

    split: Literal["train", "valid", "test"] = "test"  # the split to score


@dataclass(frozen=True)
class VizOptions:
    """``structattn viz lstmn-sst``'s own flags."""

    sentence: int = 0  # test sentence number (0-based, file order)


def _evaluate(run_dir: Path, options: EvalOptions, device: str, predictions: Path | None) -> str:
    model, vocab, config = load_trained(run_dir, device)
    examples = load_splits(config)[options.split]
    result = evaluate(model, examples, vocab, labels_of(config.task), predictions)
    return (
        f"SST {config.task} {config.model} ({options.split}, {result['sentences']} sentences): "
        f"accuracy {result['accuracy']:.1f}%"
    )


def _viz(checkpoint: Path, options: VizOptions, out: Path | None) -> list[Path]:
    """The intra-attention of the top layer over one test sentence (LSTMN models)."""
    from .. import viz

    model, vocab, config = load_trained(runs.resolve_run(RECIPE, checkpoint))
    if model.encoder.kind != "lstmn":
        raise ValueError(f"a {config.model} model has no intra-attention (use an LSTMN run)")
    examples = load_splits(config)["test"]
    if not 0 <= options.sentence < len(examples):
        raise ValueError(f"`sentence` must be in 0..{len(examples) - 1}")
    ex = examples[options.sentence]
    tokens = torch.tensor([vocab.encode(ex.tokens)])
    with torch.no_grad():
        encoded = model.encode(tokens, torch.ones_like(tokens, dtype=torch.bool))
        predicted = int(model(tokens, torch.ones_like(tokens, dtype=torch.bool)).argmax(-1))
    assert encoded.attention is not None
    words = list(ex.tokens)
    path = (out or checkpoint) / f"sst_attention_test_{options.sentence}.png"
    guess = labels_of(config.task).decode(predicted)
    title = f"{NAMES[config.model]}, gold {ex.label}, predicted {guess}"
    return [viz.attention_heatmap(encoded.attention[0, -1], words, words, path, title=title)]


#: 3 epochs: the whole table (2 tasks x 4 models x 3 seeds) measured 67 core-minutes,
#: about 35 minutes on 2 cores (docs/results/lstmn.md)
_CPU = replace_path(LSTMNSSTConfig(runs=3), {"train.epochs": 3})
_QUICK = replace_path(
    LSTMNSSTConfig(runs=2, hidden_size=8, train_size=30, eval_size=20, batch_size=10),
    {"train.epochs": 1, "train.progress": False, "train.log_every": 10},
)

RECIPE = Recipe(
    name="lstmn-sst",
    summary="LSTMN 5.2, Table 2: SST sentiment, fine-grained and binary, LSTM vs LSTMN",
    config=LSTMNSSTConfig,
    presets={
        "paper": Preset(LSTMNSSTConfig(), "sec. 5.2: hidden 168, Adam 2e-3, batch 5, 5 seeds"),
        "cpu": Preset(_CPU, "the paper's settings, 3 epochs, 3 seeds per cell"),
        "quick": Preset(_QUICK, "seconds: 30 sentences, tiny model, 2 seeds"),
    },
    grid=(GridAxis("tasks", "task", TASKS), GridAxis("models", "model", MODELS)),
    train=train,
    score=score,
    evaluate=_evaluate,
    cell_dir=lambda config: f"{config.task}/{config.model}",
    report=Reporting(
        select=valid_accuracy,
        summarize=_summarize,
        table=_table,
        paper={
            "source": "Cheng et al. 2016, Table 2 (accuracy %, fine-grained / binary)",
            **{m: {"fine": v[0], "binary": v[1]} for m, v in PAPER_TABLE2.items()},
        },
        plots=_plots,
    ),
    tools=Tools(eval_options=EvalOptions, viz=_viz, viz_options=VizOptions),
)
