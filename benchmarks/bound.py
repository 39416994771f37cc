"""A lower bound on the time of each benchmark row on this machine (issue 22.1).

The bound of a row is ``work / peak``:

* ``work``: the elements the algorithm must touch, counted per item from its recurrences and
  summed over the batch's real lengths (:func:`row_work`). A *log element* is one
  ``a + b`` followed by its share of a logsumexp (exp, add); a *max element* one ``a + b``
  and a compare; a *multiply-add* one fused ``x * y + z`` (matrix-tree rows).
  Eisner's inside pass over N positions (ROOT included) touches
  ``4 * sum_{w=1}^{N-1} (N - w) * w = 2 (N^3 - N) / 3`` log elements (two incomplete and two
  complete span kinds, width w, w split points each); a linear chain ``(N - 1) C^2``; the
  matrix-tree log-determinant an LU, ``N^3 / 3`` multiply-adds, and its gradient the
  inverse from the LU, ``2 N^3 / 3`` more; CKY over N words ``(N^3 - N) / 6`` (every split
  of every span; labelled: + L per span for the logsumexp over the labels); a semi-Markov
  chain about ``N K C + (N - 1) C^2``.
* Passes per op: log Z forward+backward touches every element twice (inside, then the
  weights ``exp(x - logZ)`` of the outside pass); marginals (forward) the same; marginals
  forward+backward four times (the backward of a backward); MAP once, in the max semiring.
* ``peak``: the best rate at which this machine runs that element through PyTorch's fused
  CPU kernels on the benchmark's threads, measured by :func:`measure_rates` on large
  contiguous batches (``logsumexp(a + b)``, ``amax(a + b)``, ``bmm``).

The dependent steps (one per span width or chain position and pass) times the measured
latency of one small PyTorch op is a second floor, :func:`latency_floor_seconds`: the least
time of an implementation that issues one op per step (the peers). It is not part of the
bound: a compiled kernel that loops inside one call (ours) pays far less than an op per step,
and does beat it at small N. Both terms are in the JSON output. A third figure,
``Rates.call_s``, is the round trip of a differentiable op that computes nothing (forward and
backward through autograd, [32, 50, 2] inputs): no call of a PyTorch autograd API can take
less, whatever its arithmetic; it is reported, not part of the bound.

``ours / bound`` = 1 would mean ours runs every element at PyTorch's peak rate with no
overhead; the issue's target is <= 2 at N >= 40 for trees and chains.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "Rates",
    "Work",
    "bound_seconds",
    "cky_elements",
    "eisner_elements",
    "latency_floor_seconds",
    "measure_rates",
    "row_work",
    "semi_markov_elements",
]


@dataclass(frozen=True)
class Rates:
    """Measured peak rates (elements per second) and the latency of one small op (s)."""

    log_per_s: float  # log-semiring elements: logsumexp(a + b) over large rows
    max_per_s: float  # max-plus elements: amax(a + b)
    mad_per_s: float  # float32 multiply-adds in batched matmul (bmm)
    latency_s: float  # one small op (logsumexp of a [32, 4] tensor), dispatch included
    call_s: float = 0.0  # a differentiable op that computes nothing, forward + backward

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class Work:
    """What one row must do: elements by kind (whole batch) and dependent steps."""

    log: float = 0.0
    max: float = 0.0
    mad: float = 0.0
    steps: int = 0


def _best_time(fn: Callable[[], object], repeats: int, min_seconds: float = 0.05) -> float:
    """Best per-call time of ``fn`` over ``repeats`` timed loops of >= ``min_seconds``."""
    fn()
    calls = 1
    while True:  # calls per loop so one loop lasts long enough for the clock
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if time.perf_counter() - start >= min_seconds or calls >= 1 << 16:
            break
        calls *= 2
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def measure_rates(repeats: int = 5, quick: bool = False) -> Rates:
    """Peak rates of the primitives on the current torch thread count (best of ``repeats``;
    ``quick``: small tensors, for smoke tests only)."""
    gen = torch.Generator().manual_seed(0)
    rows, width = (256, 64) if quick else (16384, 64)  # 1M elements: out of L1/L2, in L3
    a = torch.randn(rows, width, generator=gen)
    b = torch.randn(rows, width, generator=gen)
    best_log = min(
        _best_time(lambda: torch.logsumexp(a + b, -1), repeats),
        _best_time(lambda: torch.logsumexp(a, -1), repeats),  # the reduction alone
    )
    best_max = _best_time(lambda: torch.amax(a + b, -1), repeats)
    batch, n = (4, 32) if quick else (64, 128)
    x = torch.randn(batch, n, n, generator=gen)
    y = torch.randn(batch, n, n, generator=gen)
    best_mm = _best_time(lambda: torch.bmm(x, y), repeats)
    small = torch.randn(32, 4, generator=gen)
    latency = _best_time(lambda: torch.logsumexp(small, -1), repeats)
    unary = torch.randn(32, 50, 2, generator=gen).requires_grad_()
    pairwise = torch.randn(2, 2, generator=gen).requires_grad_()
    call = _best_time(
        lambda: torch.autograd.grad(_Null.apply(unary, pairwise).sum(), (unary, pairwise)),
        repeats,
    )
    elements = rows * width
    return Rates(
        log_per_s=elements / best_log,
        max_per_s=elements / best_max,
        mad_per_s=batch * n**3 / best_mm,
        latency_s=latency,
        call_s=call,
    )


class _Null(torch.autograd.Function):
    """log Z of a chain that computes nothing: an uninitialised [B] forward, uninitialised
    gradients backward. Its round trip (``Rates.call_s``) is what any differentiable op costs
    through PyTorch's autograd before any arithmetic: a floor for the smallest rows."""

    @staticmethod
    def forward(ctx: Any, unary: Tensor, pairwise: Tensor) -> Tensor:
        ctx.save_for_backward(unary, pairwise)
        return unary.new_empty(unary.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        unary, pairwise = ctx.saved_tensors
        return torch.empty_like(unary), torch.empty_like(pairwise)


def eisner_elements(n: int) -> int:
    """Log elements of Eisner's inside pass over ``n`` positions (ROOT included)."""
    return 2 * (n**3 - n) // 3


#: passes over the elements per op (see the module docstring)
PASSES = {"logz_fb": 2, "marg": 2, "marg_fb": 4, "argmax": 1}


def cky_elements(n: int, labels: int = 1) -> int:
    """Log elements of the CKY inside pass over ``n`` words: every split of every span,
    ``sum_{w=2}^{n} (n - w + 1)(w - 1) = (n^3 - n) / 6``, plus the logsumexp over the
    ``labels`` of each of the n (n + 1) / 2 spans when they are labelled (L > 1)."""
    splits = (n**3 - n) // 6
    return splits + (n * (n + 1) // 2 * labels if labels > 1 else 0)


def semi_markov_elements(n: int, width: int, labels: int) -> int:
    """Log elements of the semi-Markov forward pass over ``n`` positions: the segments
    ending at each position t, min(K, t + 1) C, and the transitions into the next one, C^2."""
    ends = sum(min(width, t + 1) for t in range(n)) * labels
    return ends + (n - 1) * labels * labels


def row_work(section: str, op: str, lengths: Tensor, labels: int = 0, width: int = 0) -> Work:
    """The work of one benchmark row: ``section`` tree | chain | nonproj | span | semi,
    ``op`` one of :data:`PASSES`, ``lengths`` LongTensor [B] of real positions (ROOT
    included for dependency trees), ``labels`` C for chains and semi-Markov chains, L for
    constituency trees, ``width`` K for semi-Markov chains."""
    passes = PASSES[op]
    sizes = [int(n) for n in lengths.tolist()]
    longest = max(sizes)
    if section == "span":
        elements = float(sum(cky_elements(n, labels) for n in sizes)) * passes
        steps = (longest - 1) * passes
        return (
            Work(max=elements, steps=steps) if op == "argmax" else Work(log=elements, steps=steps)
        )
    if section == "semi":
        elements = float(sum(semi_markov_elements(n, width, labels) for n in sizes)) * passes
        return Work(log=elements, steps=longest * passes)
    if section == "tree":
        elements = float(sum(eisner_elements(n) for n in sizes)) * passes
        steps = (longest - 1) * passes
        return (
            Work(max=elements, steps=steps) if op == "argmax" else Work(log=elements, steps=steps)
        )
    if section == "chain":
        elements = float(sum((n - 1) * labels * labels for n in sizes)) * passes
        steps = (longest - 1) * passes
        return (
            Work(max=elements, steps=steps) if op == "argmax" else Work(log=elements, steps=steps)
        )
    if section == "nonproj":
        if op == "argmax":  # maximum spanning arborescence: every arc scored at least once
            return Work(max=float(sum(n * n for n in sizes)), steps=longest)
        lu, inverse = (sum(n**3 for n in sizes) / 3, 2 * sum(n**3 for n in sizes) / 3)
        mads = lu + inverse if op in ("logz_fb", "marg") else 2 * (lu + inverse)
        return Work(mad=float(mads), steps=longest * PASSES[op])
    raise ValueError(f"unknown section {section!r}")


def bound_seconds(work: Work, rates: Rates) -> float:
    """``work / peak`` in seconds: no implementation on this machine's PyTorch primitives
    can touch the elements faster."""
    return work.log / rates.log_per_s + work.max / rates.max_per_s + work.mad / rates.mad_per_s


def latency_floor_seconds(work: Work, rates: Rates) -> float:
    """``steps * latency``: the floor of an implementation issuing one op per dependent step."""
    return work.steps * rates.latency_s
