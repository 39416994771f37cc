"""Parallel corpora for translation: line-aligned ``<split>.<src>`` / ``<split>.<tgt>`` files.

The layout of ``small_parallel_enja`` (50k / 500 / 500 Japanese-English pairs of the Tanaka
corpus, Japanese segmented by KyTea, English tokenized and lower-cased), the stand-in for the
WAT data of Kim et al. (2017, sec. 4.2)::

    train.ja   誰 が 一番 に 着 く か 私 に は 分か り ま せ ん 。
    train.en   i can 't tell who will arrive first .

Line i of the source file is the translation of line i of the target file; tokens are
separated by spaces. A source can be read as words (the given tokens) or as characters (the
line with the spaces removed, one token per character: the character-to-word setting).

Malformed input raises ``ValueError("<file>:<line>: ...")``: bytes that are not UTF-8, an
empty line (only a final newline is allowed), and files of different line counts.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from ..io import empty_file_error, read_utf8, shared_data_dir
from ._vocab import TokenVocabulary

__all__ = [
    "PARALLEL_SPLITS",
    "FilterReport",
    "ParallelPair",
    "TranslationVocabulary",
    "default_enja_data_dir",
    "filter_pairs",
    "read_lines",
    "read_parallel",
    "source_tokens",
    "type_counts",
]

#: split names and file stems of a parallel corpus directory
PARALLEL_SPLITS = ("train", "dev", "test")
SourceUnit = Literal["char", "word"]


@dataclass(frozen=True)
class ParallelPair:
    """One sentence pair, tokens as in the files (the source as words)."""

    source: tuple[str, ...]  # source words (KyTea tokens for Japanese)
    target: tuple[str, ...]  # target words
    line: int  # 1-based line number in both files

    @property
    def source_chars(self) -> int:
        """Characters of the source without spaces."""
        return sum(map(len, self.source))


def source_tokens(pair: ParallelPair, unit: SourceUnit) -> tuple[str, ...]:
    """The source as words (``"word"``) or as characters without the spaces (``"char"``)."""
    if unit == "word":
        return pair.source
    if unit == "char":
        return tuple("".join(pair.source))
    raise ValueError(f"`unit` must be 'char' or 'word', got {unit!r}")


def read_lines(path: str | os.PathLike[str], allow_empty: bool = False) -> list[tuple[str, ...]]:
    """The whitespace-separated tokens of every line of a UTF-8 file. Errors name the file and
    line: invalid UTF-8, and (unless ``allow_empty``) an empty or blank line; one final
    newline is fine. A file with no line at all is an error even with ``allow_empty`` (a cut
    download or copy: the error names ``structattn download small_parallel_enja``)."""
    text = read_utf8(path)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline
    if not lines:
        raise empty_file_error(path, "one sentence per line", "small_parallel_enja")
    out = []
    for lineno, line in enumerate(lines, 1):
        tokens = tuple(line.split())
        if not tokens and not allow_empty:
            raise ValueError(f"{path}:{lineno}: empty line (every line must hold a sentence)")
        out.append(tokens)
    return out


def read_parallel(
    source_path: str | os.PathLike[str], target_path: str | os.PathLike[str]
) -> list[ParallelPair]:
    """Line-aligned pairs of two files; a different number of lines is an error naming the
    first line that has no partner."""
    sources = read_lines(source_path)
    targets = read_lines(target_path)
    if len(sources) != len(targets):
        shorter, longer = source_path, target_path
        if len(sources) > len(targets):
            shorter, longer = target_path, source_path
        first = min(len(sources), len(targets)) + 1
        raise ValueError(
            f"{longer}:{first}: no matching line in {shorter} ({len(sources)} source lines, "
            f"{len(targets)} target lines)"
        )
    return [ParallelPair(s, t, i) for i, (s, t) in enumerate(zip(sources, targets, strict=True), 1)]


@dataclass(frozen=True)
class FilterReport:
    """How many pairs a length filter kept."""

    total: int  # pairs read
    kept: int  # pairs within both limits
    long_source: int  # pairs whose source is over the limit
    long_target: int  # pairs whose target is over the limit


def filter_pairs(
    pairs: Sequence[ParallelPair], max_source_chars: int | None, max_target_words: int | None
) -> tuple[list[ParallelPair], FilterReport]:
    """The paper's filter: source at most ``max_source_chars`` characters (spaces not
    counted), target at most ``max_target_words`` words (None = no limit)."""
    long_source = long_target = 0
    kept = []
    for pair in pairs:
        too_long_source = max_source_chars is not None and pair.source_chars > max_source_chars
        too_long_target = max_target_words is not None and len(pair.target) > max_target_words
        long_source += too_long_source
        long_target += too_long_target
        if not (too_long_source or too_long_target):
            kept.append(pair)
    return kept, FilterReport(len(pairs), len(kept), long_source, long_target)


def type_counts(sequences: Iterable[Sequence[str]]) -> Counter[str]:
    """Token counts over sequences."""
    counts: Counter[str] = Counter()
    for tokens in sequences:
        counts.update(tokens)
    return counts


class TranslationVocabulary(TokenVocabulary):
    """Token <-> id map of one side of a translation corpus: ``<pad>`` 0, ``<unk>`` 1,
    ``<s>`` 2, ``</s>`` 3, then the tokens by decreasing frequency (ties by code point).

    >>> vocab = TranslationVocabulary.build([("a", "b", "a"), ("a", "c")], min_count=2)
    >>> vocab.tokens
    ('<pad>', '<unk>', '<s>', '</s>', 'a')
    >>> vocab.encode(["a", "b"])
    [4, 1]
    """

    BOS: ClassVar[str] = "<s>"
    EOS: ClassVar[str] = "</s>"
    SPECIALS: ClassVar[tuple[str, ...]] = (TokenVocabulary.PAD, TokenVocabulary.UNK, BOS, EOS)
    KIND: ClassVar[str] = "structattn.TranslationVocabulary"

    @classmethod
    def build(cls, sequences: Iterable[Sequence[str]], min_count: int = 1) -> TranslationVocabulary:
        """The specials plus every token seen at least ``min_count`` times."""
        if min_count < 1:
            raise ValueError(f"`min_count` must be >= 1, got {min_count}")
        counts = type_counts(sequences)
        kept = sorted(
            (t for t, c in counts.items() if c >= min_count and t not in cls.SPECIALS),
            key=lambda t: (-counts[t], t),
        )
        return cls(cls.SPECIALS + tuple(kept))

    @property
    def bos_id(self) -> int:
        """Id of ``<s>`` (2)."""
        return 2

    @property
    def eos_id(self) -> int:
        """Id of ``</s>`` (3)."""
        return 3


def default_enja_data_dir() -> Path:
    """``<root>/small_parallel_enja`` (see :func:`structattn.io.data_dir`)."""
    return shared_data_dir("small_parallel_enja", what="small_parallel_enja")
