"""MemN2N and the CRF QA models of SAN (Appendix A.4)."""

from __future__ import annotations

import pytest
import torch

from structattn.models.memory_qa import MemoryQA, position_encoding


def _batch(b: int = 3, m: int = 6, length: int = 5, q: int = 4, vocab: int = 30):
    memory = torch.randint(1, vocab, (b, m, length))
    sentence_lengths = torch.randint(2, length + 1, (b, m))
    memory = memory * (torch.arange(length) < sentence_lengths.unsqueeze(-1))
    memory_lengths = torch.tensor([m, m - 2, 1])[:b]
    memory = memory * (torch.arange(m) < memory_lengths.unsqueeze(-1)).unsqueeze(-1)
    question = torch.randint(1, vocab, (b, q))
    return memory, sentence_lengths, memory_lengths, question, torch.full((b,), q)


def test_position_encoding_formula() -> None:
    enc = position_encoding(torch.tensor([3]), 4, 2)[0]  # J = 3, d = 2
    for j in range(1, 4):
        for k in range(1, 3):
            want = (1 - j / 3) - (k / 2) * (1 - 2 * j / 3)
            assert enc[j - 1, k - 1].item() == pytest.approx(want)
    assert (enc[3] == 0).all()  # beyond the sentence


@pytest.mark.parametrize("model", ["memn2n", "unary-crf", "binary-crf"])
def test_shapes_masking_and_gradients(model: str) -> None:
    net = MemoryQA(30, embed_dim=8, hops=3, memory_size=10, model=model)
    batch = _batch()
    out = net(*batch)
    assert out.logits.shape == (3, 30) and out.attention.shape == (3, 3, 6)
    assert out.facts.shape == (3, 3)
    assert (out.attention[2, :, 1:] == 0).all() and (out.facts[2] <= 0).all()
    torch.testing.assert_close(out.attention[0].sum(-1), torch.ones(3))
    memory = batch[0].clone()
    memory[2, 1:] = 7  # change padded sentences
    torch.testing.assert_close(net(memory, *batch[1:]).logits, out.logits)
    out.logits.logsumexp(-1).sum().backward()
    for name, p in net.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_memn2n_one_hop_by_hand() -> None:
    net = MemoryQA(20, embed_dim=4, hops=1, memory_size=5, model="memn2n").double()
    memory, sentence_lengths, memory_lengths, question, question_lengths = _batch(1, 3, 4, 3, 20)
    out = net(memory, sentence_lengths, memory_lengths, question, question_lengths)
    a, c = net.embeddings[0].weight, net.embeddings[1].weight
    pe_q = position_encoding(question_lengths, 3, 4).double()[0]
    q = (a[question[0]] * pe_q).sum(0)
    keys, values = [], []
    for i in range(3):
        pe = position_encoding(sentence_lengths[0, i : i + 1], 4, 4).double()[0]
        recency = 3 - 1 - i
        keys.append((a[memory[0, i]] * pe).sum(0) + net.temporal[0, recency])
        values.append((c[memory[0, i]] * pe).sum(0) + net.temporal[1, recency])
    p = torch.softmax(torch.stack(keys) @ q, 0)
    o = p @ torch.stack(values)
    torch.testing.assert_close(out.logits[0], (q + o) @ c.T)
    torch.testing.assert_close(out.attention[0, 0], p)
    net.linear_start = True
    lin = net(memory, sentence_lengths, memory_lengths, question, question_lengths)
    scores = torch.stack(keys) @ q  # linear start reads with the raw scores ...
    torch.testing.assert_close(lin.logits[0], (q + scores @ torch.stack(values)) @ c.T)
    torch.testing.assert_close(lin.attention[0, 0], p)  # ... and reports their softmax


