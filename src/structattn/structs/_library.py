"""The dynamic programs as ``torch.library`` custom operators (issue 38.4): what
``torch.compile(fullgraph=True)`` and ``torch.export`` see of them.

The hand-written ``autograd.Function`` nodes of :mod:`structattn.structs` keep opaque state
between their passes (the C++ kernels' charts, Python lists of per-width tensors) and take
data-dependent paths (which items the LU path keeps, the chain's scaled or log-space pass),
none of which a tracer can follow. While ``torch.compile``/``torch.export`` trace
(:func:`tracing`), each structure is therefore one opaque operator per derivative order,
in the namespace ``structattn``:

* ``<structure>_log_partition``: log Z [B]; its registered backward is the marginals
  operator times the incoming gradient;
* ``<structure>_marginals``: the marginals (the gradient of log Z); its registered backward
  is the Hessian-vector-product operator (a loss on the marginals, structured attention);
* ``<structure>_hvp``: the Hessian of log Z times a direction. It has no registered backward:
  third derivatives of a compiled model are not supported (eager code has any order).

Each operator's implementation calls the eager code (the same functions users call, with
the C++ kernels where they apply and are built, else the PyTorch code) and its fake (meta)
implementation gives the output shapes, so the tracer records one node with the right
shapes and the compiled graph calls the eager dynamic program at run time. The Hessian-vector
product is the hand-written backward of the eager marginals (their ``autograd.Function``
differentiated once, by ``torch.autograd.grad`` inside the operator), so the values and
gradients of compiled and eager code are the same operations. The intermediates of a pass
are not carried from one operator to the next (a graph holds tensors only): the marginals
operator of a backward redoes the inside pass, and the Hessian-vector product the inside
and outside passes.

The operators: ``eisner_*`` and ``matrix_tree_*`` (dependency trees, :func:`tree_ops`),
``chain_*`` (linear chains, :func:`chain_ops`), ``cky_*`` (binary bracketings, unlabelled
and labelled alike: the labels are summed out before the operator, :func:`cky_ops`) and
``semi_markov_*`` (labelled segmentations, :func:`semi_markov_ops`).

A graph with these operators runs where ``structattn`` is imported (``torch.export``'s
program calls them by name, like any custom operator).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from .._validation import tracing

__all__ = [
    "NAMESPACE",
    "autograd_dispatch",
    "chain_ops",
    "cky_ops",
    "semi_markov_ops",
    "tracing",
    "tree_ops",
]

#: the namespace of the operators: ``torch.ops.structattn.<name>``
NAMESPACE = "structattn"


@contextlib.contextmanager
def autograd_dispatch() -> Iterator[None]:
    """Autograd on inside a custom operator's implementation. The dispatcher runs an
    operator's implementation below the autograd keys (excluded in the thread-local state),
    where the eager code could not differentiate what it needs (the exact elimination's
    marginals of :mod:`.nonprojective`, the Hessian-vector product by ``autograd.grad``);
    this re-includes them for the block."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    included = torch._C._dispatch_tls_local_include_set()
    keys = torch._C.DispatchKey
    with torch._C._ForceDispatchKeyGuard(
        included, excluded.remove(keys.AutogradCPU).remove(keys.ADInplaceOrView)
    ):
        yield


def _define(name: str, schema: str, impl: Callable[..., Any], fake: Callable[..., Any]) -> Any:
    """Define ``structattn::<name>`` once per process (a re-import of this module finds it);
    returns its overload packet ``torch.ops.structattn.<name>``."""
    qualified = f"{NAMESPACE}::{name}"
    if not hasattr(getattr(torch.ops, NAMESPACE), name):
        op = torch.library.custom_op(qualified, impl, mutates_args=(), schema=schema)
        op.register_fake(fake)
        _OPS[name] = op
    return getattr(getattr(torch.ops, NAMESPACE), name)


#: name -> the CustomOpDef (to register autograd after the operators it calls exist)
_OPS: dict[str, Any] = {}


def _register_autograd(name: str, backward: Callable[..., Any], setup: Callable[..., Any]) -> None:
    if name in _OPS:
        _OPS[name].register_autograd(backward, setup_context=setup)


