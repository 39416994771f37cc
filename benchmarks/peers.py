"""Library adapters: ours and the peers, all driven from one :class:`~problems.Problem`.

Each adapter has a ``convert`` method: a *differentiable, linear* map from our tensors to
the library's native input tensors. The harness relies on it for everything that compares
libraries, so the claim "all libraries compute the same distribution" rests on one small
function per peer:

* the native inputs are ``convert(ours)``, made fresh leaves (conversion is not timed: a
  user of that library would produce potentials in its layout directly);
* native marginals map back to our layout by the vector-Jacobian product of ``convert``
  (marginals are gradients of log Z, so this is exact), and so do the gradients of the
  marginal loss;
* the weights of the marginal loss map forward by the Jacobian-vector product, so that
  ``sum(native_marginals * native_weight) == sum(our_marginals * weight)``.

Conventions converted (ours: ROOT at 0, ``arc[b, h, m]`` head -> modifier, lengths count
ROOT; chain ``pairwise[a, c]`` = (z_i = a, z_{i+1} = c)):

* torch-struct trees (``DependencyCRF``, ``NonProjectiveDependencyCRF``): no ROOT row,
  ``[B, N-1, N-1]`` ``(head, child)`` over words with the ROOT -> m score on the diagonal
  ``[m-1, m-1]``; ``lengths`` count words (ours - 1). ``multiroot`` is passed explicitly
  (``DependencyCRF`` stores it as a class attribute of ``DepTree``: set at every
  construction). Potentials must require grad (in-place error otherwise).
* supar trees (``DependencyCRF``, ``MatrixTree``): ``s_arc[b, m, h]`` (dependent, head), ROOT
  at 0 like ours (= our tensor transposed); ``lens`` count words; ``multiroot`` defaults to
  False there, so it is always passed.
* torch-struct ``LinearChainCRF``: edge potentials ``[B, N-1, C, C]`` with
  ``edge[b, i, c_next, c_prev] = pairwise[c_prev, c_next] + unary[b, i+1, c_next]``
  (+ ``unary[b, 0, c_prev]`` folded into i = 0); its marginals are edge marginals.
* supar ``LinearChainCRF``: ``scores`` = unary, ``trans`` ``[C+1, C+1]`` whose last row /
  column are start / end transitions (zero here).
* pytorch-crf ``CRF``: emissions = unary, ``transitions`` = pairwise (``[from, to]``),
  start/end transitions zero; log Z is its ``_compute_normalizer`` (it has no marginals; the
  harness gets them by autograd for the check only), the MAP its ``decode`` (Viterbi).
* chain MAP (``decode``, what the ``argmax`` op times): each library's own output (ours and
  supar: labels [B, N]; torch-struct: edge indicators; pytorch-crf: lists of labels),
  converted to labels [B, N] by ``argmax`` for the check, outside the timing.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from problems import Problem
from torch import Tensor

__all__ = ["Adapter", "State", "adapters_for"]


@dataclass
class State:
    """A problem prepared for one library: native leaves and whatever the library needs."""

    problem: Problem
    natives: tuple[Tensor, ...]  # native inputs, fresh leaves requiring grad
    weight: Tensor  # marginal-loss weights in the native layout of the marginals
    leaves: tuple[Tensor, ...]  # everything the backward differentiates (natives + params)
    extra: dict[str, Any] = field(default_factory=dict)


class Adapter:
    """One library's implementation of one structure (base class)."""

    library: str = "?"
    kind: str = "?"  # "tree", "nonproj" or "chain"
    #: timed operations this library offers ("logz_fb", "marg_fb", "marg", "argmax")
    ops: frozenset[str] = frozenset()
    is_ours: bool = False

    def supports(self, problem: Problem) -> str | None:
        """None if the library handles ``problem``, else a short reason."""
        return None

    def convert(self, problem: Problem, *ours: Tensor) -> tuple[Tensor, ...]:
        """Differentiable linear map from our tensors to the native inputs."""
        return ours

    def setup(self, problem: Problem, natives: tuple[Tensor, ...]) -> dict[str, Any]:
        """Extra per-problem objects (lengths in native convention, modules, masks)."""
        return {}

    def log_partition(self, state: State) -> Tensor:
        raise NotImplementedError

    def marginals(self, state: State) -> Tensor:
        """Marginals w.r.t. ``natives[0]`` (differentiable). Default: autograd of log Z."""
        logz = self.log_partition(state)
        return torch.autograd.grad(logz.sum(), state.natives[0], create_graph=True)[0]

    def argmax(self, state: State) -> Tensor:
        """The MAP structure in our convention: heads [B, N] (entries at ROOT and padding
        are ignored) or chain labels [B, N] (-1 at padding)."""
        raise NotImplementedError

    def decode(self, state: State) -> object:
        """What the ``argmax`` op times: the library's own MAP output (default: ``argmax``;
        the chain adapters time their native output and convert it in ``argmax``)."""
        return self.argmax(state)

    def extra_leaves(self, state: State) -> tuple[Tensor, ...]:
        return ()

    # ---- generic -------------------------------------------------------------------------
    def prepare(self, problem: Problem) -> State:
        """Native leaves for ``problem`` (conversion done here, outside any timing)."""
        ours = problem.tensors
        with torch.no_grad():
            natives = self.convert(problem, *ours)
        natives = tuple(t.detach().clone().contiguous().requires_grad_(True) for t in natives)

        def first(x: Tensor) -> Tensor:
            return self.convert(problem, x, *ours[1:])[0]

        weight = torch.func.jvp(first, (ours[0],), (problem.weight,))[1]
        state = State(problem, natives, weight.detach().contiguous(), natives)
        state.extra = self.setup(problem, natives)
        state.leaves = natives + self.extra_leaves(state)
        return state

    def to_ours(self, state: State, native_grads: tuple[Tensor | None, ...]) -> tuple[Tensor, ...]:
        """Pull tensors in the layout of the native inputs back to our layout (VJP)."""
        ours = tuple(t.detach().requires_grad_(True) for t in state.problem.tensors)
        with torch.enable_grad():
            outs = self.convert(state.problem, *ours)
            pairs = [(o, g) for o, g in zip(outs, native_grads, strict=False) if g is not None]
            grads = torch.autograd.grad(
                [o for o, _ in pairs], ours, [g for _, g in pairs], allow_unused=True
            )
        return tuple(
            torch.zeros_like(t) if g is None else g for t, g in zip(ours, grads, strict=True)
        )

    def marginals_ours(self, state: State, native_marginals: Tensor) -> Tensor:
        """Marginals in our layout (the marginals of our first tensor)."""
        return self.to_ours(state, (native_marginals.detach(),))[0]

    def op(self, name: str, state: State) -> Callable[[], object]:
        """The callable timed for operation ``name``."""
        if name == "logz_fb":

            def logz_fb() -> object:
                logz = self.log_partition(state)
                return torch.autograd.grad(logz.sum(), state.leaves, allow_unused=True)

            return logz_fb
        if name == "marg_fb":

            def marg_fb() -> object:
                loss = (self.marginals(state) * state.weight).sum()
                return torch.autograd.grad(loss, state.leaves, allow_unused=True)

            return marg_fb
        if name == "marg":
            return lambda: self.marginals(state)
        if name == "argmax":
            return lambda: self.decode(state)
        raise ValueError(f"unknown op {name!r}")


