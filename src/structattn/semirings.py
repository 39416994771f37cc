"""Semirings for dynamic programs over log-potentials.

A dynamic program in :mod:`structattn.structs` is written once against a semiring's
``sum`` (the "plus" that aggregates alternatives); "times" is always ``+`` on
log-potentials. Swapping the semiring turns the same program into:

* :class:`LogSemiring`    -- log-partition; its gradient gives marginals,
* :class:`MaxSemiring`    -- MAP score; its gradient is the MAP structure,
* :class:`SampleSemiring` -- log-partition whose gradient is one exact sample.

Semirings are stateless; the zero is ``-inf`` in every dtype (no hard-coded ``-1e5``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._validation import outer_jvp, tracing

__all__ = ["LogSemiring", "MaxSemiring", "SampleSemiring", "Semiring", "logsumexp"]


class _LogSumExp(torch.autograd.Function):
    """``torch.logsumexp`` whose gradient is 0 (not NaN) where every term is ``-inf``.

    The backward is written with differentiable ops, so it supports gradients of any order.
    """

    generate_vmap_rule = True  # forward and backward are plain tensor operations

    @staticmethod
    def forward(x: Tensor, dim: int) -> Tensor:
        return torch.logsumexp(x, dim)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, int], output: Tensor) -> None:
        x, dim = inputs
        ctx.save_for_backward(x, output)
        ctx.save_for_forward(x, output)
        ctx.dim = dim

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor, _: None) -> Tensor:
        # plain operations of the input and output: an enclosing torch.func level
        # (jacfwd(jacfwd(f))) differentiates them once outer_jvp switches forward mode on
        def body(x: Tensor, out: Tensor, tangent: Tensor) -> Tensor:
            finite_out = out.masked_fill(torch.isneginf(out), 0.0).unsqueeze(ctx.dim)
            return ((x - finite_out).exp() * tangent).sum(ctx.dim)

        return outer_jvp(body, *ctx.saved_tensors, tangent)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        x, out = ctx.saved_tensors
        finite_out = out.masked_fill(torch.isneginf(out), 0.0).unsqueeze(ctx.dim)
        return grad.unsqueeze(ctx.dim) * (x - finite_out).exp(), None


def logsumexp(x: Tensor, dim: int) -> Tensor:
    """``log(sum(exp(x), dim))`` with finite gradients when a slice is all ``-inf``."""
    if tracing():  # tracers (export, compile) see plain operations
        return _traced_logsumexp(x, dim)
    return _LogSumExp.apply(x, dim)


def _traced_logsumexp(x: Tensor, dim: int) -> Tensor:
    """:func:`logsumexp` in plain differentiable operations (any order; 0 gradients where a
    slice is all ``-inf``): what tracers record."""
    top = x.detach().amax(dim, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = (x - top).exp().sum(dim)
    some = total > 0
    safe = torch.where(some, total, torch.ones_like(total))
    return torch.where(some, safe.log() + top.squeeze(dim), torch.full_like(total, float("-inf")))


class _SampledLogSumExp(torch.autograd.Function):
    """Forward: logsumexp. Backward: routes the incoming gradient to one term drawn
    with probability ``softmax(x)`` (Gumbel-max), so back-propagating through an inside
    pass walks down one derivation drawn exactly from the Gibbs distribution."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, dim: int) -> Tensor:
        return torch.logsumexp(x, dim)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, int], output: Tensor) -> None:
        x, dim = inputs
        ctx.save_for_backward(x)
        ctx.dim = dim

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (x,) = ctx.saved_tensors
        gumbel = -torch.empty_like(x).exponential_().log()
        choice = (x + gumbel).argmax(ctx.dim, keepdim=True)
        onehot = torch.zeros_like(x).scatter_(ctx.dim, choice, 1.0)
        return grad.unsqueeze(ctx.dim) * onehot, None


class Semiring:
    """Interface: ``sum(x, dim)`` aggregates alternatives along ``dim``."""

    name = "semiring"

    @staticmethod
    def sum(x: Tensor, dim: int) -> Tensor:  # pragma: no cover - interface
        raise NotImplementedError


class LogSemiring(Semiring):
    """(logsumexp, +): the inside pass computes log Z."""

    name = "log"

    @staticmethod
    def sum(x: Tensor, dim: int) -> Tensor:
        return logsumexp(x, dim)


class MaxSemiring(Semiring):
    """(max, +): the inside pass computes the MAP score; its gradient is the MAP
    structure (ties broken by the first index)."""

    name = "max"

    @staticmethod
    def sum(x: Tensor, dim: int) -> Tensor:
        return x.max(dim).values


class SampleSemiring(Semiring):
    """Log-semiring forward whose backward draws one exact sample (gradient = 0/1 indicators)."""

    name = "sample"

    @staticmethod
    def sum(x: Tensor, dim: int) -> Tensor:
        return _SampledLogSumExp.apply(x, dim)
