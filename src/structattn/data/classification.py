"""Sentence and sentence-pair classification: examples, label and word vocabularies, padded
length-bucketed batches, and readers for SICK, SNLI and the Stanford Sentiment Treebank.

* :class:`ClassificationExample` holds one tokenised sentence (``tokens``) or pair
  (``tokens`` = premise, ``pair`` = hypothesis), a string label and where it came from.
* :class:`LabelVocabulary` fixes the class order (:data:`NLI_LABELS`,
  :data:`SST_FINE_LABELS`, :data:`SST_BINARY_LABELS`: an SST label's id is its class number).
* :class:`WordVocabulary` (``<pad>`` 0, ``<unk>`` 1) and :func:`make_batches`: padded
  ``[B, L]`` ids, lengths, labels and the examples' indices, with batches of similar length
  (shuffled buckets for training, sorted for evaluation).
* Metrics are :func:`structattn.metrics.accuracy` and
  :class:`structattn.metrics.ConfusionMatrix`.

Readers (errors read ``"<file>:<line>: ..."``):

* :func:`read_sick`: ``SICK.txt`` (TAB-separated, header, CRLF), entailment label,
  ``SemEval_set`` TRAIN / TRIAL / TEST -> ``train`` / ``valid`` / ``test``; sentences
  tokenised by :func:`tokenize` (PTB-style: ``isn't`` -> ``is n't``, commas split off).
* :func:`read_snli`: the parallel ``s1.<split>`` / ``s2.<split>`` / ``labels.<split>`` files
  (the shared dev/test copy, already tokenised); :func:`read_snli_jsonl`: the official
  ``snli_1.0_<split>.jsonl``, where pairs with gold label ``-`` (no annotator majority) are
  skipped and counted.
* :func:`read_sst`: PTB-format sentiment trees, root label of each sentence (and, with
  ``phrases=True``, every labelled phrase); ``binary`` drops neutral (2), maps 0-1 to
  ``negative`` and 3-4 to ``positive``.

>>> tokenize("A man isn't playing the boy's guitar, 3.5 times")
['A', 'man', 'is', "n't", 'playing', 'the', 'boy', "'s", 'guitar', ',', '3.5', 'times']
"""

from __future__ import annotations

import json
import os
import random
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from ..io import empty_file_error, read_utf8, shared_data_dir
from ._vocab import TokenVocabulary

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "NLI_LABELS",
    "SST_BINARY_LABELS",
    "SST_FINE_LABELS",
    "ClassificationBatch",
    "ClassificationExample",
    "LabelVocabulary",
    "SSTNode",
    "WordVocabulary",
    "default_classification_data_dir",
    "length_buckets",
    "make_batches",
    "parse_sst_tree",
    "read_sick",
    "read_snli",
    "read_snli_jsonl",
    "read_sst",
    "split_holdout",
    "tokenize",
    "word_vocabulary",
]

NLI_LABELS: tuple[str, ...] = ("entailment", "neutral", "contradiction")
"""NLI classes in SNLI's usual order (SICK's upper-case labels are lower-cased)."""
SST_FINE_LABELS: tuple[str, ...] = (
    "very negative",
    "negative",
    "neutral",
    "positive",
    "very positive",
)
"""SST fine-grained classes; the id of each is its label 0-4 in the trees."""
SST_BINARY_LABELS: tuple[str, ...] = ("negative", "positive")
"""SST binary classes: 0 = negative (0-1 in the trees), 1 = positive (3-4)."""

_TOKEN = re.compile(
    r"n't\b|'(?:s|re|ve|ll|d|m)\b|\w+(?=n't\b)|\w+(?:[-.]\w+)*|[^\w\s]", re.IGNORECASE
)


def tokenize(text: str) -> list[str]:
    """PTB-style tokens: words (with inner ``-`` and ``.``), ``n't`` and ``'s``, ``'re``,
    ``'ve``, ``'ll``, ``'d``, ``'m`` split off, every other symbol on its own. Case is kept."""
    return _TOKEN.findall(text)


# ----------------------------------------------------------------------------- examples


