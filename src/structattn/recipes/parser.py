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
import torch.nn.functional as F
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
from ..distributions import DependencyCRF, NonProjectiveDependencyCRF, structured_nll
from ..training import Task, TrainConfig, fit, load_model_state
from ..trees import projectivize
from . import runs
from .base import GridAxis, Preset, Recipe, markdown_table
from .config import config_from_dict, config_to_dict, replace_path

__all__ = [
    "RECIPE",
    "ArcParser",
    "ParserConfig",
    "WordFeatures",
    "build_model",
    "load_trained",
    "parse_sentences",
    "predict_heads",
    "tag_accuracy",
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
    parser_layers: int = 1  # BiLSTM layers of the arc scorer (the NLI layer's: 1)
    embeddings: str = ""  # GloVe-format vectors ("": ../shared/data/glove/glove.6B.50d.10k.txt)
    normalize: bool = True  # unit-normalise the pretrained vectors
    unknown_buckets: int = 100  # words without a vector: one of this many N(0, 1) vectors
    arc_scale: float = 1.0  # the loss's CRF sees arc_scale * theta (theta is tanh-bounded to
    # [-1, 1], so 1 keeps the trees flat; MAP trees do not depend on it; a pretrained NLI
    # layer uses theta unscaled)
    word_min_count: int = 0  # >0: a trained vector (size hidden_dim, added to the projected
    # fixed vector) for each lower-cased training word seen at least this often, <unk> for rest
    word_dropout: float = 0.0  # training: a word's trained vector is <unk>'s with this chance
    char_dim: int = 0  # >0: a character CNN (chars of this size, width 3, hidden_dim filters,
    # max-pooled) added to each word's vector
    max_chars: int = 20  # the character CNN reads at most the first this many characters
    upos: bool = False  # add a trained vector of the gold UPOS tag (needs tagged input; the
    # NLI sentences have none)
    upos_aux: float = 0.0  # >0: weight of an auxiliary UPOS tagging loss on the scorer's
    # first BiLSTM layer (training only: the parser still reads words alone)
    dropout: float = 0.0  # dropout on the word vectors entering the BiLSTM (training only)
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
        for name in ("hidden_dim", "parser_dim", "parser_layers", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if not self.arc_scale > 0:
            raise ValueError(f"`arc_scale` must be positive, got {self.arc_scale}")
        for name in ("max_train", "max_eval", "unknown_buckets", "word_min_count", "char_dim"):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}")
        if self.max_chars < 1:
            raise ValueError(f"`max_chars` must be >= 1, got {self.max_chars}")
        if not self.upos_aux >= 0:
            raise ValueError(f"`upos_aux` must be >= 0, got {self.upos_aux}")
        for name in ("dropout", "word_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"`{name}` must be in [0, 1), got {getattr(self, name)}")


class WordFeatures:
    """Vocabularies of the parser-side word inputs beside the fixed vectors (``None``: the
    input is not used) and the batch encoding of all of them.

    ``trained``: lower-cased training words seen at least ``word_min_count`` times (``<unk>``
    for the rest); ``chars``: the characters of the training words (``<unk>`` for others),
    at most ``max_chars`` per word (the first ones); ``tags``: UPOS tags read as input;
    ``targets``: UPOS tags predicted by the auxiliary tagger (``upos_aux``; not an input).
    """

    def __init__(
        self,
        trained: WordVocabulary | None = None,
        chars: WordVocabulary | None = None,
        tags: WordVocabulary | None = None,
        max_chars: int = 20,
        targets: WordVocabulary | None = None,
    ) -> None:
        self.trained, self.chars, self.tags, self.max_chars = trained, chars, tags, max_chars
        self.targets = targets

    @classmethod
    def build(cls, config: ParserConfig, train: Sequence[ConlluSentence]) -> WordFeatures:
        """The vocabularies ``config`` asks for, from the training sentences."""

        def ranked(counts: Counter[str], min_count: int = 1) -> WordVocabulary:
            kept = tuple(item for item, c in counts.most_common() if c >= min_count)
            return WordVocabulary(WordVocabulary.SPECIALS + kept)

        trained = chars = tags = targets = None
        if config.word_min_count:
            words = Counter(w.lower() for s in train for w in s.words)
            trained = ranked(words, config.word_min_count)
        if config.char_dim:
            chars = ranked(Counter(ch for s in train for w in s.words for ch in w))
        if config.upos or config.upos_aux:
            upos = ranked(Counter(t for s in train for t in s.upos))
            tags = upos if config.upos else None
            targets = upos if config.upos_aux else None
        return cls(trained, chars, tags, config.max_chars, targets)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (the ``extra`` of the parser's checkpoints)."""
        out: dict[str, Any] = {"max_chars": self.max_chars}
        for name in ("trained", "chars", "tags", "targets"):
            vocabulary = getattr(self, name)
            out[name] = None if vocabulary is None else vocabulary.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> WordFeatures:
        """Inverse of :meth:`to_dict` (``None``: no extra inputs, a run of older code)."""
        if not data:
            return cls()
        trained, chars, tags, targets = (
            None if data.get(name) is None else WordVocabulary.from_dict(data[name])
            for name in ("trained", "chars", "tags", "targets")
        )
        return cls(trained, chars, tags, int(data["max_chars"]), targets)

    def encode(
        self,
        sentences: Sequence[Sequence[str]],
        tags: Sequence[Sequence[str]] | None,
        device: torch.device,
    ) -> dict[str, Tensor]:
        """``trained`` [B, N], ``chars`` [B, N, C] and ``tags`` [B, N] ids (0 = padding) of
        the inputs in use."""
        width = max(len(s) for s in sentences)
        out: dict[str, Tensor] = {}
        if self.trained is not None:
            lowered = [[w.lower() for w in s] for s in sentences]
            out["trained"] = _padded_ids(self.trained, lowered, device, width)
        if self.chars is not None:
            span = min(self.max_chars, max(len(w) for s in sentences for w in s))
            ids = torch.zeros(len(sentences), width, span, dtype=torch.long)
            for b, s in enumerate(sentences):
                for i, w in enumerate(s):
                    ids[b, i, : min(len(w), span)] = torch.tensor(self.chars.encode(list(w[:span])))
            out["chars"] = ids.to(device)
        if self.tags is not None:
            if tags is None:
                raise ValueError("this parser reads UPOS tags (trained with --upos): give them")
            out["tags"] = _padded_ids(self.tags, tags, device, width)
        return out

    def encode_targets(self, tags: Sequence[Sequence[str]], device: torch.device) -> Tensor:
        """UPOS target ids [B, N] of the auxiliary tagger (0 = padding; ``<unk>`` for a tag
        unseen in training)."""
        if self.targets is None:
            raise ValueError("this parser has no auxiliary tagger (upos_aux = 0)")
        return _padded_ids(self.targets, tags, device)


def _padded_ids(
    vocabulary: WordVocabulary,
    sequences: Sequence[Sequence[str]],
    device: torch.device,
    width: int | None = None,
) -> Tensor:
    """Ids [B, N] of each sequence's items in ``vocabulary``, right-padded with 0 to ``width``
    (default: the longest sequence)."""
    width = max(len(s) for s in sequences) if width is None else width
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    for b, items in enumerate(sequences):
        ids[b, : len(items)] = torch.tensor(vocabulary.encode(list(items)))
    return ids.to(device)


class ArcParser(nn.Module):
    """Arc scores theta [B, N+1, N+1] (ROOT at 0; theta[b, h, m]: h heads m) of word ids.

    ``embed`` (fixed table [V, E]) -> ``project`` (E -> H) -> plus the optional parser-side
    inputs of ``features`` (a trained vector of the word, a character CNN, a UPOS vector; each
    [B, N, H]) -> dropout -> ROOT vector prepended -> ``scorer`` (:class:`BiLSTMArcScorer`);
    with ``features.targets`` a linear ``tagger`` on the scorer's first BiLSTM layer predicts
    each word's UPOS (:meth:`scores_and_tags`; the auxiliary loss of ``upos_aux``).
    The names ``project``, ``root`` and ``scorer`` match
    :class:`~structattn.models.DecomposableAttention`'s projection and its
    ``syntactic.root`` / ``syntactic.scorer`` (the NLI layer has no parser-side inputs).
    """

    def __init__(
        self,
        table: Tensor,
        hidden_dim: int,
        parser_dim: int,
        features: WordFeatures | None = None,
        char_dim: int = 0,
        dropout: float = 0.0,
        layers: int = 1,
    ) -> None:
        super().__init__()
        self.features = features or WordFeatures()
        self.embed = nn.Embedding.from_pretrained(table.float(), freeze=True, padding_idx=0)
        self.project = nn.Linear(table.shape[1], hidden_dim)
        self.root = nn.Parameter(torch.zeros(hidden_dim))
        self.scorer = BiLSTMArcScorer(hidden_dim, parser_dim, layers)
        f = self.features
        self.word_embed = (
            None if f.trained is None else nn.Embedding(len(f.trained), hidden_dim, padding_idx=0)
        )
        if self.word_embed is not None:
            nn.init.normal_(self.word_embed.weight, std=0.1)
            self.word_embed.weight.data[0].zero_()
        self.char_embed = (
            None if f.chars is None else nn.Embedding(len(f.chars), char_dim, padding_idx=0)
        )
        self.char_conv = None if f.chars is None else nn.Conv1d(char_dim, hidden_dim, 3, padding=1)
        self.tag_embed = (
            None if f.tags is None else nn.Embedding(len(f.tags), hidden_dim, padding_idx=0)
        )
        self.dropout = nn.Dropout(dropout)
        self.tagger = None if f.targets is None else nn.Linear(2 * parser_dim, len(f.targets))

    def char_vectors(self, chars: Tensor) -> Tensor:
        """Max-pooled character CNN of char ids [B, N, C] (0 = padding) -> [B, N, H] (zeros
        for padding words)."""
        assert self.char_embed is not None and self.char_conv is not None
        b, n, c = chars.shape
        flat = chars.reshape(b * n, c)
        x = self.char_conv(self.char_embed(flat).transpose(1, 2))  # [B*N, H, C]
        x = x.masked_fill((flat == 0).unsqueeze(1), float("-inf")).amax(-1)  # [B*N, H]
        x = x.masked_fill((flat[:, :1] == 0), 0.0)  # padding words: no characters
        return x.reshape(b, n, -1)

    def word_vectors(self, words: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
        """Word representations [B, N, H] of word ids [B, N] and the ``inputs`` of
        :meth:`WordFeatures.encode` (before dropout)."""
        x = self.project(self.embed(words))  # [B, N, H]
        for name, module in (("trained", self.word_embed), ("tags", self.tag_embed)):
            if module is not None:
                if name not in inputs:
                    raise ValueError(f"this parser needs the `{name}` input")
                x = x + module(inputs[name])
        if self.char_embed is not None:
            if "chars" not in inputs:
                raise ValueError("this parser needs the `chars` input")
            x = x + self.char_vectors(inputs["chars"])
        return x

    def _with_root(self, vectors: Tensor) -> Tensor:
        """The scorer's input [B, N+1, H]: ROOT, then the word vectors [B, N, H] after
        dropout."""
        root = self.root.expand(vectors.shape[0], 1, -1)
        return torch.cat([root, self.dropout(vectors)], dim=1)

    def score_vectors(self, vectors: Tensor, lengths: Tensor) -> Tensor:
        """Arc scores [B, N+1, N+1] of word vectors [B, N, H] with ``lengths`` [B] words."""
        return self.scorer(self._with_root(vectors), lengths + 1)

    def scores_and_tags(
        self, words: Tensor, lengths: Tensor, **inputs: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """Arc scores [B, N+1, N+1] as :meth:`forward` and the auxiliary tagger's UPOS logits
        [B, N, T] of each word (``None`` without a tagger)."""
        x = self._with_root(self.word_vectors(words, inputs))
        states = self.scorer.states(x, lengths + 1)
        tags = None if self.tagger is None else self.tagger(states[0][:, 1:])
        return self.scorer.arc_scores(states[-1]), tags

    def forward(self, words: Tensor, lengths: Tensor, **inputs: Tensor) -> Tensor:
        """Arc scores of word ids [B, N] (0 = padding) with ``lengths`` [B] words and the
        parser-side ``inputs`` of :meth:`WordFeatures.encode` (``trained``, ``chars``,
        ``tags``) that ``features`` asks for."""
        return self.score_vectors(self.word_vectors(words, inputs), lengths)


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
    lengths = torch.tensor([len(s) for s in sentences])  # [B]
    return _padded_ids(words, sentences, device), lengths.to(device)


def build_model(
    config: ParserConfig, table: Tensor, features: WordFeatures | None = None
) -> ArcParser:
    """The parser of ``config`` over the fixed ``table`` [V, E] with the vocabularies of its
    parser-side inputs."""
    return ArcParser(
        table,
        config.hidden_dim,
        config.parser_dim,
        features,
        config.char_dim,
        config.dropout,
        config.parser_layers,
    )


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
    tags: Sequence[Sequence[str]] | None = None,
) -> list[list[int]]:
    """MAP heads (0 = ROOT, 1-based) of each tokenised sentence (words in ``words``; UPOS
    ``tags`` of each word for a parser trained with them)."""
    return _predict(model, words, sentences, device, decoder, batch_size, tags)[0]


def _predict(
    model: ArcParser,
    words: WordVocabulary,
    sentences: Sequence[Sequence[str]],
    device: torch.device | str,
    decoder: str,
    batch_size: int,
    tags: Sequence[Sequence[str]] | None,
) -> tuple[list[list[int]], list[list[int]] | None]:
    """(MAP heads, the auxiliary tagger's UPOS target ids per word or None) in one pass of
    the scorer per batch."""
    device = torch.device(device)
    model.eval()
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
    out: list[list[int]] = [[] for _ in sentences]
    tagged: list[list[int]] | None = None if model.tagger is None else [[] for _ in sentences]
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        batch = [sentences[i] for i in chunk]
        ids, lengths = _encode(batch, words, device)
        inputs = model.features.encode(
            batch, None if tags is None else [tags[i] for i in chunk], device
        )
        theta, logits = model.scores_and_tags(ids, lengths, **inputs)
        heads = _decode(theta, lengths, decoder).tolist()
        guesses = None if logits is None else logits.argmax(-1).tolist()
        for row, i in enumerate(chunk):
            out[i] = heads[row][1 : 1 + len(sentences[i])]
            if tagged is not None and guesses is not None:
                tagged[i] = guesses[row][: len(sentences[i])]
    return out, tagged


def parse_sentences(
    model: ArcParser,
    config: ParserConfig,
    sentences: Sequence[Sequence[str]],
    device: torch.device | str = "cpu",
    tags: Sequence[Sequence[str]] | None = None,
) -> list[list[int]]:
    """MAP heads of any tokenised sentences: their words get vectors by the parser's own
    embedding settings (the same vector for the same word), then :func:`predict_heads`
    (``tags``: UPOS of each word, for a parser trained with ``upos``)."""
    for i, s in enumerate(sentences):
        if not s:
            raise ValueError(f"sentence {i} has no words")
    words = word_vocabulary(sentences)
    table = _table(config, words).to(next(model.parameters()).device)
    original = model.embed
    model.embed = nn.Embedding.from_pretrained(table, freeze=True, padding_idx=0)
    try:
        return predict_heads(model, words, sentences, device, config.decoder, tags=tags)
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
    heads, tagged = _predict(
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
    tagged = _predict(model, words, words_only, device, "eisner", batch_size, upos)[1]
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

    Batch = tuple[Tensor, Tensor, Tensor, dict[str, Tensor], Tensor | None]

    def collate(batch: Sequence[ConlluSentence], dev: torch.device) -> Batch:
        ids, lengths = _encode([s.words for s in batch], words, dev)
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
    path = runs.resolve_run(RECIPE, checkpoint)
    state = load_model_state(path)
    if state["config"].get("recipe") != "parser":
        raise ValueError(f"{path} is not a parser run (recipe {state['config'].get('recipe')!r})")
    config = config_from_dict(ParserConfig, state["config"])
    words = WordVocabulary.from_dict(state["extra"]["vocab"])
    features = WordFeatures.from_dict(state["extra"].get("features"))
    model = build_model(config, state["model"]["embed.weight"], features)
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
    variant="loss",
    variants=LOSSES,
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
