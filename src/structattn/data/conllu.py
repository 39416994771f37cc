"""CoNLL-U dependency treebanks (Universal Dependencies): reader, writer with replaced
heads, attachment scores (UAS / LAS) and projectivity.

A CoNLL-U sentence is a block of lines ended by a blank line: ``#`` comments, then one line
per token with 10 TAB-separated columns ``ID FORM LEMMA UPOS XPOS FEATS HEAD DEPREL DEPS
MISC``. Three kinds of ID:

* ``7``: a syntactic word, numbered 1..n; these are the tree's nodes (HEAD 0 = root).
* ``3-4``: a multiword token (``don't`` = ``do`` + ``n't``); its words follow as ``3`` and
  ``4``. Skipped: it has no HEAD.
* ``5.1``: an empty node of the enhanced graph (elided predicates). Skipped: not in the
  basic tree.

:func:`read_conllu` keeps the words with their FORM, LEMMA, UPOS, XPOS, HEAD and DEPREL,
and every line of the block unchanged, so :func:`format_conllu` writes a file back byte for
byte, or with another HEAD (and DEPREL) column on the word lines only (a parser's output).

This is a small reader of its own rather than the ``conllu`` package (PyPI): the library
keeps torch + numpy as its only dependencies, the recipes need errors that name the file
and line, and the writer must reproduce the input byte for byte; the tests check the reader
against the ``conllu`` package on EWT where it is installed.

Punctuation for the scores "without punctuation": words whose gold UPOS is ``PUNCT``
(:data:`PUNCT_TAGS`). ``SYM`` is not punctuation in UD (``$``, ``%``, ``+``, emoticons head
or fill argument slots) and is scored; pass ``punct_tags`` to change this.

>>> text = '''# sent_id = 1
... 1-2\\tdon't\\t_\\t_\\t_\\t_\\t_\\t_\\t_\\t_
... 1\\tdo\\tdo\\tAUX\\tVBP\\t_\\t3\\taux\\t_\\t_
... 2\\tn't\\tnot\\tPART\\tRB\\t_\\t3\\tadvmod\\t_\\t_
... 3\\tgo\\tgo\\tVERB\\tVB\\t_\\t0\\troot\\t_\\t_
... 3.1\\tgo\\tgo\\tVERB\\tVB\\t_\\t_\\t_\\t0:root\\t_
... 4\\t!\\t!\\tPUNCT\\t.\\t_\\t3\\tpunct\\t_\\t_
...
... '''
>>> (s,) = parse_conllu(text)
>>> s.words, s.heads, s.deprels, s.sent_id
(('do', "n't", 'go', '!'), (3, 3, 0, 3), ('aux', 'advmod', 'root', 'punct'), '1')
>>> is_projective(s.heads), format_conllu([s]) == text
(True, True)
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..io import atomic_write_text, empty_file_error, read_utf8, shared_data_dir

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "PUNCT_TAGS",
    "AttachmentScores",
    "ConlluSentence",
    "attachment_scores",
    "branching_heads",
    "check_tree",
    "conllu_stats",
    "default_ud_data_dir",
    "format_conllu",
    "heads_tensor",
    "is_projective",
    "non_projective_arcs",
    "parse_conllu",
    "read_conllu",
    "uas_beside_branching",
    "write_conllu",
]

PUNCT_TAGS: frozenset[str] = frozenset({"PUNCT"})
"""Gold UPOS tags left out by the scores without punctuation (SYM is scored, see above)."""

_WORD_ID = re.compile(r"[1-9][0-9]*")
_RANGE_ID = re.compile(r"([1-9][0-9]*)-([1-9][0-9]*)")
_EMPTY_ID = re.compile(r"(0|[1-9][0-9]*)\.([1-9][0-9]*)")
_HEAD_COLUMN, _DEPREL_COLUMN = 6, 7


@dataclass(frozen=True)
class ConlluSentence:
    """One sentence: its syntactic words (multiword tokens and empty nodes left out) and its
    lines as they were in the file."""

    words: tuple[str, ...]  # FORM of words 1..n
    lemmas: tuple[str, ...]  # LEMMA
    upos: tuple[str, ...]  # universal POS tags
    xpos: tuple[str, ...]  # language-specific POS tags ("_" if none)
    heads: tuple[int, ...] | None  # heads[i] = head of word i + 1 (0 = root); None: all "_"
    deprels: tuple[str, ...] | None  # DEPREL of each word; None when the heads are "_"
    comments: tuple[str, ...]  # the "#" lines, as in the file
    lines: tuple[str, ...]  # every line of the block (no line ends, no blank separator)
    word_lines: tuple[int, ...]  # index into ``lines`` of each word's line
    source: str  # file the sentence came from
    line: int  # 1-based line number of the block's first line in the file

    def __len__(self) -> int:
        return len(self.words)

    @property
    def sent_id(self) -> str | None:
        """The ``# sent_id = ...`` comment's value, if any."""
        return self._comment("sent_id")

    @property
    def text(self) -> str | None:
        """The ``# text = ...`` comment's value, if any."""
        return self._comment("text")

    def _comment(self, key: str) -> str | None:
        for comment in self.comments:
            name, sep, value = comment[1:].partition("=")
            if sep and name.strip() == key:
                return value.strip()
        return None

    def line_of(self, word: int) -> int:
        """1-based line number in the file of word ``word`` (1-based, as in HEAD)."""
        if not 1 <= word <= len(self.words):
            raise ValueError(f"word {word} out of range 1..{len(self.words)}")
        return self.line + self.word_lines[word - 1]


