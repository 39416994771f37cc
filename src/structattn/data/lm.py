"""Word-level language-modelling corpora (PTB, WikiText-2): vocabulary, id streams, batches
for truncated backpropagation through time, perplexity.

The conventions are the usual ones for these corpora (Mikolov's RNNLM, pytorch/examples'
``word_language_model``, AWD-LSTM, PRPN):

* A corpus file holds one sentence (PTB) or paragraph / heading (WikiText-2) per line; tokens
  are separated by whitespace (``str.split``). Every line, blank lines included, ends with
  ``<eos>``, and the lines of a split are concatenated into one stream.
* ``<unk>`` is a word like any other: both corpora already map rare words to it in the files.
  A word of valid / test that train never had encodes to ``<unk>`` (there is none in PTB or
  WikiText-2, and :func:`corpus_stats` counts them).
* The vocabulary is built from train only: ``<eos>`` = 0, ``<unk>`` = 1, then the words by
  decreasing train count (ties: first occurrence). No ``<pad>``: the streams need none, and the
  output layer keeps the published size (PTB 10,000 = 9,999 words + ``<eos>``; WikiText-2
  33,278).
* :func:`batchify` cuts a stream of N tokens into B contiguous columns of ``N // B`` tokens
  (the last ``N % B`` tokens are dropped) laid out as rows of ``[B, L]``: row b continues where
  row b-1 ends in the text. :func:`bptt_windows` walks it in windows of ``bptt`` steps:
  ``inputs = data[:, i : i + T]``, ``targets = data[:, i + 1 : i + 1 + T]``, so window k+1
  continues window k (carry the hidden state across them, detached). Every token of a row
  but its first is a target exactly once: ``B * (L - 1)`` predictions.
* Perplexity = ``exp(total NLL / number of predicted tokens)`` over the whole stream, ``<eos>``
  predictions counted (:func:`structattn.metrics.perplexity`, :func:`evaluate_stream`).

Loaders raise ``ValueError("<file>:<line>: ...")`` on malformed input: invalid UTF-8, a
carriage return (Windows line ends), a NUL or other control character inside a line, or the
reserved token ``<eos>`` in the text. Torch is imported by the functions that make tensors.

>>> vocab = LMVocabulary.build([["a", "b", "a"], ["c"]])
>>> vocab.tokens
('<eos>', '<unk>', 'a', 'b', 'c')
>>> vocab.encode_lines([["a", "c"], ["z"]])
[2, 4, 0, 1, 0]
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..io import read_utf8, shared_data_dir
from ..metrics import perplexity

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "EOS",
    "LM_SPLITS",
    "UNK",
    "BPTTWindow",
    "LMCorpus",
    "LMVocabulary",
    "StreamEvaluation",
    "batchify",
    "bptt_windows",
    "corpus_files",
    "corpus_stats",
    "default_lm_data_dir",
    "evaluate_stream",
    "line_nll",
    "load_lm_corpus",
    "read_lm_lines",
]

EOS = "<eos>"
"""End-of-line token appended to every line."""
UNK = "<unk>"
"""Unknown-word token (already present in the PTB and WikiText-2 files)."""
LM_SPLITS: tuple[str, ...] = ("train", "valid", "test")
"""The splits :func:`load_lm_corpus` returns."""

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # control characters other than tab / \n


# ----------------------------------------------------------------------------- reading


def read_lm_lines(path: str | os.PathLike[str]) -> list[list[str]]:
    """The whitespace tokens of every line of a corpus file (UTF-8, ``\\n`` line ends).

    Blank lines give empty lists (they still get an ``<eos>`` in the stream); the final
    newline does not make a line. Raises ``ValueError("<path>:<line>: ...")`` on invalid
    UTF-8, a carriage return, a control character (other than tab) or the token ``<eos>``.
    An empty file, or one of blank lines only, raises ``ValueError`` too.
    """
    text = read_utf8(path)
    if not text:
        raise ValueError(
            f"{path}: empty corpus file; a cut download or copy? `structattn download ptb` (or "
            "wikitext-2) fetches it again"
        )
    raw = text.split("\n")
    if raw[-1] == "":
        raw.pop()  # the final newline ends the last line; it does not start a new one
    lines: list[list[str]] = []
    for lineno, line in enumerate(raw, start=1):
        if "\r" in line:
            raise ValueError(f"{path}:{lineno}: carriage return in line (Windows line ending?)")
        bad = _CONTROL.search(line)
        if bad:
            raise ValueError(
                f"{path}:{lineno}: control character {bad.group()!r} at column {bad.start() + 1}"
            )
        tokens = line.split()
        if EOS in tokens:
            raise ValueError(
                f"{path}:{lineno}: the token {EOS} is reserved (it is appended to every line)"
            )
        lines.append(tokens)
    if not any(lines):  # blank lines only: a stream of <eos> would score as near perfect
        raise ValueError(
            f"{path}: no words, only blank lines; a cut download or copy? `structattn "
            "download ptb` (or wikitext-2) fetches it again"
        )
    return lines


def default_lm_data_dir(name: str) -> Path:
    """``<root>/<name>`` (``ptb``, ``wikitext-2``) for the first data root that has it
    (:func:`structattn.io.data_dir`). Raises ``FileNotFoundError`` (pass ``--data-dir``) when
    none has."""
    return shared_data_dir(
        name,
        what=f"language-modelling corpus {name!r}",
        hint=" pointing at a directory with {ptb.,wiki.,}{train,valid,test}{.txt,.tokens}",
    )


def corpus_files(data_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """``{"train", "valid", "test"}`` paths in ``data_dir``: for each split exactly one of
    ``<split>.txt`` (WikiText-2 as in pytorch/examples), ``ptb.<split>.txt`` (PTB) or
    ``wiki.<split>.tokens`` (the WikiText release)."""
    directory = Path(data_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: not a directory (pass --data-dir)")
    found = {}
    for split in LM_SPLITS:
        names = (f"{split}.txt", f"ptb.{split}.txt", f"wiki.{split}.tokens")
        matches = [directory / n for n in names if (directory / n).is_file()]
        if len(matches) != 1:
            what = "none" if not matches else ", ".join(m.name for m in matches)
            raise FileNotFoundError(
                f"{directory}: need exactly one {split} file of {', '.join(names)}; found {what}"
            )
        found[split] = matches[0]
    return found


# ----------------------------------------------------------------------------- vocabulary


@dataclass(frozen=True)
class LMVocabulary:
    """Word <-> id map of a language model: ``<eos>`` = 0, ``<unk>`` = 1, then the words.

    Build it from the training lines (:meth:`build`); every id is an output class, so
    ``len(vocab)`` is the softmax size. Unknown words encode to ``<unk>``.
    """

    tokens: tuple[str, ...]  # tokens[i] is the word with id i
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    SPECIALS: ClassVar[tuple[str, ...]] = (EOS, UNK)
    KIND: ClassVar[str] = "structattn.LMVocabulary"

    def __post_init__(self) -> None:
        tokens = tuple(self.tokens)
        if tokens[:2] != self.SPECIALS:
            raise ValueError(f"an LM vocabulary must start with {self.SPECIALS}, got {tokens[:2]}")
        if not all(isinstance(t, str) and t and not any(c.isspace() for c in t) for t in tokens):
            raise ValueError("vocabulary tokens must be non-empty strings without whitespace")
        if len(set(tokens)) != len(tokens):
            dup = sorted(t for t, c in Counter(tokens).items() if c > 1)
            raise ValueError(f"duplicate vocabulary tokens: {dup}")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "_index", {t: i for i, t in enumerate(tokens)})

    @classmethod
    def build(
        cls,
        lines: Iterable[Sequence[str]],
        max_size: int | None = None,
        min_count: int = 1,
    ) -> LMVocabulary:
        """``<eos>``, ``<unk>``, then every word of ``lines`` seen at least ``min_count``
        times, by decreasing count (ties: first occurrence), cut to ``max_size`` entries in
        all (``None``: no cut). The files' own ``<unk>`` counts as the special."""
        if max_size is not None and max_size < len(cls.SPECIALS):
            raise ValueError(f"max_size must be at least {len(cls.SPECIALS)}, got {max_size}")
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        counts: Counter[str] = Counter()
        for line in lines:
            counts.update(line)
        for special in cls.SPECIALS:
            counts.pop(special, None)
        # Counter.most_common sorts stably by count, so ties keep first-occurrence order
        words = [w for w, c in counts.most_common() if c >= min_count]
        if max_size is not None:
            words = words[: max_size - len(cls.SPECIALS)]
        return cls(cls.SPECIALS + tuple(words))

    def __len__(self) -> int:
        return len(self.tokens)

    def __contains__(self, token: object) -> bool:
        return token in self._index

    @property
    def eos_id(self) -> int:
        """Id of ``<eos>`` (0)."""
        return 0

    @property
    def unk_id(self) -> int:
        """Id of ``<unk>`` (1)."""
        return 1

    def encode(self, tokens: Iterable[str]) -> list[int]:
        """Ids of the tokens (no ``<eos>`` added); unknown words map to :attr:`unk_id`."""
        return [self._index.get(t, 1) for t in tokens]

    def encode_lines(self, lines: Iterable[Sequence[str]]) -> list[int]:
        """The id stream of ``lines``: each line's ids followed by ``<eos>``."""
        out: list[int] = []
        get = self._index.get
        for line in lines:
            out.extend(get(t, 1) for t in line)
            out.append(0)
        return out

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Words of the ids; ``ValueError`` on an id out of range."""
        out = []
        for i in ids:
            j = int(i)
            if not 0 <= j < len(self.tokens):
                raise ValueError(f"id {j} out of range for a vocabulary of {len(self.tokens)}")
            out.append(self.tokens[j])
        return out

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready description for checkpoints."""
        return {"kind": self.KIND, "version": 1, "tokens": list(self.tokens)}

    @classmethod
    def from_dict(cls, state: Mapping[str, object]) -> LMVocabulary:
        """Inverse of :meth:`to_dict`."""
        if state.get("kind") != cls.KIND or state.get("version") != 1:
            raise ValueError(f"not a version-1 {cls.KIND} dict")
        tokens = state.get("tokens")
        if not isinstance(tokens, list):
            raise ValueError("vocabulary dict needs a list of 'tokens'")
        return cls(tuple(tokens))


