"""A first-order graph-based dependency parser (the pipeline / pretraining parser of Kim et
al. 2017, sec. 4.4) and its decoding.

:class:`ArcParser` is the NLI model's syntactic attention layer on its own: fixed word vectors
(:func:`~structattn.data.embeddings.embedding_table`), a trained projection, a learned ROOT
vector and the BiLSTM + MLP arc scorer of :class:`~structattn.attention.BiLSTMArcScorer`
(Appendix A.1), plus optional parser-side inputs (:class:`WordFeatures`). Its parameter names
match :class:`~structattn.models.DecomposableAttention`'s, so a trained parser initialises
the NLI layer (:func:`copy_parser_layer`). The ``parser`` recipe trains it.

The functions here take the recipe's config through small protocols
(:class:`FeatureSettings`, :class:`ParserShape`, :class:`ParserInputs`): any object with those
fields will do.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ..attention import BiLSTMArcScorer
from ..data.batching import pad_sequences
from ..data.classification import WordVocabulary, word_vocabulary
from ..data.conllu import ConlluSentence
from ..data.embeddings import embedding_table
from ..distributions import DependencyCRF, NonProjectiveDependencyCRF
from .nli import DecomposableAttention

__all__ = [
    "ArcParser",
    "FeatureSettings",
    "ParserInputs",
    "ParserShape",
    "WordFeatures",
    "build_arc_parser",
    "copy_parser_layer",
    "decode_heads",
    "encode_words",
    "parse_sentences",
    "predict_heads",
    "predict_heads_and_tags",
]


class FeatureSettings(Protocol):
    """The fields of a parser config that :meth:`WordFeatures.build` reads."""

    @property
    def word_min_count(self) -> int: ...  # >0: trained vectors of words seen this often
    @property
    def char_dim(self) -> int: ...  # >0: a character CNN
    @property
    def max_chars(self) -> int: ...  # characters read per word
    @property
    def upos(self) -> bool: ...  # UPOS tags as input
    @property
    def upos_aux(self) -> float: ...  # >0: an auxiliary UPOS tagger


class ParserShape(Protocol):
    """The fields of a parser config that :func:`build_arc_parser` reads."""

    @property
    def hidden_dim(self) -> int: ...  # projected word vectors
    @property
    def parser_dim(self) -> int: ...  # BiLSTM (per direction) and MLP size of the scorer
    @property
    def parser_layers(self) -> int: ...  # BiLSTM layers of the scorer
    @property
    def char_dim(self) -> int: ...  # character vectors of the CNN
    @property
    def dropout(self) -> float: ...  # on the word vectors entering the BiLSTM


class ParserInputs(Protocol):
    """The fields of a parser config that :func:`parse_sentences` reads."""

    @property
    def embeddings(self) -> str: ...  # GloVe-format vectors ("": the shipped file)
    @property
    def normalize(self) -> bool: ...  # unit-normalise them
    @property
    def unknown_buckets(self) -> int: ...  # hashed Gaussian vectors of unknown words
    @property
    def decoder(self) -> str: ...  # "eisner" or "cle"


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
    def build(cls, config: FeatureSettings, train: Sequence[ConlluSentence]) -> WordFeatures:
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
    (default: the longest sequence), on ``device``."""
    rows = [vocabulary.encode(list(items)) for items in sequences]
    return pad_sequences(rows, width=width, device=device)


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


def build_arc_parser(
    config: ParserShape, table: Tensor, features: WordFeatures | None = None
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


def copy_parser_layer(model: DecomposableAttention, parser: ArcParser) -> None:
    """Copy the parser's projection, ROOT vector and arc scorer into the NLI ``model``'s
    syntactic attention layer (the ``pretrained`` variant; sizes must match)."""
    assert model.syntactic is not None and model.syntactic.root is not None
    with torch.no_grad():
        model.project.load_state_dict(parser.project.state_dict())
        model.syntactic.root.copy_(parser.root)
        model.syntactic.scorer.load_state_dict(parser.scorer.state_dict())


def encode_words(
    sentences: Sequence[Sequence[str]], words: WordVocabulary, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Word ids [B, N] (0 = padding) and ``lengths`` [B] of tokenised ``sentences``."""
    lengths = torch.tensor([len(s) for s in sentences])  # [B]
    return _padded_ids(words, sentences, device), lengths.to(device)


def decode_heads(scores: Tensor, lengths: Tensor, decoder: str) -> Tensor:
    """MAP heads [B, N+1] (-1 at ROOT and padding), one child of ROOT, of arc ``scores``
    [B, N+1, N+1] with ``lengths`` [B] words: Eisner (``"eisner"``, projective) or
    Chu-Liu-Edmonds (``"cle"``)."""
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
    return predict_heads_and_tags(model, words, sentences, device, decoder, batch_size, tags)[0]


def predict_heads_and_tags(
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
        ids, lengths = encode_words(batch, words, device)
        inputs = model.features.encode(
            batch, None if tags is None else [tags[i] for i in chunk], device
        )
        theta, logits = model.scores_and_tags(ids, lengths, **inputs)
        heads = decode_heads(theta, lengths, decoder).tolist()
        guesses = None if logits is None else logits.argmax(-1).tolist()
        for row, i in enumerate(chunk):
            out[i] = heads[row][1 : 1 + len(sentences[i])]
            if tagged is not None and guesses is not None:
                tagged[i] = guesses[row][: len(sentences[i])]
    return out, tagged


def parse_sentences(
    model: ArcParser,
    config: ParserInputs,
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
    table = embedding_table(
        words, config.embeddings, config.normalize, config.unknown_buckets
    ).weight.to(next(model.parameters()).device)
    original = model.embed
    model.embed = nn.Embedding.from_pretrained(table, freeze=True, padding_idx=0)
    try:
        return predict_heads(model, words, sentences, device, config.decoder, tags=tags)
    finally:
        model.embed = original
