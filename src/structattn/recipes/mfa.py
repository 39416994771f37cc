"""Recipe: mean-field CRF attention (Liu, Chen, Liang, Ueda; sec. 3.1-3.3, Table 1, Figures 1-4).

Tasks (``task``):

- ``counting`` (sec. 3.1): a binary string -> the number of chunks of ones (a real number,
  MSE); train on lengths 10-30, test on every length 1-100.
- ``sorting`` (sec. 3.2): integers in ``[0, max_value]`` -> the sorted sequence with an
  encoder-decoder; train on lengths 5-15, test on every length 1-25. Reported: the
  teacher-forced NLL of the target per sequence (nats, summed over its tokens and EOS; a
  positive number, lower is better: the paper's sign convention cannot be recovered), the
  NLL per token, and the exact-match accuracy of greedy decoding.

Models (``model``, Table 1 rows): ``rnn`` (tanh RNN encoder and decoder), ``lstm``,
``bilstm`` (bidirectional encoder), ``attention`` (LSTM with Bahdanau's additive softmax
attention), ``vae`` (variational attention, :class:`~structattn.attention.VariationalAttention`)
and ``mfa`` (:class:`~structattn.attention.MeanFieldAttention` with ``iterations`` = k;
k = 0 is sigmoid attention). ``mfaK`` is shorthand for ``model="mfa", iterations=K``.

Counting uses one query: the encoder's last state d (Algorithm 2 with a one-step output),
``count = w^T tanh(U [c; d]) + b`` with c the attention's context (``w^T d + b`` without
attention). Sorting is :class:`~structattn.models.Seq2Seq` (one-layer LSTM encoder and
decoder, input feeding, decoder started from the encoder's last state) with the model's
decoder attention.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor, nn

from ..attention import (
    AttentionOutput,
    MeanFieldAttention,
    SoftmaxAttention,
    VariationalAttention,
)
from ..data.synthetic import (
    CountingExample,
    SortingExample,
    counting_examples,
    read_counting,
    read_sorting,
    sorting_examples,
    write_examples,
)
from ..models import RecurrentEncoder, Seq2Seq, Seq2SeqConfig
from ..models.seq2seq import sequence_nll, source_lengths
from ..structs.mean_field import mean_field_free_energy, mean_field_marginals
from ..training import Task, TrainConfig, fit, load_model_state
from . import runs
from .base import GridAxis, Preset, Recipe, Reporting, Tools
from .config import config_from_dict, config_to_dict

__all__ = [
    "MODELS",
    "PAPER_TABLE1",
    "TABLE_MODELS",
    "TASKS",
    "ChunkCounter",
    "ElmanRNN",
    "MFAConfig",
    "build_model",
    "evaluate",
    "free_energy_check",
    "load_data",
    "load_trained",
    "score",
    "train",
    "visualize",
]

TASKS = ("counting", "sorting")
MODELS = ("rnn", "lstm", "bilstm", "attention", "vae", "mfa")
#: Table 1's rows (and the k = 0 ablation) as ``model`` values
TABLE_MODELS = ("rnn", "lstm", "bilstm", "attention", "vae", "mfa0", "mfa1", "mfa5")
MODEL_NAMES = {
    "rnn": "RNN",
    "lstm": "LSTM",
    "bilstm": "Bidirectional LSTM",
    "attention": "LSTM with Attention",
    "vae": "VAE Attention",
    "mfa0": "MFA_0 (sigmoid)",
    "mfa1": "MFA_1",
    "mfa5": "MFA_5",
}
#: Table 1 of the paper: model -> (counting MSE, sorting "NLL" as printed)
PAPER_TABLE1: dict[str, tuple[float | None, float | None]] = {
    "rnn": (720.32, -2.34),
    "lstm": (145.30, -9.13),
    "bilstm": (215.91, -8.53),
    "attention": (None, -18.43),
    "vae": (198.23, -8.44),
    "mfa1": (106.62, -20.76),
    "mfa5": (76.13, -25.12),
}
#: the task's (train lengths, longest test length) when the config leaves them at 0
TASK_LENGTHS = {"counting": (10, 30, 100), "sorting": (5, 15, 25)}
PAD, BOS, EOS = 0, 1, 2  # token ids; counting bits are 1 ("0") and 2 ("1"), sorting v -> v + 3

PAPER_TRAIN = TrainConfig(
    epochs=10, lr=1e-3, optimizer="adam", max_grad_norm=5.0, log_every=200, normalize_by="examples"
)


@dataclass(frozen=True)
class MFAConfig:
    """Settings of the mean-field attention experiments (the paper gives the data; the model
    sizes and optimisation are ours, see docs/results/mfa.md)."""

    task: str = "sorting"  # counting | sorting
    model: str = "mfa"  # rnn | lstm | bilstm | attention | vae | mfa ("mfaK": iterations = K)
    iterations: int = 5  # k: mean-field iterations of "mfa" (0 = sigmoid attention)
    embedding_dim: int = 32  # token embeddings (bits or integers)
    hidden_dim: int = 64  # encoder outputs and decoder LSTM (bilstm: half per direction)
    attention_dim: int = 32  # hidden size of the attention MLPs and rank r of J (mfa)
    kl_weight: float = 1.0  # vae: weight of KL(q(c) || N(mean memory, I)) in the loss
    max_value: int = 99  # sorting: integers drawn uniformly from [0, max_value]
    train_size: int = 100_000  # training examples (paper: about 100,000 for counting)
    valid_size: int = 1000  # validation examples (training lengths)
    test_per_length: int = 100  # test examples per length
    min_length: int = 0  # shortest training input (0 = the task's: counting 10, sorting 5)
    max_length: int = 0  # longest training input (0 = counting 30, sorting 15)
    test_max_length: int = 0  # test lengths 1..this (0 = counting 100, sorting 25)
    batch_size: int = 64  # examples per batch (bucketed by length)
    data_dir: str = ""  # directory with train/valid/test.tsv (`structattn data mfa`); "" = generate
    data_seed: int = 0  # seed of the generated data
    runs: int = 3  # seeded runs per cell (train.seed, train.seed + 1, ...)
    train: TrainConfig = field(default_factory=lambda: PAPER_TRAIN)  # optimisation

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"`task` must be one of {TASKS}, got {self.task!r}")
        model = self.model
        if model.startswith("mfa") and model[3:].isdigit():  # shorthand: mfaK
            object.__setattr__(self, "model", "mfa")
            object.__setattr__(self, "iterations", int(model[3:]))
        if self.model not in MODELS:
            raise ValueError(f"`model` must be one of {MODELS} or mfaK, got {model!r}")
        if self.iterations < 0:
            raise ValueError(f"`iterations` must be >= 0, got {self.iterations}")
        for name in ("embedding_dim", "hidden_dim", "attention_dim", "batch_size", "runs",
                     "train_size", "valid_size", "test_per_length"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if self.model == "bilstm" and self.hidden_dim % 2:
            raise ValueError("`bilstm` needs an even hidden_dim")
        if self.max_value < 0 or self.kl_weight < 0:
            raise ValueError("`max_value` and `kl_weight` must be >= 0")
        lo, hi, _ = self.lengths
        if not 1 <= lo <= hi:
            raise ValueError(f"need 1 <= min_length <= max_length, got {lo}, {hi}")
        if not isinstance(self.train, TrainConfig):
            raise ValueError(f"`train` must be a TrainConfig, got {type(self.train).__name__}")

    @property
    def lengths(self) -> tuple[int, int, int]:
        """(shortest, longest training input, longest test input)."""
        lo, hi, test = TASK_LENGTHS[self.task]
        return (self.min_length or lo, self.max_length or hi, self.test_max_length or test)

    @property
    def name(self) -> str:
        """The model's Table 1 name: rnn, ..., vae, mfaK."""
        return f"mfa{self.iterations}" if self.model == "mfa" else self.model


