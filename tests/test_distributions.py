"""One suite of invariants, checked against brute-force enumeration for every distribution.

Each ``Case`` says how to draw random potentials, build the distribution, enumerate every
structure of one item with its score, and turn a structure into part indicators (whose
expectation is the marginals). The tests below are then shared by all structures.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import oracles
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from structattn import (
    DependencyCRF,
    LinearChainCRF,
    NonProjectiveDependencyCRF,
    SemiMarkovCRF,
    SplitTreeDistribution,
    TreeCRF,
)
from structattn.distributions.base import StructuredDistribution

Params = tuple[Tensor, ...]


@dataclass(frozen=True)
class Case:
    name: str
    min_len: int
    draw: Callable[[int, int, torch.dtype, float], Params]  # (B, N, dtype, scale) -> params
    build: Callable[[Params, Tensor | None], StructuredDistribution]
    # (params of one item, length) -> list of (structure LongTensor [N], score)
    enumerate: Callable[[Params, int], list[tuple[Tensor, Tensor]]]
    indicators: Callable[[Tensor, Params], Params]  # structure -> part indicators (one item)
    marginals: Callable[[StructuredDistribution], Params]
    count: Callable[[int], int]  # number of structures of a full item of size N (zero scores)
    # (params, b, length) -> the params of item b alone, cropped to its length
    crop: Callable[[Params, int, int], Params] = lambda p, b, n: (p[0][b : b + 1, :n, :n],)
    pad: int = -1  # value of a structure at padding
    #: the marginals are the gradient of log Z (not for split trees: log Z = 0)
    gradient: bool = True
    #: marginals past the first are expected counts (>= 0, not <= 1)
    counts: bool = False
    brute_n: int = 5  # size of the brute-force tests of test_operations.py


# ---- linear chain ------------------------------------------------------------------------
C = 3


def _chain_draw(b: int, n: int, dtype: torch.dtype, scale: float) -> Params:
    return (
        torch.randn(b, n, C, dtype=dtype) * scale,
        torch.randn(b, n - 1, C, C, dtype=dtype) * scale,
    )


def _chain_enumerate(params: Params, length: int) -> list[tuple[Tensor, Tensor]]:
    unary, pairwise = params
    n = unary.shape[0]
    out = []
    for z in oracles.chains(length, C):
        value = torch.full((n,), -1, dtype=torch.long)
        value[:length] = torch.tensor(z)
        out.append((value, oracles.chain_score(unary, pairwise, z)))
    return out


def _chain_indicators(value: Tensor, params: Params) -> Params:
    unary, pairwise = params
    node = torch.zeros_like(unary)
    edge = torch.zeros_like(pairwise)
    real = [int(v) for v in value if v >= 0]
    for i, z in enumerate(real):
        node[i, z] = 1
        if i + 1 < len(real):
            edge[i, z, real[i + 1]] = 1
    return node, edge


CHAIN = Case(
    name="chain",
    min_len=1,
    draw=_chain_draw,
    build=lambda p, lengths: LinearChainCRF(p[0], p[1], lengths),
    enumerate=_chain_enumerate,
    indicators=_chain_indicators,
    marginals=lambda d: (d.marginals, d.edge_marginals),  # type: ignore[attr-defined]
    count=lambda n: C**n,
    crop=lambda p, b, n: (p[0][b : b + 1, :n], p[1][b : b + 1, : n - 1]),
    brute_n=4,
)


# ---- projective trees ----------------------------------------------------------------------
def _tree_draw(b: int, n: int, dtype: torch.dtype, scale: float) -> Params:
    return (torch.randn(b, n, n, dtype=dtype) * scale,)


def _tree_case(multiroot: bool, projective: bool = True) -> Case:
    def enumerate_trees(params: Params, length: int) -> list[tuple[Tensor, Tensor]]:
        (arcs,) = params
        n = arcs.shape[0]
        out = []
        for heads in oracles.trees(length - 1, projective=projective, multiroot=multiroot):
            value = torch.full((n,), -1, dtype=torch.long)
            value[1:length] = torch.tensor(heads)
            out.append((value, oracles.tree_score(arcs, heads)))
        return out

    def indicators(value: Tensor, params: Params) -> Params:
        (arcs,) = params
        ind = torch.zeros_like(arcs)
        for m, h in enumerate(value.tolist()):
            if h >= 0:
                ind[h, m] = 1
        return (ind,)

    cls = DependencyCRF if projective else NonProjectiveDependencyCRF
    count = oracles.count_projective if projective else oracles.count_nonprojective
    return Case(
        name=f"{'' if projective else 'non-'}projective-{'multi' if multiroot else 'single'}root",
        min_len=2,
        draw=_tree_draw,
        build=lambda p, lengths: cls(p[0], lengths, multiroot=multiroot),
        enumerate=enumerate_trees,
        indicators=indicators,
        marginals=lambda d: (d.marginals,),  # type: ignore[attr-defined]
        count=lambda n: count(n - 1, multiroot),
    )


# ---- span structures: structures are 0/1 indicators of the potentials' shape ------------
def _support(support: oracles.Support) -> list[tuple[Tensor, Tensor]]:
    return [(ind[0].long(), score) for ind, score in support]


def _constituency_case(labels: int | None) -> Case:
    def draw(b: int, n: int, dtype: torch.dtype, scale: float) -> Params:
        shape = (b, n, n) if labels is None else (b, n, n, labels)
        return (torch.randn(shape, dtype=dtype) * scale,)

    return Case(
        name="constituency" if labels is None else f"constituency-{labels}-labels",
        min_len=1,
        draw=draw,
        build=lambda p, lengths: TreeCRF(p[0], lengths),
        enumerate=lambda p, n: _support(oracles.tree_support(p[0], n)),
        indicators=lambda value, p: (value.to(p[0].dtype),),
        marginals=lambda d: (d.marginals,),  # type: ignore[attr-defined]
        count=lambda n: oracles.catalan(n - 1) * (labels or 1) ** (2 * n - 1),
        pad=0,
        brute_n=5 if labels is None else 4,
    )


K, SEMI_C = 3, 2


SEMI_MARKOV = Case(
    name="semi-markov",
    min_len=1,
    draw=lambda b, n, dtype, scale: (
        torch.randn(b, n, K, SEMI_C, dtype=dtype) * scale,
        torch.randn(b, SEMI_C, SEMI_C, dtype=dtype) * scale,
    ),
    build=lambda p, lengths: SemiMarkovCRF(p[0], p[1], lengths),
    enumerate=lambda p, n: _support(oracles.segmentation_support(p[0], p[1], n)),
    indicators=lambda value, p: (
        value.to(p[0].dtype),
        oracles.transition_counts(value.to(p[0].dtype), SEMI_C),
    ),
    marginals=lambda d: (d.marginals, d.transition_marginals),  # type: ignore[attr-defined]
    count=lambda n: sum(1 for _ in oracles.segmentations(n, K, SEMI_C)),
    crop=lambda p, b, n: (p[0][b : b + 1, :n], p[1][b : b + 1]),
    pad=0,
    counts=True,
)

SPLIT_TREE = Case(
    name="split-tree",
    min_len=1,
    draw=lambda b, n, dtype, scale: (torch.randn(b, n, dtype=dtype) * scale,),
    build=lambda p, lengths: SplitTreeDistribution(p[0], lengths),
    enumerate=lambda p, n: _support(oracles.split_tree_support(p[0], n)),
    indicators=lambda value, p: (value.to(p[0].dtype),),
    marginals=lambda d: (d.marginals,),  # type: ignore[attr-defined]
    count=lambda n: 1,  # log Z = 0: a distribution by construction
    crop=lambda p, b, n: (p[0][b : b + 1, :n],),
    pad=0,
    gradient=False,
)

CASES = [
    CHAIN,
    _tree_case(True),
    _tree_case(False),
    _tree_case(True, projective=False),
    _tree_case(False, projective=False),
    _constituency_case(None),
    _constituency_case(2),
    SEMI_MARKOV,
    SPLIT_TREE,
]
ids = [c.name for c in CASES]


def _item(params: Params, b: int) -> Params:
    return tuple(p[b] for p in params)


def _oracle(case: Case, params: Params, b: int, length: int) -> dict[str, object]:
    support = case.enumerate(_item(params, b), length)
    scores = torch.stack([s for _, s in support])
    summary: dict[str, object] = dict(oracles.summarize(scores))
    probs = summary["probs"]
    assert isinstance(probs, Tensor)
    marg = [torch.zeros_like(ind) for ind in case.indicators(support[0][0], _item(params, b))]
    for (value, _), prob in zip(support, probs, strict=True):
        for acc, ind in zip(marg, case.indicators(value, _item(params, b)), strict=True):
            acc += prob * ind
    summary["marginals"] = marg
    summary["support"] = support
    summary["argmax"] = support[int(scores.argmax())][0]
    return summary


@pytest.fixture(params=CASES, ids=ids)
def case(request: pytest.FixtureRequest) -> Case:
    return request.param


def _batch(case: Case, n: int = 5, dtype: torch.dtype = torch.float64):
    params = case.draw(3, n, dtype, 1.0)
    lengths = torch.tensor([n, max(case.min_len, n - 2), case.min_len])
    return params, lengths


# ---- brute-force agreement ------------------------------------------------------------------
def test_against_brute_force(case: Case) -> None:
    params, lengths = _batch(case)
    dist = case.build(params, lengths)
    marginals = case.marginals(dist)
    for b, length in enumerate(lengths.tolist()):
        ref = _oracle(case, params, b, length)
        torch.testing.assert_close(dist.log_partition[b], ref["log_partition"])
        torch.testing.assert_close(dist.max_score[b], ref["max_score"])
        torch.testing.assert_close(dist.entropy[b], ref["entropy"])
        assert torch.equal(dist.argmax[b], ref["argmax"])
        for got, want in zip(marginals, ref["marginals"], strict=True):  # type: ignore[call-overload]
            torch.testing.assert_close(got[b], want)


def test_log_prob_against_brute_force(case: Case) -> None:
    params, lengths = _batch(case)
    dist = case.build(params, lengths)
    refs = [_oracle(case, params, b, n) for b, n in enumerate(lengths.tolist())]
    for k in range(4):  # a few structures per item
        value = torch.stack([r["support"][k % len(r["support"])][0] for r in refs])  # type: ignore[index]
        want = torch.stack(
            [r["probs"][k % len(r["support"])].log() for r in refs]  # type: ignore[index]
        )
        torch.testing.assert_close(dist.log_prob(value), want)


def test_topk_chain_against_brute_force() -> None:
    params, lengths = _batch(CHAIN, n=4)
    dist = LinearChainCRF(params[0], params[1], lengths)
    k = 5
    scores, labels = dist.topk(k)
    assert scores.shape == (k, 3) and labels.shape == (k, 3, 4)
    for b, length in enumerate(lengths.tolist()):
        support = _chain_enumerate(_item(params, b), length)
        ranked = sorted(support, key=lambda vs: -float(vs[1]))
        want = torch.stack([s for _, s in ranked[:k]])
        got = scores[: len(want), b]
        torch.testing.assert_close(got, want)
        for r in range(min(k, len(ranked))):  # labels reproduce their scores
            z = tuple(int(v) for v in labels[r, b, :length])
            assert labels[r, b, length:].eq(-1).all()
            torch.testing.assert_close(
                oracles.chain_score(params[0][b], params[1][b], z), scores[r, b]
            )
        if len(ranked) < k:  # fewer structures than k: -inf and -1
            assert torch.isneginf(scores[len(ranked) :, b]).all()
    # the 1-best is the argmax
    assert torch.equal(labels[0], dist.argmax)


def test_sample_frequencies(case: Case) -> None:
    n = 4
    params = case.draw(1, n, torch.float64, 1.0)
    dist = case.build(params, None)
    ref = _oracle(case, params, 0, n)
    support = ref["support"]
    probs = ref["probs"]
    assert isinstance(support, list) and isinstance(probs, Tensor)
    index = {tuple(v.flatten().tolist()): i for i, (v, _) in enumerate(support)}
    draws = 4000
    samples = dist.sample(draws)
    assert samples.shape == (draws, 1, *support[0][0].shape)
    counts = torch.zeros(len(support), dtype=torch.float64)
    for s in samples[:, 0]:
        # KeyError = an invalid structure was sampled
        counts[index[tuple(s.flatten().tolist())]] += 1
    tv = 0.5 * (counts / draws - probs).abs().sum()
    # expected total variation of the empirical distribution ~ sqrt(S / (2 pi draws))
    assert tv < 3 * math.sqrt(len(support) / (2 * math.pi * draws)), float(tv)


# ---- counts, padding, degenerate ------------------------------------------------------------
def test_counts_with_zero_potentials(case: Case) -> None:
    for n in range(case.min_len, 7):
        params = tuple(torch.zeros_like(p) for p in case.draw(1, n, torch.float64, 1.0))
        dist = case.build(params, None)
        torch.testing.assert_close(
            dist.log_partition, torch.tensor([math.log(case.count(n))], dtype=torch.float64)
        )


def test_padding_invariance(case: Case) -> None:
    n = 7
    params = case.draw(4, n, torch.float64, 1.0)
    lengths = torch.tensor([7, 5, 3, case.min_len])
    # garbage in the padding must not matter
    params = tuple(p.clone() for p in params)
    padded = case.build(params, lengths)
    marginals = case.marginals(padded)
    for b, length in enumerate(lengths.tolist()):
        alone = case.build(case.crop(params, b, length), None)
        torch.testing.assert_close(padded.log_partition[b], alone.log_partition[0])
        torch.testing.assert_close(padded.entropy[b], alone.entropy[0])
        region = tuple(slice(0, s) for s in alone.argmax.shape[1:])
        assert torch.equal(padded.argmax[(b, *region)], alone.argmax[0])
        outside = padded.argmax[b].clone()
        outside[region] = case.pad
        assert outside.eq(case.pad).all()
        for got, want in zip(marginals, case.marginals(alone), strict=True):
            region = tuple(slice(0, s) for s in want.shape[1:])
            torch.testing.assert_close(got[(b, *region)], want[0])
            assert got[b].sum() == pytest.approx(want[0].sum())  # zero outside the region


def test_chain_length_one_and_independent_positions() -> None:
    unary = torch.randn(2, 4, 3, dtype=torch.float64)
    dist = LinearChainCRF(unary)  # no pairwise: independent softmaxes
    torch.testing.assert_close(dist.marginals, unary.softmax(-1))
    torch.testing.assert_close(dist.log_partition, unary.logsumexp(-1).sum(-1))
    single = LinearChainCRF(unary[:, :1], torch.randn(3, 3, dtype=torch.float64))
    torch.testing.assert_close(single.marginals, unary[:, :1].softmax(-1))
    assert single.edge_marginals.shape == (2, 0, 3, 3)


def test_tree_one_word() -> None:
    arcs = torch.randn(2, 2, 2, dtype=torch.float64)
    for multiroot in (True, False):
        dist = DependencyCRF(arcs, multiroot=multiroot)
        torch.testing.assert_close(dist.log_partition, arcs[:, 0, 1])
        assert dist.argmax.tolist() == [[-1, 0], [-1, 0]]
        torch.testing.assert_close(dist.marginals[:, 0, 1], torch.ones(2, dtype=torch.float64))


def test_tree_marginals_columns_sum_to_one() -> None:
    arcs = torch.randn(3, 9, 9)
    lengths = torch.tensor([9, 6, 2])
    for multiroot in (True, False):
        marg = DependencyCRF(arcs, lengths, multiroot).marginals
        sums = marg.sum(1)  # [B, N]: total head probability of each modifier
        for b, n in enumerate(lengths.tolist()):
            torch.testing.assert_close(sums[b, 1:n], torch.ones(n - 1))
            assert sums[b, 0] == 0 and sums[b, n:].eq(0).all()
        if not multiroot:
            torch.testing.assert_close(marg[:, 0].sum(-1), torch.ones(3))


def test_tree_log_prob_rejects_invalid() -> None:
    arcs = torch.randn(1, 5, 5, dtype=torch.float64)
    dist = DependencyCRF(arcs)
    cyclic = torch.tensor([[-1, 2, 1, 0, 0]])
    non_projective = torch.tensor([[-1, 3, 0, 0, 1]])  # 1 <- 3 crosses 4 <- 1? arcs (3,1),(1,4)
    two_roots = torch.tensor([[-1, 0, 0, 2, 2]])
    out_of_range = torch.tensor([[-1, 7, 0, 2, 2]])
    assert torch.isneginf(dist.log_prob(cyclic)).all()
    with pytest.raises(ValueError, match="heads"):  # an error, not a silent -inf loss
        dist.log_prob(out_of_range)
    assert torch.isfinite(dist.log_prob(two_roots)).all()
    assert torch.isneginf(DependencyCRF(arcs, multiroot=False).log_prob(two_roots)).all()
    assert torch.isneginf(dist.log_prob(non_projective)).all()


def test_public_protocol_num_tokens_and_impossible_reason() -> None:
    chain = LinearChainCRF(torch.randn(2, 4, 3), torch.randn(2, 3, 3, 3))
    assert chain.num_tokens.tolist() == [4, 4]
    chain = LinearChainCRF(torch.randn(2, 4, 3), lengths=torch.tensor([4, 2]))
    assert chain.num_tokens.tolist() == [4, 2]
    arcs, lengths = torch.randn(3, 5, 5), torch.tensor([5, 3, 2])
    for cls in (DependencyCRF, NonProjectiveDependencyCRF):
        assert cls(arcs, lengths).num_tokens.tolist() == [4, 2, 1]  # words: no ROOT
    heads = torch.tensor(
        [[-1, 3, 0, 0, 1], [-1, 2, 1, -1, -1], [-1, -1, -1, -1, -1]]  # crossing, cycle, none
    )
    projective = DependencyCRF(arcs, lengths)
    assert "non-projective" in projective.impossible_reason(heads, 0)
    assert projective.impossible_reason(heads, 1) == "not a tree (a cycle or a self-loop)"
    assert projective.impossible_reason(heads, 2) == "heads of -1 at every word (no tree)"
    two_roots = torch.tensor([[-1, 0, 0, 2, 2]])
    single = NonProjectiveDependencyCRF(arcs[:1], multiroot=False)
    assert single.impossible_reason(two_roots, 0).startswith("2 children of ROOT")
    banned = torch.zeros(1, 3, 3)
    banned[0, 0, 1] = float("-inf")
    chain = LinearChainCRF(banned)  # label 1 at position 0 is forbidden
    assert "-inf" in chain.impossible_reason(torch.tensor([[1, 0, 0]]), 0)


# ---- gradients ----------------------------------------------------------------------------
def test_gradcheck_and_gradgradcheck(case: Case) -> None:
    params, lengths = _batch(case, n=4)
    params = tuple(p.detach().requires_grad_() for p in params)

    def logz(*p: Tensor) -> Tensor:
        return case.build(p, lengths).log_partition

    def marginals(*p: Tensor) -> tuple[Tensor, ...]:
        return case.marginals(case.build(p, lengths))

    assert torch.autograd.gradcheck(logz, params)
    assert torch.autograd.gradgradcheck(logz, params)
    assert torch.autograd.gradcheck(marginals, params)
    assert torch.autograd.gradgradcheck(marginals, params)


def test_marginals_are_gradient_of_log_partition(case: Case) -> None:
    params, lengths = _batch(case)
    params = tuple(p.detach().requires_grad_() for p in params)
    dist = case.build(params, lengths)
    if not case.gradient:
        pytest.skip(f"{case.name}: log Z = 0, its marginals are over nodes")
    grads = torch.autograd.grad(dist.log_partition.sum(), params)
    if case.name in ("chain", "semi-markov"):
        torch.testing.assert_close(grads[1], case.marginals(dist)[1])
    if case.name == "chain":  # pairwise given per position: edge marginals are its gradient
        torch.testing.assert_close(grads[1], dist.edge_marginals)  # type: ignore[attr-defined]
    torch.testing.assert_close(grads[0], case.marginals(dist)[0])


def test_entropy_gradient_matches_finite_differences(case: Case) -> None:
    params, lengths = _batch(case, n=4)
    params = tuple(p.detach().requires_grad_() for p in params)
    assert torch.autograd.gradcheck(lambda *p: case.build(p, lengths).entropy, params)


# ---- numerical stability --------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1.0, 1e2, 1e4])
def test_float32_large_scores_are_finite(case: Case, scale: float) -> None:
    params = tuple(p.requires_grad_() for p in case.draw(4, 12, torch.float32, scale))
    lengths = torch.tensor([12, 9, 4, case.min_len])
    dist = case.build(params, lengths)
    outs = [dist.log_partition, dist.entropy, dist.max_score, *case.marginals(dist)]
    for out in outs:
        assert torch.isfinite(out).all()
    loss = dist.log_partition.sum() + sum((m * m).sum() for m in case.marginals(dist))
    for g in torch.autograd.grad(loss, params):
        assert torch.isfinite(g).all()
    for i, m in enumerate(case.marginals(dist)):
        assert (m >= -1e-4).all()  # float32 round-off
        assert (m <= 1 + 1e-4).all() or (case.counts and i > 0)  # probabilities


def test_chain_no_repeat_diagonal_minus_inf() -> None:
    """K-step fact CRF: pairwise -inf on the diagonal (never the same fact twice in a row)."""
    k, n_facts = 4, 3
    unary = torch.randn(2, k, n_facts, dtype=torch.float64, requires_grad=True)
    pairwise = torch.zeros(n_facts, n_facts, dtype=torch.float64)
    pairwise.fill_diagonal_(float("-inf"))
    pairwise.requires_grad_()
    dist = LinearChainCRF(unary, pairwise)
    support = [
        z for z in oracles.chains(k, n_facts) if all(a != b for a, b in zip(z, z[1:], strict=False))
    ]
    for b in range(2):
        scores = torch.stack([sum(unary[b, i, z[i]] for i in range(k)) for z in support])
        torch.testing.assert_close(dist.log_partition[b], scores.logsumexp(0))
    assert (dist.edge_marginals.diagonal(dim1=-2, dim2=-1) == 0).all()
    loss = dist.log_partition.sum() + dist.marginals.pow(2).sum() + dist.entropy.sum()
    for g in torch.autograd.grad(loss, (unary, pairwise)):
        assert torch.isfinite(g).all()
    z = dist.argmax
    assert (z[:, 1:] != z[:, :-1]).all()
    samples = dist.sample(50)
    assert (samples[..., 1:] != samples[..., :-1]).all()
    f32 = LinearChainCRF(unary.float().detach(), pairwise.float().detach())
    assert torch.isfinite(f32.marginals).all() and torch.isfinite(f32.log_partition).all()


def test_item_with_no_valid_structure(case: Case) -> None:
    """Documented behaviour: log Z = -inf, zero marginals, finite gradients, argmax -1."""
    if not case.gradient:
        pytest.skip(f"{case.name}: every item has trees (log Z = 0)")
    params = case.draw(2, 4, torch.float64, 1.0)
    params = tuple(p.clone() for p in params)
    params[0][1].fill_(float("-inf"))  # item 1: every structure is impossible
    params = tuple(p.requires_grad_() for p in params)
    dist = case.build(params, None)
    assert torch.isneginf(dist.log_partition[1]) and torch.isfinite(dist.log_partition[0])
    for m in case.marginals(dist):
        assert (m[1] == 0).all() and torch.isfinite(m).all()
    assert dist.argmax[1].eq(-1).all() and torch.isneginf(dist.max_score[1])
    assert dist.entropy[1] == 0
    loss = dist.log_partition[0] + sum(m.sum() for m in case.marginals(dist))
    for g in torch.autograd.grad(loss, params):
        assert torch.isfinite(g).all()


def test_empty_batch(case: Case) -> None:
    params = tuple(p.requires_grad_() for p in case.draw(0, 5, torch.float64, 1.0))
    dist = case.build(params, None)
    assert dist.log_partition.shape == (0,) and dist.entropy.shape == (0,)
    assert dist.argmax.shape[0] == 0 and dist.sample(2).shape[:2] == (2, 0)
    loss = dist.log_partition.sum() + sum(m.sum() for m in case.marginals(dist))
    for p, g in zip(params, torch.autograd.grad(loss, params), strict=True):
        assert g.shape == p.shape


# ---- inputs -------------------------------------------------------------------------------
def test_bad_inputs_raise_value_error_naming_argument() -> None:
    with pytest.raises(ValueError, match="unary"):
        LinearChainCRF(torch.randn(2, 3))
    with pytest.raises(ValueError, match="unary"):
        LinearChainCRF(torch.randint(0, 3, (2, 3, 3)))
    with pytest.raises(ValueError, match="unary"):
        LinearChainCRF(torch.tensor([[[float("nan")]]]))
    with pytest.raises(ValueError, match="pairwise"):
        LinearChainCRF(torch.randn(2, 3, 4), torch.randn(3, 3))
    with pytest.raises(ValueError, match="lengths"):
        LinearChainCRF(torch.randn(2, 3, 4), lengths=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="lengths"):
        LinearChainCRF(torch.randn(2, 3, 4), lengths=torch.tensor([1.0, 3.0]))
    with pytest.raises(ValueError, match="arc_scores"):
        DependencyCRF(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="lengths"):
        DependencyCRF(torch.randn(2, 3, 3), lengths=torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="labels"):
        LinearChainCRF(torch.randn(2, 3, 4)).log_prob(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        LinearChainCRF(torch.randn(2, 3, 4)).log_prob(torch.full((2, 3), 4))
    with pytest.raises(ValueError, match="k"):
        LinearChainCRF(torch.randn(2, 3, 4)).topk(0)
    with pytest.raises(ValueError, match="n"):
        DependencyCRF(torch.randn(2, 3, 3)).sample(0)


def test_works_under_no_grad_and_inference_mode() -> None:
    arcs = torch.randn(2, 5, 5, requires_grad=True)
    with torch.no_grad():
        marg = DependencyCRF(arcs).marginals
    assert not marg.requires_grad
    with torch.inference_mode():
        marg2 = DependencyCRF(arcs * 1).marginals
        chain = LinearChainCRF(torch.randn(2, 4, 3)).marginals
    torch.testing.assert_close(marg, marg2)
    assert chain.shape == (2, 4, 3)
    # the cached [N, N] masks of a size first seen under inference_mode serve autograd later
    with torch.inference_mode():
        assert DependencyCRF(torch.randn(2, 11, 11)).log_partition.isfinite().all()
    arcs = torch.randn(2, 11, 11, requires_grad=True)
    DependencyCRF(arcs).log_partition.sum().backward()
    assert arcs.grad is not None and bool(arcs.grad.isfinite().all())


# ---- property-based ---------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    size=st.integers(2, 7),
    multiroot=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_tree_properties(batch: int, size: int, multiroot: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    arcs = torch.randn(batch, size, size, generator=gen, dtype=torch.float64)
    lengths = torch.randint(2, size + 1, (batch,), generator=gen)
    dist = DependencyCRF(arcs, lengths, multiroot)
    sums = dist.marginals.sum(1)
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(sums[b, 1:n], torch.ones(n - 1, dtype=torch.float64))
    assert (dist.log_partition >= dist.max_score - 1e-9).all()
    assert torch.isfinite(dist.log_prob(dist.argmax)).all()
    torch.testing.assert_close(dist.log_prob(dist.argmax), dist.max_score - dist.log_partition)
    assert (dist.entropy >= -1e-9).all()


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    size=st.integers(1, 8),
    labels=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_chain_properties(batch: int, size: int, labels: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    unary = torch.randn(batch, size, labels, generator=gen, dtype=torch.float64)
    pairwise = torch.randn(labels, labels, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, size + 1, (batch,), generator=gen)
    dist = LinearChainCRF(unary, pairwise, lengths)
    sums = dist.marginals.sum(-1)
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(sums[b, :n], torch.ones(n, dtype=torch.float64))
        edge = dist.edge_marginals[b, : n - 1]
        torch.testing.assert_close(edge.sum(-1), dist.marginals[b, : n - 1])
        torch.testing.assert_close(edge.sum(-2), dist.marginals[b, 1:n])
    torch.testing.assert_close(dist.log_prob(dist.argmax), dist.max_score - dist.log_partition)
    assert (dist.entropy >= -1e-9).all()


def _keep_split_weights(cache: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``cached``: every width's split weights kept; ``recomputed``: none (and the kernels'
    ATen path); ``partly``: some widths (the rest recomputed, as beyond _CACHE_ELEMENTS): the
    kernels' first half, the PyTorch code's odd widths."""
    from structattn.structs import dependency

    if cache == "recomputed":
        monkeypatch.setattr(dependency, "_CACHE_ELEMENTS", 0)
        monkeypatch.setattr(dependency, "_FUSED_SIZE", 0)  # the ATen path, recomputing
    elif cache == "partly":
        monkeypatch.setattr(dependency, "_kept_widths", lambda batch, size: size // 2)
        monkeypatch.setattr(
            dependency, "_kept_mask", lambda batch, size: [w % 2 == 1 for w in range(1, size)]
        )


@pytest.mark.parametrize("cache", ["cached", "recomputed", "partly"])
@pytest.mark.parametrize("multiroot", [True, False], ids=["multiroot", "oneroot"])
def test_eisner_hand_written_outside_matches_autograd(
    multiroot: bool, cache: str, monkeypatch: pytest.MonkeyPatch, kernel_backend: str
) -> None:
    """log Z's backward by the hand-written outside pass equals autograd through the inside
    pass (padding, -inf arcs, an item with no tree), and so does its double backward (the
    hand-written Hessian-vector product, with split weights kept, recomputed, or kept for
    the narrow widths only)."""
    from structattn.semirings import LogSemiring
    from structattn.structs.dependency import eisner_inside, eisner_log_partition

    _keep_split_weights(cache, monkeypatch)

    gen = torch.Generator().manual_seed(21)
    scores = torch.randn(5, 9, 9, dtype=torch.float64, generator=gen) * 3
    scores[:, :, 0] = float("-inf")
    scores[1] = scores[1].masked_fill(torch.rand(9, 9, generator=gen) < 0.3, float("-inf"))
    scores[2, :, 4] = float("-inf")  # word 4 has no head: no tree
    lengths = torch.tensor([9, 7, 9, 2, 5])
    weights = torch.randn(5, 9, 9, dtype=torch.float64, generator=gen)
    results = []
    for fn in (eisner_log_partition, lambda *a: eisner_inside(*a, LogSemiring)):
        x = scores.clone().requires_grad_(True)
        logz = fn(x, lengths, multiroot)
        (marginals,) = torch.autograd.grad(logz.sum(), x, create_graph=True)
        (second,) = torch.autograd.grad((marginals * weights).sum(), x)
        x2 = scores.clone().requires_grad_(True)
        (plain,) = torch.autograd.grad(fn(x2, lengths, multiroot).sum(), x2)
        results.append((logz.detach(), marginals.detach(), second, plain))
    assert torch.isneginf(results[0][0][2]) and torch.isfinite(results[0][3]).all()
    for fast, reference in zip(*results, strict=True):
        torch.testing.assert_close(fast, reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cache", ["cached", "recomputed", "partly"])
@pytest.mark.parametrize("multiroot", [True, False], ids=["multiroot", "oneroot"])
def test_eisner_hessian_vector_product_gradchecks(
    multiroot: bool, cache: str, monkeypatch: pytest.MonkeyPatch, kernel_backend: str
) -> None:
    """The hand-written Hessian-vector product (backward of the marginals; split weights kept
    from the outside pass, recomputed, or both by width) passes gradcheck, scales with the
    incoming gradient of log Z, and its own derivative (third order, by the autograd
    fallback) passes too."""
    from structattn.structs.dependency import eisner_log_partition

    _keep_split_weights(cache, monkeypatch)

    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(3, 5, 5, dtype=torch.float64, generator=gen)
    scores[:, :, 0] = float("-inf")
    scores[0, 2, 3] = float("-inf")  # a forbidden arc
    lengths = torch.tensor([5, 3, 4])
    seed = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64, requires_grad=True)
    finite = torch.isfinite(scores)

    def marginals(x: Tensor, s: Tensor) -> Tensor:
        full = scores.masked_scatter(finite, x)  # -inf entries stay fixed
        logz = eisner_log_partition(full, lengths, multiroot)
        (m,) = torch.autograd.grad(logz, full, s, create_graph=True)
        return m[finite]

    x = scores[finite].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(marginals, (x, seed))
    assert torch.autograd.gradgradcheck(marginals, (x, seed))


@pytest.mark.parametrize("multiroot", [True, False], ids=["multiroot", "oneroot"])
def test_eisner_hand_written_backtrack_matches_autograd(multiroot: bool) -> None:
    """The MAP score and its gradient (the best tree) by the hand-written backtrack equal
    the max-semiring inside pass and its autograd gradient (padding, -inf arcs, no tree)."""
    from structattn.semirings import MaxSemiring
    from structattn.structs.dependency import eisner_inside, eisner_max

    gen = torch.Generator().manual_seed(8)
    scores = torch.randn(6, 10, 10, dtype=torch.float64, generator=gen) * 3
    scores[:, :, 0] = float("-inf")
    scores[1] = scores[1].masked_fill(torch.rand(10, 10, generator=gen) < 0.4, float("-inf"))
    scores[2, :, 4] = float("-inf")  # word 4 has no head: no tree
    lengths = torch.tensor([10, 8, 10, 2, 5, 3])
    results = []
    for fn in (eisner_max, lambda *a: eisner_inside(*a, MaxSemiring)):
        x = scores.clone().requires_grad_(True)
        best = fn(x, lengths, multiroot)
        (tree,) = torch.autograd.grad(best, x, torch.arange(1.0, 7.0, dtype=torch.float64))
        results.append((best.detach(), tree))
    assert torch.isneginf(results[0][0][2])
    for fast, reference in zip(*results, strict=True):
        torch.testing.assert_close(fast, reference, rtol=0, atol=0)
    # the valid items' gradients are trees: one head per real word, weighted by the seed
    heads = results[0][1].sum(1)
    for b, n in enumerate(lengths.tolist()):
        if b != 2:
            assert torch.equal(heads[b, 1:n], torch.full((n - 1,), b + 1.0, dtype=torch.float64))


def test_eisner_saved_state_survives_repeated_backward(kernel_backend: str) -> None:
    """The charts and split weights kept for the backward passes are not consumed: backward
    twice through the same graph (``retain_graph``) gives the same gradients."""
    from structattn.structs.dependency import eisner_log_partition

    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 7, 7, generator=gen, dtype=torch.float64)
    scores[:, :, 0] = float("-inf")
    x = scores.clone().requires_grad_(True)
    logz = eisner_log_partition(x, torch.tensor([7, 5, 3]), True)
    (marginals,) = torch.autograd.grad(logz.sum(), x, create_graph=True, retain_graph=True)
    weights = torch.randn(3, 7, 7, generator=gen, dtype=torch.float64)
    grads = [
        torch.autograd.grad((marginals * weights).sum(), x, retain_graph=True)[0] for _ in range(2)
    ]
    again = torch.autograd.grad(logz.sum(), x, retain_graph=True)[0]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    torch.testing.assert_close(again, marginals.detach(), rtol=0, atol=0)
    assert grads[0].abs().sum() > 0


def test_kept_split_weights_fit_the_budget_and_grow_smoothly() -> None:
    """The kept split weights stay within _CACHE_ELEMENTS, are all kept while they fit, and
    one more position recomputes only a few widths (no all-or-nothing step, #42)."""
    from structattn.structs import dependency

    budget = dependency._CACHE_ELEMENTS
    for batch, size in [(32, 64), (32, 65), (32, 80), (8, 101), (8, 102), (1, 2), (1, 1)]:
        sizes = [3 * batch * w * (size - w) for w in range(1, size)]
        mask = dependency._kept_mask(batch, size)
        prefix = dependency._kept_widths(batch, size)
        assert len(mask) == max(size - 1, 0)
        if sum(sizes) <= budget:
            assert all(mask) and prefix == size - 1
            continue
        assert sum(n for n, k in zip(sizes, mask, strict=True) if k) <= budget
        assert sum(sizes[:prefix]) <= budget < sum(sizes[: prefix + 1])
    assert dependency._kept_mask(32, 64).count(False) == 0
    assert dependency._kept_mask(32, 65).count(False) <= 3  # the widest few middle widths
