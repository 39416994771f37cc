"""Attention layers: reductions, masking, gradients, brute force, nn.MultiheadAttention parity."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from structattn import DependencyCRF, LinearChainCRF
from structattn.attention import (
    BiLSTMArcScorer,
    MeanFieldAttention,
    MemoryCRFAttention,
    SegmentationAttention,
    SigmoidAttention,
    SoftmaxAttention,
    StructuredMultiheadAttention,
    SyntacticAttention,
)

D = 6
MASK = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])


def _grads_reach_every_parameter(module: nn.Module, loss: torch.Tensor) -> None:
    if not any(True for _ in module.parameters()):
        return  # e.g. softmax attention with a dot scorer has no parameters
    module.zero_grad()
    loss.backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"no gradient reaches {name}"


def _perturb_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.unsqueeze(-1), x, torch.randn_like(x) * 100)


# ---- softmax / sigmoid / segmentation ------------------------------------------------------
@pytest.mark.parametrize("cls", [SoftmaxAttention, SigmoidAttention, SegmentationAttention])
@pytest.mark.parametrize("scorer", ["dot", "bilinear", "mlp"])
def test_scored_attention_masking_and_gradients(cls, scorer: str) -> None:
    layer = cls(D, scorer=scorer).double()
    if isinstance(layer, SegmentationAttention):
        nn.init.normal_(layer.transitions)
    memory = torch.randn(2, 5, D, dtype=torch.float64)
    query = torch.randn(2, 3, D, dtype=torch.float64)
    out = layer(query, memory, MASK)
    assert out.context.shape == (2, 3, D) and out.weights.shape == (2, 3, 5)
    assert (out.weights[1, :, 3:] == 0).all()
    again = layer(query, _perturb_padding(memory, MASK), MASK)
    torch.testing.assert_close(again.context, out.context)
    torch.testing.assert_close(again.weights, out.weights)
    single = layer(query[:, 0], memory, MASK)  # [B, D] query
    torch.testing.assert_close(single.context, out.context[:, 0])
    loss = out.context.pow(2).sum()
    if isinstance(layer, SegmentationAttention):
        loss = loss + layer.penalty()
    _grads_reach_every_parameter(layer, loss)


def test_softmax_attention_is_softmax() -> None:
    layer = SoftmaxAttention(D, scorer="dot")
    memory, query = torch.randn(2, 5, D), torch.randn(2, D)
    out = layer(query, memory)
    weights = torch.softmax(torch.einsum("bnd,bd->bn", memory, query), -1)
    torch.testing.assert_close(out.weights, weights)
    torch.testing.assert_close(out.context, torch.einsum("bn,bnd->bd", weights, memory))


def test_segmentation_with_zero_transitions_is_sigmoid() -> None:
    seg = SegmentationAttention(D, normalize=False).double()
    sig = SigmoidAttention(D).double()
    sig.scorer.load_state_dict(seg.scorer.state_dict())
    memory, query = (
        torch.randn(2, 5, D, dtype=torch.float64),
        torch.randn(2, 4, D, dtype=torch.float64),
    )
    a, b = seg(query, memory, MASK), sig(query, memory, MASK)
    torch.testing.assert_close(a.weights, b.weights)
    torch.testing.assert_close(a.context, b.context)


def test_segmentation_marginals_normalisation_and_queries() -> None:
    layer = SegmentationAttention(D, lam=2.0).double()
    nn.init.normal_(layer.transitions)
    memory, query = (
        torch.randn(2, 5, D, dtype=torch.float64),
        torch.randn(2, 3, D, dtype=torch.float64),
    )
    out = layer(query, memory, MASK)
    for b, q in itertools.product(range(2), range(3)):  # one chain per query, by hand
        n = int(MASK[b].sum())
        theta = out.scores[b, q, :n]
        unary = torch.stack([torch.zeros_like(theta), theta], -1)[None]
        p = LinearChainCRF(unary, layer.transitions.detach()).marginals[0, :, 1]
        torch.testing.assert_close(out.weights[b, q, :n], p)
        gamma = p.sum() / 2.0
        torch.testing.assert_close(out.context[b, q], (p[:, None] * memory[b, :n]).sum(0) / gamma)
    labels = layer.decode(query, memory, MASK)
    assert labels.shape == (2, 3, 5) and (labels[1, :, 3:] == -1).all()
    torch.testing.assert_close(layer.penalty(), 0.005 * layer.transitions.pow(2).sum())


def test_segmentation_rejects_non_prefix_mask() -> None:
    with pytest.raises(ValueError, match="prefix"):
        SegmentationAttention(D)(
            torch.randn(1, D), torch.randn(1, 3, D), torch.tensor([[1, 0, 1]]).bool()
        )


# ---- memory CRF ---------------------------------------------------------------------------
def _brute_memory(unary, pairwise, no_repeat):
    k, n = unary.shape
    seqs, scores = [], []
    for z in itertools.product(range(n), repeat=k):
        if no_repeat and any(a == b for a, b in zip(z, z[1:], strict=False)):
            continue
        s = sum(unary[i, z[i]] for i in range(k))
        if pairwise is not None:
            s = s + sum(pairwise[i, z[i], z[i + 1]] for i in range(k - 1))
        seqs.append(z)
        scores.append(s)
    return seqs, torch.stack(scores)


@pytest.mark.parametrize("binary", [False, True])
def test_memory_crf_against_brute_force(binary: bool) -> None:
    k, n = 3, 4
    layer = MemoryCRFAttention(D, steps=k, binary=binary).double()
    query = torch.randn(2, D, dtype=torch.float64)
    keys = torch.randn(2, k, n, D, dtype=torch.float64)
    values = torch.randn(2, k, n, D, dtype=torch.float64)
    out = layer(query, keys, values)
    assert out.marginals.shape == (2, k, n) and out.edge_marginals.shape == (2, k - 1, n, n)
    # potentials as defined in the paper
    q = [query]
    for _ in range(k - 1):
        q.append(q[-1] @ layer.query_update.weight.T)
    for b in range(2):
        unary = torch.stack([keys[b, s] @ q[s][b] for s in range(k)])
        torch.testing.assert_close(out.unary[b], unary)
        pair = None
        if binary:
            pair = torch.stack([keys[b, s] @ keys[b, s + 1].T for s in range(k - 1)])
        seqs, scores = _brute_memory(unary, pair, no_repeat=binary)
        probs = (scores - scores.logsumexp(0)).exp()
        marg = torch.zeros(k, n, dtype=torch.float64)
        for z, p in zip(seqs, probs, strict=True):
            for s in range(k):
                marg[s, z[s]] += p
        torch.testing.assert_close(out.marginals[b], marg)
        context = sum(marg[s] @ values[b, s] for s in range(k))
        torch.testing.assert_close(out.context[b], context)
        best = seqs[int(scores.argmax())]
        assert layer.decode(query, keys)[b].tolist() == list(best)
        assert out.distribution.argmax[b].tolist() == list(best)
        top_p, top_seq = layer.topk(query, keys, 3)
        ranked = probs.sort(descending=True).values[:3]
        torch.testing.assert_close(top_p[:, b], ranked)
        assert top_seq[0, b].tolist() == list(best)
    if binary:
        assert (out.edge_marginals.diagonal(dim1=-2, dim2=-1) == 0).all()


@pytest.mark.parametrize("mode", ["memory", "hop", "both"])
@pytest.mark.parametrize("binary", [False, True])
def test_memory_crf_memory_queries_against_brute_force(binary: bool, mode: str) -> None:
    """query_mode="memory": q_{k+1} = sum_i theta_k(i) o_i^k over the real facts; "hop":
    q_{k+1} = q_k + sum_i softmax(theta_k)(i) o_i^k (MemN2N); "both": Q q_k + the memory
    term; then the same CRF as in linear mode; padding never changes anything; values are
    required."""
    k, n = 3, 5
    layer = MemoryCRFAttention(D, steps=k, binary=binary, query_mode=mode).double()  # type: ignore[arg-type]
    if mode == "both":
        assert layer.query_update is not None
        with torch.no_grad():
            layer.query_update.weight.normal_()
    else:
        assert layer.query_update is None and not any(True for _ in layer.parameters())
    mask = torch.tensor([[True] * n, [True, False, True, True, False]])
    query = torch.randn(2, D, dtype=torch.float64)
    keys = torch.randn(2, k, n, D, dtype=torch.float64)
    values = torch.randn(2, k, n, D, dtype=torch.float64)
    out = layer(query, keys, values, mask)
    for b in range(2):
        real = mask[b].nonzero().squeeze(-1)
        q, unary = query[b], []
        for s in range(k):
            theta = keys[b, s, real] @ q
            unary.append(theta)
            torch.testing.assert_close(out.queries[b, s], q)
            if mode == "hop":
                q = q + theta.softmax(0) @ values[b, s, real]
            elif mode == "both":
                assert layer.query_update is not None
                q = layer.query_update.weight @ q + theta @ values[b, s, real]
            else:
                q = theta @ values[b, s, real]
        unary_t = torch.stack(unary)
        torch.testing.assert_close(out.unary[b][:, real], unary_t)
        pair = None
        if binary:
            pair = torch.stack([keys[b, s, real] @ keys[b, s + 1, real].T for s in range(k - 1)])
        seqs, scores = _brute_memory(unary_t, pair, no_repeat=binary)
        probs = (scores - scores.logsumexp(0)).exp()
        marg = torch.zeros(k, len(real), dtype=torch.float64)
        for z, p in zip(seqs, probs, strict=True):
            for s in range(k):
                marg[s, z[s]] += p
        torch.testing.assert_close(out.marginals[b][:, real], marg)
        best = [int(real[i]) for i in seqs[int(scores.argmax())]]
        assert layer.decode(query, keys, mask, values=values)[b].tolist() == best
    keys2 = torch.stack([_perturb_padding(keys[:, s], mask) for s in range(k)], 1)
    values2 = torch.stack([_perturb_padding(values[:, s], mask) for s in range(k)], 1)
    again = layer(query, keys2, values2, mask)
    torch.testing.assert_close(again.context, out.context)
    inputs = (query[1:], keys[1:, :, :, :3], values[1:, :, :, :3])
    small = MemoryCRFAttention(3, steps=k, binary=binary, query_mode=mode).double()  # type: ignore[arg-type]
    assert torch.autograd.gradcheck(
        lambda q_, k_, v_: small(q_[:, :3], k_, v_, mask[1:]).context,
        tuple(x.clone().requires_grad_() for x in inputs),
    )
    with pytest.raises(ValueError, match="values"):
        layer.decode(query, keys, mask)
    with pytest.raises(ValueError, match="query_mode"):
        MemoryCRFAttention(D, steps=2, query_mode="greedy")  # type: ignore[arg-type]


def test_memory_crf_per_edge_unary_is_the_papers_sum_of_edge_potentials() -> None:
    """edge_unary="per-edge": p(z) ∝ exp(sum_k theta_k(z_k) + x_{z_k}^k . x_{z_k+1}^{k+1} +
    theta_{k+1}(z_{k+1})), the paper's binary potential summed over the K - 1 edges."""
    k, n = 3, 4
    layer = MemoryCRFAttention(D, steps=k, edge_unary="per-edge").double()
    query = torch.randn(1, D, dtype=torch.float64)
    keys = torch.randn(1, k, n, D, dtype=torch.float64)
    out = layer(query, keys, keys)
    q = [query[0]]
    for _ in range(k - 1):
        q.append(q[-1] @ layer.query_update.weight.T)
    theta = torch.stack([keys[0, s] @ q[s] for s in range(k)])  # [K, n]
    scores, seqs = [], []
    for z in itertools.product(range(n), repeat=k):
        if any(z[s] == z[s + 1] for s in range(k - 1)):
            continue
        seqs.append(z)
        scores.append(
            sum(
                theta[s, z[s]]
                + keys[0, s, z[s]] @ keys[0, s + 1, z[s + 1]]
                + theta[s + 1, z[s + 1]]
                for s in range(k - 1)
            )
        )
    probs = (torch.stack(scores) - torch.stack(scores).logsumexp(0)).exp()
    marg = torch.zeros(k, n, dtype=torch.float64)
    for z, p in zip(seqs, probs, strict=True):
        for s in range(k):
            marg[s, z[s]] += p
    torch.testing.assert_close(out.marginals[0], marg)
    two = MemoryCRFAttention(D, steps=2, edge_unary="per-edge").double()
    once = MemoryCRFAttention(D, steps=2).double()
    once.load_state_dict(two.state_dict())
    torch.testing.assert_close(  # K = 2: nothing is counted twice
        two(query, keys[:, :2], keys[:, :2]).marginals,
        once(query, keys[:, :2], keys[:, :2]).marginals,
    )
    with pytest.raises(ValueError, match="edge_unary"):
        MemoryCRFAttention(D, steps=3, edge_unary="twice")  # type: ignore[arg-type]