# ----------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class LMCorpus:
    """A corpus read and encoded: the vocabulary (from train), each split's lines and its
    id stream (``<eos>`` after every line)."""

    vocab: LMVocabulary
    lines: dict[str, list[list[str]]]  # split -> tokens of each line
    streams: dict[str, Tensor]  # split -> LongTensor[N] ids with <eos>
    files: dict[str, Path]  # split -> file it was read from


def load_lm_corpus(
    data_dir: str | os.PathLike[str],
    max_size: int | None = None,
    min_count: int = 1,
) -> LMCorpus:
    """Read ``train`` / ``valid`` / ``test`` of ``data_dir`` (see :func:`corpus_files`),
    build the vocabulary from train (:meth:`LMVocabulary.build`) and encode every split.

    Use :func:`default_lm_data_dir` for the shared copies (``"ptb"``, ``"wikitext-2"``).
    """
    import torch

    files = corpus_files(data_dir)
    lines = {split: read_lm_lines(path) for split, path in files.items()}
    vocab = LMVocabulary.build(lines["train"], max_size=max_size, min_count=min_count)
    streams = {
        split: torch.tensor(vocab.encode_lines(split_lines), dtype=torch.long)
        for split, split_lines in lines.items()
    }
    return LMCorpus(vocab=vocab, lines=lines, streams=streams, files=files)