# ----------------------------------------------------------------------------- trees


def check_tree(heads: Sequence[int], single_root: bool = True) -> None:
    """Raise ``ValueError`` unless ``heads`` (``heads[i]`` = head of word i + 1, 0 = root)
    is a tree: every head in 0..n, no word its own head, no cycle and (``single_root``)
    exactly one word attached to 0. The message names the first offending word (1-based).

    >>> check_tree([2, 0, 2])
    >>> check_tree([2, 3, 1])
    Traceback (most recent call last):
    ...
    ValueError: cycle in the heads: 1 -> 2 -> 3 -> 1 (word -> its head)
    """
    problem = _tree_problem(heads, single_root)
    if problem is not None:
        raise ValueError(problem[1])


def _tree_problem(heads: Sequence[int], single_root: bool) -> tuple[int, str] | None:
    """``(word, message)`` of the first reason ``heads`` is not a tree (see
    :func:`check_tree`), or ``None``; ``word`` is 1-based (1 for an empty sentence)."""
    n = len(heads)
    if n == 0:
        return 1, "empty sentence: no words"
    for i, h in enumerate(heads, start=1):
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= n:
            return i, f"word {i}: head {h!r} out of range 0..{n}"
        if h == i:
            return i, f"word {i} is its own head"
    state = [0] * (n + 1)  # 0 unvisited, 1 on the current path, 2 reaches the root
    state[0] = 2
    for start in range(1, n + 1):
        path = []
        node = start
        while state[node] == 0:
            state[node] = 1
            path.append(node)
            node = heads[node - 1]
        if state[node] == 1:  # came back to the current path: a cycle
            cycle = path[path.index(node) :]
            names = " -> ".join(str(w) for w in [*cycle, node])
            return min(cycle), f"cycle in the heads: {names} (word -> its head)"
        for w in path:
            state[w] = 2
    roots = [i for i, h in enumerate(heads, start=1) if h == 0]
    if single_root and len(roots) != 1:
        return roots[1] if len(
            roots
        ) > 1 else 1, f"{len(roots)} words attached to the root (0): {roots}; expected 1"
    return None


def non_projective_arcs(heads: Sequence[int]) -> list[tuple[int, int]]:
    """The arcs ``(head, dependent)`` that cross another arc (words 1-based, the root is
    position 0 and its arcs count), in order of dependent. Empty for a projective tree
    (the tests check that against :func:`is_projective` on every tree of up to 5 words).

    >>> non_projective_arcs([0, 4, 1, 1])  # 1 -> 3 crosses 4 -> 2
    [(4, 2), (1, 3)]
    """
    arcs = [(min(h, d), max(h, d)) for d, h in enumerate(heads, start=1)]
    crossing: set[int] = set()
    for a, (l1, r1) in enumerate(arcs):
        for b in range(a + 1, len(arcs)):
            l2, r2 = arcs[b]
            if l1 < l2 < r1 < r2 or l2 < l1 < r2 < r1:
                crossing.update((a, b))
    return [(heads[i], i + 1) for i in sorted(crossing)]


