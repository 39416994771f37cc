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

import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, fields, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data._files import atomic_write_text
from ..data.babi import (
    FACT_EXCLUDED_TASKS,
    MEMORY_SIZE,
    PAPER_HOPS,
    PAPER_TABLE4,
    PAPER_TABLE4_AVERAGE,
    PAPER_TASKS,
    BabiBatch,
    BabiExample,
    BabiVocabulary,
    answer_accuracy,
    fact_sequence_accuracy,
    load_task,
    write_predictions,
)
from ..models import MEMORY_MODELS, MemoryQA
from ..training import Task, TrainConfig, fit, load_model_state

__all__ = [
    "BabiConfig",
    "build_model",
    "evaluate",
    "format_runs",
    "format_table",
    "load_trained",
    "reproduce",
    "summarize",
    "train",
    "train_run",
    "visualize",
]

MODEL_NAMES = {"memn2n": "MemN2N", "binary-crf": "Binary CRF", "unary-crf": "Unary CRF"}
TABLE_ORDER = ("memn2n", "binary-crf", "unary-crf")  # the paper's column order


@dataclass(frozen=True)
class BabiConfig:
    """Settings of the bAbI experiment (defaults: the paper's, Appendix A.4)."""

    task: int = 2  # bAbI task (1..20)
    model: str = "binary-crf"  # memn2n | unary-crf | binary-crf
    hops: int = 0  # K hops / CRF steps (0 = Table 4's K for the task)
    embed_dim: int = 20  # embedding size
    memory_size: int = MEMORY_SIZE  # the most recent sentences kept in memory
    batch_size: int = 32  # questions per batch (MemN2N's)
    epochs: int = 100  # training epochs
    lr: float = 0.01  # SGD learning rate ...
    decay_every: int = 25  # ... halved every this many epochs
    max_grad_norm: float = 40.0  # gradient norm clipping
    sum_loss: bool = True  # lr and clipping act on the batch's summed loss (as in MemN2N)
    linear_start: int = 20  # epochs of linear start (MemN2N: no softmax; CRF: no log-softmax)
    query_init: str = "default"  # CRF models' Q: "default" (nn.Linear's) | "identity" (q_k = q)
    runs: int = 20  # training runs with different seeds (seed, seed + 1, ...)
    fact_runs: int = 10  # Fact % = mean over this many runs best on validation
    seed: int = 0  # seed of the first run
    data_dir: str = ""  # directory with qaN_*_train/test.txt ("" = ../shared/data/babi/en)
    valid_fraction: float = 0.1  # held out from the training file
    split_seed: int = 0  # seed of the validation split (the same for every run)
    device: str = "cpu"  # cpu | cuda
    log_every: int = 100  # steps between metric lines
    progress: bool = True  # progress bars

    @property
    def steps(self) -> int:
        """K: ``hops``, or the paper's for the task (3 for tasks outside Table 4)."""
        return self.hops or PAPER_HOPS.get(self.task, 3)

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if self.model not in MEMORY_MODELS:
            raise ValueError(f"`model` must be one of {MEMORY_MODELS}, got {self.model!r}")
        if not 1 <= self.task <= 20:
            raise ValueError(f"`task` must be in 1..20, got {self.task}")
        for name in ("embed_dim", "memory_size", "batch_size", "epochs", "runs", "fact_runs"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if self.query_init not in ("default", "identity"):
            raise ValueError(f"`query_init` must be default or identity, got {self.query_init!r}")
        if self.hops < 0 or self.linear_start < 0:
            raise ValueError("`hops` and `linear_start` must be >= 0")


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
    if not splits["train"]:
        raise ValueError(f"task {config.task}: the training file has no questions")
    return splits, BabiVocabulary.build(splits["train"] + splits["valid"])


class _Encoded:
    """A split encoded once as padded tensors; ``batch(indices)`` slices and trims it."""

    def __init__(self, examples: Sequence[BabiExample], vocab: BabiVocabulary) -> None:
        self.full = vocab.encode_batch(examples)

    def batch(self, indices: Sequence[int], device: torch.device) -> BabiBatch:
        f = self.full
        index = torch.as_tensor(list(indices), dtype=torch.long)
        memory_lengths = f.memory_lengths[index]
        slots = max(int(memory_lengths.max()), 1)
        sentence_lengths = f.sentence_lengths[index, :slots]
        width = max(int(sentence_lengths.max()), 1)
        question_lengths = f.question_lengths[index]
        qwidth = max(int(question_lengths.max()), 1)
        return BabiBatch(
            memory=f.memory[index, :slots, :width].to(device),
            memory_lengths=memory_lengths.to(device),
            sentence_lengths=sentence_lengths.to(device),
            question=f.question[index, :qwidth].to(device),
            question_lengths=question_lengths.to(device),
            answer=f.answer[index].to(device),
        )


def _forward(model: nn.Module, batch: BabiBatch) -> Any:
    return model(
        batch.memory,
        batch.sentence_lengths,
        batch.memory_lengths,
        batch.question,
        batch.question_lengths,
    )


# ---- model ----------------------------------------------------------------------------------
def build_model(config: BabiConfig, vocab: BabiVocabulary, seed: int | None = None) -> MemoryQA:
    """The paper's model for ``config.model`` (MemN2N's N(0, 0.1) initialisation)."""
    torch.manual_seed(config.seed if seed is None else seed)
    model = MemoryQA(len(vocab), config.embed_dim, config.steps, config.memory_size, config.model)
    if config.query_init == "identity" and model.crf is not None:
        with torch.no_grad():
            model.crf.query_update.weight.copy_(torch.eye(config.embed_dim))
    return model


def set_linear_start(model: MemoryQA, epoch: int, linear_epochs: int) -> None:
    """Linear start (Appendix A.4): for the first ``linear_epochs`` epochs MemN2N has no
    softmax; afterwards the CRF models log-softmax their unary potentials."""
    linear = epoch <= linear_epochs
    model.linear_start = linear and model.crf is None
    model.normalize_potentials = not linear


# ---- evaluation -----------------------------------------------------------------------------
@torch.no_grad()
def predict(
    model: MemoryQA,
    examples: Sequence[BabiExample],
    vocab: BabiVocabulary,
    device: torch.device | str = "cpu",
    batch_size: int = 200,
    encoded: _Encoded | None = None,
) -> tuple[list[str], list[list[int]], float]:
    """(predicted answers, predicted fact sequences as 0-based memory indices, mean NLL);
    ``encoded``: ``examples`` already encoded (training validates every epoch)."""
    device = torch.device(device)
    model.eval()
    if encoded is None:
        encoded = _Encoded(examples, vocab)
    answers: list[str] = []
    facts: list[list[int]] = []
    total = 0.0
    for start in range(0, len(examples), batch_size):
        batch = encoded.batch(range(start, min(start + batch_size, len(examples))), device)
        out = _forward(model, batch)
        total += float(F.cross_entropy(out.logits, batch.answer, reduction="sum"))
        answers += [vocab.tokens[i] for i in out.logits.argmax(-1).tolist()]
        facts += out.facts.tolist()
    return answers, facts, total / max(len(examples), 1)


def evaluate(
    model: MemoryQA,
    examples: Sequence[BabiExample],
    vocab: BabiVocabulary,
    device: torch.device | str = "cpu",
    predictions: str | Path | None = None,
    encoded: _Encoded | None = None,
) -> dict[str, Any]:
    """Ans %, Fact % (``None`` for tasks 7 and 8; see
    :func:`~structattn.data.babi.fact_sequence_accuracy`) and the mean NLL of ``examples``;
    optionally writes the predictions JSONL (:func:`~structattn.data.babi.write_predictions`)."""
    if not examples:
        raise ValueError("no questions to evaluate")
    answers, facts, loss = predict(model, examples, vocab, device, encoded=encoded)
    ans = 100.0 * answer_accuracy(answers, [ex.answer for ex in examples])
    fact: float | None = None
    if examples[0].task not in FACT_EXCLUDED_TASKS:
        gold = [ex.support for ex in examples]
        fact = 100.0 * fact_sequence_accuracy(facts, gold)
    if predictions is not None:
        write_predictions(predictions, examples, answers, facts)
    return {"ans": ans, "fact": fact, "loss": loss, "questions": len(examples)}


def _selection_metric(accuracy: float, loss: float) -> float:
    """Validation answer accuracy (a fraction), ties broken by lower NLL: accuracy moves in
    steps of 1/|valid| >= 1e-3 for bAbI's 100 validation questions, the NLL term stays < 1e-4."""
    return accuracy - 1e-6 * min(loss, 99.0)


# ---- one run ---------------------------------------------------------------------------------
def train_run(
    config: BabiConfig,
    run_dir: str | Path,
    seed: int,
    resume: bool = False,
) -> dict[str, Any]:
    """Train one run (model seed ``seed``), then score its best-on-validation model on the
    validation and test splits; writes ``done.json`` and returns its content."""
    config.check()
    run_dir = Path(run_dir)
    splits, vocab = load_data(config)
    if resume:  # the vocabulary the run was started with
        saved = load_model_state(run_dir, "checkpoint.pt")
        vocab = BabiVocabulary.from_dict(saved["extra"]["vocab"])
    device = torch.device(config.device)
    model = build_model(config, vocab, seed)
    train = _Encoded(splits["train"], vocab)
    valid = splits["valid"]
    valid_encoded = _Encoded(valid, vocab) if valid else None

    def batches(epoch: int) -> list[list[int]]:
        order = list(range(len(splits["train"])))
        random.Random(seed * 100_003 + epoch).shuffle(order)
        return [order[s : s + config.batch_size] for s in range(0, len(order), config.batch_size)]

    def loss(m: nn.Module, batch: BabiBatch) -> tuple[Tensor, int, int]:
        logits = _forward(m, batch).logits
        n = batch.answer.shape[0]
        return F.cross_entropy(logits, batch.answer, reduction="sum"), n, n

    def validate(m: nn.Module) -> dict[str, float]:
        assert isinstance(m, MemoryQA)
        scores = evaluate(m, valid, vocab, device, encoded=valid_encoded)
        metric = _selection_metric(scores["ans"] / 100, scores["loss"])
        return {"metric": metric, "ans": scores["ans"], "loss": scores["loss"]}

    def on_epoch_start(m: nn.Module, epoch: int) -> None:
        assert isinstance(m, MemoryQA)
        set_linear_start(m, epoch, config.linear_start)

    task = Task(
        model=model,
        batches=batches,
        collate=train.batch,
        loss=loss,
        validate=validate if valid else None,
        config={"recipe": "babi", **asdict(config), "run_seed": seed},
        extra={"vocab": vocab.to_dict()},
        on_epoch_start=on_epoch_start,
    )
    train_config = TrainConfig(
        epochs=config.epochs,
        lr=config.lr,
        max_grad_norm=config.max_grad_norm,
        decay_every=config.decay_every or None,
        seed=seed,
        log_every=config.log_every,
        device=config.device,
        progress=config.progress,
        name=f"task {config.task} {config.model} seed {seed}",
        epoch_lines=config.progress,
        sum_loss=config.sum_loss,
    )
    started = time.time()
    summary = fit(task, train_config, run_dir, resume=resume)
    seconds = time.time() - started
    trained, _, _ = load_trained(run_dir, config.device)
    record = {
        "run": run_dir.name,
        "seed": seed,
        "best_epoch": summary["best"].get("epoch", config.epochs),
        "seconds": seconds,
        "valid": evaluate(trained, valid, vocab, device) if valid else None,
        "test": evaluate(trained, splits["test"], vocab, device),
    }
    atomic_write_text(run_dir / "done.json", json.dumps(record, indent=2) + "\n")
    return record


def load_trained(
    checkpoint: str | Path, device: str = "cpu"
) -> tuple[MemoryQA, BabiVocabulary, BabiConfig]:
    """The model of a run directory (its ``model.pt``) or of a ``train`` output directory
    (its best run on validation), with its vocabulary and config."""
    path = Path(checkpoint)
    if path.is_dir() and (path / "summary.json").exists() and not (path / "model.pt").exists():
        best = json.loads((path / "summary.json").read_text())["best_run"]
        path = path / best
    state = load_model_state(path)
    if state["config"].get("recipe") != "babi":
        raise ValueError(f"{path} is not a bAbI run (recipe {state['config'].get('recipe')!r})")
    known = {f.name for f in fields(BabiConfig)}
    config = BabiConfig(**{k: v for k, v in state["config"].items() if k in known})
    vocab = BabiVocabulary.from_dict(state["extra"]["vocab"])
    model = build_model(config, vocab)
    model.load_state_dict(state["model"])
    return model.to(device).eval(), vocab, config


# ---- many runs -------------------------------------------------------------------------------
def _run_worker(config: dict[str, Any], run_dir: str, seed: int, resume: bool, threads: int) -> Any:
    torch.set_num_threads(threads)
    return train_run(BabiConfig(**config), run_dir, seed, resume)


def _run_state(run_dir: Path) -> str:
    if (run_dir / "done.json").exists():
        return "done"
    return "partial" if (run_dir / "checkpoint.pt").exists() else "new"


def _pending_runs(config: BabiConfig, out_dir: Path, resume: bool) -> list[tuple[Path, int, bool]]:
    """(run dir, seed, resume?) of the runs still to train; refuses to overwrite old runs."""
    pending = []
    for r in range(config.runs):
        run_dir = out_dir / f"run_{r:02d}"
        state = _run_state(run_dir)
        if state != "new" and not resume:
            raise FileExistsError(
                f"{run_dir} already holds a run; pass --resume to continue (finished runs are "
                "kept, unfinished ones resume) or choose another --out"
            )
        if state != "done":
            pending.append((run_dir, config.seed + r, state == "partial"))
    return pending


def _execute(
    jobs: Sequence[tuple[BabiConfig, Path, int, bool]],
    workers: int,
    on_done: Callable[[BabiConfig, Path], None],
    progress: bool = True,
) -> None:
    """Train runs, ``workers`` processes at a time (one torch thread each when > 1)."""
    bar: Any = None
    if progress and jobs:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(jobs), desc="bAbI runs", unit="run", file=sys.stderr)
        except ImportError:
            bar = None
    if workers <= 1:
        for config, run_dir, seed, resume in jobs:
            train_run(config, run_dir, seed, resume)
            on_done(config, run_dir)
            if bar is not None:
                bar.update(1)
    else:
        threads = max(1, torch.get_num_threads() // workers)
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            futures: dict[Future[Any], tuple[BabiConfig, Path]] = {}
            queue = list(jobs)
            while queue or futures:
                while queue and len(futures) < 2 * workers:
                    config, run_dir, seed, resume = queue.pop(0)
                    quiet = replace(config, progress=False)
                    future = pool.submit(
                        _run_worker, asdict(quiet), str(run_dir), seed, resume, threads
                    )
                    futures[future] = (config, run_dir)
                done, _ = wait(list(futures), return_when=FIRST_COMPLETED)
                for future in done:
                    config, run_dir = futures.pop(future)
                    future.result()  # re-raise a worker's error
                    on_done(config, run_dir)
                    if bar is not None:
                        bar.update(1)
    if bar is not None:
        bar.close()


def summarize(
    out_dir: str | Path, config: BabiConfig, predictions: bool = True
) -> dict[str, Any] | None:
    """Combine the finished runs of ``out_dir`` (their ``done.json``): the best run on
    validation gives Ans % (and its Fact %), the ``fact_runs`` best give the mean Fact %.
    Writes ``summary.json`` (and the best run's ``test_predictions.jsonl``); ``None`` when
    no run has finished."""
    out_dir = Path(out_dir)
    records = [json.loads(path.read_text()) for path in sorted(out_dir.glob("run_*/done.json"))]
    if not records:
        return None

    def key(r: dict[str, Any]) -> float:  # the rule that picked each run's best epoch
        valid = r["valid"] or {"ans": 0.0, "loss": 0.0}
        return _selection_metric(valid["ans"] / 100, valid["loss"])

    ranked = sorted(records, key=key, reverse=True)
    best = ranked[0]
    facts = [r["test"]["fact"] for r in ranked[: config.fact_runs]]
    fact = None if any(f is None for f in facts) else sum(facts) / len(facts)
    summary = {
        "task": config.task,
        "model": config.model,
        "hops": config.steps,
        "runs": len(records),
        "fact_runs": min(config.fact_runs, len(records)),
        "best_run": best["run"],
        "ans": best["test"]["ans"],
        "fact": fact,
        "best_run_fact": best["test"]["fact"],
        "valid_ans": best["valid"]["ans"] if best["valid"] else None,
        "seconds_per_run": sum(r["seconds"] for r in records) / len(records),
        "config": asdict(config),
        "run_scores": [
            {k: r[k] for k in ("run", "seed", "best_epoch", "seconds", "valid", "test")}
            for r in records
        ],
    }
    if predictions:
        model, vocab, run_config = load_trained(out_dir / best["run"], config.device)
        splits, _ = load_data(run_config)
        evaluate(model, splits["test"], vocab, config.device, out_dir / "test_predictions.jsonl")
    atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def train(
    config: BabiConfig, out_dir: str | Path, resume: bool = False, jobs: int = 1
) -> dict[str, Any]:
    """Train ``config.runs`` runs of one task and model into ``out_dir`` (``jobs`` processes
    in parallel) and summarize them (see :func:`summarize`)."""
    config.check()
    load_data(config)  # fail early on a missing data directory or task
    out_dir = Path(out_dir)
    pending = _pending_runs(config, out_dir, resume)
    _execute(
        [(config, d, s, r) for d, s, r in pending],
        jobs,
        lambda c, d: None,
        progress=config.progress and jobs > 1,
    )
    summary = summarize(out_dir, config)
    assert summary is not None
    return summary


# ---- the paper's table -----------------------------------------------------------------------
def _cell(ans: float | None, fact: float | None) -> str:
    a = "-" if ans is None else f"{ans:.1f}"
    f = "-" if fact is None else f"{fact:.1f}"
    return f"{a} / {f}"


def format_table(results: dict[int, dict[str, dict[str, Any]]]) -> str:
    """Markdown table ``results[task][model] = summary``: ours beside Table 4 (Ans % / Fact %)."""
    models = [m for m in TABLE_ORDER if any(m in row for row in results.values())]
    header = ["Task", "K"]
    for m in models:
        header += [f"{MODEL_NAMES[m]} (ours)", f"{MODEL_NAMES[m]} (paper)"]
    rows = []
    sums: dict[str, dict[str, list[float]]] = {
        m: {"ans": [], "fact": [], "pans": [], "pfact": []} for m in models
    }
    for task in sorted(results):
        row = [str(task), str(PAPER_HOPS.get(task, "-"))]
        for m in models:
            ours = results[task].get(m)
            paper = PAPER_TABLE4[m.replace("-", "_")].get(task)
            row.append(_cell(ours["ans"], ours["fact"]) if ours else "-")
            row.append(_cell(*paper) if paper else "-")
            if ours and paper:
                sums[m]["ans"].append(ours["ans"])
                sums[m]["pans"].append(paper[0])
                if task not in FACT_EXCLUDED_TASKS and ours["fact"] is not None:
                    sums[m]["fact"].append(ours["fact"])
                    sums[m]["pfact"].append(paper[1] or 0.0)
        rows.append(row)

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    average = ["AVERAGE", "-"]
    for m in models:
        s = sums[m]
        average += [
            _cell(mean(s["ans"]), mean(s["fact"])),
            _cell(mean(s["pans"]), mean(s["pfact"])),
        ]
    rows.append(average)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    printed = ", ".join(
        f"{MODEL_NAMES[m]} {_cell(*PAPER_TABLE4_AVERAGE[m.replace('-', '_')])}" for m in models
    )
    note = (
        "Cells: Ans % / Fact %. AVERAGE: over the tasks in the table (Fact %: without tasks 7, "
        f"8); the paper's printed averages over its 12 tasks: {printed}."
    )
    return "\n".join([line(header), sep, *(line(r) for r in rows), "", note])


def format_runs(results: dict[int, dict[str, dict[str, Any]]]) -> str:
    """Markdown table: runs finished per task and model, and the mean seconds per run."""
    models = [m for m in TABLE_ORDER if any(m in row for row in results.values())]
    lines = [
        "| Task | " + " | ".join(f"{MODEL_NAMES[m]} runs, s/run" for m in models) + " |",
        "|---|" + "---|" * len(models),
    ]
    for task in sorted(results):
        cells = []
        for m in models:
            r = results[task].get(m)
            cells.append(f"{r['runs']}, {r['seconds_per_run']:.1f}" if r else "-")
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def reproduce(
    config: BabiConfig,
    out_dir: str | Path,
    tasks: Sequence[int] = PAPER_TASKS,
    models: Sequence[str] = TABLE_ORDER,
    resume: bool = False,
    jobs: int = 1,
) -> dict[int, dict[str, dict[str, Any]]]:
    """Train every (task, model) of Table 4 into ``out_dir/task_NN/<model>`` (runs interleaved
    so every cell fills up evenly), update ``results.json`` as runs finish, print our table
    beside the paper's; returns ``results[task][model] = summary``."""
    out_dir = Path(out_dir)
    cells: dict[tuple[int, str], tuple[BabiConfig, Path]] = {}
    by_cell: list[list[tuple[BabiConfig, Path, int, bool]]] = []
    for task in tasks:
        for model in models:
            cell_config = replace(config, task=task, model=model)
            cell_config.check()
            load_data(cell_config)
            cell_dir = out_dir / f"task_{task:02d}" / model
            cells[(task, model)] = (cell_config, cell_dir)
            pending = _pending_runs(cell_config, cell_dir, resume)
            by_cell.append([(cell_config, d, s, r) for d, s, r in pending])
    # interleave: run 0 of every cell, then run 1, ...
    jobs_list = [
        cell[i]
        for i in range(max(map(len, by_cell), default=0))
        for cell in by_cell
        if i < len(cell)
    ]
    results: dict[int, dict[str, dict[str, Any]]] = {}
    started = time.time()

    def write_results() -> None:
        payload = {
            "tasks": list(tasks),
            "models": list(models),
            "seconds": time.time() - started,
            "results": {str(t): r for t, r in results.items()},
        }
        atomic_write_text(out_dir / "results.json", json.dumps(payload, indent=2) + "\n")
        text = format_table(results) + "\n\n" + format_runs(results) + "\n"
        atomic_write_text(out_dir / "table.md", text)

    def on_done(cell_config: BabiConfig, run_dir: Path) -> None:
        summary = summarize(run_dir.parent, cell_config, predictions=False)
        if summary is not None:
            results.setdefault(cell_config.task, {})[cell_config.model] = summary
            write_results()

    out_dir.mkdir(parents=True, exist_ok=True)
    for (task, model), (cell_config, cell_dir) in cells.items():  # runs finished earlier
        summary = summarize(cell_dir, cell_config, predictions=False)
        if summary is not None:
            results.setdefault(task, {})[model] = summary
    _execute(jobs_list, jobs, on_done, progress=config.progress)
    for (task, model), (cell_config, cell_dir) in cells.items():
        summary = summarize(cell_dir, cell_config, predictions=True)
        if summary is not None:
            results.setdefault(task, {})[model] = summary
    write_results()
    print(format_table(results))
    print()
    print(format_runs(results))
    for path in plot_results(results, out_dir):
        print(f"plot written to {path}")
    return results


def plot_results(results: dict[int, dict[str, dict[str, Any]]], out_dir: str | Path) -> list[Path]:
    """``ans.png`` and ``fact.png`` in ``out_dir``: our Ans % / Fact % per task and model as
    bars, the paper's as black ticks (nothing, with a message, without matplotlib)."""
    from .. import viz

    tasks = sorted(results)
    models = [m for m in TABLE_ORDER if any(m in row for row in results.values())]
    written = []
    for index, key, what in ((0, "ans", "answer accuracy"), (1, "fact", "fact-sequence accuracy")):
        shown = [t for t in tasks if key == "ans" or t not in FACT_EXCLUDED_TASKS]
        if not shown:
            continue
        ours = {
            MODEL_NAMES[m]: [results[t][m][key] if m in results[t] else None for t in shown]
            for m in models
        }
        paper = {
            MODEL_NAMES[m]: [
                PAPER_TABLE4[m.replace("-", "_")].get(t, (None, None))[index] for t in shown
            ]
            for m in models
        }
        try:
            written.append(
                viz.grouped_bars(
                    [f"task {t}" for t in shown],
                    ours,
                    Path(out_dir) / f"{key}.png",
                    reference=paper,
                    title=f"bAbI 1k, {what} (bars: ours; ticks: paper)",
                    ylabel="Ans %" if key == "ans" else "Fact %",
                )
            )
        except ImportError as error:
            print(f"no plots: {error}", file=sys.stderr)
            break
    return written


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
    from .. import viz

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
    batch = _Encoded([ex], vocab).batch([0], torch.device("cpu"))
    with torch.no_grad():
        result = _forward(model, batch)
        crf = result.distribution
        assert crf is not None
        n = len(ex.memory)
        scores, sequences = crf.topk(3)
        probs = (scores - crf.log_partition).exp()[:, 0].tolist()
        top = [(seq, p) for seq, p in zip(sequences[:, 0].tolist(), probs, strict=True)]
        predicted = vocab.tokens[int(result.logits.argmax(-1))]
        marginals = result.attention[0, :, :n]
        edges = crf.edge_marginals[0, :, :n, :n]
    labels = [
        f"{' '.join(words)} (line {line})"
        for line, words in zip(ex.memory_lines, ex.memory, strict=True)
    ]
    gold = " -> ".join("?" if i is None else str(i) for i in ex.support)
    gold_lines = " -> ".join(str(s) for s in ex.support_lines)
    path = Path(out) if out else Path(checkpoint) / f"figure5_{split}_{question}.png"
    if path.suffix == "" or path.is_dir():
        path = path / f"figure5_{split}_{question}.png"
    return viz.fact_chain_graph(
        marginals,
        edges,
        path,
        fact_labels=labels,
        top_sequences=top,
        question=" ".join(ex.question) + "?",
        answer=f"{ex.answer} (predicted {predicted}); supporting facts {gold} (lines {gold_lines})",
        title=f"bAbI task {config.task}, {MODEL_NAMES[config.model]}, K = {config.steps}",
    )


def default_out(config: BabiConfig) -> str:
    """``runs/babi/task_NN/<model>``."""
    return os.path.join("runs", "babi", f"task_{config.task:02d}", config.model)