def corpus_stats(corpus: LMCorpus) -> dict[str, Any]:
    """Sizes of a corpus, JSON-ready: ``{"vocab_size", "splits": {split: {...}}}`` with, per
    split, ``lines``, ``words`` (without ``<eos>``), ``tokens`` (with ``<eos>``: the stream
    length), ``unk`` (``<unk>`` in the stream: the files' own plus unknown words) and
    ``oov`` (words not in the vocabulary, mapped to ``<unk>``).

    PTB (shared copy): vocabulary 10,000; train 42,068 lines, 887,521 words, 929,589 tokens.
    """
    splits = {}
    for split, split_lines in corpus.lines.items():
        words = sum(len(line) for line in split_lines)
        stream = corpus.streams[split]
        unk = int((stream == corpus.vocab.unk_id).sum())
        splits[split] = {
            "lines": len(split_lines),
            "words": words,
            "tokens": int(stream.numel()),
            "unk": unk,
            "oov": unk - sum(line.count(UNK) for line in split_lines),  # the rest are the files'
        }
    return {"vocab_size": len(corpus.vocab), "splits": splits}


# ----------------------------------------------------------------------------- batches


def batchify(stream: Tensor, batch_size: int) -> Tensor:
    """Cut a 1-D id stream into ``batch_size`` contiguous rows: ``[B, N // B]``.

    Row b holds ``stream[b * L : (b + 1) * L]``; the last ``N % B`` tokens are dropped (use
    ``batch_size=1`` to keep every token, e.g. for a final test perplexity).

    >>> import torch
    >>> batchify(torch.arange(7), 2)
    tensor([[0, 1, 2],
            [3, 4, 5]])
    """
    if stream.dim() != 1:
        raise ValueError(f"stream must be 1-D, got shape {tuple(stream.shape)}")
    if isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    length = stream.numel() // batch_size
    if length < 2:
        raise ValueError(
            f"a stream of {stream.numel()} tokens is too short for {batch_size} rows "
            "(each row needs at least 2 tokens: one input and one target)"
        )
    return stream[: batch_size * length].view(batch_size, length).contiguous()  # [B, L]


