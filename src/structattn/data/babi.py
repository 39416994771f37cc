"""bAbI question answering (Weston et al. 2015), as used by Kim et al. 2017, section 4.3 / A.4.

A bAbI file holds stories; each line is ``ID text`` and IDs restart at 1 for every story.
Question lines carry the answer and the IDs of the supporting facts, TAB-separated::

    1 Mary moved to the bathroom.
    2 Sandra journeyed to the bedroom.
    3 Mary got the football there.
    4 John went to the kitchen.
    5 Mary went back to the kitchen.
    6 Mary went back to the garden.
    7 Where is the football? <TAB>garden<TAB>3 6

:func:`read_babi` turns each question into a :class:`BabiExample` whose *memory* is the story
sentences before the question (question lines are not memory), oldest first, cut to the
``memory_size`` (paper: 25) most recent ones. Supporting facts are kept twice: as the 1-based
line IDs of the file (``support_lines``, the numbering of predictions files) and as 0-based
indices into the memory (``support``), in the file's order (the reasoning order, which is not
always chronological: task 2 has ``12 6``). A supporting fact that fell out of the memory window
has memory index ``None``: no model can select it, so :func:`fact_sequence_accuracy` counts that
question as a miss (and ``BabiExample.support_in_memory`` tells such questions apart).

Tokenisation (as in MemN2N): lowercase, split on whitespace, split off and drop ``?``, ``.``
and ``,``. Answers are lowercased too (task 5 answers names such as ``Fred``) and kept as one
token even when they are comma-separated lists (tasks 8 and 19: ``football,apple``, ``n,w``).

Splits: :func:`load_task` holds out a seeded 10% of the training *questions* as validation
(what MemN2N does, and what the paper's "10% held-out validation set" refers to); the test file
is returned separately and must only be used for final numbers.

Only the standard library is used, except :meth:`BabiVocabulary.encode_batch` (torch).

>>> ex = parse_babi_lines(["1 Mary went to the garden.", "2 Where is Mary?\\tgarden\\t1"])[0]
>>> ex.memory, ex.question, ex.answer, ex.support_lines, ex.support
((('mary', 'went', 'to', 'the', 'garden'),), ('where', 'is', 'mary'), 'garden', (1,), (0,))
"""

from __future__ import annotations

import json
import operator
import os
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from ..io import atomic_write_text, empty_file_error, read_utf8, shared_data_dir
from ._vocab import TokenVocabulary

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = [
    "FACT_EXCLUDED_TASKS",
    "MEMORY_SIZE",
    "MODEL_NAMES",
    "PAPER_HOPS",
    "PAPER_TABLE4",
    "PAPER_TABLE4_AVERAGE",
    "PAPER_TASKS",
    "SPLIT_NAMES",
    "TABLE_ORDER",
    "BabiBatch",
    "BabiExample",
    "BabiVocabulary",
    "EncodedQuestions",
    "answer_accuracy",
    "default_data_dir",
    "fact_sequence_accuracy",
    "load_task",
    "padded_widths",
    "parse_babi_lines",
    "read_babi",
    "split_train_valid",
    "task_files",
    "tokenize",
    "write_predictions",
]

MEMORY_SIZE = 25
"""The paper's memory capacity: the 25 most recent story sentences (appendix A.4)."""

SPLIT_NAMES: tuple[str, ...] = ("train", "valid", "test")
"""The splits :func:`load_task` returns."""

PAPER_TASKS: tuple[int, ...] = (2, 3, 7, 8, 11, 13, 14, 15, 16, 17, 18, 19)
"""The tasks of Table 4 (the paper leaves out the single-supporting-fact tasks)."""

FACT_EXCLUDED_TASKS: tuple[int, ...] = (7, 8)
"""Tasks left out of Fact % (a variable number of supporting facts), as in Table 4."""

PAPER_HOPS: dict[int, int] = {
    2: 2, 3: 3, 7: 3, 8: 3, 11: 2, 13: 2, 14: 2, 15: 2, 16: 3, 17: 2, 18: 2, 19: 2,
}  # fmt: skip
"""Hops / CRF steps K per task (Table 4, column K)."""

