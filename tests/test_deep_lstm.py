"""The gated-feedback and depth-gated LSTMs (nn/deep_lstm.py): each reduces to a stacked
``nn.LSTM`` when its cross-layer connections are switched off, carries its state across
windows, and rejects bad shapes."""

from __future__ import annotations

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
