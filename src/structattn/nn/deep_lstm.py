"""Multi-layer LSTMs with connections across layers: the gated-feedback LSTM (Chung et al.
2015) and the depth-gated LSTM (Yao et al. 2015), the 3-layer baselines gLSTM and dLSTM of
Table 1 of Cheng et al. (2016).

Both take and return what ``nn.LSTM(batch_first=True)`` does: ``forward(x [B, T, I],
(h0, c0)) -> (outputs [B, T, H], (h, c))`` with ``h``, ``c`` of shape ``[L, B, H]``, so they
replace a stacked LSTM in a language model. Both loop over time in Python (the
connections across layers make every step depend on every layer's previous state), with
everything that does not depend on the previous step computed for the whole window at once.

>>> lstm = GatedFeedbackLSTM(input_size=5, hidden_size=4, num_layers=3)
>>> state = (torch.zeros(3, 2, 4), torch.zeros(3, 2, 4))
>>> outputs, (h, c) = lstm(torch.randn(2, 7, 5), state)
>>> tuple(outputs.shape), tuple(h.shape)
((2, 7, 4), (3, 2, 4))
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["DepthGatedLSTM", "GatedFeedbackLSTM"]


def _check_sizes(input_size: int, hidden_size: int, num_layers: int) -> None:
    for name, value in (("input_size", input_size), ("hidden_size", hidden_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"`num_layers` must be a positive int, got {num_layers!r}")


def _check(x: Tensor, state: tuple[Tensor, Tensor], layers: int, size: int, hidden: int) -> None:
    if x.dim() != 3 or x.shape[-1] != size:
        raise ValueError(f"`x` must be [B, T, I] with I = {size}, got shape {tuple(x.shape)}")
    if not isinstance(state, tuple) or len(state) != 2:
        raise ValueError("`state` must be a tuple (h, c), each [num_layers, B, H]")
    expected = (layers, x.shape[0], hidden)
    for name, t in zip(("h", "c"), state, strict=True):
        if tuple(t.shape) != expected:
            raise ValueError(f"state `{name}` must have shape {expected}, got {tuple(t.shape)}")


def _init_uniform(module: nn.Module, hidden: int) -> None:
    """U(-1/sqrt(H), 1/sqrt(H)) for every parameter, as ``nn.LSTM``."""
    bound = 1.0 / math.sqrt(hidden)
    for p in module.parameters():
        nn.init.uniform_(p, -bound, bound)


class _DeepLSTM(nn.Module):
    """What both multi-layer LSTMs share: sizes (checked), dropout between layers, the input
    and state checks of ``forward``."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int, dropout: float) -> None:
        super().__init__()
        _check_sizes(input_size, hidden_size, num_layers)
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, x: Tensor, state: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """``x`` [B, T, I], ``(h0, c0)`` [L, B, H] -> (outputs [B, T, H], (h, c))."""
        _check(x, state, self.num_layers, self.input_size, self.hidden_size)
        if x.shape[1] == 0:  # an empty window: no outputs, the state unchanged
            return x.new_zeros(x.shape[0], 0, self.hidden_size), state
        return self._run(x, state)

    def _run(self, x: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        raise NotImplementedError


class GatedFeedbackLSTM(_DeepLSTM):
    """Gated-feedback LSTM (Chung et al. 2015, sec. 3): every layer's cell candidate reads
    the previous hidden states of *all* layers, each through a global reset gate.

    For layer j at step t, with h_t^0 = x_t and h*_{t-1} the concatenated previous hidden
    states of the L layers::

        g^{i->j} = sigmoid(w_g^{i->j} . h_t^{j-1} + u_g^{i->j} . h*_{t-1})    (a scalar per item)
        i, f, o  = sigmoid(W^{j} h_t^{j-1} + U^{j->j} h_{t-1}^j)
        c~       = tanh(W_c^{j} h_t^{j-1} + sum_i g^{i->j} U_c^{i->j} h_{t-1}^i)
        c_t^j    = f * c_{t-1}^j + i * c~,   h_t^j = o * tanh(c_t^j)

    ``dropout`` applies to the inputs of layers 2..L (as ``nn.LSTM``'s). Shapes: ``x``
    [B, T, I] and ``(h0, c0)`` [L, B, H] -> (outputs [B, T, H], (h, c) [L, B, H]).
    """

    def __init__(
        self, input_size: int, hidden_size: int, num_layers: int = 3, dropout: float = 0.0
    ) -> None:
        super().__init__(input_size, hidden_size, num_layers, dropout)
        layers, h = num_layers, hidden_size
        # per layer: the input part of i, f, o (3H), of the candidate (H), of the L reset gates
        self.inputs = nn.ModuleList(
            nn.Linear(input_size if j == 0 else h, 4 * h + layers) for j in range(layers)
        )
        self.recurrent = nn.ModuleList(nn.Linear(h, 3 * h, bias=False) for _ in range(layers))
        # U_c^{i->j}: [source i, H, (target j, H)]; u_g^{i->j}: h* -> [(target j, source i)]
        self.candidate = nn.Parameter(torch.empty(layers, h, layers * h))
        self.reset = nn.Linear(layers * h, layers * layers, bias=False)
        _init_uniform(self, h)

    def _run(self, x: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        layers, hid = self.num_layers, self.hidden_size
        batch = x.shape[0]
        first = self.inputs[0](x)  # [B, T, 4H + L]: layer 1's input part, every step at once
        h = list(state[0].unbind(0))
        c = list(state[1].unbind(0))
        outputs = []
        for t in range(x.shape[1]):
            previous = torch.stack(h)  # [L, B, H]
            resets = self.reset(previous.transpose(0, 1).reshape(batch, layers * hid))
            resets = resets.view(batch, layers, layers)  # [B, target, source]
            # U_c^{i->j} h_{t-1}^i for every source i and target j: [B, source, target, H]
            feedback = torch.bmm(previous, self.candidate).view(layers, batch, layers, hid)
            feedback = feedback.transpose(0, 1)
            below = x.new_empty(0)
            for j in range(layers):
                z = first[:, t] if j == 0 else self.inputs[j](self.dropout(below))
                gates = torch.sigmoid(z[:, : 3 * hid] + self.recurrent[j](h[j]))
                g = torch.sigmoid(z[:, 4 * hid :] + resets[:, j])  # [B, source]
                fed = (g.unsqueeze(-1) * feedback[:, :, j]).sum(1)  # [B, H]
                cand = torch.tanh(z[:, 3 * hid : 4 * hid] + fed)
                i, f, o = gates.chunk(3, dim=-1)
                c[j] = f * c[j] + i * cand
                h[j] = o * torch.tanh(c[j])
                below = h[j]
            outputs.append(below)
        return torch.stack(outputs, 1), (torch.stack(h), torch.stack(c))


class DepthGatedLSTM(_DeepLSTM):
    """Depth-gated LSTM (Yao et al. 2015): a depth gate adds the memory cell of the layer
    below, at the same step, to each layer's memory cell.

    Layer 1 is an LSTM; for layer j > 1, with x_t = h_t^{j-1} (no peephole connections)::

        i, f, o, g = sigmoid / tanh(W x_t + U h_{t-1}^j + b)
        d          = sigmoid(b_d + W_d x_t + w_cd * c_{t-1}^j + w_ld * c_t^{j-1})
        c_t^j      = d * c_t^{j-1} + f * c_{t-1}^j + i * g,   h_t^j = o * tanh(c_t^j)

    ``dropout`` applies to the inputs of layers 2..L. Shapes as :class:`GatedFeedbackLSTM`.
    """

    def __init__(
        self, input_size: int, hidden_size: int, num_layers: int = 3, dropout: float = 0.0
    ) -> None:
        super().__init__(input_size, hidden_size, num_layers, dropout)
        h = hidden_size
        # per layer: the input part of i, f, o, g (4H) and, above layer 1, of the depth gate d
        self.inputs = nn.ModuleList(
            nn.Linear(input_size if j == 0 else h, 4 * h if j == 0 else 5 * h)
            for j in range(num_layers)
        )
        self.recurrent = nn.ModuleList(nn.Linear(h, 4 * h, bias=False) for _ in range(num_layers))
        # w_cd, w_ld of layers 2..L (diagonal: one weight per unit)
        self.depth_cell = nn.Parameter(torch.empty(num_layers - 1, h))
        self.depth_below = nn.Parameter(torch.empty(num_layers - 1, h))
        _init_uniform(self, h)

    def _run(self, x: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        hid = self.hidden_size
        hs, cs = [], []
        below_h, below_c = x, None  # the layer below's hidden and memory cells, [B, T, H]
        for j in range(self.num_layers):
            z_in = self.inputs[j](below_h if j == 0 else self.dropout(below_h))  # [B, T, *]
            h, c = state[0][j], state[1][j]
            steps_h, steps_c = [], []
            for t in range(x.shape[1]):
                z = z_in[:, t, : 4 * hid] + self.recurrent[j](h)
                i, f, o = torch.sigmoid(z[:, : 3 * hid]).chunk(3, dim=-1)
                c_new = f * c + i * torch.tanh(z[:, 3 * hid :])
                if below_c is not None:
                    lower = below_c[:, t]
                    d = torch.sigmoid(
                        z_in[:, t, 4 * hid :]
                        + self.depth_cell[j - 1] * c
                        + self.depth_below[j - 1] * lower
                    )
                    c_new = c_new + d * lower
                c = c_new
                h = o * torch.tanh(c)
                steps_h.append(h)
                steps_c.append(c)
            below_h, below_c = torch.stack(steps_h, 1), torch.stack(steps_c, 1)
            hs.append(h)
            cs.append(c)
        return below_h, (torch.stack(hs), torch.stack(cs))
