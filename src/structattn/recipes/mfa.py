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
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from ..data.batching import bucket_batches
from ..data.synthetic import (
    CountingExample,
    SortingExample,
    counting_examples,
    read_counting,
    read_sorting,
    sorting_examples,
    write_examples,
)
from ..data.synthetic_batches import PAD, SyntheticBatch, collate, example_length
from ..io import check_splits
from ..metrics import mean_std_range
from ..models import (
    ChunkCounter,
    ElmanRNN,
    NoAttention,
    Seq2Seq,
    Seq2SeqConfig,
    attention_probe,
    counting_predictions,
    free_energy_check,
    mfa_attention,
    sorting_scores,
)
from ..models.mfa import figure_batch
from ..models.seq2seq import sequence_nll
from ..training import Task, TrainConfig, fit, load_model_state
from ..viz.mfa import MODEL_NAMES, PAPER_TABLE1, TABLE_MODELS, figure1, format_table
from . import runs
from .base import GridAxis, Preset, Recipe, Reporting, Tools
from .config import config_from_dict, config_to_dict

__all__ = [
    "MODELS",
    "PAPER_TABLE1",
    "TABLE_MODELS",
    "TASKS",
    "MFAConfig",
    "build_model",
    "evaluate",
    "load_data",
    "load_trained",
    "score",
    "train",
    "visualize",
]

TASKS = ("counting", "sorting")
MODELS = ("rnn", "lstm", "bilstm", "attention", "vae", "mfa")
#: the task's (train lengths, longest test length) when the config leaves them at 0
TASK_LENGTHS = {"counting": (10, 30, 100), "sorting": (5, 15, 25)}

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
        splits = {s: list(reader(root / f"{s}.tsv")) for s in ("train", "valid", "test")}
        check_splits(splits, str(root))
        return splits
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


def batches_for_epoch(
    examples: Sequence[Example], batch_size: int, seed: int, epoch: int
) -> list[list[Example]]:
    """Length-bucketed batches in a random order fixed by (seed, epoch)."""
    return bucket_batches(examples, batch_size, seed, epoch, example_length)


# ---- model --------------------------------------------------------------------------------
def build_model(config: MFAConfig) -> nn.Module:
    """The model of ``config`` (seeded with ``train.seed``)."""
    torch.manual_seed(config.train.seed)
    if config.task == "counting":
        return ChunkCounter(
            config.embedding_dim, config.hidden_dim, config.model, config.attention_dim,
            config.iterations, config.kl_weight,
        )  # fmt: skip
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
    attention = mfa_attention(
        config.model, hidden, hidden, config.attention_dim, config.iterations, config.kl_weight
    )
    attention = attention or NoAttention()
    model = Seq2Seq(seq, attention)
    if config.model == "rnn":
        assert model.encoder is not None
        model.encoder.lstm = ElmanRNN(dim, hidden)  # type: ignore[assignment]
        model.decoder = ElmanRNN(dim + hidden, hidden)  # type: ignore[assignment]
    return model


def _penalty(model: nn.Module) -> Tensor:
    """The model's ``penalty()`` (variational attention's KL; 0 for the others)."""
    return cast(Tensor, model.penalty())  # type: ignore[operator]


def batch_loss(model: nn.Module, batch: SyntheticBatch) -> tuple[Tensor, int, int]:
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
def _mean(values: Sequence[float]) -> float:
    return sum(values) / max(len(values), 1)


def validate(
    model: nn.Module, examples: Sequence[Example], device: torch.device, max_value: int
) -> dict[str, float]:
    """Validation: counting MSE, or sorting NLL per sequence (``metric`` = minus it)."""
    model.eval()
    if isinstance(examples[0], CountingExample):
        counting = [e for e in examples if isinstance(e, CountingExample)]
        predicted = counting_predictions(model, counting, device, max_value)
        mse = _mean([(p - e.count) ** 2 for p, e in zip(predicted, counting, strict=True)])
        return {"metric": -mse, "mse": mse}
    sorting = [e for e in examples if isinstance(e, SortingExample)]
    nll, _ = sorting_scores(model, sorting, device, max_value, decode=False)
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
        predicted = counting_predictions(model, counting, device, max_value)
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
        nll, decoded = sorting_scores(model, sorting, device, max_value, decode=True)
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
        "runs_spread": {k: mean_std_range([r["test"][k] for r in records]) for k in keys},
        "per_length": {n: statistics.fmean(v) for n, v in sorted(per_length.items())},
        "valid": records[0].get("valid"),
    }
    if "free_energy" in best:
        summary["free_energy"] = best["free_energy"]
    return summary


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
    spanning tree for every output step and the free energy per iteration
    (:func:`~structattn.viz.mean_field_figures`). Returns the files written."""
    from ..viz import mean_field_figures

    root = Path(checkpoint)
    out = Path(out_dir) if out_dir else (root if root.is_dir() else root.parent)
    written: list[Path] = []
    for run_dir in _run_dirs(root):
        model, config = load_trained(run_dir)
        attention = getattr(model, "attention", None)
        if attention is None or isinstance(attention, NoAttention):
            continue
        if config.task == "sorting" and values is None:
            values = SAMPLE_VALUES
            if max(values) > config.max_value:
                values = sorting_examples(1, [5], 0, "viz", config.max_value)[0].values
        batch, rows, columns = figure_batch(
            model, config.task, bits, values or (), config.max_value
        )
        probe = attention_probe(model, batch)  # weights [Q, N] (+ mean-field trajectory)
        name = MODEL_NAMES.get(config.name, config.name)
        written += mean_field_figures(
            probe.pop("weights"), rows, columns, out, f"{config.task}_{config.name}",
            title=f"{name}: attention ({config.task})", name=name, short_name=config.name,
            **probe,
        )  # fmt: skip
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
        plots=figure1,
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
