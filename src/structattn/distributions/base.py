"""Shared machinery of the structured distributions.

A subclass supplies its raw potentials, turns them into *part* potentials (one score per
part of a structure: a node label, an edge, an arc), and runs an inside pass over the parts
with a semiring. Everything else follows generically:

* ``log_partition`` -- inside pass in the log semiring,
* ``marginals``     -- gradient of log Z with respect to the parts (differentiable again:
  a loss on the marginals trains the potentials, second-order),
* ``max_score``/``argmax`` -- inside pass in the max semiring and its gradient,
* ``sample(n)``     -- the gradient of the sampling semiring's inside pass,
* ``entropy``       -- ``log Z - sum(marginals * parts)``,
* ``sparsemap()``   -- SparseMAP by the active set with the MAP pass as oracle
  (:mod:`structattn.distributions.sparsemap`); ``temperature=`` in the constructors and
  ``tempered(t)``: the distribution of the scores divided by t.

Every distribution also answers ``num_tokens`` (scored positions per item, [B]) and
``impossible_reason(value, item)`` (why a structure has probability 0, in words), which
:func:`structured_nll` uses for ``reduction="token"`` and its errors.

Items with no valid structure (every structure has a ``-inf`` part) get
``log_partition = -inf``, zero marginals with finite (zero) gradients, ``entropy = 0``,
``max_score = -inf`` and ``-1`` everywhere in ``argmax`` and samples.
"""

from __future__ import annotations

import copy
import functools
import math
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast, overload

import torch
from torch import Tensor

from .._validation import differentiated, is_transformed
from ..semirings import LogSemiring, MaxSemiring, SampleSemiring, Semiring

if TYPE_CHECKING:
    from .sparsemap import SparseMAPResult

__all__ = ["StructuredDistribution", "cached_property"]

_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")


class cached_property(Generic[_T]):  # noqa: N801 (named as functools' one it replaces)
    """``functools.cached_property`` without its lock: computed on first access and kept in
    the instance's ``__dict__``. Python 3.11's takes an ``RLock``, a context manager that
    ``torch.compile`` cannot trace (a graph break at every lazy property, which
    ``fullgraph=True`` refuses); a distribution is not shared between threads while it
    computes (3.12 dropped the lock for the same reason)."""

    def __init__(self, fn: Callable[[Any], _T]) -> None:
        self.func = fn  # functools.cached_property's name for it
        self.name = fn.__name__
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> cached_property[_T]: ...
    @overload
    def __get__(self, instance: object, owner: type | None = None) -> _T: ...
    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if instance is None:
            return self
        cache = instance.__dict__
        if self.name in cache:
            return cache[self.name]
        value = cache[self.name] = self.func(instance)
        return value


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


def gumbel_like(x: Tensor) -> Tensor:
    """Standard Gumbel noise of the shape, dtype and device of ``x`` (global RNG)."""
    uniform = torch.rand_like(x).clamp_(torch.finfo(x.dtype).tiny, 1.0)
    return -(-uniform.log()).log()