def _words(lengths: Tensor | None) -> Tensor | None:
    return None if lengths is None else lengths - 1


def _root_on_diagonal(arcs: Tensor) -> Tensor:
    """Ours [B, N, N] (ROOT row 0) -> torch-struct [B, N-1, N-1], ROOT -> m on [m-1, m-1]."""
    words = arcs[:, 1:, 1:]
    eye = torch.eye(words.shape[-1], dtype=torch.bool, device=arcs.device)
    return torch.where(eye, torch.diag_embed(arcs[:, 0, 1:]), words)


def _heads_from_indicators(arcs: Tensor, problem: Problem) -> Tensor:
    """0/1 arc indicators [B, N, N] (ours layout) -> heads [B, N], -1 at ROOT/padding."""
    heads = arcs.argmax(1)
    return heads.masked_fill(~problem.modifier_mask, -1)


# ---- ours ---------------------------------------------------------------------------------
class OursTree(Adapter):
    library = "ours"
    kind = "tree"
    ops = frozenset({"logz_fb", "marg_fb", "argmax"})
    is_ours = True

    def _dist(self, state: State) -> Any:
        import structattn

        p = state.problem
        return structattn.DependencyCRF(state.natives[0], p.lengths, multiroot=p.multiroot)

    def log_partition(self, state: State) -> Tensor:
        return self._dist(state).log_partition

    def marginals(self, state: State) -> Tensor:
        return self._dist(state).marginals

    def argmax(self, state: State) -> Tensor:
        return self._dist(state).argmax


