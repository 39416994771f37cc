"""Models of the synthetic tasks of Liu, Chen, Liang, Ueda (mean-field CRF attention, sec.
3.1-3.3, Table 1): chunk counting and the pieces that turn :class:`~.seq2seq.Seq2Seq` into
each Table 1 row, plus the hooks that read a trained model's attention back.

- :class:`ElmanRNN`: a tanh RNN with ``nn.LSTM``'s call signature (the ``rnn`` rows);
- :class:`NoAttention`: a zero context (the attention-free rows inside ``Seq2Seq``);
- :func:`mfa_attention`: the attention layer of a Table 1 row;
- :class:`ChunkCounter`: counting as a one-step encoder-decoder;
- :func:`capture_attention_inputs` / :func:`mean_field_trajectory`: the attention's inputs of
  a forward pass, and the mean-field iterates of :class:`MeanFieldAttention` on them
  (Figures 3-4);
- :func:`counting_predictions`, :func:`sorting_scores`: a trained model run over examples
  (in length-sorted chunks, results in input order); :func:`free_energy_check`: Theorem 2
  on a trained MFA model; :func:`figure_batch`: one example as a batch (sorting: teacher-forced
  on the greedy output) with the figure's labels; :func:`attention_probe`: what the figures
  of one example draw.

The row names (``model``) are the recipe's: ``rnn`` | ``lstm`` | ``bilstm`` (no attention),
``attention`` (additive softmax), ``vae`` (variational), ``mfa`` (mean field, k iterations).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..attention import (
    AttentionOutput,
    MeanFieldAttention,
    SoftmaxAttention,
    VariationalAttention,
)
from ..data.batching import length_chunks
from ..data.synthetic import CountingExample, SortingExample, count_chunks
from ..data.synthetic_batches import BOS, EOS, PAD, SyntheticBatch, collate, example_length
from ..structs.mean_field import mean_field_free_energy, mean_field_marginals
from .seq2seq import RecurrentEncoder, Seq2Seq, sequence_nll, source_lengths

__all__ = [
    "AttentionInputs",
    "ChunkCounter",
    "ElmanRNN",
    "NoAttention",
    "attention_probe",
    "capture_attention_inputs",
    "counting_predictions",
    "figure_batch",
    "free_energy_check",
    "mean_field_trajectory",
    "mfa_attention",
    "sorting_scores",
]


class ElmanRNN(nn.Module):
    """A tanh RNN (``nn.RNN``) with ``nn.LSTM``'s call signature: ``(x, (h, c))`` in,
    ``(outputs, (h, zeros))`` out, so that it can stand in for the LSTMs of
    :class:`~structattn.models.RecurrentEncoder` and :class:`~structattn.models.Seq2Seq`
    (the cell state is ignored and returned as zeros; packed sequences work)."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1) -> None:
        super().__init__()
        self.rnn = nn.RNN(input_size, hidden_size, num_layers, batch_first=True)

    def forward(self, x: Any, hx: tuple[Tensor, Tensor] | None = None) -> tuple[Any, Any]:
        outputs, h = self.rnn(x, None if hx is None else hx[0])
        return outputs, (h, torch.zeros_like(h))


class NoAttention(nn.Module):
    """An attention layer that attends to nothing: a zero context and zero weights, for the
    attention-free baselines inside :class:`~structattn.models.Seq2Seq` (no parameters).

    ``forward(query [B, T, Q], memory [B, N, M], mask [B, N])`` -> :class:`AttentionOutput`
    with ``context`` [B, T, M] and ``weights`` = ``marginals`` [B, T, N], all zeros.
    """

    def forward(self, query: Tensor, memory: Tensor, mask: Tensor) -> AttentionOutput:
        context = memory.new_zeros(*query.shape[:-1], memory.shape[-1])  # [B, T, M]
        weights = memory.new_zeros(*query.shape[:-1], memory.shape[1])  # [B, T, N]
        return AttentionOutput(context, weights, weights)