def test_memory_crf_one_step_is_softmax_over_facts() -> None:
    layer = MemoryCRFAttention(D, steps=1)
    query, keys, values = torch.randn(3, D), torch.randn(3, 7, D), torch.randn(3, 7, D)
    out = layer(query, keys, values)
    p = torch.softmax(torch.einsum("bnd,bd->bn", keys, query), -1)
    torch.testing.assert_close(out.marginals[:, 0], p)
    torch.testing.assert_close(out.context, torch.einsum("bn,bnd->bd", p, values))


def test_memory_crf_masking_and_gradients() -> None:
    layer = MemoryCRFAttention(D, steps=3, binary=True)
    mask = torch.tensor([[True] * 6, [True, False, True, True, False, False]])  # any pattern
    query, keys, values = torch.randn(2, D), torch.randn(2, 6, D), torch.randn(2, 6, D)
    out = layer(query, keys, values, mask)
    assert (out.marginals[1][:, ~mask[1]] == 0).all()
    again = layer(query, _perturb_padding(keys, mask), _perturb_padding(values, mask), mask)
    torch.testing.assert_close(again.context, out.context)
    _grads_reach_every_parameter(layer, out.context.pow(2).sum())
    assert torch.isfinite(
        torch.autograd.grad(layer(query, keys.requires_grad_(), values, mask).context.sum(), keys)[
            0
        ]
    ).all()