@dataclass(frozen=True)
class ClassificationExample:
    """One labelled sentence or sentence pair."""

    tokens: tuple[str, ...]  # the sentence (the premise of a pair)
    label: str  # class name, e.g. "entailment" or "positive"
    pair: tuple[str, ...] | None = None  # the hypothesis of a pair; None for one sentence
    index: int = 0  # 0-based index among the examples read from the source (before skips)
    source: str = ""  # "<file>:<line>" it was read from
    score: float | None = None  # SICK relatedness (1-5); None elsewhere

    def to_dict(self) -> dict[str, object]:
        """JSON-ready fields (tokens joined with spaces)."""
        return {
            "index": self.index,
            "sentence": " ".join(self.tokens),
            **({} if self.pair is None else {"pair": " ".join(self.pair)}),
            "label": self.label,
        }


@dataclass(frozen=True)
class LabelVocabulary:
    """Class names <-> ids in a fixed order; an unknown label raises ``ValueError``."""

    labels: tuple[str, ...]
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    KIND: ClassVar[str] = "structattn.LabelVocabulary"

    def __post_init__(self) -> None:
        labels = tuple(self.labels)
        if not labels or len(set(labels)) != len(labels):
            raise ValueError(f"labels must be non-empty and distinct, got {labels}")
        object.__setattr__(self, "labels", labels)
        object.__setattr__(self, "_index", {label: i for i, label in enumerate(labels)})

    @classmethod
    def build(cls, examples: Iterable[ClassificationExample]) -> LabelVocabulary:
        """The labels of ``examples`` in sorted order (prefer a fixed order such as
        :data:`NLI_LABELS` where one exists)."""
        return cls(tuple(sorted({ex.label for ex in examples})))

    def __len__(self) -> int:
        return len(self.labels)

    def __contains__(self, label: object) -> bool:
        return label in self._index

    def encode(self, label: str) -> int:
        """Id of ``label``."""
        try:
            return self._index[label]
        except KeyError:
            raise ValueError(f"unknown label {label!r}; labels are {self.labels}") from None

    def decode(self, index: int) -> str:
        """Label of id ``index``."""
        j = int(index)
        if not 0 <= j < len(self.labels):
            raise ValueError(f"label id {j} out of range for {len(self.labels)} labels")
        return self.labels[j]

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready description for checkpoints."""
        return {"kind": self.KIND, "version": 1, "labels": list(self.labels)}

    @classmethod
    def from_dict(cls, state: Mapping[str, object]) -> LabelVocabulary:
        """Inverse of :meth:`to_dict`."""
        if state.get("kind") != cls.KIND or state.get("version") != 1:
            raise ValueError(f"not a version-1 {cls.KIND} dict")
        labels = state.get("labels")
        if not isinstance(labels, list):
            raise ValueError("label vocabulary dict needs a list of 'labels'")
        return cls(tuple(labels))


@dataclass(frozen=True)
class WordVocabulary(TokenVocabulary):
    """Words of the sentences (and pairs): ``<pad>`` 0, ``<unk>`` 1, then the words by
    decreasing count (ties: first occurrence). Build it from the training examples
    (:meth:`build`) or from any sentences, without examples (:meth:`from_sentences`):

    >>> words = WordVocabulary.from_sentences(["the cat sat", ["the", "dog"]])
    >>> words.tokens
    ('<pad>', '<unk>', 'the', 'cat', 'sat', 'dog')
    >>> words.encode("the bird".split())
    [2, 1]
    """

    KIND: ClassVar[str] = "structattn.WordVocabulary"

    @classmethod
    def build(
        cls,
        examples: Iterable[ClassificationExample],
        min_count: int = 1,
        max_size: int | None = None,
        lower: bool = False,
    ) -> WordVocabulary:
        """Words of the examples' sentences (and pairs) seen at least ``min_count`` times, at
        most ``max_size`` entries in all; ``lower`` lower-cases them (then encode lower-cased
        tokens too)."""
        return cls.from_sentences(
            (s for ex in examples for s in (ex.tokens, ex.pair or ())),
            min_count=min_count,
            max_size=max_size,
            lower=lower,
        )

    @classmethod
    def from_sentences(
        cls,
        sentences: Iterable[Sequence[str] | str],
        min_count: int = 1,
        max_size: int | None = None,
        lower: bool = False,
    ) -> WordVocabulary:
        """The vocabulary of plain sentences, no :class:`ClassificationExample` needed: each
        sentence is a sequence of tokens, or a string split on whitespace (tokenise it first,
        e.g. with :func:`tokenize`, for another rule). Words seen at least ``min_count`` times
        (a positive int), at most ``max_size`` entries in all (``<pad>`` and ``<unk>``
        included: at least 2); ``lower`` lower-cases them (then encode lower-cased tokens
        too). The special tokens are never counted as words."""
        if isinstance(sentences, str):
            raise ValueError(
                "sentences must be an iterable of sentences, got one string (wrap it in a list)"
            )
        if not isinstance(min_count, int) or min_count < 1:
            raise ValueError(f"min_count must be a positive int, got {min_count!r}")
        if max_size is not None and (not isinstance(max_size, int) or max_size < 2):
            raise ValueError(f"max_size must be None or an int >= 2, got {max_size!r}")
        counts: Counter[str] = Counter()
        for k, sentence in enumerate(sentences):
            tokens = sentence.split() if isinstance(sentence, str) else sentence
            if not all(isinstance(t, str) for t in tokens):
                raise ValueError(f"sentence {k} is not a string or a sequence of strings")
            counts.update([t.lower() for t in tokens] if lower else tokens)
        for special in cls.SPECIALS:
            counts.pop(special, None)
        counts.pop("", None)
        words = [w for w, c in counts.most_common() if c >= min_count]
        if max_size is not None:
            words = words[: max_size - len(cls.SPECIALS)]
        return cls(cls.SPECIALS + tuple(words))


def word_vocabulary(sentences: Iterable[Sequence[str]]) -> WordVocabulary:
    """The words of tokenised ``sentences`` by decreasing count (``<pad>`` 0, ``<unk>`` 1
    first; ties: first occurrence): :meth:`WordVocabulary.from_sentences` with its
    defaults."""
    return WordVocabulary.from_sentences(sentences)


# ----------------------------------------------------------------------------- batches


@dataclass(frozen=True)
class ClassificationBatch:
    """Padded ids of a batch (``<pad>`` = 0 on the right)."""

    tokens: Tensor  # LongTensor[B, L] word ids of the sentences (premises)
    lengths: Tensor  # LongTensor[B] words per sentence
    pair: Tensor | None  # LongTensor[B, L2] ids of the hypotheses, None for single sentences
    pair_lengths: Tensor | None  # LongTensor[B]
    labels: Tensor  # LongTensor[B] label ids
    indices: Tensor  # LongTensor[B] positions of the examples in the list given

    @property
    def mask(self) -> Tensor:
        """BoolTensor[B, L], True at real words."""
        import torch

        return torch.arange(self.tokens.shape[1]) < self.lengths[:, None]  # [B, L]

    @property
    def pair_mask(self) -> Tensor | None:
        """BoolTensor[B, L2], True at real words of the hypotheses."""
        import torch

        if self.pair is None or self.pair_lengths is None:
            return None
        return torch.arange(self.pair.shape[1]) < self.pair_lengths[:, None]  # [B, L2]


def _pad(rows: Sequence[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    import torch

    from .batching import pad_sequences  # imports torch: not at this module's import

    ids = pad_sequences(rows, pad_id)  # [B, L]
    return ids, torch.tensor([len(r) for r in rows], dtype=torch.long)


def length_buckets(
    lengths: Sequence[int], batch_size: int, rng: random.Random, bucket_batches: int = 50
) -> list[list[int]]:
    """Training batches of indices into ``lengths``: shuffled with ``rng``, each run of
    ``bucket_batches * batch_size`` indices sorted by length (less padding) and cut into
    batches of at most ``batch_size``, then the batches shuffled with ``rng``."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    span = bucket_batches * batch_size
    chunks: list[list[int]] = []
    for start in range(0, len(order), span):
        bucket = sorted(order[start : start + span], key=lengths.__getitem__)
        chunks.extend(bucket[i : i + batch_size] for i in range(0, len(bucket), batch_size))
    rng.shuffle(chunks)
    return chunks