Example = CountingExample | SortingExample


class Batch(NamedTuple):
    source: Tensor  # [B, N] ids (padding 0 at the end)
    source_mask: Tensor  # [B, N] True at real positions
    target_in: Tensor  # [B, T] BOS + sorted ids (sorting; [B, 0] for counting)
    target_out: Tensor  # [B, T] sorted ids + EOS, 0 = padding (sorting)
    counts: Tensor  # [B] float chunk counts (counting; zeros for sorting)


# ---- data ---------------------------------------------------------------------------------
def load_data(config: MFAConfig) -> dict[str, list[Any]]:
    """Train/valid/test examples: read from ``data_dir`` (train/valid/test.tsv) or generated
    from ``data_seed`` (every test length ``test_per_length`` times)."""
    reader = read_counting if config.task == "counting" else read_sorting
    if config.data_dir:
        root = Path(config.data_dir)
        missing = [s for s in ("train", "valid", "test") if not (root / f"{s}.tsv").exists()]
        if missing:
            raise FileNotFoundError(f"{root} has no {', '.join(s + '.tsv' for s in missing)}")
        return {s: list(reader(root / f"{s}.tsv")) for s in ("train", "valid", "test")}
    lo, hi, top = config.lengths
    train_lengths, test_lengths = range(lo, hi + 1), range(1, top + 1)
    seed = config.data_seed
    if config.task == "counting":
        return {
            "train": list(counting_examples(config.train_size, train_lengths, seed, "train")),
            "valid": list(counting_examples(config.valid_size, train_lengths, seed, "valid")),
            "test": list(counting_examples(0, test_lengths, seed, "test", config.test_per_length)),
        }
    m = config.max_value
    return {
        "train": list(sorting_examples(config.train_size, train_lengths, seed, "train", m)),
        "valid": list(sorting_examples(config.valid_size, train_lengths, seed, "valid", m)),
        "test": list(sorting_examples(0, test_lengths, seed, "test", m, config.test_per_length)),
    }


