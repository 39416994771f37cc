"""Recipe: a first-order graph-based dependency parser on UD English-EWT, trained with the
tree CRF's negative log-likelihood (the pretraining / pipeline parser of Kim et al. 2017,
sec. 4.4: the ``hard-parent`` and ``pretrained`` variants of the ``nli`` recipe).

The parser is the NLI model's syntactic attention layer on its own: fixed word vectors
(GloVe, unknown words hashed to Gaussian vectors; :func:`~structattn.recipes.nli.embedding_table`),
a trained linear projection, a learned ROOT vector and the BiLSTM + MLP arc scorer of
:class:`~structattn.attention.BiLSTMArcScorer` (Appendix A.1), so its trained weights can
initialise the NLI model's. Loss: ``structured_nll`` of the gold tree under
:class:`~structattn.NonProjectiveDependencyCRF` (matrix-tree theorem: every EWT tree, the
non-projective ones too) or, with ``loss=projective``, of the projectivised gold tree under
:class:`~structattn.DependencyCRF`; decoding: Eisner (projective MAP) or Chu-Liu-Edmonds.
Reported: UAS on EWT dev and test with and without punctuation, seconds per epoch.
"""

from __future__ import annotations

import json
import random
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..attention import BiLSTMArcScorer
from ..data.classification import WordVocabulary
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
from ..distributions import (
    DependencyCRF,
    NonProjectiveDependencyCRF,
    projectivize,
    structured_nll,
)
from ..training import Task, TrainConfig, fit, load_model_state
from . import runs
from ._config import config_from_dict, config_to_dict, replace_path
from .base import GridAxis, Preset, Recipe, markdown_table

__all__ = [
    "RECIPE",
    "ArcParser",
    "ParserConfig",
    "load_trained",
    "parse_sentences",
    "predict_heads",
    "word_vocabulary",
    "score",
    "train",
]

LOSSES = ("non-projective", "projective")
SPLITS = ("train", "dev", "test")

#: Kim et al. 2017, sec. 4.4: the parsing layer pretrained for one epoch with Adam 0.01
PAPER_TRAIN = TrainConfig(epochs=1, lr=0.01, optimizer="adam", max_grad_norm=5.0, log_every=100)


