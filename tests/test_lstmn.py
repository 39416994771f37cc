"""LSTMN: cell, stack and decoder against a naive per-item, per-step reference of the paper's
equations (float64), masking, step-wise decoding, gradients, training, validation."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from structattn.nn.lstmn import (
    LSTMN,
    LSTMNCell,
    LSTMNDecoder,
    LSTMNDecoderState,
    LSTMNSource,
    LSTMNState,
)

D, H = 3, 4
DT = torch.float64


# ----------------------------------------------------------------------------- reference


def _softmax(a: list[Tensor]) -> Tensor:
    e = torch.stack([torch.exp(x) for x in a])
    return e / e.sum()


def _weighted_sum(weights: Tensor, vectors: list[Tensor] | Tensor) -> Tensor:
    """sum_i weights[i] * vectors[i], term by term."""
    total = torch.zeros_like(vectors[0])
    for i in range(len(weights)):
        total = total + weights[i] * vectors[i]
    return total


def ref_layer(cell: LSTMNCell, x: Tensor, extra: list[Tensor] | None = None):
    """One unpadded item x [T, D], eq. 4-9 literally; ``extra[t]`` is added to c_t (deep
    fusion). Returns h [T, H], c [T, H], attention [T, T] (row t over i < t)."""
    wx, wh = cell.attn_input.weight, cell.attn_hidden.weight
    wht, v = cell.attn_summary.weight, cell.attn_score.weight[0]
    w = torch.cat([cell.summary_gates.weight, cell.input_gates.weight], dim=1)  # W [h~, x]
    b = cell.input_gates.bias
    n = cell.hidden_size
    length = x.shape[0]
    hs: list[Tensor] = []
    cs: list[Tensor] = []
    attention = torch.zeros(length, length, dtype=x.dtype)
    h_tilde_prev = torch.zeros(n, dtype=x.dtype)
    for t in range(length):
        if t == 0:  # first step: only the zero slot (h_0, c_0) to attend to
            h_tilde = torch.zeros(n, dtype=x.dtype)
            c_tilde = torch.zeros(n, dtype=x.dtype)
        else:
            a = [v @ torch.tanh(wh @ hs[i] + wx @ x[t] + wht @ h_tilde_prev) for i in range(t)]
            s = _softmax(a)
            h_tilde = _weighted_sum(s, hs)
            c_tilde = _weighted_sum(s, cs)
            for i in range(t):
                attention[t, i] = s[i]
        z = w @ torch.cat([h_tilde, x[t]]) + b
        i_g, f_g, o_g = (
            torch.sigmoid(z[:n]),
            torch.sigmoid(z[n : 2 * n]),
            torch.sigmoid(z[2 * n : 3 * n]),
        )
        c_hat = torch.tanh(z[3 * n :])
        c = f_g * c_tilde + i_g * c_hat
        if extra is not None:
            c = c + extra[t]
        h = o_g * torch.tanh(c)
        hs.append(h)
        cs.append(c)
        h_tilde_prev = h_tilde
    return torch.stack(hs), torch.stack(cs), attention


def ref_stack(model: LSTMN, x: Tensor):
    """Eq. 10: layer k+1 reads h^k_t (and x_t with skip connections)."""
    layer_input = x
    attentions = []
    for cell in model.layers:
        assert isinstance(cell, LSTMNCell)
        h, c, att = ref_layer(cell, layer_input)
        attentions.append(att)
        layer_input = torch.cat([h, x], dim=-1) if model.skip_connections else h
    return h, c, torch.stack(attentions)


def ref_decoder(dec: LSTMNDecoder, x: Tensor, gamma: Tensor, alpha: Tensor):
    """Eq. 11-16 for one unpadded item: x [T, D], gamma/alpha [S, H]."""
    wg, wxp = dec.inter_source.weight, dec.inter_input.weight
    wgt, u = dec.inter_context.weight, dec.inter_score.weight[0]
    g_prev = torch.zeros(dec.hidden_size, dtype=x.dtype)
    ps, gs, extra = [], [], []
    for t in range(x.shape[0]):
        b = [u @ torch.tanh(wg @ gamma[j] + wxp @ x[t] + wgt @ g_prev) for j in range(len(gamma))]
        p = _softmax(b)
        g = _weighted_sum(p, gamma)
        a = _weighted_sum(p, alpha)
        if dec.fusion == "deep":
            assert dec.fusion_context is not None and dec.fusion_input is not None
            w_r = torch.cat([dec.fusion_context.weight, dec.fusion_input.weight], dim=1)
            r = torch.sigmoid(w_r @ torch.cat([g, x[t]]) + dec.fusion_input.bias)
            extra.append(r * a)
        ps.append(p)
        gs.append(g)
        g_prev = g
    h, c, att = ref_layer(dec.cell, x, extra if dec.fusion == "deep" else None)
    return h, c, att, torch.stack(ps), torch.stack(gs)


# ----------------------------------------------------------------------------- helpers


def _masks(batch: int, length: int) -> Tensor:
    """Right padding, left padding, holes and a full row."""
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(batch, length, generator=g) < 0.7
    mask[0] = True
    mask[1, length - 2 :] = False
    mask[2, :2] = False
    mask[:, 3] |= True  # every item has real steps
    return mask


def _check_item(out_seq: Tensor, ref: Tensor, real: Tensor) -> None:
    """Tape [T, H] of one batch item vs its reference on the real steps; zeros elsewhere."""
    torch.testing.assert_close(out_seq[real], ref)
    assert (out_seq[~real] == 0).all()


def _check_attention(att: Tensor, ref: Tensor, real: Tensor) -> None:
    """Attention [T, T] of one item vs the reference of the compressed item; zeros elsewhere."""
    idx = real.nonzero().squeeze(-1)
    torch.testing.assert_close(att[idx][:, idx], ref)
    rest = att.clone()
    rest[idx.unsqueeze(-1), idx] = 0.0
    assert (rest == 0).all()


def _source(batch: int, length: int) -> tuple[Tensor, Tensor, Tensor]:
    gamma = torch.randn(batch, length, H, dtype=DT)
    alpha = torch.randn(batch, length, H, dtype=DT)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2, 0] = False  # a hole at the front of the source
    return gamma, alpha, mask


# ----------------------------------------------------------------------------- reference tests


def test_cell_matches_reference() -> None:
    cell = LSTMNCell(D, H).to(DT)
    x = torch.randn(5, 7, D, dtype=DT)
    mask = _masks(5, 7)
    out = cell(x, mask)
    assert out.hidden.shape == (5, 7, H) and out.attention.shape == (5, 7, 7)
    for b in range(5):
        h, c, att = ref_layer(cell, x[b, mask[b]])
        _check_item(out.hidden[b], h, mask[b])
        _check_item(out.memory[b], c, mask[b])
        _check_attention(out.attention[b], att, mask[b])


@pytest.mark.parametrize("skip", [False, True])
def test_stack_matches_reference(skip: bool) -> None:
    model = LSTMN(D, H, num_layers=2, skip_connections=skip).to(DT)
    x = torch.randn(4, 6, D, dtype=DT)
    mask = _masks(4, 6)
    out = model(x, mask)
    assert out.layer_attention.shape == (4, 2, 6, 6) and len(out.final_state) == 2
    for b in range(4):
        h, c, att = ref_stack(model, x[b, mask[b]])
        _check_item(out.hidden[b], h, mask[b])
        _check_item(out.memory[b], c, mask[b])
        for k in range(2):
            _check_attention(out.layer_attention[b, k], att[k], mask[b])
        torch.testing.assert_close(out.attention[b], out.layer_attention[b, 1])


@pytest.mark.parametrize("fusion", ["shallow", "deep"])
def test_decoder_matches_reference(fusion: str) -> None:
    dec = LSTMNDecoder(D, H, fusion=fusion).to(DT)
    x = torch.randn(4, 6, D, dtype=DT)
    mask = _masks(4, 6)
    gamma, alpha, source_mask = _source(4, 5)
    out = dec(x, gamma, alpha, mask, source_mask)
    assert out.source_attention.shape == (4, 6, 5) and out.context.shape == (4, 6, H)
    for b in range(4):
        sm = source_mask[b]
        h, c, att, p, g = ref_decoder(dec, x[b, mask[b]], gamma[b, sm], alpha[b, sm])
        _check_item(out.hidden[b], h, mask[b])
        _check_item(out.memory[b], c, mask[b])
        _check_item(out.context[b], g, mask[b])
        _check_attention(out.attention[b], att, mask[b])
        torch.testing.assert_close(out.source_attention[b][mask[b]][:, sm], p)
        assert (out.source_attention[b][:, ~sm] == 0).all()
        assert (out.source_attention[b][~mask[b]] == 0).all()


def test_deep_fusion_differs_from_shallow() -> None:
    """The fusion gate really writes the source memory into the target memory."""
    shallow = LSTMNDecoder(D, H, "shallow").to(DT)
    deep = LSTMNDecoder(D, H, "deep").to(DT)
    deep.load_state_dict(shallow.state_dict(), strict=False)
    x = torch.randn(2, 4, D, dtype=DT)
    gamma, alpha = torch.randn(2, 3, H, dtype=DT), torch.randn(2, 3, H, dtype=DT)
    a, b = shallow(x, gamma, alpha), deep(x, gamma, alpha)
    torch.testing.assert_close(a.source_attention, b.source_attention)  # same inter-attention
    assert not torch.allclose(a.memory, b.memory)
    deep2 = LSTMNDecoder(D, H, "deep").to(DT)
    deep2.load_state_dict(deep.state_dict())
    torch.testing.assert_close(deep2(x, gamma, 0 * alpha).memory, a.memory)  # alpha = 0


# ----------------------------------------------------------------------------- invariants


def _assert_rows_normalised(att: Tensor, mask: Tensor) -> None:
    """att [B, T, T]: rows sum to 1 over real i < t (0 for padded and first real steps)."""
    batch, length, _ = att.shape
    causal = torch.ones(length, length, dtype=torch.bool).tril(-1)  # i < t
    allowed = causal & mask.unsqueeze(1) & mask.unsqueeze(2)  # [B, T, T]
    assert (att[~allowed] == 0).all()
    assert (att >= 0).all()
    expected = (allowed.any(-1)).to(att.dtype)  # 1 where some real i < t exists
    torch.testing.assert_close(att.sum(-1), expected)
    first = mask & (mask.cumsum(-1) == 1)  # each item's first real step
    assert (att[first] == 0).all()


def test_attention_rows_sum_to_one_over_the_past() -> None:
    model = LSTMN(D, H, num_layers=2)
    x = torch.randn(5, 8, D)
    mask = _masks(5, 8)
    out = model(x, mask)
    for k in range(2):
        _assert_rows_normalised(out.layer_attention[:, k], mask)
    dec = LSTMNDecoder(D, H, "deep")
    gamma, alpha, source_mask = (t.float() if t.is_floating_point() else t for t in _source(5, 4))
    d = dec(x, gamma, alpha, mask, source_mask)
    _assert_rows_normalised(d.attention, mask)
    torch.testing.assert_close(d.source_attention.sum(-1), mask.float())
    assert (d.source_attention.masked_select(~source_mask.unsqueeze(1)) == 0).all()


def test_padding_invariance_stack_and_decoder() -> None:
    """Each item equals the same item run alone without padding; padded content is ignored."""
    torch.manual_seed(3)
    model = LSTMN(D, H, num_layers=2, skip_connections=True).to(DT)
    dec = LSTMNDecoder(D, H, "deep").to(DT)
    x = torch.randn(4, 6, D, dtype=DT)
    mask = _masks(4, 6)
    gamma, alpha, source_mask = _source(4, 5)
    enc = model(x, mask)
    out = dec(x, gamma, alpha, mask, source_mask)
    noisy = x.masked_fill(~mask.unsqueeze(-1), 1e3)  # garbage at padded steps
    torch.testing.assert_close(model(noisy, mask).hidden, enc.hidden)
    for b in range(4):
        real, sm = mask[b], source_mask[b]
        alone = model(x[b : b + 1, real])
        torch.testing.assert_close(enc.hidden[b, real], alone.hidden[0])
        torch.testing.assert_close(enc.memory[b, real], alone.memory[0])
        torch.testing.assert_close(enc.attention[b][real][:, real], alone.attention[0])
        one = dec(x[b : b + 1, real], gamma[b : b + 1, sm], alpha[b : b + 1, sm])
        torch.testing.assert_close(out.hidden[b, real], one.hidden[0])
        torch.testing.assert_close(out.context[b, real], one.context[0])
        torch.testing.assert_close(out.source_attention[b][real][:, sm], one.source_attention[0])


def test_gradients_reach_every_parameter() -> None:
    x = torch.randn(2, 5, D)
    mask = torch.tensor([[True] * 5, [True] * 4 + [False]])
    model = LSTMN(D, H, num_layers=2, skip_connections=True)
    enc = model(x, mask)
    decoders = [LSTMNDecoder(D, H, f) for f in ("shallow", "deep")]
    loss = enc.hidden.pow(2).sum() + enc.memory.sum()
    for dec in decoders:
        out = dec(x, enc.hidden, enc.memory, mask, mask)
        loss = loss + out.hidden.pow(2).sum() + out.context.pow(2).sum()
    loss.backward()
    for module in (model, *decoders):
        for name, p in module.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            assert p.grad.abs().sum() > 0, name


def test_gradcheck_cell_with_padding() -> None:
    cell = LSTMNCell(2, 3).to(DT)
    x = torch.randn(2, 4, 2, dtype=DT, requires_grad=True)
    mask = torch.tensor([[True, False, True, True], [True, True, True, False]])

    def f(inputs: Tensor) -> tuple[Tensor, Tensor]:
        out = cell(inputs, mask)
        return out.hidden, out.attention

    assert torch.autograd.gradcheck(f, (x,))


# ----------------------------------------------------------------------------- step-wise


def test_cell_step_equals_forward() -> None:
    cell = LSTMNCell(D, H).to(DT)
    x = torch.randn(3, 5, D, dtype=DT)
    mask = _masks(3, 5)
    out = cell(x, mask)
    state = None
    for t in range(5):
        s = cell.step(x[:, t], state, mask[:, t])
        state = s.state
        torch.testing.assert_close(s.hidden, out.hidden[:, t])
        torch.testing.assert_close(s.memory, out.memory[:, t])
        torch.testing.assert_close(s.attention, out.attention[:, t, :t])
    assert state is not None
    for a, b in zip(state, out.final_state, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("fusion", ["shallow", "deep"])
def test_decoder_step_equals_forward(fusion: str) -> None:
    dec = LSTMNDecoder(D, H, fusion).to(DT)
    x = torch.randn(4, 6, D, dtype=DT)
    mask = _masks(4, 6)
    gamma, alpha, source_mask = _source(4, 5)
    out = dec(x, gamma, alpha, mask, source_mask)
    source = dec.prepare_source(gamma, alpha, source_mask)
    state = dec.initial_state(4, dtype=DT)
    for t in range(6):
        s = dec.step(x[:, t], state, source, mask[:, t])
        state = s.state
        torch.testing.assert_close(s.hidden, out.hidden[:, t])
        torch.testing.assert_close(s.memory, out.memory[:, t])
        torch.testing.assert_close(s.context, out.context[:, t])
        torch.testing.assert_close(s.attention, out.attention[:, t, :t])
        torch.testing.assert_close(s.source_attention, out.source_attention[:, t])
    # forced decoding of a prefix, then step-wise continuation
    prefix = dec(x[:, :3], gamma, alpha, mask[:, :3], source_mask)
    state = prefix.final_state
    for t in range(3, 6):
        s = dec.step(x[:, t], state, source, mask[:, t])
        state = s.state
        torch.testing.assert_close(s.hidden, out.hidden[:, t])
        torch.testing.assert_close(s.attention, out.attention[:, t, :t])
    torch.testing.assert_close(state.intra.hidden, out.final_state.intra.hidden)


def test_index_select_reorders_beams() -> None:
    dec = LSTMNDecoder(D, H, "deep").to(DT)
    x = torch.randn(3, 4, D, dtype=DT)
    gamma, alpha, source_mask = _source(3, 5)
    source = dec.prepare_source(gamma, alpha, source_mask)
    state = dec(x, gamma, alpha, source_mask=source_mask).final_state
    index = torch.tensor([2, 0, 0, 1])
    nxt = torch.randn(4, D, dtype=DT)
    beams = dec.step(nxt, state.index_select(index), source.index_select(index))
    for row, b in enumerate(index.tolist()):
        one = torch.tensor([b])
        alone = dec.step(nxt[row : row + 1], state.index_select(one), source.index_select(one))
        torch.testing.assert_close(beams.hidden[row], alone.hidden[0])
        torch.testing.assert_close(beams.source_attention[row], alone.source_attention[0])


# ----------------------------------------------------------------------------- misc behaviour


def test_dropout_only_in_training_and_empty_sequences() -> None:
    model = LSTMN(D, H, num_layers=2, dropout=0.5)
    x = torch.randn(2, 4, D)
    model.eval()
    torch.testing.assert_close(model(x).hidden, model(x).hidden)
    model.train()
    assert not torch.allclose(model(x).hidden, model(x).hidden)
    empty = model(torch.randn(2, 0, D))
    assert empty.hidden.shape == (2, 0, H) and empty.attention.shape == (2, 0, 0)
    d = LSTMNDecoder(D, H)(torch.randn(2, 0, D), torch.randn(2, 3, H))
    assert d.source_attention.shape == (2, 0, 3) and d.context.shape == (2, 0, H)


def test_initialisation_forget_bias() -> None:
    cell = LSTMNCell(D, H)
    bias = cell.input_gates.bias
    assert (bias[H : 2 * H] == 1).all() and (bias[:H] == 0).all() and (bias[2 * H :] == 0).all()
    bound = 1 / H**0.5
    assert all(p.abs().max() <= bound for n, p in cell.named_parameters() if "bias" not in n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    model = LSTMN(D, H, num_layers=2).to(DT)
    dec = LSTMNDecoder(D, H, "deep").to(DT)
    x, mask = torch.randn(3, 5, D, dtype=DT), _masks(3, 5)
    enc = model(x, mask)
    out = dec(x, enc.hidden, enc.memory, mask, mask)
    model.cuda(), dec.cuda()
    enc_c = model(x.cuda(), mask.cuda())
    out_c = dec(x.cuda(), enc_c.hidden, enc_c.memory, mask.cuda(), mask.cuda())
    torch.testing.assert_close(out_c.hidden.cpu(), out.hidden)
    torch.testing.assert_close(out_c.attention.cpu(), out.attention)


def test_training_learns_delayed_copy() -> None:
    """Predict the token read two steps earlier: 100 Adam steps cut the loss by > half."""
    torch.manual_seed(0)
    vocab, length, batch = 4, 8, 32
    embed = torch.nn.Embedding(vocab, 8)
    model = LSTMN(8, 16)
    head = torch.nn.Linear(16, vocab)
    params = [*embed.parameters(), *model.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=0.02)
    losses = []
    for _ in range(100):
        tokens = torch.randint(vocab, (batch, length))
        logits = head(model(embed(tokens)).hidden)  # [B, T, V]
        loss = torch.nn.functional.cross_entropy(
            logits[:, 2:].reshape(-1, vocab), tokens[:, :-2].reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 1.2  # ~ log 4 at chance
    assert last < 0.35 * first, (first, last)


# ----------------------------------------------------------------------------- validation


def test_validation_errors() -> None:
    cell = LSTMNCell(D, H)
    x = torch.randn(2, 5, D)
    with pytest.raises(ValueError, match="`inputs`"):
        cell(torch.randn(2, 5))
    with pytest.raises(ValueError, match="`inputs`"):
        cell(torch.randn(2, 5, D + 1))
    with pytest.raises(ValueError, match="`inputs`"):
        cell(torch.ones(2, 5, D, dtype=torch.long))
    with pytest.raises(ValueError, match="`mask`"):
        cell(x, torch.ones(2, 5))  # float mask
    with pytest.raises(ValueError, match="`mask`"):
        cell(x, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="`state`"):
        cell.step(x[:, 0], cell.initial_state(3))
    with pytest.raises(ValueError, match="`hidden_size`"):
        LSTMNCell(D, 0)
    with pytest.raises(ValueError, match="`num_layers`"):
        LSTMN(D, H, num_layers=0)
    with pytest.raises(ValueError, match="`dropout`"):
        LSTMN(D, H, dropout=1.0)
    with pytest.raises(ValueError, match="`fusion`"):
        LSTMNDecoder(D, H, fusion="medium")
    with pytest.raises(ValueError, match="`mask`"):
        LSTMN(D, H)(x, torch.ones(2, 5, 1, dtype=torch.bool))

    deep = LSTMNDecoder(D, H, "deep")
    gamma = torch.randn(2, 3, H)
    with pytest.raises(ValueError, match="`source_memory`"):
        deep(x, gamma)
    with pytest.raises(ValueError, match="`source_memory`"):
        deep(x, gamma, torch.randn(2, 4, H))
    with pytest.raises(ValueError, match="`source_hidden`"):
        deep(x, torch.randn(2, 3, H + 1), gamma)
    with pytest.raises(ValueError, match="`source_hidden`"):
        deep(x, torch.randn(3, 3, H), torch.randn(3, 3, H))  # batch mismatch
    with pytest.raises(ValueError, match="`source_mask`"):
        deep(x, gamma, gamma, source_mask=torch.tensor([[True] * 3, [False] * 3]))
    with pytest.raises(ValueError, match="`source_mask`"):
        deep(x, gamma, gamma, source_mask=torch.ones(2, 3))
    shallow = LSTMNDecoder(D, H)
    source = shallow.prepare_source(gamma)  # shallow fusion needs no memory tape
    assert isinstance(source, LSTMNSource) and source.memory is None
    state = shallow.initial_state(2)
    assert isinstance(state, LSTMNDecoderState) and isinstance(state.intra, LSTMNState)
    with pytest.raises(ValueError, match="`state`"):
        shallow.step(x[:, 0], state.intra, source)
    with pytest.raises(ValueError, match="`source`"):
        shallow.step(x[:, 0], state, gamma)
    with pytest.raises(ValueError, match="`mask`"):
        shallow.step(x[:, 0], state, source, torch.ones(2, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="`source`"):
        deep.step(x[:, 0], state, source)  # source prepared without a memory tape