class OursNonProj(OursTree):
    kind = "nonproj"
    ops = frozenset({"logz_fb", "marg_fb", "argmax"})

    def _dist(self, state: State) -> Any:
        from structattn.distributions.nonprojective import NonProjectiveDependencyCRF

        p = state.problem
        return NonProjectiveDependencyCRF(state.natives[0], p.lengths, multiroot=p.multiroot)


class OursChain(Adapter):
    library = "ours"
    kind = "chain"
    ops = frozenset({"logz_fb", "marg", "marg_fb", "argmax"})
    is_ours = True

    def _dist(self, state: State) -> Any:
        import structattn

        unary, pairwise = state.natives
        return structattn.LinearChainCRF(unary, pairwise, state.problem.lengths)

    def log_partition(self, state: State) -> Tensor:
        return self._dist(state).log_partition

    def marginals(self, state: State) -> Tensor:
        return self._dist(state).marginals

    def argmax(self, state: State) -> Tensor:
        return self._dist(state).argmax  # Viterbi labels [B, N], -1 at padding


# ---- torch-struct ---------------------------------------------------------------------------
class TorchStructTree(Adapter):
    library = "torch-struct"
    kind = "tree"
    ops = frozenset({"logz_fb", "marg_fb", "argmax"})

    def convert(self, problem: Problem, *ours: Tensor) -> tuple[Tensor, ...]:
        return (_root_on_diagonal(ours[0]),)

    def _dist(self, state: State) -> Any:
        import torch_struct

        p = state.problem
        return torch_struct.DependencyCRF(
            state.natives[0], lengths=_words(p.lengths), multiroot=p.multiroot
        )

    def log_partition(self, state: State) -> Tensor:
        return self._dist(state).partition

    def marginals(self, state: State) -> Tensor:
        return self._dist(state).marginals

    def argmax(self, state: State) -> Tensor:
        indicators = self._dist(state).argmax.detach()
        return _heads_from_indicators(self.marginals_ours(state, indicators), state.problem)


class TorchStructNonProj(TorchStructTree):
    kind = "nonproj"
    ops = frozenset({"logz_fb", "marg_fb"})  # its argmax is not implemented (returns None)

    def _dist(self, state: State) -> Any:
        import torch_struct

        p = state.problem
        return torch_struct.NonProjectiveDependencyCRF(
            state.natives[0], lengths=_words(p.lengths), multiroot=p.multiroot
        )