def mfa_attention(
    model: str,
    memory_dim: int,
    query_dim: int,
    attention_dim: int,
    iterations: int = 5,
    kl_weight: float = 1.0,
) -> nn.Module | None:
    """The attention layer of a Table 1 row: ``attention`` -> :class:`SoftmaxAttention`
    (MLP scorer), ``vae`` -> :class:`VariationalAttention` (KL weight ``kl_weight``),
    ``mfa`` -> :class:`MeanFieldAttention` (rank ``attention_dim``, k = ``iterations``);
    None for ``rnn`` / ``lstm`` / ``bilstm``."""
    if model == "attention":
        return SoftmaxAttention(memory_dim, query_dim, "mlp", attention_dim)
    if model == "vae":
        return VariationalAttention(memory_dim, query_dim, "mlp", attention_dim, kl_weight)
    if model == "mfa":
        return MeanFieldAttention(memory_dim, query_dim, attention_dim, iterations)
    return None


class ChunkCounter(nn.Module):
    r"""Chunk counting as a one-step encoder-decoder: embeddings of the bits, a (bi)LSTM or
    RNN encoder h_1..h_N, its last state d as the query,
    ``count = w^T tanh(U [c; d]) + b`` with ``c = attention(d, h).context``
    (``w^T d + b`` without attention).

    ``model`` is the Table 1 row (see :func:`mfa_attention`; ``bilstm`` needs an even
    ``hidden_dim``, half per direction). Bits are ids 1 ("0") and 2 ("1"), 0 is padding.

    ``forward(source [B, N], source_mask [B, N]) -> (counts [B], attention output or None)``.
    """

    def __init__(
        self,
        embedding_dim: int,
        hidden_dim: int,
        model: str = "mfa",
        attention_dim: int = 32,
        iterations: int = 5,
        kl_weight: float = 1.0,
    ) -> None:
        super().__init__()
        dim, hidden = embedding_dim, hidden_dim
        self.embedding = nn.Embedding(3, dim, padding_idx=PAD)
        self.encoder = RecurrentEncoder(dim, hidden, 1, model == "bilstm")
        if model == "rnn":
            self.encoder.lstm = ElmanRNN(dim, hidden)  # type: ignore[assignment]
        self.attention = mfa_attention(model, hidden, hidden, attention_dim, iterations, kl_weight)
        self.combine = nn.Linear(2 * hidden, hidden) if self.attention is not None else None
        self.output = nn.Linear(hidden, 1)

    def forward(self, source: Tensor, source_mask: Tensor) -> tuple[Tensor, Any]:
        lengths = source_lengths(source, source_mask)
        memory, final = self.encoder(self.embedding(source), lengths, True)  # [B, N, H]
        assert final is not None
        query = final[0][:, -1]  # [B, H] last layer's last state (both directions)
        if self.attention is None or self.combine is None:
            return self.output(query).squeeze(-1), None
        out = self.attention(query, memory, source_mask)
        hidden = torch.tanh(self.combine(torch.cat([out.context, query], dim=-1)))  # [B, H]
        return self.output(hidden).squeeze(-1), out

    def penalty(self) -> Tensor:
        """The attention's ``penalty()`` (variational attention's KL), 0 otherwise."""
        penalty = getattr(self.attention, "penalty", None)
        return penalty() if callable(penalty) else self.output.bias.new_zeros(())


class AttentionInputs(NamedTuple):
    """What one call of an attention layer saw."""

    query: Tensor  # [B, Q, Dq] (a [B, Dq] query is given Q = 1)
    memory: Tensor  # [B, N, Dm]
    mask: Tensor  # [B, N]


