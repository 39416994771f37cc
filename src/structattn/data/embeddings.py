"""Pretrained word vectors in GloVe's text format and embedding matrices built from them.

* :func:`read_word_vectors` reads ``word v1 ... vD`` lines (GloVe; a word2vec ``N D`` header
  line is skipped; words containing spaces, as in GloVe 840B, are kept whole). Malformed
  lines raise ``ValueError("<file>:<line>: ...")``: a wrong number of values, a value that
  is not a number.
* :func:`build_embedding_matrix` makes the ``[V, D]`` matrix of a vocabulary: the pretrained
  vector of each word found (exactly, else lower-cased), optionally unit-normalised, and for
  the other words one of ``unknown_buckets`` fixed Gaussian vectors chosen by a
  deterministic hash of the word (Kim et al. 2017, A.5: "hashed to one of 100 Gaussian
  embeddings with mean 0 and standard deviation 1"). ``<pad>`` is the zero vector.
  :class:`EmbeddingCoverage` counts the word types and tokens that the table covers.
* :func:`word_bucket` is the hash: BLAKE2b of the UTF-8 word, so it does not change across
  processes (Python's ``hash()`` of a string is salted per process).

The default file is ``<data root>/glove/glove.6B.50d.10k.txt`` (:func:`default_glove_path`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..io import read_utf8, shared_data_dir
from ._vocab import TokenVocabulary

__all__ = [
    "DEFAULT_GLOVE_FILE",
    "EmbeddingCoverage",
    "EmbeddingMatrix",
    "WordVectors",
    "build_embedding_matrix",
    "default_glove_path",
    "embedding_table",
    "read_word_vectors",
    "unknown_vectors",
    "word_bucket",
]

DEFAULT_GLOVE_FILE = "glove.6B.50d.10k.txt"
"""The shipped GloVe file (10k most frequent words of GloVe 6B, 50 dimensions, lower-case)."""


def default_glove_path() -> Path:
    """``<root>/glove/glove.6B.50d.10k.txt`` for the first data root with a ``glove`` folder
    (:func:`structattn.io.data_dir`); ``FileNotFoundError`` when none has one."""
    folder = shared_data_dir("glove", what="GloVe vectors", hint=" or --embeddings PATH")
    return folder / DEFAULT_GLOVE_FILE


@dataclass(frozen=True)
class WordVectors:
    """Words and their vectors as read from a file (in file order)."""

    words: tuple[str, ...]  # words[i] is the word of vectors[i]
    vectors: Tensor  # FloatTensor[V, D]
    path: str  # the file they came from
    duplicates: int = 0  # lines whose word was seen before (the first vector is kept)

    def __post_init__(self) -> None:
        if self.vectors.dim() != 2 or self.vectors.shape[0] != len(self.words):
            raise ValueError(
                f"vectors must be [{len(self.words)}, D], got {tuple(self.vectors.shape)}"
            )

    def __len__(self) -> int:
        return len(self.words)

    @property
    def dim(self) -> int:
        """D, the size of a vector."""
        return int(self.vectors.shape[1])

    def index(self) -> dict[str, int]:
        """Word -> row of :attr:`vectors`."""
        return {w: i for i, w in enumerate(self.words)}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_word_vectors(
    path: str | os.PathLike[str] | None = None,
    words: Iterable[str] | None = None,
    max_words: int | None = None,
) -> WordVectors:
    """Vectors of a GloVe-format text file (``None``: :func:`default_glove_path`).

    ``words`` keeps only those words (each also matched lower-cased, as the lookup of
    :func:`build_embedding_matrix` does), which saves memory for large files; ``max_words``
    stops after that many lines of vectors. The dimension D is the number of values on the
    first line. Errors name ``<file>:<line>``: a line with another number of values, a value
    that is not a number, an empty word or file.
    """
    path = default_glove_path() if path is None else Path(path)
    wanted: set[str] | None = None
    if words is not None:
        wanted = set()
        for w in words:
            wanted.update((w, w.lower()))
    lines = read_utf8(path).split("\n")
    kept: list[str] = []
    rows: list[np.ndarray] = []
    seen: set[str] = set()
    duplicates = 0
    dim: int | None = None
    read = 0
    for lineno, raw in enumerate(lines, start=1):
        line = raw.rstrip("\r\n")
        if not line.strip():
            if lineno == len(lines):
                break  # the final line end
            raise ValueError(f"{path}:{lineno}: empty line")
        parts = line.rstrip(" ").split(" ")
        if dim is None:
            if lineno == 1 and len(parts) == 2 and all(p.isdigit() for p in parts):
                dim = int(parts[1])  # a word2vec header "count dim"
                if dim < 1:
                    raise ValueError(f"{path}:1: header gives dimension {dim}")
                continue
            dim = len(parts) - 1
            if dim < 1:
                raise ValueError(f"{path}:{lineno}: a word without values")
        if max_words is not None and read >= max_words:
            break
        read += 1
        if len(parts) < dim + 1 or (len(parts) > dim + 1 and _is_number(parts[1])):
            raise ValueError(
                f"{path}:{lineno}: {len(parts) - 1} values, expected {dim} (the first line's)"
            )
        word = " ".join(parts[: len(parts) - dim])  # GloVe 840B has words with spaces
        if not word:
            raise ValueError(f"{path}:{lineno}: empty word")
        if wanted is not None and word not in wanted:
            continue
        if word in seen:
            duplicates += 1
            continue
        try:
            values = np.array(parts[len(parts) - dim :], dtype=np.float32)
        except ValueError:
            bad = next(p for p in parts[len(parts) - dim :] if not _is_number(p))
            raise ValueError(f"{path}:{lineno}: value {bad!r} is not a number") from None
        if not np.isfinite(values).all():
            raise ValueError(f"{path}:{lineno}: a value is not finite")
        seen.add(word)
        kept.append(word)
        rows.append(values)
    if dim is None:
        raise ValueError(
            f"{path}:1: empty file; a cut download or copy? `structattn download glove` fetches "
            "it again"
        )
    matrix = torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, dim)  # [V, D]
    return WordVectors(tuple(kept), matrix, str(path), duplicates)


def word_bucket(word: str, buckets: int = 100) -> int:
    """A bucket in ``[0, buckets)`` for ``word``: BLAKE2b of its UTF-8 bytes, the same in
    every process and on every machine."""
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, got {buckets}")
    digest = hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % buckets


def unknown_vectors(count: int, dim: int, seed: int = 0, std: float = 1.0) -> Tensor:
    """FloatTensor[count, dim] of N(0, std^2) values from a generator seeded with ``seed``
    (the same vectors in every run with that seed)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, dim, generator=generator) * std  # [count, dim]