def _length(example: Example) -> int:
    return len(example.bits) if isinstance(example, CountingExample) else len(example.values)


def collate(examples: Sequence[Example], device: torch.device, max_value: int) -> Batch:
    """Pad examples into a :class:`Batch` (sorting values above ``max_value`` are an error)."""
    n = max(map(_length, examples))
    source = torch.zeros(len(examples), n, dtype=torch.long)
    count = torch.zeros(len(examples))
    sorting = isinstance(examples[0], SortingExample)
    t = n + 1 if sorting else 0
    target_in = torch.zeros(len(examples), t, dtype=torch.long)
    target_out = torch.zeros(len(examples), t, dtype=torch.long)
    for i, ex in enumerate(examples):
        if isinstance(ex, CountingExample):
            source[i, : len(ex.bits)] = torch.tensor([1 + int(c) for c in ex.bits])
            count[i] = ex.count
        else:
            if max(ex.values) > max_value:
                raise ValueError(f"value {max(ex.values)} is above max_value={max_value}")
            k = len(ex.values)
            source[i, :k] = torch.tensor(ex.values) + 3
            target_in[i, : k + 1] = torch.tensor([BOS, *(v + 3 for v in ex.target)])
            target_out[i, : k + 1] = torch.tensor([*(v + 3 for v in ex.target), EOS])
    return Batch(
        source.to(device),
        (source != PAD).to(device),
        target_in.to(device),
        target_out.to(device),
        count.to(device),
    )


def batches_for_epoch(
    examples: Sequence[Example], batch_size: int, seed: int, epoch: int
) -> list[list[Example]]:
    """Length-bucketed batches in a random order fixed by (seed, epoch)."""
    rng = random.Random(seed * 100_003 + epoch)
    order = sorted(range(len(examples)), key=lambda i: (_length(examples[i]), rng.random()))
    batches = [
        [examples[i] for i in order[s : s + batch_size]] for s in range(0, len(order), batch_size)
    ]
    rng.shuffle(batches)
    return batches


def _in_length_order(examples: Sequence[Example], size: int) -> list[list[int]]:
    """Indices of ``examples`` in chunks of ``size`` of similar lengths (evaluation)."""
    order = sorted(range(len(examples)), key=lambda i: _length(examples[i]))
    return [order[s : s + size] for s in range(0, len(order), size)]


# ---- models -------------------------------------------------------------------------------
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


class _NoAttention(nn.Module):
    """A zero context (the attention-free baselines inside :class:`Seq2Seq`)."""

    def forward(self, query: Tensor, memory: Tensor, mask: Tensor) -> AttentionOutput:
        context = memory.new_zeros(*query.shape[:-1], memory.shape[-1])  # [B, T, M]
        weights = memory.new_zeros(*query.shape[:-1], memory.shape[1])  # [B, T, N]
        return AttentionOutput(context, weights, weights)


def make_attention(config: MFAConfig, memory_dim: int, query_dim: int) -> nn.Module | None:
    """The model's attention layer (None for rnn / lstm / bilstm)."""
    if config.model == "attention":
        return SoftmaxAttention(memory_dim, query_dim, "mlp", config.attention_dim)
    if config.model == "vae":
        return VariationalAttention(
            memory_dim, query_dim, "mlp", config.attention_dim, config.kl_weight
        )
    if config.model == "mfa":
        return MeanFieldAttention(memory_dim, query_dim, config.attention_dim, config.iterations)
    return None


class ChunkCounter(nn.Module):
    r"""Chunk counting as a one-step encoder-decoder: embeddings of the bits, a (bi)LSTM or
    RNN encoder h_1..h_N, its last state d as the query,
    ``count = w^T tanh(U [c; d]) + b`` with ``c = attention(d, h).context``
    (``w^T d + b`` without attention).

    ``forward(source [B, N], source_mask [B, N]) -> (counts [B], attention output or None)``.
    """

    def __init__(self, config: MFAConfig) -> None:
        super().__init__()
        dim, hidden = config.embedding_dim, config.hidden_dim
        self.embedding = nn.Embedding(3, dim, padding_idx=PAD)
        self.encoder = RecurrentEncoder(dim, hidden, 1, config.model == "bilstm")
        if config.model == "rnn":
            self.encoder.lstm = ElmanRNN(dim, hidden)  # type: ignore[assignment]
        self.attention = make_attention(config, hidden, hidden)
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


