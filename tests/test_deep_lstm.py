"""The gated-feedback and depth-gated LSTMs (nn/deep_lstm.py): each reduces to a stacked
``nn.LSTM`` when its cross-layer connections are switched off, carries its state across
windows, and rejects bad shapes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from structattn.models import RNNLanguageModel
from structattn.nn.deep_lstm import DepthGatedLSTM, GatedFeedbackLSTM

LAYERS, HIDDEN, INPUT = 3, 5, 4


def _stacked_lstm_like(module: nn.Module) -> nn.LSTM:
    """An ``nn.LSTM`` with ``module``'s own-layer weights (gate order i, f, g, o)."""
    lstm = nn.LSTM(INPUT, HIDDEN, LAYERS, batch_first=True).double()
    h = HIDDEN
    with torch.no_grad():
        for j in range(LAYERS):
            w_in = module.inputs[j].weight[: 4 * h]
            b_in = module.inputs[j].bias[: 4 * h]
            w_rec = module.recurrent[j].weight
            if isinstance(module, GatedFeedbackLSTM):  # rows i, f, o, candidate
                own = module.candidate[j, :, j * h : (j + 1) * h].t()  # U_c^{j->j}
                w_rec = torch.cat([w_rec, own])
            i, f, o, g = w_in.split(h)
            getattr(lstm, f"weight_ih_l{j}").copy_(torch.cat([i, f, g, o]))
            i, f, o, g = b_in.split(h)
            getattr(lstm, f"bias_ih_l{j}").copy_(torch.cat([i, f, g, o]))
            i, f, o, g = w_rec.split(h)
            getattr(lstm, f"weight_hh_l{j}").copy_(torch.cat([i, f, g, o]))
            getattr(lstm, f"bias_hh_l{j}").zero_()
    return lstm