@dataclass(frozen=True)
class EmbeddingCoverage:
    """How much of a vocabulary (and of the text it came from) has a pretrained vector."""

    types: int  # word types in the vocabulary (special tokens excluded)
    types_covered: int  # of those, types with a pretrained vector
    tokens: int  # running words counted (0 when no counts were given)
    tokens_covered: int  # of those, tokens whose type has a pretrained vector

    @property
    def type_rate(self) -> float:
        """Covered fraction of the types (0 for an empty vocabulary)."""
        return self.types_covered / self.types if self.types else 0.0

    @property
    def token_rate(self) -> float:
        """Covered fraction of the tokens (0 without counts)."""
        return self.tokens_covered / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict[str, float]:
        """JSON-ready counts and rates."""
        return {
            "types": self.types,
            "types_covered": self.types_covered,
            "type_rate": self.type_rate,
            "tokens": self.tokens,
            "tokens_covered": self.tokens_covered,
            "token_rate": self.token_rate,
        }

    def __str__(self) -> str:
        text = f"{self.types_covered}/{self.types} types ({100 * self.type_rate:.1f}%)"
        if self.tokens:
            text += f", {self.tokens_covered}/{self.tokens} tokens ({100 * self.token_rate:.1f}%)"
        return text + " have a pretrained vector"


