"""The training loop shared by every recipe.

A recipe hands :func:`fit` a :class:`Task` (the model and a few callables) and a
:class:`TrainConfig`; the loop does the rest: SGD with gradient clipping and the papers'
learning-rate halving, progress bars, a JSONL metrics log (and TensorBoard when installed),
atomic checkpoints with model/optimiser/schedule/RNG states, exact resumption, and
data-parallel training under ``torchrun`` (DDP; gloo on CPU, nccl on GPU).

Run directory::

    config.json       the recipe's configuration
    metrics.jsonl     one JSON object per logged step and per epoch
    checkpoint.pt     the latest full training state (for --resume)
    model.pt          the best model on validation (for eval/viz)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .checkpoint import (
    CheckpointError,
    get_rng_state,
    load_checkpoint,
    save_checkpoint,
    set_rng_state,
)

__all__ = ["CHECKPOINT_FORMAT", "LRSchedule", "Task", "TrainConfig", "fit", "load_model_state"]

CHECKPOINT_FORMAT = "structattn-checkpoint-v1"


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings (the recipe fills them from its paper's values)."""

    epochs: int  # number of passes over the training data
    lr: float  # initial SGD learning rate
    max_grad_norm: float | None = None  # clip the global gradient norm (None: no clipping)
    decay_factor: float = 0.5  # multiply the lr by this when decaying
    decay_start: int | None = None  # decay after every epoch >= this one (1-based)
    decay_on_plateau: bool = False  # also start decaying once validation stops improving
    decay_every: int | None = None  # or decay every this many epochs (bAbI: 25)
    seed: int = 0  # seeds model init, data order and dropout
    log_every: int = 50  # steps between metric lines
    checkpoint_every: int | None = None  # also checkpoint every this many steps mid-epoch
    device: str = "cpu"  # "cpu" or "cuda" ("cuda:N" under torchrun picks LOCAL_RANK)
    progress: bool = True  # show a progress bar (rank 0 only)
    name: str = ""  # prefix of the per-epoch summary lines on stderr
    epoch_lines: bool = True  # print a summary line per epoch on stderr (rank 0)
    sum_loss: bool = False  # step on the batch's summed loss, not its mean (MemN2N's convention)


class LRSchedule:
    """The papers' schedule: halve the lr after each epoch from ``decay_start`` on, or from the
    first epoch whose validation metric did not improve (whichever comes first), or every
    ``decay_every`` epochs."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.lr = config.lr
        self.decaying = False
        self.best: float | None = None

    def step(self, epoch: int, metric: float | None) -> float:
        """Update after ``epoch`` (1-based) with its validation metric (higher is better)."""
        c = self.config
        improved = metric is not None and (self.best is None or metric > self.best)
        if improved:
            self.best = metric
        if c.decay_start is not None and epoch >= c.decay_start:
            self.decaying = True
        if c.decay_on_plateau and metric is not None and not improved:
            self.decaying = True
        if self.decaying or (c.decay_every and epoch % c.decay_every == 0):
            self.lr *= c.decay_factor
        return self.lr

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "decaying": self.decaying, "best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr, self.decaying, self.best = state["lr"], state["decaying"], state["best"]


@dataclass
class Task:
    """What the loop needs from a recipe.

    ``batches(epoch)`` returns the global batches of an epoch (lists of examples), the same
    for the same epoch and seed on every rank; ``collate(examples, device)`` makes tensors;
    ``loss(model, batch)`` returns (summed loss, number of examples it sums over, number of
    tokens for throughput); ``validate(model)`` returns metrics including ``"metric"``
    (higher is better); ``extra`` is saved in every checkpoint (e.g. the vocabulary);
    ``on_epoch_start(model, epoch)`` (1-based epoch) runs before each epoch, also the first
    one after a resume, so schedules such as linear start must depend on ``epoch`` only.
    """

    model: nn.Module
    batches: Callable[[int], Sequence[Sequence[Any]]]
    collate: Callable[[Sequence[Any], torch.device], Any]
    loss: Callable[[nn.Module, Any], tuple[Tensor, int, int]]
    validate: Callable[[nn.Module], dict[str, float]] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    on_epoch_start: Callable[[nn.Module, int], None] | None = None


# ---- distributed helpers ----------------------------------------------------------------------
def _distributed() -> tuple[int, int, bool]:
    """(rank, world size, whether we created the process group); initialises the process
    group under torchrun (nccl with CUDA, gloo otherwise; STRUCTATTN_BACKEND overrides)."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1:
        return 0, 1, False
    created = False
    if not dist.is_initialized():
        default = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(os.environ.get("STRUCTATTN_BACKEND", default))
        created = True
    return dist.get_rank(), dist.get_world_size(), created