def test_memory_crf_any_number_of_steps() -> None:
    for k in (1, 2, 5):
        out = MemoryCRFAttention(D, steps=k)(
            torch.randn(2, D), torch.randn(2, 4, D), torch.randn(2, 4, D)
        )
        torch.testing.assert_close(out.marginals.sum(-1), torch.ones(2, k))


# ---- syntactic ----------------------------------------------------------------------------
@pytest.mark.parametrize(("structure", "layers"), [("projective", 1), ("softmax", 1),
                                                    ("projective", 2)])  # fmt: skip
def test_syntactic_attention(structure: str, layers: int) -> None:
    layer = SyntacticAttention(
        D, hidden_dim=5, structure=structure, children=True, scorer_layers=layers
    ).double()
    x = torch.randn(2, 5, D, dtype=torch.float64)
    out = layer(x, MASK)
    assert out.parents.shape == (2, 5, D) and out.marginals.shape == (2, 6, 6)
    sums = out.marginals.sum(1)  # each word's head distribution sums to one
    torch.testing.assert_close(sums[0, 1:], torch.ones(5, dtype=torch.float64))
    torch.testing.assert_close(sums[1, 1:4], torch.ones(3, dtype=torch.float64))
    assert (out.marginals[1, 4:] == 0).all() and (out.marginals[1, :, 4:] == 0).all()
    full = torch.cat([layer.root.expand(2, 1, D), x], 1)
    torch.testing.assert_close(out.parents, (out.marginals.transpose(1, 2) @ full)[:, 1:])
    if structure == "projective":
        ref = DependencyCRF(out.arc_scores, torch.tensor([6, 4])).marginals
        torch.testing.assert_close(out.marginals, ref)
    # padding invariance (the backward LSTM must not read padding)
    again = layer(_perturb_padding(x, MASK), MASK)
    torch.testing.assert_close(again.parents, out.parents)
    alone = layer(x[1:, :3])
    torch.testing.assert_close(alone.parents[0], out.parents[1, :3])
    heads = layer.parse(x, MASK)
    assert heads.shape == (2, 6) and heads[1, 4:].eq(-1).all() and heads[:, 0].eq(-1).all()
    _grads_reach_every_parameter(layer, out.parents.pow(2).sum() + out.children.pow(2).sum())