@dataclass(frozen=True)
class BPTTWindow:
    """One window of truncated backpropagation through time."""

    inputs: Tensor  # LongTensor[B, T] ids at positions start .. start + T - 1
    targets: Tensor  # LongTensor[B, T] ids at positions start + 1 .. start + T (next word)
    start: int  # position of inputs[:, 0] in each row of the batchified data
    index: int  # 0-based window number

    @property
    def tokens(self) -> int:
        """Number of predictions in the window (``B * T``)."""
        return self.targets.numel()


def bptt_windows(data: Tensor, bptt: int, start: int = 0) -> Iterator[BPTTWindow]:
    """Windows over batchified ``data`` ``[B, L]`` (from :func:`batchify`): inputs
    ``data[:, i : i + T]`` and targets ``data[:, i + 1 : i + 1 + T]`` for
    ``i = start, start + bptt, ...``; the last window is shorter (``T = L - 1 - i``).

    The windows tile every row: ``B * (L - 1)`` targets in all, each once. Carry the
    recurrent state from one window to the next (detached); ``start`` resumes part-way
    (a multiple of ``bptt`` to get the same windows as an uninterrupted pass).

    >>> import torch
    >>> [(w.inputs.tolist(), w.targets.tolist()) for w in bptt_windows(torch.arange(5)[None], 3)]
    [([[0, 1, 2]], [[1, 2, 3]]), ([[3]], [[4]])]
    """
    if data.dim() != 2:
        raise ValueError(f"data must be [B, L] (see batchify), got shape {tuple(data.shape)}")
    if isinstance(bptt, bool) or bptt < 1:
        raise ValueError(f"bptt must be a positive int, got {bptt!r}")
    length = data.shape[1]
    if not 0 <= start < max(length - 1, 1):
        raise ValueError(f"start {start} outside 0..{length - 2}")
    for index, i in enumerate(range(start, length - 1, bptt)):
        size = min(bptt, length - 1 - i)
        yield BPTTWindow(
            inputs=data[:, i : i + size],  # [B, T]
            targets=data[:, i + 1 : i + 1 + size],  # [B, T]
            start=i,
            index=index,
        )


