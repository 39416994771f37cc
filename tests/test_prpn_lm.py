"""PRPN language model: shapes, gradients, state carried across windows, gates, learning."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from structattn.models.prpn_lm import GATES, PRPNConfig, PRPNLanguageModel


def _model(gate: str, **kwargs: object) -> PRPNLanguageModel:
    torch.manual_seed(0)
    config = dict(vocab_size=30, embed_dim=8, hidden_dim=12, num_slots=4, lookback=3, gate=gate)
    config.update(kwargs)
    return PRPNLanguageModel(PRPNConfig(**config))  # type: ignore[arg-type]


@pytest.mark.parametrize("gate", GATES)
def test_forward_backward_shapes(gate: str) -> None:
    model = _model(gate)
    inputs = torch.randint(30, (3, 7))
    logits, state = model(inputs, model.initial_state(3, "cpu"))
    assert logits.shape == (3, 7, 30)
    assert state[3].shape == (2, 3, 4, 12) and state[5].all()  # hidden tapes, valid slots
    logits2, _ = model(inputs[:, :2], state)  # a window shorter than the memory
    (logits.logsumexp(-1).sum() + logits2.sum()).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    if gate != "none":
        assert model.parser is not None and model.parser.conv.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("gate", GATES)
def test_state_carries_the_stream_across_windows(gate: str) -> None:
    """Two windows with the carried state give exactly the logits of one long window."""
    model = _model(gate).eval()
    inputs = torch.randint(30, (2, 11))
    whole, _ = model(inputs)
    first, state = model(inputs[:, :4])
    second, state = model(inputs[:, 4:6], state)
    third, _ = model(inputs[:, 6:], tuple(x.detach() for x in state))
    torch.testing.assert_close(torch.cat([first, second, third], 1), whole)


@pytest.mark.parametrize("gate", ["stick-breaking", "bradley-terry"])
def test_gates_in_unit_interval_and_closed_on_empty_memory(gate: str) -> None:
    model = _model(gate).eval()
    out = model.run(torch.randint(30, (2, 6)))
    for gates in (out.gates, out.next_gates):
        assert ((gates >= 0) & (gates <= 1)).all()
        # a fresh stream: step t has t valid slots (the newest ones), the rest are closed
        for t in range(6):
            assert (gates[:, t, : max(4 - t, 0)] == 0).all()
        # the newest slot is always open for the reader (empty product)
    assert (out.gates[:, 1:, -1] == 1).all()
    assert (out.attention[:, 0] == 0).all()  # first step: no memory, plain LSTM step
    rows = out.attention[:, 1:].sum(-1)
    torch.testing.assert_close(rows, torch.ones_like(rows))
    assert (out.distances > 0).all()


def test_distances_ignore_padding() -> None:
    model = _model("stick-breaking").eval()
    sentences = [torch.randint(30, (n,)) for n in (5, 2, 4)]
    batch = torch.zeros(3, 5, dtype=torch.long)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    for i, s in enumerate(sentences):
        batch[i, : len(s)], mask[i, : len(s)] = s, True
    d = model.distances(batch, mask)
    for i, s in enumerate(sentences):
        torch.testing.assert_close(d[i, : len(s)], model.distances(s[None])[0])
        assert (d[i, len(s) :] == 0).all()


def test_ablation_has_no_distances_and_bad_configs_fail() -> None:
    with pytest.raises(ValueError, match="no distances"):
        _model("none").distances(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="gate"):
        _model("gumbel")
    with pytest.raises(ValueError, match="dropout"):
        _model("none", dropout=1.0)
    with pytest.raises(ValueError, match="LongTensor"):
        _model("none")(torch.zeros(2, 3))


@pytest.mark.parametrize("gate", ["stick-breaking", "bradley-terry"])
def test_tiny_model_learns_a_tiny_corpus(gate: str) -> None:
    """A repeated 6-word sentence: the loss must fall far below the uniform log V."""
    model = _model(
        gate, dropout=0.0, input_dropout=0.0, recurrent_dropout=0.0, tau=1.0, init_range=1.0
    )
    stream = torch.tensor([[1, 2, 3, 4, 5, 6] * 6, [3, 4, 5, 6, 1, 2] * 6])  # [2, 36]
    optim = torch.optim.Adam(model.parameters(), lr=0.03)
    for _ in range(25):
        state = None
        for start in range(0, 30, 10):
            window = stream[:, start : start + 11]
            logits, state = model(window[:, :-1], state)
            state = tuple(x.detach() for x in state)
            loss = F.cross_entropy(logits.reshape(-1, 30), window[:, 1:].reshape(-1))
            optim.zero_grad()
            loss.backward()
            optim.step()
    assert loss.item() < 0.3, loss.item()


def test_query_distances_of_the_gate_functions() -> None:
    """alpha[t, k] from q_t against d_k; q = d gives the default gates."""
    from structattn.structs.stick_breaking import bradley_terry_gates, stick_breaking_gates

    d = torch.tensor([[0.7, 0.6, 0.3, 0.4, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.2, 0.3, 0.9, 0.2]], dtype=torch.float64)
    torch.testing.assert_close(
        stick_breaking_gates(d, 1.0, query_distances=d), stick_breaking_gates(d, 1.0)
    )
    sb = stick_breaking_gates(d, 1.0, query_distances=q)
    torch.testing.assert_close(sb[0, 4, :4], (1 + (0.2 - d[0, :4])).clamp(0, 1))
    bt = bradley_terry_gates(d, query_distances=q)
    torch.testing.assert_close(bt[0, 3, :3], 0.9 / (0.9 + d[0, :3]))
    with pytest.raises(ValueError, match="query_distances"):
        stick_breaking_gates(d, 1.0, query_distances=q[:, :3])
    with pytest.raises(ValueError, match="> 0"):
        bradley_terry_gates(d, query_distances=-q)