def test_arc_scorer_layers() -> None:
    one = BiLSTMArcScorer(D, 4)
    assert not any(k.startswith("upper") for k in one.state_dict())  # old checkpoints load
    two = BiLSTMArcScorer(D, 4, layers=2)
    assert {k.split(".")[0] for k in two.state_dict()} >= {"forward_lstm", "upper"}
    with pytest.raises(ValueError, match="layers"):
        BiLSTMArcScorer(D, 4, layers=0)


def test_syntactic_attention_with_caller_root() -> None:
    layer = SyntacticAttention(D, hidden_dim=4, prepend_root=False)
    x = torch.randn(2, 5, D)
    out = layer(x, MASK)
    assert out.parents.shape == (2, 5, D) and out.marginals.shape == (2, 5, 5)
    assert (out.parents[:, 0] == 0).all()  # ROOT has no parent
    assert layer.root is None


# ---- mean field ---------------------------------------------------------------------------
def test_mean_field_attention_zero_interactions_is_sigmoid() -> None:
    layer = MeanFieldAttention(D, iterations=4)
    nn.init.zeros_(layer.pair_memory.weight)  # J = 0
    memory, query = torch.randn(2, 5, D), torch.randn(2, 3, D)
    out = layer(query, memory, MASK)
    torch.testing.assert_close(out.weights, torch.sigmoid(out.unary) * MASK[:, None])
    assert (out.interactions == 0).all()


