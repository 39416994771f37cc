"""The C++ chain kernels (structs/_chain.cpp: forward-backward and its Hessian-vector product
for few labels) against the PyTorch code they replace and against brute force; the fused
small-tree path of the Eisner kernels (structs/_eisner.cpp) against their per-width ATen
path and the PyTorch code."""

from __future__ import annotations

import contextlib
import itertools

import oracles
import pytest
import torch
from torch import Tensor

from structattn import LinearChainCRF
from structattn.structs import dependency, linear_chain
from structattn.structs._extension import kernels, kernels_disabled
from structattn.structs.linear_chain import chain_log_partition, chain_marginals


@pytest.fixture
def chain_kernels() -> None:
    """Skip where the kernels are not built or do not hold the chain kernels yet."""
    module = kernels(torch.zeros(1, 2, 2))
    if module is None or not hasattr(module, "chain_hvp"):
        pytest.skip("the C++ chain kernels are not built on this machine")


def _draw(
    batch: int, n: int, c: int, shared: bool, dtype: torch.dtype, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    unary = torch.randn(batch, n, c, generator=gen, dtype=torch.float64)
    shape = (c, c) if shared else (batch, n - 1, c, c)
    pairwise = torch.randn(shape, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, n + 1, (batch,), generator=gen)
    lengths[0] = n
    real = torch.arange(n) < lengths.unsqueeze(-1)
    unary = unary.masked_fill(~real.unsqueeze(-1), 0.0)
    return unary.to(dtype), pairwise.to(dtype), lengths


def _passes(unary: Tensor, pairwise: Tensor, lengths: Tensor | None) -> list[Tensor]:
    """log Z, node and edge marginals, log Z's gradient (seeded), the gradient of a loss on
    the node and edge marginals (the Hessian-vector product) and of one on the node
    marginals alone."""
    u = unary.clone().requires_grad_()
    p = pairwise.clone().requires_grad_()
    gen = torch.Generator().manual_seed(1)
    logz = chain_log_partition(u, p, lengths)
    finite = torch.where(torch.isfinite(logz), logz, torch.zeros_like(logz))
    seed = torch.linspace(-1.0, 2.0, u.shape[0], dtype=u.dtype)
    first = torch.autograd.grad((finite * seed).sum(), (u, p))
    node, edge = chain_marginals(u, p, lengths, edges=True)
    w_node = torch.randn(node.shape, generator=gen, dtype=u.dtype)
    w_edge = torch.randn(edge.shape, generator=gen, dtype=u.dtype)
    both = torch.autograd.grad((node * w_node).sum() + (edge * w_edge).sum(), (u, p))
    alone, _ = chain_marginals(u, p, lengths)
    node_only = torch.autograd.grad((alone * w_node).sum(), (u, p))
    outs = [logz, node, edge, alone, *first, *both, *node_only]
    return [torch.nan_to_num(x.detach(), neginf=0.0) for x in outs]


def _assert_all_close(got: list[Tensor], want: list[Tensor], tol: float) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.usefixtures("chain_kernels")
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-5)], ids=["f64", "f32"]
)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernels_equal_the_pytorch_code(dtype: torch.dtype, tol: float, threads: int) -> None:
    """Every output and gradient, shared and per-step transitions, C = 1..5, 10, 16, 17,
    22, 23 and 27 (above 16 only a shared matrix is served, up to 22 labels), variable
    lengths (length 1 included), the batch in one chunk and in two."""
    torch.set_num_threads(threads)
    for c, shared in itertools.product((1, 2, 3, 4, 5, 10, 16, 17, 22, 23, 27), (True, False)):
        unary, pairwise, lengths = _draw(7, 6, c, shared, dtype, seed=c)
        lengths[1] = 1
        served = linear_chain._chain_kernels(unary, pairwise, "auto") is not None
        if threads == 1:  # one thread: the batched code from 13 labels (measured faster)
            assert served == (c <= 12)
        else:
            assert served == (c <= 16 or (shared and c <= 22))
        got = _passes(unary, pairwise, lengths)
        with kernels_disabled():
            want = _passes(unary, pairwise, lengths)
        _assert_all_close(got, want, tol)