def capture_attention_inputs(model: nn.Module, *inputs: Tensor) -> list[AttentionInputs]:
    """The inputs of every call of ``model.attention`` during ``model(*inputs)`` (no grad;
    a teacher-forced decoder calls it once per target step)."""
    seen: list[AttentionInputs] = []
    attention = model.attention
    assert isinstance(attention, nn.Module)

    def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
        query = args[0] if args[0].dim() == 3 else args[0].unsqueeze(1)
        seen.append(AttentionInputs(query, args[1], args[2]))

    handle = attention.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        handle.remove()
    return seen


def mean_field_trajectory(
    attention: MeanFieldAttention, inputs: AttentionInputs
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """phi [B, Q, N], J [B, Q, N, N], mask [B, Q, N] and the iterates [k + 1, B, Q, N] of
    ``attention`` on ``inputs`` (the k + 1 mean-field updates, ``return_trajectory``)."""
    unary, coupling = attention.potentials(*inputs)
    b, q, n = unary.shape
    mask = inputs.mask.unsqueeze(1).expand(b, q, n)
    spins = mean_field_marginals(
        unary.reshape(-1, n),  # [B*Q, N]
        coupling.reshape(-1, n, n),  # [B*Q, N, N]
        attention.iterations,
        mask.reshape(-1, n),
        return_trajectory=True,
    )  # [k + 1, B*Q, N]
    return unary, coupling, mask, spins.view(-1, b, q, n)


@torch.no_grad()
def counting_predictions(
    model: nn.Module, examples: Sequence[CountingExample], device: torch.device, max_value: int
) -> list[float]:
    """Predicted counts in order."""
    predicted = [0.0] * len(examples)
    for chunk in length_chunks(examples, 500, example_length):
        batch = collate([examples[i] for i in chunk], device, max_value)
        out, _ = model(batch.source, batch.source_mask)
        for i, p in zip(chunk, out.tolist(), strict=True):
            predicted[i] = p
    return predicted


@torch.no_grad()
def sorting_scores(
    model: nn.Module,
    examples: Sequence[SortingExample],
    device: torch.device,
    max_value: int,
    decode: bool,
) -> tuple[list[float], list[list[int]]]:
    """Per-example target NLL (teacher forcing, nats) and greedy predictions (if ``decode``)."""
    nll = [0.0] * len(examples)
    predicted: list[list[int]] = [[] for _ in examples]
    assert isinstance(model, Seq2Seq)
    for chunk in length_chunks(examples, 200, example_length):
        batch = collate([examples[i] for i in chunk], device, max_value)
        logits = model(batch.source, batch.source_mask, batch.target_in)
        per_token = sequence_nll(logits, batch.target_out, PAD, "none")  # [B, T]
        for i, value in zip(chunk, per_token.sum(-1).tolist(), strict=True):
            nll[i] = value
        if decode:
            beam = model.beam_search(
                batch.source, batch.source_mask, BOS, EOS, 1, batch.source.shape[1]
            )
            for i, tokens in zip(chunk, beam.tokens, strict=True):
                predicted[i] = [t - 3 for t in tokens]
    return nll, predicted


def _capture(model: nn.Module, batch: SyntheticBatch) -> list[AttentionInputs]:
    """The attention's inputs of every call of a teacher-forced forward pass."""
    if batch.target_in.shape[1] == 0:  # counting
        return capture_attention_inputs(model, batch.source, batch.source_mask)
    return capture_attention_inputs(model, batch.source, batch.source_mask, batch.target_in)


@torch.no_grad()
def free_energy_check(
    model: nn.Module,
    examples: Sequence[CountingExample | SortingExample],
    device: torch.device | str = "cpu",
    max_value: int = 99,
    tolerance: float = 1e-4,
) -> dict[str, Any]:
    """Theorem 2 on a trained MFA model: the mean-field free energy F(q^(t)) along the k
    parallel updates of every attention query (teacher-forced). Returns the mean F per
    iteration, the fraction of queries whose F ever rises by more than ``tolerance`` (a
    violation) and the largest rise."""
    model.eval()
    attention = getattr(model, "attention", None)
    if not isinstance(attention, MeanFieldAttention):
        raise ValueError("free_energy_check needs a model with MeanFieldAttention")
    device = torch.device(device)
    totals: Tensor | None = None
    queries, violations, worst = 0, 0, 0.0
    for chunk in length_chunks(examples, 200, example_length):
        batch = collate([examples[i] for i in chunk], device, max_value)
        for captured in _capture(model, batch):
            unary, coupling, mask, spins = mean_field_trajectory(attention, captured)
            n = unary.shape[-1]
            energies = torch.stack(
                [
                    mean_field_free_energy(
                        unary.reshape(-1, n), coupling.reshape(-1, n, n), s.reshape(-1, n),
                        mask.reshape(-1, n),
                    )
                    for s in spins
                ]
            )  # [k + 1, B*Q]  # fmt: skip
            rise = (energies[1:] - energies[:-1]).amax(0) if len(energies) > 1 else None
            totals = energies.sum(1) if totals is None else totals + energies.sum(1)
            queries += energies.shape[1]
            if rise is not None:
                violations += int((rise > tolerance).sum())
                worst = max(worst, float(rise.max()))
    assert totals is not None
    return {
        "free_energy": [float(v) / queries for v in totals],
        "queries": queries,
        "violations": violations / queries,
        "largest_rise": worst,
    }


def figure_batch(
    model: nn.Module, task: str, bits: str, values: Sequence[int], max_value: int
) -> tuple[SyntheticBatch, list[str], list[str]]:
    """The batch of one example of ``task`` (counting: ``bits``; sorting: ``values``,
    teacher-forced on the model's greedy output), the figure's row labels (outputs) and
    column labels (inputs), for :func:`attention_probe`."""
    cpu = torch.device("cpu")
    if task == "counting":
        batch = collate([CountingExample(bits, count_chunks(bits))], cpu, max_value)
        predicted, _ = model(batch.source, batch.source_mask)
        return batch, [f"count {float(predicted[0]):.2f}"], list(bits)
    batch = collate([SortingExample(tuple(values), tuple(sorted(values)))], cpu, max_value)
    assert isinstance(model, Seq2Seq)
    decoded = model.beam_search(batch.source, batch.source_mask, BOS, EOS, 1, len(values))
    target = [t - 3 for t in decoded.tokens[0]]
    # attention along the greedy output (teacher-forced on it)
    batch = batch._replace(
        target_in=torch.tensor([[BOS, *(t + 3 for t in target)]]),
        target_out=torch.tensor([[*(t + 3 for t in target), EOS]]),
    )
    return batch, [*map(str, target), "</s>"], [str(v) for v in values]


@torch.no_grad()
def attention_probe(model: nn.Module, batch: SyntheticBatch) -> dict[str, Tensor]:
    """What Figures 3-4 draw of one example (``batch`` of B = 1; sorting teacher-forced on
    its target): ``weights`` [Q, N], the attention of all Q queries (output steps) at once,
    and for :class:`MeanFieldAttention` also ``iterates`` [k + 1, Q, N], ``couplings`` J
    [Q, N, N] and ``free_energy`` [k + 1, Q], F(q^(t)) of every query."""
    attention = model.attention
    assert isinstance(attention, nn.Module)
    captured = _capture(model, batch)
    query = torch.cat([c.query for c in captured], dim=1)  # [1, Q, D]
    seen = AttentionInputs(query, captured[0].memory, captured[0].mask)
    probe = {"weights": attention(*seen).weights[0]}  # [Q, N]
    if isinstance(attention, MeanFieldAttention):
        unary, coupling, mask, spins = mean_field_trajectory(attention, seen)
        energy = [
            mean_field_free_energy(unary[0], coupling[0], spins[t, 0], mask[0])  # [Q]
            for t in range(spins.shape[0])
        ]
        probe.update(iterates=spins[:, 0], couplings=coupling[0], free_energy=torch.stack(energy))
    return probe