@dataclass(frozen=True)
class StreamEvaluation:
    """Result of :func:`evaluate_stream`."""

    total_nll: float  # summed negative log-likelihood (nats) of every target
    tokens: int  # number of targets (B * (L - 1))
    perplexity: float  # exp(total_nll / tokens)
    token_nll: Tensor | None  # [B, L - 1] NLL of each target (data[:, 1:]) if requested

    @property
    def mean_nll(self) -> float:
        """Average NLL per token (nats); ``log(perplexity)``."""
        return self.total_nll / self.tokens


def evaluate_stream(
    step: Callable[[Tensor, Any], tuple[Tensor, Any]],
    data: Tensor,
    bptt: int,
    state: Any = None,
    keep_token_nll: bool = False,
) -> StreamEvaluation:
    """Perplexity of a model over batchified ``data`` ``[B, L]``, in windows of ``bptt``.

    ``step(inputs [B, T], state) -> (logits [B, T, V], state)`` is called once per window
    with the state it returned for the previous window (``state`` for the first). It runs
    under ``torch.no_grad()``; put the model in ``eval()`` mode first. The NLL of each token
    is computed in the logits' dtype (float16 / bfloat16 in float32) and summed in float64.
    """
    import torch
    import torch.nn.functional as F

    total = torch.zeros((), dtype=torch.float64)
    tokens = 0
    pieces: list[Tensor] = []
    with torch.no_grad():
        for window in bptt_windows(data, bptt):
            logits, state = step(window.inputs, state)
            b, t = window.targets.shape
            if logits.shape[:2] != (b, t) or logits.dim() != 3:
                raise ValueError(
                    f"step returned logits {tuple(logits.shape)}, expected [{b}, {t}, V]"
                )
            if logits.dtype not in (torch.float32, torch.float64):
                logits = logits.float()  # half precision: score in float32
            nll = F.cross_entropy(
                logits.reshape(b * t, -1),  # [B * T, V]
                window.targets.reshape(b * t),  # [B * T]
                reduction="none",
            ).view(b, t)  # [B, T]
            total += nll.double().sum()
            tokens += b * t
            if keep_token_nll:
                pieces.append(nll)
    total_nll = float(total)
    return StreamEvaluation(
        total_nll=total_nll,
        tokens=tokens,
        perplexity=perplexity(total_nll, tokens),
        token_nll=torch.cat(pieces, dim=1) if keep_token_nll else None,
    )


def line_nll(stream: Tensor, token_nll: Tensor, eos_id: int = 0) -> list[tuple[float, int]]:
    """``(nll, tokens)`` of each line of a stream scored with ``batch_size=1``:
    ``token_nll`` ``[N - 1]`` (or ``[1, N - 1]``, :attr:`StreamEvaluation.token_nll`) is the
    NLL of ``stream[1:]``. A line's tokens are its words and its ``<eos>``; the stream's
    first token has no prediction, so the first line has one token fewer. The sums add up
    to the total NLL and token count.

    >>> import torch
    >>> line_nll(torch.tensor([5, 6, 0, 7, 0]), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    [(3.0, 2), (7.0, 2)]
    """
    stream = stream.reshape(-1)
    token_nll = token_nll.reshape(-1)
    if token_nll.numel() != stream.numel() - 1:
        raise ValueError(
            f"{token_nll.numel()} NLL values for a stream of {stream.numel()} tokens "
            "(expected one per token after the first: evaluate with batch_size=1)"
        )
    out: list[tuple[float, int]] = []
    total, count = 0.0, 0
    for token, nll in zip(stream[1:].tolist(), token_nll.tolist(), strict=True):
        total += nll
        count += 1
        if token == eos_id:
            out.append((total, count))
            total, count = 0.0, 0
    if count:
        out.append((total, count))  # a stream that does not end with <eos>
    return out