def is_projective(heads: Sequence[int]) -> bool:
    """True when no two arcs cross, the arcs from the root (position 0) included; for a
    tree this is the usual definition (every word between a head and its dependent is
    dominated by the head). ``heads[i]`` is the head of word i + 1 (0 = root).

    One sentence through the library's batched check,
    :func:`structattn.trees.is_projective` (``[B, N]`` tensors with ROOT at
    position 0), so there is one implementation; :func:`conllu_stats` batches a treebank.

    >>> is_projective([2, 0, 2]), is_projective([3, 4, 0, 3])
    (True, False)
    """
    return bool(_projective([list(heads)])[0])


def _projective(trees: Sequence[Sequence[int]]) -> list[bool]:
    """:func:`is_projective` of many head sequences, padded into one batch per 512."""
    import torch

    from ..trees import is_projective as batched

    out: list[bool] = []
    for start in range(0, len(trees), 512):
        chunk = trees[start : start + 512]
        if any(len(t) == 0 for t in chunk):
            raise ValueError("empty sentence: no words")
        size = 1 + max(len(t) for t in chunk)
        heads = torch.zeros(len(chunk), size, dtype=torch.long)  # [B, N + 1], ROOT at 0
        for b, tree in enumerate(chunk):
            heads[b, 1 : 1 + len(tree)] = torch.tensor(list(tree), dtype=torch.long)
        lengths = torch.tensor([1 + len(t) for t in chunk], dtype=torch.long)  # [B]
        out.extend(batched(heads, lengths).tolist())
    return out


# ----------------------------------------------------------------------------- reading


def _sentence(block: list[str], source: str, first_line: int) -> ConlluSentence:
    """Parse one block (its lines; ``first_line`` is the file line of ``block[0]``)."""
    comments: list[str] = []
    rows: list[list[str]] = []
    word_lines: list[int] = []
    expect = 1  # next word ID
    range_end = 0  # last word ID covered by the latest multiword token
    for k, line in enumerate(block):
        where = f"{source}:{first_line + k}"
        if line.startswith("#"):
            if rows or range_end:
                raise ValueError(f"{where}: comment line after the first token line")
            comments.append(line)
            continue
        cols = line.split("\t")
        if len(cols) != 10:
            raise ValueError(
                f"{where}: expected 10 TAB-separated columns, found {len(cols)} in {line[:60]!r}"
            )
        if any(c == "" for c in cols):
            raise ValueError(f"{where}: empty column {cols.index('') + 1} (use '_')")
        token_id = cols[0]
        multi = _RANGE_ID.fullmatch(token_id)
        if multi:
            start, end = int(multi.group(1)), int(multi.group(2))
            if start != expect or end <= start:
                raise ValueError(
                    f"{where}: multiword token {token_id} should start at word {expect} "
                    "and span at least two words"
                )
            range_end = end
            continue
        empty = _EMPTY_ID.fullmatch(token_id)
        if empty:
            if int(empty.group(1)) != expect - 1:
                raise ValueError(
                    f"{where}: empty node {token_id} should follow word {empty.group(1)}"
                )
            continue
        if not _WORD_ID.fullmatch(token_id):
            raise ValueError(f"{where}: bad ID {token_id!r} (expected N, N-M or N.K)")
        if int(token_id) != expect:
            raise ValueError(f"{where}: word ID {token_id}, expected {expect}")
        expect += 1
        rows.append(cols)
        word_lines.append(k)
    where = f"{source}:{first_line}"
    if not rows:
        raise ValueError(f"{where}: sentence without words")
    if range_end >= expect:
        raise ValueError(f"{where}: a multiword token ends at word {range_end} > {expect - 1}")
    n = len(rows)
    head_cols = [r[_HEAD_COLUMN] for r in rows]
    heads: tuple[int, ...] | None
    deprels: tuple[str, ...] | None
    if all(h == "_" for h in head_cols):
        heads = deprels = None  # unparsed input (e.g. for a parser)
    else:
        parsed = []
        for k, h in enumerate(head_cols):
            line_no = first_line + word_lines[k]
            if not (h == "0" or _WORD_ID.fullmatch(h)):
                raise ValueError(f"{source}:{line_no}: HEAD {h!r} is not a word number")
            if int(h) > n:
                raise ValueError(f"{source}:{line_no}: HEAD {h} out of range 0..{n}")
            parsed.append(int(h))
        heads = tuple(parsed)
        problem = _tree_problem(heads, single_root=True)
        if problem is not None:
            word, message = problem
            raise ValueError(f"{source}:{first_line + word_lines[word - 1]}: {message}")
        deprels = tuple(r[_DEPREL_COLUMN] for r in rows)
    return ConlluSentence(
        words=tuple(r[1] for r in rows),
        lemmas=tuple(r[2] for r in rows),
        upos=tuple(r[3] for r in rows),
        xpos=tuple(r[4] for r in rows),
        heads=heads,
        deprels=deprels,
        comments=tuple(comments),
        lines=tuple(block),
        word_lines=tuple(word_lines),
        source=source,
        line=first_line,
    )