# Table 4 of Kim et al. 2017: test (Ans %, Fact %) on bAbI 1k; Fact % is None for tasks 7, 8.
# Column order in the paper is MemN2N, Binary CRF, Unary CRF (the converted markdown has lost
# the header row; the order follows from the text: "MemN2N and the Binary CRF model perform
# similarly while the Unary CRF model does worse"). The paper labels task 11 "indefinite
# knowledge", but bAbI task 11 is basic coreference (10 is indefinite knowledge).
_T4: dict[int, tuple[tuple[float, float | None], ...]] = {  # task: (MemN2N, Binary, Unary)
    2: ((87.3, 46.8), (84.7, 81.8), (43.5, 22.3)),
    3: ((52.6, 1.4), (40.5, 0.1), (28.2, 0.0)),
    7: ((83.2, None), (83.5, None), (79.3, None)),
    8: ((94.1, None), (93.3, None), (87.1, None)),
    11: ((97.8, 38.2), (97.7, 80.8), (88.6, 0.0)),
    13: ((95.6, 14.8), (97.0, 36.4), (94.4, 9.3)),
    14: ((99.9, 77.6), (99.7, 98.2), (90.5, 30.2)),
    15: ((100.0, 59.3), (100.0, 89.5), (100.0, 51.4)),
    16: ((97.1, 91.0), (97.9, 85.6), (98.0, 41.4)),
    17: ((61.1, 23.9), (60.6, 49.6), (59.7, 10.5)),
    18: ((86.4, 3.3), (92.2, 3.9), (92.0, 1.4)),
    19: ((21.3, 10.2), (24.4, 11.5), (24.3, 7.8)),
}
_MODELS = ("memn2n", "binary_crf", "unary_crf")

PAPER_TABLE4: dict[str, dict[int, tuple[float, float | None]]] = {
    model: {task: row[m] for task, row in _T4.items()} for m, model in enumerate(_MODELS)
}
"""``PAPER_TABLE4[model][task] = (Ans %, Fact %)`` for ``model`` in ``memn2n``, ``binary_crf``,
``unary_crf``; Fact % is ``None`` for tasks 7 and 8. Ans % is the test accuracy of the best of
20 runs on validation; Fact % is the mean over the 10 best runs."""

PAPER_TABLE4_AVERAGE: dict[str, tuple[float, float]] = {
    "memn2n": (81.4, 39.6),
    "binary_crf": (81.0, 53.7),
    "unary_crf": (73.8, 17.4),
}
"""The AVERAGE row of Table 4: (Ans % over the 12 tasks, Fact % over the 10 tasks). The rows
above it give the same averages to rounding except MemN2N Fact %: they average to 36.65, not
39.6 (as printed in the paper)."""

TABLE_ORDER: tuple[str, ...] = ("memn2n", "binary-crf", "unary-crf")
"""The models of Table 4 in the paper's column order (the ``babi`` recipe's variants)."""

MODEL_NAMES: dict[str, str] = {
    "memn2n": "MemN2N",
    "binary-crf": "Binary CRF",
    "unary-crf": "Unary CRF",
}
"""The paper's name of each model."""

_LINE = re.compile(r"([0-9]+) (.*)", re.DOTALL)  # "ID text"
_DROPPED = re.compile(r"[?.,]")  # punctuation split off and dropped by tokenize
_TASK_IN_NAME = re.compile(r"qa([0-9]+)_")


def tokenize(text: str) -> list[str]:
    """Lowercase, split on whitespace, split off and drop ``?``, ``.`` and ``,``.

    >>> tokenize("Where is the football? ")
    ['where', 'is', 'the', 'football']
    """
    return _DROPPED.sub(" ", text.lower()).split()


# ----------------------------------------------------------------------------- examples