@dataclass(frozen=True)
class EmbeddingMatrix:
    """An embedding table for a vocabulary and where each row came from."""

    weight: Tensor  # FloatTensor[V, D], row i for vocabulary id i
    pretrained: Tensor  # BoolTensor[V], True where the row is a pretrained vector
    bucket: Tensor  # LongTensor[V], the unknown-word bucket of a hashed row, -1 elsewhere
    coverage: EmbeddingCoverage  # types / tokens covered


def build_embedding_matrix(
    vocabulary: TokenVocabulary | Sequence[str],
    vectors: WordVectors,
    counts: Mapping[str, int] | None = None,
    normalize: bool = True,
    unknown_buckets: int = 100,
    seed: int = 0,
    unknown_std: float = 1.0,
    lower_fallback: bool = True,
) -> EmbeddingMatrix:
    """The ``[V, D]`` table of ``vocabulary`` (a :class:`TokenVocabulary` or its tokens, id =
    position) from ``vectors``.

    A word takes its pretrained vector (unit-normalised when ``normalize``; a zero vector
    stays zero); with ``lower_fallback`` a word not found takes its lower-cased form's vector
    (GloVe 6B is lower-case). ``<pad>`` (a :class:`TokenVocabulary`'s id 0) is all zeros.
    Every other word, ``<unk>`` included, takes row :func:`word_bucket` ``(word,
    unknown_buckets)`` of :func:`unknown_vectors` ``(unknown_buckets, D, seed, unknown_std)``;
    ``unknown_buckets=0`` gives them zeros. ``counts`` (word -> count in the text, e.g. the
    training set) fills the token coverage.
    """
    if unknown_buckets < 0:
        raise ValueError(f"unknown_buckets must be >= 0, got {unknown_buckets}")
    is_vocab = isinstance(vocabulary, TokenVocabulary)
    tokens = tuple(vocabulary.tokens if isinstance(vocabulary, TokenVocabulary) else vocabulary)
    specials = set(TokenVocabulary.SPECIALS) if is_vocab else set()
    index = vectors.index()
    dim = vectors.dim
    table = vectors.vectors.float()
    if normalize:
        norms = table.norm(dim=1, keepdim=True)  # [V', 1]
        table = table / norms.clamp_min(1e-12)
    gaussian = unknown_vectors(max(unknown_buckets, 1), dim, seed, unknown_std)  # [K, D]
    weight = torch.zeros(len(tokens), dim)  # [V, D]
    pretrained = torch.zeros(len(tokens), dtype=torch.bool)  # [V]
    bucket = torch.full((len(tokens),), -1, dtype=torch.long)  # [V]
    types = types_covered = n_tokens = tokens_covered = 0
    for i, word in enumerate(tokens):
        if is_vocab and word == TokenVocabulary.PAD:
            continue
        row = index.get(word)
        if row is None and lower_fallback:
            row = index.get(word.lower())
        if row is not None:
            weight[i] = table[row]
            pretrained[i] = True
        elif unknown_buckets:
            bucket[i] = word_bucket(word, unknown_buckets)
            weight[i] = gaussian[bucket[i]]
        if word in specials:
            continue
        types += 1
        types_covered += row is not None
        if counts is not None:
            n = int(counts.get(word, 0))
            n_tokens += n
            tokens_covered += n if row is not None else 0
    coverage = EmbeddingCoverage(types, types_covered, n_tokens, tokens_covered)
    return EmbeddingMatrix(weight, pretrained, bucket, coverage)


def embedding_table(
    words: TokenVocabulary,
    embeddings: str,
    normalize: bool,
    buckets: int,
    counts: Mapping[str, int] | None = None,
) -> EmbeddingMatrix:
    """The fixed ``[V, E]`` table of ``words``: the vectors of ``embeddings`` ("" = the
    shipped GloVe file), unknown words hashed to one of ``buckets`` Gaussian vectors. The
    same word always gets the same row, so models over different vocabularies (the parser's,
    the NLI model's) see the same inputs."""
    vectors = read_word_vectors(embeddings or None, words=words.tokens)
    return build_embedding_matrix(
        words, vectors, counts=counts, normalize=normalize, unknown_buckets=buckets
    )
