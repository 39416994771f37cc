"""Synthetic tasks of the mean-field attention paper (Liu et al., sec. 3.1-3.2): chunk
counting and sorting, seeded generators and their text files.

- **Counting**: a binary string; the target is the number of chunks of ones (maximal runs of
  ``1``), e.g. ``00100101111`` -> 3. File lines ``BITS<TAB>COUNT``.
- **Sorting**: a sequence of integers in ``[0, max_value]``; the target is the sequence sorted
  in ascending order. File lines ``x1 x2 ...<TAB>y1 y2 ...``.

Every split is drawn from its own seeded generator (``seed``, split name), so the splits do
not depend on each other's sizes; a test split has a fixed number of examples per length.
Readers raise ``ValueError("<file>:<line>: ...")`` on malformed lines.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..io import atomic_write_text, empty_file_error, read_utf8

__all__ = [
    "CountingExample",
    "SortingExample",
    "count_chunks",
    "counting_examples",
    "format_counting",
    "format_sorting",
    "read_counting",
    "read_sorting",
    "sorting_examples",
    "write_examples",
]


@dataclass(frozen=True)
class CountingExample:
    """A binary string and its number of chunks of ones."""

    bits: str  # e.g. "00100101111"
    count: int  # e.g. 3


@dataclass(frozen=True)
class SortingExample:
    """A sequence of integers and the same integers in ascending order."""

    values: tuple[int, ...]
    target: tuple[int, ...]


def count_chunks(bits: str) -> int:
    """Number of maximal runs of ``1`` in ``bits`` (a string of ``0`` and ``1``)."""
    if any(c not in "01" for c in bits):
        raise ValueError(f"`bits` must contain only 0 and 1, got {bits!r}")
    return sum(1 for i, c in enumerate(bits) if c == "1" and (i == 0 or bits[i - 1] == "0"))


def _sizes(
    count: int, lengths: Sequence[int], per_length: int, seed: int, split: str
) -> tuple[list[int], random.Random]:
    """The lengths of a split and its generator (seeded by ``seed`` and the split's name):
    ``count`` lengths drawn uniformly from ``lengths``, or with ``per_length > 0`` every
    length ``per_length`` times."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"`lengths` must be positive, got {list(lengths)}")
    rng = random.Random(f"{seed}:{split}")
    if per_length:
        return [n for n in lengths for _ in range(per_length)], rng
    return [rng.choice(list(lengths)) for _ in range(count)], rng


def counting_examples(
    count: int, lengths: Sequence[int], seed: int, split: str, per_length: int = 0
) -> list[CountingExample]:
    """Seeded binary strings (each bit 1 with probability 1/2) and their chunk counts:
    ``count`` strings of lengths drawn uniformly from ``lengths``, or with ``per_length > 0``
    exactly ``per_length`` strings of every length (test splits; ``count`` is ignored)."""
    sizes, rng = _sizes(count, lengths, per_length, seed, split)
    out = []
    for n in sizes:
        bits = "".join(rng.choice("01") for _ in range(n))
        out.append(CountingExample(bits, count_chunks(bits)))
    return out


def sorting_examples(
    count: int,
    lengths: Sequence[int],
    seed: int,
    split: str,
    max_value: int = 99,
    per_length: int = 0,
) -> list[SortingExample]:
    """Seeded integer sequences (each value uniform in ``[0, max_value]``, repeats allowed)
    and their ascending sort; sizes as :func:`counting_examples`."""
    if max_value < 0:
        raise ValueError(f"`max_value` must be >= 0, got {max_value}")
    sizes, rng = _sizes(count, lengths, per_length, seed, split)
    out = []
    for n in sizes:
        values = tuple(rng.randint(0, max_value) for _ in range(n))
        out.append(SortingExample(values, tuple(sorted(values))))
    return out


def format_counting(example: CountingExample) -> str:
    """``BITS<TAB>COUNT``."""
    return f"{example.bits}\t{example.count}"


def format_sorting(example: SortingExample) -> str:
    """``x1 x2 ...<TAB>y1 y2 ...``."""
    return " ".join(map(str, example.values)) + "\t" + " ".join(map(str, example.target))


def write_examples(path: str | Path, examples: Iterable[CountingExample | SortingExample]) -> Path:
    """Write one example per line (atomically)."""
    lines = [
        format_counting(e) if isinstance(e, CountingExample) else format_sorting(e)
        for e in examples
    ]
    return atomic_write_text(path, "".join(line + "\n" for line in lines))


def _fields(path: str | Path, expected: str) -> list[tuple[int, str, str]]:
    """(line, first field, second field) of every non-blank line of a two-field TAB file;
    a file without one (empty: a cut copy) raises ``ValueError`` naming it and ``expected``."""
    out = []
    for lineno, line in enumerate(read_utf8(path).splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 2:
            raise ValueError(f"{path}:{lineno}: expected two tab-separated fields, got {line!r}")
        out.append((lineno, parts[0].strip(), parts[1].strip()))
    if not out:
        error = empty_file_error(path, expected)
        raise ValueError(f"{error}; `structattn data mfa --out DIR` writes the data") from None
    return out


def read_counting(path: str | Path) -> list[CountingExample]:
    """Examples of a ``BITS<TAB>COUNT`` file; the count must be the string's chunk count.
    An empty file (or one of blank lines) raises ``ValueError`` naming it."""
    out = []
    for lineno, bits, count in _fields(path, "'BITS<TAB>COUNT' lines"):
        if not bits or any(c not in "01" for c in bits):
            raise ValueError(f"{path}:{lineno}: the input must be a non-empty 0/1 string")
        if not count.isdigit() or int(count) != count_chunks(bits):
            raise ValueError(
                f"{path}:{lineno}: count {count!r} is not the number of chunks of ones in "
                f"{bits!r} ({count_chunks(bits)})"
            )
        out.append(CountingExample(bits, int(count)))
    return out


def read_sorting(path: str | Path) -> list[SortingExample]:
    """Examples of an ``x1 x2 ...<TAB>y1 y2 ...`` file; the target must be the sorted input.
    An empty file (or one of blank lines) raises ``ValueError`` naming it."""
    out = []
    for lineno, source, target in _fields(path, "'x1 x2 ...<TAB>y1 y2 ...' lines"):
        try:
            values = tuple(int(x) for x in source.split())
            wanted = tuple(int(x) for x in target.split())
        except ValueError:
            raise ValueError(
                f"{path}:{lineno}: fields must be integers separated by spaces"
            ) from None
        if not values or min(values) < 0:
            raise ValueError(f"{path}:{lineno}: the input must be non-negative integers")
        if wanted != tuple(sorted(values)):
            raise ValueError(f"{path}:{lineno}: the target is not the sorted input")
        out.append(SortingExample(values, wanted))
    return out