def test_mean_field_attention_masking_symmetry_and_gradients() -> None:
    layer = MeanFieldAttention(D, iterations=3)
    memory, query = torch.randn(2, 5, D), torch.randn(2, 3, D)
    out = layer(query, memory, MASK)
    torch.testing.assert_close(out.interactions, out.interactions.transpose(-1, -2))
    assert (out.weights[1, :, 3:] == 0).all() and (out.interactions[1, :, 3:] == 0).all()
    torch.testing.assert_close(
        layer(query, _perturb_padding(memory, MASK), MASK).context, out.context
    )
    _grads_reach_every_parameter(layer, out.context.pow(2).sum())


def _mean_field_oracle(layer: MeanFieldAttention, query, memory, mask):
    """Algorithm 1 with the layer's parameters, item by item and query by query, J built
    entry by entry (phi, J, spins, context)."""
    v, w, b = layer.unary_out.weight[0], layer.unary_memory.weight, layer.unary_memory.bias
    u, a, c, cb = (layer.unary_query.weight, layer.pair_memory.weight,
                   layer.pair_query.weight, layer.pair_query.bias)  # fmt: skip
    contexts, spins, unaries, couplings = [], [], [], []
    for i in range(memory.shape[0]):
        h = memory[i, mask[i]]  # [n, D] the real positions
        n = h.shape[0]
        for d in query[i]:
            phi = torch.tanh(h @ w.T + b + u @ d) @ v  # [n]
            gate = (c @ d + cb) / layer.rank**0.5
            j = torch.stack([torch.stack([((a @ h[p]) * gate * (a @ h[q])).sum() * (p != q)
                                          for q in range(n)]) for p in range(n)])  # fmt: skip
            s = torch.sigmoid(phi)
            for _ in range(layer.iterations):
                s = torch.sigmoid(phi + j @ s)
            contexts.append(s @ h)
            spins.append(s)
            unaries.append(phi)
            couplings.append(j)
    return contexts, spins, unaries, couplings