@dataclass(frozen=True)
class BabiExample:
    """One question with its memory (see the module docstring for the conventions)."""

    task: int  # bAbI task id (1..20), from the file name qaN_...; 0 if the name has none
    story: int  # 0-based index of the story in its file
    question_index: int  # 0-based index of the question among its story's questions
    memory: tuple[tuple[str, ...], ...]  # story sentences before the question, oldest first
    memory_lines: tuple[int, ...]  # their 1-based IDs in the story (as in the file)
    question: tuple[str, ...]  # question tokens
    answer: str  # lowercased answer, one token (comma-separated lists kept whole: "n,w")
    support_lines: tuple[int, ...]  # supporting-fact IDs as in the file, in the file's order
    support: tuple[int | None, ...]  # the same facts as 0-based memory indices; None = dropped
    dropped: int  # story sentences before the question left out by the memory window
    line: int  # line number of the question in its file (1-based)

    @property
    def support_in_memory(self) -> bool:
        """True when every supporting fact is inside the memory window."""
        return None not in self.support

    def lines_of(self, indices: Iterable[int]) -> list[int]:
        """The story IDs (file numbering) of 0-based memory indices, e.g. a model's argmax."""
        out = []
        for i in indices:
            j = operator.index(i)
            if not 0 <= j < len(self.memory_lines):
                raise ValueError(f"memory index {j} out of range for {len(self.memory)} sentences")
            out.append(self.memory_lines[j])
        return out


def _task_of(path: str | os.PathLike[str]) -> int:
    match = _TASK_IN_NAME.match(Path(path).name)
    return int(match.group(1)) if match else 0


def _malformed(where: str, message: str) -> ValueError:
    return ValueError(f"{where}: {message}")


def parse_babi_lines(
    lines: Iterable[str],
    *,
    memory_size: int | None = MEMORY_SIZE,
    source: str = "<lines>",
    task: int = 0,
) -> list[BabiExample]:
    """Parse bAbI lines (without line ends); errors read ``"<source>:<line>: ..."``.

    See :func:`read_babi` for the format and the checks; ``memory_size=None`` keeps the whole
    story.
    """
    if memory_size is not None and (isinstance(memory_size, bool) or memory_size < 1):
        raise ValueError(f"memory_size must be a positive int or None, got {memory_size!r}")
    examples: list[BabiExample] = []
    story = -1
    previous = 0  # ID of the previous line (0 before the first line)
    sentences: dict[int, tuple[str, ...]] = {}  # ID -> tokens of the story's sentences so far
    questions = 0  # questions seen in the current story
    for lineno, line in enumerate(lines, start=1):
        where = f"{source}:{lineno}"
        if "\r" in line:
            raise _malformed(where, "carriage return in line (Windows line ending?)")
        if "\0" in line:
            raise _malformed(where, "a NUL byte (not a text file, or corrupted)")
        match = _LINE.fullmatch(line)
        if not match:
            if not line.strip():
                raise _malformed(where, "empty line (only allowed at the end of the file)")
            raise _malformed(where, f"expected '<number> <text>', got {line[:40]!r}")
        number = int(match.group(1))
        if number == 1:
            story, sentences, questions = story + 1, {}, 0
        elif number != previous + 1 or story < 0:
            expected = "1" if story < 0 else f"{previous + 1} or 1 (a new story)"
            raise _malformed(where, f"line ID {number}, expected {expected}")
        previous = number
        fields = match.group(2).split("\t")
        text = fields[0]
        if len(fields) == 1:
            if text.rstrip().endswith("?"):
                raise _malformed(where, "question without '<TAB>answer<TAB>supporting fact IDs'")
            tokens = tuple(tokenize(text))
            if not tokens:
                raise _malformed(where, f"sentence {number} has no words")
            sentences[number] = tokens
            continue
        if len(fields) != 3:
            raise _malformed(
                where,
                f"a question line needs 'ID question<TAB>answer<TAB>supporting fact IDs', "
                f"found {len(fields) - 1} tab(s)",
            )
        question = tuple(tokenize(text))
        if not question:
            raise _malformed(where, f"question {number} has no words")
        answer = fields[1].strip().lower()
        if not answer or any(c.isspace() for c in answer):
            raise _malformed(where, f"answer must be one non-empty token, got {fields[1]!r}")
        ids = fields[2].split()
        if not ids:
            raise _malformed(where, "no supporting fact IDs")
        support_lines: list[int] = []
        for token in ids:
            if not token.isdigit() or int(token) not in sentences:
                raise _malformed(
                    where,
                    f"supporting fact {token!r} is not an earlier story sentence of this story",
                )
            support_lines.append(int(token))
        story_ids = list(sentences)  # insertion order = chronological
        kept = story_ids if memory_size is None else story_ids[-memory_size:]
        position = {line_id: i for i, line_id in enumerate(kept)}
        examples.append(
            BabiExample(
                task=task,
                story=story,
                question_index=questions,
                memory=tuple(sentences[i] for i in kept),
                memory_lines=tuple(kept),
                question=question,
                answer=answer,
                support_lines=tuple(support_lines),
                support=tuple(position.get(i) for i in support_lines),
                dropped=len(story_ids) - len(kept),
                line=lineno,
            )
        )
        questions += 1
    return examples