def parse_conllu(text: str, source: str = "<string>") -> list[ConlluSentence]:
    """Parse CoNLL-U text (see the module docstring); errors read ``"<source>:<line>: ..."``.

    Checked: 10 TAB-separated non-empty columns, word IDs 1, 2, ... in order, multiword
    ranges starting at the next word, empty nodes after their word, comments only before the
    first token line, HEAD a number in 0..n, and the heads a tree with one root (``_`` in
    every HEAD of a sentence is allowed: ``heads`` is then ``None``). A carriage return
    (Windows line ends) is an error. Several blank lines between sentences are accepted.
    """
    blocks: list[tuple[int, list[str]]] = []
    block: list[str] = []
    start = 0
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for lineno, line in enumerate(lines, start=1):
        if "\r" in line:
            raise ValueError(f"{source}:{lineno}: carriage return in line (Windows line ending?)")
        if line.strip():
            if not block:
                start = lineno
            block.append(line)
        elif line:
            raise ValueError(f"{source}:{lineno}: line of only whitespace (use an empty line)")
        elif block:
            blocks.append((start, block))
            block = []
    if block:
        blocks.append((start, block))  # a last sentence without the final blank line
    return [_sentence(b, source, first) for first, b in blocks]


def read_conllu(path: str | os.PathLike[str]) -> list[ConlluSentence]:
    """Read a CoNLL-U file (UTF-8); see :func:`parse_conllu`. A file with no sentence (empty
    or blank: a cut download) raises ``ValueError`` naming it (:func:`parse_conllu` of an
    empty string is ``[]``: a text may hold no sentence, a file of a treebank may not)."""
    sentences = parse_conllu(read_utf8(path), source=str(path))
    if not sentences:
        raise empty_file_error(path, "CoNLL-U sentences", "ud_english_ewt")
    return sentences


def format_conllu(
    sentences: Iterable[ConlluSentence],
    heads: Sequence[Sequence[int]] | None = None,
    deprels: Sequence[Sequence[str]] | None = None,
) -> str:
    """The CoNLL-U text of ``sentences``: each block's lines and a blank line.

    Without ``heads`` / ``deprels`` this is the input file byte for byte (for files that end
    each sentence with one blank line, as UD's do). With them, the HEAD (and DEPREL) column
    of every word line is replaced by the given ones (one sequence per sentence, one value
    per word); every other column and every comment, multiword and empty-node line stays.
    """
    sentences = list(sentences)
    for name, given in (("heads", heads), ("deprels", deprels)):
        if given is not None and len(given) != len(sentences):
            raise ValueError(f"{len(given)} {name} sequences for {len(sentences)} sentences")
    out: list[str] = []
    for s, sentence in enumerate(sentences):
        lines = list(sentence.lines)
        new_heads = None if heads is None else list(heads[s])
        new_deprels = None if deprels is None else list(deprels[s])
        for name, values in (("heads", new_heads), ("deprels", new_deprels)):
            if values is not None and len(values) != len(sentence):
                raise ValueError(
                    f"sentence {s} ({sentence.source}:{sentence.line}): {len(values)} {name} "
                    f"for {len(sentence)} words"
                )
        if new_heads is not None or new_deprels is not None:
            for w, k in enumerate(sentence.word_lines):
                cols = lines[k].split("\t")
                if new_heads is not None:
                    cols[_HEAD_COLUMN] = str(int(new_heads[w]))
                if new_deprels is not None:
                    cols[_DEPREL_COLUMN] = new_deprels[w]
                lines[k] = "\t".join(cols)
        out.append("\n".join(lines) + "\n\n")
    return "".join(out)


