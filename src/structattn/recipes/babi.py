"""Recipe: bAbI question answering (Kim et al. 2017, sec. 4.3 and Appendix A.4).

Three models (:class:`~structattn.models.MemoryQA`): ``memn2n`` (the MemN2N baseline),
``unary-crf`` and ``binary-crf`` (a K-step linear-chain CRF over the memory facts). Each task
and model is trained ``runs`` times with different seeds (paper: 20); as in the paper, Ans % is
the test accuracy of the run that is best on the 10% validation split, and Fact % (the rate at
which the model's best fact sequence equals the supporting facts, in order) is the mean over
the ``fact_runs`` (paper: 10) runs that are best on validation. Tasks 7 and 8 have no Fact %.

Layout of a ``train`` output directory (one task, one model)::

    run_00/ ... run_19/   one run each (fit's run directory + done.json with its scores)
    summary.json          every run's scores, the best run, Ans % and Fact %
    test_predictions.jsonl  the best run's test predictions (see ``write_predictions``)
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.memory_crf import EDGE_UNARIES, LINEAR_QUERY_MODES, QUERY_MODES
from ..data.babi import (
    FACT_EXCLUDED_TASKS,
    MEMORY_SIZE,
    MODEL_NAMES,
    PAPER_HOPS,
    PAPER_TASKS,
    TABLE_ORDER,
    BabiBatch,
    BabiExample,
    BabiVocabulary,
    EncodedQuestions,
    answer_accuracy,
    fact_sequence_accuracy,
    load_task,
    padded_widths,
    write_predictions,
)
from ..io import check_splits
from ..models import MEMORY_MODELS, MemoryQA
from ..models.memory_qa import (
    CRF_LINEAR_STARTS,
    TEMPORAL_INITS,
    TYINGS,
    fact_chains,
    fact_nll,
    forward_batch,
    predict_answers,
)
from ..training import Task, TrainConfig, fit, load_model_state
from ..viz.babi import cells_table, figure5, nested_results, paper_record, plot_cells
from . import runs
from .base import GridAxis, Preset, Recipe, Reporting, Tools
from .config import config_from_dict, config_to_dict, replace_path
from .tables import accuracy_metric

__all__ = [
    "RECIPE",
    "BabiConfig",
    "CONVERGED_LOSS",
    "build_model",
    "converged",
    "evaluate",
    "fact_supervision_weight",
    "load_trained",
    "reproduce",
    "score",
    "summarize",
    "train",
    "train_run",
    "visualize",
]

LINEAR_START_ENDS = ("epochs", "validation")
#: a run has converged when its last epoch's training loss (per question) is below this
CONVERGED_LOSS = 0.1

#: MemN2N's optimisation (Appendix A.4): summed-loss SGD 0.01 halved every 25 epochs, clip 40
PAPER_TRAIN = TrainConfig(
    epochs=100, lr=0.01, max_grad_norm=40.0, decay_every=25, sum_loss=True, log_every=100
)


@dataclass(frozen=True)
class BabiConfig:
    """Settings of the bAbI experiment (defaults: the paper's, Appendix A.4)."""

    task: int = 2  # bAbI task (1..20)
    model: Literal["memn2n", "unary-crf", "binary-crf"] = "binary-crf"  # the variant
    hops: int = 0  # K hops / CRF steps (0 = Table 4's K for the task)
    embed_dim: int = 20  # embedding size
    memory_size: int = MEMORY_SIZE  # the most recent sentences kept in memory
    batch_size: int = 32  # questions per batch (MemN2N's)
    linear_start: int = 20  # epochs of linear start (MemN2N: no softmax; CRF: no log-softmax)
    linear_start_end: Literal["epochs", "validation"] = "epochs"  # linear start lasts
    # `linear_start` epochs (the SAN paper), or ends after the first epoch whose validation
    # loss does not fall below the lowest before it, at most `linear_start` epochs (MemN2N)
    linear_start_lr: float = 0.0  # lr during linear start (0 = the training lr; MemN2N 0.005)
    crf_linear_start: Literal["log-softmax", "unary", "scores"] = "log-softmax"  # what else
    # linear start does to the CRFs: nothing (the paper's text; the log-softmax alone does
    # not change the CRF), no fact-to-fact potentials, or the context from the raw scores
    query_init: Literal["default", "identity"] = "default"  # CRF models' Q (identity: q_k = q)
    crf_query: Literal["linear", "memory", "hop", "both"] = "linear"  # CRF models' q_{k+1}:
    # Q q_k (the paper's text), sum_i theta_k(i) o_i^k (the authors' released unary model's
    # code), q_k + sum_i softmax(theta_k)(i) o_i^k (MemN2N's hop) or Q q_k + the memory term
    crf_edge_unary: Literal["once", "per-edge"] = "once"  # binary CRF, K > 2: each theta_k
    # once, or as the sum of the paper's edge potentials (inner steps' theta_k twice)
    tying: Literal["adjacent", "separate"] = "adjacent"  # MemN2N's adjacent tying, or own
    # value tables and answer matrix (the SAN authors' released CRF code)
    fact_supervision: float = 0.0  # weight of -log p(gold fact sequence) added to the
    # training loss (strong supervision, a diagnostic; 0 = the paper's answers-only training)
    fact_supervision_epochs: int = 0  # supervise the facts in the first N epochs only, then
    # answers alone (a curriculum; 0 = every epoch)
    init_std: float = 0.1  # std of the N(0, s) embedding init (harvardnlp's MemN2N: 0.316)
    random_noise: float = 0.0  # MemN2N's random noise: rate of empty memories (theirs 0.1)
    temporal_encoding: bool = True  # the temporal vectors (off: memory a bag of sentences)
    temporal_init: Literal["normal", "zero"] = "normal"  # the temporal vectors' start:
    # N(0, init_std) as every embedding, or zero (learnt only as far as they help)
    position_encoding: Literal["sentence", "padded"] = "sentence"  # J of PE: each sentence's
    # length (the paper's formula) or the data set's padded width (MemN2N's public codes)
    runs: int = 20  # training runs with different seeds (train.seed, train.seed + 1, ...)
    fact_runs: int = 10  # Fact % = mean over this many runs best on validation
    data_dir: str = ""  # directory with qaN_*_train/test.txt ("" = ../shared/data/babi/en)
    valid_fraction: float = 0.1  # held out from the training file
    split_seed: int = 0  # seed of the validation split (the same for every run)
    train: TrainConfig = field(default_factory=lambda: PAPER_TRAIN)  # epochs, lr, seed, ...

    def __post_init__(self) -> None:
        self.check()

    @property
    def steps(self) -> int:
        """K: ``hops``, or the paper's for the task (3 for tasks outside Table 4)."""
        return self.hops or PAPER_HOPS.get(self.task, 3)

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        for name, allowed in (
            ("model", MEMORY_MODELS),
            ("position_encoding", ("sentence", "padded")),
            ("crf_linear_start", CRF_LINEAR_STARTS),
            ("query_init", ("default", "identity")),
            ("crf_query", QUERY_MODES),
            ("crf_edge_unary", EDGE_UNARIES),
            ("tying", TYINGS),
            ("temporal_init", TEMPORAL_INITS),
            ("linear_start_end", LINEAR_START_ENDS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"`{name}` must be one of {allowed}, got {getattr(self, name)!r}")
        if not 1 <= self.task <= 20:
            raise ValueError(f"`task` must be in 1..20, got {self.task}")
        for name in ("embed_dim", "memory_size", "batch_size", "runs", "fact_runs"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if self.init_std <= 0 or not 0 <= self.random_noise < 1:
            raise ValueError("`init_std` must be > 0 and `random_noise` in [0, 1)")
        if not self.fact_supervision >= 0:
            raise ValueError(f"`fact_supervision` must be >= 0, got {self.fact_supervision}")
        if self.fact_supervision_epochs < 0:
            raise ValueError(
                f"`fact_supervision_epochs` must be >= 0, got {self.fact_supervision_epochs}"
            )
        if self.fact_supervision_epochs and not self.fact_supervision:
            raise ValueError("`fact_supervision_epochs` needs a `fact_supervision` weight > 0")
        if self.crf_query not in LINEAR_QUERY_MODES and self.query_init == "identity":
            raise ValueError(
                f"`query_init identity` sets Q, which `crf_query {self.crf_query}` does not have"
            )
        if self.hops < 0 or self.linear_start < 0:
            raise ValueError("`hops` and `linear_start` must be >= 0")
        if self.linear_start_end == "validation" and self.valid_fraction == 0:
            raise ValueError(
                '`linear_start_end="validation"` needs a validation set (`valid_fraction` > 0)'
            )
        if not self.linear_start_lr >= 0:
            raise ValueError(f"`linear_start_lr` must be >= 0, got {self.linear_start_lr}")
        if not 0 <= self.valid_fraction < 1:
            raise ValueError(f"`valid_fraction` must be in [0, 1), got {self.valid_fraction}")
        if not isinstance(self.train, TrainConfig) or self.train.epochs < 1:
            raise ValueError("`train` must be a TrainConfig with epochs >= 1")


# ---- data -----------------------------------------------------------------------------------
def load_data(config: BabiConfig) -> tuple[dict[str, list[BabiExample]], BabiVocabulary]:
    """Train/valid/test questions of ``config.task`` and the vocabulary of train + valid."""
    splits = load_task(
        config.data_dir or None,
        config.task,
        config.valid_fraction,
        config.split_seed,
        config.memory_size,
    )
    # no validation split is what valid_fraction = 0 asks for; any other empty split is refused
    optional = ("valid",) if config.valid_fraction == 0 else ()
    check_splits(splits, f"bAbI task {config.task}", optional)
    return splits, BabiVocabulary.build(splits["train"] + splits["valid"])


# ---- model ----------------------------------------------------------------------------------
def build_model(
    config: BabiConfig,
    vocab: BabiVocabulary,
    seed: int | None = None,
    pe_width: tuple[int, int] | None = None,
) -> MemoryQA:
    """The paper's model for ``config.model`` (MemN2N's N(0, 0.1) initialisation);
    ``pe_width``: the fixed (sentence, question) widths of ``position_encoding="padded"``."""
    torch.manual_seed(config.train.seed if seed is None else seed)
    model = MemoryQA(
        len(vocab),
        config.embed_dim,
        config.steps,
        config.memory_size,
        config.model,
        init_std=config.init_std,
        random_noise=config.random_noise,
        pe_width=pe_width if config.position_encoding == "padded" else None,
        crf_linear_start=config.crf_linear_start,
        crf_query=config.crf_query,
        crf_edge_unary=config.crf_edge_unary,
        tying=config.tying,
        temporal_encoding=config.temporal_encoding,
        temporal_init=config.temporal_init,
    )
    if config.query_init == "identity" and model.crf is not None:
        assert model.crf.query_update is not None
        with torch.no_grad():
            model.crf.query_update.weight.copy_(torch.eye(config.embed_dim))
    return model


def in_linear_start(config: BabiConfig, epoch: int, valid_loss: Mapping[int, float]) -> bool:
    """Whether 1-based ``epoch`` trains in linear start: one of the first ``linear_start``
    epochs and, with ``linear_start_end="validation"``, no earlier epoch's validation loss
    (``valid_loss[e]``) failed to fall below the lowest before it (MemN2N: linear start
    ends "when the validation loss stopped decreasing"; that epoch is its last)."""
    if epoch > config.linear_start:
        return False
    if config.linear_start_end == "epochs":
        return True
    lowest = math.inf
    for e in range(1, epoch):
        if e not in valid_loss:
            raise ValueError(f"epoch {e} has no validation loss: cannot place linear start")
        if not valid_loss[e] < lowest:
            return False
        lowest = valid_loss[e]
    return True


def set_linear_start(model: MemoryQA, linear: bool) -> None:
    """Linear start (Appendix A.4): while ``linear`` MemN2N has no softmax and the CRF
    models are in their ``crf_linear_start`` mode; afterwards the CRF models log-softmax
    their unary potentials."""
    model.linear_start = linear
    model.normalize_potentials = not linear


# ---- evaluation -----------------------------------------------------------------------------
def evaluate(
    model: MemoryQA,
    examples: Sequence[BabiExample],
    vocab: BabiVocabulary,
    device: torch.device | str = "cpu",
    predictions: str | Path | None = None,
    encoded: EncodedQuestions | None = None,
) -> dict[str, Any]:
    """Ans %, Fact % (``None`` for tasks 7 and 8; see
    :func:`~structattn.data.babi.fact_sequence_accuracy`) and the mean NLL of ``examples``;
    optionally writes the predictions JSONL (:func:`~structattn.data.babi.write_predictions`)."""
    if not examples:
        raise ValueError("no questions to evaluate")
    answers, facts, loss = predict_answers(model, examples, vocab, device, encoded=encoded)
    ans = 100.0 * answer_accuracy(answers, [ex.answer for ex in examples])
    fact: float | None = None
    if examples[0].task not in FACT_EXCLUDED_TASKS:
        gold = [ex.support for ex in examples]
        fact = 100.0 * fact_sequence_accuracy(facts, gold)
    if predictions is not None:
        write_predictions(predictions, examples, answers, facts)
    return {"ans": ans, "fact": fact, "loss": loss, "questions": len(examples)}


def fact_supervision_weight(config: BabiConfig, epoch: int) -> float:
    """The weight of :func:`fact_nll` in the loss of 1-based ``epoch``: ``fact_supervision``,
    in the first ``fact_supervision_epochs`` epochs only when that is set."""
    if config.fact_supervision_epochs and epoch > config.fact_supervision_epochs:
        return 0.0
    return config.fact_supervision


# ---- one run ---------------------------------------------------------------------------------
def train_run(config: BabiConfig, run_dir: str | Path, resume: bool = False) -> dict[str, Any]:
    """Train one run (model seed ``config.train.seed``) into ``run_dir``; returns fit's
    summary (the best model on validation is ``model.pt``)."""
    run_dir = Path(run_dir)
    seed = config.train.seed
    splits, vocab = load_data(config)
    if resume:  # the vocabulary the run was started with
        saved = load_model_state(run_dir, "checkpoint.pt")
        vocab = BabiVocabulary.from_dict(saved["extra"]["vocab"])
    device = torch.device(config.train.device)
    pe_width = padded_widths(splits)
    model = build_model(config, vocab, seed, pe_width)
    train = EncodedQuestions(splits["train"], vocab)
    valid = splits["valid"]
    valid_encoded = EncodedQuestions(valid, vocab) if valid else None

    def batches(epoch: int) -> list[list[int]]:
        order = list(range(len(splits["train"])))
        random.Random(seed * 100_003 + epoch).shuffle(order)
        return [order[s : s + config.batch_size] for s in range(0, len(order), config.batch_size)]

    epoch_now = [1]  # set by on_epoch_start (also on resume)
    linear_now = [True]  # whether epoch_now trains in linear start
    valid_loss: dict[int, float] = {}  # epoch -> validation loss (checkpointed)

    def loss(m: nn.Module, batch: BabiBatch) -> tuple[Tensor, int, int]:
        out = forward_batch(m, batch)
        n = batch.answer.shape[0]
        total = F.cross_entropy(out.logits, batch.answer, reduction="sum")
        weight = fact_supervision_weight(config, epoch_now[0])
        if weight > 0 and batch.support is not None:
            total = total + weight * fact_nll(out, batch.support)
        return total, n, n

    def validate(m: nn.Module) -> dict[str, float]:
        assert isinstance(m, MemoryQA)
        scores = evaluate(m, valid, vocab, device, encoded=valid_encoded)
        valid_loss[epoch_now[0]] = scores["loss"]
        metric = accuracy_metric(scores["ans"] / 100, scores["loss"])
        return {"metric": metric, "ans": scores["ans"], "loss": scores["loss"]}

    def on_epoch_start(m: nn.Module, epoch: int) -> None:
        assert isinstance(m, MemoryQA)
        epoch_now[0] = epoch
        linear_now[0] = in_linear_start(config, epoch, valid_loss)
        set_linear_start(m, linear_now[0])

    def epoch_lr(epoch: int, lr: float) -> float:
        return config.linear_start_lr if linear_now[0] and config.linear_start_lr else lr

    def get_state() -> dict[str, Any]:
        return {"valid_loss": [[e, loss] for e, loss in sorted(valid_loss.items())]}

    def set_state(saved: Any) -> None:
        valid_loss.clear()
        valid_loss.update({int(e): float(loss) for e, loss in (saved or {}).get("valid_loss", [])})

    task = Task(
        model=model,
        batches=batches,
        collate=train.batch,
        loss=loss,
        validate=validate if valid else None,
        config={"recipe": "babi", **config_to_dict(config), "run_seed": seed},
        extra={"vocab": vocab.to_dict(), "pe_width": list(pe_width)},
        on_epoch_start=on_epoch_start,
        epoch_lr=epoch_lr,
        state=(get_state, set_state),
    )
    train_config = replace(
        config.train,
        name=config.train.name or f"task {config.task} {config.model} seed {seed}",
        epoch_lines=config.train.epoch_lines and config.train.progress,
    )
    return fit(task, train_config, run_dir, resume=resume)


def score(config: BabiConfig, run_dir: str | Path) -> dict[str, Any]:
    """A trained run's validation and test scores (its best model on validation); writes its
    test predictions (``test_predictions.jsonl``)."""
    run_dir = Path(run_dir)
    trained, vocab, _ = load_trained(run_dir, config.train.device)
    splits, _ = load_data(config)
    device = config.train.device
    valid = evaluate(trained, splits["valid"], vocab, device) if splits["valid"] else None
    predictions = run_dir / "test_predictions.jsonl"
    return {"valid": valid, "test": evaluate(trained, splits["test"], vocab, device, predictions)}


def load_trained(
    checkpoint: str | Path, device: str = "cpu"
) -> tuple[MemoryQA, BabiVocabulary, BabiConfig]:
    """The model of a run directory (its ``model.pt``, loaded with ``weights_only=True``) or
    of a ``train`` output directory (its best run on validation), its vocabulary and config."""
    path = Path(checkpoint)
    if path.is_dir():
        path = runs.resolve_run(RECIPE, path)
    state = load_model_state(path)
    if state["config"].get("recipe") != "babi":
        raise ValueError(f"{path} is not a bAbI run (recipe {state['config'].get('recipe')!r})")
    config = config_from_dict(BabiConfig, state["config"])
    vocab = BabiVocabulary.from_dict(state["extra"]["vocab"])
    width = state["extra"].get("pe_width")
    model = build_model(config, vocab, pe_width=None if width is None else (width[0], width[1]))
    model.load_state_dict(state["model"])
    return model.to(device).eval(), vocab, config


# ---- many runs -------------------------------------------------------------------------------
def _select(record: Mapping[str, Any]) -> float:
    """The rule that picked each run's best epoch: validation accuracy, then lower NLL."""
    valid = record["valid"] or {"ans": 0.0, "loss": 0.0}
    return accuracy_metric(valid["ans"] / 100, valid["loss"])


def converged(records: Sequence[Mapping[str, Any]]) -> int:
    """How many runs converged: final training loss (per question) below
    :data:`CONVERGED_LOSS`."""
    losses = [r.get("final_train_loss") for r in records]
    return sum(1 for loss in losses if loss is not None and loss < CONVERGED_LOSS)


def _summarize(config: BabiConfig, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Ans % of the best run on validation, Fact % averaged over the ``fact_runs`` best, and
    the number of runs that converged."""
    best = records[0]
    facts = [r["test"]["fact"] for r in records[: config.fact_runs]]
    return {
        "task": config.task,
        "model": config.model,
        "hops": config.steps,
        "fact_runs": min(config.fact_runs, len(records)),
        "ans": best["test"]["ans"],
        "fact": None if any(f is None for f in facts) else sum(facts) / len(facts),
        "best_run_fact": best["test"]["fact"],
        "valid_ans": best["valid"]["ans"] if best["valid"] else None,
        "converged": converged(records),
    }


def summarize(
    out_dir: str | Path, config: BabiConfig, predictions: bool = True
) -> dict[str, Any] | None:
    """Combine the finished runs of ``out_dir`` (their ``done.json``): the best run on
    validation gives Ans % (and its Fact %), the ``fact_runs`` best give the mean Fact %.
    Writes ``summary.json`` (and, with ``predictions``, the best run's
    ``test_predictions.jsonl``); ``None`` when no run has finished."""
    return runs.summarize_cell(RECIPE, config, out_dir, final=predictions)


def train(
    config: BabiConfig,
    out_dir: str | Path,
    resume: bool = False,
    jobs: int = 1,
    force: bool = False,
) -> dict[str, Any]:
    """Train ``config.runs`` runs of one task and model into ``out_dir`` (``jobs`` processes
    in parallel) and summarize them (see :func:`summarize`)."""
    load_data(config)  # fail early on a missing data directory or task
    summary = runs.train_cell(RECIPE, config, out_dir, resume, force, jobs)
    assert summary is not None
    return summary


# ---- the paper's table -----------------------------------------------------------------------
def reproduce(
    config: BabiConfig,
    out_dir: str | Path,
    tasks: Sequence[int] = PAPER_TASKS,
    models: Sequence[str] = TABLE_ORDER,
    resume: bool = False,
    jobs: int = 1,
    force: bool = False,
) -> dict[int, dict[str, dict[str, Any]]]:
    """Train every (task, model) of Table 4 into ``out_dir/task_NN/<model>`` (runs interleaved
    so every cell fills up evenly), update ``results.json`` and ``table.md`` as runs finish,
    print our table beside the paper's; returns ``results[task][model] = summary``."""
    for task in tasks:
        load_data(replace(config, task=task))  # fail early on missing data
    grid: dict[str, list[Any]] = {"task": list(tasks), "model": list(models)}
    payload = runs.reproduce(RECIPE, config, out_dir, grid, resume, force, jobs)
    return nested_results(payload["results"])


# ---- Figure 5 --------------------------------------------------------------------------------
def visualize(
    checkpoint: str | Path,
    question: int,
    out: str | Path | None = None,
    split: str = "test",
    data_dir: str | None = None,
) -> Path:
    """Figure 5 of the paper for question number ``question`` (0-based, file order) of
    ``split``: facts per step as nodes, edge marginals p(z_k, z_{k+1}) as edge widths, the
    three most probable fact sequences. Needs a CRF model. Returns the file written."""
    model, vocab, config = load_trained(checkpoint)
    if model.crf is None:
        raise ValueError(
            "Figure 5 shows a CRF's fact-sequence marginals; this checkpoint is a MemN2N "
            "(use a unary-crf or binary-crf run)"
        )
    if data_dir:
        config = replace(config, data_dir=data_dir)
    splits, _ = load_data(config)
    if split not in splits:
        raise ValueError(f"`split` must be one of {sorted(splits)}, got {split!r}")
    examples = splits[split]
    if not 0 <= question < len(examples):
        raise ValueError(f"`question` must be in 0..{len(examples) - 1} for {split}")
    ex = examples[question]
    marginals, edges, top, predicted = fact_chains(model, ex, vocab)
    path = Path(out) if out else Path(checkpoint) / f"figure5_{split}_{question}.png"
    if path.suffix == "" or path.is_dir():
        path = path / f"figure5_{split}_{question}.png"
    title = f"bAbI task {config.task}, {MODEL_NAMES[config.model]}, K = {config.steps}"
    return figure5(ex, marginals, edges, top, predicted, path, title)


def default_out(config: BabiConfig) -> str:
    """``runs/babi/task_NN/<model>``."""
    return str(Path("runs", "babi", _cell_dir(config)))


def _cell_dir(config: BabiConfig) -> str:
    return f"task_{config.task:02d}/{config.model}"


# ---- command-line options -------------------------------------------------------------------
@dataclass(frozen=True)
class EvalOptions:
    """``structattn eval babi``'s own flags."""

    split: Literal["train", "valid", "test"] = "test"  # the split to score
    data_dir: str | None = field(default=None, metadata={"help": "default: the run's"})


@dataclass(frozen=True)
class VizOptions:
    """``structattn viz babi``'s own flags (Figure 5)."""

    question: int = 0  # question number in --split (0-based)
    split: Literal["train", "valid", "test"] = "test"  # the split of --question
    data_dir: str | None = field(default=None, metadata={"help": "default: the run's"})


def _evaluate(run_dir: Path, options: EvalOptions, device: str, predictions: Path | None) -> str:
    model, vocab, config = load_trained(run_dir, device)
    if options.data_dir:
        config = replace(config, data_dir=options.data_dir)
    splits, _ = load_data(config)
    qa = evaluate(model, splits[options.split], vocab, device, predictions=predictions)
    fact = "-" if qa["fact"] is None else f"{qa['fact']:.1f}"
    return (
        f"task {config.task} {config.model} ({options.split}, {qa['questions']} "
        f"questions): Ans {qa['ans']:.1f}%  Fact {fact}%"
    )


def _viz(checkpoint: Path, options: VizOptions, out: Path | None) -> list[Path]:
    return [visualize(checkpoint, options.question, out, options.split, options.data_dir)]


_CPU = BabiConfig(runs=5, fact_runs=3)
_QUICK = replace_path(
    BabiConfig(runs=2, fact_runs=1, linear_start=1),
    {"train.epochs": 2, "train.progress": False, "train.log_every": 10},
)

RECIPE = Recipe(
    name="babi",
    summary="SAN 4.3, Table 4 / Figure 5: bAbI QA with MemN2N, unary and binary CRF memory",
    config=BabiConfig,
    presets={
        "paper": Preset(BabiConfig(), "Appendix A.4: 100 epochs, 20 runs per task and model"),
        "cpu": Preset(_CPU, "the paper's settings, 5 runs per cell, 2 processes", 2),
        "quick": Preset(_QUICK, "seconds: 2 runs of 2 epochs (smoke tests)"),
    },
    grid=(GridAxis("tasks", "task", PAPER_TASKS), GridAxis("models", "model", TABLE_ORDER)),
    train=train_run,
    score=score,
    evaluate=_evaluate,
    cell_dir=_cell_dir,
    resumable=frozenset({"fact_runs"}),
    report=Reporting(
        select=_select,
        summarize=_summarize,
        table=cells_table,
        paper=paper_record(),
        plots=plot_cells,
    ),
    tools=Tools(eval_options=EvalOptions, viz=_viz, viz_options=VizOptions),
)
