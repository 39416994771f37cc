"""Task metrics shared by the data modules and the recipes: accuracy, confusion matrix with
per-class precision / recall / F1, perplexity, paired bootstrap test, the spread of seeded
runs; corpus BLEU / chrF of translations and their paired bootstrap test (sacrebleu,
imported when called).

Only the standard library and numpy (sacrebleu inside the BLEU / chrF functions): any layer
may import this module (it imports nothing of structattn). Attachment scores (UAS / LAS) live
with the CoNLL-U reader (:func:`structattn.data.conllu.attachment_scores`), which knows the
punctuation tags.

>>> cm = ConfusionMatrix.build(["a", "a", "b", "b"], ["a", "b", "b", "b"], labels=["a", "b"])
>>> cm.matrix, cm.accuracy
(((1, 1), (0, 2)), 0.75)
>>> round(cm.precision("b"), 3), cm.recall("b"), round(cm.f1("b"), 3)
(0.667, 1.0, 0.8)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BootstrapResult",
    "BracketScores",
    "ConfusionMatrix",
    "accuracy",
    "bleu",
    "bleu_significance",
    "bracket_f1",
    "chrf",
    "correct_run_fractions",
    "count_correct_runs",
    "mean_std_range",
    "paired_bootstrap",
    "perplexity",
    "seed_spread",
]


def accuracy(predicted: Sequence[object], gold: Sequence[object]) -> float:
    """Fraction of predictions equal to the gold labels (multiply by 100 for %); the
    sequences must be non-empty and of equal length.

    >>> accuracy(["entailment", "neutral"], ["entailment", "contradiction"])
    0.5
    """
    if len(predicted) != len(gold):
        raise ValueError(f"{len(predicted)} predictions for {len(gold)} gold labels")
    if not gold:
        raise ValueError("no labels to score")
    return sum(p == g for p, g in zip(predicted, gold, strict=True)) / len(gold)


def perplexity(total_nll: float, tokens: int) -> float:
    """``exp(total_nll / tokens)``: the perplexity of a stream whose predictions have summed
    negative log-likelihood ``total_nll`` (nats). ``tokens`` counts every prediction
    (``<eos>`` included for word-level LMs).

    >>> perplexity(4 * math.log(10.0), 4)  # a uniform model over 10 words
    10.000000000000002
    """
    if isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    if not math.isfinite(total_nll) or total_nll < 0:
        raise ValueError(f"total NLL must be finite and >= 0, got {total_nll}")
    mean = total_nll / tokens
    return math.exp(mean) if mean < 709.0 else math.inf  # exp overflows float64 past ~709.78


def seed_spread(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample standard deviation (0 for one run) and the values of a cell's seeded runs.

    >>> seed_spread([1, 2, 3])
    {'mean': 2.0, 'std': 1.0, 'runs': [1.0, 2.0, 3.0]}
    """
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no runs to summarise")
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": spread, "runs": values}