class TorchStructChain(Adapter):
    library = "torch-struct"
    kind = "chain"
    ops = frozenset({"logz_fb", "marg", "marg_fb", "argmax"})

    def convert(self, problem: Problem, *ours: Tensor) -> tuple[Tensor, ...]:
        unary, pairwise = ours
        # edge[b, i, c_next, c_prev] = pairwise[c_prev, c_next] + unary[b, i + 1, c_next]
        edges = pairwise.t() + unary[:, 1:, :, None]
        first = edges[:, :1] + unary[:, :1, None, :]  # + unary[b, 0, c_prev] at i = 0
        return (torch.cat([first, edges[:, 1:]], dim=1),)

    def supports(self, problem: Problem) -> str | None:
        return "needs N >= 2" if problem.size < 2 else None

    def _dist(self, state: State) -> Any:
        import torch_struct

        return torch_struct.LinearChainCRF(state.natives[0], lengths=state.problem.lengths)

    def log_partition(self, state: State) -> Tensor:
        return self._dist(state).partition

    def marginals(self, state: State) -> Tensor:
        return self._dist(state).marginals

    def decode(self, state: State) -> object:
        return self._dist(state).argmax  # edge indicators [B, N-1, C, C] (max semiring)

    def argmax(self, state: State) -> Tensor:
        edges = self.decode(state)
        assert isinstance(edges, Tensor)
        edges = edges.detach()  # [B, N-1, C(next), C(prev)], 0 beyond each item's length
        labels = torch.cat([edges[:, :1].sum(2).argmax(-1), edges.sum(3).argmax(-1)], 1)
        return labels.masked_fill(~state.problem.mask, -1)


# ---- supar ------------------------------------------------------------------------------------
def _import_supar_structs() -> types.ModuleType:
    """``supar.structs`` (its package ``__init__`` imports parsers, transformers, stanza...).

    If the normal import fails, load ``supar/structs`` and ``supar/utils/{common,fn}`` with
    empty stand-ins for the ``supar`` and ``supar.utils`` packages.
    """
    try:
        return importlib.import_module("supar.structs")
    except ImportError:
        spec = importlib.util.find_spec("supar")
        if spec is None or not spec.submodule_search_locations:
            raise
        root = Path(next(iter(spec.submodule_search_locations)))
        for name, path in (("supar", root), ("supar.utils", root / "utils")):
            module = types.ModuleType(name)
            module.__path__ = [str(path)]
            sys.modules[name] = module
        return importlib.import_module("supar.structs")


class SuparTree(Adapter):
    library = "supar"
    kind = "tree"
    ops = frozenset({"logz_fb", "marg_fb", "argmax"})

    def convert(self, problem: Problem, *ours: Tensor) -> tuple[Tensor, ...]:
        return (ours[0].transpose(1, 2),)  # s_arc[b, m, h]

    def _dist(self, state: State) -> Any:
        structs = _import_supar_structs()
        p = state.problem
        return structs.DependencyCRF(state.natives[0], _words(p.lengths), multiroot=p.multiroot)

    def log_partition(self, state: State) -> Tensor:
        return self._dist(state).log_partition

    def marginals(self, state: State) -> Tensor:
        return self._dist(state).marginals

    def argmax(self, state: State) -> Tensor:
        heads = self._dist(state).argmax
        return heads.masked_fill(~state.problem.modifier_mask, -1)


class SuparNonProj(SuparTree):
    kind = "nonproj"
    ops = frozenset({"logz_fb", "marg_fb", "argmax"})  # argmax: its Chu-Liu-Edmonds ``mst``

    def _dist(self, state: State) -> Any:
        structs = _import_supar_structs()
        p = state.problem
        return structs.MatrixTree(state.natives[0], _words(p.lengths), multiroot=p.multiroot)


