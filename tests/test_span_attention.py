"""Attention over spans (#39 item 4): SpanAttention, SpanSelfAttention, the semi-Markov
segmentation attention and the "constituency" / "semi-markov" multihead heads, against
brute-force enumeration of every bracketing / segmentation in float64."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
from oracles import bracketings, segmentations
from torch import Tensor

from structattn.attention import (
    SegmentationAttention,
    SemiMarkovSegmentationAttention,
    SpanAttention,
    SpanSelfAttention,
    StructuredMultiheadAttention,
)
from structattn.attention.spans import (
    segments_to_spans,
    span_coverage,
    span_membership,
    span_self_attention_weights,
    spans_to_segments,
)
from structattn.models import StructuredSeq2Seq

STRUCTURES = ("constituency", "semi-markov")
F64 = torch.float64


# ---- brute force ------------------------------------------------------------------------------
def structures(n: int, structure: str, width: int | None = None) -> list[list[tuple[int, int]]]:
    """Every bracketing / segmentation of n positions as a list of spans (i, j)."""
    if structure == "constituency":
        return [sorted(t) for t in bracketings(0, n - 1)]
    k = n if width is None else width
    return [[(i, i + d) for i, d, _ in z] for z in segmentations(n, k, 1)]


def distribution(scores: Tensor, n: int, structure: str, width: int | None = None):
    """(structures, probabilities [S]) of span scores [N, N] over the first n positions."""
    zs = structures(n, structure, width)
    logits = torch.stack([sum(scores[i, j] for i, j in z) for z in zs])
    return zs, logits.softmax(0)


def brute_membership(scores: Tensor, n: int, structure: str, width: int | None = None) -> Tensor:
    """w[q, k] = E[sum_{c in z, q in c} 1[k in c] / |c|] / E[#{c in z: q in c}]."""
    size = scores.shape[-1]
    zs, probs = distribution(scores, n, structure, width)
    num = scores.new_zeros(size, size)
    den = scores.new_zeros(size)
    for z, p in zip(zs, probs, strict=True):
        for i, j in z:
            for q in range(i, j + 1):
                den[q] += p
                for k in range(i, j + 1):
                    num[q, k] += p / (j - i + 1)
    return torch.where(den[:, None] > 0, num / den.clamp_min(1e-300)[:, None], 0.0)


def brute_span_marginals(scores: Tensor, n: int, structure: str, width: int | None = None):
    size = scores.shape[-1]
    zs, probs = distribution(scores, n, structure, width)
    mu = scores.new_zeros(size, size)
    for z, p in zip(zs, probs, strict=True):
        for i, j in z:
            mu[i, j] += p
    return mu


# ---- the shared functions -------------------------------------------------------------------
@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("width", [None, 2])
def test_self_attention_weights_match_brute_force(structure: str, width: int | None) -> None:
    if structure == "constituency" and width is not None:
        pytest.skip("max_width is for segmentations")
    torch.manual_seed(0)
    scores = torch.randn(3, 5, 5, dtype=F64)
    lengths = torch.tensor([5, 3, 1])
    weights = span_self_attention_weights(scores, lengths, structure, width)  # type: ignore[arg-type]
    for b, n in enumerate(lengths.tolist()):
        expected = brute_membership(scores[b], n, structure, width)
        torch.testing.assert_close(weights[b], expected)
    rows = weights.sum(-1)
    real = torch.arange(5) < lengths[:, None]
    torch.testing.assert_close(rows, real.to(F64))


@pytest.mark.parametrize("structure", STRUCTURES)
def test_zero_scores_give_the_uniform_distribution(structure: str) -> None:
    # n = 3, constituency: two trees {[0,1],[0,2]} and {[1,2],[0,2]} at 1/2 each
    weights = span_self_attention_weights(torch.zeros(1, 3, 3, dtype=F64), torch.tensor([3]),
                                          structure)  # type: ignore[arg-type]  # fmt: skip
    torch.testing.assert_close(weights[0], brute_membership(torch.zeros(3, 3, dtype=F64), 3,
                                                            structure))  # fmt: skip


def test_membership_of_a_single_tree_is_exact() -> None:
    # one tree: ((0 1) 2): word 0's spans [0,0], [0,1], [0,2] -> (1 + 1/2 + 1/3, 1/2 + 1/3, 1/3)/3
    mu = torch.zeros(3, 3, dtype=F64)
    for i, j in [(0, 0), (1, 1), (2, 2), (0, 1), (0, 2)]:
        mu[i, j] = 1.0
    w = span_membership(mu)
    torch.testing.assert_close(
        w[0], torch.tensor([11 / 6, 5 / 6, 1 / 3], dtype=F64) / 3, rtol=0, atol=1e-12
    )
    torch.testing.assert_close(w[2], torch.tensor([1 / 3, 1 / 3, 4 / 3], dtype=F64) / 2)
    cover = span_coverage(mu)  # mean over the 5 spans of their uniform distributions
    torch.testing.assert_close(cover.sum(), torch.tensor(1.0, dtype=F64))


def test_segments_and_spans_round_trip() -> None:
    x = torch.randn(2, 5, 3)
    spans = segments_to_spans(x)
    back = spans_to_segments(spans, 3)
    inside = (torch.arange(5)[:, None] + torch.arange(3)) < 5
    torch.testing.assert_close(back, x * inside)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_self_attention_weights_gradcheck(structure: str) -> None:
    torch.manual_seed(1)
    scores = torch.randn(2, 4, 4, dtype=F64, requires_grad=True)
    lengths = torch.tensor([4, 3])

    def f(s: Tensor) -> Tensor:
        return span_self_attention_weights(s, lengths, structure)  # type: ignore[arg-type]

    assert torch.autograd.gradcheck(f, (scores,))


@pytest.mark.parametrize("structure", STRUCTURES)
def test_stable_at_large_scores_and_neg_inf(structure: str) -> None:
    torch.manual_seed(2)
    scores = 1e4 * torch.randn(2, 6, 6)
    scores[:, 0, 2] = float("-inf")  # a forbidden span
    scores.requires_grad_(True)
    w = span_self_attention_weights(scores, torch.tensor([6, 4]), structure)  # type: ignore[arg-type]
    assert torch.isfinite(w).all()
    w.sum().backward()
    assert scores.grad is not None and torch.isfinite(scores.grad).all()


# ---- SpanAttention --------------------------------------------------------------------------
def _span_repr(memory: Tensor, i: int, j: int, representation: str) -> Tensor:
    if representation == "endpoints":
        return torch.cat([memory[i], memory[j]])
    return memory[i : j + 1].mean(0)


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("representation", ["endpoints", "mean"])
def test_span_attention_matches_brute_force(structure: str, representation: str) -> None:
    torch.manual_seed(3)
    width = 2 if structure == "semi-markov" else None
    attn = SpanAttention(4, 3, structure, representation, max_width=width).double()  # type: ignore[arg-type]
    query, memory = torch.randn(2, 2, 3, dtype=F64), torch.randn(2, 5, 4, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    out = attn(query, memory, mask)
    weight = attn.scorer.weight.weight  # [P * Dm, Dq]
    for b, n in enumerate([5, 3]):
        for t in range(2):
            phi = torch.zeros(5, 5, dtype=F64)
            for i, j in itertools.combinations_with_replacement(range(n), 2):
                phi[i, j] = _span_repr(memory[b], i, j, representation) @ weight @ query[b, t]
                torch.testing.assert_close(out.scores[b, t, i, j], phi[i, j])
            zs, probs = distribution(phi, n, structure, width)
            mu = brute_span_marginals(phi, n, structure, width)
            torch.testing.assert_close(out.marginals[b, t], mu)
            expected_sum = sum(
                p * sum(_span_repr(memory[b], i, j, representation) for i, j in z)
                for z, p in zip(zs, probs, strict=True)
            )
            expected_count = sum(p * len(z) for z, p in zip(zs, probs, strict=True))
            torch.testing.assert_close(out.context[b, t], expected_sum / expected_count)
    if structure == "constituency":  # 2n - 1 spans in every tree
        torch.testing.assert_close(
            out.marginals.sum((-1, -2)), torch.tensor([[9.0, 9.0], [5.0, 5.0]], dtype=F64)
        )


@pytest.mark.parametrize("structure", STRUCTURES)
def test_span_attention_padding_invariance_and_shapes(structure: str) -> None:
    torch.manual_seed(4)
    attn = SpanAttention(6, 5, structure, max_width=3)  # type: ignore[arg-type]
    query = torch.randn(2, 5)
    memory = torch.randn(2, 4, 6)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    out = attn(query, memory, mask)
    assert out.context.shape == (2, 12) and out.marginals.shape == (2, 4, 4)
    assert out.weights.shape == (2, 4) and out.scores.shape == (2, 4, 4)
    padded = torch.cat([memory, torch.full((2, 3, 6), float("nan"))], 1)
    wide = torch.cat([mask, torch.zeros(2, 3, dtype=torch.bool)], 1)
    out2 = attn(query, padded, wide)
    torch.testing.assert_close(out2.context, out.context)
    torch.testing.assert_close(out2.marginals[..., :4, :4], out.marginals)
    assert (out2.marginals[..., 4:] == 0).all() and (out2.weights[..., 4:] == 0).all()
    short = attn(query[1:], memory[1:, :2])
    torch.testing.assert_close(short.context, out.context[1:])


@pytest.mark.parametrize("structure", STRUCTURES)
def test_span_attention_gradcheck(structure: str) -> None:
    torch.manual_seed(5)
    attn = SpanAttention(3, 2, structure, "mean", max_width=2).double()  # type: ignore[arg-type]
    query = torch.randn(2, 2, dtype=F64, requires_grad=True)
    memory = torch.randn(2, 4, 3, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda q, m: attn(q, m, mask).context, (query, memory))


def test_span_attention_bad_inputs() -> None:
    with pytest.raises(ValueError, match="`structure` must be one of"):
        SpanAttention(4, structure="projective")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`representation` must be one of"):
        SpanAttention(4, representation="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`max_width`"):
        SpanAttention(4, structure="semi-markov", max_width=0)
    attn = SpanAttention(4)
    with pytest.raises(ValueError, match="`memory`"):
        attn(torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match="features"):
        attn(torch.randn(2, 3), torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match="batch"):
        attn(torch.randn(3, 4), torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match="`mask`"):
        attn(torch.randn(2, 4), torch.randn(2, 3, 4), torch.tensor([[1, 0, 1], [1, 1, 1]]).bool())
    with pytest.raises(ValueError, match="`mask`"):
        attn(torch.randn(2, 4), torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.bool))


# ---- semi-Markov segmentation attention -------------------------------------------------------
def test_semi_markov_segmentation_attention_matches_brute_force() -> None:
    torch.manual_seed(6)
    attn = SemiMarkovSegmentationAttention(3, 2, max_width=2).double()
    with torch.no_grad():
        attn.transitions.copy_(torch.randn(2, 2))
    query, memory = torch.randn(1, 2, 2, dtype=F64), torch.randn(1, 4, 3, dtype=F64)
    out = attn(query, memory)
    for t in range(2):
        phi = out.scores[0, t]
        # selected segments (label 1, length <= 2) and unselected single positions (label 0)
        zs = [z for z in segmentations(4, 2, 2) if all(c == 1 or d == 0 for _, d, c in z)]
        logits = torch.stack(
            [
                sum(phi[i, i + d] for i, d, c in z if c == 1)
                + sum(attn.transitions[a[2], b[2]] for a, b in itertools.pairwise(z))
                for z in zs
            ]
        )
        probs = logits.softmax(0)
        p = torch.zeros(4, dtype=F64)
        for z, pz in zip(zs, probs, strict=True):
            for i, d, c in z:
                if c == 1:
                    p[i : i + d + 1] += pz
        torch.testing.assert_close(out.weights[0, t], p)
        context = (p[:, None] * memory[0]).sum(0) / (p.sum() / attn.lam)
        torch.testing.assert_close(out.context[0, t], context)


def test_semi_markov_segmentation_with_width_one_is_segmentation_attention() -> None:
    torch.manual_seed(7)
    semi = SemiMarkovSegmentationAttention(4, 3, max_width=1, representation="mean")
    plain = SegmentationAttention(4, 3, scorer="bilinear")
    with torch.no_grad():
        semi.scorer.weight.weight.copy_(plain.scorer.proj.weight)
        semi.transitions.copy_(torch.randn(2, 2))
        plain.transitions.copy_(semi.transitions)
    query, memory = torch.randn(2, 3, 3), torch.randn(2, 5, 4)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    a, b = semi(query, memory, mask), plain(query, memory, mask)
    torch.testing.assert_close(a.weights, b.weights)
    torch.testing.assert_close(a.context, b.context)
    assert semi.penalty().item() == pytest.approx(plain.penalty().item())


# ---- SpanSelfAttention and the model --------------------------------------------------------
@pytest.mark.parametrize("structure", STRUCTURES)
def test_span_self_attention(structure: str) -> None:
    torch.manual_seed(8)
    attn = SpanSelfAttention(6, 4, structure=structure, max_width=3).double()  # type: ignore[arg-type]
    x = torch.randn(2, 5, 6, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    out = attn(x, mask)
    width = 3 if structure == "semi-markov" else None
    for b, n in enumerate([5, 3]):
        expected = brute_membership(out.span_scores[b], n, structure, width)
        torch.testing.assert_close(out.weights[b], expected)
    torch.testing.assert_close(out.context, out.weights @ (x * mask[..., None]))
    x2 = x.clone()
    x2[1, 3:] = float("nan")  # padding is inert
    torch.testing.assert_close(attn(x2, mask).context, out.context)
    best = attn.parse(x, mask)
    assert best.shape == (2, 5, 5)
    if structure == "constituency":
        assert best.sum((-1, -2)).tolist() == [9, 5]
    else:  # a tiling: every real position in exactly one segment
        cover = torch.stack([best[:, i : i + 1, i:].sum((-1, -2)) for i in range(5)], -1)
        assert (best.triu() == best).all() and cover.sum(-1).tolist() == [
            int(best[0].sum()),
            int(best[1].sum()),
        ]


def test_constituency_seq2seq_trains() -> None:
    torch.manual_seed(9)
    model = StructuredSeq2Seq(12, 8, "constituency", parser_hidden=4)
    source = torch.randint(1, 12, (3, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4], dtype=torch.bool)
    target = torch.randint(1, 12, (3, 5))
    logits = model(source, mask, target)
    assert logits.shape == (3, 5, 12)
    logits.sum().backward()
    grads = [p.grad for p in model.self_attention.parameters()]  # type: ignore[union-attr]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads if g is not None)


# ---- multihead heads --------------------------------------------------------------------------
@pytest.mark.parametrize("structure", STRUCTURES)
def test_multihead_span_heads_match_brute_force(structure: str) -> None:
    torch.manual_seed(10)
    mha = StructuredMultiheadAttention(
        4, 2, batch_first=True, normalizer=["softmax", structure], max_segment_width=2
    ).double()  # type: ignore[list-item]
    x = torch.randn(2, 4, 4, dtype=F64)
    padding = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 1]], dtype=torch.bool)
    out, weights = mha(x, x, x, key_padding_mask=padding, average_attn_weights=False)
    assert weights is not None and weights.shape == (2, 2, 4, 4)
    q, k, _ = (mha._heads(t) for t in mha._project(x, x, x))
    scores = q @ k.transpose(-1, -2) / math.sqrt(2)
    width = 2 if structure == "semi-markov" else None
    for b, n in enumerate([4, 3]):
        torch.testing.assert_close(
            weights[b, 1], brute_membership(scores[b, 1], n, structure, width)
        )
    # padding invariance: the real rows equal those of the unpadded sequence
    out_short, w_short = mha(x[1:, :3], x[1:, :3], x[1:, :3], average_attn_weights=False)
    torch.testing.assert_close(out[1, :3], out_short[0])
    torch.testing.assert_close(weights[1, :, :3, :3], w_short[0])  # type: ignore[index]


