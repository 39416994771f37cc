"""Recipe: tree transduction, prefix -> infix (Kim et al. 2017, sec. 4.1 and Appendix A.2).

Config (paper values as defaults) -> data -> build -> train -> score / evaluate -> table,
plots; registered as ``tree-transduction`` (:data:`RECIPE`); the demo is its ``demo`` preset.
Metric: the average proportion of correct target tokens before the first error, per depth.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import SpanSelfAttentionOutput, SyntacticAttention
from ..data.batching import bucket_batches, pad_sequences
from ..data.tree_transduction import (
    Pair,
    Vocabulary,
    generate_splits,
    main_data,
    read_pairs,
    read_splits,
)
from ..models import StructuredSeq2Seq
from ..names import ATTENTION_VARIANTS, SELF_ATTENTION_VARIANTS, SelfAttentionVariant
from ..training import Task, TrainConfig, fit, load_model_state
from . import runs
from .base import GridAxis, Preset, Recipe, Reporting, Tools
from .config import config_from_dict, config_to_dict, replace_path

__all__ = [
    "PAPER_TABLE",
    "RECIPE",
    "SAMPLE_SOURCE",
    "TreeTransductionConfig",
    "build_model",
    "evaluate",
    "load_trained",
    "reproduce",
    "score",
    "train",
    "visualize",
]

#: Table 1 of the paper: depth -> (No Atten, Simple, Structured), % correct before first error
PAPER_TABLE: dict[int, tuple[float, float, float]] = {
    2: (7.6, 87.4, 99.2),
    3: (4.1, 49.6, 87.0),
    4: (2.8, 23.3, 64.5),
    5: (2.1, 15.0, 30.8),
    6: (1.5, 8.5, 18.2),
}
#: the encoders: the paper's three (:data:`PAPER_VARIANTS`, the columns of
#: :data:`PAPER_TABLE`) and "constituency" (self-attention over a TreeCRF's constituents)
VARIANTS = SELF_ATTENTION_VARIANTS
PAPER_VARIANTS = ATTENTION_VARIANTS
SAMPLE_SOURCE = "( * ( + ( + 15 7 ) 1 8 ) ( + 19 0 11 ) )"  # the paper's example (depth 3)

#: the paper's optimisation (Appendix A.2): SGD 1.0, clip 1, halving from epoch 9 or plateau
PAPER_TRAIN = TrainConfig(
    epochs=13, lr=1.0, max_grad_norm=1.0, decay_start=9, decay_on_plateau=True, log_every=50
)


@dataclass(frozen=True)
class TreeTransductionConfig:
    """Settings of the tree-transduction experiment (defaults: the paper's, Appendix A.2)."""

    attention: SelfAttentionVariant = "structured"  # encoder self-attention
    dim: int = 50  # l: embedding and LSTM size
    parser_hidden: int = 50  # size of each direction of the parsing biLSTM
    batch_size: int = 20  # sentences per batch
    init_range: float = 0.1  # parameters ~ U[-init_range, init_range]
    beam_size: int = 5  # beam search at test time
    data_dir: str = ""  # directory with train/valid/test.tsv ("" = generate with data_seed)
    data_seed: int = 0  # seed of the generated data set
    train_size: int = 0  # use a seeded subset of this many training pairs (0 = all)
    valid_size: int = 0  # likewise for validation (0 = all)
    test_size: int = 0  # score on every (n // test_size)-th test pair (0 = all)
    train: TrainConfig = field(default_factory=lambda: PAPER_TRAIN)  # epochs, lr, seed, ...

    def __post_init__(self) -> None:
        if self.attention not in VARIANTS:
            raise ValueError(f"`attention` must be one of {VARIANTS}, got {self.attention!r}")
        for name in ("dim", "parser_hidden", "batch_size", "beam_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        for name in ("train_size", "valid_size", "test_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}")
        if not self.init_range > 0:
            raise ValueError(f"`init_range` must be > 0, got {self.init_range}")
        if not isinstance(self.train, TrainConfig):
            raise ValueError(f"`train` must be a TrainConfig, got {type(self.train).__name__}")

    # read-only aliases of config.train.lr / .max_grad_norm for code written before the
    # optimisation settings moved into `train` (benchmarks/end_to_end.py)
    @property
    def lr(self) -> float:
        """``train.lr``."""
        return self.train.lr

    @property
    def max_grad_norm(self) -> float | None:
        """``train.max_grad_norm``."""
        return self.train.max_grad_norm


class Batch(NamedTuple):
    source: Tensor  # [B, N] ids, position 0 = '$'
    source_mask: Tensor  # [B, N]
    target_in: Tensor  # [B, T] '<s>' + target
    target_out: Tensor  # [B, T] target + '</s>' (0 = padding)


# ---- data ---------------------------------------------------------------------------------
def load_data(config: TreeTransductionConfig) -> dict[str, list[Pair]]:
    """Train/valid/test pairs from ``data_dir`` or generated from ``data_seed``."""
    if config.data_dir:
        splits = read_splits(config.data_dir)
    else:
        splits = generate_splits(seed=config.data_seed)
    rng = random.Random(config.train.seed)
    for name, size in (("train", config.train_size), ("valid", config.valid_size)):
        if size and size < len(splits[name]):
            splits[name] = rng.sample(splits[name], size)
    if config.test_size:
        splits["test"] = splits["test"][:: max(1, len(splits["test"]) // config.test_size)]
    return splits


def collate(pairs: Sequence[Pair], vocab: Vocabulary, device: torch.device) -> Batch:
    """Pad a list of pairs into a :class:`Batch` (the root symbol is prepended here)."""
    sources = [vocab.encode(["$", *p.source]) for p in pairs]
    targets = [vocab.encode(list(p.target)) for p in pairs]
    source = pad_sequences(sources, 0, device=device)  # [B, N]
    target_in = pad_sequences([[vocab.bos_id, *y] for y in targets], 0, device=device)
    target_out = pad_sequences([[*y, vocab.eos_id] for y in targets], 0, device=device)
    return Batch(source, source != vocab.pad_id, target_in, target_out)


def batches_for_epoch(
    pairs: Sequence[Pair], batch_size: int, seed: int, epoch: int
) -> list[list[Pair]]:
    """Length-bucketed batches in a random order fixed by (seed, epoch)."""
    return bucket_batches(pairs, batch_size, seed, epoch, lambda pair: len(pair.source))


# ---- model --------------------------------------------------------------------------------
def build_model(config: TreeTransductionConfig, vocab: Vocabulary) -> StructuredSeq2Seq:
    """The paper's model for ``config.attention``, initialised U[-init_range, init_range]."""
    torch.manual_seed(config.train.seed)
    model = StructuredSeq2Seq(
        len(vocab), config.dim, config.attention, config.parser_hidden, padding_idx=vocab.pad_id
    )
    for p in model.parameters():
        nn.init.uniform_(p, -config.init_range, config.init_range)
    return model


def sequence_loss(model: nn.Module, batch: Batch) -> tuple[Tensor, int, int]:
    """Summed token NLL, number of sentences, number of target tokens."""
    logits = model(batch.source, batch.source_mask, batch.target_in)
    loss = F.cross_entropy(
        logits.flatten(0, 1), batch.target_out.flatten(), ignore_index=0, reduction="sum"
    )
    return loss, batch.source.shape[0], int((batch.target_out != 0).sum())


def perplexity(
    model: nn.Module, pairs: Sequence[Pair], vocab: Vocabulary, device: torch.device
) -> float:
    """Teacher-forced per-token perplexity."""
    total, tokens = 0.0, 0
    for chunk in _chunks(pairs, 100):
        loss, _, n = sequence_loss(model, collate(chunk, vocab, device))
        total, tokens = total + float(loss), tokens + n
    return math.exp(total / max(tokens, 1))


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


# ---- metric -------------------------------------------------------------------------------
def correct_before_first_error(prediction: Sequence[str], target: Sequence[str]) -> float:
    """Proportion of target tokens predicted correctly before the first error (in [0, 1])."""
    if not target:
        return 1.0 if not prediction else 0.0
    correct = 0
    for p, t in zip(prediction, target, strict=False):
        if p != t:
            break
        correct += 1
    return correct / len(target)


def decode(
    model: StructuredSeq2Seq,
    pairs: Sequence[Pair],
    vocab: Vocabulary,
    device: torch.device,
    beam_size: int,
    batch_size: int = 50,
) -> list[tuple[list[str], float]]:
    """Beam-search predictions (tokens, log-probability) for every pair, in order."""
    model.eval()
    out: list[tuple[list[str], float]] = []
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i].source))
    results: dict[int, tuple[list[str], float]] = {}
    for chunk in _chunks(order, batch_size):
        batch = collate([pairs[i] for i in chunk], vocab, device)
        max_length = 2 * batch.source.shape[1] + 10
        beam = model.beam_search(
            batch.source, batch.source_mask, vocab.bos_id, vocab.eos_id, beam_size, max_length
        )
        for i, tokens, score in zip(chunk, beam.tokens, beam.scores.tolist(), strict=True):
            results[i] = (vocab.decode(tokens), score)
    out = [results[i] for i in range(len(pairs))]
    return out