def check_temperature(temperature: object) -> float:
    """``temperature`` as a float, ValueError unless it is a finite positive number."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"`temperature` must be a positive float, got {temperature!r}")
    if not temperature > 0 or math.isinf(temperature):
        raise ValueError(f"`temperature` must be a positive float, got {temperature!r}")
    return float(temperature)


def tempered_inputs(temperature: float, *potentials: Tensor) -> tuple[Tensor, ...]:
    """The potentials divided by ``temperature``; at temperature 1 the very same tensors (no
    division, so the untempered distribution is bit-for-bit unchanged)."""
    if temperature == 1.0:
        return potentials
    return tuple(p / temperature for p in potentials)


class StructuredDistribution:
    """Base class: a batch of Gibbs distributions over structures, p(z) ∝ exp(score(z)).

    Every distribution with a tempered form takes ``temperature=t`` (keyword, default 1) in
    its constructor: the distribution p_t(z) ∝ exp(score(z) / t), every potential divided by
    t before anything is computed, so ``log_partition`` is log Z(s / t), ``marginals`` the
    tempered marginals (t -> 0: the MAP indicators) and ``t * log_partition`` the
    entropy-smoothed max (:meth:`smoothed_max`). ``Cls(s, temperature=t)`` is the same
    distribution as ``Cls(s).tempered(t)``.
    """

    #: the temperature t the given potentials were divided by (1: the plain distribution)
    temperature: float = 1.0

    #: whether the part scores are positively homogeneous in the raw potentials (dividing
    #: the potentials by t divides every structure's score by t): what ``tempered`` needs
    _homogeneous_parts: bool = True

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
        # a torch.func grad or jvp wrapper counts whatever its requires_grad says (a jvp
        # wrapper does not require grad, yet forward mode and enclosing levels differentiate
        # it: jacfwd of the marginals, jacrev(jacfwd(f)))
        return torch.is_grad_enabled() and any(differentiated(t) for t in self._raw)

    # Marginals are gradients taken inside the forward pass and differentiated again by the
    # caller (double backward), which torch.compile's AOTAutograd does not support: the
    # inference pass runs eagerly (a graph break) and everything around it can still be
    # compiled. Chains, projective and non-projective trees do not come here while tracing:
    # their log Z and marginals are custom operators (structs/_library.py), traced whole.
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
            # views: the gradient with respect to each part counts its direct uses only,
            # also where one part is computed from another (the split tree's node scores
            # from its pivot scores), so it is the part's indicator / marginal
            parts = tuple(p.view_as(p) for p in self._parts(*raw))
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
        if torch.compiler.is_compiling():  # torch.func's gradient traces (autograd.grad not)
            return tuple(self._inside_with_func(LogSemiring)[1])
        _, grads = self._inside_with_grad(LogSemiring, create_graph=self._differentiable())
        return tuple(grads)

    @cached_property
    def _map(self) -> tuple[Tensor, tuple[Tensor, ...]]:
        """(MAP score [B], part indicators of the MAP structure): the max-plus inside pass
        and its gradient (ties broken by the first index at every max), detached."""
        score, grads = self._inside_with_grad(MaxSemiring, create_graph=False)
        return score.detach(), tuple(g.detach() for g in grads)

    @cached_property
    def max_score(self) -> Tensor:
        """Score of the highest-scoring structure, shape [B] (``-inf`` if none is valid).

        Differentiable when the potentials require grad: its gradient with respect to the
        parts is the part indicators of ``argmax`` (the max semiring's gradient; 0 for an
        item with no valid structure), so a perceptron or max-margin loss
        ``max_score - score(gold)`` trains through both terms."""
        if not self._differentiable():
            with torch.no_grad():
                return self._inside(MaxSemiring, self._parts(*self._raw), self.lengths)
        return self._map_score()

    def _map_score(self) -> Tensor:
        """Differentiable score of ``argmax``, [B]; subclasses whose ``argmax`` does not come
        from :attr:`_map` override it (the score of their own argmax)."""
        score, indicators = self._map
        return self._indicator_score(indicators, self._parts(*self._raw), score)

    @staticmethod
    def _indicator_score(
        indicators: Sequence[Tensor], parts: Sequence[Tensor], best: Tensor
    ) -> Tensor:
        """Σ indicators * parts over every part tensor, [B], differentiable in ``parts``
        (gradient: the indicators); ``-inf`` (constant) where ``best`` is ``-inf``.

        An unused part (indicator 0) never enters the sum, so ``-inf`` or junk there is
        harmless (no ``0 * -inf``)."""
        total = best.new_zeros(best.shape)
        for ind, part in zip(indicators, parts, strict=True):
            used = ind != 0
            term = ind.to(part.dtype) * torch.where(used, part, torch.zeros_like(part))
            total = total + term.flatten(1).sum(-1)
        return torch.where(torch.isneginf(best), best, total)

    @cached_property
    def argmax(self) -> Tensor:
        """The highest-scoring structure (MAP), as a LongTensor; ``-1`` at padding."""
        score, indicators = self._map
        value = self._to_structure(*indicators)
        return self._invalidate(value, score)

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

    # ---- counting, cross-entropy and KL divergence -----------------------------------------
    @cached_property
    def count(self) -> Tensor:
        """Number of valid structures of each item (those with no ``-inf`` part, within its
        length), float64 [B]; 0 for an item with none.

        The log-semiring inside pass in float64 with every finite part set to 0 (so log Z is
        the log of the count), exponentiated and rounded to the nearest integer: exact while
        the pass's relative error times the count stays below 1/2 (the tests check counts up
        to about 1e12); larger counts are float64 approximations. Not differentiable."""
        with torch.no_grad():
            parts = tuple(
                torch.where(torch.isneginf(p), float("-inf"), 0.0).to(torch.float64)
                for p in self._parts(*(t.detach() for t in self._raw))
            )
            log_count = self._inside(LogSemiring, parts, self.lengths).to(torch.float64)
            return log_count.exp().round()

    def _check_comparable(self, other: object) -> StructuredDistribution:
        """``other`` as a distribution over the same structures as this one: the same class,
        potentials of the same shapes, dtype and device, the same lengths (and options such as
        ``multiroot``); ValueError naming what differs."""
        if type(other) is not type(self):
            raise ValueError(
                f"`q` must be a {type(self).__name__} like `p` (the same structures), "
                f"got {type(other).__name__}"
            )
        assert isinstance(other, StructuredDistribution)
        for name, mine, theirs in zip(
            self._option_names(), self._options(), other._options(), strict=True
        ):
            if mine != theirs:
                raise ValueError(f"`p` and `q` differ in `{name}`: {mine!r} and {theirs!r}")
        # part shapes: a shared [C, C] transition matrix and a per-step one are comparable
        with torch.no_grad():
            mine_parts = self._parts(*(t.detach() for t in self._raw))
            their_parts = other._parts(*(t.detach() for t in other._raw))
        for mine, theirs in zip(mine_parts, their_parts, strict=True):
            if mine.shape != theirs.shape:
                raise ValueError(
                    "`p` and `q` must have potentials of the same shapes, got parts of shape "
                    f"{tuple(mine.shape)} and {tuple(theirs.shape)}"
                )
            if mine.dtype != theirs.dtype or mine.device != theirs.device:
                raise ValueError("`p` and `q` must have potentials of the same dtype and device")
        size = self._raw[0].shape[1]
        full = torch.full((self.batch_size,), size, dtype=torch.long, device=self._raw[0].device)
        mine_len = full if self.lengths is None else self.lengths
        their_len = full if other.lengths is None else other.lengths
        if not torch.equal(mine_len.to(full.device), their_len.to(full.device)):
            raise ValueError("`p` and `q` must have the same `lengths`")
        return other

    def _option_names(self) -> tuple[str, ...]:
        """Names of the options besides the potentials that define the set of structures."""
        return tuple(name for name in ("multiroot", "labelled") if hasattr(self, name))

    def _options(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self._option_names())

    def _expected_part_scores(self, parts: Sequence[Tensor]) -> Tensor:
        """E_p[Σ parts of z] under this distribution p, from its marginals, [B]: ``-inf``
        where p gives mass to a part scored ``-inf``; parts p never uses do not count."""
        marginals = self._marginals_tuple
        total = parts[0].new_zeros(self.batch_size)
        for marginal, part in zip(marginals, parts, strict=True):
            used = marginal != 0
            term = marginal * torch.where(used, part, torch.zeros_like(part))
            total = total + term.flatten(1).sum(-1)
        return total

    def cross_entropy(self, q: StructuredDistribution) -> Tensor:
        """Cross-entropy H(p, q) = -E_p[log q(z)] = log Z_q - E_p[score_q(z)] of ``q`` (same
        class, shapes and lengths) under this distribution p, shape [B].

        Exact, from p's marginals and q's log-partition (no sampling); differentiable in the
        potentials of both. ``+inf`` where p gives mass to a structure that q forbids (or q
        has no structure); 0 for an item where p has no structure (an empty expectation).
        ``p.cross_entropy(p) == p.entropy``."""
        q = self._check_comparable(q)
        logz_q = q.log_partition
        expected = self._expected_part_scores(q._parts(*q._raw))
        value = logz_q - expected
        value = torch.where(torch.isneginf(logz_q), torch.full_like(value, float("inf")), value)
        return torch.where(torch.isneginf(self.log_partition), torch.zeros_like(value), value)

    def kl_divergence(self, q: StructuredDistribution) -> Tensor:
        """KL(p || q) = E_p[log p(z) - log q(z)] = H(p, q) - H(p) between this distribution
        p and ``q`` (same class, shapes and lengths), shape [B].

        Computed as ``log Z_q - log Z_p - E_p[score_q - score_p]`` from p's marginals (no
        difference of two large cross-entropies), differentiable in the potentials of both;
        >= 0 up to round-off (not clamped, so the gradient stays exact). ``+inf`` where p
        gives mass to a structure that q forbids; 0 for an item where p has no structure."""
        q = self._check_comparable(q)
        logz_p, logz_q = self.log_partition, q.log_partition
        own = self._parts(*self._raw)
        other = q._parts(*q._raw)
        # p's marginals are 0 on its own -inf parts: those are skipped, never -inf - -inf
        diff = tuple(
            torch.where(torch.isneginf(mine), torch.zeros_like(theirs), theirs - mine)
            for mine, theirs in zip(own, other, strict=True)
        )
        logz_gap = torch.where(
            torch.isneginf(logz_q) | torch.isneginf(logz_p),
            torch.zeros_like(logz_q),
            logz_q - logz_p,
        )
        value = logz_gap - self._expected_part_scores(diff)
        value = torch.where(torch.isneginf(logz_q), torch.full_like(value, float("inf")), value)
        return torch.where(torch.isneginf(logz_p), torch.zeros_like(value), value)

    # ---- smoothed MAP and perturb-and-MAP (#41.7) -------------------------------------------
    def _with_raw(self, *raw: Tensor) -> StructuredDistribution:
        """A copy of this distribution with the potentials ``raw`` (the shapes of ``_raw``)
        in place of its own, nothing computed yet (no cached output is copied)."""
        new = copy.copy(self)
        cls = type(self)
        new.__dict__ = {
            name: value
            for name, value in self.__dict__.items()
            if not isinstance(getattr(cls, name, None), cached_property)
        }
        for name, value in self.__dict__.items():  # attributes naming a raw tensor follow it
            for old, replacement in zip(self._raw, raw, strict=True):
                if value is old:
                    setattr(new, name, replacement)
        new._raw = tuple(raw)
        return new

    def tempered(self, temperature: float) -> StructuredDistribution:
        """The distribution p_t(z) ∝ exp(score(z) / t) over the same structures (the same
        class; every potential divided by ``temperature`` t > 0): t = 1 is this one, t -> 0
        concentrates on the MAP structures (its ``marginals`` tend to ``argmax``'s
        indicators where the MAP is unique), t -> inf on the uniform distribution.

        ``t * tempered(t).log_partition`` is the entropy-smoothed max (:meth:`smoothed_max`)
        and ``tempered(t).marginals`` its gradient: differentiable, dense relaxations of
        ``max_score`` and ``argmax`` for structured attention."""
        temperature = check_temperature(temperature)
        if not self._homogeneous_parts:
            raise NotImplementedError(
                f"{type(self).__name__} has no tempered form: its part scores are not "
                "proportional to its potentials (dividing the potentials by t does not divide "
                "every structure's score by t)"
            )
        new = self._with_raw(*(t / temperature for t in self._raw))
        new.temperature = self.temperature * temperature
        return new

    def smoothed_max(self, temperature: float) -> Tensor:
        """Entropy-smoothed max t log Σ_z exp(score(z) / t) = max over distributions q of
        (E_q[score] + t H(q)), shape [B], with ``max_score <= smoothed_max(t) <= max_score +
        t log(count)``: ``max_score`` as t -> 0, ``log_partition`` at t = 1. Its gradient
        with respect to the parts is ``tempered(t)``'s marginals. ``-inf`` where no
        structure is valid."""
        return temperature * self.tempered(temperature).log_partition

    def rsample(self, n: int = 1, temperature: float = 1.0) -> Tensor:
        """``n`` perturb-and-MAP structures with a straight-through gradient, as indicators
        of the shape of ``marginals``: [n, B, ...] (float, 0/1 forward).

        Each draw adds independent Gumbel noise to every entry of the first potential tensor
        (unary / arc / span / segment / pivot scores; labelled trees: the label scores),
        takes the MAP structure of the perturbed scores (forward: its 0/1 indicators) and
        back-propagates through the marginals of the perturbed scores at ``temperature``
        (the straight-through estimator: value ``hard + (soft - soft.detach())``). The
        perturbation is per part, not per structure, so the draws are **not** exact samples
        of this distribution (use ``sample(n)`` for those); they are hard structures a layer
        can use in the forward pass and still train. Uses the global torch RNG."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"`n` must be a positive int, got {n!r}")
        draws = []
        for _ in range(n):
            perturbed = self._perturbed()
            soft = perturbed.tempered(temperature).marginals  # type: ignore[attr-defined]
            hard = perturbed._indicators(perturbed.argmax).to(soft.dtype)
            draws.append(hard + (soft - soft.detach()))  # exactly 0/1 forward
        return torch.stack(draws)

    def _perturbed(self) -> StructuredDistribution:
        """This distribution with independent Gumbel noise added to every entry of its first
        potential tensor (one perturb-and-MAP draw of :meth:`rsample`; global RNG)."""
        first = self._raw[0]
        return self._with_raw(first + gumbel_like(first), *self._raw[1:])

    # ---- SparseMAP (#41.7) ---------------------------------------------------------------
    def _sparsemap_parts(self) -> tuple[Tensor, ...]:
        """The part scores that :meth:`sparsemap` projects, the ``marginals`` part first (the
        shapes of :meth:`_parts`; labelled trees: their labelled arcs)."""
        return self._parts(*self._raw)

    def _sparsemap_argmax(
        self, parts: tuple[Tensor, ...], lengths: Tensor | None
    ) -> tuple[Tensor, ...]:
        """0/1 indicators of the MAP structures under the part scores ``parts`` (the shapes
        of :meth:`_sparsemap_parts`, for any batch of items whose ``lengths`` are given),
        detached: the oracle of :meth:`sparsemap`."""
        return self._part_argmax(parts, lengths)

    def _part_argmax(self, parts: tuple[Tensor, ...], lengths: Tensor | None) -> tuple[Tensor, ...]:
        """0/1 indicators of the MAP structure of each item under the part scores ``parts``
        (the shapes of :meth:`_parts`, any batch size, items of ``lengths``; 0 everywhere
        for an item with none), detached: the gradient of the max-plus inside pass (ties:
        as ``_map``). Subclasses with their own MAP algorithm override it. The oracle of
        :meth:`sparsemap`."""
        with torch.inference_mode(False), torch.enable_grad():
            leaves = tuple(_fresh_leaf(p) for p in parts)
            value = self._inside(MaxSemiring, leaves, lengths)
            grads = torch.autograd.grad(value.sum(), leaves, materialize_grads=True)
        none = torch.isneginf(value.detach())  # [B]: no structure (no meaningful gradient)
        return tuple(
            g.detach().masked_fill(none.view(-1, *([1] * (g.dim() - 1))), 0.0) for g in grads
        )

    def sparsemap(
        self, max_iter: int = 50, tol: float = 1e-6, init: SparseMAPResult | None = None
    ) -> SparseMAPResult:
        """SparseMAP marginals (Niculae et al. 2018): the scores projected onto the marginal
        polytope, a sparse convex combination of few structures, by the active-set algorithm
        with this distribution's MAP pass as oracle; differentiable (closed-form backward).
        Returns a :class:`~structattn.distributions.sparsemap.SparseMAPResult` (``.marginals``
        has the shape of ``marginals``); see :func:`~structattn.distributions.sparsemap
        .sparsemap` for the arguments (``init``: a warm start from an earlier result)."""
        from .sparsemap import sparsemap  # a function-level import: sparsemap types this one

        return sparsemap(self, max_iter, tol, init)

    def straight_through(self) -> Tensor:
        """The MAP structure (``argmax``) as 0/1 indicators of the shape of ``marginals``
        in the forward pass, with the gradient of ``marginals`` in the backward pass (the
        straight-through estimator, ``hard + (soft - soft.detach())``: exactly 0/1 forward).
        Labelled structures: the labelled parts (``marginals``' shape, [B, N, N, L])."""
        soft = self.marginals  # type: ignore[attr-defined]
        hard = self._indicators(self.argmax).to(soft.dtype)
        return hard + (soft - soft.detach())

    def _indicators(self, value: Tensor) -> Tensor:
        """0/1 indicators of the shape of ``marginals`` for structures ``value`` in the
        encoding of ``argmax`` (the span structures: that encoding itself; ``-1`` -> 0)."""
        return value.clamp_min(0)

    # ---- helpers --------------------------------------------------------------------------
    @staticmethod
    def _argmax_first(scores: Tensor, structures: Tensor, best: Tensor) -> tuple[Tensor, Tensor]:
        """A k-best list (scores [k, B], structures [k, B, ...], best first) reordered so that
        rank 0 is ``best`` [B, ...] (the ``argmax``) where the list has tied best structures:
        ``best`` is moved to the front if it is in the list, else it replaces rank 0 (then
        every listed structure is tied with it, so the list stays a valid k-best list)."""
        k = scores.shape[0]
        if k == 0 or scores.shape[1] == 0:
            return scores, structures
        same = (structures == best.unsqueeze(0)).flatten(2).all(-1)  # [k, B]
        found = same.any(0)  # [B]
        missing = ~found & ~torch.isneginf(scores[0])
        # the rank of ``best``; if it is not listed, the last rank (dropped for it)
        rank = torch.where(found, same.to(torch.int8).argmax(0), k - 1)  # [B]
        j = torch.arange(k, device=scores.device).unsqueeze(1)  # [k, 1]
        order = torch.where(j == 0, rank, torch.where(j <= rank, j - 1, j))  # [r, 0, .., r-1, ..]
        new_scores = scores.gather(0, order)
        index = order.view(*order.shape, *([1] * (structures.dim() - 2))).expand_as(structures)
        new_structures = structures.gather(0, index)
        first = torch.where(missing.view(-1, *([1] * (best.dim() - 1))), best, new_structures[0])
        new_structures = torch.cat([first.unsqueeze(0), new_structures[1:]])
        new_scores = torch.cat(
            [torch.where(missing, scores[0], new_scores[0]).unsqueeze(0), new_scores[1:]]
        )
        return new_scores, new_structures

    @staticmethod
    def _invalidate(value: Tensor, score: Tensor) -> Tensor:
        """Set every entry of items whose score is ``-inf`` (no valid structure) to ``-1``."""
        bad = torch.isneginf(score).reshape(-1, *([1] * (value.dim() - 1)))
        return value.masked_fill(bad, -1)
