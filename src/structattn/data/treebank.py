"""Penn Treebank ``.mrg`` trees for unsupervised-parsing evaluation (WSJ10, unlabelled F1).

The gold trees are NLTK's 3,914-tree WSJ sample (``../shared/data/nltk_treebank_sample``,
files ``wsj_0001.mrg`` .. ``wsj_0199.mrg`` = WSJ sections 00-01); the full WSJ is not public.
Trees are parsed with :class:`nltk.Tree` (nltk is needed by this module only; it is in the
``recipes`` extra) and preprocessed as PRPN's ``data_ptb.py`` does (Shen et al., 2018):

* a word is kept iff its part-of-speech tag is in :data:`WORD_TAGS`, i.e. punctuation
  (``, . : `` '' -LRB- -RRB-``), currency symbols (``$ #``) and empty elements (``-NONE-``)
  are removed, and so are the constituents left empty;
* words are lower-cased and every run of digits becomes ``N`` (the Mikolov PTB text's
  convention); :func:`lm_tokens` then maps words outside an LM's vocabulary to ``<unk>``;
* the gold brackets are the spans ``[start, end)`` (word positions after removal) of every
  remaining constituent with at least two words; unary chains give one span. The root span
  ``(0, n)`` is part of :attr:`TreebankSentence.spans`; :func:`structattn.metrics.bracket_f1`
  decides whether it counts.

WSJ10 = the sentences with at most 10 words after removal (:func:`load_treebank` with
``max_words=10``), under one of two conventions (:data:`SENTENCE_CONVENTIONS`):

* ``"standard"`` (the default): sentences of **2** to ``max_words`` words, each distinct
  sentence (its kept words as written in the treebank) once, at its first occurrence. A
  one-word sentence has no bracket to score, and a repeated sentence (``Terms weren't
  disclosed.`` is 8 trees of the sample) would be counted once per copy. On the NLTK sample
  this gives **531** WSJ10 sentences.
* ``"prpn"``: what PRPN's ``data_ptb.py`` / ``test_phrase_grammar.py`` keep: every tree with
  1 to ``max_words`` words, repeats included (**555** on the sample: the 531, 13 one-word
  sentences and 11 repeats). A one-word sentence scores F1 = 1 at sentence level (no gold
  and no predicted bracket) whatever the parser does.

Both remove exactly the same words: keeping the tags of :data:`WORD_TAGS` is the same as
removing ``, . : `` '' -LRB- -RRB- # $ -NONE-`` on this sample (no other tag occurs).
Malformed files raise ``ValueError("<file>:<line>: ...")``.

Baseline trees over n words (span sets with the root, for the F1 of :mod:`structattn.metrics`):
:func:`branching_spans` (left / right / balanced) and :func:`random_spans` (greedy SPLIT on
random distances, i.e. a uniformly random ranking of the split points).
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..io import empty_file_error, read_utf8, shared_data_dir
from ..trees import split_tree, tree_spans

__all__ = [
    "SENTENCE_CONVENTIONS",
    "WORD_TAGS",
    "SentenceConvention",
    "TreebankSentence",
    "binarised_spans",
    "branching_spans",
    "default_treebank_dir",
    "load_treebank",
    "lm_tokens",
    "normalise_word",
    "parse_mrg",
    "random_spans",
    "read_mrg",
    "tree_spans_with_root",
]

Span = tuple[int, int]

#: Part-of-speech tags of the words kept (PRPN's ``word_tags``: no punctuation, $, #, -NONE-).
WORD_TAGS: frozenset[str] = frozenset(
    "CC CD DT EX FW IN JJ JJR JJS LS MD NN NNS NNP NNPS PDT POS PRP PRP$ RB RBR RBS RP SYM "
    "TO UH VB VBD VBG VBN VBP VBZ WDT WP WP$ WRB".split()
)
_DIGITS = re.compile(r"[0-9]+")

SentenceConvention = Literal["standard", "prpn"]
#: Which gold sentences an evaluation keeps (module docstring): ``"standard"`` = 2..n words,
#: distinct sentences once; ``"prpn"`` = PRPN's 1..n words, repeats kept.
SENTENCE_CONVENTIONS: tuple[SentenceConvention, ...] = ("standard", "prpn")


@dataclass(frozen=True)
class TreebankSentence:
    """One gold tree after preprocessing."""

    file: str  # file name, e.g. "wsj_0001.mrg"
    tree_index: int  # 0-based index of the tree in its file
    line: int  # 1-based line where the tree starts
    words: tuple[str, ...]  # kept words, lower-cased, digits -> N
    tags: tuple[str, ...]  # their part-of-speech tags
    spans: frozenset[Span]  # gold constituents [start, end) with >= 2 words, root included
    tree: str  # the bracketed gold tree over the kept words (labels dropped)
    original: tuple[str, ...] = ()  # the kept words as written in the treebank (no normalising)


def normalise_word(word: str) -> str:
    """Lower-case, every run of digits -> ``N`` (``"61"`` -> ``"N"``, ``"1.5"`` -> ``"N.N"``)."""
    return _DIGITS.sub("N", word.lower())


def default_treebank_dir() -> Path:
    """``<root>/nltk_treebank_sample/treebank/combined`` for the first data root that has it
    (:func:`structattn.io.data_dir`)."""
    return shared_data_dir(
        "nltk_treebank_sample", "treebank", "combined", what="the NLTK WSJ treebank sample"
    )


def _blocks(text: str, path: str) -> list[tuple[int, str]]:
    """Split a ``.mrg`` text into its top-level bracketed trees: [(first line, text)]."""
    blocks: list[tuple[int, str]] = []
    depth, start, start_line, line = 0, -1, 0, 1
    for i, char in enumerate(text):
        if char == "\n":
            line += 1
        elif char == "(":
            if depth == 0:
                start, start_line = i, line
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{path}:{line}: unbalanced ')'")
            if depth == 0:
                blocks.append((start_line, text[start : i + 1]))
        elif depth == 0 and not char.isspace():
            raise ValueError(f"{path}:{line}: text outside a tree: {char!r}")
    if depth:
        raise ValueError(f"{path}:{start_line}: tree not closed (missing ')')")
    return blocks


def _strip(
    tree: Any, words: list[str], tags: list[str], spans: set[Span], original: list[str]
) -> str | None:
    """Walk an nltk.Tree: append kept words/tags, add spans; return the bracketed subtree."""
    from nltk import Tree

    if isinstance(tree, Tree) and len(tree) == 1 and not isinstance(tree[0], Tree):
        if tree.label() not in WORD_TAGS:
            return None  # punctuation, currency, -NONE-
        original.append(str(tree[0]))
        words.append(normalise_word(str(tree[0])))
        tags.append(str(tree.label()))
        return words[-1]
    if not isinstance(tree, Tree):
        raise ValueError(f"a word {tree!r} without a part-of-speech tag")
    start = len(words)
    parts = [
        p for p in (_strip(child, words, tags, spans, original) for child in tree) if p is not None
    ]
    if not parts:
        return None  # a constituent left empty
    if len(words) - start >= 2:
        spans.add((start, len(words)))
    return parts[0] if len(parts) == 1 else "(" + " ".join(parts) + ")"


def parse_mrg(text: str, path: str = "<string>") -> list[TreebankSentence]:
    """Every tree of a ``.mrg`` text, preprocessed (see the module docstring)."""
    from nltk import Tree

    sentences = []
    name = os.path.basename(path)
    for index, (line, block) in enumerate(_blocks(text, path)):
        try:
            tree = Tree.fromstring(block, remove_empty_top_bracketing=True)
        except ValueError as err:
            raise ValueError(f"{path}:{line}: malformed tree: {err}") from None
        words: list[str] = []
        tags: list[str] = []
        spans: set[Span] = set()
        original: list[str] = []
        try:
            bracketed = _strip(tree, words, tags, spans, original)
        except ValueError as err:
            raise ValueError(f"{path}:{line}: {err}") from None
        sentences.append(
            TreebankSentence(
                file=name,
                tree_index=index,
                line=line,
                words=tuple(words),
                tags=tuple(tags),
                spans=frozenset(spans),
                tree=bracketed or "",
                original=tuple(original),
            )
        )
    return sentences


def read_mrg(path: str | os.PathLike[str]) -> list[TreebankSentence]:
    """The preprocessed trees of one ``.mrg`` file; a file without a tree (empty: a cut
    download or copy) raises ``ValueError`` naming it."""
    sentences = parse_mrg(read_utf8(path), str(path))
    if not sentences:
        raise empty_file_error(path, "bracketed Penn Treebank trees", "nltk_treebank_sample")
    return sentences


def load_treebank(
    data_dir: str | os.PathLike[str] | None = None,
    max_words: int | None = None,
    convention: SentenceConvention = "prpn",
) -> list[TreebankSentence]:
    """The trees of ``data_dir/*.mrg`` in file order with at most ``max_words`` words (None:
    any length; ``max_words=10`` gives WSJ10), selected by ``convention`` (module docstring):
    ``"prpn"`` keeps every non-empty tree, ``"standard"`` the first occurrence of each
    distinct sentence of at least 2 words."""
    if convention not in SENTENCE_CONVENTIONS:
        raise ValueError(f"`convention` must be one of {SENTENCE_CONVENTIONS}, got {convention!r}")
    folder = default_treebank_dir() if data_dir is None else Path(data_dir)
    files = sorted(folder.glob("*.mrg"))
    if not files:
        raise FileNotFoundError(f"no .mrg files in {folder}")
    shortest = 2 if convention == "standard" else 1
    out, seen = [], set()
    for path in files:
        for sentence in read_mrg(path):
            n = len(sentence.words)
            if n < shortest or (max_words is not None and n > max_words):
                continue
            if convention == "standard":
                if sentence.original in seen:
                    continue
                seen.add(sentence.original)
            out.append(sentence)
    return out


def lm_tokens(words: Iterable[str], vocabulary: Mapping[str, int], unk: str = "<unk>") -> list[str]:
    """Words as an LM vocabulary sees them: kept if known, else ``unk``."""
    return [w if w in vocabulary else unk for w in words]


def branching_spans(n: int, kind: Literal["left", "right", "balanced"]) -> frozenset[Span]:
    """Spans (root included, >= 2 words) of the left-/right-branching or balanced tree.

    >>> sorted(branching_spans(4, "right"))
    [(0, 4), (1, 4), (2, 4)]
    >>> sorted(branching_spans(4, "balanced"))
    [(0, 2), (0, 4), (2, 4)]
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if kind == "left":
        return frozenset((0, end) for end in range(2, n + 1))
    if kind == "right":
        return frozenset((start, n) for start in range(0, n - 1))
    if kind != "balanced":
        raise ValueError(f"kind must be 'left', 'right' or 'balanced', got {kind!r}")
    spans: set[Span] = set()

    def split(start: int, end: int) -> None:
        if end - start < 2:
            return
        spans.add((start, end))
        middle = (start + end + 1) // 2  # the left half takes the extra word
        split(start, middle)
        split(middle, end)

    split(0, n)
    return frozenset(spans)


def random_spans(n: int, rng: random.Random) -> frozenset[Span]:
    """Spans (root included) of SPLIT on i.i.d. uniform distances: a random binary tree."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return tree_spans_with_root([rng.random() for _ in range(n)])


def tree_spans_with_root(distances: Sequence[float]) -> frozenset[Span]:
    """Spans (root included, >= 2 words) of the greedy SPLIT tree of ``distances``."""
    return frozenset(tree_spans(split_tree(list(distances)), include_root=True))


def binarised_spans(spans: Iterable[Span], n: int) -> frozenset[Span]:
    """A binary tree over n words containing every gold span: the best binary tree's spans.

    Each gold constituent with k > 2 children (maximal gold spans and single words inside it)
    is right-binarised by the spans (start of child i, end) for i = 2 .. k-1; its F1 against
    the gold spans is the upper bound of any binary-tree parser (Table 2's UPPER BOUND).

    >>> sorted(binarised_spans({(0, 4)}, 4))
    [(0, 4), (1, 4), (2, 4)]
    """
    gold = {(a, b) for a, b in spans if b - a >= 2}
    if n >= 2:
        gold.add((0, n))
    out = set(gold)

    def visit(start: int, end: int) -> None:
        kids, i = [], start
        while i < end:
            j = max(
                (b for a, b in gold if a == i and b <= end and (a, b) != (start, end)),
                default=i + 1,
            )
            kids.append((i, j))
            i = j
        for k in range(1, len(kids) - 1):
            out.add((kids[k][0], end))
        for a, b in kids:
            if b - a >= 2:
                visit(a, b)

    if n >= 2:
        visit(0, n)
    return frozenset(out)