@pytest.mark.parametrize("model", ["memn2n", "unary-crf", "binary-crf"])
def test_separate_tying_by_hand(model: str) -> None:
    """tying="separate": keys from E_1..E_K, values from V_1..V_K (own temporal vectors), an
    untied answer matrix W; no unused table; every parameter gets a gradient."""
    net = MemoryQA(20, embed_dim=4, hops=2, memory_size=5, model=model, tying="separate")
    net = net.double()
    assert len(net.embeddings) == 2 and net.value_embeddings is not None
    assert net.answer is not None and net.value_temporal is not None
    memory, sentence_lengths, memory_lengths, question, question_lengths = _batch(1, 3, 4, 3, 20)
    out = net(memory, sentence_lengths, memory_lengths, question, question_lengths)
    pe_q = position_encoding(question_lengths, 3, 4).double()[0]
    q = (net.embeddings[0].weight[question[0]] * pe_q).sum(0)
    keys, values = [[], []], [[], []]
    for k in range(2):
        for i in range(3):
            pe = position_encoding(sentence_lengths[0, i : i + 1], 4, 4).double()[0]
            recency = 3 - 1 - i
            e, v = net.embeddings[k].weight, net.value_embeddings[k].weight
            keys[k].append((e[memory[0, i]] * pe).sum(0) + net.temporal[k, recency])
            values[k].append((v[memory[0, i]] * pe).sum(0) + net.value_temporal[k, recency])
    w = net.answer.weight
    if model == "memn2n":
        for k in range(2):
            p = torch.softmax(torch.stack(keys[k]) @ q, 0)
            q = q + p @ torch.stack(values[k])
        torch.testing.assert_close(out.logits[0], q @ w.T)
    else:
        assert net.crf is not None
        context = sum(out.attention[0, k] @ torch.stack(values[k]) for k in range(2))
        last = net.crf.queries(q.unsqueeze(0))[0, -1]  # q_K = Q q
        torch.testing.assert_close(out.logits[0], (last + context) @ w.T)
        if model == "unary-crf":  # independent steps: each marginal is a softmax
            torch.testing.assert_close(
                out.attention[0, 0], torch.softmax(torch.stack(keys[0]) @ q, 0)
            )
    out.logits.logsumexp(-1).sum().backward()
    for name, p in net.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    with pytest.raises(ValueError, match="tying"):
        MemoryQA(20, tying="none")


def test_crf_with_one_hop_is_memn2n_attention() -> None:
    """K = 1: the CRF's marginals are the softmax over facts, and q_K + c = q + c."""
    torch.manual_seed(0)
    crf = MemoryQA(25, embed_dim=6, hops=1, memory_size=8, model="unary-crf")
    mem = MemoryQA(25, embed_dim=6, hops=1, memory_size=8, model="memn2n")
    mem.load_state_dict(crf.state_dict(), strict=False)
    batch = _batch(3, 6, 5, 4, 25)
    a, b = crf(*batch), mem(*batch)
    torch.testing.assert_close(a.attention, b.attention)
    torch.testing.assert_close(a.logits, b.logits)


def test_crf_linear_start_modes() -> None:
    """log-softmax: the CRF is unchanged (the per-step constant cancels); unary: the binary
    model without its fact-to-fact potentials; scores: the context from the raw scores."""
    torch.manual_seed(0)
    batch = _batch()
    out = {}
    for mode in ("log-softmax", "unary", "scores"):
        torch.manual_seed(1)
        net = MemoryQA(30, embed_dim=8, hops=3, memory_size=10, model="binary-crf",
                       crf_linear_start=mode).double()  # fmt: skip
        net.normalize_potentials = True
        after = net(*batch)
        net.linear_start, net.normalize_potentials = True, False
        out[mode] = (after, net(*batch), net)
    after, lin, _ = out["log-softmax"]
    torch.testing.assert_close(lin.logits, after.logits)
    torch.testing.assert_close(lin.attention, after.attention)
    _, lin, net = out["unary"]
    assert not torch.allclose(lin.attention, after.attention)
    facts = lin.facts[:2]
    assert (facts[:, 1:] != facts[:, :-1]).all()  # no-repeat is kept
    assert net.crf is not None
    unary = MemoryQA(30, embed_dim=8, hops=3, memory_size=10, model="unary-crf").double()
    unary.load_state_dict(net.state_dict())
    unary.crf.no_repeat = True  # type: ignore[union-attr]
    ref = unary(*batch)
    torch.testing.assert_close(lin.attention, ref.attention)
    torch.testing.assert_close(lin.logits, ref.logits)
    _, lin, net = out["scores"]
    torch.testing.assert_close(lin.attention, after.attention)  # marginals still reported
    assert net.crf is not None
    seen = {}
    net.crf.register_forward_hook(lambda m, args, o: seen.update(values=args[2], out=o))
    lin = net(*batch)
    unary, values = seen["out"].unary, seen["values"]  # [B, K, M], [B, K, M, d]
    context = torch.einsum("bkm,bkmd->bd", unary.masked_fill(unary.isinf(), 0.0), values)
    answer = net.embeddings[-1].weight
    torch.testing.assert_close(lin.logits, (seen["out"].queries[:, -1] + context) @ answer.T)
    assert not torch.allclose(lin.logits, after.logits)
    with pytest.raises(ValueError, match="crf_linear_start"):
        MemoryQA(30, model="binary-crf", crf_linear_start="linear")


