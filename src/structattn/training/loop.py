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
from typing import Any, Literal, TextIO

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
    """Optimisation settings (the recipe fills them from its paper's values).

    The defaults are plain SGD with the papers' step schedule and the loss averaged over a
    batch's examples. Every field is checked in ``__post_init__`` (``ValueError``); a field
    that only applies to another optimiser or schedule must keep its default.
    """

    epochs: int  # number of passes over the training data
    lr: float  # initial learning rate
    max_grad_norm: float | None = None  # clip the global gradient norm (None: no clipping)
    decay_factor: float = 0.5  # multiply the lr by this when decaying (every schedule)
    decay_start: int | None = None  # "step": decay after every epoch >= this one (1-based)
    decay_on_plateau: bool = False  # "step": also start decaying once validation stops improving
    decay_every: int | None = None  # "step": or decay every this many epochs (bAbI: 25)
    seed: int = 0  # seeds model init, data order and dropout
    log_every: int = 50  # steps between metric lines
    checkpoint_every: int | None = None  # also checkpoint every this many steps mid-epoch
    device: str = "cpu"  # "cpu" or "cuda" ("cuda:N" under torchrun picks LOCAL_RANK)
    progress: bool = True  # show a progress bar (rank 0 only)
    name: str = ""  # prefix of the per-epoch summary lines on stderr
    epoch_lines: bool = True  # print a summary line per epoch on stderr (rank 0)
    sum_loss: bool = False  # step on the batch's summed loss, not its mean (MemN2N's convention)
    # ---- optimiser (the defaults are plain SGD, as before these fields existed) ----
    optimizer: Literal["sgd", "adam", "adagrad"] = "sgd"  # torch.optim.SGD / Adam / Adagrad
    momentum: float = 0.0  # "sgd" only: momentum
    weight_decay: float = 0.0  # L2 penalty added to the gradient (every optimiser)
    betas: tuple[float, float] = (0.9, 0.999)  # "adam" only: decay rates of the moments
    eps: float | None = None  # "adam"/"adagrad": denominator term (None: torch's 1e-8 / 1e-10)
    initial_accumulator_value: float = 0.0  # "adagrad" only: initial sum of squares (SAN: 0.1)
    # ---- learning-rate schedule, updated after each epoch from its validation metric ----
    lr_schedule: Literal["step", "plateau"] = "step"  # "step": decay_start / decay_on_plateau /
    # decay_every as above (the default, unchanged); "plateau": multiply by decay_factor after
    # each epoch whose validation metric does not improve significantly (ReduceLROnPlateau)
    plateau_threshold: float = 0.0  # "plateau": improving means beating the reference by > this
    plateau_threshold_mode: Literal["abs", "rel"] = "abs"  # "plateau": threshold in metric
    # units ("abs"), or as a fraction of |reference| ("rel")
    plateau_reference: Literal["best", "previous"] = "best"  # "plateau": compare with the best
    # epoch so far (PyTorch, PRPN) or with the previous epoch (OpenNMT's "does not decrease")
    plateau_patience: int = 0  # "plateau": non-improving epochs tolerated before each decay
    min_lr: float = 0.0  # never decay the lr below this (every schedule)
    # ---- loss ----
    normalize_by: Literal["examples", "tokens", "none"] = "examples"  # divide the batch's
    # summed loss by the examples or tokens the task counts (summed over DDP ranks), or not at
    # all ("none", the same as sum_loss=True)
    # ---- evaluation and stopping ----
    eval_every: int | None = None  # also validate every this many steps (None: per epoch only)
    patience: int | None = None  # stop after this many validations in a row without a new best

    def __post_init__(self) -> None:
        def fail(message: str) -> None:
            raise ValueError(f"TrainConfig: {message}")

        def choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
            if value not in allowed:
                fail(f"`{name}` must be one of {allowed}, got {value!r}")

        def positive_or_none(name: str, value: float | None) -> None:
            if value is not None and not value > 0:
                fail(f"`{name}` must be positive or None, got {value!r}")

        if self.epochs < 0:
            fail(f"`epochs` must be >= 0, got {self.epochs}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            fail(f"`lr` must be a positive number, got {self.lr!r}")
        positive_or_none("max_grad_norm", self.max_grad_norm)
        if not 0 < self.decay_factor <= 1:
            fail(f"`decay_factor` must be in (0, 1], got {self.decay_factor!r}")
        for name in ("decay_start", "decay_every", "checkpoint_every", "eval_every", "patience"):
            value = getattr(self, name)
            if value is not None and value < 1:
                fail(f"`{name}` must be >= 1 or None, got {value!r}")
        if self.log_every < 1:
            fail(f"`log_every` must be >= 1, got {self.log_every!r}")
        choice("optimizer", self.optimizer, ("sgd", "adam", "adagrad"))
        choice("lr_schedule", self.lr_schedule, ("step", "plateau"))
        choice("plateau_threshold_mode", self.plateau_threshold_mode, ("abs", "rel"))
        choice("plateau_reference", self.plateau_reference, ("best", "previous"))
        choice("normalize_by", self.normalize_by, ("examples", "tokens", "none"))
        if self.momentum < 0 or self.weight_decay < 0 or self.initial_accumulator_value < 0:
            fail("`momentum`, `weight_decay` and `initial_accumulator_value` must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            fail(f"`betas` must be two numbers in [0, 1), got {self.betas!r}")
        positive_or_none("eps", self.eps)
        only = {  # field -> (default, the optimiser or schedule it belongs to)
            "momentum": (0.0, self.optimizer == "sgd", 'optimizer="sgd"'),
            "betas": ((0.9, 0.999), self.optimizer == "adam", 'optimizer="adam"'),
            "eps": (None, self.optimizer != "sgd", 'optimizer="adam" or "adagrad"'),
            "initial_accumulator_value": (
                0.0,
                self.optimizer == "adagrad",
                'optimizer="adagrad"',
            ),
            "decay_start": (None, self.lr_schedule == "step", 'lr_schedule="step"'),
            "decay_on_plateau": (False, self.lr_schedule == "step", 'lr_schedule="step"'),
            "decay_every": (None, self.lr_schedule == "step", 'lr_schedule="step"'),
            "plateau_threshold": (0.0, self.lr_schedule == "plateau", 'lr_schedule="plateau"'),
            "plateau_threshold_mode": (
                "abs",
                self.lr_schedule == "plateau",
                'lr_schedule="plateau"',
            ),
            "plateau_reference": ("best", self.lr_schedule == "plateau", 'lr_schedule="plateau"'),
            "plateau_patience": (0, self.lr_schedule == "plateau", 'lr_schedule="plateau"'),
        }
        for name, (default, applies, owner) in only.items():
            value = getattr(self, name)
            if not applies and (tuple(value) if name == "betas" else value) != default:
                fail(f"`{name}` only applies with {owner} (got {name}={value!r})")
        if self.plateau_threshold < 0 or self.plateau_patience < 0:
            fail("`plateau_threshold` and `plateau_patience` must be >= 0")
        if not 0 <= self.min_lr <= self.lr:
            fail(f"`min_lr` must be in [0, lr], got {self.min_lr!r}")
        if self.sum_loss and self.normalize_by == "tokens":
            fail(
                '`sum_loss=True` is normalize_by="none"; do not set both '
                f"(got normalize_by={self.normalize_by!r})"
            )

    @property
    def loss_normalizer(self) -> str:
        """What the batch's summed loss is divided by: "examples", "tokens" or "none"."""
        return "none" if self.sum_loss else self.normalize_by


_NEW_FIELDS = (
    "optimizer", "momentum", "weight_decay", "betas", "eps", "initial_accumulator_value",
    "lr_schedule", "plateau_threshold", "plateau_threshold_mode", "plateau_reference",
    "plateau_patience", "min_lr", "normalize_by", "eval_every", "patience",
)  # fmt: skip


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
    defaults = TrainConfig(epochs=config.epochs, lr=config.lr)
    for name in _NEW_FIELDS:  # interim: the loop behind these fields is being written
        if getattr(config, name) != getattr(defaults, name):
            raise NotImplementedError(f"TrainConfig.{name} is not implemented yet")
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
