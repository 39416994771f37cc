"""Prefix -> infix tree transduction (Kim et al. 2017, section 4.1 and appendix A.2).

A source is a random arithmetic formula in prefix notation, its target the same formula in
infix notation::

    ( * ( + ( + 15 7 ) 1 8 ) ( + 19 0 11 ) )  =>  ( ( 15 + 7 ) + 1 + 8 ) * ( 19 + 0 + 11 )

The alphabet is ``( ) + *`` and the numbers ``0 .. 20``; every parenthesised expression has one
operator and 2 to 4 operands; the *depth* of a formula is the maximum nesting of its
parentheses (3 above). The infix form parenthesises every operand that is an expression (one
operator per level, so precedence plays no part) but not the top level, and leaves numbers bare.

The paper trains on 15K pairs of depth 2-4 (5K per depth) and tests on 1K pairs of depth 2-6
(200 per depth). :func:`generate_splits` builds these, plus a validation split, from one seed;
:func:`write_splits` and :func:`read_pairs` store them as text, one pair per line::

    source<TAB>target            tokens separated by single spaces, no root symbol

The model prepends the root symbol ``$`` itself (:attr:`Vocabulary.root_id`).

Only the standard library is used, except :meth:`Vocabulary.encode_batch` (torch).

>>> expr = parse_prefix("( * ( + ( + 15 7 ) 1 8 ) ( + 19 0 11 ) )".split())
>>> " ".join(to_infix(expr)), depth(expr), evaluate(expr)
('( ( 15 + 7 ) + 1 + 8 ) * ( 19 + 0 + 11 )', 3, 930)
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, TypeAlias

from ..io import atomic_write_text, empty_file_error, read_utf8
from ._vocab import TokenVocabulary

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "OPERATORS",
    "SPLIT_NAMES",
    "Expr",
    "GeneratorConfig",
    "Pair",
    "Vocabulary",
    "depth",
    "evaluate",
    "format_summary",
    "generate_splits",
    "main_data",
    "make_pair",
    "parse_infix",
    "parse_prefix",
    "random_expression",
    "read_pairs",
    "read_splits",
    "source_depth",
    "to_infix",
    "to_prefix",
    "write_splits",
]

OPERATORS: tuple[str, ...] = ("+", "*")
"""The operator tokens (``*`` is the paper's ``∗``)."""

SPLIT_NAMES: tuple[str, ...] = ("train", "valid", "test")
"""The splits :func:`generate_splits` returns and :func:`read_splits` reads, in file order."""

_NUMBER = re.compile(r"0|[1-9][0-9]*")  # a number token: decimal, no sign, no leading zero
_SPLIT_NAME = re.compile(r"[A-Za-z0-9_-]+")  # a split name usable as a file name


# ----------------------------------------------------------------------------- expressions


@dataclass(frozen=True)
class Expr:
    """One parenthesised expression: an operator applied to two or more operands.

    An operand is a number (a non-negative ``int``) or another :class:`Expr`. Equality and
    hashing are structural.
    """

    op: str  # "+" or "*"
    args: tuple[Operand, ...]  # the operands, left to right; at least two

    def __post_init__(self) -> None:
        if self.op not in OPERATORS:
            raise ValueError(f"operator must be one of {OPERATORS}, got {self.op!r}")
        if not isinstance(self.args, tuple) or len(self.args) < 2:
            raise ValueError(
                f"an expression needs a tuple of at least 2 operands, got {self.args!r}"
            )
        for arg in self.args:
            is_number = isinstance(arg, int) and not isinstance(arg, bool) and arg >= 0
            if not (is_number or isinstance(arg, Expr)):
                raise ValueError(f"operands must be non-negative ints or Expr, got {arg!r}")


Operand: TypeAlias = Expr | int
"""An operand: a number or a parenthesised expression."""


def depth(expr: Operand) -> int:
    """Maximum nesting of parentheses: 0 for a number, 1 for ``( + 1 2 )``."""
    if isinstance(expr, int):
        return 0
    return 1 + max(depth(arg) for arg in expr.args)


def evaluate(expr: Operand) -> int:
    """The value of the formula (exact integer arithmetic)."""
    if isinstance(expr, int):
        return expr
    values = [evaluate(arg) for arg in expr.args]
    return sum(values) if expr.op == "+" else math.prod(values)


def to_prefix(expr: Operand) -> list[str]:
    """Prefix tokens: ``( op a1 a2 ... )`` at every level."""
    if isinstance(expr, int):
        return [str(expr)]
    tokens = ["(", expr.op]
    for arg in expr.args:
        tokens += to_prefix(arg)
    tokens.append(")")
    return tokens


def to_infix(expr: Operand) -> list[str]:
    """Infix tokens ``a1 op a2 op ...``; operands that are expressions are parenthesised,
    numbers and the top level are not."""
    if isinstance(expr, int):
        return [str(expr)]
    tokens: list[str] = []
    for i, arg in enumerate(expr.args):
        if i:
            tokens.append(expr.op)
        tokens += to_infix(arg) if isinstance(arg, int) else ["(", *to_infix(arg), ")"]
    return tokens


def _number(token: str, where: str) -> int:
    if not _NUMBER.fullmatch(token):
        raise ValueError(f"unexpected token {token!r} {where}")
    return int(token)


def parse_prefix(tokens: Sequence[str]) -> Expr:
    """Parse prefix tokens (as made by :func:`to_prefix`) into an :class:`Expr`.

    Raises ``ValueError`` naming the offending token position on malformed input: unbalanced
    parentheses, a missing or unknown operator, fewer than two operands, an invalid number
    (numbers are decimal without sign or leading zeros), or tokens after the end.
    """
    tokens = list(tokens)
    if not tokens:
        raise ValueError("empty prefix expression")
    if tokens[0] != "(":
        raise ValueError(f"a prefix expression must start with '(', got {tokens[0]!r}")
    # Iterative: one frame [op, operands] per open parenthesis (no recursion limit on input).
    stack: list[tuple[str, list[Operand]]] = []
    result: Expr | None = None
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if result is not None:
            raise ValueError(f"token {i}: unexpected {token!r} after the end of the expression")
        if token == "(":
            if i + 1 >= len(tokens) or tokens[i + 1] not in OPERATORS:
                found = repr(tokens[i + 1]) if i + 1 < len(tokens) else "end of input"
                raise ValueError(f"token {i + 1}: expected an operator after '(', got {found}")
            stack.append((tokens[i + 1], []))
            i += 2
            continue
        op, operands = stack[-1]
        if token == ")":
            if len(operands) < 2:
                raise ValueError(f"token {i}: '( {op}' closed with {len(operands)} operand(s)")
            stack.pop()
            done = Expr(op, tuple(operands))
            if stack:
                stack[-1][1].append(done)
            else:
                result = done
        else:
            operands.append(_number(token, f"at token {i} (expected a number, '(' or ')')"))
        i += 1
    if result is None:
        raise ValueError(f"unbalanced parentheses: {len(stack)} '(' left open at end of input")
    return result


@dataclass
class _Group:
    """A parenthesised group being parsed by :func:`parse_infix`."""

    op: str | None = None  # the group's operator once seen
    operands: list[Operand] = field(default_factory=list)
    want_operand: bool = True  # True after '(' or an operator, False after an operand

    def close(self, i: int) -> Expr:
        if self.want_operand or self.op is None:
            raise ValueError(f"token {i}: incomplete group (need 'a op b ...')")
        return Expr(self.op, tuple(self.operands))


def parse_infix(tokens: Sequence[str]) -> Expr:
    """Parse infix tokens (as made by :func:`to_infix`) into an :class:`Expr`.

    Grouping is given by parentheses alone: each group (and the top level, which has no
    parentheses) is ``a1 op a2 op ... an`` with one operator repeated, ``n >= 2``; an operand
    is a number or a parenthesised group. Raises ``ValueError`` naming the token position.
    """
    tokens = list(tokens)
    stack = [_Group()]  # the top level, then one group per open parenthesis
    for i, token in enumerate(tokens):
        group = stack[-1]
        if token in OPERATORS:
            if group.want_operand:
                raise ValueError(f"token {i}: expected an operand, got {token!r}")
            if group.op is not None and group.op != token:
                raise ValueError(f"token {i}: mixed operators {group.op!r} and {token!r}")
            group.op, group.want_operand = token, True
            continue
        if not group.want_operand:
            if token != ")":
                raise ValueError(f"token {i}: expected an operator or ')', got {token!r}")
            if len(stack) == 1:
                raise ValueError(f"token {i}: unbalanced ')'")
            stack.pop()
            stack[-1].operands.append(group.close(i))
            stack[-1].want_operand = False
        elif token == "(":
            stack.append(_Group())
        else:
            group.operands.append(_number(token, f"at token {i} (expected an operand)"))
            group.want_operand = False
    if len(stack) > 1:
        raise ValueError(f"unbalanced parentheses: {len(stack) - 1} '(' left open at end of input")
    return stack[0].close(len(tokens))


# ----------------------------------------------------------------------------- generator


@dataclass(frozen=True)
class GeneratorConfig:
    """How :func:`random_expression` draws a formula of exact depth ``d``.

    Each expression draws its operand count ``k`` uniformly from ``min_operands ..
    max_operands`` and its operator uniformly from ``operators``. One operand, at a uniform
    position, is an expression of depth exactly ``d - 1`` (a number when ``d = 1``), so the
    depth is exact. Every other operand is, with probability ``subexpr_prob`` (and only if
    ``d >= 2``), an expression of depth uniform in ``1 .. d - 1``, and otherwise a number
    uniform in ``0 .. max_number``. The paper fixes the alphabet and the operand counts, not
    the branching probabilities; with the defaults, source lengths (mean / 99th percentile /
    max over 20K draws) are 14.5 / 26 / 31, 25.9 / 54 / 82, 41.4 / 93 / 139, 60.9 / 146 / 197
    and 83.5 / 184 / 200 tokens for depths 2, 3, 4, 5 and 6.
    """

    min_operands: int = 2  # fewest operands per expression (paper: 2)
    max_operands: int = 4  # most operands per expression (paper: "at most 4")
    max_number: int = 20  # numbers are drawn uniformly from 0 .. max_number (paper: 20)
    operators: tuple[str, ...] = OPERATORS  # drawn uniformly (paper: + and *)
    # Chance that an operand off the deepest path is an expression rather than a number.
    # 0.35 keeps depth-6 sources near 85 tokens on average (uncapped: 0.3 gives ~75, 0.5 ~125).
    subexpr_prob: float = 0.35
    # Sources longer than this are redrawn (rejection sampling), bounding the O(N^3) cost of
    # the tree CRF on the longest test items; None disables. At 200 it redraws about 1.3% of
    # depth-6 draws, 0.02% of depth-5 draws and none at depth 2-4.
    max_source_length: int | None = 200

    def __post_init__(self) -> None:
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError(
                f"need 2 <= min_operands <= max_operands, got {self.min_operands}, "
                f"{self.max_operands}"
            )
        if self.max_number < 0:
            raise ValueError(f"max_number must be >= 0, got {self.max_number}")
        if not self.operators or not set(self.operators) <= set(OPERATORS):
            raise ValueError(f"operators must be a non-empty subset of {OPERATORS}")
        if not 0.0 <= self.subexpr_prob <= 1.0:
            raise ValueError(f"subexpr_prob must lie in [0, 1], got {self.subexpr_prob}")
        if self.max_source_length is not None and self.max_source_length < 1:
            raise ValueError(f"max_source_length must be positive, got {self.max_source_length}")

    def min_source_length(self, depth: int) -> int:
        """Length of the shortest source of this depth (a chain of minimal expressions)."""
        return depth * (self.min_operands + 2) + 1


DEFAULT_CONFIG = GeneratorConfig()
_MAX_REDRAWS = 1000  # rejection-sampling budget per formula (the defaults need < 1.02 on average)


class _TooLong(Exception):
    """Raised by :func:`_draw` once a formula outgrows ``max_source_length``."""


@dataclass
class _Budget:
    """Source tokens a draw may still use (so an oversized draw stops early)."""

    left: float

    def spend(self, tokens: int) -> None:
        self.left -= tokens
        if self.left < 0:
            raise _TooLong


def _draw(depth: int, rng: random.Random, config: GeneratorConfig, budget: _Budget) -> Expr:
    budget.spend(3)  # "(", the operator, ")"
    k = rng.randint(config.min_operands, config.max_operands)
    spine = rng.randrange(k)  # position of the operand of depth exactly depth - 1
    op = rng.choice(config.operators)
    args: list[Operand] = []
    for i in range(k):
        if i == spine and depth > 1:
            args.append(_draw(depth - 1, rng, config, budget))
        elif i != spine and depth > 1 and rng.random() < config.subexpr_prob:
            args.append(_draw(rng.randint(1, depth - 1), rng, config, budget))
        else:
            budget.spend(1)
            args.append(rng.randint(0, config.max_number))
    return Expr(op, tuple(args))


def random_expression(
    depth: int, rng: random.Random, config: GeneratorConfig = DEFAULT_CONFIG
) -> Expr:
    """A random formula of depth exactly ``depth`` (>= 1); see :class:`GeneratorConfig`.

    >>> e = random_expression(3, random.Random(0))
    >>> depth(e), to_prefix(e)[:2]
    (3, ['(', '+'])
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be an int >= 1, got {depth!r}")
    cap = config.max_source_length
    if cap is not None and config.min_source_length(depth) > cap:
        raise ValueError(
            f"no source of depth {depth} fits max_source_length={cap} "
            f"(the shortest has {config.min_source_length(depth)} tokens)"
        )
    for _ in range(_MAX_REDRAWS):
        try:
            return _draw(depth, rng, config, _Budget(math.inf if cap is None else cap))
        except _TooLong:
            continue  # redraw: a draw stops as soon as it outgrows the cap
    raise RuntimeError(
        f"no source of depth {depth} within max_source_length={cap} in {_MAX_REDRAWS} draws; "
        "raise max_source_length or lower subexpr_prob"
    )


# ----------------------------------------------------------------------------- pairs and splits


@dataclass(frozen=True)
class Pair:
    """A source/target token sequence pair and the source's depth."""

    source: tuple[str, ...]  # prefix tokens, no root symbol
    target: tuple[str, ...]  # infix tokens
    depth: int  # maximum parenthesis nesting of the source (source_depth)


def source_depth(tokens: Iterable[str]) -> int:
    """Maximum nesting of ``(`` ... ``)`` in a token sequence (need not be well formed)."""
    level = best = 0
    for token in tokens:
        if token == "(":
            level += 1
            best = max(best, level)
        elif token == ")":
            level -= 1
    return best


def make_pair(expr: Expr) -> Pair:
    """The (prefix, infix) pair of a formula."""
    return Pair(tuple(to_prefix(expr)), tuple(to_infix(expr)), depth(expr))


def _sample_split(
    name: str,
    seed: int,
    per_depth: int,
    depths: Sequence[int],
    config: GeneratorConfig,
    taken: set[tuple[str, ...]],
) -> list[Pair]:
    pairs: list[Pair] = []
    for d in depths:
        # One stream per (seed, split, depth): a split does not change when another split's
        # sizes do (except through the deduplication against earlier splits).
        rng = random.Random(f"structattn.tree_transduction:{seed}:{name}:{d}")
        count = attempts = 0
        max_attempts = 100 * per_depth + 1000
        while count < per_depth:
            attempts += 1
            if attempts > max_attempts:
                raise RuntimeError(
                    f"{name}: only {count} distinct unseen sources of depth {d} after "
                    f"{max_attempts} draws; ask for fewer or loosen the GeneratorConfig"
                )
            pair = make_pair(random_expression(d, rng, config))
            if pair.source in taken:
                continue
            taken.add(pair.source)
            pairs.append(pair)
            count += 1
    return pairs


def generate_splits(
    seed: int = 0,
    *,
    train_per_depth: int = 5000,
    train_depths: Sequence[int] = (2, 3, 4),
    valid_per_depth: int = 100,
    valid_depths: Sequence[int] = (2, 3, 4, 5, 6),
    test_per_depth: int = 200,
    test_depths: Sequence[int] = (2, 3, 4, 5, 6),
    config: GeneratorConfig = DEFAULT_CONFIG,
) -> dict[str, list[Pair]]:
    """The paper's splits, reproducible from ``seed``: ``{"train", "valid", "test"}``.

    Defaults follow section 4.1: train 15K pairs of depth 2-4 (5K per depth), test 1K pairs
    of depth 2-6 (200 per depth). The paper does not describe its validation set; here it has
    100 pairs per depth 2-6, so model selection can watch generalisation to deeper formulas
    (select on ``pair.depth <= 4`` for the strictly in-distribution protocol).

    No source occurs twice in a split nor in two splits: test is drawn first, then valid, then
    train, each redrawing any source already taken. Valid and test are ordered by depth;
    train is shuffled (seeded).
    """
    for name, n in (
        ("train", train_per_depth),
        ("valid", valid_per_depth),
        ("test", test_per_depth),
    ):
        if n < 0:
            raise ValueError(f"{name}_per_depth must be >= 0, got {n}")
    taken: set[tuple[str, ...]] = set()
    test = _sample_split("test", seed, test_per_depth, test_depths, config, taken)
    valid = _sample_split("valid", seed, valid_per_depth, valid_depths, config, taken)
    train = _sample_split("train", seed, train_per_depth, train_depths, config, taken)
    random.Random(f"structattn.tree_transduction:{seed}:train:shuffle").shuffle(train)
    return {"train": train, "valid": valid, "test": test}


# ----------------------------------------------------------------------------- files


def _format_line(pair: Pair) -> str:
    return " ".join(pair.source) + "\t" + " ".join(pair.target) + "\n"


def _counts_by_depth(pairs: Iterable[Pair]) -> dict[str, int]:
    counts = Counter(pair.depth for pair in pairs)
    return {str(d): counts[d] for d in sorted(counts)}


def write_splits(
    splits: Mapping[str, Sequence[Pair]],
    out_dir: str | os.PathLike[str],
    *,
    seed: int | None = None,
    config: GeneratorConfig | None = None,
) -> dict[str, Path]:
    """Write ``<name>.tsv`` per split and ``meta.json``; returns ``{name: path}`` (and
    ``"meta"``). Each file is written to a temporary file and renamed into place.

    ``meta.json`` records the format, the seed and generator config (when given) and the
    counts per depth; it has no timestamps, so equal splits give identical files.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name, pairs in splits.items():
        if not _SPLIT_NAME.fullmatch(name) or name == "meta":
            raise ValueError(f"split name must match [A-Za-z0-9_-]+ and not be 'meta': {name!r}")
        for pair in pairs:
            for side in (pair.source, pair.target):
                if not side or any(not t or any(c.isspace() for c in t) for t in side):
                    raise ValueError(f"{name}: cannot write a pair with empty/whitespace tokens")
        paths[name] = out / f"{name}.tsv"
        atomic_write_text(paths[name], "".join(_format_line(pair) for pair in pairs))
    meta = {
        "task": "tree-transduction (prefix -> infix), Kim et al. 2017 section 4.1",
        "format": "one pair per line: source<TAB>target, tokens separated by single spaces, "
        "no root symbol",
        "seed": seed,
        "generator_config": None if config is None else asdict(config),
        "files": {name: path.name for name, path in paths.items()},
        "counts_per_depth": {name: _counts_by_depth(pairs) for name, pairs in splits.items()},
    }
    paths["meta"] = out / "meta.json"
    atomic_write_text(paths["meta"], json.dumps(meta, indent=2) + "\n")
    return paths


def _check_field(text: str, what: str) -> str | None:
    """What is wrong with one side of a line, or None."""
    if not text:
        return f"empty {what}"
    if text != text.strip(" "):
        return f"leading or trailing space in the {what}"
    if "  " in text:
        return f"more than one space between tokens of the {what}"
    odd = sorted({c for c in text if c.isspace() and c != " "})
    if odd:
        hint = " (Windows line ending?)" if "\r" in odd else ""
        return f"whitespace other than single spaces in the {what}: {odd!r}{hint}"
    return None


def read_pairs(path: str | os.PathLike[str]) -> list[Pair]:
    """Read a ``source<TAB>target`` file (UTF-8, ``\\n`` line ends) into :class:`Pair` s.

    Any tokens are accepted (the file need not hold valid formulas); ``Pair.depth`` is
    :func:`source_depth` of the source. Empty lines at the end of the file are ignored; any
    other malformed line raises ``ValueError("<path>:<line>: <what is wrong>")``: an empty
    line before the end, no tab, more than one tab, an empty source or target, a leading,
    trailing or doubled space, or any whitespace other than single spaces (tabs, ``\\r``). A
    file without a pair (empty: a cut copy) raises ``ValueError`` naming it too.
    """
    text = read_utf8(path)
    lines = text.split("\n")
    while lines and lines[-1] == "":
        lines.pop()  # the final newline and any blank lines at the end
    if not lines:
        error = empty_file_error(path, "'source<TAB>target' lines")
        raise ValueError(f"{error}; `structattn data tree-transduction --out DIR` writes them")
    pairs: list[Pair] = []
    for lineno, line in enumerate(lines, start=1):
        if not line:
            raise ValueError(f"{path}:{lineno}: empty line (only allowed at the end of the file)")
        tabs = line.count("\t")
        if tabs != 1:
            found = "no tab" if tabs == 0 else f"{tabs} tabs"
            raise ValueError(f"{path}:{lineno}: expected 'source<TAB>target', found {found}")
        source, target = line.split("\t")
        for text_, what in ((source, "source"), (target, "target")):
            problem = _check_field(text_, what)
            if problem:
                raise ValueError(f"{path}:{lineno}: {problem}")
        src = tuple(source.split(" "))
        pairs.append(Pair(src, tuple(target.split(" ")), source_depth(src)))
    return pairs


def read_splits(data_dir: str | os.PathLike[str]) -> dict[str, list[Pair]]:
    """Read ``train.tsv``, ``valid.tsv`` and ``test.tsv`` from a directory; ``ValueError``
    naming the file when a split has no pairs (:func:`read_pairs` refuses an empty file: an
    empty validation set would score as perfect, perplexity 1)."""
    directory = Path(data_dir)
    missing = [f"{n}.tsv" for n in SPLIT_NAMES if not (directory / f"{n}.tsv").is_file()]
    if missing:
        raise FileNotFoundError(f"{directory}: missing {', '.join(missing)}")
    return {name: read_pairs(directory / f"{name}.tsv") for name in SPLIT_NAMES}


# ----------------------------------------------------------------------------- vocabulary


@dataclass(frozen=True)
class Vocabulary(TokenVocabulary):
    """Token <-> id map with the special tokens first.

    Ids: ``<pad>`` 0, ``<unk>`` 1, ``<s>`` 2, ``</s>`` 3, ``$`` 4 (the root symbol the model
    prepends to each source), then the data tokens: operators and parentheses in code-point
    order, then numbers in numeric order, then any other token. Unknown tokens encode to
    ``<unk>``.

    >>> vocab = Vocabulary.build([Pair(("(", "+", "1", "2", ")"), ("1", "+", "2"), 1)])
    >>> vocab.encode(["$", "(", "+", "1", "7", ")"])
    [4, 5, 7, 8, 1, 6]
    >>> vocab.decode([4, 5, 7, 8, 1, 6])
    ['$', '(', '+', '1', '<unk>', ')']
    """

    BOS: ClassVar[str] = "<s>"
    EOS: ClassVar[str] = "</s>"
    ROOT: ClassVar[str] = "$"
    SPECIALS: ClassVar[tuple[str, ...]] = (TokenVocabulary.PAD, TokenVocabulary.UNK, BOS, EOS, ROOT)
    KIND: ClassVar[str] = "structattn.Vocabulary"

    @classmethod
    def build(cls, pairs: Iterable[Pair], min_count: int = 1) -> Vocabulary:
        """The specials plus every source or target token seen at least ``min_count`` times."""
        counts: Counter[str] = Counter()
        for pair in pairs:
            counts.update(pair.source)
            counts.update(pair.target)
        kept = [t for t, c in counts.items() if c >= min_count and t not in cls.SPECIALS]

        def key(token: str) -> tuple[int, int, str]:
            if _NUMBER.fullmatch(token):
                return (1, int(token), token)
            return (0 if token in ("(", ")", *OPERATORS) else 2, 0, token)

        return cls(cls.SPECIALS + tuple(sorted(kept, key=key)))

    @property
    def bos_id(self) -> int:
        """Id of ``<s>`` (2)."""
        return 2

    @property
    def eos_id(self) -> int:
        """Id of ``</s>`` (3)."""
        return 3

    @property
    def root_id(self) -> int:
        """Id of the root symbol ``$`` (4)."""
        return 4

    def encode_batch(
        self,
        sequences: Sequence[Sequence[str]],
        *,
        add_root: bool = False,
        add_bos: bool = False,
        add_eos: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Padded ids ``LongTensor[B, N]`` (``<pad>`` = 0 on the right) and ``lengths``
        ``LongTensor[B]``; optionally prepend ``$`` (sources) or ``<s>`` and append ``</s>``
        (targets)."""
        import torch

        from .batching import pad_sequences  # imports torch: not at this module's import

        prefix = ([self.root_id] if add_root else []) + ([self.bos_id] if add_bos else [])
        suffix = [self.eos_id] if add_eos else []
        rows = [prefix + self.encode(seq) + suffix for seq in sequences]
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)  # [B]
        return pad_sequences(rows, self.pad_id), lengths  # [B, N]