@pytest.mark.usefixtures("chain_kernels")
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-step"])
def test_kernels_against_brute_force(shared: bool) -> None:
    """log Z and marginals against enumeration of every label sequence (float64)."""
    c, n = 3, 4
    unary, pairwise, lengths = _draw(4, n, c, shared, torch.float64, seed=5)
    logz = chain_log_partition(unary, pairwise, lengths)
    node, edge = chain_marginals(unary, pairwise, lengths, edges=True)
    steps = pairwise.expand(4, n - 1, c, c) if shared else pairwise
    for b, length in enumerate(lengths.tolist()):
        sequences = oracles.chains(length, c)
        scores = torch.stack(
            [oracles.chain_score(unary[b, :length], steps[b, : length - 1], z) for z in sequences]
        )
        probs = (scores - scores.logsumexp(0)).exp()
        want_node = torch.zeros(n, c, dtype=torch.float64)
        want_edge = torch.zeros(n - 1, c, c, dtype=torch.float64)
        for prob, z in zip(probs, sequences, strict=True):
            for i in range(length):
                want_node[i, z[i]] += prob
            for i in range(length - 1):
                want_edge[i, z[i], z[i + 1]] += prob
        torch.testing.assert_close(logz[b], scores.logsumexp(0))
        torch.testing.assert_close(node[b], want_node)
        torch.testing.assert_close(edge[b], want_edge)


@pytest.mark.usefixtures("chain_kernels")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_kernels_with_minus_inf_and_wide_transitions(dtype: torch.dtype) -> None:
    """A forbidden transition, transitions spread too widely for the probability-space pass
    (the kernel's log-space pass), an item with no valid sequence (log Z = -inf, marginals
    and gradients 0), a forbidden label, items whose steps repeat one matrix: as the PyTorch
    code (its log-space pass)."""
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for c in (2, 3):
        unary, pairwise, lengths = _draw(6, 7, c, False, dtype, seed=c)
        pairwise[0, 2, 0, 1] = float("-inf")
        pairwise[1] *= 300.0
        unary[2, 3] = float("-inf")
        unary[3, 1, 0] = float("-inf")
        pairwise[4] = pairwise[4, :1].clone()
        pairwise[5] = pairwise[4]
        lengths[2] = 7
        got = _passes(unary, pairwise, lengths)
        with kernels_disabled():
            want = _passes(unary, pairwise, lengths)
        _assert_all_close(got, want, tol)
        logz, node = chain_log_partition(unary, pairwise, lengths), got[1]
        assert torch.isneginf(logz[2]) and node[2].eq(0).all()
        assert got[2][0, 2, 0, 1] == 0 and node[3, 1, 0] == 0
        for grad in got[4:]:
            assert torch.isfinite(grad).all()
        assert got[6][2].eq(0).all() and got[8][2].eq(0).all()


def _through_every_item(unary: Tensor, pairwise: Tensor, lengths: Tensor) -> Tensor:
    """log Z's gradient for the pairwise scores with 1 into every item (-inf ones too)."""
    p = pairwise.clone().requires_grad_()
    (grad,) = torch.autograd.grad(chain_log_partition(unary, p, lengths).sum(), p)
    return grad


@pytest.mark.usefixtures("chain_kernels")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_shared_transitions_summed_edge_gradient(dtype: torch.dtype) -> None:
    """log Z's gradient for a shared matrix (the kernel sums each item's edge marginals in
    its backward sweep): an item with no valid sequence, a forbidden transition, a matrix
    spread too widely for the probability-space pass, length 1: as the PyTorch code."""
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for c, scale in itertools.product((2, 3, 10), (1.0, 300.0)):
        unary, pairwise, lengths = _draw(6, 7, c, True, dtype, seed=c)
        pairwise = pairwise * scale
        pairwise[0, 1] = float("-inf")
        unary[2, 3] = float("-inf")  # item 2: no valid sequence
        lengths[2], lengths[4] = 7, 1
        got = _passes(unary, pairwise, lengths)
        with kernels_disabled():
            want = _passes(unary, pairwise, lengths)
        _assert_all_close(got, want, tol)
        d_pair = got[5]
        assert d_pair.shape == (c, c) and torch.isfinite(d_pair).all() and d_pair[0, 1] == 0

        got_all = _through_every_item(unary, pairwise, lengths)
        with kernels_disabled():
            want_all = _through_every_item(unary, pairwise, lengths)
        torch.testing.assert_close(got_all, want_all, rtol=tol, atol=tol)