def write_conllu(
    path: str | os.PathLike[str],
    sentences: Iterable[ConlluSentence],
    heads: Sequence[Sequence[int]] | None = None,
    deprels: Sequence[Sequence[str]] | None = None,
) -> Path:
    """Write :func:`format_conllu` to ``path`` atomically."""
    return atomic_write_text(path, format_conllu(sentences, heads, deprels))


def default_ud_data_dir() -> Path:
    """``<root>/ud_english_ewt`` for the first data root that has it
    (:func:`structattn.io.data_dir`); ``FileNotFoundError`` (pass ``--data-dir``) else."""
    return shared_data_dir(
        "ud_english_ewt",
        what="UD English-EWT",
        hint=" pointing at the directory with en_ewt-ud-{train,dev,test}.conllu",
    )


def heads_tensor(sentences: Sequence[ConlluSentence]) -> tuple[Tensor, Tensor]:
    """``(heads, lengths)`` in the layout of :class:`structattn.DependencyCRF` and
    :func:`structattn.structured_nll`: ``heads`` LongTensor ``[B, N]`` with ROOT at position
    0, ``heads[b, m]`` the head of word m (1..n_b) and -1 at ROOT and padding; ``lengths``
    LongTensor ``[B]`` of positions including ROOT (``n_b + 1``). Raises ``ValueError`` for a
    sentence without gold heads."""
    import torch

    for s in sentences:
        if s.heads is None:
            raise ValueError(f"{s.source}:{s.line}: sentence has no gold heads")
    size = 1 + max((len(s) for s in sentences), default=0)
    heads = torch.full((len(sentences), size), -1, dtype=torch.long)  # [B, N]
    for b, s in enumerate(sentences):
        heads[b, 1 : 1 + len(s)] = torch.tensor(s.heads, dtype=torch.long)  # [n_b]
    lengths = torch.tensor([1 + len(s) for s in sentences], dtype=torch.long)  # [B]
    return heads, lengths


# ----------------------------------------------------------------------------- scores


@dataclass(frozen=True)
class AttachmentScores:
    """Unlabelled / labelled attachment scores (fractions; multiply by 100 for %)."""

    uas: float  # correct heads / words
    las: float  # correct heads and labels / words
    uas_no_punct: float  # the same over words whose gold UPOS is not punctuation
    las_no_punct: float
    words: int  # words scored
    words_no_punct: int  # words scored without punctuation

    def to_dict(self) -> dict[str, float | int]:
        """JSON-ready fields."""
        return dict(self.__dict__)