def test_multihead_span_heads_gradcheck_and_errors() -> None:
    torch.manual_seed(11)
    mha = StructuredMultiheadAttention(
        4, 2, batch_first=True, normalizer=["constituency", "semi-markov"]
    ).double()
    x = torch.randn(1, 3, 4, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: mha(t, t, t)[0], (x,))
    with pytest.raises(ValueError, match="attn_mask"):
        mha(x, x, x, attn_mask=torch.ones(3, 3, dtype=torch.bool).triu(1))
    with pytest.raises(ValueError, match="L == S"):
        mha(x, x[:, :2], x[:, :2])
    with pytest.raises(ValueError, match="`max_segment_width`"):
        StructuredMultiheadAttention(4, 2, normalizer="semi-markov", max_segment_width=0)


# ---- bf16 autocast, as the other layers (tests/test_autocast.py) -------------------------------
LAYERS = {
    "span-constituency": lambda q, m: SpanAttention(8, structure="constituency")(q, m).context,
    "span-semi-markov": lambda q, m: SpanAttention(8, structure="semi-markov")(q, m).context,
    "span-self": lambda q, m: SpanSelfAttention(8, 4)(m).context,
    "semi-markov-segmentation": lambda q, m: SemiMarkovSegmentationAttention(8)(q, m).context,
    "multihead-constituency": lambda q, m: StructuredMultiheadAttention(
        8, 2, batch_first=True, normalizer="constituency"
    )(m, m, m)[0],
    "multihead-semi-markov": lambda q, m: StructuredMultiheadAttention(
        8, 2, batch_first=True, normalizer="semi-markov"
    )(m, m, m)[0],
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_span_layers_train_under_bf16_autocast(name: str) -> None:
    torch.manual_seed(0)
    query = torch.randn(2, 3, 8, requires_grad=True)
    memory = torch.randn(2, 5, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = LAYERS[name](query, memory)
    out.float().sum().backward()
    assert torch.isfinite(out.float()).all()
    assert memory.grad is not None and torch.isfinite(memory.grad).all()


# ---- the tree-transduction recipe's constituency encoder ----------------------------------------
def test_tree_transduction_constituency_table_and_figure(tmp_path) -> None:
    from structattn.cli import main
    from structattn.data.tree_transduction import generate_splits, write_splits
    from structattn.recipes.tree_transduction import format_table, visualize

    data = tmp_path / "data"
    write_splits(generate_splits(0, train_per_depth=6, valid_per_depth=2, test_per_depth=1), data)
    run = tmp_path / "constituency"
    args = ["train", "tree-transduction", "--attention", "constituency", "--out", str(run)]
    args += ["--data-dir", str(data), "--epochs", "1", "--dim", "8", "--parser-hidden", "4"]
    assert main([*args, "--batch-size", "6", "--progress", "false"]) == 0
    files = visualize(run, "( + 1 2 )", tmp_path / "fig")
    assert [f.name for f in files] == ["constituency_attention.png"]
    table = format_table({"simple": {2: 50.0}, "constituency": {2: 75.0}})
    assert "Constituency (ours)" in table and "Simple (paper)" in table
    assert "Constituency (paper)" not in table


# ---- second order through every span layer (the hand-written Hessian-vector products) -------
def _span_layers() -> dict[str, tuple[torch.nn.Module, Callable[..., Tensor], int]]:
    """name -> (layer in float64, (x, memory) -> output, model dim) on tiny sizes."""
    torch.manual_seed(12)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    layers: dict[str, tuple[torch.nn.Module, Callable[..., Tensor], int]] = {}
    for structure in STRUCTURES:
        attn = SpanAttention(3, 2, structure, "endpoints", max_width=2).double()  # type: ignore[arg-type]
        layers[f"span-{structure}"] = (
            attn,
            lambda q, m, a=attn: a(q[:, 0, :2], m, mask).context,
            3,
        )
        self_attn = SpanSelfAttention(3, 2, structure=structure, max_width=2).double()  # type: ignore[arg-type]
        layers[f"self-{structure}"] = (self_attn, lambda q, m, a=self_attn: a(m, mask).context, 3)
    semi = SemiMarkovSegmentationAttention(3, 2, max_width=2).double()
    with torch.no_grad():
        semi.transitions.copy_(torch.randn(2, 2))
    layers["semi-markov-segmentation"] = (
        semi,
        lambda q, m, a=semi: a(q[:, :, :2], m, mask).context,
        3,
    )
    heads = StructuredMultiheadAttention(
        4, 2, batch_first=True, normalizer=["constituency", "semi-markov"], max_segment_width=2
    ).double()
    layers["multihead-span-heads"] = (heads, lambda q, m, a=heads: a(m, m, m)[0], 4)
    return layers


SECOND_ORDER_LAYERS = _span_layers()


@pytest.mark.parametrize("name", sorted(SECOND_ORDER_LAYERS))
def test_span_layers_gradgradcheck(name: str) -> None:
    """gradcheck and gradgradcheck in float64 through every span layer: a loss on the
    context trains through the marginals (first order: their hand-written Hessian-vector
    products; second order: double backward through those)."""
    _, forward, dim = SECOND_ORDER_LAYERS[name]
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(2, 2, 3, dtype=F64, generator=generator).requires_grad_()
    memory = torch.randn(2, 4, dim, dtype=F64, generator=generator).requires_grad_()
    assert torch.autograd.gradcheck(forward, (query, memory))
    assert torch.autograd.gradgradcheck(forward, (query, memory))