@pytest.mark.parametrize("k", [0, 1, 5])
def test_mean_field_attention_matches_algorithm_1_and_keys(k: int) -> None:
    # precomputed keys and the fused updates (#19) change no number: outputs and gradients
    # in float64 against the layer's formula, with and without ``keys``
    torch.manual_seed(k)
    layer = MeanFieldAttention(D, 4, hidden_dim=5, iterations=k).double()
    for p in layer.parameters():
        nn.init.normal_(p, std=0.8)  # strong interactions: the updates matter
    memory = torch.randn(2, 5, D, dtype=torch.float64, requires_grad=True)
    query = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    out = layer(query, memory, MASK)
    keyed = layer(query, memory, MASK, keys=layer.precompute(memory, MASK))
    contexts, spins, unaries, couplings = _mean_field_oracle(layer, query, memory, MASK)
    for i in range(2):
        n = int(MASK[i].sum())
        for q in range(3):
            t = 3 * i + q
            torch.testing.assert_close(out.context[i, q], contexts[t], rtol=0, atol=1e-10)
            torch.testing.assert_close(out.weights[i, q, :n], spins[t], rtol=0, atol=1e-10)
            torch.testing.assert_close(out.unary[i, q, :n], unaries[t], rtol=0, atol=1e-10)
            torch.testing.assert_close(
                out.interactions[i, q, :n, :n], couplings[t], rtol=0, atol=1e-10
            )
    for got, want in zip(keyed, out, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    inputs = (query, memory, *layer.parameters())
    seed = torch.randn_like(out.context)
    oracle = (torch.stack(contexts).view(2, 3, D) * seed).sum()
    want = torch.autograd.grad(oracle, inputs, allow_unused=True)  # k = 0: J is unused
    got = torch.autograd.grad((keyed.context * seed).sum(), inputs, allow_unused=True)
    for g, r, x in zip(got, want, inputs, strict=True):
        zero = torch.zeros_like(x)
        torch.testing.assert_close(zero if g is None else g, zero if r is None else r,
                                   rtol=0, atol=1e-9)  # fmt: skip


def test_mean_field_attention_gradcheck_and_gradgradcheck_with_keys() -> None:
    # the fused updates' hand-written backward, and autograd through them when the
    # gradient is differentiated again, through the keyed path of the layer
    layer = MeanFieldAttention(4, 3, hidden_dim=3, iterations=3).double()
    memory = torch.randn(2, 4, 4, dtype=torch.float64, requires_grad=True)
    query = torch.randn(2, 2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True] * 4, [True, True, False, False]])

    def context(q: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return layer(q, m, mask, keys=layer.precompute(m, mask)).context

    assert torch.autograd.gradcheck(context, (query, memory))
    assert torch.autograd.gradgradcheck(context, (query, memory))


# ---- multi-head ---------------------------------------------------------------------------
@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_softmax_matches_torch(batch_first: bool) -> None:
    ref = nn.MultiheadAttention(12, 3, batch_first=batch_first)
    ours = StructuredMultiheadAttention.from_torch(ref)
    x = torch.randn(2, 5, 12) if batch_first else torch.randn(5, 2, 12)
    kpm = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    for kwargs in (
        {"key_padding_mask": kpm},
        {"attn_mask": torch.randn(5, 5)},
        {"attn_mask": torch.ones(5, 5).triu(1).bool(), "is_causal": True},
        {"average_attn_weights": False},
        {"need_weights": False},
    ):
        a, wa = ref(x, x, x, **kwargs)
        b, wb = ours(x, x, x, **kwargs)
        torch.testing.assert_close(b, a)
        if wa is None:
            assert wb is None
        else:
            torch.testing.assert_close(wb, wa)


def test_multihead_softmax_matches_torch_with_kdim_vdim() -> None:
    ref = nn.MultiheadAttention(8, 2, kdim=5, vdim=3, batch_first=True)
    ours = StructuredMultiheadAttention(8, 2, kdim=5, vdim=3, batch_first=True)
    ours.load_state_dict(ref.state_dict(), strict=False)
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 6, 5), torch.randn(2, 6, 3)
    torch.testing.assert_close(ours(q, k, v)[0], ref(q, k, v)[0])