def build_model(config: MFAConfig) -> nn.Module:
    """The model of ``config`` (seeded with ``train.seed``)."""
    torch.manual_seed(config.train.seed)
    if config.task == "counting":
        return ChunkCounter(config)
    dim, hidden = config.embedding_dim, config.hidden_dim
    seq = Seq2SeqConfig(
        source_vocab_size=config.max_value + 4,
        embedding_dim=dim,
        hidden_dim=hidden,
        encoder_layers=1,
        bidirectional=config.model == "bilstm",
        decoder_layers=1,
        input_feeding=True,
        init_decoder="final",
        dropout=0.0,
        share_embeddings=True,
        padding_idx=PAD,
    )
    attention = make_attention(config, hidden, hidden) or _NoAttention()
    model = Seq2Seq(seq, attention)
    if config.model == "rnn":
        assert model.encoder is not None
        model.encoder.lstm = ElmanRNN(dim, hidden)  # type: ignore[assignment]
        model.decoder = ElmanRNN(dim + hidden, hidden)  # type: ignore[assignment]
    return model


def _penalty(model: nn.Module) -> Tensor:
    """The model's ``penalty()`` (variational attention's KL; 0 for the others)."""
    return cast(Tensor, model.penalty())  # type: ignore[operator]


def batch_loss(model: nn.Module, batch: Batch) -> tuple[Tensor, int, int]:
    """Summed loss of a batch (squared error, or the target NLL), examples, tokens; plus the
    attention's penalty (variational attention's KL)."""
    n = batch.source.shape[0]
    if batch.target_in.shape[1] == 0:  # counting
        predicted, _ = model(batch.source, batch.source_mask)
        return (predicted - batch.counts).pow(2).sum() + _penalty(model), n, n
    logits = model(batch.source, batch.source_mask, batch.target_in)  # [B, T, V]
    nll = sequence_nll(logits, batch.target_out, PAD, "sum") + _penalty(model)
    return nll, n, int((batch.target_out != PAD).sum())


# ---- evaluation ---------------------------------------------------------------------------
@torch.no_grad()
def _counting_scores(
    model: nn.Module, examples: Sequence[CountingExample], device: torch.device, max_value: int
) -> list[float]:
    """Predicted counts in order."""
    predicted = [0.0] * len(examples)
    for chunk in _in_length_order(examples, 500):
        batch = collate([examples[i] for i in chunk], device, max_value)
        out, _ = model(batch.source, batch.source_mask)
        for i, p in zip(chunk, out.tolist(), strict=True):
            predicted[i] = p
    return predicted


