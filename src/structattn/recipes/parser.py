"""Recipe: a first-order graph-based dependency parser on UD English-EWT, trained with the
tree CRF's negative log-likelihood (the pretraining / pipeline parser of Kim et al. 2017,
sec. 4.4: the ``hard-parent`` and ``pretrained`` variants of the ``nli`` recipe).

The parser (:class:`~structattn.models.parser.ArcParser`) is the NLI model's syntactic
attention layer on its own: fixed word vectors (GloVe, unknown words hashed to Gaussian
vectors; :func:`~structattn.data.embeddings.embedding_table`), a trained linear projection, a
learned ROOT vector and the BiLSTM + MLP arc scorer of
:class:`~structattn.attention.BiLSTMArcScorer` (Appendix A.1), so its trained weights can
initialise the NLI model's. Loss: ``structured_nll`` of the gold tree under
:class:`~structattn.NonProjectiveDependencyCRF` (matrix-tree theorem: every EWT tree, the
non-projective ones too) or, with ``loss=projective``, of the projectivised gold tree under
:class:`~structattn.DependencyCRF`; decoding: Eisner (projective MAP) or Chu-Liu-Edmonds.
Reported: UAS on EWT dev and test with and without punctuation, seconds per epoch.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.classification import WordVocabulary, length_buckets, word_vocabulary
from ..data.conllu import (
    ConlluSentence,
    attachment_scores,
    default_ud_data_dir,
    format_conllu,
    heads_tensor,
    parse_conllu,
    read_conllu,
    write_conllu,
)
from ..data.embeddings import embedding_table
from ..distributions import DependencyCRF, NonProjectiveDependencyCRF, structured_nll
from ..models.parser import (
    ArcParser,
    WordFeatures,
    build_arc_parser,
    encode_words,
    parse_sentences,
    predict_heads_and_tags,
)
from ..training import Task, fit, load_model_state
from ..trees import projectivize
from . import runs
from ._parsing import LOSSES, ParserConfig, epoch_seconds, load_parser_run
from .base import GridAxis, Preset, Recipe, Reporting, Tools
from .config import config_to_dict, replace_path
from .tables import markdown_table

__all__ = [
    "RECIPE",
    "ParserConfig",
    "build_model",
    "evaluate",
    "load_data",
    "load_trained",
    "score",
    "tag_accuracy",
    "train",
]

SPLITS = ("train", "dev", "test")


# ---- data -----------------------------------------------------------------------------------
def load_data(config: ParserConfig) -> dict[str, list[ConlluSentence]]:
    """EWT train / dev / test (``max_train`` / ``max_eval`` applied)."""
    folder = Path(config.data_dir) if config.data_dir else default_ud_data_dir()
    splits = {s: read_conllu(folder / f"en_ewt-ud-{s}.conllu") for s in SPLITS}
    if config.max_train:
        splits["train"] = splits["train"][: config.max_train]
    if config.max_eval:
        for s in ("dev", "test"):
            splits[s] = splits[s][: config.max_eval]
    for s, sentences in splits.items():
        if not sentences:
            raise ValueError(f"EWT {s}: no sentences")
        for sentence in sentences:
            if len(sentence) == 0:
                raise ValueError(f"{sentence.source}:{sentence.line}: empty sentence")
    return splits


def build_model(
    config: ParserConfig, table: Tensor, features: WordFeatures | None = None
) -> ArcParser:
    """The parser of ``config`` over the fixed ``table`` [V, E] with the vocabularies of its
    parser-side inputs (:func:`~structattn.models.parser.build_arc_parser`)."""
    return build_arc_parser(config, table, features)


def _table(config: ParserConfig, words: WordVocabulary) -> Tensor:
    table = embedding_table(words, config.embeddings, config.normalize, config.unknown_buckets)
    return table.weight


# ---- one run ---------------------------------------------------------------------------------
def _vocabulary(splits: Mapping[str, Sequence[ConlluSentence]]) -> WordVocabulary:
    """Every word of every split (the word vectors are fixed functions of the word)."""
    return word_vocabulary([s.words for split in splits.values() for s in split])


def evaluate(
    model: ArcParser,
    words: WordVocabulary,
    sentences: Sequence[ConlluSentence],
    config: ParserConfig,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, Any], list[list[int]]]:
    """UAS (%) with and without punctuation, and the predicted heads."""
    heads, tagged = predict_heads_and_tags(
        model, words, [s.words for s in sentences], device, config.decoder, 128,
        [s.upos for s in sentences] if config.upos else None,
    )  # fmt: skip
    scores = attachment_scores(sentences, heads)
    out: dict[str, Any] = {
        "uas": 100 * scores.uas,
        "uas_no_punct": 100 * scores.uas_no_punct,
        "words": scores.words,
        "sentences": len(sentences),
    }
    if tagged is not None:  # the auxiliary tagger's accuracy, from the same pass
        out["upos_accuracy"] = 100 * _upos_accuracy(model, sentences, tagged)
    return out, heads


@torch.no_grad()
def tag_accuracy(
    model: ArcParser,
    words: WordVocabulary,
    sentences: Sequence[ConlluSentence],
    device: torch.device | str = "cpu",
    batch_size: int = 128,
) -> float:
    """Share of words whose gold UPOS the auxiliary tagger predicts (a parser trained with
    ``upos_aux`` > 0)."""
    if model.tagger is None or model.features.targets is None:
        raise ValueError("this parser has no auxiliary tagger (upos_aux = 0)")
    words_only = [s.words for s in sentences]
    upos = [s.upos for s in sentences]  # read only by a parser trained with --upos
    tagged = predict_heads_and_tags(model, words, words_only, device, "eisner", batch_size, upos)[1]
    assert tagged is not None
    return _upos_accuracy(model, sentences, tagged)


def _upos_accuracy(
    model: ArcParser, sentences: Sequence[ConlluSentence], tagged: Sequence[Sequence[int]]
) -> float:
    """Share of words whose gold UPOS target id equals the ``tagged`` id."""
    targets = model.features.encode_targets([s.upos for s in sentences], torch.device("cpu"))
    gold = [row[: len(s.words)] for row, s in zip(targets.tolist(), sentences, strict=True)]
    pairs = zip(gold, tagged, strict=True)
    right = sum(g == p for gs, ps in pairs for g, p in zip(gs, ps, strict=True))
    return right / max(sum(map(len, gold)), 1)


def train(config: ParserConfig, run_dir: str | Path, resume: bool = False) -> dict[str, Any]:
    """Train the parser into ``run_dir``; returns fit's summary (best model on dev UAS)."""
    run_dir = Path(run_dir)
    splits = load_data(config)
    words = _vocabulary(splits)
    if resume:
        saved = load_model_state(run_dir, "checkpoint.pt")
        words = WordVocabulary.from_dict(saved["extra"]["vocab"])
        features = WordFeatures.from_dict(saved["extra"].get("features"))
    else:
        features = WordFeatures.build(config, splits["train"])
    torch.manual_seed(config.train.seed)
    model = build_model(config, _table(config, words), features)
    train_set = splits["train"]
    device = torch.device(config.train.device)

    def batches(epoch: int) -> list[list[ConlluSentence]]:
        # shuffled, then sorted by length within buckets of 50 batches (less padding)
        rng = random.Random(config.train.seed * 100_003 + epoch)
        lengths = [len(s) for s in train_set]
        return [[train_set[i] for i in c] for c in length_buckets(lengths, config.batch_size, rng)]

    Batch = tuple[Tensor, Tensor, Tensor, dict[str, Tensor], Tensor | None]

    def collate(batch: Sequence[ConlluSentence], dev: torch.device) -> Batch:
        ids, lengths = encode_words([s.words for s in batch], words, dev)
        inputs = features.encode([s.words for s in batch], [s.upos for s in batch], dev)
        heads, _ = heads_tensor(batch)  # [B, N+1], -1 at ROOT and padding
        targets = (
            None if features.targets is None
            else features.encode_targets([s.upos for s in batch], dev)
        )  # fmt: skip
        return ids, lengths, heads.to(dev), inputs, targets

    def loss(m: nn.Module, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        assert isinstance(m, ArcParser)
        ids, lengths, heads, inputs, targets = batch
        if m.training and config.word_dropout and "trained" in inputs:
            trained = inputs["trained"]
            drop = torch.rand(trained.shape, device=trained.device) < config.word_dropout
            inputs = {**inputs, "trained": trained.masked_fill(drop & (trained > 0), 1)}
        theta, tag_logits = m.scores_and_tags(ids, lengths, **inputs)
        scores = config.arc_scale * theta  # [B, N+1, N+1]
        if config.loss == "projective":
            crf: Any = DependencyCRF(scores, lengths + 1, multiroot=False)
            heads = projectivize(heads, lengths + 1)
        else:
            crf = NonProjectiveDependencyCRF(scores, lengths + 1, multiroot=False)
        nll = structured_nll(crf, heads, reduction="sum")
        if tag_logits is not None and targets is not None:  # the auxiliary UPOS loss
            tagging = F.cross_entropy(
                tag_logits.flatten(0, 1), targets.flatten(), ignore_index=0, reduction="sum"
            )
            nll = nll + config.upos_aux * tagging
        return nll, lengths.sum(), lengths.sum()

    def validate(m: nn.Module) -> dict[str, float]:
        assert isinstance(m, ArcParser)
        scores, _ = evaluate(m, words, splits["dev"], config, device)
        tagged = {"upos_accuracy": scores["upos_accuracy"]} if "upos_accuracy" in scores else {}
        return {"metric": scores["uas"] / 100, "uas": scores["uas"], **tagged}

    task = Task(
        model=model,
        batches=batches,
        collate=collate,
        loss=loss,
        validate=validate,
        config={"recipe": "parser", **config_to_dict(config)},
        extra={"vocab": words.to_dict(), "features": features.to_dict()},
    )
    train_config = replace(config.train, name=config.train.name or f"parser {config.loss}")
    return fit(task, replace(train_config, normalize_by="tokens"), run_dir, resume=resume)


def load_trained(
    checkpoint: str | Path, device: str = "cpu"
) -> tuple[ArcParser, WordVocabulary, ParserConfig]:
    """The best parser of a run directory (or its ``model.pt``), its vocabulary and config."""
    return load_parser_run(checkpoint, device)


def score(config: ParserConfig, run_dir: str | Path) -> dict[str, Any]:
    """Dev and test UAS of a trained run; writes ``test_predictions.jsonl`` and
    ``test_predictions.conllu`` (the test file with predicted heads)."""
    run_dir = Path(run_dir)
    model, words, _ = load_trained(run_dir, config.train.device)
    splits = load_data(config)
    dev, _ = evaluate(model, words, splits["dev"], config, config.train.device)
    test, heads = evaluate(model, words, splits["test"], config, config.train.device)
    _write_predictions(run_dir / "test_predictions.jsonl", splits["test"], heads)
    write_conllu(run_dir / "test_predictions.conllu", splits["test"], heads)
    test["seconds_per_epoch"] = epoch_seconds(run_dir)
    return {"valid": dev, "test": test}


def _write_predictions(
    path: Path, sentences: Sequence[ConlluSentence], heads: Sequence[Sequence[int]]
) -> None:
    if path.suffix == ".conllu":
        write_conllu(path, sentences, heads)
        return
    runs.write_jsonl(
        path,
        (
            {"index": i, "sent_id": s.sent_id, "words": list(s.words), "gold": s.heads,
             "predicted": list(h)}
            for i, (s, h) in enumerate(zip(sentences, heads, strict=True))
        ),
    )  # fmt: skip


def _select(record: Mapping[str, Any]) -> float:
    return float((record.get("valid") or {}).get("uas", -1.0))


def _summarize(config: ParserConfig, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    best = records[0]
    return {"loss": config.loss, "decoder": config.decoder, "dev": best["valid"],
            "test": best["test"]}  # fmt: skip


def format_table(results: Mapping[tuple[Any, ...], Mapping[str, Any]]) -> str:
    """UAS on EWT dev and test, with and without punctuation."""
    rows = []
    for (loss,), s in results.items():
        dev, test = s["dev"], s["test"]
        sec = test.get("seconds_per_epoch")
        rows.append(
            [loss, f"{dev['uas']:.1f}", f"{dev['uas_no_punct']:.1f}", f"{test['uas']:.1f}",
             f"{test['uas_no_punct']:.1f}", "-" if sec is None else f"{sec:.0f}"]
        )  # fmt: skip
    header = ["Loss", "dev UAS", "dev UAS no punct", "test UAS", "test UAS no punct", "s/epoch"]
    return markdown_table(header, rows)


# ---- command-line options -------------------------------------------------------------------
@dataclass(frozen=True)
class EvalOptions:
    """``structattn eval parser``'s own flags."""

    conllu: str = field(default="", metadata={"help": "a CoNLL-U file (default: EWT --split)"})
    split: Literal["dev", "test"] = "test"  # the EWT split scored without --conllu
    decoder: str = field(default="", metadata={"help": "eisner or cle (default: the run's)"})


def _evaluate(run_dir: Path, options: EvalOptions, device: str, predictions: Path | None) -> str:
    model, _, config = load_trained(run_dir, device)
    if options.decoder:
        config = replace(config, decoder=options.decoder)  # type: ignore[arg-type]
    if options.conllu:
        sentences = read_conllu(options.conllu)
        where = options.conllu
    else:
        sentences = load_data(config)[options.split]
        where = f"EWT {options.split}"
    tags = [s.upos for s in sentences] if config.upos else None
    heads = parse_sentences(model, config, [s.words for s in sentences], device, tags)
    if predictions is not None:
        _write_predictions(predictions, sentences, heads)
    if any(s.heads is None for s in sentences):
        return f"{where}: parsed {len(sentences)} sentences (no gold heads to score)"
    scores = attachment_scores(sentences, heads)
    return (
        f"{where} ({len(sentences)} sentences, {scores.words} words, {config.decoder}): "
        f"UAS {100 * scores.uas:.2f}%  without punctuation {100 * scores.uas_no_punct:.2f}%"
    )


def _parse(
    run_dir: Path, sentences: Sequence[Sequence[str]], device: str, options: object = None
) -> list[str]:
    """``structattn parse parser``: one CoNLL-U block per tokenised sentence (ID, FORM and
    the predicted HEAD; the other columns ``_``)."""
    model, _, config = load_trained(run_dir, device)
    blocks = [
        "# text = " + " ".join(words) + "\n"
        + "".join(f"{i}\t{w}\t_\t_\t_\t_\t_\t_\t_\t_\n" for i, w in enumerate(words, 1))
        for words in sentences
    ]  # fmt: skip
    plain = parse_conllu("\n".join(blocks), source="input")
    heads = parse_sentences(model, config, [s.words for s in plain], device)
    return [format_conllu([s], [h]).rstrip("\n") + "\n" for s, h in zip(plain, heads, strict=True)]


@dataclass(frozen=True)
class VizOptions:
    """``structattn viz parser``'s own flags."""

    sentence: str = "The men are fighting outside a deli ."  # a tokenised sentence


def _viz(checkpoint: Path, options: VizOptions, out: Path | None) -> list[Path]:
    from .. import viz

    model, _, config = load_trained(checkpoint)
    tokens = options.sentence.split()
    if not tokens:
        raise ValueError("the sentence has no tokens")
    heads = parse_sentences(model, config, [tokens])[0]
    folder = Path(out) if out else runs.resolve_run(RECIPE, checkpoint)
    return [
        viz.dependency_arcs(
            [-1, *heads], ["ROOT", *tokens], folder / "parse.png", title="parser (EWT)"
        )
    ]


#: measured on the first 3,000 training sentences (docs/results/parser.md): arc scale 10,
#: trained vectors of words seen twice, the character CNN, dropout 0.33, Adam 0.005, batch 16;
#: on the whole treebank: 3 BiLSTM layers and the auxiliary UPOS loss (81.0 -> 85.6 test
#: UAS). parser_dim stays the NLI layer's 50 and the NLI cpu preset has the same 3 layers, so
#: that the `pretrained` NLI variant can load it
_CPU = replace_path(
    ParserConfig(hidden_dim=100, arc_scale=10.0, word_min_count=2, char_dim=30, dropout=0.33,
                 batch_size=16, parser_layers=3, upos_aux=1.0),
    {"train.epochs": 20, "train.lr": 0.005},
)  # fmt: skip
_QUICK = replace_path(
    ParserConfig(
        hidden_dim=16,
        parser_dim=8,
        max_train=64,
        max_eval=32,
        arc_scale=10.0,
        word_min_count=2,
        char_dim=8,
        dropout=0.1,
    ),
    {"train.epochs": 1, "train.progress": False, "train.log_every": 10},
)

RECIPE = Recipe(
    name="parser",
    summary="Dependency parser on UD English-EWT (tree-CRF NLL; the NLI recipe's pipeline "
    "and pretraining parser): UAS dev / test",
    config=ParserConfig,
    presets={
        "paper": Preset(ParserConfig(), "sec. 4.4: hidden 300, 1 epoch of Adam 0.01"),
        "cpu": Preset(
            _CPU,
            "hidden 100 (the nli cpu preset's), 3 BiLSTM layers, arc scale 10, trained word "
            "vectors (words seen twice) + character CNN, dropout 0.33, auxiliary UPOS loss, "
            "20 epochs of Adam 0.005, batch 16",
        ),
        "quick": Preset(_QUICK, "seconds: 64 sentences, 1 epoch, tiny model"),
    },
    grid=(GridAxis("losses", "loss", LOSSES),),
    train=train,
    score=score,
    evaluate=_evaluate,
    cell_dir=lambda config: config.loss,
    report=Reporting(
        select=_select,
        summarize=_summarize,
        table=format_table,
    ),
    tools=Tools(eval_options=EvalOptions, viz=_viz, viz_options=VizOptions, parse=_parse),
)
