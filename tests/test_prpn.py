"""PRPN gates: the notes' worked Figures 1-3, brute force, padding, gradients, SPLIT trees."""

from __future__ import annotations

import doctest
import itertools
from fractions import Fraction

import pytest
import torch

import structattn.nn.prpn as prpn_module
import structattn.structs.stick_breaking as sb_module
import structattn.trees as trees_module
from structattn.nn.prpn import GatedSelfAttention, ParsingNetwork
from structattn.structs.stick_breaking import (
    bradley_terry_distribution,
    bradley_terry_expected_gates,
    bradley_terry_gates,
    expected_gates,
    gated_attention_weights,
    stick_breaking_distribution,
    stick_breaking_gates,
)
from structattn.trees import split_tree, tree_spans, tree_to_brackets

F64 = torch.float64
# The running example of the notes: t = 4, raw attention over i < 4 and scores d_0..d_4.
RAW = [0.4, 0.1, 0.3, 0.2]
D = [0.7, 0.6, 0.3, 0.4, 0.5]


def _row(values: list[float], t: int = 4, n: int = 5) -> torch.Tensor:
    """[1, n, n] tensor that is 0 except for row t, whose first len(values) entries are set."""
    out = torch.zeros(1, n, n, dtype=F64)
    out[0, t, : len(values)] = torch.tensor(values, dtype=F64)
    return out


def _causal(n: int) -> torch.Tensor:
    """BoolTensor [n, n], True where key k < query t."""
    return torch.arange(n).unsqueeze(-1) > torch.arange(n)


def _causal_softmax(b: int, n: int) -> torch.Tensor:
    """Random raw attention [b, n, n]: rows t >= 1 are a softmax over i < t."""
    scores = torch.randn(b, n, n, dtype=F64)
    causal = _causal(n)
    raw = torch.softmax(scores.masked_fill(~causal, -torch.inf), -1)
    return torch.nan_to_num(raw, nan=0.0)  # row 0 has no memory


def _hard_gates(l_t: int, t: int = 4) -> list[float]:
    """g_i(l_t) = 1(l_t <= i) for i < t (notes, eq. 3)."""
    return [float(l_t <= i) for i in range(t)]


# ---- the notes' worked examples -------------------------------------------------------------
def test_figure_1_hard_gates() -> None:
    raw = _row(RAW)
    # The figure's gate row [0, 1, 1, 1] gives the figure's attention [0, .17, .5, .33] ...
    weights = gated_attention_weights(raw, _row([0.0, 1.0, 1.0, 1.0]))[0, 4, :4]
    torch.testing.assert_close(weights, torch.tensor([0, 1 / 6, 1 / 2, 1 / 3], dtype=F64))
    assert torch.allclose(weights, torch.tensor([0, 0.17, 0.5, 0.33], dtype=F64), atol=5e-3)
    # ... but the figure labels it l_4 = 2. With the notes' own definition
    # g_i(l_t) = 1(l_t <= i) that gate row is l_4 = 1; l_4 = 2 gives [0, 0, 1, 1] and
    # s = [0, 0, 0.6, 0.4]. We test the definition and record the figure's off-by-one.
    assert _hard_gates(1) == [0.0, 1.0, 1.0, 1.0]
    assert _hard_gates(2) == [0.0, 0.0, 1.0, 1.0]
    weights = gated_attention_weights(raw, _row(_hard_gates(2)))[0, 4, :4]
    torch.testing.assert_close(weights, torch.tensor([0, 0, 0.6, 0.4], dtype=F64))
    # Hard stick-breaking gates (alpha_2 = 0, alpha_3 = 1) put l_4 = 2 with certainty and
    # reproduce the same hard gates as expected gates.
    alpha = _row([0.0, 0.7, 0.0, 1.0])
    torch.testing.assert_close(
        expected_gates(alpha)[0, 4, :4], torch.tensor(_hard_gates(2), dtype=F64)
    )
    torch.testing.assert_close(
        stick_breaking_distribution(alpha)[0, 4, :4], torch.tensor([0, 0, 1, 0], dtype=F64)
    )