def read_babi(
    path: str | os.PathLike[str], memory_size: int | None = MEMORY_SIZE
) -> list[BabiExample]:
    """Read a bAbI file (UTF-8, ``\\n`` line ends) into one :class:`BabiExample` per question.

    The task id comes from the file name (``qa<N>_...``; 0 otherwise). Blank lines at the end
    of the file are ignored; any other malformed line raises ``ValueError("<path>:<line>: <what
    is wrong>")``: invalid UTF-8, a carriage return, a NUL byte, an empty line, no leading
    ``ID`` and space, the first ID not 1, an ID that neither follows the previous one nor
    restarts a story at 1, a sentence or question without words, a question (ends with ``?``)
    without the two TAB fields, a wrong number of TABs, an empty or multi-word answer, no
    supporting fact IDs, or a supporting fact ID that is not an earlier story sentence (not a
    question) of the same story. A file with no line (empty or blank: a cut download) raises
    ``ValueError`` naming it and the ``structattn download babi`` that fetches it again.
    """
    text = read_utf8(path)
    lines = text.split("\n")
    while lines and not lines[-1].strip():
        lines.pop()  # the final newline and blank lines at the end
    if not lines:
        raise empty_file_error(path, "bAbI lines '<ID> <text>'", "babi")
    return parse_babi_lines(lines, memory_size=memory_size, source=str(path), task=_task_of(path))


# ----------------------------------------------------------------------------- files and splits


def default_data_dir() -> Path:
    """``<root>/babi/en`` for the first data root that has it (:func:`structattn.io.data_dir`:
    ``$STRUCTATTN_DATA``, the user cache, ``../shared/data``).

    Raises ``FileNotFoundError`` (telling the user to pass ``--data-dir``) when none has.
    """
    return shared_data_dir(
        "babi",
        "en",
        what="bAbI data",
        hint=" pointing at the directory with qa1_single-supporting-fact_train.txt ... "
        "(bAbI v1.2, tasks_1-20_v1-2/en)",
    )