# ----------------------------------------------------------------------------- CLI hook


def format_summary(splits: Mapping[str, Sequence[Pair]]) -> str:
    """A table of pair counts and mean / max source and target lengths per split and depth."""
    rows = [
        f"{'split':<6} {'depth':>5} {'pairs':>6} {'src mean':>8} {'src max':>7} "
        f"{'tgt mean':>8} {'tgt max':>7}"
    ]
    for name, pairs in splits.items():
        for d in sorted({p.depth for p in pairs}):
            group = [p for p in pairs if p.depth == d]
            src = [len(p.source) for p in group]
            tgt = [len(p.target) for p in group]
            rows.append(
                f"{name:<6} {d:>5} {len(group):>6} {statistics.fmean(src):>8.1f} "
                f"{max(src):>7} {statistics.fmean(tgt):>8.1f} {max(tgt):>7}"
            )
    return "\n".join(rows)


def main_data(
    out_dir: str,
    seed: int = 0,
    *,
    train_per_depth: int = 5000,
    valid_per_depth: int = 100,
    test_per_depth: int = 200,
) -> None:
    """``structattn data tree-transduction --out DIR``: generate, write and summarise."""
    splits = generate_splits(
        seed,
        train_per_depth=train_per_depth,
        valid_per_depth=valid_per_depth,
        test_per_depth=test_per_depth,
    )
    paths = write_splits(splits, out_dir, seed=seed, config=DEFAULT_CONFIG)
    print(format_summary(splits))
    print("wrote " + ", ".join(str(paths[name]) for name in (*splits, "meta")))