@pytest.mark.usefixtures("chain_kernels")
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-step"])
def test_kernels_gradcheck_and_gradgradcheck(shared: bool) -> None:
    """Float64: log Z and marginals to second order through the kernels (a third order falls
    back to autograd)."""
    unary, pairwise, lengths = _draw(3, 4, 2, shared, torch.float64, seed=3)
    unary.requires_grad_()
    pairwise.requires_grad_()

    def logz(u: Tensor, p: Tensor) -> Tensor:
        return chain_log_partition(u, p, lengths)

    def marginals(u: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
        return chain_marginals(u, p, lengths, True)

    def node(u: Tensor, p: Tensor) -> Tensor:
        return chain_marginals(u, p, lengths)[0]

    for fn in (logz, marginals, node):
        assert torch.autograd.gradcheck(fn, (unary, pairwise))
        assert torch.autograd.gradgradcheck(fn, (unary, pairwise))


@pytest.mark.usefixtures("chain_kernels")
def test_kernels_single_position() -> None:
    """N = 1: log Z = logsumexp of the unary, marginals its softmax, no transitions."""
    unary = torch.randn(3, 1, 2, dtype=torch.float64, requires_grad=True)
    pairwise = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    node, edge = chain_marginals(unary, pairwise, None, True)
    torch.testing.assert_close(node, unary.softmax(-1))
    assert edge.shape == (3, 0, 2, 2)
    logz = chain_log_partition(unary, pairwise, None)
    torch.testing.assert_close(logz, unary.logsumexp(-1)[:, 0])
    assert torch.autograd.gradcheck(lambda u: chain_marginals(u, pairwise, None)[0], (unary,))


@pytest.mark.usefixtures("chain_kernels")
def test_more_labels_served_only_with_a_small_buffer() -> None:
    """17-22 labels with a shared matrix: served while [B, N-1, C, C] holds at most 2^20
    elements (the kernel's double buffer); not with one matrix per step nor above 22 labels;
    with one torch thread not above 12 labels (the batched code is faster there)."""
    torch.set_num_threads(2)
    assert linear_chain._chain_kernels(torch.zeros(32, 20, 22), torch.zeros(22, 22), "auto")
    assert linear_chain._chain_kernels(torch.zeros(32, 20, 23), torch.zeros(23, 23), "auto") is None
    pairwise = torch.zeros(20, 20)
    small = torch.zeros(32, 80, 20)  # 32 * 79 * 400 = 1.01M
    large = torch.zeros(32, 83, 20)  # 1.06M
    assert linear_chain._chain_kernels(small, pairwise, "auto") is not None
    assert linear_chain._chain_kernels(large, pairwise, "auto") is None
    per_step = torch.zeros(32, 79, 20, 20)
    assert linear_chain._chain_kernels(small, per_step, "auto") is None
    assert (
        linear_chain._chain_kernels(torch.zeros(32, 10, 16), per_step[:, :9, :16, :16], "auto")
        is not None
    )
    torch.set_num_threads(1)
    assert linear_chain._chain_kernels(small, pairwise, "auto") is None
    assert linear_chain._chain_kernels(torch.zeros(32, 10, 13), torch.zeros(13, 13), "auto") is None
    assert (
        linear_chain._chain_kernels(torch.zeros(32, 10, 12), torch.zeros(12, 12), "auto")
        is not None
    )


@pytest.mark.usefixtures("chain_kernels")
def test_kernels_serve_the_distribution_and_only_auto() -> None:
    """LinearChainCRF with few labels uses the kernels; method "scaled" / "log", more labels,
    mixed dtypes and a disabled extension use the PyTorch code."""
    unary, pairwise, lengths = _draw(4, 5, 2, True, torch.float32)
    assert linear_chain._chain_kernels(unary, pairwise, "auto") is not None
    for method in ("scaled", "log"):
        assert linear_chain._chain_kernels(unary, pairwise, method) is None
    assert linear_chain._chain_kernels(unary, pairwise.double(), "auto") is None
    with kernels_disabled():
        assert linear_chain._chain_kernels(unary, pairwise, "auto") is None
        want = LinearChainCRF(unary, pairwise, lengths).marginals
    torch.testing.assert_close(LinearChainCRF(unary, pairwise, lengths).marginals, want)


@pytest.mark.parametrize("path", ["kernels", "pytorch"])
@pytest.mark.parametrize(
    "fill", [float("-inf"), float("inf"), float("nan"), 1e4], ids=["-inf", "inf", "nan", "1e4"]
)
def test_padding_is_ignored(path: str, fill: float) -> None:
    """log Z, the marginals, their gradients (first order and the Hessian-vector product) and
    a third order through a LinearChainCRF do not depend on the unary at padding, whose
    gradient is 0: the kernels never read it, the PyTorch code gets it masked (NaN and +inf
    there are refused by the distribution's checks, not by these functions)."""
    if (
        path == "kernels"
        and linear_chain._chain_kernels(torch.zeros(1, 2, 2), torch.zeros(2, 2), "auto") is None
    ):
        pytest.skip("the C++ chain kernels are not built on this machine")
    unary, pairwise, lengths = _draw(5, 6, 3, True, torch.float64, seed=11)
    real = torch.arange(6) < lengths.unsqueeze(-1)
    filled = unary.masked_fill(~real.unsqueeze(-1), fill)
    weight = filled.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    context = kernels_disabled if path == "pytorch" else contextlib.nullcontext
    with context():
        _assert_all_close(
            _passes(filled, pairwise, lengths), _passes(unary, pairwise, lengths), 1e-12
        )
        u = filled.clone().requires_grad_()
        p = pairwise.clone().requires_grad_()
        dist = LinearChainCRF(u, p, lengths, validate_args=False)
        (d_u,) = torch.autograd.grad(dist.log_partition.sum(), u, create_graph=True)
        (dd_u,) = torch.autograd.grad((d_u * weight).sum(), u, create_graph=True)
        (ddd_p,) = torch.autograd.grad(dd_u.pow(2).sum(), p)
    for grad in (d_u, dd_u):
        assert torch.isfinite(grad).all() and (grad[~real] == 0).all()
    assert torch.isfinite(ddd_p).all()
    with context():
        u0 = unary.clone().requires_grad_()
        p0 = pairwise.clone().requires_grad_()
        (d0,) = torch.autograd.grad(
            LinearChainCRF(u0, p0, lengths).log_partition.sum(), u0, create_graph=True
        )
        (dd0,) = torch.autograd.grad((d0 * weight).sum(), u0, create_graph=True)
        (ddd0,) = torch.autograd.grad(dd0.pow(2).sum(), p0)
    torch.testing.assert_close(ddd_p, ddd0)


# ---- the fused path of the Eisner kernels -----------------------------------------------
@pytest.fixture(autouse=True)
def _fused_loops_on_every_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused loops serve up to _FUSED_SIZE positions on every SIMD target (tested)."""
    monkeypatch.setattr(dependency, "_FUSED_SIZES", {})


def _tree_passes(scores: Tensor, lengths: Tensor, multiroot: bool) -> list[Tensor]:
    """log Z, its seeded gradient, the marginals and a Hessian-vector product."""
    x = scores.clone().requires_grad_()
    logz = dependency.eisner_log_partition(x, lengths, multiroot)
    seed = torch.linspace(-1.0, 2.0, x.shape[0], dtype=x.dtype)
    (plain,) = torch.autograd.grad(logz, x, seed, retain_graph=True)
    (marginals,) = torch.autograd.grad(logz.sum(), x, create_graph=True)
    direction = torch.randn(x.shape, generator=torch.Generator().manual_seed(4), dtype=x.dtype)
    (hvp,) = torch.autograd.grad((marginals * direction).sum(), x)
    return [logz.detach(), plain, marginals.detach(), hvp]


@pytest.mark.usefixtures("built_kernels")
@pytest.mark.parametrize("multiroot", [True, False], ids=["multiroot", "oneroot"])
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-5)], ids=["f64", "f32"]
)
def test_fused_eisner_equals_the_aten_path_and_the_pytorch_code(
    multiroot: bool, dtype: torch.dtype, tol: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fused loops (eight trees per group: one partial group, two groups), the ATen path
    with kept and with recomputed weights, and the PyTorch code agree, with -inf arcs and
    lengths 2 .. N, at 1 and 2 threads."""
    for batch, size in [(1, 2), (11, 9), (3, 21)]:
        gen = torch.Generator().manual_seed(size)
        scores = (torch.randn(batch, size, size, generator=gen) * 3).to(dtype)
        scores[:, :, 0] = float("-inf")
        if batch > 1:  # forbidden arcs that still leave trees
            scores[1, 2:, 1] = float("-inf")
        lengths = torch.randint(2, size + 1, (batch,), generator=gen)
        lengths[0] = size
        with kernels_disabled():
            want = _tree_passes(scores, lengths, multiroot)
        for path, threads in itertools.product(("fused", "kept", "recomputed"), (1, 2)):
            torch.set_num_threads(threads)
            with monkeypatch.context() as patch:
                if path != "fused":
                    patch.setattr(dependency, "_FUSED_SIZE", 0)
                if path == "recomputed":
                    patch.setattr(dependency, "_CACHE_ELEMENTS", 0)
                got = _tree_passes(scores, lengths, multiroot)
            for a in got:
                assert torch.isfinite(a).all()
            _assert_all_close(got, want, tol)


@pytest.mark.usefixtures("chain_kernels")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_nan_potentials_give_nan_for_their_items_as_the_pytorch_code(dtype: torch.dtype) -> None:
    """A NaN unary or transition score of a real position makes log Z, the marginals and the
    gradients NaN for its item only, from the kernels as from the PyTorch code (the kernels
    gave log Z = -inf and zero marginals, #37.10); NaN at padding (a unary beyond the length,
    a transition beyond the last position) changes nothing, on either path."""
    unary, pairwise, lengths = _draw(5, 6, 3, False, dtype, seed=8)
    lengths.copy_(torch.tensor([6, 6, 6, 4, 6]))
    unary[1, 2, 0] = float("nan")  # item 1: a real position
    pairwise[2, 1, 0, 2] = float("nan")  # item 2: a real step
    unary[3, 5, 1] = float("nan")  # item 3 (length 4): padding
    pairwise[3, 3, 1, 1] = float("nan")  # its step 3 (positions 3 -> 4): padding

    def outputs() -> list[Tensor]:
        u = unary.clone().requires_grad_()
        p = pairwise.clone().requires_grad_()
        logz = chain_log_partition(u, p, lengths)
        first = torch.autograd.grad(logz.sum(), (u, p))
        node, edge = chain_marginals(u, p, lengths, edges=True)
        second = torch.autograd.grad((node * node).sum() + (edge * edge).sum(), (u, p))
        return [logz.detach(), node.detach(), edge.detach(), *first, *second]

    got = outputs()
    with kernels_disabled():
        want = outputs()
    expected = [False, True, True, False, False]
    keep = ~torch.tensor(expected)
    for a, b in zip(got, want, strict=True):
        nan_items = a.reshape(5, -1).isnan().any(1).tolist()
        assert nan_items == expected == b.reshape(5, -1).isnan().any(1).tolist()
        torch.testing.assert_close(a[keep], b[keep], rtol=1e-5, atol=1e-6)