def tree_ops(
    name: str,
    log_partition: Callable[[Tensor, Tensor | None, bool], Tensor],
    marginals: Callable[[Tensor, Tensor | None, bool, bool], Tensor],
) -> tuple[Any, Any]:
    """(log Z op, marginals op) of a dependency-tree structure: arc scores [B, N, N],
    lengths [B] or None, multiroot. ``marginals(scores, lengths, multiroot, create_graph)``
    is the eager function (differentiable in ``scores`` when ``create_graph``)."""

    def logz_impl(scores: Tensor, lengths: Tensor | None, multiroot: bool) -> Tensor:
        with autograd_dispatch(), torch.no_grad():
            return log_partition(scores.detach(), lengths, multiroot)

    def marginals_impl(scores: Tensor, lengths: Tensor | None, multiroot: bool) -> Tensor:
        with autograd_dispatch(), torch.no_grad():
            return marginals(scores.detach(), lengths, multiroot, False)

    def hvp_impl(
        scores: Tensor, lengths: Tensor | None, multiroot: bool, direction: Tensor
    ) -> Tensor:
        with autograd_dispatch(), torch.enable_grad():
            leaf = scores.detach().requires_grad_(True)
            out = marginals(leaf, lengths, multiroot, True)
            (hvp,) = torch.autograd.grad(out, leaf, direction, materialize_grads=True)
        return hvp

    args = "Tensor scores, Tensor? lengths, bool multiroot"
    logz = _define(
        f"{name}_log_partition",
        f"({args}) -> Tensor",
        logz_impl,
        lambda scores, lengths, multiroot: scores.new_empty(scores.shape[0]),
    )
    marg = _define(
        f"{name}_marginals",
        f"({args}) -> Tensor",
        marginals_impl,
        lambda scores, lengths, multiroot: torch.empty_like(scores),
    )
    hvp = _define(
        f"{name}_hvp",
        f"({args}, Tensor direction) -> Tensor",
        hvp_impl,
        lambda scores, lengths, multiroot, direction: torch.empty_like(scores),
    )

    def setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        scores, lengths, multiroot = inputs[:3]
        ctx.save_for_backward(scores, lengths)
        ctx.multiroot = multiroot

    def logz_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        scores, lengths = ctx.saved_tensors
        return grad[:, None, None] * marg(scores, lengths, ctx.multiroot), None, None

    def marginals_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        scores, lengths = ctx.saved_tensors
        return hvp(scores, lengths, ctx.multiroot, grad), None, None

    _register_autograd(f"{name}_log_partition", logz_backward, setup)
    _register_autograd(f"{name}_marginals", marginals_backward, setup)
    return logz, marg