def test_multihead_structured_heads() -> None:
    heads = ["softmax", "sigmoid", "segmentation", "projective", "mean-field"]
    mha = StructuredMultiheadAttention(20, 5, batch_first=True, normalizer=heads).double()
    nn.init.normal_(mha.root_value)
    nn.init.normal_(mha.coupling)
    nn.init.normal_(mha.transitions)
    x = torch.randn(2, 5, 20, dtype=torch.float64)
    kpm = ~MASK
    out, w = mha(x, x, x, key_padding_mask=kpm, average_attn_weights=False)
    assert w is not None and w.shape == (2, 5, 5, 5)
    assert (w[1, :, :, 3:] == 0).all()
    torch.testing.assert_close(w[:, 0].sum(-1)[0], torch.ones(5, dtype=torch.float64))
    tree_rows = w[0, 3].sum(-1)
    assert (tree_rows <= 1 + 1e-9).all() and (tree_rows > 0).all()
    perturbed = torch.where(MASK.unsqueeze(-1), x, torch.randn_like(x) * 10)
    out2, _ = mha(perturbed, perturbed, perturbed, key_padding_mask=kpm)
    torch.testing.assert_close(out2[:, :3], out[:, :3])
    _grads_reach_every_parameter(mha, out[:, :3].pow(2).sum())
    with pytest.raises(ValueError, match="attn_mask"):
        mha(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match="normalizer"):
        StructuredMultiheadAttention(8, 2, normalizer="tree")


def test_transformer_layer_with_tree_heads_trains() -> None:
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    layer.self_attn = StructuredMultiheadAttention(16, 2, batch_first=True, normalizer="projective")
    x = torch.randn(3, 6, 16)
    out = layer(
        x, src_key_padding_mask=torch.tensor([[False] * 6] * 2 + [[False] * 4 + [True] * 2])
    )
    assert out.shape == (3, 6, 16) and torch.isfinite(out).all()
    out[:, :4].sum().backward()


# ---- compile ------------------------------------------------------------------------------
@pytest.mark.slow
def test_layers_work_under_torch_compile() -> None:
    layer = SegmentationAttention(D)
    query, memory = torch.randn(2, 3, D), torch.randn(2, 5, D)
    compiled = torch.compile(layer)
    out = compiled(query, memory, MASK)
    torch.testing.assert_close(out.context, layer(query, memory, MASK).context)
    out.context.sum().backward()


@pytest.mark.parametrize("cls", [SoftmaxAttention, SegmentationAttention, MeanFieldAttention])
def test_memory_layers_name_bad_arguments(cls) -> None:
    layer = cls(D)
    memory = torch.randn(2, 5, D)
    with pytest.raises(ValueError, match="query"):
        layer(torch.randn(3, D), memory)
    with pytest.raises(ValueError, match="values"):
        layer(torch.randn(2, D), memory, values=torch.randn(2, 4, D))
    with pytest.raises(ValueError, match="mask"):
        layer(torch.randn(2, D), memory, mask=torch.ones(2, 5))