def evaluate(
    model: StructuredSeq2Seq,
    pairs: Sequence[Pair],
    vocab: Vocabulary,
    device: torch.device | str = "cpu",
    beam_size: int = 5,
    predictions: str | Path | None = None,
) -> dict[str, Any]:
    """Per-depth % of target tokens correct before the first error (beam search)."""
    device = torch.device(device)
    decoded = decode(model, pairs, vocab, device, beam_size)
    per_depth: dict[int, list[float]] = defaultdict(list)
    records = []
    for pair, (prediction, score) in zip(pairs, decoded, strict=True):
        accuracy = correct_before_first_error(prediction, pair.target)
        per_depth[pair.depth].append(accuracy)
        records.append(
            {
                "source": " ".join(pair.source),
                "target": " ".join(pair.target),
                "prediction": " ".join(prediction),
                "score": score,
                "depth": pair.depth,
                "correct_before_first_error": accuracy,
            }
        )
    if predictions is not None:
        runs.write_jsonl(predictions, records)
    table = {d: 100.0 * sum(v) / len(v) for d, v in sorted(per_depth.items())}
    counts = {d: len(v) for d, v in sorted(per_depth.items())}
    overall = 100.0 * sum(sum(v) for v in per_depth.values()) / max(len(pairs), 1)
    return {"per_depth": table, "counts": counts, "overall": overall}