def test_binary_crf_never_repeats_a_fact_and_normalizes() -> None:
    net = MemoryQA(30, embed_dim=8, hops=3, memory_size=10, model="binary-crf")
    net.normalize_potentials = True
    out = net(*_batch())
    facts = out.facts[:2]
    assert (facts[:, 1:] != facts[:, :-1]).all()
    assert torch.isfinite(out.logits).all()


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="model"):
        MemoryQA(10, model="lstm")
    net = MemoryQA(30, memory_size=4)
    with pytest.raises(ValueError, match="memory"):
        net(*_batch(m=6))


def test_random_noise_shifts_recency_in_training_only() -> None:
    """MemN2N's random noise: empty memories between sentences push older sentences to
    later temporal slots, at most ceil(r n) of them, order kept; none at evaluation."""
    torch.manual_seed(0)
    net = MemoryQA(30, embed_dim=4, hops=1, memory_size=60, random_noise=0.1)
    lengths = torch.full((4000,), 20)
    base = net.eval()._recency(lengths, 20)
    assert torch.equal(base[0], torch.arange(19, -1, -1))
    noisy = net.train()._recency(lengths, 20)
    shift = noisy - base
    assert (shift >= 0).all() and (shift <= 2).all()  # ceil(0.1 * 20) = 2
    assert (noisy[:, :-1] > noisy[:, 1:]).all()  # older sentences stay older
    # u ~ U{0, 1, 2} blanks, each after a uniform one of the 21 gaps: the oldest sentence
    # moves by every blank not placed after it, i.e. E[u] * 20 / 21
    assert shift[:, 0].float().mean().item() == pytest.approx(20 / 21, abs=0.05)
    assert torch.equal(net.eval()._recency(lengths, 20), base)


@pytest.mark.parametrize("model", ["memn2n", "binary-crf"])
def test_temporal_encoding_off_makes_memory_a_bag_of_sentences(model: str) -> None:
    """Without the temporal vectors, reversing the order of the memory sentences changes
    neither the answer nor the attention (reversed); with them it does."""
    torch.manual_seed(3)
    memory, lengths, memory_lengths, question, question_lengths = _batch(b=2, m=5)
    memory_lengths = torch.full_like(memory_lengths, 5)
    lengths = torch.full_like(lengths, 5)
    memory = torch.randint(1, 30, memory.shape)
    flipped = memory.flip(1)
    for temporal in (False, True):
        net = MemoryQA(
            30, embed_dim=8, hops=2, memory_size=10, model=model, temporal_encoding=temporal
        ).eval()
        torch.nn.init.normal_(net.temporal, std=1.0)
        a = net(memory, lengths, memory_lengths, question, question_lengths)
        b = net(flipped, lengths, memory_lengths, question, question_lengths)
        same = torch.allclose(a.logits, b.logits, atol=1e-5)
        assert same == (not temporal)
        if not temporal:
            torch.testing.assert_close(a.attention, b.attention.flip(-1), atol=1e-5, rtol=1e-5)