def mean_std_range(values: Sequence[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), minimum and maximum of a score
    over a cell's runs.

    >>> mean_std_range([1, 2, 3])
    {'mean': 2.0, 'std': 1.0, 'min': 1, 'max': 3}
    """
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


_COUNT_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"  # counts 0..35 as one character


def count_correct_runs(correct: Sequence[str]) -> str:
    """Per test item, how many of a cell's runs got it right, as one base-36 digit (at most
    35 runs are counted): a compact form of the runs' per-item correctness that
    :func:`correct_run_fractions` reads back for :func:`paired_bootstrap` between cells.
    ``correct``: one string of ``0`` / ``1`` per run, one character per item (item order).

    >>> count_correct_runs(["110", "100"])
    '210'
    """
    counts = [sum(c[i] == "1" for c in correct) for i in range(len(correct[0]))]
    return "".join(_COUNT_DIGITS[min(c, 35)] for c in counts)


def correct_run_fractions(digits: str, runs: int) -> list[float]:
    """Per test item, the fraction of the ``runs`` (at most 35 counted) that got it right,
    from the digits of :func:`count_correct_runs`.

    >>> correct_run_fractions("210", 2)
    [1.0, 0.5, 0.0]
    """
    counted = min(int(runs), 35)
    return [_COUNT_DIGITS.index(c) / counted for c in digits]


@dataclass(frozen=True)
class ConfusionMatrix:
    """Counts ``matrix[g][p]`` of examples with gold label ``labels[g]`` predicted as
    ``labels[p]`` (rows gold, columns predicted).

    Precision, recall and F1 of a class with no predictions / no gold examples are 0 (as
    scikit-learn's ``zero_division=0``); :attr:`macro_f1` averages F1 over all labels.
    """

    labels: tuple[Hashable, ...]  # class order of rows and columns
    matrix: tuple[tuple[int, ...], ...]  # [C, C] counts, rows gold, columns predicted

    def __post_init__(self) -> None:
        n = len(self.labels)
        if len(set(self.labels)) != n:
            raise ValueError(f"duplicate labels: {self.labels}")
        if len(self.matrix) != n or any(len(row) != n for row in self.matrix):
            raise ValueError(f"matrix must be {n} x {n} for {n} labels")

    @classmethod
    def build(
        cls,
        gold: Sequence[Hashable],
        predicted: Sequence[Hashable],
        labels: Sequence[Hashable] | None = None,
    ) -> ConfusionMatrix:
        """Count pairs; ``labels`` fixes the class order (default: sorted gold and predicted
        labels). A label outside ``labels`` raises ``ValueError``."""
        if len(predicted) != len(gold):
            raise ValueError(f"{len(predicted)} predictions for {len(gold)} gold labels")
        if labels is None:
            labels = sorted(set(gold) | set(predicted), key=repr)
        order = tuple(labels)
        index = {label: i for i, label in enumerate(order)}
        counts = [[0] * len(order) for _ in order]
        for i, (g, p) in enumerate(zip(gold, predicted, strict=True)):
            if g not in index or p not in index:
                bad = g if g not in index else p
                raise ValueError(f"example {i}: label {bad!r} is not one of {order}")
            counts[index[g]][index[p]] += 1
        return cls(order, tuple(tuple(row) for row in counts))

    def _index(self, label: Hashable) -> int:
        try:
            return self.labels.index(label)
        except ValueError:
            raise ValueError(f"unknown label {label!r}; labels are {self.labels}") from None

    @property
    def total(self) -> int:
        """Number of examples."""
        return sum(map(sum, self.matrix))

    @property
    def accuracy(self) -> float:
        """Trace / total (``nan`` for an empty matrix)."""
        total = self.total
        return (
            sum(self.matrix[i][i] for i in range(len(self.labels))) / total if total else math.nan
        )

    def support(self, label: Hashable) -> int:
        """Gold examples of ``label`` (its row sum)."""
        return sum(self.matrix[self._index(label)])

    def precision(self, label: Hashable) -> float:
        """Correct / predicted as ``label`` (0 when nothing was predicted as it)."""
        k = self._index(label)
        predicted = sum(row[k] for row in self.matrix)
        return self.matrix[k][k] / predicted if predicted else 0.0

    def recall(self, label: Hashable) -> float:
        """Correct / gold ``label`` (0 when it has no gold examples)."""
        k = self._index(label)
        gold = sum(self.matrix[k])
        return self.matrix[k][k] / gold if gold else 0.0

    def f1(self, label: Hashable) -> float:
        """Harmonic mean of precision and recall (0 when both are 0)."""
        p, r = self.precision(label), self.recall(label)
        return 2 * p * r / (p + r) if p + r else 0.0

    @property
    def macro_f1(self) -> float:
        """Unweighted mean of the per-class F1."""
        return sum(self.f1(label) for label in self.labels) / len(self.labels)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: labels (as strings), matrix, accuracy, macro F1 and per-class
        precision / recall / F1 / support."""
        return {
            "labels": [str(label) for label in self.labels],
            "matrix": [list(row) for row in self.matrix],
            "accuracy": self.accuracy,
            "macro_f1": self.macro_f1,
            "per_class": {
                str(label): {
                    "precision": self.precision(label),
                    "recall": self.recall(label),
                    "f1": self.f1(label),
                    "support": self.support(label),
                }
                for label in self.labels
            },
        }

    def format(self) -> str:
        """A plain-text table: the counts (rows gold, columns predicted) and per-class
        precision / recall / F1 in percent.

        >>> print(ConfusionMatrix.build(["a", "b"], ["a", "a"], labels=["a", "b"]).format())
        gold \\ pred  a  b     P %     R %    F1 %  n
        a            1  0    50.0   100.0    66.7  1
        b            1  0     0.0     0.0     0.0  1
        accuracy 50.0 %, macro F1 33.3 %
        """
        names = [str(label) for label in self.labels]
        head = "gold \\ pred"
        first = max(len(head), *(len(n) for n in names))
        widths = [
            max(len(n), *(len(str(row[j])) for row in self.matrix)) for j, n in enumerate(names)
        ]
        support = max(1, *(len(str(self.support(label))) for label in self.labels))
        tail = ["P %".rjust(6), "R %".rjust(6), "F1 %".rjust(6), "n".rjust(support)]
        lines = [
            "  ".join(
                [
                    head.ljust(first),
                    *(n.rjust(w) for n, w in zip(names, widths, strict=True)),
                    *tail,
                ]
            )
        ]
        for i, label in enumerate(self.labels):
            scores = (self.precision(label), self.recall(label), self.f1(label))
            lines.append(
                "  ".join(
                    [
                        names[i].ljust(first),
                        *(str(c).rjust(w) for c, w in zip(self.matrix[i], widths, strict=True)),
                        *(f"{100 * x:6.1f}" for x in scores),
                        str(self.support(label)).rjust(support),
                    ]
                )
            )
        lines.append(f"accuracy {100 * self.accuracy:.1f} %, macro F1 {100 * self.macro_f1:.1f} %")
        return "\n".join(lines)


@dataclass(frozen=True)
class BootstrapResult:
    """Result of :func:`paired_bootstrap` (differences are A minus B, as fractions)."""

    difference: float  # mean(score_a) - mean(score_b) on the test set itself
    low: float  # 2.5 % quantile of the resampled differences
    high: float  # 97.5 % quantile
    p_value: float  # one-sided: fraction of resamples with difference <= 0 (A not better)
    samples: int  # number of resamples


def paired_bootstrap(
    score_a: Sequence[float], score_b: Sequence[float], samples: int = 10_000, seed: int = 0
) -> BootstrapResult:
    """Paired bootstrap over test items (Efron and Tibshirani 1993; Koehn 2004): resample
    the items with replacement ``samples`` times and recompute the difference of the mean
    per-item scores of systems A and B (for accuracy, the scores are 1 = correct, 0 =
    wrong, item by item on the same test set).

    ``p_value`` is the fraction of resamples where A is not better than B: below 0.05, A's
    advantage is significant at 5 % (one-sided). ``low`` / ``high`` bound a 95 % interval.

    >>> r = paired_bootstrap([1, 1, 1, 0] * 50, [1, 0, 0, 0] * 50, samples=2000)
    >>> r.difference, r.p_value
    (0.5, 0.0)
    """
    import numpy as np

    a = np.asarray(score_a, dtype=np.float64)
    b = np.asarray(score_b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(
            f"need two non-empty score lists of equal length, got {a.shape}, {b.shape}"
        )
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    delta = a - b  # [N] per-item differences
    rng = np.random.default_rng(seed)
    diffs = np.empty(samples)
    chunk = max(1, 2_000_000 // delta.size)  # bound the [chunk, N] index array to ~16 MB
    for start in range(0, samples, chunk):
        rows = min(chunk, samples - start)
        picks = rng.integers(0, delta.size, size=(rows, delta.size))  # [rows, N]
        diffs[start : start + rows] = delta[picks].mean(axis=1)
    low, high = np.quantile(diffs, [0.025, 0.975])
    return BootstrapResult(
        difference=float(delta.mean()),
        low=float(low),
        high=float(high),
        p_value=float((diffs <= 0).mean()),
        samples=samples,
    )


@dataclass(frozen=True)
class BracketScores:
    """Unlabelled bracket scores of a set of parses (all in [0, 1])."""

    sentence_f1: float  # mean over sentences of the sentence F1 (PRPN's "averaged sentence F1")
    corpus_f1: float  # F1 of the summed matches / predicted / gold counts (EVALB-style)
    corpus_precision: float  # summed matches / summed predicted brackets
    corpus_recall: float  # summed matches / summed gold brackets
    sentences: int  # number of sentences scored

    def as_dict(self) -> dict[str, float | int]:
        """The fields, F1s as percentages (1 decimal kept by callers)."""
        return {
            "sentence_f1": 100 * self.sentence_f1,
            "corpus_f1": 100 * self.corpus_f1,
            "corpus_precision": 100 * self.corpus_precision,
            "corpus_recall": 100 * self.corpus_recall,
            "sentences": self.sentences,
        }


def bracket_f1(
    predicted: Sequence[Sequence[tuple[int, int]] | frozenset[tuple[int, int]]],
    gold: Sequence[Sequence[tuple[int, int]] | frozenset[tuple[int, int]]],
    lengths: Sequence[int],
    include_root: bool = False,
) -> BracketScores:
    """Unlabelled bracket F1 of predicted vs gold span sets (spans ``(start, end)``, end
    exclusive, over sentences of ``lengths`` words).

    Conventions (as PRPN's ``test_phrase_grammar.py``): only spans of >= 2 words count (any
    one-word span given is ignored); the whole-sentence span ``(0, n)`` counts only with
    ``include_root``; a sentence whose gold set is empty has recall 1, and precision 1 if the
    predicted set is empty too (so a 2-word sentence scores 1 without the root), otherwise
    P = R = 0 when a set is empty.

    >>> s = bracket_f1([{(0, 2), (0, 3)}], [{(1, 3), (0, 3)}], [3])
    >>> s.sentence_f1, s.corpus_f1
    (0.0, 0.0)
    >>> bracket_f1([{(0, 2), (0, 3)}], [{(1, 3), (0, 3)}], [3], include_root=True).corpus_f1
    0.5
    """
    if not (len(predicted) == len(gold) == len(lengths)):
        raise ValueError(
            f"{len(predicted)} predictions, {len(gold)} gold trees and {len(lengths)} lengths"
        )
    if not gold:
        raise ValueError("no sentences to score")
    f1s = []
    matched = n_pred = n_gold = 0
    for pred_spans, gold_spans, n in zip(predicted, gold, lengths, strict=True):

        def keep(spans: Iterable[tuple[int, int]], n: int = n) -> set[tuple[int, int]]:
            return {
                (int(a), int(b))
                for a, b in spans
                if b - a >= 2 and (include_root or (a, b) != (0, n))
            }

        p, g = keep(pred_spans), keep(gold_spans)
        overlap = len(p & g)
        matched, n_pred, n_gold = matched + overlap, n_pred + len(p), n_gold + len(g)
        recall = overlap / len(g) if g else 1.0
        precision = overlap / len(p) if p else (1.0 if not g else 0.0)
        f1s.append(2 * precision * recall / (precision + recall) if precision + recall else 0.0)
    precision = matched / n_pred if n_pred else 0.0
    recall = matched / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return BracketScores(
        sentence_f1=sum(f1s) / len(f1s),
        corpus_f1=f1,
        corpus_precision=precision,
        corpus_recall=recall,
        sentences=len(f1s),
    )


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU (0-100) of space-tokenized hypotheses against one reference each, as
    multi-bleu.perl: no further tokenization, case kept, no smoothing (sacrebleu)."""
    import sacrebleu

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    return float(
        sacrebleu.corpus_bleu(
            list(hypotheses), [list(references)], tokenize="none", smooth_method="none",
            force=True,
        ).score
    )  # fmt: skip


def chrf(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus chrF (0-100, sacrebleu's defaults: character 6-grams, beta 2)."""
    import sacrebleu

    return float(sacrebleu.corpus_chrf(list(hypotheses), [list(references)]).score)


def bleu_significance(
    hypotheses: Mapping[str, Sequence[str]],
    references: Sequence[str],
    baseline: str,
    samples: int = 1000,
) -> dict[str, dict[str, float | None]]:
    """Paired bootstrap resampling of corpus BLEU (Koehn 2004; sacrebleu's ``PairedTest``
    with its fixed seed, the test of Moses' bootstrap-hypothesis-difference-significance.pl):
    per system ``{"bleu", "low", "high", "p_value"}`` -- the 95% interval of its resampled
    BLEU, and the two-sided p-value of its difference from ``baseline`` (None for the
    baseline itself; below 0.05: the difference is significant at 5%)."""
    import sacrebleu
    from sacrebleu.significance import PairedTest

    if baseline not in hypotheses:
        raise ValueError(f"baseline {baseline!r} is not among {sorted(hypotheses)}")
    for name, hyps in hypotheses.items():
        if len(hyps) != len(references):
            raise ValueError(f"{name}: {len(hyps)} hypotheses for {len(references)} references")
    systems: list[tuple[str, Sequence[str]]] = [(baseline, list(hypotheses[baseline]))]
    systems += [(n, list(h)) for n, h in hypotheses.items() if n != baseline]
    metric = sacrebleu.BLEU(tokenize="none", smooth_method="none", force=True)
    _, scores = PairedTest(systems, {"BLEU": metric}, [list(references)], "bs", samples)()
    out: dict[str, dict[str, float | None]] = {}
    for (name, _), result in zip(systems, scores["BLEU"], strict=True):
        assert not isinstance(result, str)
        ci = result.ci or 0.0
        mean = result.mean if result.mean is not None else result.score
        out[name] = {"bleu": result.score, "low": mean - ci, "high": mean + ci,
                     "p_value": None if name == baseline else result.p_value}  # fmt: skip
    return out
