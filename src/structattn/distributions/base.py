"""Shared machinery of the structured distributions.

A subclass supplies its raw potentials, turns them into *part* potentials (one score per
part of a structure: a node label, an edge, an arc), and runs an inside pass over the parts
with a semiring. Everything else follows generically:

* ``log_partition`` -- inside pass in the log semiring,
* ``marginals``     -- gradient of log Z with respect to the parts (differentiable again:
  a loss on the marginals trains the potentials, second-order),
* ``max_score``/``argmax`` -- inside pass in the max semiring and its gradient,
* ``sample(n)``     -- the gradient of the sampling semiring's inside pass,
* ``entropy``       -- ``log Z - sum(marginals * parts)``.

Every distribution also answers ``num_tokens`` (scored positions per item, [B]) and
``impossible_reason(value, item)`` (why a structure has probability 0, in words), which
:func:`structured_nll` uses for ``reduction="token"`` and its errors.

Items with no valid structure (every structure has a ``-inf`` part) get
``log_partition = -inf``, zero marginals with finite (zero) gradients, ``entropy = 0``,
``max_score = -inf`` and ``-1`` everywhere in ``argmax`` and samples.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from .._validation import is_transformed
from ..semirings import LogSemiring, MaxSemiring, SampleSemiring, Semiring

__all__ = ["StructuredDistribution"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _fresh_leaf(t: Tensor) -> Tensor:
    """A grad-requiring leaf copy of ``t`` (works for inference-mode tensors too)."""
    if t.is_inference():
        t = t.clone()
    return t.detach().requires_grad_(True)


def _eager(fn: _F) -> _F:
    """``torch.compiler.disable(fn)``, applied at the first call made while ``torch._dynamo``
    is loaded: the decorator imports Dynamo (about 2 s), which ``import structattn`` should
    not pay. Before Dynamo is loaded nothing can be compiling, so ``fn`` runs as it is."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return cast(_F, call)