class SuparChain(Adapter):
    library = "supar"
    kind = "chain"
    ops = frozenset({"logz_fb", "marg", "marg_fb", "argmax"})

    def convert(self, problem: Problem, *ours: Tensor) -> tuple[Tensor, ...]:
        unary, pairwise = ours
        return unary, torch.nn.functional.pad(pairwise, (0, 1, 0, 1))  # zero start/end

    def _dist(self, state: State) -> Any:
        structs = _import_supar_structs()
        scores, trans = state.natives
        return structs.LinearChainCRF(scores, trans, state.problem.lengths)

    def log_partition(self, state: State) -> Tensor:
        return self._dist(state).log_partition

    def marginals(self, state: State) -> Tensor:
        return self._dist(state).marginals

    def decode(self, state: State) -> object:
        return self._dist(state).argmax  # tags [B, N] (gradient of the max pass), 0 at padding

    def argmax(self, state: State) -> Tensor:
        labels = self.decode(state)
        assert isinstance(labels, Tensor)
        return labels.masked_fill(~state.problem.mask, -1)


# ---- pytorch-crf ---------------------------------------------------------------------------
class TorchCRFChain(Adapter):
    library = "pytorch-crf"
    kind = "chain"
    ops = frozenset({"logz_fb", "argmax"})  # no marginals API; argmax: its Viterbi ``decode``

    def setup(self, problem: Problem, natives: tuple[Tensor, ...]) -> dict[str, Any]:
        import torchcrf

        crf = torchcrf.CRF(problem.num_labels, batch_first=True)
        del crf.transitions  # replaced by our native leaf (a plain tensor attribute)
        crf.transitions = natives[1]
        with torch.no_grad():
            crf.start_transitions.zero_()
            crf.end_transitions.zero_()
        mask = problem.mask.t().contiguous()  # seq-first, bool
        return {"crf": crf, "mask": mask, "mask_bf": problem.mask.contiguous()}

    def extra_leaves(self, state: State) -> tuple[Tensor, ...]:
        crf = state.extra["crf"]
        return (crf.start_transitions, crf.end_transitions)

    def log_partition(self, state: State) -> Tensor:
        crf, mask = state.extra["crf"], state.extra["mask"]
        return crf._compute_normalizer(state.natives[0].transpose(0, 1), mask)

    def decode(self, state: State) -> object:
        crf, mask = state.extra["crf"], state.extra["mask_bf"]
        with torch.no_grad():  # as a tagger decodes
            return crf.decode(state.natives[0], mask)  # a list of B label lists

    def argmax(self, state: State) -> Tensor:
        lists = self.decode(state)
        assert isinstance(lists, list)
        labels = torch.full(state.problem.mask.shape, -1, dtype=torch.long)
        for b, tags in enumerate(lists):
            labels[b, : len(tags)] = torch.tensor(tags, dtype=torch.long)
        return labels


# ---- registry ------------------------------------------------------------------------------
_PEERS: dict[str, list[tuple[str, type[Adapter]]]] = {
    "tree": [("torch_struct", TorchStructTree), ("supar", SuparTree)],
    "nonproj": [("torch_struct", TorchStructNonProj), ("supar", SuparNonProj)],
    "chain": [
        ("torch_struct", TorchStructChain),
        ("supar", SuparChain),
        ("torchcrf", TorchCRFChain),
    ],
}


def _ours(kind: str) -> Adapter | str:
    if kind == "tree":
        return OursTree()
    if kind == "chain":
        return OursChain()
    try:
        from structattn.distributions.nonprojective import (  # noqa: F401
            NonProjectiveDependencyCRF,
        )
    except ImportError as err:
        return f"structattn NonProjectiveDependencyCRF not available ({err})"
    return OursNonProj()


def adapters_for(kind: str) -> tuple[list[Adapter], list[str]]:
    """(ours first, then every installed peer) and one-line messages for skipped ones."""
    adapters: list[Adapter] = []
    skipped: list[str] = []
    ours = _ours(kind)
    if isinstance(ours, str):
        return [], [ours]
    adapters.append(ours)
    for module, cls in _PEERS[kind]:
        try:
            if module == "supar":
                _import_supar_structs()
            else:
                importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - any import failure means "not installed"
            skipped.append(f"{cls.library} not installed, skipped ({type(err).__name__}: {err})")
            continue
        adapters.append(cls())
    return adapters, skipped