def test_figure_2_stick_breaking() -> None:
    d = torch.tensor([D], dtype=F64)
    # Figure 2's alpha_i = (d_t - d_i + 1) / 2 (not eq. 7; any alpha in [0, 1] is accepted)
    causal = _causal(5)
    alpha = ((d.unsqueeze(-1) - d.unsqueeze(-2) + 1) / 2) * causal
    torch.testing.assert_close(alpha[0, 4, 1:4], torch.tensor([0.45, 0.6, 0.55], dtype=F64))
    p = stick_breaking_distribution(alpha)[0, 4]
    torch.testing.assert_close(p, torch.tensor([0.1485, 0.1815, 0.22, 0.45, 0], dtype=F64))
    cdf = expected_gates(alpha)[0, 4]
    torch.testing.assert_close(cdf, torch.tensor([0.1485, 0.33, 0.55, 1.0, 0], dtype=F64))
    soft = gated_attention_weights(_row(RAW), expected_gates(alpha))[0, 4, :4]
    gated = torch.tensor([0.1485 * 0.4, 0.33 * 0.1, 0.55 * 0.3, 1.0 * 0.2], dtype=F64)
    torch.testing.assert_close(soft, gated / gated.sum())
    # the figure prints [0.13, 0.07, 0.36, 0.43]; the last entry is 0.4373 (0.44 to two places,
    # the figure truncates), so compare within 0.01
    assert torch.allclose(soft, torch.tensor([0.13, 0.07, 0.36, 0.43], dtype=F64), atol=0.01)


def test_figure_3_bradley_terry_by_hand() -> None:
    # By hand: p(alpha'_i = 1) = d_i / (d_4 + d_i) = 6/11, 3/8, 4/9 and
    # p(l_4) = [5/11*5/8*5/9, 6/11*5/8*5/9, 3/8*5/9, 4/9] = [125, 150, 165, 352] / 792.
    stop = [Fraction(6, 11), Fraction(3, 8), Fraction(4, 9)]
    expect = [(1 - stop[0]) * (1 - stop[1]) * (1 - stop[2])]
    expect += [stop[0] * (1 - stop[1]) * (1 - stop[2]), stop[1] * (1 - stop[2]), stop[2]]
    assert [x * 792 for x in expect] == [125, 150, 165, 352] and sum(expect) == 1

    d = torch.tensor([D], dtype=F64)
    alpha = bradley_terry_gates(d)
    torch.testing.assert_close(
        1 - alpha[0, 4, 1:4], torch.tensor([float(s) for s in stop], dtype=F64)
    )
    p = bradley_terry_distribution(d)[0, 4, :4]
    torch.testing.assert_close(p, torch.tensor([float(x) for x in expect], dtype=F64))
    # The figure prints [0.16, 0.19, 0.21, 0.45]; the last entry is 4/9 = 0.444 (0.44 to two
    # places): the figure reuses Figure 2's 0.45. Every entry is within 0.01 of the figure.
    assert torch.allclose(p, torch.tensor([0.16, 0.19, 0.21, 0.45], dtype=F64), atol=0.01)
    cdf = bradley_terry_expected_gates(d)[0, 4, :4]
    torch.testing.assert_close(cdf, p.cumsum(0))


# ---- definitions against loops and brute force ----------------------------------------------
def test_eq7_gates_against_a_loop() -> None:
    d = torch.rand(2, 6, dtype=F64) * 3
    tau = 0.7
    alpha = stick_breaking_gates(d, tau)
    for b, t, k in itertools.product(range(2), range(6), range(6)):
        x = torch.tensor(2 * (d[b, t] - d[b, k]).item() / tau + 1, dtype=F64)
        expect = (torch.nn.functional.hardtanh(x) + 1) / 2 if k < t else torch.tensor(0.0)
        assert abs(alpha[b, t, k].item() - expect.item()) < 1e-12
    # alpha = 1 when d_k <= d_t, 0 when d_k >= d_t + tau
    row = stick_breaking_gates(torch.tensor([[0.7, 0.6, 0.3, 0.4, 0.5]]), tau=0.15)[0, 4]
    torch.testing.assert_close(row, torch.tensor([0.0, 1 / 3, 1.0, 1.0, 0.0]))