def task_files(data_dir: str | os.PathLike[str], task: int) -> tuple[Path, Path]:
    """``(train, test)`` paths ``qa<task>_*_train.txt`` and ``qa<task>_*_test.txt``."""
    if isinstance(task, bool) or not isinstance(task, int) or not 1 <= task <= 20:
        raise ValueError(f"task must be an int in 1..20, got {task!r}")
    directory = Path(data_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: not a directory (pass --data-dir)")
    found = []
    for split in ("train", "test"):
        matches = sorted(directory.glob(f"qa{task}_*_{split}.txt"))
        if len(matches) != 1:
            what = "no file" if not matches else f"{len(matches)} files"
            raise FileNotFoundError(f"{directory}: {what} matching qa{task}_*_{split}.txt")
        found.append(matches[0])
    return found[0], found[1]


def split_train_valid(
    examples: Sequence[BabiExample],
    valid_fraction: float = 0.1,
    seed: int = 0,
    unit: Literal["question", "story"] = "question",
) -> tuple[list[BabiExample], list[BabiExample]]:
    """Hold out ``round(valid_fraction * n)`` questions (or stories) by a seeded shuffle.

    ``unit="question"`` (default) is what MemN2N does; questions of one story may then land on
    both sides (a validation question may share its story prefix with a training question).
    ``unit="story"`` keeps stories whole. Both lists keep file order. The shuffle depends only
    on ``seed``, the task and the number of units.
    """
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must lie in [0, 1), got {valid_fraction}")
    if unit not in ("question", "story"):
        raise ValueError(f"unit must be 'question' or 'story', got {unit!r}")
    keys = (
        list(range(len(examples))) if unit == "question" else sorted({ex.story for ex in examples})
    )
    task = examples[0].task if examples else 0
    order = list(keys)
    random.Random(f"structattn.babi:{seed}:{task}:{unit}:valid").shuffle(order)
    held = set(order[: round(valid_fraction * len(keys))])
    train: list[BabiExample] = []
    valid: list[BabiExample] = []
    for i, ex in enumerate(examples):
        (valid if (i if unit == "question" else ex.story) in held else train).append(ex)
    return train, valid


def load_task(
    data_dir: str | os.PathLike[str] | None,
    task: int,
    valid_fraction: float = 0.1,
    seed: int = 0,
    memory_size: int | None = MEMORY_SIZE,
    unit: Literal["question", "story"] = "question",
) -> dict[str, list[BabiExample]]:
    """``{"train", "valid", "test"}`` for one task; ``data_dir=None`` uses
    :func:`default_data_dir`. Validation is held out from the training file
    (:func:`split_train_valid`); the test file is only for final numbers."""
    directory = default_data_dir() if data_dir is None else Path(data_dir)
    train_path, test_path = task_files(directory, task)
    train, valid = split_train_valid(read_babi(train_path, memory_size), valid_fraction, seed, unit)
    return {"train": train, "valid": valid, "test": read_babi(test_path, memory_size)}


# ----------------------------------------------------------------------------- vocabulary


@dataclass(frozen=True)
class BabiBatch:
    """Padded ids of a batch of :class:`BabiExample` (``<pad>`` = 0 on the right)."""

    memory: Tensor  # LongTensor[B, M, L] word ids, sentences oldest first
    memory_lengths: Tensor  # LongTensor[B] sentences per example (M_b)
    sentence_lengths: Tensor  # LongTensor[B, M] words per sentence (0 for padding)
    question: Tensor  # LongTensor[B, Q] word ids
    question_lengths: Tensor  # LongTensor[B]
    answer: Tensor  # LongTensor[B] answer ids (same vocabulary)
    support: Tensor | None = None  # LongTensor[B, S] gold facts as memory indices, in order
    # (-1 = padding, -2 = a fact outside the memory window)


@dataclass(frozen=True)
class BabiVocabulary(TokenVocabulary):
    """One shared word <-> id map for sentences, questions and answers.

    Shared (as in MemN2N) because the adjacent weight tying of appendix A.4 ties the answer
    matrix ``W`` to the last output embedding, so answers must live in the word space. A list
    answer such as ``n,w`` is one token. Ids: ``<pad>`` 0, ``<unk>`` 1, then the words in
    code-point order. Build it from train + valid only; unknown words encode to ``<unk>``.

    >>> ex = parse_babi_lines(["1 Mary went to the garden.", "2 Where is Mary?\\tgarden\\t1"])
    >>> vocab = BabiVocabulary.build(ex)
    >>> vocab.tokens
    ('<pad>', '<unk>', 'garden', 'is', 'mary', 'the', 'to', 'went', 'where')
    >>> vocab.encode(["mary", "ran"]), vocab.encode_answer("garden")
    ([4, 1], 2)
    """

    KIND: ClassVar[str] = "structattn.BabiVocabulary"

    @classmethod
    def build(cls, examples: Iterable[BabiExample]) -> BabiVocabulary:
        """The specials plus every memory, question and answer token of ``examples``."""
        words: set[str] = set()
        for ex in examples:
            for sentence in ex.memory:
                words.update(sentence)
            words.update(ex.question)
            words.add(ex.answer)
        return cls(cls.SPECIALS + tuple(sorted(words - set(cls.SPECIALS))))

    def encode_answer(self, answer: str) -> int:
        """Id of an answer token (``<unk>`` if unseen, which no prediction can match)."""
        return self._index.get(answer, self.unk_id)

    def encode_batch(self, examples: Sequence[BabiExample]) -> BabiBatch:
        """Pad a batch: memory ``[B, M, L]``, question ``[B, Q]``, answer ``[B]``, supporting
        facts ``[B, S]`` (memory indices, -1 = padding, -2 = outside the memory)."""
        import torch

        size = len(examples)
        mem = [[self.encode(s) for s in ex.memory] for ex in examples]
        m = max((len(rows) for rows in mem), default=0)
        width = max((len(s) for rows in mem for s in rows), default=0)
        memory = torch.full((size, m, width), self.pad_id, dtype=torch.long)  # [B, M, L]
        sentence_lengths = torch.zeros(size, m, dtype=torch.long)  # [B, M]
        for b, rows in enumerate(mem):
            for i, row in enumerate(rows):
                memory[b, i, : len(row)] = torch.tensor(row, dtype=torch.long)  # [L_bi]
                sentence_lengths[b, i] = len(row)
        questions = [self.encode(ex.question) for ex in examples]
        q = max((len(row) for row in questions), default=0)
        question = torch.full((size, q), self.pad_id, dtype=torch.long)  # [B, Q]
        for b, row in enumerate(questions):
            question[b, : len(row)] = torch.tensor(row, dtype=torch.long)  # [Q_b]
        facts = max((len(ex.support) for ex in examples), default=0)
        support = torch.full((size, facts), -1, dtype=torch.long)  # [B, S]
        for b, ex in enumerate(examples):
            for k, fact in enumerate(ex.support):
                support[b, k] = -2 if fact is None else fact
        return BabiBatch(
            memory=memory,
            memory_lengths=torch.tensor([len(rows) for rows in mem], dtype=torch.long),
            sentence_lengths=sentence_lengths,
            question=question,
            question_lengths=torch.tensor([len(row) for row in questions], dtype=torch.long),
            answer=torch.tensor([self.encode_answer(ex.answer) for ex in examples]).long(),
            support=support,
        )


class EncodedQuestions:
    """A split encoded once as padded tensors (:meth:`BabiVocabulary.encode_batch`);
    ``batch(indices, device)`` slices it and trims the padding to the batch's longest."""

    def __init__(self, examples: Sequence[BabiExample], vocab: BabiVocabulary) -> None:
        self.full = vocab.encode_batch(examples)

    def batch(self, indices: Sequence[int], device: torch.device) -> BabiBatch:
        import torch

        f = self.full
        index = torch.as_tensor(list(indices), dtype=torch.long)
        memory_lengths = f.memory_lengths[index]
        slots = max(int(memory_lengths.max()), 1)
        sentence_lengths = f.sentence_lengths[index, :slots]
        width = max(int(sentence_lengths.max()), 1)
        question_lengths = f.question_lengths[index]
        qwidth = max(int(question_lengths.max()), 1)
        return BabiBatch(
            memory=f.memory[index, :slots, :width].to(device),
            memory_lengths=memory_lengths.to(device),
            sentence_lengths=sentence_lengths.to(device),
            question=f.question[index, :qwidth].to(device),
            question_lengths=question_lengths.to(device),
            answer=f.answer[index].to(device),
            support=None if f.support is None else f.support[index].to(device),
        )


def padded_widths(splits: Mapping[str, Sequence[BabiExample]]) -> tuple[int, int]:
    """(longest memory sentence, longest question) in words over all splits: the fixed J of
    the position encoding over padded widths (``position_encoding="padded"`` of ``babi``)."""
    examples = [ex for split in splits.values() for ex in split]
    sentence = max((len(s) for ex in examples for s in ex.memory), default=1)
    question = max((len(ex.question) for ex in examples), default=1)
    return max(sentence, 1), max(question, 1)


# ----------------------------------------------------------------------------- metrics


def answer_accuracy(predicted: Sequence[object], gold: Sequence[object]) -> float:
    """Fraction of equal answers (multiply by 100 for Ans %); the lists must be non-empty and
    of equal length.

    >>> answer_accuracy(["garden", "n,w", "yes"], ["garden", "w,n", "yes"])
    0.6666666666666666
    """
    if len(predicted) != len(gold):
        raise ValueError(f"{len(predicted)} predictions for {len(gold)} gold answers")
    if not gold:
        raise ValueError("no answers to score")
    return sum(p == g for p, g in zip(predicted, gold, strict=True)) / len(gold)


def fact_sequence_accuracy(
    predicted_sequences: Sequence[Sequence[int]],
    gold_sequences: Sequence[Sequence[int | None]],
) -> float:
    """Fraction of questions whose predicted fact sequence equals the gold one exactly, in
    order (multiply by 100 for Fact %).

    Both sides must use the same numbering (memory indices, or story IDs via
    :meth:`BabiExample.lines_of`). A sequence of another length is a miss (e.g. K hops for a
    question with fewer facts), and so is a gold ``None`` (a fact outside the memory window).
    An empty gold sequence cannot be scored and raises ``ValueError`` (every bAbI question has
    supporting facts; tasks 7 and 8, whose count varies, are left out by the caller, see
    :data:`FACT_EXCLUDED_TASKS`).

    >>> fact_sequence_accuracy([[2, 5], [5, 2], [1, 2, 3]], [[2, 5], [2, 5], [1, 2]])
    0.3333333333333333
    """
    if len(predicted_sequences) != len(gold_sequences):
        raise ValueError(
            f"{len(predicted_sequences)} predicted sequences for {len(gold_sequences)} gold ones"
        )
    if not gold_sequences:
        raise ValueError("no fact sequences to score")
    hits = 0
    for i, (pred, gold) in enumerate(zip(predicted_sequences, gold_sequences, strict=True)):
        if len(gold) == 0:
            raise ValueError(f"gold fact sequence {i} is empty")
        hits += [operator.index(p) for p in pred] == list(gold)
    return hits / len(gold_sequences)


# ----------------------------------------------------------------------------- predictions


def write_predictions(
    path: str | os.PathLike[str],
    examples: Sequence[BabiExample],
    predicted_answers: Sequence[str],
    predicted_facts: Sequence[Sequence[int]],
) -> Path:
    """Write one JSON object per question (atomically): ``task``, ``story``,
    ``question_index``, ``answer``, ``predicted_answer``, ``supporting_facts`` and
    ``predicted_facts``; facts are story IDs as in the file (``predicted_facts`` are given as
    0-based memory indices and converted with :meth:`BabiExample.lines_of`; a negative index,
    a CRF's "no valid sequence", becomes ``null``)."""
    if not len(examples) == len(predicted_answers) == len(predicted_facts):
        raise ValueError("examples, predicted_answers and predicted_facts differ in length")
    rows = []
    for ex, answer, facts in zip(examples, predicted_answers, predicted_facts, strict=True):
        row = {
            "task": ex.task,
            "story": ex.story,
            "question_index": ex.question_index,
            "answer": ex.answer,
            "predicted_answer": answer,
            "supporting_facts": list(ex.support_lines),
            "predicted_facts": [
                None if operator.index(i) < 0 else ex.lines_of([i])[0] for i in facts
            ],
        }
        rows.append(json.dumps(row) + "\n")
    return atomic_write_text(path, "".join(rows))
