r"""Long Short-Term Memory-Networks (Cheng, Dong and Lapata, EMNLP 2016).

An LSTMN replaces the single memory cell of an LSTM by two tapes that keep one slot per
token read so far: a hidden tape ``h_1..h_{t-1}`` and a memory tape ``c_1..c_{t-1}``. At step
``t`` the reader attends over its own past (intra-attention, eq. 4-9 of the paper)::

    a_i^t = v^T tanh(W_h h_i + W_x x_t + W_h~ h~_{t-1})          i < t
    s^t   = softmax_i(a^t)
    h~_t  = sum_i s_i^t h_i,      c~_t = sum_i s_i^t c_i
    [i_t, f_t, o_t, c^_t] = [sigmoid, sigmoid, sigmoid, tanh](W [h~_t, x_t] + b)
    c_t   = f_t * c~_t + i_t * c^_t
    h_t   = o_t * tanh(c_t)

Conventions shared by every layer here (all batch first):

* **First step.** Each tape starts with one extra slot ``(h_0, c_0) = (0, 0)``, the initial
  zero memory of the authors' code, and ``h~_0 = 0``. Slot 0 is attended only while an item
  has read no real token yet, so the first real step is a plain LSTM step from the zero state
  (``h~ = c~ = 0``); from the second real step on, attention is over real tokens ``i < t``
  only. Slot 0 is not part of the returned tapes, and the attention row of the first real
  step is all zeros.
* **Masking.** ``mask`` is a BoolTensor ``[B, T]``, True at real positions (any pattern, not
  only trailing padding). A padded step writes zeros to both tapes, is never attended to,
  leaves ``h~`` (and the decoder's ``g~``) unchanged and has all-zero outputs and attention
  rows. Every item therefore gets exactly the results of running it alone with its padded
  steps removed.
* **Cost.** ``W_x x_t`` is computed for all ``t`` at once and ``W_h h_i`` once per token
  (cached on a key tape), so step ``t`` costs O(t H) plus O(H^2) matmuls; a forward pass is
  O(T^2 H + T H^2) time per item. The loop is over time only, never over the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._validation import check_mask

__all__ = [
    "LSTMN",
    "LSTMNCell",
    "LSTMNDecoder",
    "LSTMNDecoderOutput",
    "LSTMNDecoderState",
    "LSTMNDecoderStep",
    "LSTMNOutput",
    "LSTMNSource",
    "LSTMNStackOutput",
    "LSTMNState",
    "LSTMNStep",
]

FUSIONS = ("shallow", "deep")


# ----------------------------------------------------------------------------- containers


class LSTMNState(NamedTuple):
    """Recurrent state of one LSTMN layer after ``n`` steps (``N = n + 1`` tape slots).

    Slot 0 is the initial zero slot ``(h_0, c_0)``; slot ``k >= 1`` belongs to step ``k``
    (zeros for a padded step).
    """

    hidden: Tensor  # [B, N, H] hidden tape
    memory: Tensor  # [B, N, H] memory tape
    keys: Tensor  # [B, N, H] cached W_h h_i
    valid: Tensor  # [B, N] bool: slots that may be attended (slot 0 only before any real step)
    summary: Tensor  # [B, H] h~ of the last real step (h~_0 = 0)

    def index_select(self, index: Tensor) -> LSTMNState:
        """Reorder/expand the batch (e.g. beam search): item ``b`` of the result is ``index[b]``."""
        return LSTMNState(*(x.index_select(0, index) for x in self))


class LSTMNOutput(NamedTuple):
    """Result of :meth:`LSTMNCell.forward` (zeros at padded steps)."""

    hidden: Tensor  # [B, T, H] hidden tape h_1..h_T
    memory: Tensor  # [B, T, H] memory tape c_1..c_T
    attention: Tensor  # [B, T, T] row t = s^t over i < t, 0 elsewhere
    final_state: LSTMNState  # state after T steps (tapes with slot 0)


class LSTMNStep(NamedTuple):
    """Result of :meth:`LSTMNCell.step` for step ``t`` (zeros where the step is padded)."""

    hidden: Tensor  # [B, H] h_t
    memory: Tensor  # [B, H] c_t
    attention: Tensor  # [B, t - 1] s^t over the previous steps
    state: LSTMNState  # state after step t


class LSTMNStackOutput(NamedTuple):
    """Result of :meth:`LSTMN.forward`: the top layer's tapes and every layer's attention."""

    hidden: Tensor  # [B, T, H] top layer's hidden tape
    memory: Tensor  # [B, T, H] top layer's memory tape
    attention: Tensor  # [B, T, T] top layer's intra-attention
    layer_attention: Tensor  # [B, L, T, T] intra-attention of every layer, bottom first
    final_state: tuple[LSTMNState, ...]  # one per layer, bottom first


class LSTMNSource(NamedTuple):
    """Encoder tapes prepared for inter-attention (:meth:`LSTMNDecoder.prepare_source`)."""

    hidden: Tensor  # [B, S, H] source hidden tape gamma
    memory: Tensor | None  # [B, S, H] source memory tape alpha (deep fusion only)
    keys: Tensor  # [B, S, H] cached W_g gamma_j
    mask: Tensor  # [B, S] bool, True at real source positions

    def index_select(self, index: Tensor) -> LSTMNSource:
        """Reorder/expand the batch (e.g. beam search): item ``b`` of the result is ``index[b]``."""
        memory = None if self.memory is None else self.memory.index_select(0, index)
        return LSTMNSource(
            self.hidden.index_select(0, index),
            memory,
            self.keys.index_select(0, index),
            self.mask.index_select(0, index),
        )


class LSTMNDecoderState(NamedTuple):
    """Recurrent state of :class:`LSTMNDecoder`."""

    intra: LSTMNState  # target tapes, as for LSTMNCell
    context: Tensor  # [B, H] g~ of the last real step (g~_0 = 0)

    def index_select(self, index: Tensor) -> LSTMNDecoderState:
        """Reorder/expand the batch (e.g. beam search): item ``b`` of the result is ``index[b]``."""
        return LSTMNDecoderState(
            self.intra.index_select(index), self.context.index_select(0, index)
        )


class LSTMNDecoderStep(NamedTuple):
    """Result of :meth:`LSTMNDecoder.step` for step ``t`` (zeros where the step is padded)."""

    hidden: Tensor  # [B, H] h_t
    memory: Tensor  # [B, H] c_t
    attention: Tensor  # [B, t - 1] intra-attention s^t over the previous target steps
    source_attention: Tensor  # [B, S] inter-attention p^t
    context: Tensor  # [B, H] source context g~_t
    state: LSTMNDecoderState  # state after step t


class LSTMNDecoderOutput(NamedTuple):
    """Result of :meth:`LSTMNDecoder.forward` (zeros at padded steps)."""

    hidden: Tensor  # [B, T, H] target hidden tape
    memory: Tensor  # [B, T, H] target memory tape
    attention: Tensor  # [B, T, T] intra-attention, row t over i < t
    source_attention: Tensor  # [B, T, S] inter-attention p^t
    context: Tensor  # [B, T, H] source contexts g~_t
    final_state: LSTMNDecoderState  # state after T steps (continue with ``step``)


# ----------------------------------------------------------------------------- validation


def _describe(x: object) -> str:
    return str(tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__


def _check_features(name: str, x: object, rank: int, size: int) -> Tensor:
    """Floating tensor of the given rank whose last dimension is ``size``."""
    dims = "[B, T, D]" if rank == 3 else "[B, D]"
    if (
        not isinstance(x, Tensor)
        or not x.is_floating_point()
        or x.dim() != rank
        or x.shape[-1] != size
    ):
        raise ValueError(
            f"`{name}` must be a floating-point tensor of shape {dims} with D = {size}, "
            f"got {_describe(x)}"
        )
    return x


def _check_size(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return value


def _check_state(state: object, batch: int, hidden_size: int) -> LSTMNState:
    if not isinstance(state, LSTMNState):
        raise ValueError(f"`state` must be an LSTMNState, got {type(state).__name__}")
    if state.hidden.dim() != 3 or state.hidden.shape[0] != batch:
        raise ValueError(
            f"`state` has batch {state.hidden.shape[0]} but `inputs` has batch {batch}"
        )
    if state.hidden.shape[-1] != hidden_size:
        raise ValueError(
            f"`state` has hidden size {state.hidden.shape[-1]}, expected {hidden_size}"
        )
    return state


# ----------------------------------------------------------------------------- layers


class LSTMNCell(nn.Module):
    r"""One LSTMN layer: an LSTM whose memory cell is a tape read by intra-attention.

    .. math::
        a_i^t &= v^\top \tanh(W_h h_i + W_x x_t + W_{\tilde h} \tilde h_{t-1}), \quad i < t \\
        s^t &= \mathrm{softmax}(a^t), \quad
        \tilde h_t = \textstyle\sum_i s_i^t h_i, \quad \tilde c_t = \sum_i s_i^t c_i \\
        [i_t, f_t, o_t, \hat c_t] &= [\sigma, \sigma, \sigma, \tanh](W [\tilde h_t, x_t] + b) \\
        c_t &= f_t \odot \tilde c_t + i_t \odot \hat c_t, \quad h_t = o_t \odot \tanh(c_t)

    The first real step attends to the zero slot ``(h_0, c_0)`` only (a plain LSTM step from
    the zero state); see the module docstring for the masking semantics.

    Args:
        input_size: D, size of ``x_t``.
        hidden_size: H, size of ``h_t``, ``c_t`` and of the attention space.

    Parameters (``W = [summary_gates | input_gates]``): ``input_gates`` (D -> 4H, with the
    bias ``b``; gate order i, f, o, c^), ``summary_gates`` (H -> 4H), ``attn_input``
    ``W_x`` (D -> H), ``attn_hidden`` ``W_h`` (H -> H), ``attn_summary`` ``W_h~`` (H -> H),
    ``attn_score`` ``v`` (H -> 1); attention projections have no bias, as in eq. 4.
    Initialisation: U(-1/sqrt(H), 1/sqrt(H)) as ``nn.LSTM``, gate bias 0 except forget 1.

    Shapes: ``inputs`` [B, T, D], ``mask`` [B, T] -> :class:`LSTMNOutput` with tapes
    [B, T, H] and attention [B, T, T]. Time O(B (T^2 H + T H^2)), sequential in T.

    Example:
        >>> cell = LSTMNCell(3, 4)
        >>> mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
        >>> out = cell(torch.randn(2, 5, 3), mask)
        >>> out.hidden.shape, out.attention.shape
        (torch.Size([2, 5, 4]), torch.Size([2, 5, 5]))
    """

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.input_size = _check_size("input_size", input_size)
        self.hidden_size = _check_size("hidden_size", hidden_size)
        h = hidden_size
        self.input_gates = nn.Linear(input_size, 4 * h)  # W[:, x] and b
        self.summary_gates = nn.Linear(h, 4 * h, bias=False)  # W[:, h~]
        self.attn_input = nn.Linear(input_size, h, bias=False)  # W_x
        self.attn_hidden = nn.Linear(h, h, bias=False)  # W_h
        self.attn_summary = nn.Linear(h, h, bias=False)  # W_h~
        self.attn_score = nn.Linear(h, 1, bias=False)  # v
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """U(-1/sqrt(H), 1/sqrt(H)) weights; gate bias 0 except the forget gate (1)."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)
        with torch.no_grad():
            h = self.hidden_size
            self.input_gates.bias.zero_()
            self.input_gates.bias[h : 2 * h].fill_(1.0)

    def initial_state(
        self,
        batch_size: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> LSTMNState:
        """State before the first step: one zero slot, attendable; ``h~_0 = 0``."""
        ref = self.attn_score.weight
        device = ref.device if device is None else device
        dtype = ref.dtype if dtype is None else dtype
        zeros = torch.zeros(batch_size, 1, self.hidden_size, device=device, dtype=dtype)
        valid = torch.ones(batch_size, 1, dtype=torch.bool, device=device)
        return LSTMNState(zeros, zeros, zeros, valid, zeros[:, 0])

    def _step(
        self,
        x_attn: Tensor,
        x_gates: Tensor,
        state: LSTMNState,
        real: Tensor,
        extra_memory: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, LSTMNState]:
        """One step from precomputed ``W_x x_t`` [B, H] and ``W[:, x] x_t + b`` [B, 4H].

        ``real`` [B] bool marks real steps; ``extra_memory`` [B, H] is added to ``c_t`` (the
        decoder's deep fusion term ``r_t * a~_t``). Returns ``h_t``, ``c_t`` [B, H], the
        weights over all N slots [B, N] (slot 0 included) and the new state.
        """
        # a_i^t = v^T tanh(W_h h_i + W_x x_t + W_h~ h~_{t-1}) over the N slots
        query = x_attn + self.attn_summary(state.summary)  # [B, H]
        scores = self.attn_score(torch.tanh(state.keys + query.unsqueeze(1))).squeeze(-1)  # [B, N]
        scores = scores.masked_fill(~state.valid, float("-inf"))  # >= 1 valid slot per row
        weights = torch.softmax(scores, dim=-1)  # [B, N]
        h_sum = torch.bmm(weights.unsqueeze(1), state.hidden).squeeze(1)  # h~_t [B, H]
        c_sum = torch.bmm(weights.unsqueeze(1), state.memory).squeeze(1)  # c~_t [B, H]
        gates = x_gates + self.summary_gates(h_sum)  # [B, 4H]
        in_gate, forget_gate, out_gate, candidate = gates.chunk(4, dim=-1)  # 4 x [B, H]
        memory = torch.sigmoid(forget_gate) * c_sum + torch.sigmoid(in_gate) * torch.tanh(candidate)
        if extra_memory is not None:
            memory = memory + extra_memory
        hidden = torch.sigmoid(out_gate) * torch.tanh(memory)  # [B, H]
        keep = real.unsqueeze(-1)  # [B, 1]
        hidden = hidden.masked_fill(~keep, 0.0)
        memory = memory.masked_fill(~keep, 0.0)
        weights = weights.masked_fill(~keep, 0.0)
        valid = torch.cat(
            [state.valid[:, :1] & ~keep, state.valid[:, 1:], keep], dim=1
        )  # [B, N + 1]; slot 0 is closed by the first real step
        new_state = LSTMNState(
            hidden=torch.cat([state.hidden, hidden.unsqueeze(1)], dim=1),  # [B, N + 1, H]
            memory=torch.cat([state.memory, memory.unsqueeze(1)], dim=1),
            keys=torch.cat([state.keys, self.attn_hidden(hidden).unsqueeze(1)], dim=1),
            valid=valid,
            summary=torch.where(keep, h_sum, state.summary),
        )
        return hidden, memory, weights, new_state

    def step(
        self, inputs: Tensor, state: LSTMNState | None = None, mask: Tensor | None = None
    ) -> LSTMNStep:
        """Read one token: ``inputs`` [B, D], ``mask`` [B] (False = padded step, state kept).

        ``state`` defaults to :meth:`initial_state`. Calling ``step`` T times gives the same
        results as :meth:`forward` on the sequence.
        """
        inputs = _check_features("inputs", inputs, rank=2, size=self.input_size)
        batch = inputs.shape[0]
        if state is None:
            state = self.initial_state(batch, inputs.device, inputs.dtype)
        state = _check_state(state, batch, self.hidden_size)
        real = check_mask("mask", mask, (batch,), inputs.device)
        hidden, memory, weights, state = self._step(
            self.attn_input(inputs), self.input_gates(inputs), state, real
        )
        return LSTMNStep(hidden, memory, weights[:, 1:], state)

    def forward(
        self,
        inputs: Tensor,
        mask: Tensor | None = None,
        state: LSTMNState | None = None,
        memory_span: int | None = None,
    ) -> LSTMNOutput:
        """Read a sequence.

        Args:
            inputs: [B, T, D] token vectors ``x_t``.
            mask: BoolTensor [B, T], True at real steps (default: all real).
            state: continue from this state (e.g. the ``final_state`` of the previous window
                of a stream, detached) instead of :meth:`initial_state`.
            memory_span: attend to at most the last ``memory_span`` slots of the tape, and
                keep only those (and slot 0) in ``final_state`` (None: the whole tape, as the
                paper's sentence-level models). A language model reading a long stream in
                windows sets it so that the tape it carries stays bounded. (Should no slot in
                the span be open, a run of padded steps longer than the span before the
                first real one, the span's zero slots are read: h~ = c~ = 0 as from slot 0.)

        Returns:
            :class:`LSTMNOutput`: ``hidden`` and ``memory`` tapes [B, T, H] of this call's
            steps, ``attention`` and ``final_state``. Without ``state``, ``attention`` is
            [B, T, T] (row t holds s^t over the real i < t and sums to 1, except for padded
            steps and each item's first real step, whose rows are 0); with ``state`` of P
            slots it is [B, T, P + T] over the starting slots (slot 0 included while present),
            then this call's.

        The steps run in one loop with fused projections: ``W_x x_t`` and ``W[:, x] x_t + b``
        for all t at once, ``[W[:, h~] ; W_h~] h~_t`` in one matmul per step (gates now, query
        of the next step), the two tapes read by one ``bmm``. Same results as :meth:`step`.
        """
        inputs = _check_features("inputs", inputs, rank=3, size=self.input_size)
        batch, length, _ = inputs.shape
        mask = check_mask("mask", mask, (batch, length), inputs.device)
        if memory_span is not None:
            _check_size("memory_span", memory_span)
        fresh = state is None
        if state is None:
            state = self.initial_state(batch, inputs.device, inputs.dtype)
        state = _check_state(state, batch, self.hidden_size)
        # W_x x_t and W[:, x] x_t + b for all t, as T x [B, H] and T x [B, 4H] (unbind: one
        # gradient stack in the backward instead of a zero-filled [B, T, *] per step)
        x_attn = self.attn_input(inputs).unbind(1)
        x_gates = self.input_gates(inputs).unbind(1)
        h = self.hidden_size
        all_real = bool(mask.all())
        fused = torch.cat([self.summary_gates.weight, self.attn_summary.weight], dim=0)  # [5H, H]
        query_summary = self.attn_summary(state.summary)  # W_h~ h~_{t-1}, [B, H]
        # The P starting slots stay one block (read in place: a state carried from the previous
        # window is detached, so slicing it costs nothing in the backward); the slots written
        # by this call are lists that each step stacks as far as it attends, so the backward
        # only splits gradients (no zero-filled gradient of a whole tape per step).
        old_tape = torch.cat([state.hidden, state.memory], dim=-1)  # [B, P, 2H]
        old_keys, old_valid = state.keys, state.valid  # [B, P, H], [B, P]
        start = old_tape.shape[1]  # P
        tape: list[Tensor] = []  # this call's slots, [B, 2H] each
        keys: list[Tensor] = []  # [B, H] each
        valid: list[Tensor] = []  # [B] each
        summary = state.summary  # [B, H]
        score = self.attn_score.weight.squeeze(0)  # v, [H]
        width = start + length  # P slots before this call, then T
        rows, hidden_steps, memory_steps = [], [], []
        for t in range(length):
            slots = start + t
            low = max(0, slots - memory_span) if memory_span is not None else 0
            low_old, low_new = min(low, start), max(low - start, 0)  # the span in each part
            # a_i^t = v^T tanh(W_h h_i + W_x x_t + W_h~ h~_{t-1}) over the attended slots
            query = (x_attn[t] + query_summary).unsqueeze(1)  # [B, 1, H]
            parts, opens, values = [], [], []
            if low_old < start:
                parts.append(torch.tanh(old_keys[:, low_old:] + query) @ score)  # [B, n_old]
                opens.append(old_valid[:, low_old:])
                values.append(old_tape[:, low_old:])
            if low_new < t:
                parts.append(torch.tanh(torch.stack(keys[low_new:], 1) + query) @ score)
                opens.append(torch.stack(valid[low_new:], 1))  # [B, n_new]
                values.append(torch.stack(tape[low_new:], 1))  # [B, n_new, 2H]
            scores = parts[0] if len(parts) == 1 else torch.cat(parts, -1)  # [B, n]
            open_slots = opens[0] if len(opens) == 1 else torch.cat(opens, -1)  # [B, n]
            if low > 0:  # slot 0 has left the span: read zero slots if nothing is open
                open_slots = open_slots | ~open_slots.any(-1, keepdim=True)
            weights = torch.softmax(scores.masked_fill(~open_slots, float("-inf")), dim=-1)
            read = torch.bmm(weights[:, None, : parts[0].shape[1]], values[0])  # [B, 1, 2H]
            if len(values) == 2:
                read = read + torch.bmm(weights[:, None, parts[0].shape[1] :], values[1])
            read = read.squeeze(1)
            h_sum, c_sum = read[:, :h], read[:, h:]  # h~_t, c~_t [B, H]
            projected = h_sum @ fused.t()  # [B, 5H]: gates part, next query part
            gates = x_gates[t] + projected[:, : 4 * h]  # [B, 4H]
            in_gate, forget_gate, out_gate, candidate = gates.chunk(4, dim=-1)
            memory = torch.sigmoid(forget_gate) * c_sum + torch.sigmoid(in_gate) * torch.tanh(
                candidate
            )  # c_t [B, H]
            hidden = torch.sigmoid(out_gate) * torch.tanh(memory)  # h_t [B, H]
            if all_real:
                query_summary = projected[:, 4 * h :]
                summary = h_sum
                if t == 0:  # a real step closes slot 0
                    old_valid = torch.cat([old_valid[:, :1] & False, old_valid[:, 1:]], 1)
                valid.append(mask[:, t])
            else:
                keep = mask[:, t].unsqueeze(-1)  # [B, 1]
                hidden = hidden.masked_fill(~keep, 0.0)
                memory = memory.masked_fill(~keep, 0.0)
                weights = weights.masked_fill(~keep, 0.0)
                query_summary = torch.where(keep, projected[:, 4 * h :], query_summary)
                summary = torch.where(keep, h_sum, summary)
                old_valid = torch.cat([old_valid[:, :1] & ~keep, old_valid[:, 1:]], 1)
                valid.append(mask[:, t])
            tape.append(torch.cat([hidden, memory], -1))  # [B, 2H]
            keys.append(self.attn_hidden(hidden))  # W_h h_t [B, H]
            rows.append(F.pad(weights, (low, width - slots)))  # [B, P + T]
            hidden_steps.append(hidden)
            memory_steps.append(memory)
        if rows:
            attention = torch.stack(rows, dim=1)  # [B, T, P + T]
            out_hidden = torch.stack(hidden_steps, dim=1)  # [B, T, H]
            out_memory = torch.stack(memory_steps, dim=1)
        else:
            attention = inputs.new_zeros(batch, 0, width)
            out_hidden = out_memory = inputs.new_zeros(batch, 0, h)
        if fresh:
            attention = attention[:, :, 1:]  # drop slot 0: [B, T, T]
        all_tape = torch.cat([old_tape, *(x.unsqueeze(1) for x in tape)], 1)  # [B, P + T, 2H]
        all_keys = torch.cat([old_keys, *(x.unsqueeze(1) for x in keys)], 1)  # [B, P + T, H]
        all_valid = torch.cat([old_valid, *(x.unsqueeze(1) for x in valid)], 1)  # [B, P + T]
        if memory_span is not None and all_tape.shape[1] > memory_span + 1:
            # keep slot 0 (the zero slot, open until the first real step) and the last
            # `memory_span` slots, so slot 0 stays the zero slot in the carried state
            kept = torch.cat(
                [torch.zeros(1, dtype=torch.long), torch.arange(-memory_span, 0) + width]
            ).to(all_tape.device)
            all_tape, all_keys, all_valid = all_tape[:, kept], all_keys[:, kept], all_valid[:, kept]
        final = LSTMNState(
            hidden=all_tape[..., :h],
            memory=all_tape[..., h:],
            keys=all_keys,
            valid=all_valid,
            summary=summary,
        )
        return LSTMNOutput(out_hidden, out_memory, attention, final)


class LSTMN(nn.Module):
    r"""Stacked LSTMN (eq. 10): layer ``k + 1`` reads the outputs ``h^k_t`` of layer ``k``.

    .. math:: a_{i,k+1}^t = v^\top \tanh(W_h h^{k+1}_i + W_l h^k_t
              + W_{\tilde h} \tilde h^{k+1}_{t-1})

    Every layer is an :class:`LSTMNCell` whose ``x_t`` is its input ``u^k_t``: ``u^1_t = x_t``
    and ``u^{k+1}_t = dropout(h^k_t)``, so the attention query term ``W_x u^{k+1}_t`` is the
    paper's ``W_l h^k_t``. With ``skip_connections`` the upper layers read
    ``u^{k+1}_t = [dropout(h^k_t), x_t]`` (input fed to every layer, Graves 2013), so both the
    gates and the attention query see ``x_t`` as well: ``W_x u = W_l h^k_t + W_s x_t``.
    The layers run one after the other over the whole sequence (layer k+1 at step t only
    needs ``h^k_t``), each with the shared ``mask``.

    Args:
        input_size: D.
        hidden_size: H of every layer.
        num_layers: L >= 1.
        dropout: probability of dropout on the outputs of every layer but the last
            (as ``nn.LSTM``; no effect when L = 1).
        skip_connections: also feed ``x_t`` to layers 2..L.

    Shapes: ``inputs`` [B, T, D], ``mask`` [B, T] -> :class:`LSTMNStackOutput` (top layer's
    tapes [B, T, H], attention [B, T, T], every layer's attention [B, L, T, T]).
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        dropout: float = 0.0,
        skip_connections: bool = False,
    ) -> None:
        super().__init__()
        self.input_size = _check_size("input_size", input_size)
        self.hidden_size = _check_size("hidden_size", hidden_size)
        self.num_layers = _check_size("num_layers", num_layers)
        if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must be a float in [0, 1), got {dropout!r}")
        self.skip_connections = bool(skip_connections)
        upper = hidden_size + (input_size if skip_connections else 0)
        self.layers = nn.ModuleList(
            LSTMNCell(input_size if k == 0 else upper, hidden_size) for k in range(num_layers)
        )
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        inputs: Tensor,
        mask: Tensor | None = None,
        state: Sequence[LSTMNState] | None = None,
        memory_span: int | None = None,
    ) -> LSTMNStackOutput:
        """Read a sequence: ``inputs`` [B, T, D], ``mask`` [B, T] (True = real step);
        ``state`` (one :class:`LSTMNState` per layer, bottom first, e.g. the ``final_state``
        of the previous window) and ``memory_span`` as in :meth:`LSTMNCell.forward`.

        Returns:
            :class:`LSTMNStackOutput` (zeros at padded steps; with ``state``, attention over
            the starting slots then this call's, see :meth:`LSTMNCell.forward`).
        """
        inputs = _check_features("inputs", inputs, rank=3, size=self.input_size)
        batch, length, _ = inputs.shape
        mask = check_mask("mask", mask, (batch, length), inputs.device)
        if state is not None and len(state) != self.num_layers:
            raise ValueError(f"`state` must hold {self.num_layers} layer states, got {len(state)}")
        layer_input = inputs
        outputs: list[LSTMNOutput] = []
        for k, cell in enumerate(self.layers):
            if k > 0:
                layer_input = self.dropout(outputs[-1].hidden)  # h^k, [B, T, H]
                if self.skip_connections:
                    layer_input = torch.cat([layer_input, inputs], dim=-1)  # [B, T, H + D]
            start = None if state is None else state[k]
            outputs.append(cell(layer_input, mask, state=start, memory_span=memory_span))
        top = outputs[-1]
        return LSTMNStackOutput(
            hidden=top.hidden,
            memory=top.memory,
            attention=top.attention,
            layer_attention=torch.stack([o.attention for o in outputs], dim=1),  # [B, L, T, T]
            final_state=tuple(o.final_state for o in outputs),
        )


class LSTMNDecoder(nn.Module):
    r"""LSTMN decoder reading a target sequence with intra- and inter-attention (section 4).

    The target is read by an :class:`LSTMNCell` (intra-attention over its own tapes). At every
    step, inter-attention over the source tapes (hidden ``gamma`` and memory ``alpha``, e.g. the
    tapes of an :class:`LSTMN` encoder) gives (eq. 11-13)

    .. math::
        b_j^t &= u^\top \tanh(W_g \gamma_j + W'_x x_t + W_{\tilde g} \tilde g_{t-1}), \quad
        p^t = \mathrm{softmax}_j(b^t) \text{ over real } j \\
        \tilde g_t &= \textstyle\sum_j p_j^t \gamma_j, \quad \tilde a_t = \sum_j p_j^t \alpha_j

    with ``g~_0 = 0``. ``fusion="shallow"``: the inter-attention does not enter the target
    recurrence; ``g~_t`` is returned as ``context`` for the caller to combine with ``h_t``
    (Bahdanau-style attention over an LSTMN decoder). ``fusion="deep"`` (eq. 14-16) writes the
    attended source memory into the target memory through a gate:

    .. math::
        r_t = \sigma(W_r [\tilde g_t, x_t] + b_r), \quad
        c_t = r_t \odot \tilde a_t + f_t \odot \tilde c_t + i_t \odot \hat c_t, \quad
        h_t = o_t \odot \tanh(c_t)

    Args:
        input_size: D, size of the target vectors ``x_t``.
        hidden_size: H, size of the target and of the source tapes.
        fusion: ``"shallow"`` or ``"deep"``.

    Parameters: ``cell`` (:class:`LSTMNCell`), ``inter_source`` ``W_g``, ``inter_input``
    ``W'_x``, ``inter_context`` ``W_g~``, ``inter_score`` ``u`` (no biases); deep fusion adds
    ``fusion_context`` and ``fusion_input`` (``W_r = [fusion_context | fusion_input]``, bias
    ``b_r`` = 0 initially).

    Shapes: ``inputs`` [B, T, D], source tapes [B, S, H], ``mask`` [B, T], ``source_mask``
    [B, S] -> :class:`LSTMNDecoderOutput` (tapes and ``context`` [B, T, H], ``attention``
    [B, T, T], ``source_attention`` [B, T, S]). For step-wise decoding (beam search), call
    :meth:`prepare_source` once, then :meth:`step` from :meth:`initial_state`; every state has
    an ``index_select`` to reorder beams.
    """

    def __init__(self, input_size: int, hidden_size: int, fusion: str = "shallow") -> None:
        super().__init__()
        if fusion not in FUSIONS:
            raise ValueError(f"`fusion` must be one of {FUSIONS}, got {fusion!r}")
        self.fusion = fusion
        self.cell = LSTMNCell(input_size, hidden_size)
        self.input_size, self.hidden_size = input_size, hidden_size
        h = hidden_size
        self.inter_source = nn.Linear(h, h, bias=False)  # W_g
        self.inter_input = nn.Linear(input_size, h, bias=False)  # W'_x
        self.inter_context = nn.Linear(h, h, bias=False)  # W_g~
        self.inter_score = nn.Linear(h, 1, bias=False)  # u
        self.fusion_context: nn.Linear | None = None
        self.fusion_input: nn.Linear | None = None
        if fusion == "deep":
            self.fusion_context = nn.Linear(h, h, bias=False)  # W_r[:, g~]
            self.fusion_input = nn.Linear(input_size, h)  # W_r[:, x] and b_r
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """U(-1/sqrt(H), 1/sqrt(H)) weights (cell: see :class:`LSTMNCell`); ``b_r`` = 0."""
        self.cell.reset_parameters()
        bound = 1.0 / math.sqrt(self.hidden_size)
        for name, p in self.named_parameters():
            if not name.startswith("cell."):
                nn.init.uniform_(p, -bound, bound)
        if self.fusion_input is not None:
            nn.init.zeros_(self.fusion_input.bias)

    def initial_state(
        self,
        batch_size: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> LSTMNDecoderState:
        """State before the first target step: zero slot on the target tapes, ``g~_0 = 0``."""
        intra = self.cell.initial_state(batch_size, device, dtype)
        return LSTMNDecoderState(intra, torch.zeros_like(intra.summary))

    def prepare_source(
        self,
        source_hidden: Tensor,
        source_memory: Tensor | None = None,
        source_mask: Tensor | None = None,
    ) -> LSTMNSource:
        """Validate the source tapes and cache ``W_g gamma_j``.

        Args:
            source_hidden: [B, S, H] source hidden tape gamma.
            source_memory: [B, S, H] source memory tape alpha (required for deep fusion,
                ignored by shallow fusion).
            source_mask: BoolTensor [B, S], True at real source positions; every item needs
                at least one (default: all real).
        """
        h = self.hidden_size
        source_hidden = _check_features("source_hidden", source_hidden, rank=3, size=h)
        batch, length, _ = source_hidden.shape
        if length < 1:
            raise ValueError("`source_hidden` must have at least one position (S >= 1)")
        memory: Tensor | None = None
        if self.fusion == "deep":
            if source_memory is None:
                raise ValueError(
                    "`source_memory` (the source memory tape) is required for deep fusion"
                )
            memory = _check_features("source_memory", source_memory, rank=3, size=h)
            if memory.shape != source_hidden.shape:
                raise ValueError(
                    f"`source_memory` must have the shape of `source_hidden` "
                    f"{tuple(source_hidden.shape)}, got {tuple(memory.shape)}"
                )
        mask = check_mask("source_mask", source_mask, (batch, length), source_hidden.device)
        if source_mask is not None and not bool(mask.any(-1).all()):
            raise ValueError("`source_mask` must leave at least one real source position per item")
        return LSTMNSource(source_hidden, memory, self.inter_source(source_hidden), mask)

    def _step(
        self,
        x_attn: Tensor,
        x_gates: Tensor,
        x_inter: Tensor,
        x_fusion: Tensor | None,
        state: LSTMNDecoderState,
        source: LSTMNSource,
        real: Tensor,
    ) -> tuple[LSTMNDecoderStep, Tensor]:
        """One target step from precomputed input projections; also returns the raw intra
        weights over all N slots [B, N]."""
        # b_j^t = u^T tanh(W_g gamma_j + W'_x x_t + W_g~ g~_{t-1})
        query = x_inter + self.inter_context(state.context)  # [B, H]
        scores = self.inter_score(torch.tanh(source.keys + query.unsqueeze(1))).squeeze(-1)
        scores = scores.masked_fill(~source.mask, float("-inf"))  # [B, S]
        source_weights = torch.softmax(scores, dim=-1)  # p^t [B, S]
        context = torch.bmm(source_weights.unsqueeze(1), source.hidden).squeeze(1)  # g~_t
        extra: Tensor | None = None
        if self.fusion_context is not None and x_fusion is not None:
            if source.memory is None:
                raise ValueError("`source` has no memory tape; deep fusion needs `source_memory`")
            attended = torch.bmm(source_weights.unsqueeze(1), source.memory).squeeze(1)  # a~_t
            gate = torch.sigmoid(x_fusion + self.fusion_context(context))  # r_t [B, H]
            extra = gate * attended
        hidden, memory, weights, intra = self.cell._step(
            x_attn, x_gates, state.intra, real, extra_memory=extra
        )
        keep = real.unsqueeze(-1)  # [B, 1]
        new_state = LSTMNDecoderState(intra, torch.where(keep, context, state.context))
        out = LSTMNDecoderStep(
            hidden=hidden,
            memory=memory,
            attention=weights[:, 1:],
            source_attention=source_weights.masked_fill(~keep, 0.0),
            context=context.masked_fill(~keep, 0.0),
            state=new_state,
        )
        return out, weights

    def _project(self, inputs: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Input projections W_x x, W[:, x] x + b, W'_x x and W_r[:, x] x + b_r."""
        fusion = None if self.fusion_input is None else self.fusion_input(inputs)
        return (
            self.cell.attn_input(inputs),
            self.cell.input_gates(inputs),
            self.inter_input(inputs),
            fusion,
        )

    def step(
        self,
        inputs: Tensor,
        state: LSTMNDecoderState,
        source: LSTMNSource,
        mask: Tensor | None = None,
    ) -> LSTMNDecoderStep:
        """Read one target token ``inputs`` [B, D] given ``state`` and prepared ``source``.

        ``mask`` [B] (False = padded step: outputs 0, state kept). T calls give the same
        results as :meth:`forward` on the sequence.
        """
        inputs = _check_features("inputs", inputs, rank=2, size=self.input_size)
        batch = inputs.shape[0]
        if not isinstance(state, LSTMNDecoderState):
            raise ValueError(f"`state` must be an LSTMNDecoderState, got {type(state).__name__}")
        _check_state(state.intra, batch, self.hidden_size)
        if not isinstance(source, LSTMNSource) or source.hidden.shape[0] != batch:
            raise ValueError(
                f"`source` must be an LSTMNSource (see `prepare_source`) with batch {batch}"
            )
        real = check_mask("mask", mask, (batch,), inputs.device)
        out, _ = self._step(*self._project(inputs), state, source, real)
        return out

    def forward(
        self,
        inputs: Tensor,
        source_hidden: Tensor,
        source_memory: Tensor | None = None,
        mask: Tensor | None = None,
        source_mask: Tensor | None = None,
    ) -> LSTMNDecoderOutput:
        """Read a target sequence conditioned on the source tapes.

        Args:
            inputs: [B, T, D] target vectors ``x_t``.
            source_hidden: [B, S, H] source hidden tape gamma.
            source_memory: [B, S, H] source memory tape alpha (deep fusion only).
            mask: BoolTensor [B, T], True at real target steps.
            source_mask: BoolTensor [B, S], True at real source positions.

        Returns:
            :class:`LSTMNDecoderOutput` (zeros at padded target steps).
        """
        inputs = _check_features("inputs", inputs, rank=3, size=self.input_size)
        batch, length, _ = inputs.shape
        mask = check_mask("mask", mask, (batch, length), inputs.device)
        source = self.prepare_source(source_hidden, source_memory, source_mask)
        if source.hidden.shape[0] != batch:
            raise ValueError(
                f"`source_hidden` has batch {source.hidden.shape[0]}, `inputs` has {batch}"
            )
        x_attn, x_gates, x_inter, x_fusion = self._project(inputs)  # [B, T, *] each
        state = self.initial_state(batch, inputs.device, inputs.dtype)
        rows, source_rows, contexts = [], [], []
        for t in range(length):
            out, weights = self._step(
                x_attn[:, t],
                x_gates[:, t],
                x_inter[:, t],
                None if x_fusion is None else x_fusion[:, t],
                state,
                source,
                mask[:, t],
            )
            state = out.state
            rows.append(F.pad(weights[:, 1:], (0, length - t)))  # [B, T]
            source_rows.append(out.source_attention)  # [B, S]
            contexts.append(out.context)  # [B, H]
        if length:
            attention = torch.stack(rows, dim=1)  # [B, T, T]
            source_attention = torch.stack(source_rows, dim=1)  # [B, T, S]
            context = torch.stack(contexts, dim=1)  # [B, T, H]
        else:
            attention = inputs.new_zeros(batch, 0, 0)
            source_attention = inputs.new_zeros(batch, 0, source.hidden.shape[1])
            context = inputs.new_zeros(batch, 0, self.hidden_size)
        intra = state.intra
        return LSTMNDecoderOutput(
            hidden=intra.hidden[:, 1:],
            memory=intra.memory[:, 1:],
            attention=attention,
            source_attention=source_attention,
            context=context,
            final_state=state,
        )