def test_stick_breaking_against_loops() -> None:
    b, n = 3, 6
    alpha = torch.rand(b, n, n, dtype=F64)
    alpha[0, 5, 2] = 0.0  # exact 0 and 1 (saturated gates)
    alpha[1, 4, 3] = 1.0
    p = stick_breaking_distribution(alpha)
    e = expected_gates(alpha)
    for bi, t in itertools.product(range(b), range(n)):
        a = alpha[bi, t]
        for k in range(n):
            if k >= t:
                assert p[bi, t, k] == 0 and e[bi, t, k] == 0
                continue
            tail = torch.prod(a[k + 1 : t]) if k + 1 < t else torch.tensor(1.0, dtype=F64)
            expect = tail if k == 0 else (1 - a[k]) * tail  # eq. (4)
            assert abs(p[bi, t, k].item() - expect.item()) < 1e-12
            assert abs(e[bi, t, k].item() - tail.item()) < 1e-12  # eq. (5)
        if t > 0:
            assert abs(p[bi, t].sum().item() - 1) < 1e-12
        else:
            assert p[bi, t].abs().sum() == 0
    # E[g_i] = sum_k p(l_t = k) 1(k <= i), the CDF of l_t
    causal = _causal(n)
    torch.testing.assert_close(e, p.cumsum(-1) * causal)


def test_bradley_terry_against_enumeration() -> None:
    """Enumerate every alpha' in {0,1}^t with alpha'_i ~ Bern(d_i / (d_t + d_i)), i = 0..t-1,
    and l_t = max{i : alpha'_i = 1} (0 if none fires, so alpha'_0 is irrelevant)."""
    n = 6
    d = torch.rand(2, n, dtype=F64) + 0.1
    p = bradley_terry_distribution(d)
    cdf = bradley_terry_expected_gates(d)
    for b, t in itertools.product(range(2), range(1, n)):
        probs = [(d[b, i] / (d[b, t] + d[b, i])).item() for i in range(t)]
        p_ref = [0.0] * t
        for fires in itertools.product([0, 1], repeat=t):
            weight = 1.0
            for i, f in enumerate(fires):
                weight *= probs[i] if f else 1 - probs[i]
            l_t = max([i for i in range(t) if fires[i]], default=0)
            p_ref[l_t] += weight
        cdf_ref = list(itertools.accumulate(p_ref))
        torch.testing.assert_close(p[b, t, :t], torch.tensor(p_ref, dtype=F64))
        torch.testing.assert_close(cdf[b, t, :t], torch.tensor(cdf_ref, dtype=F64))
        assert p[b, t, t:].abs().sum() == 0 and cdf[b, t, t:].abs().sum() == 0


def test_all_gates_one_give_the_raw_attention() -> None:
    raw = _causal_softmax(2, 5)
    torch.testing.assert_close(gated_attention_weights(raw, torch.ones_like(raw)), raw)
    # every alpha = 1 -> every expected gate = 1 -> raw attention back
    ones = torch.ones(2, 5, 5, dtype=F64)
    torch.testing.assert_close(gated_attention_weights(raw, expected_gates(ones)), raw)
    # equal distances give alpha = 1 in eq. (7): PRPN's gated attention is the raw one
    attend = GatedSelfAttention(4).double()
    x = torch.randn(2, 5, 4, dtype=F64)
    gates = expected_gates(stick_breaking_gates(torch.ones(2, 5, dtype=F64), tau=1.0))
    out = attend(x, gates)
    torch.testing.assert_close(out.weights, out.raw_weights)
    torch.testing.assert_close(attend(x, None).weights, out.raw_weights)


def test_zero_gated_mass_gives_zero_rows_without_nan() -> None:
    raw = _row(RAW).requires_grad_(True)
    gates = _row([1.0, 1.0, 1.0, 1.0])
    gates[0, 4, :4] = torch.tensor([0.0, 0.0, 0.0, 0.0], dtype=F64)
    gates.requires_grad_(True)
    weights = gated_attention_weights(raw, gates)
    assert torch.equal(weights, torch.zeros_like(weights))  # row 4 closed, the others empty
    weights.sum().backward()
    assert raw.grad is not None and gates.grad is not None
    assert torch.isfinite(raw.grad).all() and torch.isfinite(gates.grad).all()
    # t = 0 has no memory: zero weights and zero context
    out = GatedSelfAttention(3)(torch.randn(1, 4, 3), None)
    assert out.weights[0, 0].abs().sum() == 0 and out.context[0, 0].abs().sum() == 0
    torch.testing.assert_close(out.weights[0, 1:].sum(-1), torch.ones(3))