@torch.no_grad()
def _sorting_scores(
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
    for chunk in _in_length_order(examples, 200):
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


def _mean(values: Sequence[float]) -> float:
    return sum(values) / max(len(values), 1)


def validate(
    model: nn.Module, examples: Sequence[Example], device: torch.device, max_value: int
) -> dict[str, float]:
    """Validation: counting MSE, or sorting NLL per sequence (``metric`` = minus it)."""
    model.eval()
    if isinstance(examples[0], CountingExample):
        counting = [e for e in examples if isinstance(e, CountingExample)]
        predicted = _counting_scores(model, counting, device, max_value)
        mse = _mean([(p - e.count) ** 2 for p, e in zip(predicted, counting, strict=True)])
        return {"metric": -mse, "mse": mse}
    sorting = [e for e in examples if isinstance(e, SortingExample)]
    nll, _ = _sorting_scores(model, sorting, device, max_value, decode=False)
    return {"metric": -_mean(nll), "nll": _mean(nll)}


def evaluate(
    model: nn.Module,
    examples: Sequence[Example],
    device: torch.device | str = "cpu",
    max_value: int = 99,
    predictions: str | Path | None = None,
) -> dict[str, Any]:
    """Test scores, overall and per input length: counting ``mse``; sorting ``nll`` (per
    sequence), ``token_nll`` and ``accuracy`` (% exact match, greedy decoding). Writes one
    JSON line per example to ``predictions``."""
    device = torch.device(device)
    model.eval()
    by_length: dict[int, list[float]] = defaultdict(list)
    records: list[dict[str, Any]] = []
    if isinstance(examples[0], CountingExample):
        counting = [e for e in examples if isinstance(e, CountingExample)]
        predicted = _counting_scores(model, counting, device, max_value)
        for i, (ex, p) in enumerate(zip(counting, predicted, strict=True)):
            by_length[len(ex.bits)].append((p - ex.count) ** 2)
            records.append({"index": i, "input": ex.bits, "target": ex.count, "predicted": p})
        errors = [v for vs in by_length.values() for v in vs]
        scores: dict[str, Any] = {
            "mse": _mean(errors),
            "per_length": {n: _mean(v) for n, v in sorted(by_length.items())},
        }
    else:
        sorting = [e for e in examples if isinstance(e, SortingExample)]
        nll, decoded = _sorting_scores(model, sorting, device, max_value, decode=True)
        correct: dict[int, list[float]] = defaultdict(list)
        for i, (sx, value, out) in enumerate(zip(sorting, nll, decoded, strict=True)):
            by_length[len(sx.values)].append(value)
            correct[len(sx.values)].append(100.0 * (tuple(out) == sx.target))
            records.append(
                {"index": i, "input": list(sx.values), "target": list(sx.target),
                 "predicted": out, "nll": value}
            )  # fmt: skip
        tokens = sum(len(e.values) + 1 for e in sorting)
        scores = {
            "nll": _mean(nll),
            "token_nll": sum(nll) / tokens,
            "accuracy": _mean([v for vs in correct.values() for v in vs]),
            "per_length": {n: _mean(v) for n, v in sorted(by_length.items())},
            "accuracy_per_length": {n: _mean(v) for n, v in sorted(correct.items())},
            "decoding": "greedy",
        }
    scores["examples"] = len(examples)
    if predictions is not None:
        runs.write_jsonl(predictions, records)
    return scores


class _Captured(NamedTuple):
    query: Tensor  # [B, Q, Dq]
    memory: Tensor  # [B, N, Dm]
    mask: Tensor  # [B, N]


def _capture(model: nn.Module, batch: Batch) -> list[_Captured]:
    """The attention's inputs of every call of a teacher-forced forward pass."""
    seen: list[_Captured] = []
    attention = model.attention
    assert isinstance(attention, nn.Module)

    def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
        query = args[0] if args[0].dim() == 3 else args[0].unsqueeze(1)
        seen.append(_Captured(query, args[1], args[2]))

    handle = attention.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            if batch.target_in.shape[1] == 0:
                model(batch.source, batch.source_mask)
            else:
                model(batch.source, batch.source_mask, batch.target_in)
    finally:
        handle.remove()
    return seen


def _trajectory(
    attention: MeanFieldAttention, captured: _Captured
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """phi [B, Q, N], J [B, Q, N, N], mask [B, Q, N] and the iterates [k + 1, B, Q, N]."""
    unary, coupling = attention.potentials(*captured)
    b, q, n = unary.shape
    mask = captured.mask.unsqueeze(1).expand(b, q, n)
    spins = mean_field_marginals(
        unary.reshape(-1, n),  # [B*Q, N]
        coupling.reshape(-1, n, n),  # [B*Q, N, N]
        attention.iterations,
        mask.reshape(-1, n),
        return_trajectory=True,
    )  # [k + 1, B*Q, N]
    return unary, coupling, mask, spins.view(-1, b, q, n)


@torch.no_grad()
def free_energy_check(
    model: nn.Module,
    examples: Sequence[Example],
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
    for chunk in _in_length_order(examples, 200):
        batch = collate([examples[i] for i in chunk], device, max_value)
        for captured in _capture(model, batch):
            unary, coupling, mask, spins = _trajectory(attention, captured)
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


# ---- train / load / score -----------------------------------------------------------------
def train(config: MFAConfig, run_dir: str | Path, resume: bool = False) -> dict[str, Any]:
    """Train one model into ``run_dir`` (``fit``'s files); returns fit's summary."""
    splits = load_data(config)
    device = torch.device(config.train.device)
    model = build_model(config)
    task = Task(
        model=model,
        batches=lambda epoch: batches_for_epoch(
            splits["train"], config.batch_size, config.train.seed, epoch
        ),
        collate=lambda examples, dev: collate(examples, dev, config.max_value),
        loss=batch_loss,
        validate=lambda m: validate(m, splits["valid"], device, config.max_value),
        config={"recipe": "mfa", **config_to_dict(config)},
    )
    name = config.train.name or f"{config.task} {config.name}"
    return fit(task, replace(config.train, name=name), run_dir, resume=resume)


def load_trained(run_dir: str | Path, device: str = "cpu") -> tuple[nn.Module, MFAConfig]:
    """The best model of a run directory and its config."""
    state = load_model_state(run_dir)
    saved = dict(state["config"])
    if saved.pop("recipe", None) != "mfa":
        raise ValueError(f"{run_dir} is not an mfa run")
    config = config_from_dict(MFAConfig, saved)
    model = build_model(config)
    model.load_state_dict(state["model"])
    return model.to(device).eval(), config


def score(config: MFAConfig, run_dir: str | Path) -> dict[str, Any]:
    """Validation scores of the best epoch and the test scores (``test_predictions.jsonl``);
    for MFA with k >= 1 also the free-energy check on the test set."""
    run_dir = Path(run_dir)
    model, _ = load_trained(run_dir, config.train.device)
    valid = dict(load_model_state(run_dir)["valid"])
    test = load_data(config)["test"]
    device = config.train.device
    scores = evaluate(model, test, device, config.max_value, run_dir / "test_predictions.jsonl")
    if config.model == "mfa" and config.iterations > 0:
        scores["free_energy"] = free_energy_check(model, test, device, config.max_value)
    return {"valid": valid, "test": scores}


def _select(record: Mapping[str, Any]) -> float:
    return float(record.get("valid", {}).get("metric", -math.inf))


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def _summarize(config: MFAConfig, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The best run on validation, and mean / spread over the runs of each test score and
    of the per-length curve."""
    keys = ("mse",) if config.task == "counting" else ("nll", "token_nll", "accuracy")
    per_length: dict[int, list[float]] = defaultdict(list)
    for r in records:
        for n, v in r["test"]["per_length"].items():
            per_length[int(n)].append(v)
    best = records[0]["test"]
    summary: dict[str, Any] = {
        "task": config.task,
        "model": config.name,
        "test": {k: best[k] for k in keys},
        "runs_spread": {k: _spread([r["test"][k] for r in records]) for k in keys},
        "per_length": {n: statistics.fmean(v) for n, v in sorted(per_length.items())},
        "valid": records[0].get("valid"),
    }
    if "free_energy" in best:
        summary["free_energy"] = best["free_energy"]
    return summary


# ---- tables and plots -----------------------------------------------------------------------
def _fmt(spread: Mapping[str, float] | None, digits: int = 2) -> str:
    if not spread:
        return "-"
    return f"{spread['mean']:.{digits}f} ± {spread['std']:.{digits}f}"


def format_table(results: Mapping[tuple[Any, ...], Mapping[str, Any]]) -> str:
    """Table 1: per model, counting MSE and sorting NLL / accuracy (mean ± std over runs)
    beside the paper's numbers."""
    cells: dict[tuple[str, str], Mapping[str, Any]] = {}
    for summary in results.values():
        cells[(summary["task"], summary["model"])] = summary
    models = [m for m in TABLE_MODELS if any(k[1] == m for k in cells)]
    models += sorted({k[1] for k in cells} - set(models))
    header = ["Model", "Counting MSE (ours)", "(paper)", "Sorting NLL/seq (ours)",
              "Sorting exact % (ours)", "(paper)", "runs"]  # fmt: skip
    rows = []
    for m in models:
        count, sort = cells.get(("counting", m)), cells.get(("sorting", m))
        paper = PAPER_TABLE1.get(m, (None, None))
        spread_c = count["runs_spread"] if count else {}
        spread_s = sort["runs_spread"] if sort else {}
        n_runs = "/".join(str(c["runs"]) if c else "-" for c in (count, sort))
        rows.append(
            [
                MODEL_NAMES.get(m, m),
                _fmt(spread_c.get("mse")),
                "-" if paper[0] is None else f"{paper[0]:.2f}",
                _fmt(spread_s.get("nll"), 3),
                _fmt(spread_s.get("accuracy"), 1),
                "-" if paper[1] is None else f"{paper[1]:.2f}",
                n_runs,
            ]
        )
    return runs.markdown_table(header, rows)


def _plots(results: Mapping[tuple[Any, ...], Mapping[str, Any]], out: Path) -> list[Path]:
    """Figure 1: the test metric against the input length, one line per model and task."""
    from ..viz import line_curves

    written = []
    for task, ylabel in (("counting", "test MSE"), ("sorting", "test NLL per sequence")):
        series = {
            MODEL_NAMES.get(s["model"], s["model"]): {int(n): v for n, v in s["per_length"].items()}
            for s in results.values()
            if s["task"] == task
        }
        if series:
            path = out / f"figure1_{task}.png"
            title = f"{task}: test error vs input length (mean over runs)"
            written.append(line_curves(series, path, "input length", ylabel, title, log_y=True))
    return written


# ---- figures of one run ---------------------------------------------------------------------
SAMPLE_BITS = "0011011100101101"
SAMPLE_VALUES = (2, 9, 11, 1, 17)  # the paper's Figure 2 example


def _run_dirs(checkpoint: Path) -> list[Path]:
    """Run directories under ``checkpoint``: a run, a cell (its best run) or a reproduce
    directory (the best run of each of its cells)."""
    try:
        return [runs.resolve_run(RECIPE, checkpoint)]
    except FileNotFoundError:
        pass
    cells = sorted(p.parent for p in checkpoint.glob("**/summary.json"))
    found = [runs.resolve_run(RECIPE, c) for c in cells]
    if not found:
        raise FileNotFoundError(f"no trained mfa model under {checkpoint}")
    return found


def visualize(
    checkpoint: str | Path,
    out_dir: str | Path | None = None,
    bits: str = SAMPLE_BITS,
    values: Sequence[int] | None = None,
) -> list[Path]:
    """Figures 3 and 4 and sec. 3.3 for every model under ``checkpoint``: its attention on
    one example (counting: ``bits``; sorting: ``values``, greedy-decoded; default the
    paper's [2, 9, 11, 1, 17], or a seeded sequence of 5 when it exceeds ``max_value``),
    for MFA also the attention after iteration 1, the interaction map J with its maximum
    spanning tree for every output step and the free energy per iteration. Returns the
    files written."""
    from .. import viz

    root = Path(checkpoint)
    out = Path(out_dir) if out_dir else (root if root.is_dir() else root.parent)
    written: list[Path] = []
    for run_dir in _run_dirs(root):
        model, config = load_trained(run_dir)
        attention = getattr(model, "attention", None)
        if attention is None or isinstance(attention, _NoAttention):
            continue
        tag = f"{config.task}_{config.name}"
        if config.task == "counting":
            example: Example = CountingExample(bits, sum(
                1 for i, c in enumerate(bits) if c == "1" and (i == 0 or bits[i - 1] == "0")
            ))  # fmt: skip
            batch = collate([example], torch.device("cpu"), config.max_value)
            predicted, _ = model(batch.source, batch.source_mask)
            rows = [f"count {float(predicted[0]):.2f}"]
            columns = list(bits)
        else:
            if values is None:
                values = SAMPLE_VALUES
                if max(values) > config.max_value:
                    values = sorting_examples(1, [5], 0, "viz", config.max_value)[0].values
            ex = SortingExample(tuple(values), tuple(sorted(values)))
            batch = collate([ex], torch.device("cpu"), config.max_value)
            assert isinstance(model, Seq2Seq)
            decoded = model.beam_search(batch.source, batch.source_mask, BOS, EOS, 1, len(values))
            target = [t - 3 for t in decoded.tokens[0]]
            # attention along the greedy output (teacher-forced on it)
            ex = SortingExample(tuple(values), tuple(target))
            k = len(target)
            batch = Batch(
                batch.source,
                batch.source_mask,
                torch.tensor([[BOS, *(t + 3 for t in target[:k])]]),
                torch.tensor([[*(t + 3 for t in target[:k]), EOS]]),
                batch.counts,
            )
            rows = [*map(str, target), "</s>"]
            columns = [str(v) for v in values]
            example = ex
        captured = _capture(model, batch)
        query = torch.cat([c.query for c in captured], dim=1)  # [1, Q, D]
        seen = _Captured(query, captured[0].memory, captured[0].mask)
        with torch.no_grad():
            result = attention(*seen)
        weights = result.weights[0]  # [Q, N]
        title = f"{MODEL_NAMES.get(config.name, config.name)}: attention ({config.task})"
        written.append(
            viz.attention_heatmap(
                weights,
                rows,
                columns,
                out / f"{tag}_attention.png",
                title,
                annotate=len(columns) <= 30,
            )  # fmt: skip
        )
        if not isinstance(attention, MeanFieldAttention):
            continue
        with torch.no_grad():
            unary, coupling, mask, spins = _trajectory(attention, seen)
        if attention.iterations > 0:
            written.append(
                viz.attention_heatmap(
                    spins[1, 0], rows, columns, out / f"{tag}_attention_iteration1.png",
                    f"{MODEL_NAMES.get(config.name, config.name)}: after iteration 1",
                    annotate=len(columns) <= 30,
                )
            )  # fmt: skip
        for q, label in enumerate(rows):
            written.append(
                viz.interaction_map(
                    coupling[0, q], columns, out / f"{tag}_interactions_step{q + 1}.png",
                    title=f"{config.name}: J at output step {q + 1} ({label})",
                )
            )  # fmt: skip
        n = unary.shape[-1]
        energy = {
            f"step {q + 1}": {
                t: float(
                    mean_field_free_energy(
                        unary[0, q].view(1, n), coupling[0, q].view(1, n, n),
                        spins[t, 0, q].view(1, n), mask[0, q].view(1, n),
                    )[0]
                )
                for t in range(spins.shape[0])
            }
            for q in range(len(rows))
        }  # fmt: skip
        written.append(
            viz.line_curves(
                energy, out / f"{tag}_free_energy.png", "iteration", "free energy F(q)",
                f"{config.name}: mean-field free energy per iteration",
            )
        )  # fmt: skip
        del example
    if not written:
        raise ValueError(f"no model with attention under {checkpoint}")
    return written


# ---- command-line options -------------------------------------------------------------------
@dataclass(frozen=True)
class EvalOptions:
    """``structattn eval mfa``'s own flags."""

    data: str = field(
        default="",
        metadata={"help": "a data file of the run's task (BITS<TAB>COUNT or "
                  "x1 x2<TAB>y1 y2; default: the run's test split)"},
    )  # fmt: skip


@dataclass(frozen=True)
class VizOptions:
    """``structattn viz mfa``'s own flags."""

    bits: str = field(default=SAMPLE_BITS, metadata={"help": "counting example (0/1 string)"})
    values: str = field(
        default="",
        metadata={"help": "sorting example, space-separated integers (default: the paper's "
                  "2 9 11 1 17, or a seeded one within max_value)"},
    )  # fmt: skip


@dataclass(frozen=True)
class DataOptions:
    """``structattn data mfa``'s flags (the sizes and lengths of the paper preset)."""

    task: str = field(default="counting", metadata={"help": "counting or sorting"})
    out: str = field(default="", metadata={"required": True, "help": "output directory"})
    seed: int = field(default=0, metadata={"help": "data seed"})
    max_value: int = field(default=99, metadata={"help": "sorting: largest integer"})


def _evaluate(run_dir: Path, options: EvalOptions, device: str, predictions: Path | None) -> str:
    model, config = load_trained(run_dir, device)
    if options.data:
        reader: Callable[[str], Sequence[Example]] = (
            read_counting if config.task == "counting" else read_sorting
        )
        examples = list(reader(options.data))
    else:
        examples = load_data(config)["test"]
    scores = evaluate(model, examples, device, config.max_value, predictions)
    name = MODEL_NAMES.get(config.name, config.name)
    if config.task == "counting":
        return f"{name} counting: MSE {scores['mse']:.3f} ({scores['examples']} examples)"
    return (
        f"{name} sorting: NLL {scores['nll']:.3f} per sequence, {scores['token_nll']:.4f} per "
        f"token, exact match {scores['accuracy']:.1f}% ({scores['examples']} examples, greedy)"
    )


def _viz(checkpoint: Path, options: VizOptions, out: Path | None) -> list[Path]:
    try:
        values = [int(v) for v in options.values.split()] or None
    except ValueError:
        raise ValueError(f"--values must be integers, got {options.values!r}") from None
    if any(c not in "01" for c in options.bits) or not options.bits:
        raise ValueError(f"--bits must be a 0/1 string, got {options.bits!r}")
    return visualize(checkpoint, out, options.bits, values)


def _data(options: DataOptions) -> None:
    config = MFAConfig(task=options.task, data_seed=options.seed, max_value=options.max_value)
    out = Path(options.out)
    for split, examples in load_data(config).items():
        path = write_examples(out / f"{split}.tsv", examples)
        print(f"{path}: {len(examples)} examples")


# ---- presets and the record -------------------------------------------------------------------
_PAPER = MFAConfig()
#: about 2 hours for Table 1 on 2 cores (see docs/results/mfa.md for the measured times)
_CPU = MFAConfig(
    train_size=20_000,
    valid_size=500,
    test_per_length=20,
    runs=3,
    train=replace(PAPER_TRAIN, epochs=5),
)
_QUICK = MFAConfig(
    iterations=2,
    embedding_dim=8,
    hidden_dim=16,
    attention_dim=8,
    max_value=9,
    train_size=64,
    valid_size=16,
    test_per_length=2,
    test_max_length=8,
    batch_size=16,
    runs=1,
    train=replace(PAPER_TRAIN, epochs=1, progress=False, log_every=10),
)


def _cell_dir(config: MFAConfig) -> str:
    return f"{config.task}/{config.name}"


RECIPE = Recipe(
    name="mfa",
    summary="Liu et al., Table 1 / Figures 1-4: chunk counting and sorting with mean-field "
    "CRF attention vs RNN, LSTM, BiLSTM, softmax and variational attention",
    config=MFAConfig,
    presets={
        "paper": Preset(_PAPER, "the paper's data (100K examples), our model sizes, 10 epochs"),
        "cpu": Preset(_CPU, "20K training examples, 5 epochs, 3 runs per cell (interleaved)"),
        "quick": Preset(_QUICK, "seconds: 64 sorting examples, tiny MFA_2 (smoke tests)"),
    },
    grid=(GridAxis("tasks", "task", TASKS), GridAxis("models", "model", TABLE_MODELS)),
    train=train,
    score=score,
    evaluate=_evaluate,
    cell_dir=_cell_dir,
    report=Reporting(
        select=_select,
        summarize=_summarize,
        table=format_table,
        paper={
            "source": "Liu et al., Table 1 (counting MSE, sorting NLL as printed)",
            "counting": {m: v[0] for m, v in PAPER_TABLE1.items()},
            "sorting": {m: v[1] for m, v in PAPER_TABLE1.items()},
        },
        plots=_plots,
        reproduce_also=("mfa-lm",),  # Tables 2-3 (language modelling) are their own recipe
    ),
    tools=Tools(
        eval_options=EvalOptions,
        viz=_viz,
        viz_options=VizOptions,
        data=_data,
        data_options=DataOptions,
    ),
)
