"""The hand-written chain forward-backward (structs.linear_chain.chain_log_partition and
chain_marginals) against brute force and against autograd through the forward algorithm.

Both forward passes are checked ("scaled" in probability space, "log" in log space), with
shared [C, C] and per-step [B, N-1, C, C] transitions, few labels (per-step matrices) and
more (one shared matrix), and every normalisation schedule of the scaled pass.
"""

from __future__ import annotations

from collections.abc import Iterator

import oracles
import pytest
import torch
from torch import Tensor

from structattn import LinearChainCRF, SegmentationAttention
from structattn.semirings import LogSemiring
from structattn.structs import linear_chain
from structattn.structs.linear_chain import chain_inside, chain_log_partition, chain_marginals

METHODS = ("scaled", "log")
LABELS = (1, 2, 3, 6)  # 6 > _FOLD_LABELS: the shared-matrix loops


@pytest.fixture(params=[0, 1, 2, 3], ids=["auto-k", "k=1", "k=2", "k=3"])
def every(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """Force the scaled pass to normalise every k steps (0: its own choice, which in
    float64 is never at these sizes)."""
    k = request.param
    if k:
        original = linear_chain._scaled_steps

        def forced(pairwise: Tensor, top: Tensor) -> tuple[int, bool]:
            steps, empty = original(pairwise, top)
            return (min(steps, k) if steps else 0), empty

        monkeypatch.setattr(linear_chain, "_scaled_steps", forced)
    yield k


def _draw(
    batch: int, n: int, c: int, shared: bool, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor]:
    unary = torch.randn(batch, n, c, dtype=dtype)
    pairwise = torch.randn(c, c, dtype=dtype) if shared else torch.randn(batch, n - 1, c, c)
    return unary, pairwise.to(dtype)


def _mask(unary: Tensor, lengths: Tensor) -> Tensor:
    real = torch.arange(unary.shape[1]) < lengths.unsqueeze(-1)
    return unary.masked_fill(~real.unsqueeze(-1), 0.0)


def _steps(pairwise: Tensor, batch: int, n: int) -> Tensor:
    c = pairwise.shape[-1]
    return pairwise.expand(batch, n - 1, c, c) if pairwise.dim() == 2 else pairwise


def _brute(unary: Tensor, steps: Tensor, length: int) -> tuple[Tensor, Tensor, Tensor]:
    """log Z, marginals [N, C], edge marginals [N-1, C, C] of one item by enumeration."""
    n, c = unary.shape
    support = oracles.chains(length, c)
    scores = torch.stack([oracles.chain_score(unary, steps, z) for z in support])
    logz = scores.logsumexp(0)
    probs = (scores - logz).exp()
    node = torch.zeros_like(unary)
    edge = torch.zeros(max(n - 1, 0), c, c, dtype=unary.dtype)
    for z, p in zip(support, probs, strict=True):
        for i, label in enumerate(z):
            node[i, label] += p
            if i + 1 < len(z):
                edge[i, label, z[i + 1]] += p
    return logz, node, edge


def _reference(
    unary: Tensor, pairwise: Tensor, lengths: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """log Z and the marginals by autograd of the forward algorithm (create_graph, the old
    path): (log Z, node, edge, steps) with ``steps`` the per-step transitions."""
    steps = _steps(pairwise, unary.shape[0], unary.shape[1])
    logz = chain_inside(unary, steps, lengths, LogSemiring, method="sequential")
    node, edge = torch.autograd.grad(logz.sum(), (unary, steps), create_graph=True)
    return logz, node, edge, steps


# ---- values -------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-step"])
@pytest.mark.parametrize("c", LABELS)
def test_against_brute_force(method: str, shared: bool, c: int, every: int) -> None:
    n = 5 if c < 6 else 4
    unary, pairwise = _draw(4, n, c, shared)
    lengths = torch.tensor([n, n - 1, 2, 1])
    unary = _mask(unary, lengths)
    logz = chain_log_partition(unary, pairwise, lengths, method)
    node, edge = chain_marginals(unary, pairwise, lengths, edges=True, method=method)
    assert edge is not None
    steps = _steps(pairwise, 4, n)
    for b, length in enumerate(lengths.tolist()):
        want_logz, want_node, want_edge = _brute(unary[b], steps[b], length)
        torch.testing.assert_close(logz[b], want_logz)
        torch.testing.assert_close(node[b], want_node)
        torch.testing.assert_close(edge[b], want_edge)
        # padding: exactly 0
        assert node[b, length:].eq(0).all() and edge[b, max(length - 1, 0) :].eq(0).all()
    alone, _ = chain_marginals(unary, pairwise, lengths, method=method)
    torch.testing.assert_close(alone, node)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("c", [2, 6])
def test_first_and_second_order_match_autograd(method: str, c: int, every: int) -> None:
    """log Z's gradient, and the gradient of a loss on the (node and edge) marginals, equal
    autograd (of autograd) through the forward algorithm; so does log Z's double backward."""
    for shared in (True, False):
        n = 7
        base, pairwise = _draw(4, n, c, shared)
        lengths = torch.tensor([7, 5, 2, 1])
        unary_leaf = base.requires_grad_()
        pair_leaf = pairwise.requires_grad_()
        unary = _mask(unary_leaf, lengths)
        leaves = (unary_leaf, pair_leaf)
        w_node = torch.randn(4, n, c, dtype=torch.float64)
        w_edge = torch.randn(4, n - 1, c, c, dtype=torch.float64)
        ref_logz, ref_node, ref_edge, _ = _reference(unary, pair_leaf, lengths)

        logz = chain_log_partition(unary, pair_leaf, lengths, method)
        torch.testing.assert_close(logz, ref_logz)
        got = torch.autograd.grad(logz.sum(), leaves, create_graph=True)
        want = torch.autograd.grad(ref_logz.sum(), leaves, create_graph=True)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
        loss2 = (got[0] * w_node).sum() + got[1].pow(2).sum()
        ref_loss2 = (want[0] * w_node).sum() + want[1].pow(2).sum()
        second = torch.autograd.grad(loss2, leaves, retain_graph=True)
        want2 = torch.autograd.grad(ref_loss2, leaves, retain_graph=True)
        for a, b in zip(second, want2, strict=True):
            torch.testing.assert_close(a, b)

        for with_edges in (False, True):
            node, edge = chain_marginals(unary, pair_leaf, lengths, with_edges, method)
            loss = (node * w_node).sum()
            ref_loss = (ref_node * w_node).sum()
            if with_edges:
                assert edge is not None
                loss = loss + (edge * w_edge).sum()
                ref_loss = ref_loss + (ref_edge * w_edge).sum()
            got = torch.autograd.grad(loss, leaves, retain_graph=True)
            want = torch.autograd.grad(ref_loss, leaves, retain_graph=True)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-step"])
@pytest.mark.parametrize("c", [2, 6])
def test_gradcheck_and_gradgradcheck(method: str, shared: bool, c: int) -> None:
    """First order (log Z), second (marginals: the hand-written Hessian-vector product) and
    third (the marginals' double backward: autograd through the forward algorithm)."""
    unary, pairwise = _draw(3, 4, c, shared)
    lengths = torch.tensor([4, 2, 1])
    unary = _mask(unary, lengths).requires_grad_()
    pairwise = pairwise.requires_grad_()

    def logz(u: Tensor, p: Tensor) -> Tensor:
        return chain_log_partition(u, p, lengths, method)

    def marginals(u: Tensor, p: Tensor) -> tuple[Tensor, Tensor | None]:
        return chain_marginals(u, p, lengths, True, method)

    def node(u: Tensor, p: Tensor) -> Tensor:
        return chain_marginals(u, p, lengths, False, method)[0]

    assert torch.autograd.gradcheck(logz, (unary, pairwise))
    assert torch.autograd.gradgradcheck(logz, (unary, pairwise))
    for fn in (marginals, node):
        assert torch.autograd.gradcheck(fn, (unary, pairwise))
        assert torch.autograd.gradgradcheck(fn, (unary, pairwise))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-step"])
def test_single_position(method: str, shared: bool) -> None:
    """N = 1: softmax marginals, no edges, and every derivative (no step at all)."""
    unary, pairwise = _draw(2, 1, 3, shared)
    unary, pairwise = unary.requires_grad_(), pairwise.requires_grad_()
    node, edge = chain_marginals(unary, pairwise, None, True, method)
    assert edge is not None and edge.shape == (2, 0, 3, 3)
    torch.testing.assert_close(node, unary.softmax(-1))
    torch.testing.assert_close(
        chain_log_partition(unary, pairwise, None, method), unary.logsumexp(-1)[:, 0]
    )
    assert torch.autograd.gradcheck(
        lambda u, p: chain_marginals(u, p, None, False, method)[0], (unary, pairwise)
    )
    assert torch.autograd.gradgradcheck(
        lambda u, p: chain_log_partition(u, p, None, method), (unary, pairwise)
    )


# ---- -inf, items with no structure, float32 ----------------------------------------------
def test_forbidden_transitions_and_an_item_with_no_structure() -> None:
    """-inf on the diagonal (log-space pass) with lengths, and an item whose position 2 has
    every label at -inf: log Z = -inf, zero marginals, finite (zero) gradients for it."""
    c, n = 3, 5
    base = torch.randn(4, n, c, dtype=torch.float64)
    base[1, 2] = float("-inf")
    base[2, 0, 1] = float("-inf")  # one forbidden label at one position
    lengths = torch.tensor([5, 4, 3, 1])
    pairwise = torch.zeros(c, c, dtype=torch.float64)
    pairwise.fill_diagonal_(float("-inf"))
    unary_leaf = base.requires_grad_()
    pair_leaf = pairwise.requires_grad_()
    unary = _mask(unary_leaf, lengths)
    logz = chain_log_partition(unary, pair_leaf, lengths)
    node, edge = chain_marginals(unary, pair_leaf, lengths, edges=True)
    assert edge is not None
    steps = _steps(pairwise.detach(), 4, n)
    for b, length in enumerate(lengths.tolist()):
        if b == 1:
            continue
        want_logz, want_node, want_edge = _brute(unary[b].detach(), steps[b], length)
        torch.testing.assert_close(logz[b], want_logz)
        torch.testing.assert_close(node[b], want_node)
        torch.testing.assert_close(edge[b], want_edge)
    assert torch.isneginf(logz[1]) and node[1].eq(0).all() and edge[1].eq(0).all()
    assert edge.diagonal(dim1=-2, dim2=-1).eq(0).all()
    finite = torch.where(torch.isfinite(logz), logz, torch.zeros_like(logz))
    w = torch.randn_like(node)
    loss = finite.sum() + (node * w).sum() + edge.pow(2).sum()
    grads = torch.autograd.grad(loss, (unary_leaf, pair_leaf), retain_graph=True)
    for g in grads:
        assert torch.isfinite(g).all()
    assert grads[0][1].eq(0).all()
    ref_logz, ref_node, ref_edge, _ = _reference(unary, pair_leaf, lengths)
    ref_finite = torch.where(torch.isfinite(ref_logz), ref_logz, torch.zeros_like(ref_logz))
    ref_loss = ref_finite.sum() + (ref_node * w).sum() + ref_edge.pow(2).sum()
    want = torch.autograd.grad(ref_loss, (unary_leaf, pair_leaf))
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("c", [2, 6])
def test_scaled_pass_with_an_item_with_no_structure(c: int, every: int) -> None:
    unary, pairwise = _draw(3, 6, c, True)
    unary[1, 3] = float("-inf")
    unary = unary.requires_grad_()
    pairwise = pairwise.requires_grad_()
    logz = chain_log_partition(unary, pairwise, None, "scaled")
    node, edge = chain_marginals(unary, pairwise, None, True, "scaled")
    assert edge is not None
    assert torch.isneginf(logz[1]) and node[1].eq(0).all() and edge[1].eq(0).all()
    ref = chain_log_partition(unary, pairwise, None, "log")
    torch.testing.assert_close(logz, ref)
    loss = logz[[0, 2]].sum() + node.pow(2).sum() + edge.pow(2).sum()
    for g in torch.autograd.grad(loss, (unary, pairwise)):
        assert torch.isfinite(g).all()


def test_method_choice_and_errors() -> None:
    unary = torch.randn(2, 4, 3)
    forbidden = torch.zeros(3, 3)
    forbidden[0, 1] = float("-inf")
    with pytest.raises(ValueError, match="not exact"):
        chain_log_partition(unary, forbidden, None, "scaled")
    with pytest.raises(ValueError, match="method"):
        chain_marginals(unary, torch.zeros(3, 3), None, method="viterbi")
    top = unary.amax(-1, keepdim=True)
    assert linear_chain._scaled_steps(torch.zeros(3, 3), top)[0] > 0
    assert linear_chain._scaled_steps(forbidden, top)[0] == 0
    assert linear_chain._scaled_steps(torch.tensor([[0.0, 80.0], [0.0, 0.0]]), top)[0] == 0
    assert linear_chain._scaled_steps(torch.zeros(3, 3, dtype=torch.float16), top)[0] == 0
    # float64 allows a far wider spread than float32
    wide = torch.tensor([[0.0, 80.0], [0.0, 0.0]], dtype=torch.float64)
    assert linear_chain._scaled_steps(wide, top.double())[0] > 0


@pytest.mark.parametrize("c", [2, 25])
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_float32_long_chains_agree_with_float64(c: int, scale: float) -> None:
    """N = 200 in float32: unary scores up to ~4 scale, transitions as spread as the scaled
    pass allows (scale 30) or standard normal; both passes agree with float64."""
    n = 200
    unary = torch.randn(4, n, c) * scale
    pairwise = torch.randn(c, c)
    if scale > 1:  # spread just below the float32 limit of the scaled pass
        limit = 0.3 * 87.3 - torch.tensor(float(c)).log().item()
        pairwise = (pairwise - pairwise.min()) / (pairwise.max() - pairwise.min()) * limit * 0.95
    lengths = torch.tensor([200, 150, 37, 1])
    unary = _mask(unary, lengths)
    assert linear_chain._scaled_steps(pairwise, unary.amax(-1, keepdim=True))[0] > 0
    w = torch.randn(4, n, c)
    want_logz = chain_log_partition(unary.double(), pairwise.double(), lengths, "log")
    want_node, _ = chain_marginals(unary.double(), pairwise.double(), lengths, method="log")
    u64, p64 = unary.double().requires_grad_(), pairwise.double().requires_grad_()
    node64, _ = chain_marginals(u64, p64, lengths, method="log")
    want_grads = torch.autograd.grad((node64 * w.double()).sum(), (u64, p64))
    for method in METHODS:
        u, p = unary.clone().requires_grad_(), pairwise.clone().requires_grad_()
        logz = chain_log_partition(u, p, lengths, method)
        node, _ = chain_marginals(u, p, lengths, method=method)
        torch.testing.assert_close(logz.double(), want_logz, rtol=1e-5, atol=1e-3)
        torch.testing.assert_close(node.double(), want_node, rtol=0, atol=1e-4)
        assert (node >= 0).all() and (node <= 1 + 1e-5).all()
        grads = torch.autograd.grad((node * w).sum(), (u, p))
        for g, g64 in zip(grads, want_grads, strict=True):
            assert torch.isfinite(g).all()
            scale_g = g64.abs().max().clamp_min(1.0)
            assert float((g.double() - g64).abs().max() / scale_g) < 1e-3


@pytest.mark.parametrize("scale", [1e2, 1e4])
def test_float32_huge_scores_are_finite(scale: float) -> None:
    for c in (2, 6):
        unary = (torch.randn(3, 40, c) * scale).requires_grad_()
        pairwise = (torch.randn(c, c) * scale).requires_grad_()  # log-space pass
        lengths = torch.tensor([40, 17, 1])
        masked = _mask(unary, lengths)
        logz = chain_log_partition(masked, pairwise, lengths)
        node, edge = chain_marginals(masked, pairwise, lengths, edges=True)
        assert edge is not None
        assert torch.isfinite(logz).all() and torch.isfinite(node).all()
        loss = logz.sum() + node.pow(2).sum() + edge.pow(2).sum()
        for g in torch.autograd.grad(loss, (unary, pairwise)):
            assert torch.isfinite(g).all()


# ---- the distribution and segmentation attention ------------------------------------------
def test_distribution_node_and_edge_marginals_agree() -> None:
    unary = torch.randn(3, 6, 4, dtype=torch.float64, requires_grad=True)
    pairwise = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([6, 3, 1])
    first = LinearChainCRF(unary, pairwise, lengths)
    node = first.marginals  # the node-only pass
    both = LinearChainCRF(unary, pairwise, lengths)
    edge = both.edge_marginals  # the pass with edges; marginals then reuse it
    torch.testing.assert_close(node, both.marginals)
    assert both.marginals is both._marginals_tuple[0]
    torch.testing.assert_close(edge.sum(-1), node[:, :-1] * (node[:, 1:].sum(-1) > 0)[..., None])
    (g,) = torch.autograd.grad(first.log_partition.sum(), pairwise)
    torch.testing.assert_close(g, edge.sum((0, 1)))


def test_segmentation_attention_matches_autograd_reference() -> None:
    """Weights and every gradient of segmentation attention equal those of the old path
    (marginals by autograd of the forward algorithm, differentiated again)."""
    d = 6
    layer = SegmentationAttention(d).double()
    torch.nn.init.normal_(layer.transitions)
    memory = torch.randn(3, 7, d, dtype=torch.float64)
    query = torch.randn(3, 2, d, dtype=torch.float64)
    mask = torch.arange(7) < torch.tensor([[7], [4], [1]])
    out = layer(query, memory, mask)
    params = [layer.transitions, *layer.scorer.parameters()]
    grads = torch.autograd.grad(out.context.pow(2).sum(), params)

    scores = layer.scorer(memory, query)  # [B, Q, N]
    lengths = mask.sum(-1).repeat_interleave(2)
    on = scores.reshape(6, 7)
    unary = _mask(torch.stack([torch.zeros_like(on), on], -1), lengths)
    _, node, _, _ = _reference(unary, layer.transitions, lengths)
    weights = node[..., 1].reshape(3, 2, 7)
    torch.testing.assert_close(out.weights, weights)
    context = layer.contextualize(weights, memory)
    want = torch.autograd.grad(context.pow(2).sum(), params)
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b)