# ---- padding ------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_changes_nothing_in_the_pure_functions(side: str) -> None:
    n, lengths = 6, [6, 4, 2]
    d = torch.rand(3, n, dtype=F64) + 0.1
    alpha = torch.rand(3, n, n, dtype=F64)
    raw = torch.rand(3, n, n, dtype=F64)
    mask = torch.arange(n) < torch.tensor(lengths).unsqueeze(-1)
    if side == "left":
        mask = mask.flip(-1)
    outs = {
        "sb_p": stick_breaking_distribution(alpha, mask),
        "sb_e": expected_gates(alpha, mask),
        "bt_p": bradley_terry_distribution(d, mask),
        "bt_e": bradley_terry_expected_gates(d, mask),
        "eq7": stick_breaking_gates(d, 0.5, mask),
        "attn": gated_attention_weights(raw, expected_gates(alpha, mask), mask),
    }
    for b in range(3):
        keep = mask[b].nonzero().squeeze(-1)
        a1 = alpha[b][keep][:, keep].unsqueeze(0)
        d1, raw1 = d[b, keep].unsqueeze(0), raw[b][keep][:, keep].unsqueeze(0)
        alone = {
            "sb_p": stick_breaking_distribution(a1),
            "sb_e": expected_gates(a1),
            "bt_p": bradley_terry_distribution(d1),
            "bt_e": bradley_terry_expected_gates(d1),
            "eq7": stick_breaking_gates(d1, 0.5),
            "attn": gated_attention_weights(raw1, expected_gates(a1)),
        }
        pad = ~mask[b]
        for name, out in outs.items():
            torch.testing.assert_close(out[b][keep][:, keep], alone[name][0], msg=name)
            assert out[b][pad].abs().sum() == 0 and out[b][:, pad].abs().sum() == 0, name
    # padded distances are ignored by Bradley-Terry even when they are not positive
    d_bad = d.masked_fill(~mask, -1.0)
    torch.testing.assert_close(bradley_terry_distribution(d_bad, mask), outs["bt_p"])