def _device(name: str) -> torch.device:
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError("`device` is 'cuda' but CUDA is not available")
        if "LOCAL_RANK" in os.environ and ":" not in name:
            return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    elif name != "cpu":
        raise ValueError(f"`device` must be 'cpu' or 'cuda[:N]', got {name!r}")
    return torch.device(name)


# ---- logging --------------------------------------------------------------------------------
class _Logger:
    """Rank-0 metrics: JSONL file, optional TensorBoard, optional progress bar."""

    def __init__(self, run_dir: Path, enabled: bool, progress: bool) -> None:
        self.enabled = enabled
        self.progress = progress and enabled
        self.file: TextIO | None = None
        self.writer: Any = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = (run_dir / "metrics.jsonl").open("a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        except Exception:  # noqa: BLE001 - tensorboard is optional
            self.writer = None

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled or self.file is None:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            step = record.get("step", 0)
            for key, value in record.items():
                if isinstance(value, int | float) and key not in ("step", "epoch"):
                    self.writer.add_scalar(f"{record.get('kind', 'train')}/{key}", value, step)

    def bar(self, total: int, initial: int, description: str) -> Any:
        if not self.progress:
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return None
        return tqdm(total=total, initial=initial, desc=description, file=sys.stderr, leave=False)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()


# ---- checkpoints -------------------------------------------------------------------------------
def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _truncate_log(path: Path, step: int) -> None:
    """Keep the metric lines up to ``step`` (the last checkpoint's)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the crash
            continue
        if record.get("step", 0) <= step:
            kept.append(line)
    path.write_text("".join(x + "\n" for x in kept))


def load_model_state(run_dir: str | os.PathLike[str], which: str = "model.pt") -> dict[str, Any]:
    """The saved best model (``model.pt``) or last state (``checkpoint.pt``) of a run."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / which
    return load_checkpoint(path)


def fit(
    task: Task, config: TrainConfig, run_dir: str | os.PathLike[str], resume: bool = False
) -> dict[str, Any]:
    """Train ``task.model``; returns a summary (best validation metrics, epochs, time)."""
    run_dir = Path(run_dir)
    rank, world, created_group = _distributed()
    device = _device(config.device)
    logger = _Logger(run_dir, enabled=rank == 0, progress=config.progress)
    model = task.model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    schedule = LRSchedule(config)
    start_epoch, start_batch, step = 1, 0, 0
    best: dict[str, float] = {}
    if resume:
        state = load_checkpoint(run_dir / "checkpoint.pt")
        if state.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{run_dir / 'checkpoint.pt'} has an unknown format")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        set_rng_state(state["rng"])
        start_epoch, start_batch, step = state["epoch"], state["batch"], state["step"]
        best = state["best"]
        if rank == 0:  # forget what was logged after this checkpoint: it is redone
            _truncate_log(run_dir / "metrics.jsonl", step)
    elif rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(task.config, indent=2) + "\n")
        (run_dir / "metrics.jsonl").write_text("")
    for group in optimizer.param_groups:
        group["lr"] = schedule.lr
    train_model: nn.Module = model
    if world > 1:
        train_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )

    def checkpoint(epoch: int, batch: int) -> None:
        if rank != 0:
            return
        save_checkpoint(
            run_dir / "checkpoint.pt",
            {
                "format": CHECKPOINT_FORMAT,
                "model": _unwrap(model).state_dict(),
                "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(),
                "rng": get_rng_state(),
                "epoch": epoch,
                "batch": batch,
                "step": step,
                "best": best,
                "config": task.config,
                "extra": task.extra,
            },
        )

    def save_model(epoch: int, metrics: dict[str, float]) -> None:
        """The model for eval/viz (``model.pt``): weights, config, extras, its validation."""
        if rank != 0:
            return
        save_checkpoint(
            run_dir / "model.pt",
            {
                "format": CHECKPOINT_FORMAT,
                "model": _unwrap(model).state_dict(),
                "config": task.config,
                "extra": task.extra,
                "epoch": epoch,
                "valid": metrics,
            },
        )

    started = time.time()
    for epoch in range(start_epoch, config.epochs + 1):
        if task.on_epoch_start is not None:
            task.on_epoch_start(_unwrap(model), epoch)
        model.train()
        batches = task.batches(epoch)
        bar = logger.bar(len(batches), start_batch, f"epoch {epoch}/{config.epochs}")
        total_loss, total_examples, window_tokens, window_start = 0.0, 0, 0, time.time()
        for index in range(start_batch, len(batches)):
            examples = batches[index]
            local = examples[rank::world]
            if not local:
                raise ValueError(f"batch {index} has {len(examples)} examples for {world} ranks")
            batch = task.collate(local, device)
            loss_sum, _, tokens = task.loss(train_model, batch)
            # DDP averages gradients over ranks: scale so the result is the global mean (sum)
            loss = loss_sum * (world if config.sum_loss else world / len(examples))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if config.max_grad_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            step += 1
            value = loss_sum.detach()
            if world > 1:
                dist.all_reduce(value)
            value_f = float(value)
            if not math.isfinite(value_f):
                raise FloatingPointError(
                    f"training loss is {value_f} at epoch {epoch}, step {step}"
                )
            total_loss += value_f
            total_examples += len(examples)
            window_tokens += tokens * world
            if bar is not None:
                bar.update(1)
                rate = window_tokens / max(time.time() - window_start, 1e-9)
                bar.set_postfix(
                    loss=f"{value_f / len(examples):.3f}",
                    lr=f"{schedule.lr:.3g}",
                    tok_s=f"{rate:.0f}",
                )
            if step % config.log_every == 0:
                now = time.time()
                logger.log(
                    {
                        "kind": "train",
                        "epoch": epoch,
                        "step": step,
                        "loss": value_f / len(examples),
                        "lr": schedule.lr,
                        "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                    }
                )
                window_tokens, window_start = 0, now
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                checkpoint(epoch, index + 1)
        if bar is not None:
            bar.close()
        start_batch = 0
        metrics: dict[str, float] = {}
        if task.validate is not None:
            model.eval()
            with torch.no_grad():
                metrics = task.validate(_unwrap(model))
            model.train()
        metric = metrics.get("metric")
        if metric is not None and (not best or metric > best.get("metric", -math.inf)):
            best = {"epoch": epoch, **metrics}
            save_model(epoch, metrics)
        record = {
            "kind": "epoch",
            "epoch": epoch,
            "step": step,
            "train_loss": total_loss / max(total_examples, 1),
            "lr": schedule.lr,
            "time": time.time() - started,
            **{f"valid_{k}": v for k, v in metrics.items()},
        }
        logger.log(record)
        if rank == 0 and config.epoch_lines:
            shown = ", ".join(f"{k} {v:.4g}" for k, v in record.items() if isinstance(v, float))
            prefix = f"[{config.name}] " if config.name else ""
            print(f"{prefix}epoch {epoch}/{config.epochs}: {shown}", file=sys.stderr, flush=True)
        lr = schedule.step(epoch, metric)
        for group in optimizer.param_groups:
            group["lr"] = lr
        checkpoint(epoch + 1, 0)
    if task.validate is None:  # no model selection: the last model is the model
        save_model(config.epochs, {})
    logger.close()
    if created_group:
        dist.barrier()
        dist.destroy_process_group()
    return {"best": best, "epochs": config.epochs, "seconds": time.time() - started}