class StructuredDistribution:
    """Base class: a batch of Gibbs distributions over structures, p(z) ∝ exp(score(z))."""

    #: the raw potential tensors as given by the user (set by subclasses)
    _raw: tuple[Tensor, ...]
    lengths: Tensor | None

    # ---- hooks for subclasses -------------------------------------------------------------
    def _parts(self, *raw: Tensor) -> tuple[Tensor, ...]:
        """Part potentials (padding sanitised) built differentiably from the raw tensors."""
        raise NotImplementedError

    def _inside(
        self, semiring: type[Semiring], parts: tuple[Tensor, ...], lengths: Tensor | None
    ) -> Tensor:
        """Inside pass returning one value per batch item, shape [B]."""
        raise NotImplementedError

    def _to_structure(self, *indicators: Tensor) -> Tensor:
        """Convert 0/1 part indicators (batch-first) into the structure encoding."""
        raise NotImplementedError

    def _score(self, value: Tensor) -> Tensor:
        """Score of given structures, [B]; ``-inf`` where a structure is invalid."""
        raise NotImplementedError

    # ---- public protocol that every distribution fills (used by structured_nll) -----------
    @property
    def num_tokens(self) -> Tensor:
        """Number of scored positions per item (words of a tree, positions of a chain),
        LongTensor [B]: the denominator of ``structured_nll(..., reduction="token")``."""
        raise NotImplementedError

    def impossible_reason(self, value: Tensor, item: int) -> str:
        """Why ``value[item]`` (a structure in the encoding of ``argmax``) has probability 0,
        i.e. ``log_prob(value)[item] == -inf``, in words for an error message. Subclasses
        name their own reasons (not a tree, crossing arcs, ...) and end with this one's: no
        structure at all (log Z = -inf), else a part scored ``-inf``."""
        if bool(torch.isneginf(self.log_partition[item])):
            return "no structure of this item has a finite score (log Z = -inf)"
        return "it uses a part whose score is -inf (a forbidden part)"

    # ---- generic machinery ----------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self._raw[0].shape[0]

    def _differentiable(self) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in self._raw)

    # Marginals are gradients taken inside the forward pass and differentiated again by the
    # caller (double backward), which torch.compile's AOTAutograd does not support: the
    # inference pass runs eagerly and everything around it can still be compiled.
    @_eager
    def _inside_with_grad(
        self,
        semiring: type[Semiring],
        create_graph: bool,
        repeat: int = 1,
    ) -> tuple[Tensor, Sequence[Tensor]]:
        """Run the inside pass on parts that require grad; return (value [B'], grads of parts).

        ``repeat`` > 1 tiles the batch (for several samples at once): B' = repeat * B.
        """
        if any(is_transformed(t) for t in self._raw):
            return self._inside_with_func(semiring, repeat)
        with torch.inference_mode(False), torch.enable_grad():
            # a raw tensor is used as is only when the grads must flow back into it
            raw = tuple(
                t if create_graph and t.requires_grad else _fresh_leaf(t) for t in self._raw
            )
            parts = self._parts(*raw)
            lengths = self.lengths
            if repeat > 1:
                parts = tuple(p.repeat(repeat, *([1] * (p.dim() - 1))) for p in parts)
                lengths = None if lengths is None else lengths.repeat(repeat)
            value = self._inside(semiring, parts, lengths)
            grads = torch.autograd.grad(
                value.sum(), parts, create_graph=create_graph, materialize_grads=True
            )
        return value, grads

    def _inside_with_func(
        self, semiring: type[Semiring], repeat: int = 1
    ) -> tuple[Tensor, Sequence[Tensor]]:
        """:meth:`_inside_with_grad` under ``torch.func`` transforms (and ``torch.compile``
        tracing), which ``torch.autograd.grad`` cannot see: the gradient by ``torch.func.grad``,
        which composes with them (and stays differentiable by the outer ones)."""
        parts = self._parts(*self._raw)
        lengths = self.lengths
        if repeat > 1:
            parts = tuple(p.repeat(repeat, *([1] * (p.dim() - 1))) for p in parts)
            lengths = None if lengths is None else lengths.repeat(repeat)

        def total(*args: Tensor) -> tuple[Tensor, Tensor]:
            value = self._inside(semiring, args, lengths)
            return value.sum(), value

        argnums = tuple(range(len(parts)))
        grads, value = torch.func.grad(total, argnums=argnums, has_aux=True)(*parts)
        return value, grads

    @cached_property
    def log_partition(self) -> Tensor:
        """log Z, shape [B]; ``-inf`` for an item with no valid structure."""
        if self._differentiable():
            return self._inside(LogSemiring, self._parts(*self._raw), self.lengths)
        with torch.no_grad():
            return self._inside(LogSemiring, self._parts(*self._raw), self.lengths)

    @cached_property
    def _marginals_tuple(self) -> tuple[Tensor, ...]:
        _, grads = self._inside_with_grad(LogSemiring, create_graph=self._differentiable())
        return tuple(grads)

    @cached_property
    def max_score(self) -> Tensor:
        """Score of the highest-scoring structure, shape [B] (``-inf`` if none is valid)."""
        with torch.no_grad():
            return self._inside(MaxSemiring, self._parts(*self._raw), self.lengths)

    @cached_property
    def argmax(self) -> Tensor:
        """The highest-scoring structure (MAP), as a LongTensor; ``-1`` at padding."""
        score, grads = self._inside_with_grad(MaxSemiring, create_graph=False)
        value = self._to_structure(*(g.detach() for g in grads))
        return self._invalidate(value, score.detach())

    @cached_property
    def entropy(self) -> Tensor:
        """Shannon entropy H(p) = log Z - E_p[score(z)], shape [B] (0 if no valid structure)."""
        logz = self.log_partition
        marginals = self._marginals_tuple
        with torch.set_grad_enabled(self._differentiable()):
            parts = self._parts(*self._raw)
            expected = logz.new_zeros(logz.shape)
            for marginal, part in zip(marginals, parts, strict=True):
                # 0 * -inf would be NaN: a -inf part has marginal exactly 0
                finite = part.masked_fill(torch.isneginf(part), 0.0)
                expected = expected + (marginal * finite).flatten(1).sum(-1)
            # >= 0 mathematically; in float32 with |scores| ~ 1e4 the difference of two large
            # numbers can round to a tiny negative value
            entropy = (logz - expected).clamp_min(0.0)
        return torch.where(torch.isneginf(logz), torch.zeros_like(entropy), entropy)

    def sample(self, n: int = 1) -> Tensor:
        """``n`` exact samples from the distribution, shape [n, B, ...] (``-1`` at padding).

        Uses the global torch RNG (seed it with ``torch.manual_seed`` for reproducibility).
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"`n` must be a positive int, got {n!r}")
        logz, grads = self._inside_with_grad(SampleSemiring, create_graph=False, repeat=n)
        value = self._to_structure(*(g.detach() for g in grads))
        value = self._invalidate(value, logz.detach())
        return value.reshape(n, self.batch_size, *value.shape[1:])

    def log_prob(self, value: Tensor) -> Tensor:
        """log p(value) = score(value) - log Z, shape [B]; ``-inf`` for an invalid structure."""
        score = self._score(value)
        logz = self.log_partition
        # an item with no valid structure (log Z = -inf) gives -inf, not -inf - -inf = NaN
        return torch.where(
            torch.isneginf(logz), torch.full_like(score, float("-inf")), score - logz
        )

    # ---- helpers --------------------------------------------------------------------------
    @staticmethod
    def _invalidate(value: Tensor, score: Tensor) -> Tensor:
        """Set every entry of items whose score is ``-inf`` (no valid structure) to ``-1``."""
        bad = torch.isneginf(score).reshape(-1, *([1] * (value.dim() - 1)))
        return value.masked_fill(bad, -1)