@pytest.mark.parametrize("gate", ["stick-breaking", "bradley-terry"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_changes_nothing_in_the_modules(gate: str, side: str) -> None:
    parser = ParsingNetwork(4, 8, kernel_size=3, gate=gate).double().eval()  # type: ignore[arg-type]
    attend = GatedSelfAttention(4).double().eval()
    n, lengths = 7, [7, 5, 1]
    x = torch.randn(3, n, 4, dtype=F64)
    mask = torch.arange(n) < torch.tensor(lengths).unsqueeze(-1)
    if side == "left":
        mask = mask.flip(-1)
    x = x.masked_fill(~mask.unsqueeze(-1), 1e3)  # garbage at padding must not leak
    parsed = parser(x, mask)
    out = attend(x, parsed.expected_gates, mask)
    for b in range(3):
        keep = mask[b].nonzero().squeeze(-1)
        alone_parsed = parser(x[b, keep].unsqueeze(0))
        alone = attend(x[b, keep].unsqueeze(0), alone_parsed.expected_gates)
        torch.testing.assert_close(parsed.distances[b, keep], alone_parsed.distances[0])
        for field in ("alpha", "expected_gates", "distribution"):
            got = getattr(parsed, field)[b][keep][:, keep]
            torch.testing.assert_close(got, getattr(alone_parsed, field)[0], msg=field)
        torch.testing.assert_close(out.weights[b][keep][:, keep], alone.weights[0])
        torch.testing.assert_close(out.context[b, keep], alone.context[0])
        pad = ~mask[b]
        assert out.weights[b][:, pad].abs().sum() == 0 and out.weights[b][pad].abs().sum() == 0
        assert out.context[b, pad].abs().sum() == 0 and parsed.distances[b, pad].abs().sum() == 0


# ---- gradients ----------------------------------------------------------------------------------
@pytest.mark.parametrize("gate", ["stick-breaking", "bradley-terry"])
def test_gradients_reach_every_parameter(gate: str) -> None:
    parser = ParsingNetwork(5, 6, dropout=0.1, gate=gate)  # type: ignore[arg-type]
    attend = GatedSelfAttention(5)
    x = torch.randn(3, 8, 5)
    mask = torch.arange(8) < torch.tensor([[8], [6], [3]])
    parsed = parser(x, mask)
    out = attend(x, parsed.expected_gates, mask)
    loss = (out.context * torch.randn_like(out.context)).sum() + parsed.distances.sum()
    loss.backward()
    for module in (parser, attend):
        for name, param in module.named_parameters():
            assert param.grad is not None, name
            assert torch.isfinite(param.grad).all(), name
            assert param.grad.abs().sum() > 0, name


def test_gradients_are_finite_and_exact_with_saturated_gates() -> None:
    # tiny tau: eq. (7) saturates, alpha is exactly 0 or 1 almost everywhere
    parser = ParsingNetwork(4, 6, tau=1e-4)
    attend = GatedSelfAttention(4)
    x = torch.randn(2, 9, 4)
    parsed = parser(x)
    causal = _causal(9)
    alpha = parsed.alpha[:, causal]
    assert (alpha == 0).any() and (alpha == 1).any()
    out = attend(x, parsed.expected_gates)
    out.context.sum().backward()
    for module in (parser, attend):
        for name, param in module.named_parameters():
            assert param.grad is not None and torch.isfinite(param.grad).all(), name

    # d E[g_i] / d alpha_j = prod_{m in (i, t), m != j} alpha_m, also when some alpha are 0 / 1
    alpha = _row([0.3, 0.0, 1.0, 0.0]).requires_grad_(True)
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=F64)
    (expected_gates(alpha)[0, 4] * weights).sum().backward()
    a = alpha.detach()[0, 4, :4].tolist()
    grad = [0.0] * 4
    for i in range(4):
        for j in range(i + 1, 4):
            grad[j] += (
                weights[i].item()
                * torch.tensor([a[m] for m in range(i + 1, 4) if m != j], dtype=F64).prod().item()
            )
    assert alpha.grad is not None
    torch.testing.assert_close(alpha.grad[0, 4, :4], torch.tensor(grad, dtype=F64))


def test_gradcheck_float64() -> None:
    n = 5
    mask = torch.tensor([[True] * 5, [False, True, True, True, False]])
    alpha = (torch.rand(2, n, n, dtype=F64) * 0.9 + 0.05).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a: expected_gates(a, mask), (alpha,))
    assert torch.autograd.gradgradcheck(lambda a: expected_gates(a, mask), (alpha,))
    assert torch.autograd.gradcheck(lambda a: stick_breaking_distribution(a, mask), (alpha,))
    d = (torch.rand(2, n, dtype=F64) + 0.2).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: bradley_terry_distribution(x, mask), (d,))
    assert torch.autograd.gradcheck(lambda x: bradley_terry_expected_gates(x, mask), (d,))
    raw = (_causal_softmax(2, n) + 0.01).requires_grad_(True)
    gates = (torch.rand(2, n, n, dtype=F64) + 0.1).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda r, g: gated_attention_weights(r, g, mask), (raw, gates))


# ---- tree extraction ----------------------------------------------------------------------------
def _split_literal(values: list[float], leaves: list[object]) -> object:
    """The notes' SPLIT verbatim, with the empty set as ``()``; empties removed afterwards."""
    if not values:
        return ()
    if len(values) == 1:
        return leaves[0]
    i = values.index(max(values))
    return (
        _split_literal(values[:i], leaves[:i]),
        (leaves[i], _split_literal(values[i + 1 :], leaves[i + 1 :])),
    )


def _drop_empty(tree: object) -> object:
    if not isinstance(tree, tuple) or tree == ():
        return tree
    kids = [_drop_empty(k) for k in tree]
    kids = [k for k in kids if k != ()]
    return kids[0] if len(kids) == 1 else tuple(kids)


