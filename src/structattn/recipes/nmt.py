"""Recipe: Japanese -> English NMT with simple / sigmoid / structured (segmentation) attention
(Kim et al. 2017, sec. 4.2, Table 3, Figure 4 and Appendix A.3).

Two source settings (``source``): ``char`` (the Japanese line without its word boundaries,
one token per character: the structured attention has to learn a soft segmentation) and
``word`` (the KyTea tokens); the target is English words. Three attentions (``attention``)
in the Luong et al. (2015) encoder-decoder of :class:`~structattn.models.Seq2Seq`:
``simple`` (softmax), ``sigmoid`` and ``structured``
(:class:`~structattn.attention.SegmentationAttention`: a 2-state linear-chain CRF over the
source for every decoder step, context normalised by its marginals, L2 penalty on b).

Data: ``small_parallel_enja`` (50k / 500 / 500 Tanaka-corpus pairs), a public stand-in for the
paper's WAT data; the paper's filters (Japanese <= 50 characters, English <= 50 words) and
vocabulary (tokens seen >= 10 times in training, others ``<unk>``) are config defaults.

Metric: corpus BLEU on the test split (sacrebleu with ``tokenize="none"`` and no smoothing:
multi-bleu.perl on the tokenized, lower-cased references), chrF as a second metric.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..attention import SegmentationAttention
from ..data.batching import bucket_batches
from ..data.parallel import (
    FilterReport,
    ParallelPair,
    TranslationVocabulary,
    default_enja_data_dir,
    filter_pairs,
    read_lines,
    read_parallel,
)
from ..data.translation import (
    TranslationBatch,
    Vocabularies,
    collate,
    vocabularies,
)
from ..io import atomic_write_text, check_splits
from ..metrics import bleu, chrf
from ..models import (
    Seq2Seq,
    Seq2SeqConfig,
    translate,
    translation_attention,
    translation_perplexity,
)
from ..models.seq2seq import sequence_nll
from ..names import MemoryStructure
from ..training import Task, TrainConfig, fit, load_model_state
from ..viz.nmt import (
    PAPER_TABLE,
    SOURCES,
    VARIANT_NAMES,
    VARIANTS,
    plot_results,
    results_table,
    significance_table,
)
from . import runs
from .base import GridAxis, Preset, Recipe, Reporting, Tools
from .config import config_from_dict, config_to_dict, replace_path
from .tables import epoch_timing

__all__ = [
    "significance_table",
    "PAPER_TABLE",
    "RECIPE",
    "NMTConfig",
    "build_model",
    "load_data",
    "load_trained",
    "score",
    "train",
    "visualize",
]

_LAYER: dict[str, MemoryStructure] = {
    "simple": "softmax",
    "sigmoid": "sigmoid",
    "structured": "segmentation",
}
#: the paper's optimisation (A.3, Luong et al.): SGD 1.0, clip 1, halve from the first epoch
#: without validation improvement, loss summed over a sentence and averaged over the batch
PAPER_TRAIN = TrainConfig(
    epochs=30, lr=1.0, max_grad_norm=1.0, decay_on_plateau=True, log_every=100
)


@dataclass(frozen=True)
class NMTConfig:
    """Settings of the NMT experiment (defaults: the paper's, sec. 4.2 and Appendix A.3)."""

    source: Literal["char", "word"] = "char"  # source units: characters or KyTea words
    attention: Literal["simple", "sigmoid", "structured"] = "structured"  # decoder attention
    embedding_dim: int = 500  # source and target embedding size
    hidden_dim: int = 500  # l: LSTM size of encoder and decoder
    layers: int = 2  # LSTM layers of the encoder and of the decoder
    dropout: float = 0.3  # between LSTM layers and on the attentional vector
    init_range: float = 0.1  # parameters ~ U[-init_range, init_range]
    lam: float = 2.0  # structured: context = sum_i p_i h_i / gamma, gamma = sum_i p_i / lam
    penalty: float = 0.005  # structured: L2 penalty on the 4 pairwise parameters b
    batch_size: int = 128  # sentences per batch
    beam_size: int = 5  # beam search at test time
    max_source_chars: int = 50  # filter: Japanese sentences of at most this many characters
    max_target_words: int = 50  # filter: English sentences of at most this many words
    min_count: int = 10  # vocabulary: tokens seen at least this often in training
    data_dir: str = ""  # directory with {train,dev,test}.{ja,en} ("" = shared enja data)
    train_size: int = 0  # use a seeded subset of this many training pairs (0 = all)
    valid_size: int = 0  # use the first this many dev pairs (0 = all)
    test_size: int = 0  # score the first this many test pairs (0 = all)
    train: TrainConfig = field(default_factory=lambda: PAPER_TRAIN)  # epochs, lr, seed, ...

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"`source` must be one of {SOURCES}, got {self.source!r}")
        if self.attention not in VARIANTS:
            raise ValueError(f"`attention` must be one of {VARIANTS}, got {self.attention!r}")
        for name in ("embedding_dim", "hidden_dim", "layers", "batch_size", "beam_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        for name in ("max_source_chars", "max_target_words", "min_count"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        for name in ("train_size", "valid_size", "test_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {self.dropout}")
        if not (self.init_range > 0 and self.lam > 0 and self.penalty >= 0):
            raise ValueError("need init_range > 0, lam > 0 and penalty >= 0")
        if not isinstance(self.train, TrainConfig):
            raise ValueError(f"`train` must be a TrainConfig, got {type(self.train).__name__}")


# ---- data ---------------------------------------------------------------------------------
def _data_dir(config: NMTConfig) -> Path:
    return Path(config.data_dir) if config.data_dir else default_enja_data_dir()


def load_data(config: NMTConfig) -> tuple[dict[str, list[ParallelPair]], dict[str, FilterReport]]:
    """Train / valid / test pairs after the length filter (applied to every split, as in the
    paper), subsets as configured; and what the filter kept of each split."""
    root = _data_dir(config)
    splits: dict[str, list[ParallelPair]] = {}
    reports: dict[str, FilterReport] = {}
    for name, stem in (("train", "train"), ("valid", "dev"), ("test", "test")):
        pairs = read_parallel(root / f"{stem}.ja", root / f"{stem}.en")
        splits[name], reports[name] = filter_pairs(
            pairs, config.max_source_chars, config.max_target_words
        )
    if config.train_size and config.train_size < len(splits["train"]):
        rng = random.Random(config.train.seed)
        splits["train"] = rng.sample(splits["train"], config.train_size)
    if config.valid_size:
        splits["valid"] = splits["valid"][: config.valid_size]
    if config.test_size:
        splits["test"] = splits["test"][: config.test_size]
    check_splits(splits, f"{root} (after the length filter)")
    return splits, reports


def build_vocabularies(config: NMTConfig, train: Sequence[ParallelPair]) -> Vocabularies:
    """Source (characters or words) and target vocabularies of the training pairs."""
    return vocabularies(train, config.source, config.min_count)


def batches_for_epoch(
    pairs: Sequence[ParallelPair], batch_size: int, seed: int, epoch: int
) -> list[list[ParallelPair]]:
    """Batches of pairs of similar source length, in a random order fixed by (seed, epoch)."""
    return bucket_batches(pairs, batch_size, seed, epoch, lambda pair: pair.source_chars)


# ---- model --------------------------------------------------------------------------------
def build_model(config: NMTConfig, vocabs: Vocabularies) -> Seq2Seq:
    """The paper's encoder-decoder (A.3) for ``config.attention``, U[-init_range, init_range]."""
    torch.manual_seed(config.train.seed)
    s2s = Seq2SeqConfig(
        source_vocab_size=len(vocabs.source),
        target_vocab_size=len(vocabs.target),
        embedding_dim=config.embedding_dim,
        hidden_dim=config.hidden_dim,
        encoder_layers=config.layers,
        decoder_layers=config.layers,
        attention=_LAYER[config.attention],
        scorer="bilinear",
        input_feeding=True,
        init_decoder="final",
        dropout=config.dropout,
        padding_idx=vocabs.source.pad_id,
    )
    attention = None
    if config.attention == "structured":  # the paper's lambda and penalty, as configured
        attention = SegmentationAttention(
            s2s.memory_dim, s2s.hidden_dim, "bilinear", lam=config.lam, penalty=config.penalty
        )
    model = Seq2Seq(s2s, attention)
    for p in model.parameters():
        nn.init.uniform_(p, -config.init_range, config.init_range)
    return model


def sequence_loss(model: nn.Module, batch: TranslationBatch) -> tuple[Tensor, int, Tensor]:
    """Summed token NLL plus B times the attention penalty (the loop divides by B, so each
    step minimises the mean sentence NLL + penalty), sentences, target tokens."""
    logits = model(batch.source, batch.source_mask, batch.target_in)  # [B, T, V]
    examples = batch.source.shape[0]
    nll = sequence_nll(logits, batch.target_out, 0, "sum")
    inner = getattr(model, "module", model)  # the model itself under DDP
    penalty = inner.penalty() if isinstance(inner, Seq2Seq) else logits.new_zeros(())
    return nll + examples * penalty, examples, (batch.target_out != 0).sum()


def evaluate(
    model: Seq2Seq,
    sources: Sequence[Sequence[str]],
    vocabs: Vocabularies,
    unit: str,
    references: Sequence[Sequence[str]] | None = None,
    device: torch.device | str = "cpu",
    beam_size: int = 5,
    predictions: str | Path | None = None,
    max_length: int = 100,
) -> dict[str, Any]:
    """Translate source lines (as words; ``unit`` "char" joins them into characters) and
    score them against ``references`` (BLEU, chrF). With ``predictions``, writes one JSON
    object per line (``index``, ``source``, ``hypothesis``, ``reference``) and, beside it,
    ``<stem>.hyp.txt`` with one hypothesis per line in input order."""
    inputs = [
        tuple("".join(s)) if unit == "char" else tuple(s)  # the model's source tokens
        for s in sources
    ]
    hyps = [" ".join(h) for h in translate(model, inputs, vocabs, device, beam_size, max_length)]
    refs = [" ".join(r) for r in references] if references is not None else None
    if predictions is not None:
        records = [
            {
                "index": i,
                "source": " ".join(s),
                "hypothesis": h,
                "reference": refs[i] if refs is not None else None,
            }
            for i, (s, h) in enumerate(zip(sources, hyps, strict=True))
        ]
        path = Path(predictions)
        runs.write_jsonl(path, records)
        atomic_write_text(_hyp_path(path), "".join(h + "\n" for h in hyps))
    scores: dict[str, Any] = {"sentences": len(hyps), "beam_size": beam_size}
    if refs is not None:
        scores["bleu"] = bleu(hyps, refs)
        scores["chrf"] = chrf(hyps, refs)
    scores["empty_hypotheses"] = sum(not h for h in hyps)
    return scores


def _hyp_path(predictions: Path) -> Path:
    stem = predictions.name[: -len(".jsonl")] if predictions.name.endswith(".jsonl") else (
        predictions.stem
    )  # fmt: skip
    return predictions.with_name(f"{stem}.hyp.txt")


# ---- train / load -------------------------------------------------------------------------
def train(config: NMTConfig, run_dir: str | Path, resume: bool = False) -> dict[str, Any]:
    """Train one (source, attention) cell into ``run_dir`` (``fit``'s files)."""
    run_dir = Path(run_dir)
    splits, reports = load_data(config)
    if resume:
        saved = load_model_state(run_dir, "checkpoint.pt")
        vocabs = Vocabularies(
            TranslationVocabulary.from_dict(saved["extra"]["source_vocab"]),
            TranslationVocabulary.from_dict(saved["extra"]["target_vocab"]),
        )
    else:
        vocabs = build_vocabularies(config, splits["train"])
    device = torch.device(config.train.device)
    model = build_model(config, vocabs)
    valid = splits["valid"]

    def validate(m: nn.Module) -> dict[str, float]:
        ppl = translation_perplexity(m, valid, vocabs, config.source, device)  # type: ignore[arg-type]
        return {"metric": -ppl, "perplexity": ppl}

    task = Task(
        model=model,
        batches=lambda epoch: batches_for_epoch(
            splits["train"], config.batch_size, config.train.seed, epoch
        ),
        collate=lambda pairs, dev: collate(pairs, vocabs, config.source, dev),
        loss=sequence_loss,
        validate=validate,
        config={"recipe": "nmt", **config_to_dict(config)},
        extra={
            "source_vocab": vocabs.source.to_dict(),
            "target_vocab": vocabs.target.to_dict(),
            "filter": {k: r.__dict__ for k, r in reports.items()},
        },
    )
    train_config = config.train if config.train.name else replace(
        config.train, name=f"{config.source}-{config.attention}"
    )  # fmt: skip
    return fit(task, train_config, run_dir, resume=resume)


def load_trained(
    run_dir: str | Path, device: str = "cpu"
) -> tuple[Seq2Seq, Vocabularies, NMTConfig]:
    """The best model of a run directory (``model.pt``), its vocabularies and config."""
    state = load_model_state(run_dir)
    saved = state["config"]
    if saved.get("recipe") != "nmt":
        raise ValueError(f"{run_dir} is not an nmt run ({saved.get('recipe')!r})")
    config = config_from_dict(NMTConfig, saved)
    vocabs = Vocabularies(
        TranslationVocabulary.from_dict(state["extra"]["source_vocab"]),
        TranslationVocabulary.from_dict(state["extra"]["target_vocab"]),
    )
    model = build_model(config, vocabs)
    model.load_state_dict(state["model"])
    return model.to(device).eval(), vocabs, config


def score(config: NMTConfig, run_dir: str | Path) -> dict[str, Any]:
    """A trained run's validation perplexity (best epoch) and test BLEU / chrF (beam
    search), its speed and what the filter kept; writes ``test_predictions.jsonl`` and
    ``test_predictions.hyp.txt`` in the run directory."""
    run_dir = Path(run_dir)
    model, vocabs, _ = load_trained(run_dir, config.train.device)
    state = load_model_state(run_dir)
    splits, reports = load_data(config)
    test = splits["test"]
    scores = evaluate(
        model,
        [p.source for p in test],
        vocabs,
        config.source,
        [p.target for p in test],
        config.train.device,
        config.beam_size,
        run_dir / "test_predictions.jsonl",
        max_length=config.max_target_words,
    )
    train_tokens = sum(len(p.target) + 1 for p in splits["train"])
    scores.update(epoch_timing(run_dir, train_tokens))
    scores["filter"] = {k: {"kept": r.kept, "total": r.total} for k, r in reports.items()}
    if config.attention == "structured":
        layer = model.attention
        assert isinstance(layer, SegmentationAttention)
        scores["transitions"] = layer.transitions.detach().cpu().tolist()
    return {"valid": dict(state["valid"]), "test": scores}


def _select(record: Mapping[str, Any]) -> float:
    """Lower validation perplexity is better."""
    return -float(record.get("valid", {}).get("perplexity", math.inf))


def _summarize(config: NMTConfig, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    best = records[0]
    test = best["test"]
    return {
        "source": config.source,
        "attention": config.attention,
        "bleu": test.get("bleu"),
        "chrf": test.get("chrf"),
        "valid_perplexity": best["valid"].get("perplexity"),
        "best": best["train"].get("best", {}),
        "epochs": best["train"].get("epochs"),
        "seconds": best["seconds"],
        "seconds_per_epoch": test.get("seconds_per_epoch"),
        "tokens_per_second": test.get("tokens_per_second"),
        "transitions": test.get("transitions"),
    }


# ---- Figure 4 -------------------------------------------------------------------------------
def _runs_in(checkpoint: str | Path) -> list[Path]:
    """Run directories under ``checkpoint``: itself, or its char-* (else word-*) cells."""
    root = Path(checkpoint)
    if (root / "model.pt").exists() or root.suffix == ".pt":
        return [root.parent if root.suffix == ".pt" else root]
    for source in SOURCES:
        cells = [root / f"{source}-{v}" for v in VARIANTS]
        found = [cell for cell in cells if (cell / "model.pt").exists()]
        if found:
            return found
    raise FileNotFoundError(
        f"no trained model (model.pt) in {root} or its <source>-<attention> cells"
    )


def visualize(
    checkpoint: str | Path, index: int = 0, sentence: str = "", out_dir: str | Path | None = None
) -> list[Path]:
    """Figure 4 for one source (test sentence ``index``, or ``sentence``): each model's
    source attention (rows = its decoded target words, columns = source tokens) side by side
    in ``figure4.png``, the structured model's Viterbi segmentation per target word in
    ``segmentation.png``, and the same as text (source spans per target word) in
    ``figure4.md``. Column labels are source positions (the figure's fonts may lack CJK
    glyphs); the Markdown file lists the tokens. Returns the files written."""
    from .. import viz

    viz.require_matplotlib()
    found = _runs_in(checkpoint)
    root = Path(checkpoint)
    out = Path(out_dir) if out_dir else (root if root.is_dir() else root.parent)
    panels: list[tuple[str, Any, list[str]]] = []
    text: list[str] = []
    segmentation: tuple[Tensor, list[str]] | None = None
    tokens: tuple[str, ...] = ()
    for run in found:
        model, vocabs, config = load_trained(run)
        if sentence:
            words = tuple(sentence.split())
            reference = None
        else:
            splits, _ = load_data(config)
            if not 0 <= index < len(splits["test"]):
                raise ValueError(f"`index` must be in [0, {len(splits['test'])}), got {index}")
            pair = splits["test"][index]
            words, reference = pair.source, " ".join(pair.target)
        if not words:
            raise ValueError("the source sentence is empty")
        tokens = tuple("".join(words)) if config.source == "char" else words
        hypothesis = translate(model, [tokens], vocabs, beam_size=config.beam_size)[0]
        alpha, segments = translation_attention(model, tokens, hypothesis, vocabs)
        rows = [*hypothesis, "</s>"]
        name = f"{VARIANT_NAMES[config.attention]} ({config.source})"
        panels.append((name, alpha, rows))
        text.append(f"- **{name}**: {' '.join(hypothesis) or '(empty)'}")
        if segments is not None:
            segmentation = (segments.clamp_min(0).float(), rows)
            for row, z in zip(rows, segments.tolist(), strict=True):
                spans = "".join(t if zi == 1 else "·" for t, zi in zip(tokens, z, strict=True))
                text.append(f"    - `{row}`: {spans}")
    columns = [str(i) for i in range(len(tokens))]
    written = viz.translation_figures(panels, columns, out, segmentation)
    legend = " ".join(f"{i}:{t}" for i, t in enumerate(tokens))
    lines = [f"Source: {' '.join(tokens)}", f"Columns: {legend}"]
    if not sentence:
        lines.append(f"Reference: {reference}")
    md = "\n".join([*lines, "", *text]) + "\n"
    written.append(atomic_write_text(out / "figure4.md", md))
    return written


# ---- command-line options -------------------------------------------------------------------
@dataclass(frozen=True)
class EvalOptions:
    """``structattn eval nmt``'s own flags."""

    source_file: str = field(default="", metadata={"help": "Japanese lines to translate, "
                             "KyTea-segmented (default: the run's test split)"})  # fmt: skip
    reference_file: str = field(default="", metadata={"help": "English references, one per "
                                "source line (BLEU and chrF are printed when given)"})  # fmt: skip
    beam_size: int | None = field(default=None, metadata={"help": "default: the run's"})


@dataclass(frozen=True)
class VizOptions:
    """``structattn viz nmt``'s own flags."""

    index: int = field(default=0, metadata={"help": "test sentence to draw"})
    sentence: str = field(default="", metadata={"help": "or a Japanese sentence to draw"})


def _evaluate(run_dir: Path, options: EvalOptions, device: str, predictions: Path | None) -> str:
    model, vocabs, config = load_trained(run_dir, device)
    beam = options.beam_size or config.beam_size
    if options.source_file:
        # every line is read and checked (file:line errors) before anything is decoded
        sources = read_lines(options.source_file)
        references = read_lines(options.reference_file) if options.reference_file else None
        if references is not None and len(references) != len(sources):
            raise ValueError(
                f"{options.reference_file}: {len(references)} lines for {len(sources)} source "
                f"lines in {options.source_file}"
            )
        what = options.source_file
    else:
        if options.reference_file:
            raise ValueError("--reference-file needs --source-file")
        test = load_data(config)[0]["test"]
        sources, references, what = [p.source for p in test], [p.target for p in test], "test"
    long = sum(sum(map(len, s)) > config.max_source_chars for s in sources)
    scores = evaluate(
        model, sources, vocabs, config.source, references, device, beam, predictions,
        max_length=max(config.max_target_words, 100),
    )  # fmt: skip
    lines = [f"{what}: {scores['sentences']} sentences, beam {beam} ({config.source}, "
             f"{config.attention})"]  # fmt: skip
    if long:
        lines.append(f"{long} source lines are over the {config.max_source_chars}-character "
                     "training filter (decoded anyway)")  # fmt: skip
    if scores["empty_hypotheses"]:
        lines.append(f"{scores['empty_hypotheses']} empty hypotheses")
    if "bleu" in scores:
        lines.append(f"BLEU {scores['bleu']:.2f}  chrF {scores['chrf']:.2f}")
    if predictions is not None:
        lines.append(f"hypotheses written to {_hyp_path(predictions)}")
    return "\n".join(lines)


def _viz(checkpoint: Path, options: VizOptions, out: Path | None) -> list[Path]:
    """The figures (``figure4.md``, their text version, is written beside them)."""
    written = visualize(checkpoint, options.index, options.sentence, out)
    return [p for p in written if p.suffix != ".md"]


# ---- presets and the record -------------------------------------------------------------------
#: the whole table on this 2-core machine in about 1 hour when idle (2 runs in parallel, 1
#: thread each, ~70 s per epoch): 2 x 128-unit LSTMs, batch 64, 15 epochs (5 epochs left the
#: validation perplexity falling by 20% per epoch; the paper: 2 x 500 units, batch 128, 30
#: epochs); lambda, penalty, dropout, init, the optimiser and the filters are the paper's
CPU_CONFIG = NMTConfig(
    embedding_dim=128,
    hidden_dim=128,
    batch_size=64,
    train=replace(PAPER_TRAIN, epochs=15),
)
#: a seconds-long smoke run (tests, CI)
QUICK_CONFIG = replace_path(
    CPU_CONFIG,
    {"embedding_dim": 16, "hidden_dim": 16, "layers": 1, "batch_size": 16, "beam_size": 2,
     "min_count": 50, "train_size": 64, "valid_size": 16, "test_size": 8, "train.epochs": 1,
     "train.progress": False, "train.log_every": 100},
)  # fmt: skip

RECIPE = Recipe(
    name="nmt",
    summary="SAN 4.2, Table 3: ja->en NMT, char/word source x simple/sigmoid/structured attention",
    config=NMTConfig,
    presets={
        "paper": Preset(NMTConfig(), "Appendix A.3: 2x500 LSTMs, batch 128, 30 epochs"),
        "cpu": Preset(CPU_CONFIG, "2x128 LSTMs, batch 64, 15 epochs (the table: ~1 h, 2 cores)", 2),
        "quick": Preset(QUICK_CONFIG, "seconds: 64 pairs, 1 epoch, tiny model (smoke tests)"),
    },
    grid=(GridAxis("sources", "source", SOURCES), GridAxis("variants", "attention", VARIANTS)),
    train=train,
    score=score,
    evaluate=_evaluate,
    cell_dir=lambda config: f"{config.source}-{config.attention}",
    resumable=frozenset({"beam_size", "test_size"}),
    needs={
        "viz": ("matplotlib",),
        "train": ("sacrebleu",),
        "reproduce": ("sacrebleu",),
        "eval": ("sacrebleu",),
    },
    report=Reporting(
        select=_select,
        summarize=_summarize,
        table=results_table,
        paper={
            "source": "Kim et al. 2017, Table 3 (WAT ja-en)",
            "metric": "BLEU",
            "bleu": PAPER_TABLE,
        },
        plots=plot_results,
    ),
    tools=Tools(eval_options=EvalOptions, viz=_viz, viz_options=VizOptions),
)
