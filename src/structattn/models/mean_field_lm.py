r"""An LSTM language model with mean-field CRF attention over its previous hidden states
(Liu et al., appendix C.3).

For every position t, with LSTM states h_1..h_t (the last ``memory_size`` of them, carried
across the windows of truncated backpropagation through time):

.. math::
    s^{(t)} &= \text{MeanField}_k(\phi(h_{<t}, h_t), J(h_{<t}, h_t))
        \quad (\text{one binary spin per earlier state, Algorithm 1}) \\
    c_t &= \textstyle\sum_{i < t} s^{(t)}_i h_i, \qquad
    \tilde h_t = \tanh(U [c_t; h_t]), \qquad p(w_{t+1}) = \text{softmax}(V \tilde h_t + b)

All T positions of a window are attended at once: queries [B, T], memory = the tape of
earlier windows followed by the window's own states, and a causal mask [B, T, N] (a query
sees only states strictly before it and at most ``memory_size`` of them).

Interface of :mod:`structattn.models.language_model`: ``forward(inputs [B, T], state) ->
(logits [B, T, V], state)``, ``initial_state(batch, device)``. State: a plain tuple
``(h, c, tape, filled)`` with ``h, c`` [1, B, H] (``nn.LSTM``'s layout), ``tape``
[B, M, H] the last M = ``memory_size`` hidden states (oldest first) and ``filled`` [B] how
many of them are real (the tape is empty at the start of a stream).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..attention import MeanFieldAttention
from ..attention.normalizers import mean_field_weights

__all__ = ["MeanFieldLanguageModel"]


class MeanFieldLanguageModel(nn.Module):
    """LSTM LM with mean-field attention over its last ``memory_size`` hidden states.

    Args:
        vocab_size: V. embed_size: word embeddings. hidden_size: H of the LSTM.
        iterations: k mean-field iterations (0 = sigmoid attention).
        attention_dim: hidden size of the unary MLP and rank of J.
        memory_size: M, how many earlier states a position may attend to.
        dropout: on the embeddings and on the attentional vector.
    """

    def __init__(
        self,
        vocab_size: int,
        embed_size: int,
        hidden_size: int,
        iterations: int = 5,
        attention_dim: int = 32,
        memory_size: int = 35,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if memory_size < 1:
            raise ValueError(f"`memory_size` must be >= 1, got {memory_size}")
        self.hidden_size = hidden_size
        self.memory_size = memory_size
        self.embedding = nn.Embedding(vocab_size, embed_size)
        self.lstm = nn.LSTM(embed_size, hidden_size, batch_first=True)
        self.attention = MeanFieldAttention(hidden_size, hidden_size, attention_dim, iterations)
        self.combine = nn.Linear(2 * hidden_size, hidden_size, bias=False)  # U
        self.output = nn.Linear(hidden_size, vocab_size)  # V, b
        self.dropout = nn.Dropout(dropout)

    def initial_state(self, batch: int, device: torch.device) -> tuple[Tensor, ...]:
        """Zero LSTM state and an empty tape."""
        h = torch.zeros(1, batch, self.hidden_size, device=device)
        tape = torch.zeros(batch, self.memory_size, self.hidden_size, device=device)
        return (h, h.clone(), tape, torch.zeros(batch, dtype=torch.long, device=device))

    def forward(self, inputs: Tensor, state: Any) -> tuple[Tensor, tuple[Tensor, ...]]:
        h0, c0, tape, filled = state
        x = self.dropout(self.embedding(inputs))  # [B, T, E]
        hidden, (h, c) = self.lstm(x, (h0, c0))  # [B, T, H]
        batch, t, _ = hidden.shape
        m = tape.shape[1]
        memory = torch.cat([tape, hidden], dim=1)  # [B, M + T, H]
        # position j of the memory (tape slots 0..M-1, then the window) is visible to query
        # q if it is strictly earlier, at most M steps back, and (on the tape) filled
        positions = torch.arange(m + t, device=inputs.device)  # [M + T]
        queries = torch.arange(t, device=inputs.device).unsqueeze(-1) + m  # [T, 1]
        causal = (positions < queries) & (positions >= queries - m)  # [T, M + T]
        real = positions.unsqueeze(0) >= (m - filled).unsqueeze(-1)  # [B, M + T]
        mask = causal.unsqueeze(0) & real.unsqueeze(1)  # [B, T, M + T]
        everything = torch.ones(batch, m + t, dtype=torch.bool, device=inputs.device)
        unary, coupling = self.attention.potentials(hidden, memory, everything)
        spins = mean_field_weights(unary, coupling, mask, self.attention.iterations)  # [B,T,N]
        context = torch.bmm(spins, memory)  # [B, T, H]
        attentional = torch.tanh(self.combine(torch.cat([context, hidden], dim=-1)))
        logits = self.output(self.dropout(attentional))  # [B, T, V]
        new_tape = memory[:, -m:]  # [B, M, H] the last M states
        new_filled = (filled + t).clamp(max=m)
        return logits, (h, c, new_tape, new_filled)