def make_batches(
    examples: Sequence[ClassificationExample],
    words: TokenVocabulary,
    labels: LabelVocabulary,
    batch_size: int,
    order: Literal["bucket", "sorted", "original"] = "bucket",
    seed: int = 0,
    bucket_batches: int = 50,
    lower: bool = False,
) -> Iterator[ClassificationBatch]:
    """Batches of at most ``batch_size`` examples, padded to their longest sentence.

    ``order``: ``"bucket"`` (training) shuffles with ``seed``, sorts each run of
    ``bucket_batches * batch_size`` examples by length, cuts it into batches and shuffles
    the batches, so a batch has similar lengths but the order changes with the seed (pass
    ``seed=epoch``); ``"sorted"`` (evaluation) sorts all examples by length, longest first;
    ``"original"`` keeps the list's order. The length of a pair is that of its longer
    sentence. ``batch.indices`` maps each row back to ``examples``. An example with no words
    raises ``ValueError`` naming its source.
    """
    if isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if bucket_batches < 1:
        raise ValueError(f"bucket_batches must be >= 1, got {bucket_batches}")
    for ex in examples:
        if not ex.tokens or (ex.pair is not None and not ex.pair):
            raise ValueError(f"{ex.source or f'example {ex.index}'}: a sentence has no words")
    pairs = {ex.pair is not None for ex in examples}
    if len(pairs) > 1:
        raise ValueError("a batch mixes single sentences and pairs")

    def size(i: int) -> int:
        ex = examples[i]
        return max(len(ex.tokens), len(ex.pair or ()))

    positions = list(range(len(examples)))
    chunks: list[list[int]]
    if order == "original":
        chunks = [positions[i : i + batch_size] for i in range(0, len(positions), batch_size)]
    elif order == "sorted":
        positions.sort(key=lambda i: (-size(i), i))
        chunks = [positions[i : i + batch_size] for i in range(0, len(positions), batch_size)]
    elif order == "bucket":
        rng = random.Random(f"structattn.classification:{seed}")
        sizes = [size(i) for i in positions]
        chunks = length_buckets(sizes, batch_size, rng, bucket_batches)
    else:
        raise ValueError(f"order must be 'bucket', 'sorted' or 'original', got {order!r}")

    import torch

    def ids(sentence: Sequence[str]) -> list[int]:
        return words.encode(t.lower() for t in sentence) if lower else words.encode(sentence)

    for chunk in chunks:
        batch = [examples[i] for i in chunk]
        tokens, lengths = _pad([ids(ex.tokens) for ex in batch], words.pad_id)
        pair = pair_lengths = None
        if batch[0].pair is not None:
            pair, pair_lengths = _pad([ids(ex.pair or ()) for ex in batch], words.pad_id)
        yield ClassificationBatch(
            tokens=tokens,
            lengths=lengths,
            pair=pair,
            pair_lengths=pair_lengths,
            labels=torch.tensor([labels.encode(ex.label) for ex in batch], dtype=torch.long),
            indices=torch.tensor(chunk, dtype=torch.long),
        )