def test_temporal_init_zero() -> None:
    """temporal_init="zero": the temporal vectors (also the separate tables') start at zero,
    so the first forward pass equals the one without temporal encoding; they still learn."""
    torch.manual_seed(4)
    batch = _batch()
    for tying in ("adjacent", "separate"):
        shape = {"embed_dim": 8, "hops": 2, "memory_size": 10, "model": "binary-crf"}
        zero = MemoryQA(30, **shape, tying=tying, temporal_init="zero")  # type: ignore[arg-type]
        assert zero.temporal.abs().sum() == 0
        if zero.value_temporal is not None:
            assert zero.value_temporal.abs().sum() == 0
        off = MemoryQA(30, **shape, tying=tying, temporal_encoding=False)  # type: ignore[arg-type]
        off.load_state_dict(zero.state_dict())
        torch.testing.assert_close(zero.eval()(*batch).logits, off.eval()(*batch).logits)
        zero.train()(*batch).logits.sum().backward()
        assert zero.temporal.grad is not None and zero.temporal.grad.abs().sum() > 0
    normal = MemoryQA(30, embed_dim=8, hops=2, memory_size=10)
    assert normal.temporal.abs().sum() > 0
    with pytest.raises(ValueError, match="temporal_init"):
        MemoryQA(30, temporal_init="ones")


def test_fixed_position_encoding_width() -> None:
    """pe_width=(J, Q): J is the same for every sentence; equal to the sentences' own length
    it changes nothing, and a sentence longer than J is an error."""
    torch.manual_seed(1)
    memory, _, memory_lengths, question, question_lengths = _batch(length=5, q=4)
    full = torch.full(memory.shape[:2], 5)
    memory = torch.randint(1, 30, memory.shape) * (memory.sum(-1, keepdim=True) > 0)
    own = MemoryQA(30, embed_dim=8, hops=2, memory_size=10).eval()
    fixed = MemoryQA(30, embed_dim=8, hops=2, memory_size=10, pe_width=(5, 4)).eval()
    fixed.load_state_dict(own.state_dict())
    batch = (memory, full, memory_lengths, question, question_lengths)
    torch.testing.assert_close(fixed(*batch).logits, own(*batch).logits)
    wider = MemoryQA(30, embed_dim=8, hops=2, memory_size=10, pe_width=(9, 4)).eval()
    wider.load_state_dict(own.state_dict())
    assert not torch.allclose(wider(*batch).logits, own(*batch).logits)
    narrow = MemoryQA(30, embed_dim=8, hops=2, memory_size=10, pe_width=(3, 4))
    with pytest.raises(ValueError, match="pe_width"):
        narrow(*batch)


def test_init_std_and_option_errors() -> None:
    torch.manual_seed(2)
    net = MemoryQA(2000, embed_dim=20, hops=1, init_std=0.316)
    assert net.embeddings[0].weight[1:].std().item() == pytest.approx(0.316, rel=0.05)
    for bad in ({"init_std": 0.0}, {"random_noise": 1.0}, {"pe_width": (0, 3)}):
        with pytest.raises(ValueError):
            MemoryQA(30, **bad)


def test_linear_start_facts_never_point_at_padding() -> None:
    """In linear start MemN2N reads with raw scores; when every real score is negative the
    padded slots (0) must still never be the predicted fact (a reproduce once crashed
    writing predictions for such a run)."""
    torch.manual_seed(3)
    net = MemoryQA(30, embed_dim=8, hops=2, memory_size=10).eval()
    net.linear_start = True
    memory, sentence_lengths, memory_lengths, question, question_lengths = _batch()
    with torch.no_grad():
        for emb in net.embeddings:
            emb.weight.abs_()
        net.embeddings[0].weight[1:] *= -1  # question vs keys: every real score < 0
        net.temporal.zero_()
    out = net(memory, sentence_lengths, memory_lengths, question, question_lengths)
    assert (out.facts < memory_lengths.unsqueeze(-1)).all()
    torch.testing.assert_close(out.attention.sum(-1), torch.ones(3, 2))
