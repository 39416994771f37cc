"""Batched beam search (and greedy decoding as beam size 1) for any autoregressive model.

The search is written once against a step function::

    log_probs, state = step(tokens, state)
    # tokens    LongTensor [R]   the last token of each of R = B * K hypotheses
    # log_probs Tensor [R, V]    log p(next token | hypothesis)
    # state     whatever the model carries between steps (LSTM states, input feed, ...)

Hypotheses of item b sit in rows ``b * K .. b * K + K - 1``. After every step the rows are
reordered to follow the surviving hypotheses: by default every tensor in ``state`` (a
tensor, or tuples / lists / dicts of tensors, ``None`` allowed) is taken to have the batch
in dim 0 and is indexed with ``index_select(0, rows)``; pass ``reorder(state, rows)`` for any
other layout. Constant per-item tensors (an encoder's memory) are best kept out of the state
and captured by the step function, expanded once to ``B * K`` rows with
``repeat_interleave(K, dim=0)``: rows never move between items, so they need no reordering.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["BeamResult", "StepFunction", "beam_search", "greedy_search", "reorder_batch_first"]

#: ``step(tokens [R], state) -> (log_probs [R, V], state)``
StepFunction = Callable[[Tensor, Any], tuple[Tensor, Any]]


class BeamResult(NamedTuple):
    """Best hypothesis per item: token ids (no BOS/EOS) and total log-probability."""

    tokens: list[list[int]]
    scores: Tensor  # [B] sum of the log-probabilities of the tokens and EOS


def reorder_batch_first(state: Any, rows: Tensor) -> Any:
    """``state`` with every tensor indexed by ``rows`` along dim 0 (tuples, lists, NamedTuples
    and dicts are walked; anything else is returned as it is)."""
    if isinstance(state, Tensor):
        return state.index_select(0, rows)
    if isinstance(state, tuple) and hasattr(state, "_fields"):  # NamedTuple
        return type(state)(*(reorder_batch_first(s, rows) for s in state))
    if isinstance(state, (tuple, list)):
        return type(state)(reorder_batch_first(s, rows) for s in state)
    if isinstance(state, dict):
        return {k: reorder_batch_first(v, rows) for k, v in state.items()}
    return state


def _device_of(state: Any) -> torch.device | None:
    """The device of the first tensor in ``state`` (None if it holds none)."""
    if isinstance(state, Tensor):
        return state.device
    if isinstance(state, dict):
        state = list(state.values())
    if isinstance(state, (tuple, list)):
        for item in state:
            found = _device_of(item)
            if found is not None:
                return found
    return None


def _length_norm(length: int, alpha: float) -> float:
    """GNMT length penalty lp(|Y|) = ((5 + |Y|) / 6) ** alpha (1 for alpha = 0)."""
    return ((5.0 + length) / 6.0) ** alpha


@torch.no_grad()
def beam_search(
    step: StepFunction,
    state: Any,
    batch_size: int,
    bos: int,
    eos: int,
    beam_size: int = 5,
    max_length: int = 200,
    min_length: int = 0,
    length_penalty: float = 0.0,
    reorder: Callable[[Any, Tensor], Any] = reorder_batch_first,
    device: torch.device | str | None = None,
) -> BeamResult:
    r"""Batched beam search over B items with K = ``beam_size`` hypotheses each.

    ``state`` is the initial state of the B items (B rows, expanded here to B * K with
    ``reorder``). Every step scores the K * V continuations of each item, takes the 2K best;
    those among the K best that end in EOS are finished hypotheses, and the K best that do
    not end in EOS stay in the beam (so the beam never shrinks). With ``beam_size=1`` this
    is greedy decoding: stop when the most probable token is EOS.

    Length handling: a hypothesis holds at most ``max_length`` tokens before EOS (EOS is
    forced at step ``max_length``), EOS is not allowed before ``min_length`` tokens, and
    finished hypotheses are ranked by ``score / lp`` with the GNMT penalty
    ``lp = ((5 + |Y|) / 6) ** length_penalty`` (|Y| counts EOS; ``length_penalty >= 0``,
    0 = raw log-probability).

    An item stops once no live hypothesis can still beat its best finished one: scores
    only fall as tokens are added, so a live score s is bounded by ``s / lp(max_length + 1)``
    (for ``length_penalty=0``: by s itself). The search stops when every item has stopped.
    A beam as wide as all sequences (K >= V ** max_length) is an exhaustive search.

    Args:
        step: ``step(tokens [R], state) -> (log_probs [R, V], state)``, R = B * K.
        state: initial state for the B items (batch-first tensors, see ``reorder``).
        batch_size: B. bos, eos: the start and end token ids.
        reorder: ``reorder(state, rows) -> state`` picks rows (LongTensor) of the state.
        device: where the search's own tensors live (default: the first tensor's in
            ``state``, else the CPU).

    Returns:
        :class:`BeamResult`: per item the best finished hypothesis (without BOS and EOS)
        and its raw total log-probability (EOS included).
    """
    if beam_size < 1:
        raise ValueError(f"`beam_size` must be >= 1, got {beam_size}")
    if length_penalty < 0:
        raise ValueError(f"`length_penalty` must be >= 0, got {length_penalty}")
    if max_length < 0 or min_length < 0 or min_length > max_length:
        raise ValueError(
            f"need 0 <= min_length <= max_length, got min_length={min_length}, "
            f"max_length={max_length}"
        )
    batch, k = batch_size, beam_size
    dev = torch.device(device) if device is not None else _device_of(state)
    dev = dev or torch.device("cpu")
    expand = torch.arange(batch, device=dev).repeat_interleave(k)  # [B*K] item of each row
    state = reorder(state, expand)
    last = torch.full((batch * k,), bos, dtype=torch.long, device=dev)
    log_probs, state = step(last, state)  # [B*K, V]; the search follows its dtype
    vocab, dtype, minus_inf = log_probs.shape[-1], log_probs.dtype, float("-inf")
    scores = torch.full((batch, k), minus_inf, device=dev, dtype=dtype)
    scores[:, 0] = 0.0  # one live hypothesis (BOS) per item to start with
    tokens = torch.full((batch, k, max_length + 1), eos, dtype=torch.long, device=dev)
    best_norm = torch.full((batch,), minus_inf, device=dev, dtype=dtype)  # score / lp
    best_score = best_norm.clone()
    best_tokens = torch.full((batch, max_length + 1), eos, dtype=torch.long, device=dev)
    done = torch.zeros(batch, dtype=torch.bool, device=dev)
    offsets = (torch.arange(batch, device=dev) * k).unsqueeze(-1)  # [B, 1] first row of item
    bound_scale = _length_norm(max_length + 1, length_penalty)
    for t in range(max_length + 1):
        if t > 0:
            log_probs, state = step(last, state)
        log_probs = log_probs.view(batch, k, vocab)
        if t < min_length:  # too short to end
            log_probs = log_probs.index_fill(-1, torch.tensor([eos], device=dev), minus_inf)
        if t == max_length:  # out of room: only EOS
            only_eos = torch.full_like(log_probs, minus_inf)
            only_eos[..., eos] = 0.0
            log_probs = log_probs + only_eos
        candidates = scores.unsqueeze(-1) + log_probs  # [B, K, V]
        width = min(2 * k, k * vocab)
        top, index = candidates.view(batch, -1).topk(width, dim=-1)  # [B, 2K] best first
        beam, token = index // vocab, index % vocab  # [B, 2K] source hypothesis, new token
        is_eos = token == eos

        # finished: EOS among the K best (finite) candidates of items still searching
        ended = is_eos & torch.isfinite(top) & ~done.unsqueeze(-1)
        ended[:, k:] = False
        norm = top / _length_norm(t + 1, length_penalty)
        ended_norm = norm.masked_fill(~ended, minus_inf)
        candidate, which = ended_norm.max(-1)  # [B] best hypothesis ending now
        better = candidate > best_norm
        best_norm = torch.where(better, candidate, best_norm)
        best_score = torch.where(better, top.gather(1, which.unsqueeze(-1)).squeeze(-1), best_score)
        ended_from = beam.gather(1, which.unsqueeze(-1)).squeeze(-1)  # [B]
        history = tokens[torch.arange(batch, device=dev), ended_from]  # [B, L]
        history[:, t] = eos
        best_tokens = torch.where(better.unsqueeze(-1), history, best_tokens)

        # the beam: the K best candidates that do not end in EOS (sorted, so topk keeps order)
        live = top.masked_fill(is_eos, minus_inf)
        live, pick = live.topk(k, dim=-1)  # [B, K]
        beam, token = beam.gather(1, pick), token.gather(1, pick)
        tokens = tokens.gather(1, beam.unsqueeze(-1).expand_as(tokens)).clone()
        tokens[:, :, t] = token
        # an item stops when its best live hypothesis cannot beat its best finished one
        done = done | (best_norm >= live[:, 0] / bound_scale) | ~torch.isfinite(live[:, 0])
        scores = live.masked_fill(done.unsqueeze(-1), minus_inf)
        if bool(done.all()):  # one host sync per step
            break
        rows = (offsets + beam).view(-1)  # [B*K] rows of the surviving hypotheses
        state = reorder(state, rows)
        last = token.reshape(-1)
    out = []
    for row in best_tokens.tolist():  # one transfer at the end
        out.append(row[: row.index(eos)] if eos in row else row)
    return BeamResult(out, best_score)


def greedy_search(
    step: StepFunction,
    state: Any,
    batch_size: int,
    bos: int,
    eos: int,
    max_length: int = 200,
    min_length: int = 0,
    reorder: Callable[[Any, Tensor], Any] = reorder_batch_first,
) -> BeamResult:
    """Greedy decoding: :func:`beam_search` with ``beam_size=1``."""
    return beam_search(step, state, batch_size, bos, eos, 1, max_length, min_length, 0.0, reorder)