def attachment_scores(
    gold: Sequence[ConlluSentence],
    predicted_heads: Sequence[Sequence[int]],
    predicted_deprels: Sequence[Sequence[str]] | None = None,
    punct_tags: Iterable[str] = PUNCT_TAGS,
    deprel_subtypes: bool = False,
) -> AttachmentScores:
    """UAS and LAS of predicted trees against the gold sentences, over all words and over
    the words whose gold UPOS is not in ``punct_tags`` (micro-averaged: corpus-level
    counts).

    LAS compares the universal part of DEPREL (``nmod`` for ``nmod:poss``, as the CoNLL 2018
    shared task) unless ``deprel_subtypes``; without ``predicted_deprels`` it is NaN. A
    sentence without gold heads or with a wrong number of predictions raises ``ValueError``.
    """
    import math

    if len(predicted_heads) != len(gold):
        raise ValueError(f"{len(predicted_heads)} predicted trees for {len(gold)} sentences")
    if predicted_deprels is not None and len(predicted_deprels) != len(gold):
        raise ValueError(f"{len(predicted_deprels)} deprel sequences for {len(gold)} sentences")
    punct = frozenset(punct_tags)

    def label(rel: str) -> str:
        return rel if deprel_subtypes else rel.split(":", 1)[0]

    words = words_np = heads_ok = heads_ok_np = both_ok = both_ok_np = 0
    for s, sentence in enumerate(gold):
        if sentence.heads is None or sentence.deprels is None:
            raise ValueError(f"{sentence.source}:{sentence.line}: sentence {s} has no gold heads")
        pred = list(predicted_heads[s])
        rels = None if predicted_deprels is None else list(predicted_deprels[s])
        if len(pred) != len(sentence) or (rels is not None and len(rels) != len(sentence)):
            raise ValueError(
                f"sentence {s} ({sentence.source}:{sentence.line}) has {len(sentence)} words, "
                f"got {len(pred)} heads" + ("" if rels is None else f" and {len(rels)} deprels")
            )
        for i in range(len(sentence)):
            head = int(pred[i]) == sentence.heads[i]
            both = head and rels is not None and label(rels[i]) == label(sentence.deprels[i])
            words += 1
            heads_ok += head
            both_ok += both
            if sentence.upos[i] not in punct:
                words_np += 1
                heads_ok_np += head
                both_ok_np += both
    if words == 0:
        raise ValueError("no words to score")
    nan = math.nan
    return AttachmentScores(
        uas=heads_ok / words,
        las=both_ok / words if predicted_deprels is not None else nan,
        uas_no_punct=heads_ok_np / words_np if words_np else nan,
        las_no_punct=both_ok_np / words_np if words_np and predicted_deprels is not None else nan,
        words=words,
        words_no_punct=words_np,
    )


def branching_heads(length: int, direction: Literal["left", "right"]) -> list[int]:
    """A chain: ``right`` = each word headed by the next (the last by ROOT), ``left`` = each
    word headed by the previous one (the first by ROOT)."""
    if direction == "right":
        return [i + 2 for i in range(length - 1)] + [0]
    return list(range(length))


def uas_beside_branching(
    gold: Sequence[ConlluSentence], predicted_heads: Sequence[Sequence[int]]
) -> dict[str, Any]:
    """UAS (%, punctuation included and excluded) of ``predicted_heads`` (``"model"``) and of
    right- and left-branching chains against the gold sentences, and their number."""
    report: dict[str, Any] = {"sentences": len(gold)}
    for name, heads in (
        ("model", predicted_heads),
        ("right-branching", [branching_heads(len(s), "right") for s in gold]),
        ("left-branching", [branching_heads(len(s), "left") for s in gold]),
    ):
        scores = attachment_scores(gold, heads)
        report[name] = {"uas": 100 * scores.uas, "uas_no_punct": 100 * scores.uas_no_punct}
    return report


def conllu_stats(sentences: Sequence[ConlluSentence]) -> dict[str, int]:
    """Counts, JSON-ready: ``sentences``, ``words``, ``punct`` (UPOS PUNCT words),
    ``multiword_tokens``, ``empty_nodes``, ``unparsed`` (sentences without heads) and
    ``non_projective`` (sentences whose gold tree has a crossing arc)."""
    stats = dict.fromkeys(
        (
            "sentences",
            "words",
            "punct",
            "multiword_tokens",
            "empty_nodes",
            "unparsed",
            "non_projective",
        ),
        0,
    )
    for s in sentences:
        stats["sentences"] += 1
        stats["words"] += len(s)
        stats["punct"] += sum(tag in PUNCT_TAGS for tag in s.upos)
        for line in s.lines:
            if not line.startswith("#"):
                token_id = line.split("\t", 1)[0]
                stats["multiword_tokens"] += "-" in token_id
                stats["empty_nodes"] += "." in token_id
        if s.heads is None:
            stats["unparsed"] += 1
    parsed = [s.heads for s in sentences if s.heads is not None]
    stats["non_projective"] = sum(not p for p in _projective(parsed))
    return stats
