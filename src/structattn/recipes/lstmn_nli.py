"""Recipe: natural language inference with LSTMNs, shallow and deep attention fusion (Cheng et
al. 2016, sec. 5.3, Table 3).

Models (:class:`~structattn.models.lstmn_text.PairClassifier`): ``lstm`` (two LSTM encoders),
``lstm-attention`` (Rocktaschel et al.'s word-by-word attention with conditional encoding:
the hypothesis LSTM starts from the premise's final state, the attended premise is carried
from word to word; its tape ``tanh(W^p r_t + W^x h_t)`` is averaged like the others), ``lstmn``,
``lstmn-shallow`` and ``lstmn-deep`` (an LSTMN premise encoder and an LSTMN decoder reading
the hypothesis with inter-attention; deep fusion writes the attended premise memory into the
hypothesis memory). The average of each hidden tape, concatenated, goes to a 2-layer ReLU
classifier; Adam 1e-3, batch 32, dropout 0.3 (the paper searched 0.1-0.4), hidden size 100
and 300 (``paper`` preset: also 450).

Data as the SAN NLI recipe (``nli``): ``sick`` (SICK TRAIN / TRIAL / TEST; the default) and
``snli-small`` (SNLI 1.0 dev as training data with 10% held out for validation, SNLI test;
the SNLI training set is not available here, so the numbers are not comparable with the
paper's SNLI table), read by :func:`~structattn.data.nli.load_nli_splits` as in ``nli``.
Embeddings: GloVe (:mod:`structattn.data.embeddings`, the shipped 6B 50-d file by default,
``--embeddings PATH``), words without a vector start from hashed N(0, 1) vectors; as in the
paper only those rows are updated in the first epoch, then every embedding. Each cell trains
``runs`` seeds (mean and spread in the table). ``viz`` draws the inter-attention of one test
pair.
"""

from __future__ import annotations

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
    NLI_LABELS,
    ClassificationExample,
    LabelVocabulary,
    WordVocabulary,
    make_batches,
)
from ..data.embeddings import build_embedding_matrix, read_word_vectors
from ..data.nli import load_nli_splits, write_nli_predictions
from ..models.lstmn_text import PAIR_MODELS, PairClassifier
from ..training import Task, TrainConfig, fit, load_model_state
from . import runs
from .base import GridAxis, Preset, Recipe, Reporting, Tools
from .config import config_to_dict, replace_path
from .runs import load_vocabulary_run
from .tables import accuracy_metric, markdown_table, mean_std_text, seed_summary, valid_accuracy

__all__ = [
    "PAPER_TABLE3",
    "RECIPE",
    "LSTMNNLIConfig",
    "build_model",
    "evaluate",
    "load_pairs",
    "load_trained",
    "score",
    "train",
]

MODELS = PAIR_MODELS
NAMES = {
    "lstm": "LSTM",
    "lstm-attention": "LSTM + attention",
    "lstmn": "LSTMN",
    "lstmn-shallow": "LSTMN shallow fusion",
    "lstmn-deep": "LSTMN deep fusion",
}
DATASETS = ("sick", "snli-small")
#: Table 3 of Cheng et al. (2016), SNLI test accuracy % by hidden size
PAPER_TABLE3: dict[str, dict[int, float]] = {
    "lstm": {100: 77.6},
    "lstm-attention": {100: 83.5},
    "lstmn": {100: 81.5},
    "lstmn-shallow": {100: 84.3, 300: 85.2, 450: 86.0},
    "lstmn-deep": {100: 84.5, 300: 85.7, 450: 86.3},
}

#: sec. 5.3: Adam 1e-3, batch 32 (epochs: not given)
PAPER_TRAIN = TrainConfig(epochs=10, lr=1e-3, optimizer="adam", log_every=100)


