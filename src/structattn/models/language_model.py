"""Word-level language models and the one interface every LM of the project implements.

The interface (what :mod:`structattn.recipes._lm` trains and evaluates)::

    class MyLM(nn.Module):
        def forward(self, inputs, state):          # inputs: LongTensor [B, T] word ids
            ...                                    # state: what initial_state / the previous
            return logits, new_state               # call returned; logits: [B, T, V]
        def initial_state(self, batch, device):    # the state before the first token
            ...

* ``forward(inputs, state)`` reads ``T`` tokens of ``B`` streams that continue where the
  previous call left them (truncated backpropagation through time: ``state`` is detached
  between windows by the caller) and returns the next-word logits of every position, in any
  floating dtype, and the state after the window.
* A **state** is a tensor, or plain ``tuple`` / ``list`` / ``dict`` nests of tensors (also
  ``None``, numbers and strings), with the batch in dimension 0 or 1 of each tensor (say
  which in your docstring; ``nn.LSTM``-style ``[layers, B, H]`` is fine). It is saved in
  mid-epoch checkpoints by the training loop, so ``NamedTuple`` and other classes are not
  allowed: convert them to plain tuples (see :class:`RNNLanguageModel` for ``(h, c)``).
  The state is never reordered; ``B`` stays fixed within a pass over a stream.
* ``initial_state(batch, device)`` is the state at the start of every stream (every epoch
  and every evaluation pass).
* The model has no other obligations: embeddings, dropout, tied weights are its business.
  :func:`detach_state` cuts the graph of a state between windows.

Models here: :class:`RNNLanguageModel` (Elman RNN with tanh, or LSTM; ``n`` layers, dropout
on the embeddings, between layers and on the output, optional tied input / output
embeddings), the baselines of Table 1 of Cheng et al. (2016) and of PRPN, and
:class:`LSTMNLanguageModel` (a stacked LSTMN whose tapes span the windows of a stream).

>>> model = RNNLanguageModel(vocab_size=11, embed_size=4, hidden_size=4, cell="lstm")
>>> state = model.initial_state(2, torch.device("cpu"))
>>> logits, state = model(torch.zeros(2, 3, dtype=torch.long), state)
>>> tuple(logits.shape), tuple(state[0].shape)
((2, 3, 11), (1, 2, 4))
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ..nn.deep_lstm import DepthGatedLSTM, GatedFeedbackLSTM
from ..nn.lstmn import LSTMN, LSTMNCell, LSTMNStackOutput, LSTMNState

__all__ = [
    "LM_CELLS",
    "LSTMNLanguageModel",
    "LanguageModel",
    "RNNLanguageModel",
    "detach_state",
]

LM_CELLS = ("rnn", "lstm", "gf-lstm", "dg-lstm")
"""Recurrent cells of :class:`RNNLanguageModel` (gated-feedback and depth-gated LSTMs:
:mod:`structattn.nn.deep_lstm`)."""


@runtime_checkable
class LanguageModel(Protocol):
    """The interface of every language model (see the module docstring)."""

    def __call__(self, inputs: Tensor, state: Any) -> tuple[Tensor, Any]:
        """``inputs`` [B, T] ids -> (logits [B, T, V], state after the window)."""
        ...

    def initial_state(self, batch: int, device: torch.device) -> Any:
        """The state at the start of ``batch`` streams."""
        ...


def detach_state(state: Any) -> Any:
    """``state`` with every tensor detached (gradients stop here), the nesting kept: tensors
    inside tuples (``NamedTuple`` s too), lists and dicts; other values as they are."""
    if isinstance(state, Tensor):
        return state.detach()
    if isinstance(state, tuple):
        items = [detach_state(x) for x in state]
        return type(state)(*items) if hasattr(state, "_fields") else tuple(items)
    if isinstance(state, list):
        return [detach_state(x) for x in state]
    if isinstance(state, dict):
        return {key: detach_state(value) for key, value in state.items()}
    return state


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return value


class RNNLanguageModel(nn.Module):
    """Embedding -> ``num_layers`` of Elman RNN (tanh), LSTM, gated-feedback LSTM
    (``gf-lstm``) or depth-gated LSTM (``dg-lstm``) -> linear softmax layer.

    Dropout (probability ``dropout``) on the embeddings, between the layers and on the top
    layer's outputs (Zaremba et al. 2014; ``dropout=0`` for the unregularised models of
    Cheng et al.). With ``tie_weights`` the output layer uses the embedding matrix (Press and
    Wolf 2017; needs ``hidden_size == embed_size``). Weights of the embeddings and of the
    output layer ~ U(-0.1, 0.1), output bias 0, recurrent weights as ``nn.RNN`` / ``nn.LSTM``.

    State: ``(h,)`` for the RNN, ``(h, c)`` for the LSTMs, each ``[num_layers, B, H]``.

    Shapes: ``inputs`` [B, T] -> logits [B, T, V].
    """

    def __init__(
        self,
        vocab_size: int,
        embed_size: int,
        hidden_size: int,
        num_layers: int = 1,
        cell: Literal["rnn", "lstm", "gf-lstm", "dg-lstm"] = "lstm",
        dropout: float = 0.0,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        self.vocab_size = _positive("vocab_size", vocab_size)
        self.embed_size = _positive("embed_size", embed_size)
        self.hidden_size = _positive("hidden_size", hidden_size)
        self.num_layers = _positive("num_layers", num_layers)
        if cell not in LM_CELLS:
            raise ValueError(f"`cell` must be one of {LM_CELLS}, got {cell!r}")
        if not isinstance(dropout, int | float) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {dropout!r}")
        if tie_weights and hidden_size != embed_size:
            raise ValueError(
                f"tied weights need hidden_size == embed_size, got {hidden_size} and {embed_size}"
            )
        self.cell = cell
        self.embedding = nn.Embedding(vocab_size, embed_size)
        self.dropout = nn.Dropout(dropout)
        between = dropout if num_layers > 1 else 0.0
        self.rnn: nn.Module
        if cell == "gf-lstm":
            self.rnn = GatedFeedbackLSTM(embed_size, hidden_size, num_layers, dropout=between)
        elif cell == "dg-lstm":
            self.rnn = DepthGatedLSTM(embed_size, hidden_size, num_layers, dropout=between)
        elif cell == "lstm":
            self.rnn = nn.LSTM(
                embed_size, hidden_size, num_layers, batch_first=True, dropout=between
            )
        else:
            self.rnn = nn.RNN(
                embed_size,
                hidden_size,
                num_layers,
                nonlinearity="tanh",
                batch_first=True,
                dropout=between,
            )
        self.output = nn.Linear(hidden_size, vocab_size)
        if tie_weights:
            self.output.weight = self.embedding.weight
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        if not tie_weights:
            nn.init.uniform_(self.output.weight, -0.1, 0.1)
        nn.init.zeros_(self.output.bias)

    def initial_state(self, batch: int, device: torch.device) -> tuple[Tensor, ...]:
        """Zeros: ``(h,)`` or ``(h, c)``, each ``[num_layers, batch, H]``."""
        zeros = torch.zeros(
            self.num_layers, batch, self.hidden_size, device=device, dtype=self.output.weight.dtype
        )
        return (zeros,) if self.cell == "rnn" else (zeros, zeros.clone())

    def forward(
        self, inputs: Tensor, state: tuple[Tensor, ...]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """``inputs`` [B, T] ids and the state -> (logits [B, T, V], new state)."""
        if inputs.dim() != 2 or inputs.dtype != torch.long:
            raise ValueError(
                f"`inputs` must be a LongTensor [B, T], got {inputs.dtype} {tuple(inputs.shape)}"
            )
        expected = 1 if self.cell == "rnn" else 2
        if not isinstance(state, tuple) or len(state) != expected:
            raise ValueError(
                f"`state` of a {self.cell} LM is a tuple of {expected} tensors (initial_state)"
            )
        embedded = self.dropout(self.embedding(inputs))  # [B, T, E]
        if self.cell != "rnn":
            outputs, (h, c) = self.rnn(embedded, (state[0], state[1]))  # [B, T, H]
            new_state: tuple[Tensor, ...] = (h, c)
        else:
            outputs, h = self.rnn(embedded, state[0])
            new_state = (h,)
        return self.output(self.dropout(outputs)), new_state  # [B, T, V]


class LSTMNLanguageModel(nn.Module):
    """Embedding -> ``num_layers`` stacked LSTMN (:class:`~structattn.nn.LSTMN`) -> softmax layer.

    The tapes span the windows of a stream: the state carries every layer's last
    ``memory_span`` slots (detached between windows by the caller, so gradients stop at the
    window boundary while attention reaches back up to ``memory_span`` tokens), and each
    step attends to at most the last ``memory_span`` tokens (Cheng et al.: the memory grows
    "until an upper bound of the memory span is reached"). Dropout as in
    :class:`RNNLanguageModel`; ``skip_connections`` feeds the embeddings to every layer.

    State: one plain tuple per layer, bottom first, of the :class:`~structattn.nn.LSTMNState`
    fields ``(hidden [B, N, H], memory [B, N, H], keys [B, N, H], valid [B, N], summary
    [B, H])`` with ``N <= memory_span + 1`` slots.

    Shapes: ``inputs`` [B, T] -> logits [B, T, V].
    """

    def __init__(
        self,
        vocab_size: int,
        embed_size: int,
        hidden_size: int,
        num_layers: int = 1,
        memory_span: int = 35,
        dropout: float = 0.0,
        skip_connections: bool = False,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        self.vocab_size = _positive("vocab_size", vocab_size)
        self.memory_span = _positive("memory_span", memory_span)
        if not isinstance(dropout, int | float) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {dropout!r}")
        if tie_weights and hidden_size != embed_size:
            raise ValueError(
                f"tied weights need hidden_size == embed_size, got {hidden_size} and {embed_size}"
            )
        self.embedding = nn.Embedding(vocab_size, _positive("embed_size", embed_size))
        self.lstmn = LSTMN(embed_size, hidden_size, num_layers, dropout, skip_connections)
        self.dropout = nn.Dropout(dropout)
        self.output = nn.Linear(hidden_size, vocab_size)
        if tie_weights:
            self.output.weight = self.embedding.weight
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        if not tie_weights:
            nn.init.uniform_(self.output.weight, -0.1, 0.1)
        nn.init.zeros_(self.output.bias)

    def initial_state(self, batch: int, device: torch.device) -> tuple[tuple[Tensor, ...], ...]:
        """Every layer's :meth:`~structattn.nn.LSTMNCell.initial_state` as plain tuples."""
        dtype = self.output.weight.dtype
        cells = [layer for layer in self.lstmn.layers if isinstance(layer, LSTMNCell)]
        return tuple(tuple(cell.initial_state(batch, device, dtype)) for cell in cells)

    def read(
        self, inputs: Tensor, state: tuple[tuple[Tensor, ...], ...] | None = None
    ) -> tuple[Tensor, tuple[tuple[Tensor, ...], ...], LSTMNStackOutput]:
        """:meth:`forward` that also returns the stack's output (its attention:
        ``layer_attention`` [B, L, T, T] from a fresh ``state=None``)."""
        if inputs.dim() != 2 or inputs.dtype != torch.long:
            raise ValueError(
                f"`inputs` must be a LongTensor [B, T], got {inputs.dtype} {tuple(inputs.shape)}"
            )
        layers = None if state is None else [LSTMNState(*layer) for layer in state]
        if layers is not None and len(layers) != len(self.lstmn.layers):
            raise ValueError(f"`state` must hold {len(self.lstmn.layers)} layer states")
        embedded = self.dropout(self.embedding(inputs))  # [B, T, E]
        out = self.lstmn(embedded, state=layers, memory_span=self.memory_span)
        logits = self.output(self.dropout(out.hidden))  # [B, T, V]
        return logits, tuple(tuple(layer) for layer in out.final_state), out

    def forward(
        self, inputs: Tensor, state: tuple[tuple[Tensor, ...], ...]
    ) -> tuple[Tensor, tuple[tuple[Tensor, ...], ...]]:
        """``inputs`` [B, T] ids and the state -> (logits [B, T, V], new state)."""
        logits, new_state, _ = self.read(inputs, state)
        return logits, new_state