# ---- length 1 (issue #20.3) ---------------------------------------------------------------
LENGTH_ONE = torch.tensor([[True, False, False], [True, True, True], [True, False, False]])


@pytest.mark.parametrize(
    "cls", [SoftmaxAttention, SigmoidAttention, SegmentationAttention, MeanFieldAttention]
)
def test_memory_layers_at_length_one(cls) -> None:
    layer = cls(D).double()
    if isinstance(layer, SegmentationAttention):
        nn.init.normal_(layer.transitions)
    query = torch.randn(3, 2, D, dtype=torch.float64)
    one = layer(query, torch.randn(3, 1, D, dtype=torch.float64))  # N = 1
    assert one.weights.shape == (3, 2, 1) and torch.isfinite(one.context).all()
    memory = torch.randn(3, 3, D, dtype=torch.float64)
    out = layer(query, memory, LENGTH_ONE)  # items of length 1 in a padded batch
    for b in range(3):
        n = int(LENGTH_ONE[b].sum())
        alone = layer(query[b : b + 1], memory[b : b + 1, :n])
        torch.testing.assert_close(out.context[b : b + 1], alone.context)
        torch.testing.assert_close(out.weights[b : b + 1, :, :n], alone.weights)
    if isinstance(layer, SegmentationAttention):
        assert layer.decode(query, memory, LENGTH_ONE)[0, :, 1:].eq(-1).all()


@pytest.mark.parametrize("structure", ["projective", "non-projective", "softmax"])
def test_syntactic_attention_at_length_one(structure: str) -> None:
    layer = SyntacticAttention(D, hidden_dim=4, structure=structure).double()
    x = torch.randn(3, 3, D, dtype=torch.float64)
    one = layer(x[:, :1])
    assert one.parents.shape == (3, 1, D) and torch.isfinite(one.parents).all()
    if structure != "softmax":  # the only word attaches to ROOT
        torch.testing.assert_close(one.marginals[:, 0, 1], torch.ones(3, dtype=torch.float64))
    out = layer(x, LENGTH_ONE)
    torch.testing.assert_close(out.parents[0:1, :1], one.parents[0:1])
    assert layer.parse(x, LENGTH_ONE)[0].tolist() == [-1, 0, -1, -1]


def test_memory_crf_with_one_fact() -> None:
    query, keys, values = torch.randn(2, D), torch.randn(2, 1, D), torch.randn(2, 1, D)
    out = MemoryCRFAttention(D, steps=3, no_repeat=False)(query, keys, values)
    torch.testing.assert_close(out.marginals, torch.ones(2, 3, 1))
    # no_repeat with one fact and K >= 2: no valid sequence, zero marginals (documented)
    out = MemoryCRFAttention(D, steps=3, no_repeat=True)(query, keys, values)
    assert (out.marginals == 0).all() and (out.context == 0).all()
    assert (out.distribution.argmax == -1).all()


# ---- one mask validator (issue #14.7) -----------------------------------------------------
def test_one_mask_validator_names_the_argument() -> None:
    from structattn._validation import check_mask

    assert check_mask("mask", None, (2, 3), torch.device("cpu")).all()
    for bad in (torch.ones(2, 3), torch.ones(2, 4, dtype=torch.bool), [[True] * 3] * 2):
        with pytest.raises(ValueError, match="`source_mask` must be a BoolTensor of shape"):
            check_mask("source_mask", bad, (2, 3), torch.device("cpu"))
    with pytest.raises(ValueError, match="`lengths_mask` must be a prefix mask"):
        check_mask("lengths_mask", torch.tensor([[True, False, True]]), (1, 3), None, prefix=True)
    with pytest.raises(ValueError, match="`mask` must leave at least 1"):
        check_mask("mask", torch.tensor([[False] * 3]), (1, 3), None, prefix=True)