def split_holdout(
    examples: Sequence[ClassificationExample], fraction: float, seed: int = 0
) -> tuple[list[ClassificationExample], list[ClassificationExample]]:
    """``(kept, held_out)``: a seeded ``round(fraction * n)`` examples held out (e.g. 10% of
    SNLI dev for validation when dev is the training set); both keep the input order."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    order = list(range(len(examples)))
    random.Random(f"structattn.holdout:{seed}").shuffle(order)
    held = set(order[: round(fraction * len(examples))])
    kept = [ex for i, ex in enumerate(examples) if i not in held]
    return kept, [ex for i, ex in enumerate(examples) if i in held]


# ----------------------------------------------------------------------------- NLI readers


def default_classification_data_dir(name: Literal["sick", "snli_devtest", "sst"]) -> Path:
    """``<root>/<name>`` for the first data root that has it (:func:`structattn.io.data_dir`:
    ``$STRUCTATTN_DATA``, the user cache, ``../shared/data``); ``FileNotFoundError`` else."""
    return shared_data_dir(name, what=f"data set {name!r}")


_SICK_COLUMNS = ("pair_ID", "sentence_A", "sentence_B", "entailment_label")
_SICK_SPLITS = {"TRAIN": "train", "TRIAL": "valid", "TEST": "test"}


def read_sick(path: str | os.PathLike[str]) -> dict[str, list[ClassificationExample]]:
    """``{"train", "valid", "test"}`` from ``SICK.txt``: SemEval_set TRAIN / TRIAL / TEST,
    premise = sentence_A, hypothesis = sentence_B (both :func:`tokenize`-d), label =
    entailment_label lower-cased, ``score`` = relatedness_score. CRLF or LF line ends.

    Errors (``"<path>:<line>: ..."``): a header without the needed columns, a row with
    another number of fields, an unknown label or split, an empty sentence, a score that is
    not a number; an empty file or one without a pair after the header (a cut download;
    the error names ``structattn download sick``).
    """
    text = read_utf8(path)
    lines = text.split("\n")
    if lines and lines[-1] in ("", "\r"):
        lines.pop()
    if not lines:
        raise empty_file_error(path, "SICK's header and TAB-separated pairs", "sick")
    header = lines[0].rstrip("\r").split("\t")
    missing = [c for c in (*_SICK_COLUMNS, "relatedness_score", "SemEval_set") if c not in header]
    if missing:
        raise ValueError(f"{path}:1: header lacks the column(s) {missing}")
    if not any(line.strip() for line in lines[1:]):
        raise ValueError(
            f"{path}: no sentence pairs after the header; a cut download or copy? "
            "`structattn download sick` fetches it again"
        )
    col = {name: header.index(name) for name in header}
    splits: dict[str, list[ClassificationExample]] = {s: [] for s in _SICK_SPLITS.values()}
    for lineno, line in enumerate(lines[1:], start=2):
        where = f"{path}:{lineno}"
        fields = line.rstrip("\r").split("\t")
        if len(fields) != len(header):
            raise ValueError(f"{where}: {len(fields)} fields, expected {len(header)}")
        label = fields[col["entailment_label"]].strip().lower()
        if label not in NLI_LABELS:
            raise ValueError(f"{where}: unknown entailment label {label!r}")
        split = _SICK_SPLITS.get(fields[col["SemEval_set"]].strip())
        if split is None:
            raise ValueError(f"{where}: unknown SemEval_set {fields[col['SemEval_set']]!r}")
        premise = tokenize(fields[col["sentence_A"]])
        hypothesis = tokenize(fields[col["sentence_B"]])
        if not premise or not hypothesis:
            raise ValueError(f"{where}: empty sentence")
        try:
            score = float(fields[col["relatedness_score"]])
        except ValueError:
            raise ValueError(f"{where}: relatedness score is not a number") from None
        splits[split].append(
            ClassificationExample(
                tokens=tuple(premise),
                pair=tuple(hypothesis),
                label=label,
                index=lineno - 2,
                source=where,
                score=score,
            )
        )
    return splits


def _text_lines(path: Path) -> list[str]:
    lines = read_utf8(path).split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for lineno, line in enumerate(lines, start=1):
        if "\r" in line:
            raise ValueError(f"{path}:{lineno}: carriage return in line (Windows line ending?)")
    return lines


def read_snli(
    data_dir: str | os.PathLike[str], split: Literal["train", "dev", "test"]
) -> list[ClassificationExample]:
    """Pairs from the parallel files ``s1.<split>`` (premises), ``s2.<split>`` (hypotheses)
    and ``labels.<split>`` (InferSent / e-SNLI layout, already tokenised: split on
    whitespace). The files must have the same number of lines; a ``-`` label or an empty
    sentence raises ``ValueError("<file>:<line>: ...")`` (this layout holds gold-labelled
    pairs only), and so does an empty file."""
    directory = Path(data_dir)
    paths = [directory / f"{name}.{split}" for name in ("s1", "s2", "labels")]
    s1, s2, labels = (_text_lines(p) for p in paths)
    for path, lines in zip(paths, (s1, s2, labels), strict=True):
        if not lines:
            raise empty_file_error(path, "one sentence or label per line", "snli_devtest")
    if not len(s1) == len(s2) == len(labels):
        raise ValueError(
            f"{directory}: {len(s1)} premises, {len(s2)} hypotheses and {len(labels)} labels "
            f"for split {split!r}"
        )
    out = []
    for i, (premise, hypothesis, label) in enumerate(zip(s1, s2, labels, strict=True)):
        lineno = i + 1
        label = label.strip()
        if label not in NLI_LABELS:
            raise ValueError(f"{paths[2]}:{lineno}: label {label!r} is not one of {NLI_LABELS}")
        for path, sentence in ((paths[0], premise), (paths[1], hypothesis)):
            if not sentence.split():
                raise ValueError(f"{path}:{lineno}: empty sentence")
        out.append(
            ClassificationExample(
                tokens=tuple(premise.split()),
                pair=tuple(hypothesis.split()),
                label=label,
                index=i,
                source=f"{paths[2]}:{lineno}",
            )
        )
    return out


def _parse_leaves(binary_parse: str) -> list[str]:
    return binary_parse.replace("(", " ").replace(")", " ").split()


def read_snli_jsonl(path: str | os.PathLike[str]) -> tuple[list[ClassificationExample], int]:
    """``(examples, skipped)`` from an official SNLI / MultiNLI ``.jsonl`` file: one JSON
    object per line with ``sentence1``, ``sentence2`` and ``gold_label``. Pairs whose gold
    label is ``-`` (no majority among the annotators) are skipped and counted in
    ``skipped``; ``index`` is the line's 0-based position, skipped lines included. Tokens
    come from ``sentence1_binary_parse`` / ``sentence2_binary_parse`` when present (SNLI's
    own tokenisation), else from :func:`tokenize`. Errors name the file and line; an empty
    file is an error (a file of only ``-`` pairs gives ``([], skipped)``: it was read)."""
    examples: list[ClassificationExample] = []
    skipped = 0
    lines = _text_lines(Path(path))
    if not lines:
        raise empty_file_error(path, "one JSON object per line", "snli")
    for lineno, line in enumerate(lines, start=1):
        where = f"{path}:{lineno}"
        if not line.strip():
            raise ValueError(f"{where}: empty line")
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err.msg})") from None
        if not isinstance(row, dict) or not {"sentence1", "sentence2", "gold_label"} <= set(row):
            raise ValueError(f"{where}: needs 'sentence1', 'sentence2' and 'gold_label'")
        label = row["gold_label"]
        if label == "-":
            skipped += 1
            continue
        if label not in NLI_LABELS:
            raise ValueError(f"{where}: gold_label {label!r} is not one of {NLI_LABELS} or '-'")
        sentences = []
        for k in ("1", "2"):
            parse = row.get(f"sentence{k}_binary_parse")
            tokens = (
                _parse_leaves(parse) if isinstance(parse, str) else tokenize(row[f"sentence{k}"])
            )
            if not tokens:
                raise ValueError(f"{where}: sentence{k} is empty")
            sentences.append(tuple(tokens))
        examples.append(
            ClassificationExample(
                tokens=sentences[0], pair=sentences[1], label=label, index=lineno - 1, source=where
            )
        )
    return examples, skipped


# ----------------------------------------------------------------------------- SST


@dataclass(frozen=True)
class SSTNode:
    """A node of a sentiment tree: its label 0-4 and either a word (leaf) or children."""

    label: int  # 0 very negative .. 4 very positive
    children: tuple[SSTNode, ...] = ()  # empty for a leaf
    word: str | None = None  # the word of a leaf

    def leaves(self) -> list[str]:
        """The words under the node, left to right."""
        if self.word is not None:
            return [self.word]
        return [w for child in self.children for w in child.leaves()]

    def nodes(self) -> Iterator[SSTNode]:
        """Every node, pre-order (the root first)."""
        yield self
        for child in self.children:
            yield from child.nodes()


# "(label" | ")" | text with a non-space character (whitespace between brackets is skipped)
_SST_PIECE = re.compile(r"\(\s*([^\s()]*)|(\))|([^()]*[^()\s][^()]*)")
_SST_LABELS = {"0": 0, "1": 1, "2": 2, "3": 3, "4": 4}


def parse_sst_tree(line: str, where: str = "<tree>") -> SSTNode:
    """Parse ``(3 (2 It) (4 (2 's) (4 great)))``; ``ValueError("<where>: ...")`` on
    unbalanced brackets, a label outside 0-4, a node without a word or children, a word
    beside children, or text after the tree.

    A leaf's word is its text up to ``)``: the one leaf with inner whitespace in SST
    (``8<NBSP> 1\\/2``, the film) becomes one word with each whitespace run replaced by
    ``_`` (``8_1\\/2``), so sentences joined with spaces split back correctly.

    >>> parse_sst_tree("(3 (2 It) (4 (2 's) (4 great)))").leaves()
    ['It', "'s", 'great']
    """
    stack: list[tuple[int, list[SSTNode], list[str]]] = []  # (label, children, word pieces)
    root: SSTNode | None = None
    for k, (label, close, text) in enumerate(_SST_PIECE.findall(line)):
        if root is not None:
            raise ValueError(f"{where}: text after the tree (piece {k + 1}): {line[-20:]!r}")
        if close:
            if not stack:
                raise ValueError(f"{where}: unbalanced ')' (piece {k + 1})")
            value, children, words = stack.pop()
            if words:
                node = SSTNode(label=value, word="_".join(words))
            elif children:
                node = SSTNode(label=value, children=tuple(children))
            else:
                raise ValueError(f"{where}: node with label {value} has no word or children")
            if stack:
                stack[-1][1].append(node)
            else:
                root = node
        elif text:
            if not stack:
                raise ValueError(f"{where}: expected '(', found {text.strip()[:20]!r}")
            if stack[-1][1]:
                raise ValueError(f"{where}: a word and a subtree in one node (piece {k + 1})")
            stack[-1][2].extend(text.split())
        else:
            if label not in _SST_LABELS:
                raise ValueError(f"{where}: expected a label 0-4 after '(', found {label!r}")
            if stack and stack[-1][2]:
                raise ValueError(f"{where}: a word and a subtree in one node (piece {k + 1})")
            stack.append((_SST_LABELS[label], [], []))
    if root is None:
        raise ValueError(f"{where}: expected ')' at the end of the line (unbalanced brackets)")
    return root


def _sst_label(label: int, task: str) -> str | None:
    if task == "fine":
        return SST_FINE_LABELS[label]
    return None if label == 2 else SST_BINARY_LABELS[label > 2]


def read_sst(
    path: str | os.PathLike[str],
    task: Literal["fine", "binary"] = "fine",
    phrases: bool = False,
) -> list[ClassificationExample]:
    """Examples from a file of SST trees (one per line).

    Without ``phrases``: one example per sentence, its words and root label. With
    ``phrases``: every node of every tree (the sentence first, then its phrases in pre-order,
    single words included) with its own label, duplicates within a tree kept (the usual
    phrase-level training set). ``task="binary"`` drops neutral (2) items and maps 0-1 to
    ``negative`` and 3-4 to ``positive`` (labels of :data:`SST_BINARY_LABELS`);
    ``"fine"`` uses :data:`SST_FINE_LABELS`. ``index`` is the tree's 0-based line index.
    Sentence counts (shared copy): fine 8,544 / 1,101 / 2,210, binary 6,920 / 872 / 1,821.
    An empty file raises ``ValueError`` naming it (``binary`` of a file of only neutral trees
    gives ``[]``: the file was read, every tree dropped; recipes refuse the empty split).
    """
    if task not in ("fine", "binary"):
        raise ValueError(f"task must be 'fine' or 'binary', got {task!r}")
    lines = _text_lines(Path(path))
    if not lines:
        raise empty_file_error(path, "SST trees, one per line", "sst")
    out = []
    for lineno, line in enumerate(lines, start=1):
        where = f"{path}:{lineno}"
        if not line.strip():
            raise ValueError(f"{where}: empty line")
        tree = parse_sst_tree(line, where)
        for node in tree.nodes() if phrases else (tree,):
            label = _sst_label(node.label, task)
            if label is not None:
                out.append(
                    ClassificationExample(
                        tokens=tuple(node.leaves()), label=label, index=lineno - 1, source=where
                    )
                )
    return out