# ---- train / load -------------------------------------------------------------------------
def train(
    config: TreeTransductionConfig,
    run_dir: str | Path,
    resume: bool = False,
    splits: dict[str, list[Pair]] | None = None,
) -> dict[str, Any]:
    """Train one variant into ``run_dir`` (``fit``'s files); returns fit's summary."""
    run_dir = Path(run_dir)
    if resume:
        saved = load_model_state(run_dir, "checkpoint.pt")
        vocab = Vocabulary.from_dict(saved["extra"]["vocab"])
    splits = splits or load_data(config)
    if not resume:
        vocab = Vocabulary.build(splits["train"])  # unseen test tokens map to <unk>
    device = torch.device(config.train.device)
    model = build_model(config, vocab)
    valid = splits["valid"]

    def validate(m: nn.Module) -> dict[str, float]:
        ppl = perplexity(m, valid, vocab, device)
        return {"metric": -ppl, "perplexity": ppl}

    task = Task(
        model=model,
        batches=lambda epoch: batches_for_epoch(
            splits["train"], config.batch_size, config.train.seed, epoch
        ),
        collate=lambda pairs, dev: collate(pairs, vocab, dev),
        loss=sequence_loss,
        validate=validate,
        config={"recipe": "tree-transduction", **config_to_dict(config)},
        extra={"vocab": vocab.to_dict()},
    )
    train_config = config.train if config.train.name else replace(
        config.train, name=config.attention
    )  # fmt: skip
    return fit(task, train_config, run_dir, resume=resume)