def chain_ops(
    log_partition: Callable[[Tensor, Tensor, Tensor | None, str], Tensor],
    marginals: Callable[[Tensor, Tensor, Tensor | None, bool, str], tuple[Tensor, Any]],
) -> tuple[Any, Any]:
    """(log Z op, marginals op) of linear chains: unary [B, N, C], pairwise [C, C] or
    [B, N-1, C, C], lengths [B] or None, method. The marginals op returns (node marginals
    [B, N, C], edge marginals [B, N-1, C, C], or an empty tensor without ``edges``)."""

    def logz_impl(unary: Tensor, pairwise: Tensor, lengths: Tensor | None, method: str) -> Tensor:
        with autograd_dispatch(), torch.no_grad():
            return log_partition(unary.detach(), pairwise.detach(), lengths, method)

    def marginals_impl(
        unary: Tensor, pairwise: Tensor, lengths: Tensor | None, edges: bool, method: str
    ) -> tuple[Tensor, Tensor]:
        with autograd_dispatch(), torch.no_grad():
            node, edge = marginals(unary.detach(), pairwise.detach(), lengths, edges, method)
        return node, (edge if edges else unary.new_empty(0))

    def hvp_impl(
        unary: Tensor,
        pairwise: Tensor,
        lengths: Tensor | None,
        edges: bool,
        method: str,
        g_node: Tensor,
        g_edge: Tensor,
    ) -> tuple[Tensor, Tensor]:
        with autograd_dispatch(), torch.enable_grad():
            leaves = (unary.detach().requires_grad_(True), pairwise.detach().requires_grad_(True))
            node, edge = marginals(*leaves, lengths, edges, method)
            outs, grads = ((node, edge), (g_node, g_edge)) if edges else ((node,), (g_node,))
            d_unary, d_pair = torch.autograd.grad(outs, leaves, grads, materialize_grads=True)
        return d_unary, d_pair

    def marginals_fake(
        unary: Tensor, pairwise: Tensor, lengths: Tensor | None, edges: bool, method: str
    ) -> tuple[Tensor, Tensor]:
        batch, n, c = unary.shape
        edge = unary.new_empty(batch, max(n - 1, 0), c, c) if edges else unary.new_empty(0)
        return torch.empty_like(unary), edge

    args = "Tensor unary, Tensor pairwise, Tensor? lengths"
    logz = _define(
        "chain_log_partition",
        f"({args}, str method) -> Tensor",
        logz_impl,
        lambda unary, pairwise, lengths, method: unary.new_empty(unary.shape[0]),
    )
    marg = _define(
        "chain_marginals",
        f"({args}, bool edges, str method) -> (Tensor, Tensor)",
        marginals_impl,
        marginals_fake,
    )
    hvp = _define(
        "chain_hvp",
        f"({args}, bool edges, str method, Tensor g_node, Tensor g_edge) -> (Tensor, Tensor)",
        hvp_impl,
        lambda unary, pairwise, *_: (torch.empty_like(unary), torch.empty_like(pairwise)),
    )

    def logz_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        unary, pairwise, lengths, method = inputs
        ctx.save_for_backward(unary, pairwise, lengths)
        ctx.method = method

    def logz_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        unary, pairwise, lengths = ctx.saved_tensors
        node, edge = marg(unary, pairwise, lengths, True, ctx.method)
        d_pair = edge * grad[:, None, None, None]
        if pairwise.dim() == 2:  # one matrix shared by every step
            d_pair = d_pair.sum((0, 1))
        return node * grad[:, None, None], d_pair, None, None

    def marginals_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        unary, pairwise, lengths, edges, method = inputs
        ctx.save_for_backward(unary, pairwise, lengths)
        ctx.edges, ctx.method = edges, method

    def marginals_backward(
        ctx: Any, g_node: Tensor, g_edge: Tensor
    ) -> tuple[Tensor, Tensor, None, None, None]:
        unary, pairwise, lengths = ctx.saved_tensors
        d_unary, d_pair = hvp(unary, pairwise, lengths, ctx.edges, ctx.method, g_node, g_edge)
        return d_unary, d_pair, None, None, None

    _register_autograd("chain_log_partition", logz_backward, logz_setup)
    _register_autograd("chain_marginals", marginals_backward, marginals_setup)
    return logz, marg


def _fresh(x: Tensor) -> Tensor:
    """``x`` contiguous (the strides the fake implementations give)."""
    return x.contiguous()


def cky_ops(
    log_partition: Callable[[Tensor, Tensor | None], Tensor],
    marginals: Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor]],
) -> tuple[Any, Any]:
    """(log Z op, marginals op) of binary bracketings: span scores [B, N, N], lengths [B] or
    None. ``marginals(scores, lengths)`` is the eager function returning (log Z [B], span
    marginals [B, N, N]) in one autograd node (differentiable in ``scores``: its backward
    is the hand-written Hessian-vector product); the marginals operator returns the same
    pair (log Z's gradient is the marginals, registered too)."""

    def logz_impl(scores: Tensor, lengths: Tensor | None) -> Tensor:
        with autograd_dispatch(), torch.no_grad():
            return _fresh(log_partition(scores.detach(), lengths))

    def marginals_impl(scores: Tensor, lengths: Tensor | None) -> tuple[Tensor, Tensor]:
        with autograd_dispatch(), torch.no_grad():
            logz, marg = marginals(scores.detach(), lengths)
        return _fresh(logz), _fresh(marg)

    def hvp_impl(scores: Tensor, lengths: Tensor | None, direction: Tensor) -> Tensor:
        with autograd_dispatch(), torch.enable_grad():
            leaf = scores.detach().requires_grad_(True)
            _, out = marginals(leaf, lengths)
            (hvp,) = torch.autograd.grad(out, leaf, direction, materialize_grads=True)
        return _fresh(hvp)

    args = "Tensor span_scores, Tensor? lengths"
    logz = _define(
        "cky_log_partition",
        f"({args}) -> Tensor",
        logz_impl,
        lambda scores, lengths: scores.new_empty(scores.shape[0]),
    )
    marg = _define(
        "cky_marginals",
        f"({args}) -> (Tensor, Tensor)",
        marginals_impl,
        lambda scores, lengths: (scores.new_empty(scores.shape[0]), scores.new_empty(scores.shape)),
    )
    hvp = _define(
        "cky_hvp",
        f"({args}, Tensor direction) -> Tensor",
        hvp_impl,
        lambda scores, lengths, direction: scores.new_empty(scores.shape),
    )

    def logz_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*inputs)

    def logz_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        scores, lengths = ctx.saved_tensors
        _, unit = marg(scores, lengths)
        return grad[:, None, None] * unit, None

    def marginals_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*inputs, output[1])

    def marginals_backward(ctx: Any, g_logz: Tensor, g_marg: Tensor) -> tuple[Tensor, None]:
        scores, lengths, unit = ctx.saved_tensors
        out = hvp(scores, lengths, g_marg)
        if g_logz is not None:  # log Z's gradient: the marginals
            out = out + g_logz[:, None, None] * unit
        return out, None

    _register_autograd("cky_log_partition", logz_backward, logz_setup)
    _register_autograd("cky_marginals", marginals_backward, marginals_setup)
    return logz, marg


