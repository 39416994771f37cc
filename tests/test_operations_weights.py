"""Temperature, SparseMAP and the layers' ``weights`` option (#41 item 7), against brute-force
enumeration in float64.

The structures and their enumerators are those of ``test_operations.py`` (chains, projective
and non-projective trees, constituency trees, semi-Markov segmentations, split trees), plus
the second-order trees of ``test_trees_ops.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import test_operations as suite
import test_trees_ops as tree_ops
import torch
import torch.autograd.forward_ad as fwAD
from oracles import trees
from torch import Tensor

from structattn import (
    DependencyCRF,
    LinearChainCRF,
    NonProjectiveDependencyCRF,
    SegmentationAttention,
    SemiMarkovCRF,
    StructuredMultiheadAttention,
    SyntacticAttention,
    TreeCRF,
)
from structattn.attention import (
    MemoryCRFAttention,
    SemiMarkovSegmentationAttention,
    SpanAttention,
    SpanSelfAttention,
)
from structattn.attention._weights import structured_weights
from structattn.attention.normalizers import (
    segmentation_weights,
    self_attention_tree_weights,
    tree_distribution,
    tree_marginals,
)
from structattn.attention.spans import span_marginals
from structattn.distributions import SecondOrderDependencyCRF
from structattn.distributions.base import StructuredDistribution
from structattn.distributions.dependency import TreeCRFBase
from structattn.distributions.sparsemap import sparsemap
from structattn.structs._extension import kernels, kernels_disabled

Op = suite.Op
Params = suite.Params


# ---- second-order trees as one more Op -----------------------------------------------------
def _second_order_draw(b: int, n: int, dtype: torch.dtype, scale: float) -> Params:
    return (
        torch.randn(b, n, n, dtype=dtype) * scale,
        torch.randn(b, n, n, n, dtype=dtype) * scale,
    )


def _second_order_support(item: Params, length: int) -> suite.Support:
    arcs, sibs = item
    out = []
    for heads in trees(length - 1, True, True):
        arc_ind = torch.zeros_like(arcs)
        sib_ind = torch.zeros_like(sibs)
        for m, h in enumerate(heads, 1):
            arc_ind[h, m] = 1
        for triple in tree_ops.sibling_triples(heads):
            sib_ind[triple] = 1
        out.append(((arc_ind, sib_ind), tree_ops.second_order_score(arcs, sibs, heads)))
    return out


SECOND_ORDER = Op(
    "second-order",
    _second_order_draw,
    lambda p, lengths: SecondOrderDependencyCRF(p[0], p[1], lengths),
    _second_order_support,
    5,
    2,
)


# ---- labelled dependency trees ([B, N, N, L] arc scores) as Ops (SparseMAP's parts) --------
LABELS = 2


def _labelled_op(cls: type[TreeCRFBase], multiroot: bool) -> Op:
    projective = cls is DependencyCRF

    def draw(b: int, n: int, dtype: torch.dtype, scale: float) -> Params:
        return (torch.randn(b, n, n, LABELS, dtype=dtype) * scale,)

    def support(item: Params, length: int) -> suite.Support:
        (scores,) = item  # [N, N, L]
        out = []
        for heads in trees(length - 1, projective, multiroot):
            for labels in itertools.product(range(LABELS), repeat=len(heads)):
                ind = torch.zeros_like(scores)
                arcs = list(zip(range(1, length), heads, labels, strict=True))
                for m, h, lab in arcs:
                    ind[h, m, lab] = 1
                out.append(((ind,), sum(scores[h, m, lab] for m, h, lab in arcs)))
        return out

    name = f"labelled-{'' if projective else 'non-'}projective-{'multi' if multiroot else 'single'}"
    return Op(name, draw, lambda p, lengths: cls(p[0], lengths, multiroot), support, 4, 2)


LABELLED = [
    _labelled_op(cls, multiroot)
    for cls in (DependencyCRF, NonProjectiveDependencyCRF)
    for multiroot in (True, False)
]
OPS = [*suite.OPS, SECOND_ORDER]
TEMPERED = [op for op in OPS if op.name != "split-tree"]  # no tempered form
SPARSEMAP_OPS = [*OPS, *LABELLED]  # SparseMAP: the labelled trees' labelled arcs too


@pytest.fixture(params=SPARSEMAP_OPS, ids=[op.name for op in SPARSEMAP_OPS])
def op(request: pytest.FixtureRequest) -> Op:
    return request.param


def _build_at(op: Op, params: Params, lengths: Tensor | None, t: float) -> StructuredDistribution:
    """``op``'s distribution built with the constructor's ``temperature=t``."""
    dist = op.build(params, lengths)
    if isinstance(dist, SecondOrderDependencyCRF):
        return SecondOrderDependencyCRF(params[0], params[1], lengths, temperature=t)
    if isinstance(dist, TreeCRFBase):
        return type(dist)(params[0], lengths, dist.multiroot, temperature=t)
    if isinstance(dist, LinearChainCRF):
        return LinearChainCRF(params[0], params[1], lengths, temperature=t)
    if isinstance(dist, TreeCRF):
        return TreeCRF(params[0], lengths, temperature=t)
    assert isinstance(dist, SemiMarkovCRF)
    return SemiMarkovCRF(params[0], params[1], lengths, temperature=t)


# ---- #41.7: log_partition / marginals under a temperature --------------------------------------
@pytest.mark.parametrize("op", TEMPERED, ids=[op.name for op in TEMPERED])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 4.0])
def test_temperature_argument_against_brute_force(op: Op, temperature: float) -> None:
    params, lengths = suite._draw(op), suite._lengths(op)
    hot = _build_at(op, params, lengths, temperature)
    assert hot.temperature == temperature
    marginals = hot._marginals_tuple
    smooth = temperature * hot.log_partition  # the entropy-smoothed max
    for b, length in enumerate(lengths.tolist()):
        support = op.support(suite._item(params, b), length)
        scores = torch.stack([s for _, s in support]) / temperature
        torch.testing.assert_close(hot.log_partition[b], scores.logsumexp(0))
        torch.testing.assert_close(smooth[b], temperature * scores.logsumexp(0))
        probs = (scores - scores.logsumexp(0)).exp()
        for i, got in enumerate(marginals):
            want = sum(p * ind[i] for p, (ind, _) in zip(probs, support, strict=True))
            torch.testing.assert_close(got[b], want)
    # the same distribution as tempered(t); smoothed_max(t) = t log Z(s / t)
    plain = op.build(params, lengths)
    torch.testing.assert_close(hot.log_partition, plain.tempered(temperature).log_partition)
    torch.testing.assert_close(smooth, plain.smoothed_max(temperature))
    # differentiable: the gradient of t log Z(s / t) is the tempered marginals
    grads = torch.autograd.grad(smooth.sum(), params)
    want_grads = torch.autograd.grad(plain.smoothed_max(temperature).sum(), params)
    for got, want_grad in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want_grad)


@pytest.mark.parametrize("op", TEMPERED, ids=[op.name for op in TEMPERED])
def test_temperature_one_is_bit_for_bit_plain(op: Op) -> None:
    params, lengths = tuple(p.detach() for p in suite._draw(op, torch.float32)), None
    plain, one = op.build(params, lengths), _build_at(op, params, lengths, 1.0)
    assert torch.equal(plain.log_partition, one.log_partition)
    for got, want in zip(one._marginals_tuple, plain._marginals_tuple, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(plain.argmax, one.argmax)


@pytest.mark.parametrize("op", TEMPERED, ids=[op.name for op in TEMPERED])
def test_temperature_to_zero_gives_the_map_indicators(op: Op) -> None:
    params, lengths = tuple(p.detach() for p in suite._draw(op)), suite._lengths(op)
    cold = _build_at(op, params, lengths, 1e-3)
    plain = op.build(params, lengths)
    torch.testing.assert_close(1e-3 * cold.log_partition, plain.max_score, atol=1e-2, rtol=0)
    assert torch.equal(cold.argmax, plain.argmax)
    for b, length in enumerate(lengths.tolist()):
        scores = torch.stack([s for _, s in op.support(suite._item(params, b), length)])
        top2 = scores.topk(min(2, scores.numel())).values
        if top2.numel() == 2 and top2[0] - top2[1] < 0.05:  # a near tie: no clear limit yet
            continue
        hard = plain._indicators(plain.argmax)[b].to(scores.dtype)
        torch.testing.assert_close(cold.marginals[b], hard, atol=1e-6, rtol=0)  # type: ignore[attr-defined]


@pytest.mark.parametrize("cls", [DependencyCRF, NonProjectiveDependencyCRF])
def test_temperature_of_labelled_trees_divides_the_label_scores(
    cls: type[TreeCRFBase],
) -> None:
    scores = torch.randn(2, 4, 4, 3, dtype=torch.float64)
    want = cls(scores / 0.4, torch.tensor([4, 3]))
    for hot in (
        cls(scores, torch.tensor([4, 3]), temperature=0.4),
        cls(scores, torch.tensor([4, 3])).tempered(0.4),
    ):
        torch.testing.assert_close(hot.log_partition, want.log_partition)
        torch.testing.assert_close(hot.marginals, want.marginals)  # type: ignore[attr-defined]
        torch.testing.assert_close(hot.entropy, want.entropy)
        assert hot.temperature == pytest.approx(0.4)


def test_temperature_argument_errors() -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan"), "1", True):
        with pytest.raises(ValueError, match="`temperature`"):
            LinearChainCRF(torch.randn(2, 4, 3), temperature=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="`temperature`"):
            DependencyCRF(torch.randn(2, 4, 4), temperature=bad)  # type: ignore[arg-type]
    # tempered twice multiplies the temperatures
    twice = TreeCRF(torch.randn(1, 3, 3), temperature=2.0).tempered(3.0)
    assert twice.temperature == 6.0


# ---- #41.7: SparseMAP ----------------------------------------------------------------------------
def _structure_parts(
    op: Op, support: suite.Support, item: Params, length: int
) -> tuple[Tensor, ...]:
    """(first [K, P1]: the first part's indicators of every structure (the ``marginals``
    part; it determines the structure), full [K, P]: the indicators of all its parts, as
    ``sparsemap`` sees them, c [K]: its score), structures of score -inf left out."""
    kept = [(ind, s) for ind, s in support if torch.isfinite(s)]
    first = torch.stack([ind[0].flatten() for ind, _ in kept])
    if op.name == "split-tree":  # parts (nodes, pivots): every position is a pivot once
        pivots = (torch.arange(item[0].shape[-1]) < length).to(first.dtype).expand(len(kept), -1)
        full = torch.cat([first, pivots], -1)
    else:
        full = torch.stack([torch.cat([i.flatten() for i in ind]) for ind, _ in kept])
    return first, full, torch.stack([s for _, s in kept]).detach()


def _brute_force_qp(u: Tensor, c: Tensor, steps: int = 4000) -> Tensor:
    """max_a c.a - |U^T a|^2 / 2 over the simplex (the SparseMAP problem over the enumerated
    structures' part indicators U [K, P] and scores c = U theta), by accelerated projected
    gradient in float64, then the KKT system solved exactly on the support it found;
    returns mu = U^T a."""
    k = u.shape[0]
    lipschitz = float(torch.linalg.matrix_norm(u, 2)) ** 2 + 1e-12
    a = torch.full((k,), 1.0 / k, dtype=u.dtype)
    y, t = a.clone(), 1.0
    for _ in range(steps):
        grad = c - u @ (u.T @ y)
        new = _simplex(y + grad / lipschitz)
        t_new = (1 + (1 + 4 * t * t) ** 0.5) / 2
        y = new + (t - 1) / t_new * (new - a)
        a, t = new, t_new
    support = a > 1e-6
    us, cs = u[support], c[support]
    size = int(support.sum())
    kkt = torch.zeros(size + 1, size + 1, dtype=u.dtype)
    kkt[:size, :size] = us @ us.T
    kkt[:size, size] = kkt[size, :size] = 1
    rhs = torch.cat([cs, torch.ones(1, dtype=u.dtype)])
    weights = (torch.linalg.pinv(kkt) @ rhs)[:size]
    return us.T @ weights


def _simplex(v: Tensor) -> Tensor:
    """Euclidean projection onto the probability simplex (sort-based)."""
    s, _ = v.sort(descending=True)
    cumulative = s.cumsum(0) - 1
    index = torch.arange(1, len(v) + 1, dtype=v.dtype)
    rho = int((s - cumulative / index > 0).nonzero().max())
    return (v - cumulative[rho] / (rho + 1)).clamp_min(0)


@pytest.mark.parametrize("scale", [0.1, 1.0, 3.0])
def test_sparsemap_against_brute_force_qp(op: Op, scale: float) -> None:
    params, lengths = suite._draw(op, scale=scale), suite._lengths(op)
    dist = op.build(params, lengths)
    result = dist.sparsemap(tol=1e-12)
    assert result.marginals.shape == dist.marginals.shape  # type: ignore[attr-defined]
    assert result.converged.all()
    for b, length in enumerate(lengths.tolist()):
        item = suite._item(params, b)
        first, full, c = _structure_parts(op, op.support(item, length), item, length)
        mu = torch.cat([p[b].detach().flatten() for p in result.parts])
        # a convex combination of valid structures
        weights = result.weights[b]
        assert (weights >= 0).all()
        torch.testing.assert_close(weights.sum(), weights.new_tensor(1.0))
        active = result.structures[b][weights > 0].flatten(1)
        match = (active.unsqueeze(1) == first.unsqueeze(0)).all(-1)  # [S', K]
        assert match.any(1).all(), "an active structure is not a valid structure"
        torch.testing.assert_close(weights[weights > 0] @ active, result.marginals[b].flatten())
        torch.testing.assert_close(weights[weights > 0] @ full[match.float().argmax(1)], mu)
        # optimality certificate over every structure: <m_z, theta - mu> = c_z - <m_z, mu>
        # is maximal on the active ones (the KKT conditions of the projection)
        value = c - full @ mu
        on_support = value[match.float().argmax(1)]
        assert float(value.max() - on_support.min()) <= 1e-9
        # the brute-force QP gives the same marginals
        torch.testing.assert_close(mu, _brute_force_qp(full, c), atol=1e-7, rtol=0)


def test_sparsemap_gradient_by_finite_differences(op: Op) -> None:
    torch.manual_seed(3)
    params = tuple(p.detach().requires_grad_() for p in op.draw(2, op.n - 1, torch.float64, 1.0))
    lengths = torch.tensor([op.n - 1, max(op.min_len, op.n - 2)])

    def project(*p: Tensor) -> tuple[Tensor, ...]:
        return op.build(p, lengths).sparsemap(tol=1e-13).parts

    assert torch.autograd.gradcheck(project, params, eps=1e-6, atol=1e-6)


FORWARD_MODE = [op for op in SPARSEMAP_OPS if op.name != "split-tree"]  # no gradient there


@pytest.mark.parametrize("op", FORWARD_MODE, ids=[op.name for op in FORWARD_MODE])
def test_sparsemap_forward_mode_and_second_derivative(op: Op) -> None:
    """The jvp of SparseMAP (torch.func.jvp, torch.autograd.forward_ad, jacfwd) is the
    closed-form Jacobian: equal to central finite differences, to jacrev and (J symmetric in
    the part scores) to the vjp; the second derivative (double backward, gradgradcheck) is 0
    in the scores and J in the incoming gradient."""
    torch.manual_seed(5)
    params = tuple(p.detach() for p in op.draw(2, op.n - 1, torch.float64, 1.0))
    lengths = torch.tensor([op.n - 1, max(op.min_len, op.n - 2)])
    tangents = tuple(torch.randn_like(p) for p in params)

    def project(*p: Tensor) -> Tensor:
        return torch.cat([x.flatten(1) for x in op.build(p, lengths).sparsemap(tol=1e-13).parts], 1)

    eps = 1e-6
    plus = project(*(p + eps * t for p, t in zip(params, tangents, strict=True)))
    minus = project(*(p - eps * t for p, t in zip(params, tangents, strict=True)))
    finite = (plus - minus) / (2 * eps)
    _, by_func = torch.func.jvp(project, params, tangents)
    torch.testing.assert_close(by_func, finite, atol=1e-6, rtol=0)
    with fwAD.dual_level():
        dual = project(*(fwAD.make_dual(p, t) for p, t in zip(params, tangents, strict=True)))
        by_dual = fwAD.unpack_dual(dual).tangent
    assert by_dual is not None
    torch.testing.assert_close(by_dual, by_func)
    forward = torch.func.jacfwd(project, argnums=0)(*params)
    torch.testing.assert_close(forward, torch.func.jacrev(project, argnums=0)(*params))
    leaves = tuple(p.clone().requires_grad_() for p in params)
    assert torch.autograd.gradgradcheck(project, leaves, eps=1e-6, atol=1e-6)
    # the second derivative in the scores is 0 (piecewise linear), in the seed J
    out = project(*leaves)
    seed = torch.randn_like(out, requires_grad=True)
    grads = torch.autograd.grad(out, leaves, seed, create_graph=True)
    probe = [torch.randn_like(g) for g in grads]
    total = sum((g * q).sum() for g, q in zip(grads, probe, strict=True))
    second = torch.autograd.grad(total, [*leaves, seed], allow_unused=True)
    assert all(g is None or (g == 0).all() for g in second[:-1])
    assert second[-1] is not None and second[-1].abs().sum() > 0


WARM = [op for op in SPARSEMAP_OPS if op.name != "split-tree"]


@pytest.mark.parametrize("op", WARM, ids=[op.name for op in WARM])
def test_sparsemap_warm_start(op: Op) -> None:
    """``init=`` an earlier result: from its own result no iteration and the same solution;
    from the result of nearby scores the solution of a cold start (optimal), in fewer or
    as many iterations."""
    torch.manual_seed(11)
    params = tuple(p.detach() for p in op.draw(3, op.n, torch.float64, 1.0))
    lengths = suite._lengths(op)
    cold = op.build(params, lengths).sparsemap(tol=1e-12)
    again = op.build(params, lengths).sparsemap(tol=1e-12, init=cold)
    assert again.iterations == 0 and again.converged.all()
    torch.testing.assert_close(again.marginals, cold.marginals)
    moved = tuple(p + 0.1 * torch.randn_like(p) for p in params)
    want = op.build(moved, lengths).sparsemap(tol=1e-12)
    got = op.build(moved, lengths).sparsemap(tol=1e-12, init=cold)
    assert got.converged.all()
    for a, b in zip(got.parts, want.parts, strict=True):
        torch.testing.assert_close(a, b)
    assert got.iterations <= want.iterations


def test_sparsemap_warm_start_skips_forbidden_structures_and_checks_init() -> None:
    arcs = torch.randn(2, 7, 7, dtype=torch.float64)
    cold = DependencyCRF(arcs).sparsemap()
    # forbid an arc that the earlier support uses: those structures do not come back
    used = (cold.structures[0] * (cold.weights[0] > 0).view(-1, 1, 1)).sum(0)
    h, m = divmod(int(used.flatten().argmax()), 7)
    blocked = arcs.clone()
    blocked[:, h, m] = float("-inf")
    got = DependencyCRF(blocked).sparsemap(init=cold)
    want = DependencyCRF(blocked).sparsemap()
    torch.testing.assert_close(got.marginals, want.marginals)
    assert (got.marginals[:, h, m] == 0).all()
    with pytest.raises(ValueError, match="`init`"):
        DependencyCRF(arcs).sparsemap(init=cold.marginals)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`init`"):
        DependencyCRF(torch.randn(2, 6, 6)).sparsemap(init=cold)


def test_sparsemap_under_vmap_is_refused() -> None:
    scores = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="vmap"):
        torch.func.vmap(lambda s: DependencyCRF(s).sparsemap().marginals)(scores)


def test_sparsemap_is_sparse_and_sums_as_marginals(op: Op) -> None:
    params, lengths = tuple(p.detach() for p in suite._draw(op)), suite._lengths(op)
    dist = op.build(params, lengths)
    dense = dist.marginals  # type: ignore[attr-defined]
    result = dist.sparsemap()
    # the same linear constraints as the marginals (each holds for every structure): the
    # number of parts, or for segmentations the number of positions covered
    if op.name == "semi-markov":
        widths = torch.arange(1, dense.shape[2] + 1, dtype=dense.dtype).view(1, 1, -1, 1)
        dense, sparse = dense * widths, result.marginals * widths
    else:
        sparse = result.marginals
    torch.testing.assert_close(sparse.flatten(1).sum(-1), dense.flatten(1).sum(-1))
    # few structures: at most the dimension of the first part plus one (affinely
    # independent), far fewer than the support
    active = (result.weights > 0).sum(-1)
    assert (active >= 1).all() and (active <= dense[0].numel() + 1).all()
    assert (result.marginals == 0).sum() > (dense == 0).sum()
    # large scores: SparseMAP is the MAP structure
    sharp = op.build(tuple(p * 100 for p in params), lengths)
    hard = sharp._indicators(sharp.argmax).to(dense.dtype)
    torch.testing.assert_close(sharp.sparsemap().marginals, hard)


def test_sparsemap_float32_and_no_structure() -> None:
    arcs = torch.randn(3, 6, 6) * 1e4
    arcs[1] = float("-inf")  # no tree at all
    arcs.requires_grad_()
    for cls in (DependencyCRF, NonProjectiveDependencyCRF):
        result = cls(arcs, torch.tensor([6, 6, 4])).sparsemap()
        assert torch.isfinite(result.marginals).all()
        assert (result.marginals[1] == 0).all() and (result.weights[1] == 0).all()
        (grad,) = torch.autograd.grad((result.marginals * torch.randn(3, 6, 6)).sum(), arcs)
        assert torch.isfinite(grad).all()


def test_sparsemap_with_and_without_kernels() -> None:
    arcs = torch.randn(4, 9, 9, dtype=torch.float64)
    arcs[2, :, 3] = float("-inf")  # no tree
    if kernels(arcs) is None:
        pytest.skip("the C++ kernels are not built (STRUCTATTN_EXTENSION=0)")
    lengths = torch.tensor([9, 6, 9, 2])
    for multiroot in (True, False):
        fast = DependencyCRF(arcs, lengths, multiroot).sparsemap(tol=1e-12)
        with kernels_disabled():
            slow = DependencyCRF(arcs, lengths, multiroot).sparsemap(tol=1e-12)
        torch.testing.assert_close(fast.marginals, slow.marginals)


def test_sparsemap_bounded_iterations_and_errors() -> None:
    dist = DependencyCRF(torch.randn(4, 8, 8, dtype=torch.float64))
    once = sparsemap(dist, max_iter=1)
    assert once.iterations <= 1
    torch.testing.assert_close(once.weights.sum(-1), torch.ones(4, dtype=torch.float64))
    assert sparsemap(dist, max_iter=0).iterations == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="`max_iter`"):
            sparsemap(dist, max_iter=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`tol`"):
        sparsemap(dist, tol=-1.0)


# ---- #41.7: the layers' weights="marginals" | "sparse" | "hard-st" ------------------------------
def _tree_function(kind: str, mode: str, scores: Tensor, root: Tensor) -> Tensor:
    lengths = torch.tensor([5, 3])
    w, share = self_attention_tree_weights(scores, root, lengths, kind, mode)  # type: ignore[arg-type]
    return torch.cat([w, share.unsqueeze(-1)], -1)  # [B, L, L + 1]


FUNCTIONS = {
    "segmentation": lambda mode, s: segmentation_weights(
        s, torch.tensor([[5, 5, 5], [3, 3, 3]]), torch.randn(2, 2, generator=_gen(1)), mode
    ),
    "projective": lambda mode, s: _tree_function("projective", mode, s[:, 0].mT, s[:, 1, 0]),
    "non-projective": lambda mode, s: _tree_function("non-projective", mode, s[:, 0], s[:, 2, 1]),
    "constituency": lambda mode, s: span_marginals(
        s, torch.tensor([5, 3, 4]), "constituency", None, mode
    ),
    "semi-markov": lambda mode, s: span_marginals(
        s, torch.tensor([5, 3, 4]), "semi-markov", 3, mode
    ),
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _scores(name: str) -> Tensor:
    shape = (2, 3, 5) if name == "segmentation" else (2, 3, 5, 5)
    if name in ("constituency", "semi-markov"):
        shape = (3, 5, 5)
    return torch.randn(shape, dtype=torch.float64, generator=_gen(0)).requires_grad_()


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_hard_st_is_the_argmax_forward_and_the_marginals_gradient(name: str) -> None:
    scores = _scores(name)
    soft = FUNCTIONS[name]("marginals", scores)
    hard = FUNCTIONS[name]("hard-st", scores)
    assert ((hard == 0) | (hard == 1)).all()
    assert not torch.equal(hard, soft)
    probe = torch.randn(soft.shape, dtype=soft.dtype, generator=_gen(2))
    (want,) = torch.autograd.grad((soft * probe).sum(), scores)
    (got,) = torch.autograd.grad((hard * probe).sum(), scores)
    torch.testing.assert_close(got, want)


def test_hard_st_weights_are_the_argmax_structures() -> None:
    arcs = torch.randn(2, 6, 6, dtype=torch.float64)
    lengths = torch.tensor([6, 4])
    for kind in ("projective", "non-projective"):
        hard = tree_marginals(arcs, lengths, kind, weights="hard-st")  # type: ignore[arg-type]
        dist = tree_distribution(arcs, lengths, kind)  # type: ignore[arg-type]
        assert torch.equal(hard, dist._indicators(dist.argmax).to(hard.dtype))
    spans = torch.randn(2, 5, 5, dtype=torch.float64)
    hard = span_marginals(spans, torch.tensor([5, 3]), "constituency", weights="hard-st")
    assert torch.equal(hard, TreeCRF(spans, torch.tensor([5, 3])).argmax.to(hard.dtype))


LABELLED_DISTRIBUTIONS = {
    "labelled-projective": lambda s, lengths: DependencyCRF(s, lengths),
    "labelled-non-projective": lambda s, lengths: NonProjectiveDependencyCRF(s, lengths, False),
    "labelled-constituency": lambda s, lengths: TreeCRF(s[:, 1:, 1:], lengths - 1),
}


@pytest.mark.parametrize("name", list(LABELLED_DISTRIBUTIONS))
def test_weights_options_on_labelled_structures(name: str) -> None:
    """weights="hard-st" and "sparse" on labelled trees: the labelled MAP structure's 0/1
    indicators forward and the labelled marginals' gradient backward; SparseMAP's labelled
    marginals a convex combination of labelled MAP structures; the marginals' shape."""
    scores = torch.randn(2, 6, 6, 3, dtype=torch.float64, generator=_gen(4)).requires_grad_()
    lengths = torch.tensor([6, 4])
    dist = LABELLED_DISTRIBUTIONS[name](scores, lengths)
    soft = structured_weights(dist, "marginals")
    hard = structured_weights(dist, "hard-st")
    sparse = structured_weights(dist, "sparse")
    assert soft.shape == hard.shape == sparse.shape == dist.marginals.shape  # type: ignore[attr-defined]
    assert torch.equal(hard, dist._indicators(dist.argmax).to(hard.dtype))
    assert ((hard == 0) | (hard == 1)).all() and not torch.equal(hard, soft)
    # one label per arc (span) of the MAP structure, the same count as the marginals
    torch.testing.assert_close(hard.flatten(1).sum(-1), soft.flatten(1).sum(-1))
    torch.testing.assert_close(sparse.flatten(1).sum(-1), soft.flatten(1).sum(-1))
    assert (sparse == 0).sum() > (soft == 0).sum()
    probe = torch.randn(soft.shape, dtype=soft.dtype, generator=_gen(2))
    (want,) = torch.autograd.grad((soft * probe).sum(), scores, retain_graph=True)
    (got,) = torch.autograd.grad((hard * probe).sum(), scores, retain_graph=True)
    torch.testing.assert_close(got, want)
    (grad,) = torch.autograd.grad((sparse * probe).sum(), scores)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("cls", [DependencyCRF, NonProjectiveDependencyCRF])
def test_rsample_of_labelled_trees_perturbs_the_labels(cls: type[TreeCRFBase]) -> None:
    """Perturb-and-MAP on labelled trees: labelled 0/1 indicators, one label per word, and
    the noise reaches the labels (with tied label scores both labels are drawn)."""
    scores = torch.zeros(1, 4, 4, 2, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(0)
    draws = cls(scores).rsample(40)
    assert draws.shape == (40, 1, 4, 4, 2)
    torch.testing.assert_close(draws.sum((2, 3, 4)), torch.full((40, 1), 3.0, dtype=draws.dtype))
    per_label = draws.detach().sum((0, 1, 2, 3))
    assert (per_label > 0).all()
    (grad,) = torch.autograd.grad(draws.sum(), scores)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_sparse_weights_are_sparse_and_sum_as_marginals(name: str) -> None:
    scores = _scores(name)
    soft = FUNCTIONS[name]("marginals", scores)
    sparse = FUNCTIONS[name]("sparse", scores)
    assert (sparse >= -1e-12).all() and (sparse <= 1 + 1e-12).all()
    assert (sparse == 0).sum() > (soft == 0).sum()
    if name in ("projective", "non-projective"):  # every word: one head (ROOT's share last)
        torch.testing.assert_close(sparse.sum(-1), soft.sum(-1))
    elif name == "constituency":  # 2n - 1 spans
        torch.testing.assert_close(sparse.sum((-1, -2)), soft.sum((-1, -2)))
    elif name == "semi-markov":  # the segments cover every position once
        width = torch.arange(1, 6, dtype=soft.dtype)
        span_width = (width.view(1, -1) - width.view(-1, 1) + 1).clamp_min(0)
        torch.testing.assert_close(
            (sparse * span_width).sum((-1, -2)), (soft * span_width).sum((-1, -2))
        )
    probe = torch.randn(soft.shape, dtype=soft.dtype, generator=_gen(2))
    (grad,) = torch.autograd.grad((sparse * probe).sum(), scores)
    assert torch.isfinite(grad).all()


def _layers(mode: str) -> dict[str, tuple[torch.nn.Module, Callable[[torch.nn.Module], Tensor]]]:
    """name -> (layer, one call returning what a loss reads), tiny sizes."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    q = torch.randn(2, 3, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).bool()
    heads = ["segmentation", "projective", "non-projective", "constituency", "semi-markov"]
    return {
        "multihead": (
            StructuredMultiheadAttention(
                10,
                5,
                batch_first=True,
                normalizer=heads,
                max_segment_width=2,
                weights=mode,  # type: ignore[arg-type]
            ),
            lambda m: m(
                torch.randn(2, 5, 10, generator=_gen(3)),
                *[torch.randn(2, 5, 10, generator=_gen(3))] * 2,
                average_attn_weights=False,
            )[0],
        ),
        "segmentation": (
            SegmentationAttention(8, weights=mode),  # type: ignore[arg-type]
            lambda m: m(q, x, mask).context,
        ),
        "syntactic": (
            SyntacticAttention(8, hidden_dim=4, weights=mode),  # type: ignore[arg-type]
            lambda m: m(x, mask).parents,
        ),
        "syntactic-nonprojective": (
            SyntacticAttention(8, hidden_dim=4, structure="non-projective", weights=mode),  # type: ignore[arg-type]
            lambda m: m(x, mask).parents,
        ),
        "span": (SpanAttention(8, weights=mode), lambda m: m(q, x, mask).context),  # type: ignore[arg-type]
        "span-self": (
            SpanSelfAttention(8, hidden_dim=4, structure="semi-markov", weights=mode),  # type: ignore[arg-type]
            lambda m: m(x, mask).context,
        ),
        "semi-markov-segmentation": (
            SemiMarkovSegmentationAttention(8, max_width=2, weights=mode),  # type: ignore[arg-type]
            lambda m: m(q, x, mask).context,
        ),
        "memory-crf": (
            MemoryCRFAttention(8, steps=3, weights=mode),  # type: ignore[arg-type]
            lambda m: m(q[:, 0], x, x.flip(1), mask).context,
        ),
    }


LAYER_NAMES = list(_layers("marginals"))


@pytest.mark.parametrize("name", LAYER_NAMES)
def test_default_weights_are_the_marginals_bit_for_bit(name: str) -> None:
    layer, call = _layers("marginals")[name]
    default = type(layer)(**_init_args(layer))
    default.load_state_dict(layer.state_dict())
    torch.manual_seed(5)
    want = call(default)
    torch.manual_seed(5)
    got = call(layer)
    assert torch.equal(got, want)


def _init_args(layer: torch.nn.Module) -> dict[str, object]:
    """The constructor arguments of one of ``_layers``' layers, without ``weights``."""
    return {
        StructuredMultiheadAttention: lambda: {
            "embed_dim": 10,
            "num_heads": 5,
            "batch_first": True,
            "normalizer": [
                "segmentation",
                "projective",
                "non-projective",
                "constituency",
                "semi-markov",
            ],
            "max_segment_width": 2,
        },
        SegmentationAttention: lambda: {"memory_dim": 8},
        SyntacticAttention: lambda: {
            "input_dim": 8,
            "hidden_dim": 4,
            "structure": layer.structure,  # type: ignore[attr-defined]
        },
        SpanAttention: lambda: {"memory_dim": 8},
        SpanSelfAttention: lambda: {"input_dim": 8, "hidden_dim": 4, "structure": "semi-markov"},
        SemiMarkovSegmentationAttention: lambda: {"memory_dim": 8, "max_width": 2},
        MemoryCRFAttention: lambda: {"embed_dim": 8, "steps": 3},
    }[type(layer)]()


@pytest.mark.parametrize("mode", ["marginals", "sparse", "hard-st"])
@pytest.mark.parametrize("name", LAYER_NAMES)
def test_a_training_step_runs_with_each_weights_option(name: str, mode: str) -> None:
    layer, call = _layers(mode)[name]
    assert layer.weights_mode == mode
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    before = [p.detach().clone() for p in layer.parameters()]
    loss = call(layer).pow(2).mean()
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in layer.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    optimizer.step()
    assert any(not torch.equal(p, b) for p, b in zip(layer.parameters(), before, strict=True))


def test_weights_option_errors() -> None:
    with pytest.raises(ValueError, match="`weights`"):
        SegmentationAttention(8, weights="hard")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`weights`"):
        StructuredMultiheadAttention(8, 2, weights="sparsemax")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a tree structure"):
        SyntacticAttention(8, structure="softmax", weights="sparse")


def test_memory_crf_weights_options() -> None:
    torch.manual_seed(0)
    query, facts = torch.randn(2, 8), torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).bool()
    soft = MemoryCRFAttention(8, steps=3)
    hard = MemoryCRFAttention(8, steps=3, weights="hard-st")
    sparse = MemoryCRFAttention(8, steps=3, weights="sparse")
    hard.load_state_dict(soft.state_dict())
    sparse.load_state_dict(soft.state_dict())
    keys = facts.clone().requires_grad_()
    out_soft, out_hard = soft(query, keys, facts, mask), hard(query, keys, facts, mask)
    best = out_soft.distribution.argmax  # [B, K]
    onehot = torch.nn.functional.one_hot(best, 5).float()
    assert torch.equal(out_hard.marginals, onehot)
    assert torch.equal(out_hard.edge_marginals, onehot[:, :-1, :, None] * onehot[:, 1:, None, :])
    probe = torch.randn(2, 3, 5), torch.randn(2, 2, 5, 5)
    want = torch.autograd.grad(
        (out_soft.marginals * probe[0]).sum() + (out_soft.edge_marginals * probe[1]).sum(), keys
    )
    got = torch.autograd.grad(
        (out_hard.marginals * probe[0]).sum() + (out_hard.edge_marginals * probe[1]).sum(), keys
    )
    torch.testing.assert_close(got, want)
    out_sparse = sparse(query, keys, facts, mask)
    torch.testing.assert_close(out_sparse.marginals.sum(-1), torch.ones(2, 3))
    torch.testing.assert_close(out_sparse.edge_marginals.sum(-1), out_sparse.marginals[:, :-1])