def load_trained(
    run_dir: str | Path, device: str = "cpu"
) -> tuple[StructuredSeq2Seq, Vocabulary, TreeTransductionConfig]:
    """The best model of a run directory (``model.pt``, loaded with ``weights_only=True``),
    its vocabulary and config (also from runs saved before configs were nested)."""
    state = load_model_state(run_dir)
    saved = state["config"]
    if saved.get("recipe", "tree-transduction") != "tree-transduction":
        raise ValueError(f"{run_dir} is not a tree-transduction run ({saved.get('recipe')!r})")
    config = config_from_dict(TreeTransductionConfig, saved)
    vocab = Vocabulary.from_dict(state["extra"]["vocab"])
    model = build_model(config, vocab)
    model.load_state_dict(state["model"])
    return model.to(device).eval(), vocab, config


def score(config: TreeTransductionConfig, run_dir: str | Path) -> dict[str, Any]:
    """A trained run's validation perplexity (of its best epoch) and test scores (beam
    search); writes ``test_predictions.jsonl`` in the run directory."""
    run_dir = Path(run_dir)
    model, vocab, _ = load_trained(run_dir, config.train.device)
    valid = dict(load_model_state(run_dir)["valid"])
    test = load_data(config)["test"]
    scores = evaluate(
        model,
        test,
        vocab,
        config.train.device,
        config.beam_size,
        run_dir / "test_predictions.jsonl",
    )
    return {"valid": valid, "test": scores}


def _select(record: Mapping[str, Any]) -> float:
    """Lower validation perplexity is better."""
    return -float(record.get("valid", {}).get("perplexity", math.inf))