@dataclass(frozen=True)
class ParserConfig:
    """Settings of the parser (defaults: those of the NLI model's parsing layer)."""

    loss: Literal["non-projective", "projective"] = "non-projective"  # the CRF of the loss
    decoder: Literal["eisner", "cle"] = "eisner"  # MAP trees: projective or not
    hidden_dim: int = 300  # projected word vectors (the NLI model's hidden_dim)
    parser_dim: int = 50  # BiLSTM (per direction) and MLP size of the arc scorer
    embeddings: str = ""  # GloVe-format vectors ("": ../shared/data/glove/glove.6B.50d.10k.txt)
    normalize: bool = True  # unit-normalise the pretrained vectors
    unknown_buckets: int = 100  # words without a vector: one of this many N(0, 1) vectors
    arc_scale: float = 1.0  # the loss's CRF sees arc_scale * theta (theta is tanh-bounded to
    # [-1, 1], so 1 keeps the trees flat; MAP trees do not depend on it; a pretrained NLI
    # layer uses theta unscaled)
    batch_size: int = 32  # sentences per batch
    max_train: int = 0  # use only the first this many training sentences (0: all)
    max_eval: int = 0  # score only the first this many dev / test sentences (0: all)
    data_dir: str = ""  # folder of en_ewt-ud-{train,dev,test}.conllu ("": shared data)
    train: TrainConfig = field(default_factory=lambda: PAPER_TRAIN)  # optimisation

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"`loss` must be one of {LOSSES}, got {self.loss!r}")
        if self.decoder not in ("eisner", "cle"):
            raise ValueError(f"`decoder` must be eisner or cle, got {self.decoder!r}")
        for name in ("hidden_dim", "parser_dim", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if not self.arc_scale > 0:
            raise ValueError(f"`arc_scale` must be positive, got {self.arc_scale}")
        if self.max_train < 0 or self.max_eval < 0 or self.unknown_buckets < 0:
            raise ValueError("`max_train`, `max_eval` and `unknown_buckets` must be >= 0")


class ArcParser(nn.Module):
    """Arc scores theta [B, N+1, N+1] (ROOT at 0; theta[b, h, m]: h heads m) of word ids.

    ``embed`` (fixed table [V, E]) -> ``project`` (E -> H) -> ROOT vector prepended ->
    ``scorer`` (:class:`BiLSTMArcScorer`). The names ``project``, ``root`` and ``scorer``
    match :class:`~structattn.models.DecomposableAttention`'s projection and its
    ``syntactic.root`` / ``syntactic.scorer``.
    """

    def __init__(self, table: Tensor, hidden_dim: int, parser_dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding.from_pretrained(table.float(), freeze=True, padding_idx=0)
        self.project = nn.Linear(table.shape[1], hidden_dim)
        self.root = nn.Parameter(torch.zeros(hidden_dim))
        self.scorer = BiLSTMArcScorer(hidden_dim, parser_dim)

    def score_vectors(self, vectors: Tensor, lengths: Tensor) -> Tensor:
        """Arc scores [B, N+1, N+1] of word vectors [B, N, E] with ``lengths`` [B] words."""
        x = self.project(vectors)  # [B, N, H]
        root = self.root.expand(x.shape[0], 1, -1)
        return self.scorer(torch.cat([root, x], dim=1), lengths + 1)  # [B, N+1, N+1]

    def forward(self, words: Tensor, lengths: Tensor) -> Tensor:
        """Arc scores of word ids [B, N] (0 = padding) with ``lengths`` [B] words."""
        return self.score_vectors(self.embed(words), lengths)


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


def word_vocabulary(sentences: Sequence[Sequence[str]]) -> WordVocabulary:
    """The words of ``sentences`` by decreasing count (``<pad>`` 0, ``<unk>`` 1 first)."""
    counts = Counter(w for s in sentences for w in s)
    for special in WordVocabulary.SPECIALS:
        counts.pop(special, None)
    return WordVocabulary(WordVocabulary.SPECIALS + tuple(w for w, _ in counts.most_common()))


def _table(config: ParserConfig, words: WordVocabulary) -> Tensor:
    from .nli import embedding_table

    return embedding_table(
        words, config.embeddings, config.normalize, config.unknown_buckets
    ).weight


def _encode(
    sentences: Sequence[Sequence[str]], words: WordVocabulary, device: torch.device
) -> tuple[Tensor, Tensor]:
    width = max(len(s) for s in sentences)
    ids = torch.zeros(len(sentences), width, dtype=torch.long)  # [B, N]
    for b, s in enumerate(sentences):
        ids[b, : len(s)] = torch.tensor(words.encode(s))
    lengths = torch.tensor([len(s) for s in sentences])  # [B]
    return ids.to(device), lengths.to(device)


def _decode(scores: Tensor, lengths: Tensor, decoder: str) -> Tensor:
    """MAP heads [B, N+1] (-1 at ROOT and padding), one child of ROOT."""
    crf = DependencyCRF if decoder == "eisner" else NonProjectiveDependencyCRF
    return crf(scores.double(), lengths + 1, multiroot=False).argmax


@torch.no_grad()
def predict_heads(
    model: ArcParser,
    words: WordVocabulary,
    sentences: Sequence[Sequence[str]],
    device: torch.device | str = "cpu",
    decoder: str = "eisner",
    batch_size: int = 128,
) -> list[list[int]]:
    """MAP heads (0 = ROOT, 1-based) of each tokenised sentence (words in ``words``)."""
    device = torch.device(device)
    model.eval()
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
    out: list[list[int]] = [[] for _ in sentences]
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        ids, lengths = _encode([sentences[i] for i in chunk], words, device)
        heads = _decode(model(ids, lengths), lengths, decoder).tolist()
        for i, row in zip(chunk, heads, strict=True):
            out[i] = row[1 : 1 + len(sentences[i])]
    return out


def parse_sentences(
    model: ArcParser,
    config: ParserConfig,
    sentences: Sequence[Sequence[str]],
    device: torch.device | str = "cpu",
) -> list[list[int]]:
    """MAP heads of any tokenised sentences: their words get vectors by the parser's own
    embedding settings (the same vector for the same word), then :func:`predict_heads`."""
    for i, s in enumerate(sentences):
        if not s:
            raise ValueError(f"sentence {i} has no words")
    words = word_vocabulary(sentences)
    table = _table(config, words).to(next(model.parameters()).device)
    original = model.embed
    model.embed = nn.Embedding.from_pretrained(table, freeze=True, padding_idx=0)
    try:
        return predict_heads(model, words, sentences, device, config.decoder)
    finally:
        model.embed = original


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
    heads = predict_heads(model, words, [s.words for s in sentences], device, config.decoder)
    scores = attachment_scores(sentences, heads)
    return {
        "uas": 100 * scores.uas,
        "uas_no_punct": 100 * scores.uas_no_punct,
        "words": scores.words,
        "sentences": len(sentences),
    }, heads


def train(config: ParserConfig, run_dir: str | Path, resume: bool = False) -> dict[str, Any]:
    """Train the parser into ``run_dir``; returns fit's summary (best model on dev UAS)."""
    run_dir = Path(run_dir)
    splits = load_data(config)
    words = _vocabulary(splits)
    if resume:
        saved = load_model_state(run_dir, "checkpoint.pt")
        words = WordVocabulary.from_dict(saved["extra"]["vocab"])
    torch.manual_seed(config.train.seed)
    model = ArcParser(_table(config, words), config.hidden_dim, config.parser_dim)
    train_set = splits["train"]
    device = torch.device(config.train.device)

    def batches(epoch: int) -> list[list[ConlluSentence]]:
        order = list(range(len(train_set)))
        rng = random.Random(config.train.seed * 100_003 + epoch)
        rng.shuffle(order)
        span = 50 * config.batch_size  # sort buckets by length: less padding
        chunks: list[list[ConlluSentence]] = []
        for s in range(0, len(order), span):
            bucket = sorted(order[s : s + span], key=lambda i: len(train_set[i]))
            for k in range(0, len(bucket), config.batch_size):
                chunks.append([train_set[i] for i in bucket[k : k + config.batch_size]])
        rng.shuffle(chunks)
        return chunks

    def collate(batch: Sequence[ConlluSentence], dev: torch.device) -> tuple[Tensor, ...]:
        ids, lengths = _encode([s.words for s in batch], words, dev)
        heads, _ = heads_tensor(batch)  # [B, N+1], -1 at ROOT and padding
        return ids, lengths, heads.to(dev)

    def loss(m: nn.Module, batch: tuple[Tensor, ...]) -> tuple[Tensor, Tensor, Tensor]:
        ids, lengths, heads = batch
        scores = config.arc_scale * m(ids, lengths)  # [B, N+1, N+1]
        if config.loss == "projective":
            crf: Any = DependencyCRF(scores, lengths + 1, multiroot=False)
            heads = projectivize(heads, lengths + 1)
        else:
            crf = NonProjectiveDependencyCRF(scores, lengths + 1, multiroot=False)
        nll = structured_nll(crf, heads, reduction="sum")
        return nll, lengths.sum(), lengths.sum()

    def validate(m: nn.Module) -> dict[str, float]:
        assert isinstance(m, ArcParser)
        scores, _ = evaluate(m, words, splits["dev"], config, device)
        return {"metric": scores["uas"] / 100, "uas": scores["uas"]}

    task = Task(
        model=model,
        batches=batches,
        collate=collate,
        loss=loss,
        validate=validate,
        config={"recipe": "parser", **config_to_dict(config)},
        extra={"vocab": words.to_dict()},
    )
    train_config = replace(config.train, name=config.train.name or f"parser {config.loss}")
    return fit(task, replace(train_config, normalize_by="tokens"), run_dir, resume=resume)


def load_trained(
    checkpoint: str | Path, device: str = "cpu"
) -> tuple[ArcParser, WordVocabulary, ParserConfig]:
    """The best parser of a run directory (or its ``model.pt``), its vocabulary and config."""
    path = runs.resolve_run(RECIPE, checkpoint)
    state = load_model_state(path)
    if state["config"].get("recipe") != "parser":
        raise ValueError(f"{path} is not a parser run (recipe {state['config'].get('recipe')!r})")
    config = config_from_dict(ParserConfig, state["config"])
    words = WordVocabulary.from_dict(state["extra"]["vocab"])
    model = ArcParser(state["model"]["embed.weight"], config.hidden_dim, config.parser_dim)
    model.load_state_dict(state["model"])
    return model.to(device).eval(), words, config


def _epoch_seconds(run_dir: Path) -> float | None:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    times = [float(r["time"]) for r in records if r.get("kind") == "epoch"]
    steps = [b - a for a, b in zip([0.0, *times], times, strict=False) if b > a]
    return statistics.median(steps) if steps else None


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
    test["seconds_per_epoch"] = _epoch_seconds(run_dir)
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
    heads = parse_sentences(model, config, [s.words for s in sentences], device)
    if predictions is not None:
        _write_predictions(predictions, sentences, heads)
    if any(s.heads is None for s in sentences):
        return f"{where}: parsed {len(sentences)} sentences (no gold heads to score)"
    scores = attachment_scores(sentences, heads)
    return (
        f"{where} ({len(sentences)} sentences, {scores.words} words, {config.decoder}): "
        f"UAS {100 * scores.uas:.2f}%  without punctuation {100 * scores.uas_no_punct:.2f}%"
    )


def _parse(run_dir: Path, sentences: Sequence[Sequence[str]], device: str) -> list[str]:
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


_CPU = replace_path(ParserConfig(hidden_dim=100), {"train.epochs": 5})
_QUICK = replace_path(
    ParserConfig(hidden_dim=16, parser_dim=8, max_train=64, max_eval=32),
    {"train.epochs": 1, "train.progress": False, "train.log_every": 10},
)

RECIPE = Recipe(
    name="parser",
    summary="Dependency parser on UD English-EWT (tree-CRF NLL; the NLI recipe's pipeline "
    "and pretraining parser): UAS dev / test",
    config=ParserConfig,
    variant="loss",
    variants=LOSSES,
    presets={
        "paper": Preset(ParserConfig(), "sec. 4.4: hidden 300, 1 epoch of Adam 0.01"),
        "cpu": Preset(_CPU, "hidden 100 (the nli cpu preset's), 5 epochs of Adam 0.01"),
        "quick": Preset(_QUICK, "seconds: 64 sentences, 1 epoch, tiny model"),
    },
    train=train,
    score=score,
    select=_select,
    summarize=_summarize,
    cell_dir=lambda config: config.loss,
    grid=(GridAxis("losses", "loss", LOSSES),),
    table=format_table,
    evaluate=_evaluate,
    eval_options=EvalOptions,
    viz=_viz,
    viz_options=VizOptions,
    parse=_parse,
)
