"""PyTorch 2 features over every distribution (issue 38 items 2-5): torch.func transforms
(grad, jacrev, hessian, vmap) against plain autograd, no host reads with validation off
(distributions and layers), meta tensors, torch.compile(fullgraph=True) and torch.export
through the custom operators, and a clear refusal (never a wrong model) where a trace
cannot be right."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor
from torch.func import grad, hessian, jacrev, vmap

from structattn.attention import (
    MeanFieldAttention,
    SegmentationAttention,
    SemiMarkovSegmentationAttention,
    SpanAttention,
    SpanSelfAttention,
    StructuredMultiheadAttention,
)
from structattn.distributions import (
    DependencyCRF,
    LinearChainCRF,
    NonProjectiveDependencyCRF,
    SemiMarkovCRF,
    SplitTreeDistribution,
    StructuredDistribution,
    TreeCRF,
)
from structattn.structs._extension import kernels_disabled
from structattn.structs._ops import sync_free
from structattn.structs.constituency import cky_log_partition, cky_marginals
from structattn.structs.mean_field import mean_field_marginals
from structattn.structs.semi_markov import semi_markov_log_partition, semi_markov_marginals

F64 = torch.float64

Make = Callable[[Tensor, bool], StructuredDistribution]


def _potentials(shape: tuple[int, ...], seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


_PER_STEP = _potentials((2, 3, 3, 3), 7)  # per-step transitions of a chain [B, N-1, C, C]

#: name -> (a distribution of one potential tensor, that tensor's shape)
CASES: dict[str, tuple[Make, tuple[int, ...]]] = {
    "chain-shared": (
        lambda x, v: LinearChainCRF(
            x, torch.full((3, 3), 0.3, dtype=x.dtype), torch.tensor([4, 2]), validate_args=v
        ),
        (2, 4, 3),
    ),
    "chain-per-step": (
        lambda x, v: LinearChainCRF(
            x, _PER_STEP.to(x.dtype), torch.tensor([4, 2]), validate_args=v
        ),
        (2, 4, 3),
    ),
    "projective": (
        lambda x, v: DependencyCRF(x, torch.tensor([4, 3]), validate_args=v),
        (2, 4, 4),
    ),
    "non-projective": (
        lambda x, v: NonProjectiveDependencyCRF(x, torch.tensor([4, 3]), validate_args=v),
        (2, 4, 4),
    ),
    "non-projective-one-root": (
        lambda x, v: NonProjectiveDependencyCRF(
            x, torch.tensor([4, 3]), multiroot=False, validate_args=v
        ),
        (2, 4, 4),
    ),
    "constituency": (
        lambda x, v: TreeCRF(x, torch.tensor([4, 3]), validate_args=v),
        (2, 4, 4),
    ),
    "semi-markov": (
        lambda x, v: SemiMarkovCRF(
            x, torch.zeros(2, 2, dtype=x.dtype), torch.tensor([4, 3]), validate_args=v
        ),
        (2, 4, 3, 2),
    ),
    "split-tree": (
        lambda x, v: SplitTreeDistribution(x, torch.tensor([4, 3]), validate_args=v),
        (2, 4),
    ),
}


def _autograd_grad(f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    leaf = x.clone().requires_grad_(True)
    (out,) = torch.autograd.grad(f(leaf), leaf)
    return out


def _autograd_hessian(f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    result = torch.autograd.functional.hessian(f, x)
    assert isinstance(result, Tensor)
    return result


# ---- torch.func (#38.3) ---------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CASES))
def test_func_grad_jacrev_hessian_equal_autograd(name: str) -> None:
    make, shape = CASES[name]
    x = _potentials(shape)

    def logz(a: Tensor) -> Tensor:
        return make(a, True).log_partition.sum()

    torch.testing.assert_close(grad(logz)(x), _autograd_grad(logz, x))
    expected = _autograd_hessian(logz, x)
    torch.testing.assert_close(hessian(logz)(x), expected)  # forward-over-reverse
    torch.testing.assert_close(jacrev(jacrev(logz))(x), expected)
    if name != "split-tree":  # its marginals are over nodes, its scores over split points
        # the marginals are the gradient of log Z: their Jacobian is the Hessian
        torch.testing.assert_close(jacrev(lambda a: make(a, True).marginals)(x), expected)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("name", sorted(CASES))
def test_func_vmap_equals_a_loop(name: str, validate: bool) -> None:
    """vmap over log Z, the marginals and the gradient, with validation on (its value checks
    are skipped under the transforms) and off."""
    make, shape = CASES[name]
    xs = torch.stack([_potentials(shape, seed) for seed in range(3)])  # [V, *shape]
    logz = vmap(lambda a: make(a, validate).log_partition)(xs)
    marginals = vmap(lambda a: make(a, validate).marginals)(xs)
    grads = vmap(grad(lambda a: make(a, validate).log_partition.sum()))(xs)
    for v, x in enumerate(xs):
        dist = make(x, True)
        torch.testing.assert_close(logz[v], dist.log_partition)
        torch.testing.assert_close(marginals[v], dist.marginals)
        expected = _autograd_grad(lambda a: make(a, True).log_partition.sum(), x)
        torch.testing.assert_close(grads[v], expected)


def test_func_vmap_over_the_shared_transitions() -> None:
    unary = _potentials((2, 5, 3))
    pairwise = torch.stack([_potentials((3, 3), seed) for seed in range(4)])  # [V, C, C]
    lengths = torch.tensor([5, 3])
    logz = vmap(lambda p: LinearChainCRF(unary, p, lengths).log_partition)(pairwise)
    for v, p in enumerate(pairwise):
        torch.testing.assert_close(logz[v], LinearChainCRF(unary, p, lengths).log_partition)


def test_func_the_issue_example_and_items_without_a_tree() -> None:
    """The issue's example; and a non-projective item with no tree (the exact elimination's
    fallback), under grad and vmap."""
    x = _potentials((2, 5, 5))
    torch.testing.assert_close(
        grad(lambda a: DependencyCRF(a).log_partition.sum())(x), DependencyCRF(x).marginals
    )
    x[0, :, 2] = float("-inf")  # word 2 has no head: item 0 has no tree

    def logz(a: Tensor) -> Tensor:
        return NonProjectiveDependencyCRF(a).log_partition.sum()

    torch.testing.assert_close(grad(logz)(x), _autograd_grad(logz, x))
    both = vmap(lambda a: NonProjectiveDependencyCRF(a).marginals)(torch.stack([x, x]))
    torch.testing.assert_close(both[1], NonProjectiveDependencyCRF(x).marginals)


def test_func_mean_field_marginals() -> None:
    unary, pairwise = _potentials((2, 4)), _potentials((2, 4, 4), 1)

    def total(u: Tensor) -> Tensor:
        return mean_field_marginals(u, pairwise, iterations=3).sum()

    torch.testing.assert_close(grad(total)(unary), _autograd_grad(total, unary))
    torch.testing.assert_close(hessian(total)(unary), _autograd_hessian(total, unary))
    spins = vmap(lambda u: mean_field_marginals(u, pairwise, iterations=3))(unary[None])
    torch.testing.assert_close(spins[0], mean_field_marginals(unary, pairwise, iterations=3))


# ---- no host reads with validation off (#38.5) ----------------------------------------------
_HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")


@contextlib.contextmanager
def _no_host_reads() -> Iterator[None]:
    """Every way of reading a tensor's values on the host raises (what a CUDA device
    synchronisation is), and CPU tensors take the paths CUDA tensors take."""
    saved = {name: getattr(Tensor, name) for name in _HOST_READS}

    def refuse(name: str) -> Callable[..., object]:
        def read(*_: object, **__: object) -> object:
            raise AssertionError(f"a host read (Tensor.{name}) with validation off")

        return read

    for name in _HOST_READS:
        setattr(Tensor, name, refuse(name))
    try:
        with sync_free():
            yield
    finally:
        for name, method in saved.items():
            setattr(Tensor, name, method)


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_host_reads_with_validation_off(name: str) -> None:
    make, shape = CASES[name]
    x = _potentials(shape).float().requires_grad_(True)
    with _no_host_reads():
        dist = make(x, False)
        loss = dist.log_partition.sum() + (dist.marginals**2).sum()
        loss.backward()
    # the same values as the paths that read the host
    leaf = x.detach().clone().requires_grad_(True)
    dist = make(leaf, True)
    (dist.log_partition.sum() + (dist.marginals**2).sum()).backward()
    assert x.grad is not None and leaf.grad is not None
    torch.testing.assert_close(x.grad, leaf.grad, rtol=1e-4, atol=1e-5)


def test_the_host_read_guard_catches_a_read() -> None:
    """The guard of the test above works: the chain's PyTorch code reads the host on CPU
    outside ``sync_free`` (where reading is no device synchronisation)."""
    saved = Tensor.tolist

    def read(*_: object) -> object:
        raise AssertionError("read")

    try:
        Tensor.tolist = read  # type: ignore[method-assign]
        with kernels_disabled(), pytest.raises(AssertionError, match="read"):
            _ = LinearChainCRF(_potentials((1, 3, 2)), validate_args=False).log_partition
    finally:
        Tensor.tolist = saved  # type: ignore[method-assign]


# ---- meta tensors (#38.4) -------------------------------------------------------------------
def _meta(*shape: int) -> Tensor:
    return torch.empty(*shape, device="meta")


@pytest.mark.parametrize(
    "make",
    [
        lambda: LinearChainCRF(_meta(2, 5, 3), _meta(3, 3), validate_args=False),
        lambda: LinearChainCRF(_meta(2, 5, 3), _meta(2, 4, 3, 3), validate_args=False),
        lambda: DependencyCRF(_meta(2, 5, 5), validate_args=False),
        lambda: NonProjectiveDependencyCRF(_meta(2, 5, 5), validate_args=False),
        lambda: TreeCRF(_meta(2, 5, 5), validate_args=False),
    ],
    ids=["chain-shared", "chain-per-step", "projective", "non-projective", "constituency"],
)
def test_meta_tensors_propagate_shapes(make: Callable[[], StructuredDistribution]) -> None:
    """Shapes without computation (the issue's LinearChainCRF(..., device="meta") failed at
    a ``.tolist()``)."""
    dist = make()
    raw = dist._raw[0]
    assert dist.log_partition.shape == (raw.shape[0],) and dist.log_partition.is_meta
    assert dist.marginals.shape == raw.shape and dist.marginals.is_meta


# ---- export (#38.2) -------------------------------------------------------------------------
class _SelfAttention(torch.nn.Module):
    """A model with one StructuredMultiheadAttention layer, the key padding mask an input."""

    def __init__(self, normalizer: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attention = StructuredMultiheadAttention(8, 2, batch_first=True, normalizer=normalizer)

    def forward(self, x: Tensor, padding: Tensor) -> Tensor:
        return self.attention(x, x, x, key_padding_mask=padding)[0]


def _inputs(lengths: list[int], seed: int) -> tuple[Tensor, Tensor]:
    x = torch.randn(len(lengths), 5, 8, generator=torch.Generator().manual_seed(seed))
    padding = torch.arange(5) >= torch.tensor(lengths).unsqueeze(-1)  # True = padding
    return x, padding


_STRUCTURED = ["projective", "non-projective", "segmentation", "constituency", "semi-markov"]


@pytest.mark.parametrize("normalizer", _STRUCTURED)
def test_jit_trace_and_onnx_refuse_instead_of_a_wrong_model(normalizer: str) -> None:
    model = _SelfAttention(normalizer).eval()
    example = _inputs([5, 3], 0)
    with pytest.raises(RuntimeError, match="cannot be traced by torch.jit.trace"):
        torch.jit.trace(model, example, check_trace=False)
    with pytest.raises(RuntimeError, match="torch.onnx.export"):
        torch.onnx.export(model, example, io.BytesIO(), dynamo=False)
    with pytest.raises(RuntimeError, match="cannot be compiled by torch.jit.script"):
        torch.jit.script(model)


@pytest.mark.parametrize(
    "normalizer",
    ["projective", "non-projective", "segmentation", "mean-field", "constituency", "semi-markov"],
)
def test_torch_export_gives_the_eager_result_on_new_inputs(normalizer: str) -> None:
    """Exported with one padding mask, run with another: the eager result (the mask is an
    input of the graph, not a constant)."""
    model = _SelfAttention(normalizer).eval()
    program = torch.export.export(model, _inputs([5, 3], 0))
    for lengths, seed in (([4, 2], 1), ([5, 5], 2), ([2, 4], 3)):
        x, padding = _inputs(lengths, seed)
        torch.testing.assert_close(program.module()(x, padding), model(x, padding))


# ---- deterministic algorithms, activation checkpointing (README table) ---------------------
@pytest.mark.parametrize("name", ["chain-shared", "projective", "non-projective"])
def test_deterministic_algorithms(name: str) -> None:
    make, shape = CASES[name]
    x = _potentials(shape).float()
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = (make(x, True).marginals for _ in range(2))
    finally:
        torch.use_deterministic_algorithms(before)
    assert torch.equal(first, second)


@pytest.mark.parametrize("normalizer", _STRUCTURED)
def test_activation_checkpointing(normalizer: str) -> None:
    """torch.utils.checkpoint over a structured layer: the gradients of running it plainly."""
    model = _SelfAttention(normalizer)
    x, padding = _inputs([5, 3], 0)
    grads = []
    for checkpointed in (False, True):
        model.zero_grad()
        leaf = x.clone().requires_grad_(True)
        if checkpointed:
            out = torch.utils.checkpoint.checkpoint(model, leaf, padding, use_reentrant=False)
        else:
            out = model(leaf, padding)
        out.square().sum().backward()
        assert leaf.grad is not None
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[0], grads[1])


# ---- torch.compile(fullgraph=True) and the custom operators (#38.4) -------------------------
#: name -> a distribution of float64 potentials with validation off (what compiles whole)
_COMPILED: dict[str, tuple[Make, tuple[int, ...]]] = {
    name: CASES[name]
    for name in (
        "chain-shared",
        "chain-per-step",
        "projective",
        "non-projective",
        "split-tree",
        "constituency",
        "semi-markov",
    )
}
_COMPILED["constituency-labelled"] = (
    lambda x, v: TreeCRF(x, torch.tensor([4, 3]), validate_args=v),
    (2, 4, 4, 3),
)
_HEADS = ["projective", "non-projective", "segmentation", "mean-field"]
_SPAN_HEADS = ["constituency", "semi-markov"]


def _distribution_loss(name: str) -> Callable[[Tensor], Tensor]:
    make = _COMPILED[name][0]

    def loss(x: Tensor) -> Tensor:
        dist = make(x, False)
        return dist.log_partition.sum() + (dist.marginals**2).sum()

    return loss


def _layer_loss(normalizer: str) -> tuple[_SelfAttention, Callable[[Tensor, Tensor], Tensor]]:
    model = _SelfAttention(normalizer)
    return model, lambda x, padding: model(x, padding).square().sum()


def _graph_breaks(fn: Callable[..., Tensor], *args: Tensor) -> list[str]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_count == 1
    return [str(reason.reason) for reason in explained.break_reasons]


@pytest.mark.parametrize("name", sorted(_COMPILED))
def test_compile_fullgraph_distributions_equal_eager(name: str) -> None:
    """log Z and marginals (forward and backward, a loss on the marginals included) of a
    distribution trace as one graph, with the eager values and gradients."""
    loss = _distribution_loss(name)
    x = _potentials(_COMPILED[name][1])
    assert _graph_breaks(loss, x.clone().requires_grad_(True)) == []
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    values = []
    for fn in (loss, compiled):
        leaf = x.clone().requires_grad_(True)
        value = fn(leaf)
        value.backward()
        values.append((value.detach(), leaf.grad))
    torch.testing.assert_close(values[1], values[0])


@pytest.mark.parametrize("normalizer", [*_HEADS, *_SPAN_HEADS])
def test_compile_fullgraph_layers_equal_eager(normalizer: str) -> None:
    model, loss = _layer_loss(normalizer)
    x, padding = _inputs([5, 3], 0)
    assert _graph_breaks(loss, x, padding) == []
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (loss, compiled):
        model.zero_grad()
        leaf = x.clone().requires_grad_(True)
        value = fn(leaf, padding)
        value.backward()
        grads.append([value.detach(), leaf.grad, *(p.grad for p in model.parameters())])
    torch.testing.assert_close(grads[1], grads[0])
    # new padding: the mask is an input of the graph
    x, padding = _inputs([2, 4], 1)
    torch.testing.assert_close(compiled(x, padding), loss(x, padding))


@pytest.mark.parametrize("normalizer", ["projective", "segmentation", *_SPAN_HEADS])
def test_compile_fullgraph_under_autocast_and_inference_mode(normalizer: str) -> None:
    """Under bfloat16 autocast (inference in float32 inside: no graph break) and under
    ``torch.inference_mode``, compiled whole, with the eager result."""
    model, loss = _layer_loss(normalizer)
    x, padding = _inputs([5, 3], 0)

    def autocast_loss(x: Tensor, padding: Tensor) -> Tensor:
        with torch.autocast("cpu", torch.bfloat16):
            return loss(x, padding).float()

    assert _graph_breaks(autocast_loss, x, padding) == []
    compiled = torch.compile(autocast_loss, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, padding), autocast_loss(x, padding))
    with torch.inference_mode():
        compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x, padding), loss(x, padding))


def _span_layer(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "semi-markov-segmentation":
        return SemiMarkovSegmentationAttention(8, max_width=2, validate_args=False)
    return SpanAttention(8, structure=name, validate_args=False)


@pytest.mark.parametrize("name", ["constituency", "semi-markov", "semi-markov-segmentation"])
def test_compile_fullgraph_span_layers_equal_eager(name: str) -> None:
    """SpanAttention (constituency, semi-Markov) and SemiMarkovSegmentationAttention: one
    graph, the eager values and gradients (inputs and parameters), a new mask as input."""
    layer = _span_layer(name)

    def loss(x: Tensor, mask: Tensor) -> Tensor:
        return layer(x, x, mask).context.square().sum()

    x, padding = _inputs([5, 3], 0)
    assert _graph_breaks(loss, x, ~padding) == []
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (loss, compiled):
        layer.zero_grad()
        leaf = x.clone().requires_grad_(True)
        value = fn(leaf, ~padding)
        value.backward()
        grads.append([value.detach(), leaf.grad, *(p.grad for p in layer.parameters())])
    torch.testing.assert_close(grads[1], grads[0])
    x, padding = _inputs([2, 4], 1)
    torch.testing.assert_close(compiled(x, ~padding), loss(x, ~padding))


@pytest.mark.parametrize("normalizer", ["projective", *_SPAN_HEADS])
def test_compile_dynamic_shapes(normalizer: str) -> None:
    """``dynamic=True`` (symbolic shapes through the operators' fake implementations): other
    batch sizes, lengths and padding give the eager result."""
    model, loss = _layer_loss(normalizer)
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager", dynamic=True)
    for lengths, seed in (([5, 3], 0), ([4, 2, 5], 1)):
        x, padding = _inputs(lengths, seed)
        torch.testing.assert_close(compiled(x, padding), loss(x, padding))
    longer = torch.randn(2, 7, 8)
    padding = torch.arange(7) >= torch.tensor([7, 4]).unsqueeze(-1)
    torch.testing.assert_close(compiled(longer, padding), loss(longer, padding))


def test_compile_inductor_layer() -> None:
    """One compile by inductor (the default backend): a projective head, forward and
    backward, equal to eager."""
    model, loss = _layer_loss("projective")
    x, padding = _inputs([5, 3], 0)
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)
    grads = []
    for fn in (loss, compiled):
        model.zero_grad()
        leaf = x.clone().requires_grad_(True)
        value = fn(leaf, padding)
        value.backward()
        grads.append([value.detach(), leaf.grad, *(p.grad for p in model.parameters())])
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)


_TREE_OPS = ("eisner", "matrix_tree")


@pytest.mark.parametrize("name", _TREE_OPS)
def test_custom_ops_opcheck_and_derivatives(name: str) -> None:
    """``torch.library.opcheck`` (schema, fake implementation, registered autograd) of the
    tree operators; gradcheck of log Z and the marginals, gradgradcheck of log Z (the
    marginals operator's backward is the Hessian-vector product)."""
    ops = torch.ops.structattn
    logz, marginals = getattr(ops, f"{name}_log_partition"), getattr(ops, f"{name}_marginals")
    x = _potentials((2, 4, 4))
    x[:, :, 0] = float("-inf")
    x.diagonal(dim1=1, dim2=2).fill_(float("-inf"))
    lengths = torch.tensor([4, 3])
    for op in (logz, marginals):
        torch.library.opcheck(op, (x.clone().requires_grad_(True), lengths, True))
    hvp = getattr(ops, f"{name}_hvp")  # no registered backward: third order is eager only
    torch.library.opcheck(hvp, (x, lengths, True, _potentials((2, 4, 4), 1)))
    leaf = x.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a: logz(a, lengths, True), leaf)
    assert torch.autograd.gradcheck(lambda a: marginals(a, lengths, True), leaf)
    assert torch.autograd.gradgradcheck(lambda a: logz(a, lengths, True), leaf)


@pytest.mark.parametrize("shared", [True, False])
def test_custom_chain_ops(shared: bool) -> None:
    ops = torch.ops.structattn
    unary = _potentials((2, 4, 3))
    pairwise = _potentials((3, 3) if shared else (2, 3, 3, 3), 1)
    lengths = torch.tensor([4, 2])
    leaves = (unary.clone().requires_grad_(True), pairwise.clone().requires_grad_(True))
    torch.library.opcheck(ops.chain_log_partition, (*leaves, lengths, "auto"))
    torch.library.opcheck(ops.chain_marginals, (*leaves, lengths, True, "auto"))
    directions = (_potentials((2, 4, 3), 2), _potentials((2, 3, 3, 3), 3))
    torch.library.opcheck(ops.chain_hvp, (unary, pairwise, lengths, True, "auto", *directions))
    assert torch.autograd.gradcheck(
        lambda u, p: ops.chain_log_partition(u, p, lengths, "auto"), leaves
    )
    assert torch.autograd.gradcheck(
        lambda u, p: ops.chain_marginals(u, p, lengths, True, "auto"), leaves
    )
    assert torch.autograd.gradgradcheck(
        lambda u, p: ops.chain_log_partition(u, p, lengths, "auto"), leaves
    )


def _span_potentials(name: str) -> tuple[Tensor, ...]:
    """Potentials of the span operators: (span scores [2, 4, 4]) or (segment scores
    [2, 4, 3, 2], transitions [2, 2, 2])."""
    if name == "cky":
        return (_potentials((2, 4, 4)),)
    return _potentials((2, 4, 3, 2)), _potentials((2, 2, 2), 1)


@pytest.mark.parametrize("name", ["cky", "semi_markov"])
def test_custom_span_ops(name: str) -> None:
    """``torch.library.opcheck`` of the span operators (CKY, semi-Markov); gradcheck of log
    Z and the marginals, gradgradcheck of log Z (the marginals' backward is the
    Hessian-vector product operator); the operators equal the eager functions."""
    ops = torch.ops.structattn
    logz, marginals = getattr(ops, f"{name}_log_partition"), getattr(ops, f"{name}_marginals")
    hvp = getattr(ops, f"{name}_hvp")
    raw = _span_potentials(name)
    lengths = torch.tensor([4, 3])
    leaves = tuple(t.clone().requires_grad_(True) for t in raw)
    for op in (logz, marginals):
        torch.library.opcheck(op, (*leaves, lengths))
    directions = tuple(_potentials(tuple(t.shape), 5 + i) for i, t in enumerate(raw))
    torch.library.opcheck(hvp, (*raw, lengths, *directions))
    assert torch.autograd.gradcheck(lambda *a: logz(*a, lengths), leaves)
    assert torch.autograd.gradcheck(lambda *a: marginals(*a, lengths), leaves)
    assert torch.autograd.gradgradcheck(lambda *a: logz(*a, lengths), leaves)
    if name == "cky":
        eager = (cky_log_partition(*raw, lengths), cky_marginals(*raw, lengths))
    else:
        eager = (
            semi_markov_log_partition(*raw, lengths),
            semi_markov_marginals(*raw, lengths),
        )
    torch.testing.assert_close((logz(*raw, lengths), marginals(*raw, lengths)), eager)


# ---- the layers' validate_args switch (#38.5) -----------------------------------------------
def _layers(validate: bool) -> dict[str, Callable[[Tensor, Tensor], Tensor]]:
    """name -> (x [B, N, 8], mask [B, N] True = real) -> a loss of the layer's output."""
    torch.manual_seed(0)
    layers: dict[str, Callable[[Tensor, Tensor], Tensor]] = {}
    for normalizer in (*_HEADS, *_SPAN_HEADS):
        mha = StructuredMultiheadAttention(
            8, 2, batch_first=True, normalizer=normalizer, validate_args=validate
        )
        layers[f"multihead-{normalizer}"] = lambda x, m, a=mha: (
            a(x, x, x, key_padding_mask=~m)[0].square().sum()
        )
    one = {
        "segmentation": SegmentationAttention(8, validate_args=validate),
        "semi-markov-segmentation": SemiMarkovSegmentationAttention(
            8, max_width=2, validate_args=validate
        ),
        "span-constituency": SpanAttention(8, structure="constituency", validate_args=validate),
        "mean-field": MeanFieldAttention(8, iterations=2, validate_args=validate),
    }
    for name, layer in one.items():
        layers[name] = lambda x, m, a=layer: a(x, x, m).context.square().sum()
    self_attention = SpanSelfAttention(8, hidden_dim=4, validate_args=validate)
    layers["span-self"] = lambda x, m: self_attention(x, m).context.square().sum()
    return layers


_LAYER_NAMES = sorted(_layers(True))


@pytest.mark.parametrize("name", _LAYER_NAMES)
def test_layers_without_validation_read_no_host_value(name: str) -> None:
    """With ``validate_args=False`` a layer's forward and backward read no tensor value on
    the host (the paths CUDA tensors take); with the default it checks its mask (a read)
    and gives the same values."""
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    mask = torch.arange(5) < torch.tensor([5, 3]).unsqueeze(-1)
    checked, unchecked = _layers(True)[name], _layers(False)[name]
    leaf = x.clone().requires_grad_(True)
    with _no_host_reads():
        loss = unchecked(leaf, mask)
        loss.backward()
    expected = x.clone().requires_grad_(True)
    reference = checked(expected, mask)
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(leaf.grad, expected.grad, rtol=1e-4, atol=1e-5)
    if name != "mean-field":  # any mask pattern is valid there: nothing to check
        with _no_host_reads(), pytest.raises(AssertionError, match="a host read"):
            checked(x, mask)