def _int_keys(table: Mapping[Any, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in table.items()}


def _summarize(
    config: TreeTransductionConfig, records: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    best = records[0]
    return {
        "attention": config.attention,
        "per_depth": _int_keys(best["test"]["per_depth"]),
        "counts": _int_keys(best["test"]["counts"]),
        "overall": best["test"]["overall"],
        "valid_perplexity": best["valid"].get("perplexity"),
        "best": best["train"].get("best", {}),
        "epochs": best["train"].get("epochs"),
        "seconds": best["seconds"],
    }


# ---- tables -------------------------------------------------------------------------------
def format_table(results: Mapping[str, Mapping[Any, float]], with_paper: bool = True) -> str:
    """Per-depth table of our numbers (and the paper's Table 1 beside them)."""
    variants = [v for v in VARIANTS if v in results]
    names = dict(none="No Atten", simple="Simple", structured="Structured")
    paper = [v for v in variants if v in PAPER_VARIANTS]
    ours = {v: _int_keys(results[v]) for v in variants}
    header = ["Depth", *(f"{names.get(v, v.title())} (ours)" for v in variants)]
    if with_paper:
        header += [f"{names.get(v, v)} (paper)" for v in paper]
    depths = sorted({d for r in ours.values() for d in r})
    rows = []
    for d in depths:
        row = [str(d)] + [f"{ours[v].get(d, float('nan')):.1f}" for v in variants]
        if with_paper:
            row += [
                f"{PAPER_TABLE[d][PAPER_VARIANTS.index(v)]:.1f}" if d in PAPER_TABLE else "-"
                for v in paper
            ]
        rows.append(row)
    return runs.markdown_table(header, rows)


def _table(results: Mapping[tuple[Any, ...], Mapping[str, Any]]) -> str:
    return format_table({key[0]: summary["per_depth"] for key, summary in results.items()})


def reproduce(
    config: TreeTransductionConfig,
    out_dir: str | Path,
    variants: Sequence[str] = VARIANTS,
    resume: bool = False,
    force: bool = False,
    jobs: int = 1,
) -> dict[str, Any]:
    """Train every variant on the same data, score it on the test set, write
    ``results.json`` and ``table.md``, print the table beside the paper's."""
    return runs.reproduce(
        RECIPE, config, out_dir, {"attention": list(variants)}, resume, force, jobs
    )


# ---- plots ----------------------------------------------------------------------------------
def _runs_in(checkpoint: str | Path) -> list[Path]:
    """The run directories under ``checkpoint``: itself, or its none/simple/structured runs."""
    root = Path(checkpoint)
    if (root / "model.pt").exists() or root.suffix == ".pt":
        return [root]
    runs = [root / v for v in VARIANTS if (root / v / "model.pt").exists()]
    if not runs:
        raise FileNotFoundError(f"no trained model (model.pt) in {root} or its variant folders")
    return runs


def visualize(checkpoint: str | Path, source: str, out_dir: str | Path | None = None) -> list[Path]:
    """Figure 3 of the paper for one source: each model's self-attention over parents (rows =
    words, columns = candidate parents, each row sums to one) and the structured model's
    MAP dependency parse with its arc marginals. Returns the files written."""
    from .. import viz
    from ..data.tree_transduction import source_depth

    tokens = source.split()
    if not tokens:
        raise ValueError("`source` is empty")
    root = Path(checkpoint)
    out = Path(out_dir) if out_dir else (root if root.is_dir() else root.parent)
    written: list[Path] = []
    for run in _runs_in(checkpoint):
        model, vocab, config = load_trained(run)
        if model.self_attention is None:
            continue
        pair = Pair(tuple(tokens), (), source_depth(tokens))
        batch = collate([pair], vocab, torch.device("cpu"))
        unknown = [t for t in tokens if t not in vocab]
        if unknown:
            raise ValueError(f"`source` has tokens the model never saw: {unknown}")
        with torch.no_grad():
            _, parse = model.encode(batch.source, batch.source_mask)
            assert parse is not None
            labels = ["$", *tokens]
            if isinstance(parse, SpanSelfAttentionOutput):  # constituency: rows = queries
                written.append(
                    viz.attention_heatmap(
                        parse.weights[0][1:],
                        labels[1:],
                        labels,
                        out / f"{config.attention}_attention.png",
                        title=f"{config.attention}: expected share in the word's constituents",
                        vmax=1.0,
                    )
                )
                continue
            marginals = parse.marginals[0]  # [N, N] p(i -> j), '$' at 0
            written.append(
                viz.attention_heatmap(
                    marginals.T[1:],
                    labels[1:],
                    labels,
                    out / f"{config.attention}_attention.png",
                    title=f"{config.attention}: p(parent | word)",
                    vmax=1.0,
                )
            )
            if config.attention == "structured":
                assert isinstance(model.self_attention, SyntacticAttention)
                heads = model.self_attention.parse(
                    model.source_embedding(batch.source), batch.source_mask
                )
                written.append(
                    viz.dependency_arcs(
                        heads[0],
                        labels,
                        out / "structured_parse.png",
                        marginals=marginals,
                        title="structured: MAP parse (Eisner) and arc marginals",
                    )
                )
    if not written:
        raise ValueError(f"no model with self-attention (simple/structured) under {checkpoint}")
    return written


def depth_plot(results: Mapping[str, Mapping[Any, float]], path: str | Path, title: str) -> Path:
    """Our per-depth accuracy (lines) beside the paper's (dashed): ``accuracy_by_depth.png``."""
    from ..viz import depth_curves

    ours = {v: _int_keys(results[v]) for v in results}
    paper = [v for v in ours if v in PAPER_VARIANTS]
    reference: dict[str, dict[int, float]] = {
        v: {d: PAPER_TABLE[d][PAPER_VARIANTS.index(v)] for d in PAPER_TABLE} for v in paper
    }
    return depth_curves(ours, Path(path), reference=reference, title=title)


def _plots(results: Mapping[tuple[Any, ...], Mapping[str, Any]], out: Path) -> list[Path]:
    per_depth = {key[0]: summary["per_depth"] for key, summary in results.items()}
    title = "Tree transduction: ours vs paper"
    return [depth_plot(per_depth, out / "accuracy_by_depth.png", title)]


# ---- command-line options -------------------------------------------------------------------
@dataclass(frozen=True)
class EvalOptions:
    """``structattn eval tree-transduction``'s own flags."""

    data: str = field(default="", metadata={"help": "file of source<TAB>target lines "
                      "(default: the run's test split)"})  # fmt: skip
    beam_size: int | None = field(default=None, metadata={"help": "default: the run's"})


@dataclass(frozen=True)
class VizOptions:
    """``structattn viz tree-transduction``'s own flags."""

    source: str = field(
        default=SAMPLE_SOURCE, metadata={"help": 'a source expression, e.g. "( + 1 2 )"'}
    )


@dataclass(frozen=True)
class DataOptions:
    """``structattn data tree-transduction``'s flags."""

    out: str = field(default="", metadata={"required": True, "help": "output directory"})
    seed: int = field(default=0, metadata={"help": "data seed"})


def _evaluate(run_dir: Path, options: EvalOptions, device: str, predictions: Path | None) -> str:
    model, vocab, config = load_trained(run_dir, device)
    pairs = read_pairs(options.data) if options.data else load_data(config)["test"]
    beam = options.beam_size or config.beam_size
    scores = evaluate(model, pairs, vocab, device, beam, predictions)
    counts = ", ".join(f"depth {d}: {n}" for d, n in scores["counts"].items())
    table = format_table({config.attention: scores["per_depth"]})
    return f"{table}\noverall {scores['overall']:.1f}% ({counts}; beam {beam})"


def _viz(checkpoint: Path, options: VizOptions, out: Path | None) -> list[Path]:
    return visualize(checkpoint, options.source, out)


def _data(options: DataOptions) -> None:
    main_data(options.out, seed=options.seed)


# ---- presets and the record -------------------------------------------------------------------
_CPU = TreeTransductionConfig(train=replace(PAPER_TRAIN, epochs=5, decay_start=3))
#: the demo: the paper's model and data, 5 epochs (about 3 minutes per model on 2 CPU cores)
DEMO_CONFIG = replace_path(_CPU, {"train.progress": False, "train.log_every": 100})
#: a seconds-long smoke run (tests, CI, ``structattn demo --quick``)
QUICK_CONFIG = replace_path(
    DEMO_CONFIG,
    {"train.epochs": 1, "train_size": 60, "valid_size": 20, "test_size": 50, "dim": 16,
     "parser_hidden": 8, "beam_size": 2},
)  # fmt: skip

RECIPE = Recipe(
    name="tree-transduction",
    summary="SAN 4.1, Table 1: prefix -> infix with none / simple / structured / constituency "
    "self-attention",
    config=TreeTransductionConfig,
    presets={
        "paper": Preset(TreeTransductionConfig(), "Appendix A.2: 13 epochs, 15K pairs"),
        "cpu": Preset(_CPU, "the paper's model and data, 5 epochs (minutes per model on a CPU)"),
        "demo": Preset(DEMO_CONFIG, "structattn demo: the cpu preset, quiet, 2 processes", 2),
        "quick": Preset(QUICK_CONFIG, "seconds: 60 pairs, 1 epoch, tiny model (smoke tests)"),
    },
    grid=(GridAxis("variants", "attention", VARIANTS),),
    train=train,
    score=score,
    evaluate=_evaluate,
    cell_dir=lambda config: config.attention,
    resumable=frozenset({"beam_size", "test_size"}),
    report=Reporting(
        select=_select,
        summarize=_summarize,
        table=_table,
        paper={
            "source": "Kim et al. 2017, Table 1",
            "metric": "% target tokens correct before the first error",
            "per_depth": {
                v: {str(d): PAPER_TABLE[d][i] for d in PAPER_TABLE}
                for i, v in enumerate(PAPER_VARIANTS)
            },
        },
        plots=_plots,
    ),
    tools=Tools(
        eval_options=EvalOptions,
        viz=_viz,
        viz_options=VizOptions,
        data=_data,
        data_options=DataOptions,
    ),
)