def _state(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    shape = (LAYERS, batch, HIDDEN)
    return (
        torch.randn(shape, generator=gen, dtype=torch.float64),
        torch.randn(shape, generator=gen, dtype=torch.float64),
    )


def test_gated_feedback_without_cross_layer_feedback_is_a_stacked_lstm() -> None:
    """Reset gates fully open (bias +50) and U_c^{i->j} = 0 for i != j: a stacked LSTM."""
    torch.manual_seed(0)
    model = GatedFeedbackLSTM(INPUT, HIDDEN, LAYERS).double()
    with torch.no_grad():
        for j in range(LAYERS):
            model.inputs[j].bias[4 * HIDDEN :] = 50.0
            for i in range(LAYERS):
                if i != j:
                    model.candidate[i, :, j * HIDDEN : (j + 1) * HIDDEN] = 0.0
    x = torch.randn(2, 6, INPUT, dtype=torch.float64)
    ours, (h, c) = model(x, _state(2))
    theirs, (h2, c2) = _stacked_lstm_like(model)(x, _state(2))
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(h, h2)
    torch.testing.assert_close(c, c2)
    # with the feedback on, the output changes (the test above can fail)
    with torch.no_grad():
        model.candidate.add_(0.3)
    assert not torch.allclose(model(x, _state(2))[0], theirs)


def test_depth_gated_with_closed_depth_gates_is_a_stacked_lstm() -> None:
    """Depth gates closed (bias -50): a stacked LSTM; open, the layers' cells add up."""
    torch.manual_seed(0)
    model = DepthGatedLSTM(INPUT, HIDDEN, LAYERS).double()
    with torch.no_grad():
        for j in range(1, LAYERS):
            model.inputs[j].bias[4 * HIDDEN :] = -50.0
    x = torch.randn(2, 6, INPUT, dtype=torch.float64)
    ours, (h, c) = model(x, _state(2))
    theirs, (h2, c2) = _stacked_lstm_like(model)(x, _state(2))
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(c, c2)
    with torch.no_grad():
        for j in range(1, LAYERS):
            model.inputs[j].bias[4 * HIDDEN :] = 0.0
    assert not torch.allclose(model(x, _state(2))[0], theirs)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def _equation_setup(cls: type[nn.Module], seed: int) -> tuple[Any, ...]:
    """A random double model, one item's 2-step input, its start state [L, 1, H] and the
    same as per-layer vectors (what the by-hand references update)."""
    torch.manual_seed(seed)
    model = cls(INPUT, HIDDEN, LAYERS).double()
    x = torch.randn(1, 2, INPUT, dtype=torch.float64)
    h0, c0 = (t[:, :1] for t in _state(1))
    hs, cs = [h0[j, 0] for j in range(LAYERS)], [c0[j, 0] for j in range(LAYERS)]
    return model, x, h0, c0, hs, cs


def test_gated_feedback_equals_its_equations() -> None:
    """Two steps by the docstring's equations, one item and one unit of arithmetic at a
    time (every gate active, random weights)."""
    model, x, h0, c0, hs, cs = _equation_setup(GatedFeedbackLSTM, 3)
    h = HIDDEN
    expected = []
    with torch.no_grad():
        for t in range(2):
            previous = list(hs)  # h_{t-1} of every layer
            star = torch.cat(previous)  # h*_{t-1}
            below = x[0, t]
            for j in range(LAYERS):
                w, b = model.inputs[j].weight, model.inputs[j].bias
                u = model.recurrent[j].weight
                gates = [
                    _sigmoid(
                        w[k * h : (k + 1) * h] @ below
                        + b[k * h : (k + 1) * h]
                        + u[k * h : (k + 1) * h] @ previous[j]
                    )
                    for k in range(3)
                ]
                cand = w[3 * h : 4 * h] @ below + b[3 * h : 4 * h]
                for i in range(LAYERS):
                    g = _sigmoid(
                        w[4 * h + i] @ below
                        + b[4 * h + i]
                        + model.reset.weight[j * LAYERS + i] @ star
                    )
                    u_c = model.candidate[i, :, j * h : (j + 1) * h]  # [H (source), H]
                    cand = cand + g * (previous[i] @ u_c)
                cs[j] = gates[1] * cs[j] + gates[0] * torch.tanh(cand)
                hs[j] = gates[2] * torch.tanh(cs[j])
                below = hs[j]
            expected.append(below)
        ours, (h_last, c_last) = model(x, (h0, c0))
    torch.testing.assert_close(ours[0], torch.stack(expected))
    torch.testing.assert_close(c_last[:, 0], torch.stack(cs))


def test_depth_gated_equals_its_equations() -> None:
    """Two steps by the docstring's equations (depth gates active, random weights)."""
    model, x, h0, c0, hs, cs = _equation_setup(DepthGatedLSTM, 4)
    h = HIDDEN
    expected = []
    with torch.no_grad():
        for t in range(2):
            below_h, below_c = x[0, t], None
            for j in range(LAYERS):
                w, b = model.inputs[j].weight, model.inputs[j].bias
                u = model.recurrent[j].weight
                z = [
                    w[k * h : (k + 1) * h] @ below_h
                    + b[k * h : (k + 1) * h]
                    + u[k * h : (k + 1) * h] @ hs[j]
                    for k in range(4)
                ]
                i, f, o = (_sigmoid(v) for v in z[:3])
                c = f * cs[j] + i * torch.tanh(z[3])
                if below_c is not None:
                    d = _sigmoid(
                        w[4 * h :] @ below_h
                        + b[4 * h :]
                        + model.depth_cell[j - 1] * cs[j]
                        + model.depth_below[j - 1] * below_c
                    )
                    c = c + d * below_c
                cs[j], hs[j] = c, o * torch.tanh(c)
                below_h, below_c = hs[j], cs[j]
            expected.append(below_h)
        ours, (h_last, c_last) = model(x, (h0, c0))
    torch.testing.assert_close(ours[0], torch.stack(expected))
    torch.testing.assert_close(c_last[:, 0], torch.stack(cs))


@pytest.mark.parametrize("cls", [GatedFeedbackLSTM, DepthGatedLSTM])
def test_bad_sizes_and_empty_windows(cls: type[nn.Module]) -> None:
    with pytest.raises(ValueError, match="num_layers"):
        cls(INPUT, HIDDEN, 0)
    with pytest.raises(ValueError, match="hidden_size"):
        cls(INPUT, 0, LAYERS)
    model = cls(INPUT, HIDDEN, LAYERS).double()
    with pytest.raises(ValueError, match=r"I = 4"):
        model(torch.zeros(2, 3, INPUT + 1, dtype=torch.float64), _state(2))
    out, state = model(torch.zeros(2, 0, INPUT, dtype=torch.float64), _state(2))
    assert out.shape == (2, 0, HIDDEN) and torch.equal(state[0], _state(2)[0])


@pytest.mark.parametrize("cls", [GatedFeedbackLSTM, DepthGatedLSTM])
def test_windows_carry_the_state_and_gradients_flow(cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = cls(INPUT, HIDDEN, LAYERS).double()
    x = torch.randn(3, 8, INPUT, dtype=torch.float64, requires_grad=True)
    whole, final = model(x, _state(3))
    left, state = model(x[:, :3], _state(3))
    right, state2 = model(x[:, 3:], state)
    torch.testing.assert_close(torch.cat([left, right], 1), whole)
    torch.testing.assert_close(state2[1], final[1])
    whole.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="state `h`"):
        model(x, (torch.zeros(2, 3, HIDDEN), torch.zeros(2, 3, HIDDEN)))
    with pytest.raises(ValueError, match=r"\[B, T, I\]"):
        model(x[0], _state(3))


@pytest.mark.parametrize("cell", ["gf-lstm", "dg-lstm"])
def test_language_model_cells(cell: str) -> None:
    model = RNNLanguageModel(11, 4, 4, num_layers=3, cell=cell)  # type: ignore[arg-type]
    state = model.initial_state(2, torch.device("cpu"))
    logits, (h, c) = model(torch.zeros(2, 5, dtype=torch.long), state)
    assert logits.shape == (2, 5, 11) and h.shape == c.shape == (3, 2, 4)