def semi_markov_ops(
    log_partition: Callable[[Tensor, Tensor, Tensor | None], Tensor],
    marginals: Callable[[Tensor, Tensor, Tensor | None], tuple[Tensor, Tensor]],
) -> tuple[Any, Any]:
    """(log Z op, marginals op) of labelled segmentations: segment scores [B, N, K, C],
    transitions [B, C, C], lengths [B] or None. The marginals op returns (segment marginals
    [B, N, K, C], transition marginals [B, C, C]); ``marginals`` is the eager function
    (one autograd node whose backward is the hand-written Hessian-vector product)."""

    def logz_impl(segments: Tensor, transitions: Tensor, lengths: Tensor | None) -> Tensor:
        with autograd_dispatch(), torch.no_grad():
            return _fresh(log_partition(segments.detach(), transitions.detach(), lengths))

    def marginals_impl(
        segments: Tensor, transitions: Tensor, lengths: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        with autograd_dispatch(), torch.no_grad():
            segs, pairs = marginals(segments.detach(), transitions.detach(), lengths)
        return _fresh(segs), _fresh(pairs)

    def hvp_impl(
        segments: Tensor,
        transitions: Tensor,
        lengths: Tensor | None,
        g_seg: Tensor,
        g_trans: Tensor,
    ) -> tuple[Tensor, Tensor]:
        with autograd_dispatch(), torch.enable_grad():
            leaves = (
                segments.detach().requires_grad_(True),
                transitions.detach().requires_grad_(True),
            )
            outs = marginals(*leaves, lengths)
            d_seg, d_trans = torch.autograd.grad(
                outs, leaves, (g_seg, g_trans), materialize_grads=True
            )
        return _fresh(d_seg), _fresh(d_trans)

    def pair_fake(segments: Tensor, transitions: Tensor, *_: Any) -> tuple[Tensor, Tensor]:
        return segments.new_empty(segments.shape), transitions.new_empty(transitions.shape)

    args = "Tensor segment_scores, Tensor transitions, Tensor? lengths"
    logz = _define(
        "semi_markov_log_partition",
        f"({args}) -> Tensor",
        logz_impl,
        lambda segments, transitions, lengths: segments.new_empty(segments.shape[0]),
    )
    marg = _define(
        "semi_markov_marginals", f"({args}) -> (Tensor, Tensor)", marginals_impl, pair_fake
    )
    hvp = _define(
        "semi_markov_hvp",
        f"({args}, Tensor g_segments, Tensor g_transitions) -> (Tensor, Tensor)",
        hvp_impl,
        pair_fake,
    )

    def setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*inputs)

    def logz_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        segments, transitions, lengths = ctx.saved_tensors
        segs, pairs = marg(segments, transitions, lengths)
        return segs * grad[:, None, None, None], pairs * grad[:, None, None], None

    def marginals_backward(ctx: Any, g_seg: Tensor, g_trans: Tensor) -> tuple[Tensor, Tensor, None]:
        segments, transitions, lengths = ctx.saved_tensors
        d_seg, d_trans = hvp(segments, transitions, lengths, g_seg, g_trans)
        return d_seg, d_trans, None

    _register_autograd("semi_markov_log_partition", logz_backward, setup)
    _register_autograd("semi_markov_marginals", marginals_backward, setup)
    return logz, marg