@dataclass(frozen=True)
class LSTMNNLIConfig:
    """Settings of the NLI experiment (defaults: the paper's, sec. 5.3, on SICK)."""

    model: Literal["lstm", "lstm-attention", "lstmn", "lstmn-shallow", "lstmn-deep"] = (
        "lstmn-deep"  # the variant
    )
    dataset: Literal["sick", "snli-small"] = "sick"  # data set (see the module docstring)
    hidden_size: int = 100  # hidden size of both readers (paper: 100, 300, 450)
    dropout: float = 0.3  # on the embeddings and in the classifier (paper: 0.1-0.4)
    embeddings: str = ""  # GloVe-format file ("" = ../shared/data/glove/glove.6B.50d.10k.txt)
    unknown_buckets: int = 100  # words without a vector start from one of this many N(0, 1)
    freeze_pretrained: bool = True  # epoch 1: update only the rows without a GloVe vector
    batch_size: int = 32  # pairs per batch
    data_dir: str = ""  # folder of SICK.txt or the SNLI s1/s2/labels files ("": shared data)
    valid_fraction: float = 0.1  # snli-small: share of SNLI dev held out for validation
    max_train: int = 0  # use only the first N training pairs (0 = all)
    max_eval: int = 0  # likewise for validation and test (0 = all; quick runs)
    runs: int = 3  # seeded runs per cell (train.seed, train.seed + 1, ...)
    train: TrainConfig = field(default_factory=lambda: PAPER_TRAIN)  # Adam 1e-3, 10 epochs

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"`model` must be one of {MODELS}, got {self.model!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"`dataset` must be one of {DATASETS}, got {self.dataset!r}")
        for name in ("hidden_size", "batch_size", "runs"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0 or self.max_train < 0 or self.max_eval < 0:
            raise ValueError("`dropout` must be in [0, 1), `max_train` and `max_eval` >= 0")
        if not 0 < self.valid_fraction < 1:
            raise ValueError(f"`valid_fraction` must be in (0, 1), got {self.valid_fraction}")


# ---- data -----------------------------------------------------------------------------------
def load_pairs(config: LSTMNNLIConfig) -> dict[str, list[ClassificationExample]]:
    """``{"train", "valid", "test"}`` pairs: the SAN NLI recipe's splits
    (:func:`structattn.data.nli.load_nli_splits`), validation and test cut to ``max_eval``."""
    splits = load_nli_splits(
        config.dataset, config.data_dir, config.max_train, config.valid_fraction
    )
    if config.max_eval:
        splits["valid"] = splits["valid"][: config.max_eval]
        splits["test"] = splits["test"][: config.max_eval]
    return splits


LABELS = LabelVocabulary(NLI_LABELS)


def build_model(
    config: LSTMNNLIConfig, vocab_size: int, embed_dim: int, pretrained: Tensor | None = None
) -> PairClassifier:
    """The classifier of ``config.model`` (seeded by ``config.train.seed``)."""
    torch.manual_seed(config.train.seed)
    return PairClassifier(
        config.model,
        vocab_size,
        embed_dim,
        config.hidden_size,
        classes=len(LABELS),
        dropout=config.dropout,
        pretrained=pretrained,
    )


def _tensors(batch: Any, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(premise, premise mask, hypothesis, hypothesis mask, labels) of a ClassificationBatch."""
    assert batch.pair is not None and batch.pair_mask is not None
    return (
        batch.tokens.to(device),
        batch.mask.to(device),
        batch.pair.to(device),
        batch.pair_mask.to(device),
        batch.labels.to(device),
    )


# ---- evaluation -----------------------------------------------------------------------------
@torch.no_grad()
def evaluate(
    model: PairClassifier,
    examples: Sequence[ClassificationExample],
    vocab: WordVocabulary,
    predictions: str | Path | None = None,
    batch_size: int = 100,
) -> dict[str, Any]:
    """Accuracy (%) and mean NLL; optionally the predictions JSONL of the SAN NLI recipe
    ``{"index", "premise", "hypothesis", "gold", "predicted"}`` (label names)."""
    if not examples:
        raise ValueError("no pairs to evaluate")
    model.eval()
    device = next(model.parameters()).device
    predicted = [0] * len(examples)
    total = 0.0
    for batch in make_batches(examples, vocab, LABELS, batch_size, order="sorted"):
        premise, pmask, hypothesis, hmask, gold = _tensors(batch, device)
        logits = model(premise, pmask, hypothesis, hmask)
        total += float(F.cross_entropy(logits, gold, reduction="sum"))
        for i, p in zip(batch.indices.tolist(), logits.argmax(-1).tolist(), strict=True):
            predicted[i] = p
    gold_ids = [LABELS.encode(ex.label) for ex in examples]
    correct = sum(p == g for p, g in zip(predicted, gold_ids, strict=True))
    if predictions is not None:
        write_nli_predictions(predictions, examples, predicted)
    return {"accuracy": 100.0 * correct / len(examples), "loss": total / len(examples),
            "pairs": len(examples)}  # fmt: skip


# ---- one run --------------------------------------------------------------------------------
def train(config: LSTMNNLIConfig, run_dir: str | Path, resume: bool = False) -> dict[str, Any]:
    """Train one run (seed ``config.train.seed``) into ``run_dir``; returns fit's summary."""
    run_dir = Path(run_dir)
    splits = load_pairs(config)
    vocab = WordVocabulary.build(splits["train"])
    if resume:
        saved = load_model_state(run_dir, "checkpoint.pt")
        vocab = WordVocabulary.from_dict(saved["extra"]["vocab"])
    vectors = read_word_vectors(config.embeddings or None, words=vocab.tokens)
    counts = Counter(t for ex in splits["train"] for s in (ex.tokens, ex.pair or ()) for t in s)
    matrix = build_embedding_matrix(
        vocab, vectors, counts=counts, unknown_buckets=config.unknown_buckets
    )
    model = build_model(config, len(vocab), matrix.weight.shape[1], matrix.weight)
    seed = config.train.seed
    valid = splits["valid"]

    def rows(epoch: int) -> list[list[tuple[Tensor, ...]]]:
        out: list[list[tuple[Tensor, ...]]] = []
        for b in make_batches(
            splits["train"],
            vocab,
            LABELS,
            config.batch_size,
            order="bucket",
            seed=seed * 1000 + epoch,
        ):
            assert b.pair is not None and b.pair_lengths is not None
            out.append(
                list(zip(b.tokens, b.lengths, b.pair, b.pair_lengths, b.labels, strict=True))
            )
        return out

    def collate(batch: Sequence[tuple[Tensor, ...]], device: torch.device) -> tuple[Tensor, ...]:
        def padded(ids: Sequence[Tensor], lengths: Tensor) -> tuple[Tensor, Tensor]:
            width = max(int(lengths.max()), 1)
            mask = torch.arange(width) < lengths[:, None]  # [B, W]
            return torch.stack(list(ids))[:, :width].to(device), mask.to(device)

        premise, pmask = padded([r[0] for r in batch], torch.stack([r[1] for r in batch]))
        hypothesis, hmask = padded([r[2] for r in batch], torch.stack([r[3] for r in batch]))
        return premise, pmask, hypothesis, hmask, torch.stack([r[4] for r in batch]).to(device)

    def loss(m: nn.Module, batch: tuple[Tensor, ...]) -> tuple[Tensor, int, int]:
        premise, pmask, hypothesis, hmask, gold = batch
        n = gold.shape[0]
        return F.cross_entropy(m(premise, pmask, hypothesis, hmask), gold, reduction="sum"), n, n

    def validate(m: nn.Module) -> dict[str, float]:
        assert isinstance(m, PairClassifier)
        scores = evaluate(m, valid, vocab)
        return {"metric": accuracy_metric(scores["accuracy"], scores["loss"]), **scores}

    def on_epoch_start(m: nn.Module, epoch: int) -> None:
        assert isinstance(m, PairClassifier)
        first = (~matrix.pretrained).float() if config.freeze_pretrained else 1.0
        m.embedding.set_gradient_scale(first if epoch == 1 else 1.0)

    coverage = matrix.coverage.to_dict()
    task = Task(
        model=model,
        batches=rows,
        collate=collate,
        loss=loss,
        validate=validate,
        config={"recipe": "lstmn-nli", **config_to_dict(config), "run_seed": seed},
        extra={"vocab": vocab.to_dict(), "embed_dim": int(matrix.weight.shape[1]),
               "coverage": coverage},
        on_epoch_start=on_epoch_start,
    )  # fmt: skip
    name = config.train.name or f"{config.dataset} {config.model} h{config.hidden_size} seed {seed}"
    return fit(task, replace(config.train, name=name), run_dir, resume=resume)


def load_trained(
    run_dir: str | Path, device: str = "cpu"
) -> tuple[PairClassifier, WordVocabulary, LSTMNNLIConfig]:
    """The best model of a run directory (``model.pt``), its vocabulary and config."""
    model, vocab, config, _ = _load(run_dir, device)
    return model, vocab, config


def _load(
    run_dir: str | Path, device: str
) -> tuple[PairClassifier, WordVocabulary, LSTMNNLIConfig, dict[str, Any]]:
    """:func:`load_trained` and the checkpoint's ``extra`` (one read of ``model.pt``)."""
    return load_vocabulary_run(run_dir, device, "lstmn-nli", LSTMNNLIConfig, build_model)


def score(config: LSTMNNLIConfig, run_dir: str | Path) -> dict[str, Any]:
    """Validation and test accuracy of a trained run; writes ``test_predictions.jsonl``."""
    run_dir = Path(run_dir)
    model, vocab, _, extra = _load(run_dir, config.train.device)
    splits = load_pairs(config)
    return {
        "valid": evaluate(model, splits["valid"], vocab),
        "test": evaluate(model, splits["test"], vocab, run_dir / "test_predictions.jsonl"),
        "coverage": extra.get("coverage"),
    }


def _summarize(config: LSTMNNLIConfig, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean and standard deviation of the test accuracy over the runs; the best run's."""
    return {
        "model": config.model,
        "dataset": config.dataset,
        "hidden_size": config.hidden_size,
        **seed_summary(records),
    }


def _table(results: Mapping[tuple[Any, ...], Mapping[str, Any]]) -> str:
    """Test accuracy per model and hidden size: mean +- std (best run on valid), paper's."""
    rows = []
    for _, s in results.items():
        model, hidden = str(s["model"]), int(s["hidden_size"])
        paper = PAPER_TABLE3.get(model, {}).get(hidden)
        rows.append(
            [
                NAMES.get(model, model),
                str(hidden),
                s["dataset"],
                mean_std_text(s),
                f"{s['test']['accuracy']:.1f}",
                "-" if paper is None else f"{paper:.1f}",
            ]
        )
    header = ["Model", "h", "data", "test acc. mean +- std (ours)", "best-on-valid run",
              "paper (SNLI)"]  # fmt: skip
    return markdown_table(header, rows)


def _plots(results: Mapping[tuple[Any, ...], Mapping[str, Any]], out: Path) -> list[Path]:
    from .. import viz

    cells = list(results.values())
    labels = [f"{NAMES[str(s['model'])]} h{s['hidden_size']}" for s in cells]
    try:
        return [
            viz.grouped_bars(
                labels,
                {"ours (mean)": [s["test_mean"] for s in cells]},
                out / "nli_accuracy.png",
                reference={
                    "ours (mean)": [
                        PAPER_TABLE3.get(str(s["model"]), {}).get(int(s["hidden_size"]))
                        for s in cells
                    ]
                },
                title="NLI test accuracy (bars: ours; ticks: paper, SNLI)",
            )
        ]
    except ImportError as error:
        print(f"no plots: {error}", file=sys.stderr)
        return []


# ---- command-line options, viz -------------------------------------------------------------------
@dataclass(frozen=True)
class EvalOptions:
    """``structattn eval lstmn-nli``'s own flags."""

    split: Literal["train", "valid", "test"] = "test"  # the split to score


@dataclass(frozen=True)
class VizOptions:
    """``structattn viz lstmn-nli``'s own flags."""

    pair: int = 0  # test pair number (0-based, file order)


def _evaluate(run_dir: Path, options: EvalOptions, device: str, predictions: Path | None) -> str:
    model, vocab, config = load_trained(run_dir, device)
    result = evaluate(model, load_pairs(config)[options.split], vocab, predictions)
    return (
        f"{config.dataset} {config.model} h{config.hidden_size} ({options.split}, "
        f"{result['pairs']} pairs): accuracy {result['accuracy']:.1f}%"
    )


def _viz(checkpoint: Path, options: VizOptions, out: Path | None) -> list[Path]:
    """The inter-attention (hypothesis word -> premise words) of one test pair."""
    from .. import viz

    model, vocab, config = load_trained(runs.resolve_run(RECIPE, checkpoint))
    if model.kind in ("lstm", "lstmn"):
        raise ValueError(f"a {config.model} model has no inter-attention (use a fusion model)")
    examples = load_pairs(config)["test"]
    if not 0 <= options.pair < len(examples):
        raise ValueError(f"`pair` must be in 0..{len(examples) - 1}")
    ex = examples[options.pair]
    premise = torch.tensor([vocab.encode(ex.tokens)])
    hypothesis = torch.tensor([vocab.encode(ex.pair or ())])
    ones = torch.ones_like
    with torch.no_grad():
        _, _, inter = model.encode(
            premise, ones(premise, dtype=torch.bool), hypothesis, ones(hypothesis, dtype=torch.bool)
        )
        logits = model(
            premise, ones(premise, dtype=torch.bool), hypothesis, ones(hypothesis, dtype=torch.bool)
        )
    assert inter is not None
    path = (out or checkpoint) / f"nli_inter_attention_test_{options.pair}.png"
    title = f"{NAMES[config.model]}: gold {ex.label}, predicted {NLI_LABELS[int(logits.argmax())]}"
    return [
        viz.attention_heatmap(inter[0], list(ex.pair or ()), list(ex.tokens), path, title=title)
    ]


HIDDEN_SIZES = (100, 300)
_CPU = replace_path(LSTMNNLIConfig(runs=2), {"train.epochs": 5})
_QUICK = replace_path(
    LSTMNNLIConfig(runs=1, hidden_size=8, max_train=40, max_eval=20, batch_size=10),
    {"train.epochs": 1, "train.progress": False, "train.log_every": 10},
)

RECIPE = Recipe(
    name="lstmn-nli",
    summary="LSTMN 5.3, Table 3: NLI (SICK / SNLI dev) with LSTM, LSTMN, shallow / deep fusion",
    config=LSTMNNLIConfig,
    presets={
        "paper": Preset(LSTMNNLIConfig(), "sec. 5.3: Adam 1e-3, batch 32, h 100 (grid 100-450)"),
        "cpu": Preset(_CPU, "the paper's settings on SICK, 5 epochs, 2 seeds per cell"),
        "quick": Preset(_QUICK, "seconds: 40 pairs, tiny model"),
    },
    grid=(
        GridAxis("sizes", "hidden_size", HIDDEN_SIZES),
        GridAxis("models", "model", MODELS),
    ),
    train=train,
    score=score,
    evaluate=_evaluate,
    cell_dir=lambda config: f"{config.dataset}/h{config.hidden_size}/{config.model}",
    report=Reporting(
        select=valid_accuracy,
        summarize=_summarize,
        table=_table,
        paper={
            "source": "Cheng et al. 2016, Table 3 (SNLI test accuracy %, by hidden size)",
            **{m: {str(h): v for h, v in row.items()} for m, row in PAPER_TABLE3.items()},
        },
        plots=_plots,
    ),
    tools=Tools(eval_options=EvalOptions, viz=_viz, viz_options=VizOptions),
)