def test_split_tree_hand_examples() -> None:
    abc, abcd = list("abc"), list("abcd")
    assert split_tree([3, 1, 2], abc) == ("a", ("b", "c"))
    assert tree_to_brackets(split_tree([3, 1, 2], abc)) == "(a (b c))"
    assert tree_to_brackets(split_tree([1, 3, 2], abc)) == "(a (b c))"
    assert tree_to_brackets(split_tree([1, 2, 3], abc)) == "((a b) c)"
    assert tree_to_brackets(split_tree([2, 0, 3, 1], abcd)) == "((a b) (c d))"
    assert tree_to_brackets(split_tree([1, 1, 1], abc)) == "(a (b c))"  # ties: leftmost argmax
    # the notes' running example, default leaves are positions, tensors are accepted
    assert split_tree(torch.tensor(D)) == (0, (1, ((2, 3), 4)))
    assert split_tree([0.3], ["x"]) == "x" and tree_to_brackets("x") == "x"
    # x_i joins the left part instead
    assert tree_to_brackets(split_tree([1, 3, 2], abc, attach="left")) == "((a b) c)"
    assert tree_to_brackets(split_tree([3, 1, 2], abc, attach="left")) == "(a (b c))"
    assert tree_to_brackets(split_tree([1, 3, 0, 2], abcd, attach="left")) == "((a b) (c d))"


def test_split_tree_matches_the_notes_pseudocode() -> None:
    for n in range(1, 9):
        for _ in range(10):
            values = torch.randint(0, 4, (n,)).tolist()  # many ties
            leaves = [f"w{i}" for i in range(n)]
            assert split_tree(values, leaves) == _drop_empty(_split_literal(values, leaves))


def test_tree_spans() -> None:
    tree = split_tree([2, 0, 3, 1], list("abcd"))
    assert tree_spans(tree) == {(0, 2), (2, 4)}
    assert tree_spans(tree, include_root=True) == {(0, 2), (2, 4), (0, 4)}
    assert tree_spans(tree, include_leaves=True) == {(0, 2), (2, 4), (0, 1), (1, 2), (2, 3), (3, 4)}
    assert tree_spans(split_tree(D)) == {(1, 5), (2, 5), (2, 4)}
    assert tree_spans("a") == set() and tree_spans("a", include_leaves=True) == {(0, 1)}


# ---- validation ---------------------------------------------------------------------------------
def test_validation_errors() -> None:
    d = torch.rand(2, 4) + 0.1
    alpha = torch.rand(2, 4, 4)
    with pytest.raises(ValueError, match="`distances`"):
        stick_breaking_gates(torch.rand(4), 1.0)
    with pytest.raises(ValueError, match="`distances` contains NaN"):
        stick_breaking_gates(torch.tensor([[0.1, float("nan")]]), 1.0)
    with pytest.raises(ValueError, match="`tau`"):
        stick_breaking_gates(d, 0.0)
    with pytest.raises(ValueError, match="`mask`"):
        stick_breaking_gates(d, 1.0, mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="`mask`"):
        expected_gates(alpha, mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"`distances` must be > 0"):
        bradley_terry_distribution(torch.tensor([[0.5, 0.0, 1.0]]))
    with pytest.raises(ValueError, match=r"`distances` must be > 0"):
        bradley_terry_gates(torch.tensor([[0.5, -1.0, 1.0]]))
    with pytest.raises(ValueError, match=r"`alpha` must lie in \[0, 1\]"):
        expected_gates(alpha + 1)
    with pytest.raises(ValueError, match="`alpha` must have shape"):
        stick_breaking_distribution(torch.rand(2, 4, 3))
    with pytest.raises(ValueError, match="`gates` must have the shape"):
        gated_attention_weights(alpha, torch.rand(2, 3, 3))
    with pytest.raises(ValueError, match="`raw_attention` must be non-negative"):
        gated_attention_weights(-alpha, alpha)
    with pytest.raises(ValueError, match="`gates` must be non-negative"):
        gated_attention_weights(alpha, -alpha)
    with pytest.raises(ValueError, match="at least one"):
        split_tree([])
    with pytest.raises(ValueError, match="`tokens`"):
        split_tree([1, 2], ["a"])
    with pytest.raises(ValueError, match="`attach`"):
        split_tree([1, 2], attach="up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`distances`"):
        split_tree(torch.rand(2, 2))
    with pytest.raises(ValueError, match="`gate`"):
        ParsingNetwork(4, 4, gate="softmax")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`x`"):
        ParsingNetwork(4, 4)(torch.rand(2, 3, 5))
    with pytest.raises(ValueError, match="`memory`"):
        GatedSelfAttention(4)(torch.rand(2, 3, 4), None, memory=torch.rand(2, 3, 5))


def test_docstring_examples() -> None:
    for module in (sb_module, prpn_module, trees_module):
        result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, module.__name__
