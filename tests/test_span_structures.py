"""Span structures (TreeCRF, SemiMarkovCRF, SplitTreeDistribution) against brute force.

As in ``test_distributions.py``, each ``Case`` says how to draw potentials, build the
distribution and enumerate every structure of one item with its score and its part
indicators (whose expectation is the marginals); the invariants below are shared.
Structures are 0/1 indicator tensors of the potentials' shape.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import oracles
import pytest
import torch
from torch import Tensor

from structattn import (
    LinearChainCRF,
    SemiMarkovCRF,
    SplitTreeDistribution,
    TreeCRF,
    structured_nll,
)
from structattn.distributions.base import StructuredDistribution
from structattn.semirings import LogSemiring
from structattn.structs.constituency import cky_inside
from structattn.structs.semi_markov import semi_markov_inside
from structattn.trees import split_tree

Params = tuple[Tensor, ...]
Support = oracles.Support  # (part indicators of one item, score)


@dataclass(frozen=True)
class Case:
    name: str
    draw: Callable[[int, int, torch.dtype, float], Params]  # (B, N, dtype, scale) -> params
    build: Callable[[Params, Tensor | None], StructuredDistribution]
    enumerate: Callable[[Params, int], Support]  # (params of one item, length) -> support
    marginals: Callable[[Any], Params]
    brute_n: int  # largest size enumerated in the tests


# ---- constituency trees ----------------------------------------------------------------------
def _tree_case(labels: int | None) -> Case:
    def draw(b: int, n: int, dtype: torch.dtype, scale: float) -> Params:
        shape = (b, n, n) if labels is None else (b, n, n, labels)
        return (torch.randn(shape, dtype=dtype) * scale,)

    return Case(
        name="tree" if labels is None else f"tree-{labels}-labels",
        draw=draw,
        build=lambda p, lengths: TreeCRF(p[0], lengths),
        enumerate=lambda p, length: oracles.tree_support(p[0], length),
        marginals=lambda d: (d.marginals,),
        brute_n=5 if labels is None else 4,
    )


# ---- semi-Markov ----------------------------------------------------------------------------
K, C = 3, 2


def _semi_draw(b: int, n: int, dtype: torch.dtype, scale: float) -> Params:
    return (
        torch.randn(b, n, K, C, dtype=dtype) * scale,
        torch.randn(b, C, C, dtype=dtype) * scale,
    )


SEMI = Case(
    name="semi-markov",
    draw=_semi_draw,
    build=lambda p, lengths: SemiMarkovCRF(p[0], p[1], lengths),
    enumerate=lambda p, length: oracles.segmentation_support(p[0], p[1], length),
    marginals=lambda d: (d.marginals, d.transition_marginals),
    brute_n=5,
)


# ---- split trees ----------------------------------------------------------------------------
SPLIT = Case(
    name="split-tree",
    draw=lambda b, n, dtype, scale: (torch.randn(b, n, dtype=dtype) * scale,),
    build=lambda p, lengths: SplitTreeDistribution(p[0], lengths),
    enumerate=lambda p, length: oracles.split_tree_support(p[0], length),
    marginals=lambda d: (d.marginals,),
    brute_n=5,
)

CASES = [_tree_case(None), _tree_case(2), SEMI, SPLIT]


@pytest.fixture(params=CASES, ids=[c.name for c in CASES])
def case(request: pytest.FixtureRequest) -> Case:
    return request.param


def _item(params: Params, b: int) -> Params:
    return tuple(p[b] for p in params)


def _oracle(case: Case, params: Params, b: int, length: int) -> dict[str, Any]:
    support = case.enumerate(_item(params, b), length)
    scores = torch.stack([torch.as_tensor(s, dtype=params[0].dtype) for _, s in support])
    ref: dict[str, Any] = dict(oracles.summarize(scores))
    marg = [torch.zeros_like(ind) for ind in support[0][0]]
    for (inds, _), prob in zip(support, ref["probs"], strict=True):
        for acc, ind in zip(marg, inds, strict=True):
            acc += prob * ind
    ref["marginals"] = marg
    ref["support"] = support
    ref["argmax"] = support[int(scores.argmax())][0][0].long()
    return ref


def _batch(case: Case, dtype: torch.dtype = torch.float64) -> tuple[Params, Tensor]:
    n = case.brute_n
    return case.draw(3, n, dtype, 1.0), torch.tensor([n, n - 2, 1])


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
        for got, want in zip(marginals, ref["marginals"], strict=True):
            torch.testing.assert_close(got[b], want)


def test_log_prob_against_brute_force(case: Case) -> None:
    params, lengths = _batch(case)
    dist = case.build(params, lengths)
    refs = [_oracle(case, params, b, n) for b, n in enumerate(lengths.tolist())]
    for k in range(0, 40, 7):  # a few structures per item
        value = torch.stack([r["support"][k % len(r["support"])][0][0] for r in refs]).long()
        want = torch.stack([r["probs"][k % len(r["support"])].log() for r in refs])
        torch.testing.assert_close(dist.log_prob(value), want)
    # the argmax has log-probability max_score - log Z; a sum of two structures is none
    torch.testing.assert_close(dist.log_prob(dist.argmax), dist.max_score - dist.log_partition)
    two = refs[0]["support"][0][0][0] + refs[0]["support"][1][0][0]
    value = dist.argmax.clone()
    value[0] = two.clamp_max(1).long()
    assert (
        torch.isneginf(dist.log_prob(value)[0]) and torch.isfinite(dist.log_prob(value)[1:]).all()
    )


def test_sample_frequencies(case: Case) -> None:
    """Chi-square goodness of fit of 10000 exact samples per item, variable lengths
    (p-value > 1e-3; fixed seed)."""
    n = 3 if case.name.startswith("tree-") else 4
    params = case.draw(2, n, torch.float64, 0.5)
    lengths = torch.tensor([n, n - 1])
    dist = case.build(params, lengths)
    draws = 10000
    samples = dist.sample(draws)
    assert samples.shape == (draws, *dist.argmax.shape)
    for b, length in enumerate(lengths.tolist()):
        ref = _oracle(case, params, b, length)
        support = ref["support"]
        index = {tuple(inds[0].flatten().tolist()): i for i, (inds, _) in enumerate(support)}
        counts = torch.zeros(len(index), dtype=torch.float64)
        for s in samples[:, b]:
            counts[index[tuple(s.double().flatten().tolist())]] += 1  # KeyError: invalid
        expected = ref["probs"] * draws
        chi2 = ((counts - expected) ** 2 / expected).sum()
        dof = torch.tensor((len(index) - 1) / 2, dtype=torch.float64)
        p_value = torch.special.gammaincc(dof, chi2 / 2)
        assert p_value > 1e-3, (float(chi2), len(index))


# ---- counts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("labels", [None, 1, 3])
def test_tree_counts_with_zero_scores(labels: int | None) -> None:
    for n in range(1, 8):
        shape = (1, n, n) if labels is None else (1, n, n, labels)
        logz = TreeCRF(torch.zeros(shape, dtype=torch.float64)).log_partition
        count = oracles.catalan(n - 1) * (labels or 1) ** (2 * n - 1)
        torch.testing.assert_close(logz, torch.tensor([math.log(count)], dtype=torch.float64))
        assert len(oracles.bracketings(0, n - 1)) == oracles.catalan(n - 1)


def test_semi_markov_counts_with_zero_scores() -> None:
    for n in range(1, 8):
        for labels in (1, 2, 3):
            # segments of any length: C (C + 1)^(n - 1) (each gap between positions is a
            # boundary with one of C new labels, or none)
            dist = SemiMarkovCRF(torch.zeros(1, n, n, labels, dtype=torch.float64))
            want = math.log(labels) + (n - 1) * math.log(labels + 1)
            torch.testing.assert_close(
                dist.log_partition, torch.tensor([want], dtype=torch.float64)
            )
        # segments of length 1 or 2, one label: Fibonacci
        fib = [1, 1]
        while len(fib) <= n:
            fib.append(fib[-1] + fib[-2])
        dist = SemiMarkovCRF(torch.zeros(1, n, 2, 1, dtype=torch.float64))
        torch.testing.assert_close(
            dist.log_partition, torch.tensor([math.log(fib[n])], dtype=torch.float64)
        )
        assert sum(1 for _ in oracles.segmentations(n, 2, 1)) == fib[n]


def test_split_tree_log_partition_is_zero_and_counts() -> None:
    for n in range(1, 8):
        for scale in (0.0, 1.0, 5.0):
            scores = torch.randn(2, n, dtype=torch.float64) * scale
            dist = SplitTreeDistribution(scores)
            torch.testing.assert_close(dist.log_partition, torch.zeros(2, dtype=torch.float64))
            # n nodes per tree, the whole sentence always one of them
            torch.testing.assert_close(
                dist.marginals.sum((1, 2)), torch.full((2,), float(n)).double()
            )
            torch.testing.assert_close(dist.marginals[:, 0, n - 1], torch.ones(2).double())
        assert len(oracles.split_trees(0, n - 1)) == oracles.catalan(n)
    f32 = SplitTreeDistribution(torch.randn(3, 30) * 1e4).log_partition
    assert f32.abs().max() < 1e-2  # round-off only


# ---- gradients ------------------------------------------------------------------------------
def test_gradcheck_and_gradgradcheck(case: Case) -> None:
    params = tuple(p.requires_grad_() for p in case.draw(3, 4, torch.float64, 1.0))
    lengths = torch.tensor([4, 3, 1])

    def logz(*p: Tensor) -> Tensor:
        return case.build(p, lengths).log_partition

    def marginals(*p: Tensor) -> tuple[Tensor, ...]:
        return case.marginals(case.build(p, lengths))

    def entropy(*p: Tensor) -> Tensor:
        return case.build(p, lengths).entropy

    assert torch.autograd.gradcheck(logz, params)
    assert torch.autograd.gradgradcheck(logz, params)
    assert torch.autograd.gradcheck(marginals, params)
    assert torch.autograd.gradgradcheck(marginals, params)
    assert torch.autograd.gradcheck(entropy, params)


def test_marginals_are_gradient_of_log_partition() -> None:
    for case in (CASES[0], CASES[1], SEMI):
        params, lengths = _batch(case)
        params = tuple(p.requires_grad_() for p in params)
        dist = case.build(params, lengths)
        grads = torch.autograd.grad(dist.log_partition.sum(), params)
        for got, want in zip(grads, case.marginals(dist), strict=True):
            torch.testing.assert_close(got, want)


# ---- padding, -inf, stability, length 1 -----------------------------------------------------
def _nan_padding(case: Case, params: Params, lengths: Tensor) -> Params:
    """NaN at every entry that the distribution must ignore."""
    out = tuple(p.clone() for p in params)
    n = params[0].shape[1]
    pos = torch.arange(n)
    for b, length in enumerate(lengths.tolist()):
        if case is SPLIT:
            out[0][b, length:] = float("nan")
        elif case is SEMI:
            past = pos.unsqueeze(-1) + torch.arange(K) >= length  # [N, K]: ends past it
            out[0][b][past] = float("nan")
        else:
            ignored = (pos.unsqueeze(-1) > pos) | (pos >= length)  # below diagonal, padding
            out[0][b][ignored] = float("nan")
            out[0][b][:, length:] = float("nan")
    return out


def test_padding_invariance(case: Case) -> None:
    n = 6
    params = case.draw(4, n, torch.float64, 1.0)
    lengths = torch.tensor([6, 4, 2, 1])
    params = tuple(p.requires_grad_() for p in _nan_padding(case, params, lengths))
    padded = case.build(params, lengths)  # validation ignores the padding too
    marginals = case.marginals(padded)
    for b, length in enumerate(lengths.tolist()):
        if case is SPLIT:
            item: Params = (params[0][b : b + 1, :length],)
        elif case is SEMI:
            item = (params[0][b : b + 1, :length], params[1][b : b + 1])
        else:
            item = (params[0][b : b + 1, :length, :length],)
        alone = case.build(tuple(p.detach() for p in item), None)
        torch.testing.assert_close(padded.log_partition[b], alone.log_partition[0])
        torch.testing.assert_close(padded.entropy[b], alone.entropy[0])
        torch.testing.assert_close(padded.max_score[b], alone.max_score[0])
        for got, want in zip(
            (padded.argmax, *marginals), (alone.argmax, *case.marginals(alone)), strict=True
        ):
            region = (b, *(slice(0, s) for s in want.shape[1:]))
            torch.testing.assert_close(got[region], want[0].to(got.dtype))
            assert float(got[b].detach().sum()) == pytest.approx(float(want[0].detach().sum()))
    loss = padded.log_partition.sum() + sum((m * m).sum() for m in marginals)
    for g in torch.autograd.grad(loss, params):
        assert torch.isfinite(g).all()


def test_minus_inf_spans_against_brute_force() -> None:
    """Forbid the spans that cross the bracket [1, 2] and the span [0, 3]."""
    n = 5
    scores = torch.randn(2, n, n, 2, dtype=torch.float64)
    for i in range(n):
        for j in range(i, n):
            if (i < 1 <= j < 2) or (1 < i <= 2 < j) or (i, j) == (0, 3):
                scores[:, i, j] = float("-inf")
    scores[1, 2, 2, 0] = float("-inf")  # and one label of a word
    case = _tree_case(2)
    dist = TreeCRF(scores.requires_grad_())
    for b in range(2):
        ref = _oracle(case, (scores.detach(),), b, n)
        torch.testing.assert_close(dist.log_partition[b], ref["log_partition"])
        torch.testing.assert_close(dist.marginals[b], ref["marginals"][0])
        torch.testing.assert_close(dist.entropy[b], ref["entropy"])
        assert torch.equal(dist.argmax[b], ref["argmax"])
    forbidden = torch.isneginf(scores.detach())
    assert (dist.marginals[forbidden] == 0).all()
    assert (dist.sample(200)[:, forbidden] == 0).all()
    loss = dist.log_partition.sum() + dist.marginals.pow(2).sum() + dist.entropy.sum()
    assert torch.isfinite(torch.autograd.grad(loss, scores)[0]).all()


def test_semi_markov_minus_inf_against_brute_force() -> None:
    segments, transitions = _semi_draw(2, 5, torch.float64, 1.0)
    transitions[:, 0, 0] = float("-inf")  # no two segments labelled 0 in a row
    segments[:, :, 2, 1] = float("-inf")  # no segment of length 3 labelled 1
    dist = SemiMarkovCRF(segments, transitions)
    for b in range(2):
        ref = _oracle(SEMI, (segments, transitions), b, 5)
        torch.testing.assert_close(dist.log_partition[b], ref["log_partition"])
        torch.testing.assert_close(dist.marginals[b], ref["marginals"][0])
        torch.testing.assert_close(dist.transition_marginals[b], ref["marginals"][1])
        assert torch.equal(dist.argmax[b], ref["argmax"])
    assert (dist.transition_marginals[:, 0, 0] == 0).all()


@pytest.mark.parametrize("case", [CASES[0], CASES[1], SEMI], ids=lambda c: c.name)
def test_item_with_no_valid_structure(case: Case) -> None:
    """log Z = -inf, zero marginals, finite gradients, argmax and samples -1."""
    params = tuple(p.clone() for p in case.draw(2, 4, torch.float64, 1.0))
    params[0][1].fill_(float("-inf"))
    params = tuple(p.requires_grad_() for p in params)
    dist = case.build(params, None)
    assert torch.isneginf(dist.log_partition[1]) and torch.isfinite(dist.log_partition[0])
    for m in case.marginals(dist):
        assert (m[1] == 0).all() and torch.isfinite(m).all()
    assert dist.argmax[1].eq(-1).all() and torch.isneginf(dist.max_score[1])
    assert dist.sample(3)[:, 1].eq(-1).all()
    assert dist.entropy[1] == 0 and torch.isneginf(dist.log_prob(dist.argmax)[1])
    loss = dist.log_partition[0] + sum(m.sum() for m in case.marginals(dist))
    for g in torch.autograd.grad(loss, params):
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("scale", [1.0, 1e2, 1e4])
def test_float32_large_scores_are_finite(case: Case, scale: float) -> None:
    params = tuple(p.requires_grad_() for p in case.draw(4, 12, torch.float32, scale))
    dist = case.build(params, torch.tensor([12, 9, 4, 1]))
    marginals = case.marginals(dist)
    for out in (dist.log_partition, dist.entropy, dist.max_score, *marginals):
        assert torch.isfinite(out).all()
    assert (dist.entropy >= 0).all()
    loss = dist.log_partition.sum() + sum((m * m).sum() for m in marginals)
    for g in torch.autograd.grad(loss, params):
        assert torch.isfinite(g).all()
    for m in marginals[:1]:
        assert (m >= -1e-4).all() and (m <= 1 + 1e-4).all()


def test_length_one() -> None:
    spans = torch.randn(2, 1, 1, 3, dtype=torch.float64)
    tree = TreeCRF(spans)
    torch.testing.assert_close(tree.log_partition, spans.logsumexp(-1).view(2))
    torch.testing.assert_close(tree.marginals, spans.softmax(-1))
    assert tree.argmax.sum().item() == 2
    segments = torch.randn(2, 1, 3, 2, dtype=torch.float64)
    semi = SemiMarkovCRF(segments)
    torch.testing.assert_close(semi.log_partition, segments[:, 0, 0].logsumexp(-1))
    assert semi.marginals[:, 0, 1:].eq(0).all()  # longer segments run past the end
    split = SplitTreeDistribution(torch.randn(2, 1, dtype=torch.float64))
    torch.testing.assert_close(split.log_partition, torch.zeros(2, dtype=torch.float64))
    assert split.argmax.tolist() == [[[1]], [[1]]] and split.entropy.eq(0).all()


def test_empty_batch(case: Case) -> None:
    params = tuple(p.requires_grad_() for p in case.draw(0, 4, torch.float64, 1.0))
    dist = case.build(params, None)
    assert dist.log_partition.shape == (0,) and dist.entropy.shape == (0,)
    assert dist.argmax.shape[0] == 0 and dist.sample(2).shape[:2] == (2, 0)
    inference = case.build(tuple(p.detach() for p in params), None)  # TreeCRF: by hand
    for want, got in zip(case.marginals(dist), case.marginals(inference), strict=True):
        assert got.shape == want.shape and want.shape[0] == 0


# ---- relations to other structures -------------------------------------------------------
def test_one_label_tree_equals_unlabelled() -> None:
    spans = torch.randn(3, 6, 6, dtype=torch.float64)
    lengths = torch.tensor([6, 3, 1])
    one, plain = TreeCRF(spans.unsqueeze(-1), lengths), TreeCRF(spans, lengths)
    torch.testing.assert_close(one.log_partition, plain.log_partition)
    torch.testing.assert_close(one.marginals.squeeze(-1), plain.marginals)
    assert torch.equal(one.argmax.squeeze(-1), plain.argmax)


def test_semi_markov_with_unit_segments_is_a_linear_chain() -> None:
    unary = torch.randn(3, 7, 4, dtype=torch.float64)
    pairwise = torch.randn(4, 4, dtype=torch.float64)
    lengths = torch.tensor([7, 5, 1])
    semi = SemiMarkovCRF(unary.unsqueeze(2), pairwise, lengths)
    chain = LinearChainCRF(unary, pairwise, lengths)
    torch.testing.assert_close(semi.log_partition, chain.log_partition)
    torch.testing.assert_close(semi.marginals.squeeze(2), chain.marginals)
    torch.testing.assert_close(semi.transition_marginals, chain.edge_marginals.sum(1))
    labels = semi.argmax.squeeze(2).argmax(-1).masked_fill(semi.argmax.sum((2, 3)) == 0, -1)
    assert torch.equal(labels, chain.argmax)
    # shared [C, C] transitions and per-item [B, C, C] ones agree
    per_item = SemiMarkovCRF(unary.unsqueeze(2), pairwise.expand(3, 4, 4), lengths)
    torch.testing.assert_close(per_item.log_partition, semi.log_partition)


def test_plackett_luce_split_induces_the_same_trees() -> None:
    """Eq. 9 (rank by Plackett-Luce, split at the top-ranked position) = eq. 8."""
    for n in (1, 2, 3, 4, 5):
        scores = torch.randn(n, dtype=torch.float64) * 1.5
        ranked = oracles.plackett_luce_tree_probs(scores)
        dist = SplitTreeDistribution(scores.unsqueeze(0))
        assert len(ranked) == oracles.catalan(n)
        for nodes, prob in ranked.items():
            value = torch.zeros(1, n, n, dtype=torch.long)
            for a, b in nodes:
                value[0, a, b] = 1
            torch.testing.assert_close(dist.log_prob(value)[0].exp(), prob)
        torch.testing.assert_close(sum(ranked.values()), torch.tensor(1.0).double())


def _as_split_tree(nodes: Tensor, a: int, b: int) -> Any:
    """Node spans [N, N] -> the nested tuple that ``split_tree`` (attach right) builds."""
    if a > b:
        return None
    pivot = next(
        i for i in range(a, b + 1) if (i == a or nodes[a, i - 1]) and (i == b or nodes[i + 1, b])
    )
    left, right = _as_split_tree(nodes, a, pivot - 1), _as_split_tree(nodes, pivot + 1, b)
    tail = pivot if right is None else (pivot, right)
    return tail if left is None else (left, tail)


def _greedy_nodes(scores: list[float]) -> Tensor:
    nodes = torch.zeros(1, len(scores), len(scores), dtype=torch.long)

    def split(a: int, b: int) -> None:
        if a <= b:
            nodes[0, a, b] = 1
            i = max(range(a, b + 1), key=lambda k: (scores[k], -k))
            split(a, i - 1)
            split(i + 1, b)

    split(0, len(scores) - 1)
    return nodes


def test_greedy_split_is_not_the_most_likely_tree() -> None:
    scores = [0.0, 1.0, 1.5, 2.0]  # the docstring's example
    dist = SplitTreeDistribution(torch.tensor([scores], dtype=torch.float64))
    greedy = _greedy_nodes(scores)
    assert _as_split_tree(greedy[0], 0, 3) == split_tree(scores) == (((0, 1), 2), 3)
    assert _as_split_tree(dist.argmax[0], 0, 3) == ((0, 1), (2, 3))
    assert round(dist.log_prob(greedy).exp().item(), 3) == 0.189
    assert round(dist.max_score.exp().item(), 3) == 0.210
    # in general: greedy never beats the argmax, which is the brute-force best
    torch.manual_seed(1)
    differ = 0
    for _ in range(30):
        values = (torch.randn(5, dtype=torch.float64)).tolist()
        dist = SplitTreeDistribution(torch.tensor([values], dtype=torch.float64))
        greedy = _greedy_nodes(values)
        assert _as_split_tree(greedy[0], 0, 4) == split_tree(values)
        assert dist.log_prob(greedy) <= dist.max_score + 1e-12
        ref = _oracle(SPLIT, (dist.scores,), 0, 5)
        assert torch.equal(dist.argmax[0], ref["argmax"])
        differ += int(not torch.equal(greedy, dist.argmax))
    assert differ > 0


# ---- losses, inputs -------------------------------------------------------------------------
def test_structured_nll_gradient_is_marginals_minus_gold(case: Case) -> None:
    params, lengths = _batch(case)
    params = tuple(p.requires_grad_() for p in params)
    dist = case.build(params, lengths)
    gold = dist.sample(1)[0]
    loss = structured_nll(dist, gold, reduction="sum")
    grad = torch.autograd.grad(loss, params[0])[0]
    if case is not SPLIT:  # the parts are the potentials themselves
        torch.testing.assert_close(grad, case.marginals(dist)[0] - gold.to(grad.dtype))
    bad = gold.clone()
    bad[0] = 0
    with pytest.raises(ValueError, match="item 0"):
        structured_nll(dist, bad)


def test_bad_inputs_raise_value_error_naming_argument() -> None:
    nan = float("nan")
    with pytest.raises(ValueError, match="span_scores"):
        TreeCRF(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="span_scores"):
        TreeCRF(torch.randn(2, 3))
    with pytest.raises(ValueError, match="span_scores"):
        TreeCRF(torch.zeros(2, 3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="span_scores.*NaN"):
        TreeCRF(torch.tensor([[[0.0, nan], [0.0, 0.0]]]))
    with pytest.raises(ValueError, match="span_scores.*inf"):
        TreeCRF(torch.tensor([[[0.0, float("inf")], [0.0, 0.0]]]))
    TreeCRF(torch.tensor([[[0.0, 1.0], [nan, 0.0]]]))  # below the diagonal: ignored
    with pytest.raises(ValueError, match="lengths"):
        TreeCRF(torch.randn(2, 3, 3), lengths=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="lengths"):
        TreeCRF(torch.randn(2, 3, 3), lengths=torch.tensor([4, 3]))
    with pytest.raises(ValueError, match="lengths"):
        TreeCRF(torch.randn(2, 3, 3), lengths=torch.tensor([1.0, 3.0]))
    with pytest.raises(ValueError, match="segment_scores"):
        SemiMarkovCRF(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="segment_scores.*NaN"):
        SemiMarkovCRF(torch.full((1, 2, 1, 2), nan))
    with pytest.raises(ValueError, match="transitions"):
        SemiMarkovCRF(torch.randn(2, 3, 2, 4), torch.randn(3, 3))
    with pytest.raises(ValueError, match="transitions"):
        SemiMarkovCRF(torch.randn(2, 3, 2, 4), torch.full((4, 4), nan))
    with pytest.raises(ValueError, match="transitions"):
        SemiMarkovCRF(torch.randn(2, 3, 2, 4), torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="lengths"):
        SemiMarkovCRF(torch.randn(2, 3, 2, 4), lengths=torch.tensor([2, 5]))
    with pytest.raises(ValueError, match="scores"):
        SplitTreeDistribution(torch.randn(2, 3, 3))
    with pytest.raises(ValueError, match="scores.*-inf"):
        SplitTreeDistribution(torch.tensor([[0.0, float("-inf")]]))
    with pytest.raises(ValueError, match="scores.*NaN"):
        SplitTreeDistribution(torch.tensor([[0.0, nan]]))
    SplitTreeDistribution(torch.tensor([[0.0, nan]]), lengths=torch.tensor([1]))  # padding
    with pytest.raises(ValueError, match="lengths"):
        SplitTreeDistribution(torch.randn(2, 3), lengths=torch.tensor([0, 1]))
    # structures
    tree = TreeCRF(torch.randn(2, 3, 3), lengths=torch.tensor([3, 2]))
    with pytest.raises(ValueError, match="spans"):
        tree.log_prob(torch.zeros(2, 3, 3))  # float
    with pytest.raises(ValueError, match="spans"):
        tree.log_prob(torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="spans"):
        tree.log_prob(torch.full((2, 3, 3), 2))
    outside = tree.argmax.clone()
    outside[1, 2, 2] = 1  # past the length of item 1
    with pytest.raises(ValueError, match="spans.*item 1"):
        tree.log_prob(outside)
    semi = SemiMarkovCRF(torch.randn(1, 3, 2, 2))
    past = semi.argmax.clone()
    past[0, 2, 1, 0] = 1  # a segment 2..3 runs past the end
    with pytest.raises(ValueError, match="segments"):
        semi.log_prob(past)
    with pytest.raises(ValueError, match="n"):
        SplitTreeDistribution(torch.randn(1, 3)).sample(0)


def test_works_under_no_grad_and_inference_mode(case: Case) -> None:
    params, lengths = _batch(case)
    want = case.marginals(case.build(params, lengths))
    with torch.inference_mode():
        got = case.marginals(case.build(tuple(p * 1 for p in params), lengths))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def _autograd_tree(scores: Tensor, lengths: Tensor) -> TreeCRF:
    """A TreeCRF whose log Z is the semiring inside pass, differentiated by autograd (the
    reference of the hand-written outside pass and Hessian-vector product)."""

    class Auto(TreeCRF):
        def _inside(self, semiring: Any, parts: Any, lengths: Tensor | None) -> Tensor:
            (spans,) = parts
            if self.labelled:
                spans = semiring.sum(spans, dim=-1)
            return cky_inside(spans, lengths, semiring)

        @property
        def log_partition(self) -> Tensor:  # the base class's: the semiring inside pass
            return StructuredDistribution.log_partition.func(self)  # type: ignore[attr-defined]

        @property
        def marginals(self) -> Tensor:  # the base class's: autograd of log Z
            return StructuredDistribution._marginals_tuple.func(self)[0]  # type: ignore[attr-defined]

    return Auto(scores, lengths)


@pytest.mark.parametrize("labels", [None, 3])
def test_tree_hand_written_outside_and_hvp_match_autograd(labels: int | None) -> None:
    """The outside pass and the Hessian-vector product written by hand equal autograd
    through the semiring inside pass (-inf spans, items without a tree, NaN padding,
    length 1), in float64 and with |scores| ~ 1e4 in float32."""
    n = 7
    shape = (5, n, n) if labels is None else (5, n, n, labels)
    scores = torch.randn(shape, dtype=torch.float64)
    scores[0, 1, 3] = float("-inf")  # a forbidden span
    scores[1, 0, 0] = float("-inf")  # item 1: one label forbidden, or no tree at all
    scores[3] = float("-inf")  # item 3: no tree
    scores[4, 2:] = float("nan")  # item 4: padding
    lengths = torch.tensor([7, 5, 1, 6, 2])
    hand = TreeCRF(scores, lengths)
    auto = _autograd_tree(scores.clone().requires_grad_(), lengths)
    torch.testing.assert_close(hand.marginals, auto.marginals.detach())
    torch.testing.assert_close(hand.entropy, auto.entropy.detach())
    assert (hand.marginals[3] == 0).all() and torch.isfinite(hand.marginals).all()
    # first and second order: the gradient of log Z and of a loss on the marginals
    weight = torch.randn(shape, dtype=torch.float64)
    grads = []
    for build in (TreeCRF, _autograd_tree):
        x = scores.clone().requires_grad_()
        dist = build(x, lengths)
        (g1,) = torch.autograd.grad(dist.log_partition.sum(), x, create_graph=True)
        (g2,) = torch.autograd.grad((g1 * weight).nan_to_num().sum(), x)
        (g3,) = torch.autograd.grad((dist.marginals * weight).nan_to_num().sum(), x)
        grads.append((g1.detach(), g2, g3))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num())
    torch.testing.assert_close(grads[0][1].nan_to_num(), grads[0][2].nan_to_num())
    big = (torch.randn(shape) * 1e4).requires_grad_()
    hand32 = TreeCRF(big, lengths).marginals
    auto32 = _autograd_tree(big, lengths).marginals
    assert torch.isfinite(hand32).all()
    torch.testing.assert_close(hand32, auto32, atol=1e-4, rtol=1e-4)
    (hvp,) = torch.autograd.grad((hand32 * weight.float()).sum(), big)
    assert torch.isfinite(hvp).all()


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "pytorch"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_labelled_tree_label_passes_match_autograd(kernels: bool, dtype: torch.dtype) -> None:
    """The labels summed out in the CKY's own nodes (cky_labelled_log_partition and
    cky_labelled_marginals: the label passes in the C++ kernels on CPU, else in PyTorch)
    equal autograd through a ``where``, a logsumexp over L and the semiring inside pass:
    log Z, its gradient, the double backward (create_graph), the marginals and their
    backward, and batched cotangents of log Z (is_grads_batched); -inf labels, a span whose labels
    are all -inf, no tree, NaN padding, length 1; |scores| ~ 1e4 in float32 stays finite."""
    from structattn.structs._extension import kernels_disabled
    from structattn.structs.constituency import (
        _kernel_ops,
        _labelled_parts,
        cky_labelled_log_partition,
        cky_labelled_marginals,
    )

    if kernels and _kernel_ops(torch.zeros(1, 2, 2)) is None:
        pytest.skip("C++ kernels not built (STRUCTATTN_EXTENSION=0 or no compiler)")
    torch.manual_seed(0)
    scores = torch.randn(5, 7, 7, 4, dtype=dtype)
    scores[0, 1, 3, 2] = float("-inf")  # a forbidden label
    scores[0, 2, 4] = float("-inf")  # a forbidden span (every label)
    scores[1, 0, 0, 1] = float("-inf")
    scores[3] = float("-inf")  # no tree
    scores[4, 2:] = float("nan")  # padding
    scores[:, 5, 2] = float("nan")  # below the diagonal
    lengths = torch.tensor([7, 5, 1, 6, 2])
    weight = torch.randn_like(scores)
    eye = torch.eye(5, dtype=dtype)

    def reference(x: Tensor) -> Tensor:
        _, spans = _labelled_parts(x, lengths)
        return cky_inside(spans, lengths, LogSemiring)

    def run(logz_of: Callable[[Tensor], Tensor], marginals_of: Any) -> list[Tensor]:
        x = scores.clone().requires_grad_()
        logz = logz_of(x)
        (rows,) = torch.autograd.grad(logz, x, eye, is_grads_batched=True, retain_graph=True)
        (g1,) = torch.autograd.grad(logz.sum(), x, create_graph=True)
        (g2,) = torch.autograd.grad((g1 * weight).nan_to_num().sum(), x, retain_graph=True)
        marginals = g1 if marginals_of is None else marginals_of(x)
        (hvp,) = torch.autograd.grad((marginals * weight).nan_to_num().sum(), x)
        return [logz, g1, g2, rows, marginals, hvp]

    with contextlib.ExitStack() as stack:
        if not kernels:
            stack.enter_context(kernels_disabled())
        got = run(
            lambda x: cky_labelled_log_partition(x, lengths),
            lambda x: cky_labelled_marginals(x, lengths),
        )
    want = run(reference, None)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.detach().nan_to_num(), w.detach().nan_to_num(), **tol)
    assert torch.isfinite(got[4]).all() and (got[4][3] == 0).all() and (got[4][0, 2, 4] == 0).all()
    if dtype == torch.float32:  # large scores: finite, and the span totals are probabilities
        with contextlib.ExitStack() as stack:
            if not kernels:
                stack.enter_context(kernels_disabled())
            big = (torch.randn(5, 7, 7, 4) * 1e4).requires_grad_()
            marginals = cky_labelled_marginals(big, lengths)
            (hvp,) = torch.autograd.grad((marginals * weight).nan_to_num().sum(), big)
            (grad,) = torch.autograd.grad(cky_labelled_log_partition(big, lengths).sum(), big)
        assert torch.isfinite(marginals).all() and torch.isfinite(hvp).all()
        torch.testing.assert_close(grad, marginals.detach())
        diagonal = marginals.detach().sum(-1).diagonal(dim1=1, dim2=2)
        torch.testing.assert_close(diagonal.sum(-1), lengths.float())


def test_semi_markov_hand_written_marginals_and_hvp_match_autograd() -> None:
    """The marginals and the Hessian-vector product written by hand (structs/semi_markov.py)
    equal autograd through the semiring forward pass (-inf segments and transitions, an item
    without a segmentation, NaN padding, length 1), through ``marginals`` and through the
    double backward of log Z, in float64 and with |scores| ~ 1e4 in float32."""
    torch.manual_seed(0)
    n, width, labels = 7, 3, 3
    segments = torch.randn(5, n, width, labels, dtype=torch.float64)
    transitions = torch.randn(5, labels, labels, dtype=torch.float64)
    segments[0, 1, 1] = float("-inf")  # forbidden segments
    transitions[1, 0, 1] = float("-inf")  # a forbidden label pair
    segments[3] = float("-inf")  # item 3: no segmentation
    lengths = torch.tensor([7, 5, 1, 6, 2])
    segments[4, 2:] = float("nan")  # item 4: padding
    weights = (torch.randn_like(segments), torch.randn_like(transitions))

    def auto(dist: SemiMarkovCRF) -> tuple[Tensor, ...]:
        return StructuredDistribution._marginals_tuple.func(dist)  # type: ignore[attr-defined,no-any-return]

    def run(how: str) -> list[Tensor]:
        x = (segments.clone().requires_grad_(), transitions.clone().requires_grad_())
        dist = SemiMarkovCRF(*x, lengths=lengths)
        if how == "auto":  # autograd through the semiring forward pass
            dist._inside = lambda s, parts, n: semi_markov_inside(*parts, n, s)  # type: ignore[method-assign]
            marginals = auto(dist)
        elif how == "double":  # the double backward of the hand-written log Z
            marginals = torch.autograd.grad(dist.log_partition.sum(), x, create_graph=True)
        else:
            marginals = (dist.marginals, dist.transition_marginals)
        loss = sum(((m * w).nan_to_num().sum() for m, w in zip(marginals, weights, strict=True)))
        hvp = torch.autograd.grad(loss, x)
        return [m.detach().nan_to_num() for m in marginals] + [h.nan_to_num() for h in hvp]

    want = run("auto")
    for how in ("hand", "double"):
        for got, expected in zip(run(how), want, strict=True):
            torch.testing.assert_close(got, expected)
    big = (torch.randn(4, 9, 4, 3) * 1e4).requires_grad_()
    dist = SemiMarkovCRF(big, lengths=torch.tensor([9, 5, 1, 8]))
    assert torch.isfinite(dist.marginals).all()
    (hvp,) = torch.autograd.grad((dist.marginals * torch.randn(4, 9, 4, 3)).sum(), big)
    assert torch.isfinite(hvp).all()


@pytest.mark.parametrize("labels", [None, 2])
def test_tree_topk_against_brute_force(labels: int | None) -> None:
    case = _tree_case(labels)
    n, k = 4, 7
    params = case.draw(3, n, torch.float64, 1.0)
    params[0][1, 0, 1] = float("-inf")  # a forbidden span
    lengths = torch.tensor([4, 3, 2])  # item 2: 1 unlabelled tree (fewer than k)
    dist = case.build(params, lengths)
    scores, trees = dist.topk(k)
    assert scores.shape == (k, 3) and trees.shape == (k, *params[0].shape)
    assert torch.equal(trees[0], dist.argmax)
    torch.testing.assert_close(scores[0], dist.max_score)
    for b, length in enumerate(lengths.tolist()):
        support = [(ind[0], s) for ind, s in case.enumerate(_item(params, b), length)]
        ranked = sorted((s for _, s in support if torch.isfinite(s)), key=float, reverse=True)
        want = torch.tensor(ranked[:k] + [-math.inf] * (k - len(ranked[:k]))).double()
        torch.testing.assert_close(scores[:, b], want)
        found = len(ranked[:k])
        for r in range(found):  # each tree reproduces its score, all distinct
            tree = trees[r, b]
            assert tree.min() >= 0
            torch.testing.assert_close((tree * params[0][b].nan_to_num()).sum(), scores[r, b])
        distinct = {tuple(trees[r, b].flatten().tolist()) for r in range(found)}
        assert len(distinct) == found
        assert trees[found:, b].eq(-1).all()
    with pytest.raises(ValueError, match="k"):
        dist.topk(0)


# ---- autocast, C++ kernels ------------------------------------------------------------------
def _span_marginals(x: Tensor) -> dict[str, Tensor]:
    """Marginals of each span distribution from potentials made of ``x`` [2, 6, 6]."""
    return {
        "tree": TreeCRF(x).marginals,
        "labelled-tree": TreeCRF(torch.stack([x, 2 * x], -1)).marginals,
        "semi-markov": SemiMarkovCRF(x[:, :, :3].unsqueeze(-1).expand(2, 6, 3, 2)).marginals,
        "split-tree": SplitTreeDistribution(x[:, 0]).marginals,
    }


def test_span_distributions_compute_in_float32_under_autocast() -> None:
    """Under bfloat16 autocast (a layer's matmul output) the span DPs run in float32 and give
    the float32 values; their backward runs too (issue 38.6, as tests/test_autocast.py)."""
    torch.manual_seed(0)
    scores = torch.randn(2, 6, 6).bfloat16().float().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = scores @ torch.eye(6)
        assert half.dtype == torch.bfloat16
        got = _span_marginals(half)
    want = _span_marginals(scores.detach().bfloat16().float())
    for name, marginals in got.items():
        assert marginals.dtype == torch.float32, name
        torch.testing.assert_close(marginals, want[name], rtol=1e-5, atol=1e-6)
    sum(m.pow(2).sum() for m in got.values()).backward()
    assert scores.grad is not None and torch.isfinite(scores.grad).all()


def test_cky_kernel_matches_pytorch_path() -> None:
    """The C++ CKY kernels (_cky.cpp) give the PyTorch path's log Z, marginals and
    Hessian-vector product (-inf spans, no tree, NaN padding, length 1; float32 and 64)."""
    from structattn.structs._extension import kernels_disabled
    from structattn.structs.constituency import _kernel_ops

    if _kernel_ops(torch.zeros(1, 2, 2)) is None:
        pytest.skip("C++ kernels not built (STRUCTATTN_EXTENSION=0 or no compiler)")
    torch.manual_seed(0)
    for dtype in (torch.float64, torch.float32):
        scores = torch.randn(5, 9, 9, 2, dtype=dtype)
        scores[0, 1, 3] = float("-inf")
        scores[3] = float("-inf")
        scores[4, 2:] = float("nan")
        lengths = torch.tensor([9, 5, 1, 6, 2])
        weight = torch.randn_like(scores)

        def run(
            scores: Tensor = scores, lengths: Tensor = lengths, weight: Tensor = weight
        ) -> tuple[Tensor, ...]:
            x = scores.clone().requires_grad_()
            dist = TreeCRF(x, lengths)
            (hvp,) = torch.autograd.grad((dist.marginals * weight).nan_to_num().sum(), x)
            (grad,) = torch.autograd.grad(dist.log_partition.sum(), x)
            return dist.log_partition, dist.marginals, grad, hvp

        got = run()
        with kernels_disabled():
            want = run()
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.detach().nan_to_num(), w.detach().nan_to_num(), **tol)
