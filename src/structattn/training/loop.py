"""The training loop shared by every recipe.

A recipe hands :func:`fit` a :class:`Task` (the model and a few callables) and a
:class:`TrainConfig`; the loop does the rest: the optimiser (SGD, Adam or Adagrad) with
gradient clipping and an epoch-level learning-rate schedule (the papers' halving, or decay on
a validation plateau), the loss normalised per example or per token, truncated
backpropagation through time (a state carried from batch to batch), validation every epoch
or every N steps with best-model saving and early stopping, progress bars, a JSONL metrics
log (and TensorBoard when installed), atomic checkpoints with the model, optimiser,
schedule, carried state and RNG states, exact resumption (also mid-epoch), and
data-parallel training under ``torchrun`` (DDP; gloo on CPU, nccl on GPU).

What a run advances is one :class:`~structattn.training.state.TrainState` (which is what a
checkpoint holds); :func:`_train` drives a ``_Trainer`` whose small steps advance it:
``run_epoch`` (``train_step`` per batch, ``validate``, ``save``), then ``end_epoch``.

Run directory (files written by rename, see :mod:`structattn.training.run_dir`)::

    config.json       the recipe's configuration
    metrics.jsonl     one JSON object per logged step, validation, epoch and early stop
    checkpoint.pt     the latest full training state (for --resume), with the number of
                      metrics.jsonl lines it covers
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

from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig
from .optim import LRSchedule, PlateauSchedule
from .run_dir import (
    cut_metrics,
    notice,
    remove_stale_temp_files,
    repair_config,
    write_config,
)
from .state import CHECKPOINT_FORMAT, TrainState, map_tensors

__all__ = [
    "CHECKPOINT_FORMAT",
    "LRSchedule",
    "PlateauSchedule",
    "Task",
    "TrainConfig",
    "TrainState",
    "fit",
    "load_model_state",
]

Count = int | Tensor  # a number of examples or tokens (a 0-dim tensor avoids a device sync)


@dataclass
class Task:
    """What the loop needs from a recipe.

    ``batches(epoch)`` returns the global batches of an epoch (lists of examples), the same
    for the same epoch and seed on every rank; under DDP rank ``r`` of ``w`` takes
    ``examples[r::w]``. ``collate(examples, device)`` makes tensors.

    The loss is one of:

    - ``loss(model, batch) -> (loss_sum, examples, tokens)``: the loss summed over the batch,
      the number of examples and the number of tokens it sums over (ints or 0-dim tensors);
    - ``stateful_loss(model, batch, state) -> (loss_sum, examples, tokens, new_state)`` for
      truncated backpropagation through time: ``state`` is ``None`` at the first batch of
      each epoch and then what the previous batch returned, with every tensor detached (so
      gradients stop at the batch boundary). It is saved in mid-epoch checkpoints, so a state
      must be made of tensors, numbers, strings, ``None`` and plain tuples, lists and dicts of
      them (e.g. an LSTM's ``(h, c)``). Row ``i`` of the state belongs to example ``i`` of
      the local batch: keep each stream at the same position in every batch of an epoch.

    The loop divides ``loss_sum`` by the examples or tokens (``TrainConfig.normalize_by``),
    summed over DDP ranks. ``validate(model)`` returns metrics including ``"metric"``
    (higher is better); ``extra`` is saved in every checkpoint (e.g. the vocabulary);
    ``on_epoch_start(model, epoch)`` (1-based epoch) runs before each epoch, also the first
    one after a resume, so schedules such as linear start must depend on ``epoch`` and on
    ``state`` only. ``epoch_lr(epoch, lr)`` (after ``on_epoch_start``) returns the learning
    rate of an epoch given the schedule's (e.g. linear start's own rate). A task whose
    hooks keep a state between epochs (e.g. the validation losses so far) passes
    ``state = (get, set)``: ``get()`` returns it as plain numbers, strings, lists and dicts
    (saved in every checkpoint), ``set(saved)`` restores it on resume.
    """

    model: nn.Module
    batches: Callable[[int], Sequence[Sequence[Any]]]
    collate: Callable[[Sequence[Any], torch.device], Any]
    loss: Callable[[nn.Module, Any], tuple[Tensor, Count, Count]] | None = None
    validate: Callable[[nn.Module], dict[str, float]] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    on_epoch_start: Callable[[nn.Module, int], None] | None = None
    epoch_lr: Callable[[int, float], float] | None = None
    state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None
    stateful_loss: Callable[[nn.Module, Any, Any], tuple[Tensor, Count, Count, Any]] | None = None

    def __post_init__(self) -> None:
        if (self.loss is None) == (self.stateful_loss is None):
            raise ValueError("a Task needs exactly one of `loss` and `stateful_loss`")


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
    """Rank-0 metrics: JSONL file (with its line count, which checkpoints record), optional
    TensorBoard, optional progress bar. Lines are written once :meth:`open` is called."""

    def __init__(self, run_dir: Path, enabled: bool, progress: bool) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self.progress = progress and enabled
        self.file: TextIO | None = None
        self.writer: Any = None
        self.lines = 0  # lines in metrics.jsonl
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        except Exception:  # noqa: BLE001 - tensorboard is optional
            self.writer = None

    def open(self, lines: int) -> None:
        """Write after the first ``lines`` lines of metrics.jsonl (0: a new, empty file)."""
        if self.enabled:
            self.file = self.path.open("a" if lines else "w", encoding="utf-8")
            self.lines = lines

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled or self.file is None:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.lines += 1
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
def load_model_state(run_dir: str | os.PathLike[str], which: str = "model.pt") -> dict[str, Any]:
    """The saved best model (``model.pt``) or last state (``checkpoint.pt``) of a run."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / which
    return load_checkpoint(path)


def _scale_loss(
    loss_sum: Tensor, normalizer: str, world: int, examples: Count, tokens: Count
) -> Tensor:
    """The loss to differentiate. DDP averages gradients over the ``world`` ranks, so each
    rank's summed loss is scaled by ``world / count`` (``count`` summed over ranks): the
    gradient is then that of the global sum divided by the global count (or of the global sum,
    with ``normalizer="none"``)."""
    if normalizer == "none":
        return loss_sum * world
    count = examples if normalizer == "examples" else tokens
    if isinstance(count, Tensor):  # no device sync
        return loss_sum * (world / count.clamp(min=1)).to(loss_sum.dtype)
    return loss_sum * (world / max(count, 1))


def fit(
    task: Task, config: TrainConfig, run_dir: str | os.PathLike[str], resume: bool = False
) -> dict[str, Any]:
    """Train ``task.model``; returns a summary: the best validation metrics (``"best"``, with
    the epoch, and the step when ``eval_every`` is set), ``"epochs"``, ``"seconds"``, and with
    ``patience`` also ``"stopped"`` (``{"epoch", "step"}`` of an early stop, or ``None``)."""
    if task.validate is None:
        for name, needed in (
            ("lr_schedule", config.lr_schedule == "plateau"),
            ("eval_every", config.eval_every is not None),
            ("patience", config.patience is not None),
        ):
            if needed:
                raise ValueError(
                    f"TrainConfig.{name}={getattr(config, name)!r} needs a validation metric, "
                    "but the task has no `validate`"
                )
    rank, world, created_group = _distributed()
    try:
        device = _device(config.device)
        if device.type == "cuda" and world > 1:
            torch.cuda.set_device(device)  # collectives of Python objects use this device
        logger = _Logger(Path(run_dir), enabled=rank == 0, progress=config.progress)
        try:
            summary = _train(task, config, Path(run_dir), resume, rank, world, device, logger)
        finally:
            logger.close()
    except BaseException:
        if created_group:
            dist.destroy_process_group()
        raise
    if created_group:
        dist.barrier()
        dist.destroy_process_group()
    return summary


# ---- the loop ----------------------------------------------------------------------------
def _train(
    task: Task,
    config: TrainConfig,
    run_dir: Path,
    resume: bool,
    rank: int,
    world: int,
    device: torch.device,
    logger: _Logger,
) -> dict[str, Any]:
    """The loop itself (:func:`fit` sets up and tears down the process group and logger)."""
    trainer = _Trainer.start(task, config, run_dir, resume, rank, world, device, logger)
    state = trainer.state
    while state.epoch <= config.epochs and state.stopped is None:
        trainer.run_epoch()
    if task.validate is None:  # no model selection: the last model is the model
        trainer.save_model(config.epochs, {})
    summary: dict[str, Any] = {
        "best": state.best,
        "epochs": config.epochs,
        "seconds": time.time() - trainer.started,
    }
    if config.patience is not None:
        summary["stopped"] = state.stopped
    return summary


@dataclass
class _Trainer:
    """One process's part of a run: what stays fixed (the task, the settings, the outputs,
    this process's rank) and the :class:`TrainState` that its steps advance. Every rank
    holds one; rank 0 alone writes files."""

    task: Task
    config: TrainConfig
    run_dir: Path
    rank: int
    world: int
    device: torch.device
    logger: _Logger
    state: TrainState
    train_model: nn.Module  # the model, or its DistributedDataParallel wrapper
    started: float = field(default_factory=time.time)

    @classmethod
    def start(
        cls,
        task: Task,
        config: TrainConfig,
        run_dir: Path,
        resume: bool,
        rank: int,
        world: int,
        device: torch.device,
        logger: _Logger,
    ) -> _Trainer:
        """A new run in ``run_dir``, or (``resume``) the one its ``checkpoint.pt`` holds,
        with ``metrics.jsonl`` cut back to the lines the checkpoint covers (the rest is
        redone); a resume without a checkpoint starts afresh, with a notice. Rank 0 first
        removes the temporary files that a killed run left."""
        model = task.model.to(device)
        path = run_dir / "checkpoint.pt"
        if rank == 0:
            remove_stale_temp_files(run_dir)
            if resume and not path.exists():
                notice(f"no checkpoint in {run_dir} to resume from: the run starts afresh")
        if resume and path.exists():
            saved = load_checkpoint(path)
            state = TrainState.from_checkpoint(
                saved, model, config, path=path, rank=rank, world=world, device=device
            )
            if task.state is not None:
                task.state[1](saved.get("task_state"))
            if rank == 0:  # forget what was logged after this checkpoint: it is redone
                logger.open(cut_metrics(logger.path, state.metric_lines, state.step))
                repair_config(run_dir, saved.get("config", task.config))
        else:
            state = TrainState.start(model, config)
            if rank == 0:
                write_config(run_dir, task.config)
                logger.open(0)
        train_model: nn.Module = model
        if world > 1:
            ids = [device.index] if device.type == "cuda" else None
            train_model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        return cls(task, config, run_dir, rank, world, device, logger, state, train_model)

    def run_epoch(self) -> None:
        """Train the rest of epoch ``state.epoch`` (from batch ``state.batch``), validating
        and checkpointing as configured, then :meth:`end_epoch` (unless stopped early)."""
        state, config = self.state, self.config
        lr = self._begin_epoch()
        batches = self.task.batches(state.epoch)
        bar = self.logger.bar(len(batches), state.batch, f"epoch {state.epoch}/{config.epochs}")
        window_tokens, window_start = 0, time.time()  # throughput since the last metric line
        for index in range(state.batch, len(batches)):
            loss, tokens = self.train_step(batches[index], index)
            window_tokens += tokens
            rate = window_tokens / max(time.time() - window_start, 1e-9)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.3g}", tok_s=f"{rate:.0f}")
            if state.step % config.log_every == 0:
                self.log("train", loss=loss, lr=lr, tokens_per_s=rate)
                window_tokens, window_start = 0, time.time()
            if config.eval_every and state.step % config.eval_every == 0:
                self.validate_and_log()
            if state.stopped is not None or (
                config.checkpoint_every and state.step % config.checkpoint_every == 0
            ):
                self.save()
            if state.stopped is not None:
                break
        if bar is not None:
            bar.close()
        if state.stopped is None:
            self.end_epoch(lr)
        else:
            self.say_stopped()

    def _begin_epoch(self) -> float:
        """The task's epoch hook, then the epoch's learning rate (returned) set in the
        optimiser; the model in training mode."""
        state, task = self.state, self.task
        if task.on_epoch_start is not None:
            task.on_epoch_start(state.model, state.epoch)
        lr = state.schedule.lr
        if task.epoch_lr is not None:
            lr = task.epoch_lr(state.epoch, lr)
        for group in state.optimizer.param_groups:
            group["lr"] = lr
        state.model.train()
        return lr

    def train_step(self, examples: Sequence[Any], index: int) -> tuple[float, int]:
        """One optimiser step on global batch ``index``; adds the batch's summed loss and
        its examples or tokens (over all ranks) to the epoch's. Returns the batch's loss per
        example or token, and its tokens."""
        state, config, world = self.state, self.config, self.world
        loss_sum, n_examples, n_tokens = self._forward(examples, index)
        totals = self._sum_over_ranks(loss_sum, n_examples, n_tokens) if world > 1 else None
        if totals is not None:
            n_examples, n_tokens = totals[1], totals[2]
        loss = _scale_loss(loss_sum, config.loss_normalizer, world, n_examples, n_tokens)
        state.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(state.model.parameters(), config.max_grad_norm)
        state.optimizer.step()
        state.step, state.batch = state.step + 1, index + 1
        if totals is not None:
            value, examples_f, tokens_f = totals.tolist()
            batch_examples, batch_tokens = round(examples_f), round(tokens_f)
        else:
            value = float(loss_sum.detach())
            batch_examples, batch_tokens = int(n_examples), int(n_tokens)
        if not math.isfinite(value):
            raise FloatingPointError(
                f"training loss is {value} at epoch {state.epoch}, step {state.step}"
            )
        count = batch_tokens if config.loss_normalizer == "tokens" else batch_examples
        state.epoch_loss = (state.epoch_loss[0] + value, state.epoch_loss[1] + count)
        return value / max(count, 1), batch_tokens

    def _forward(self, examples: Sequence[Any], index: int) -> tuple[Tensor, Count, Count]:
        """This rank's part of global batch ``index`` (every ``world``-th example): its
        summed loss, examples and tokens; a carried state goes on, detached."""
        task, world = self.task, self.world
        local = examples[self.rank :: world]
        if not local:
            raise ValueError(f"batch {index} has {len(examples)} examples for {world} ranks")
        batch = task.collate(local, self.device)
        if task.stateful_loss is None:
            assert task.loss is not None
            return task.loss(self.train_model, batch)
        loss_sum, n_examples, n_tokens, carry = task.stateful_loss(
            self.train_model, batch, self.state.carry
        )
        self.state.carry = map_tensors(Tensor.detach, carry)  # truncate backpropagation here
        return loss_sum, n_examples, n_tokens

    def _sum_over_ranks(self, loss_sum: Tensor, examples: Count, tokens: Count) -> Tensor:
        """``[loss, examples, tokens]`` summed over the ranks (float64; one collective, before
        backward)."""
        totals = torch.stack(
            [
                torch.as_tensor(x, dtype=torch.float64, device=self.device)
                for x in (loss_sum.detach(), examples, tokens)
            ]
        )
        dist.all_reduce(totals)
        return totals

    def log(self, kind: str, **values: Any) -> None:
        """A metrics line of this epoch and step."""
        state = self.state
        self.logger.log({"kind": kind, "epoch": state.epoch, "step": state.step, **values})

    def validate(self) -> dict[str, float]:
        """Validate; keep the best model (``model.pt``); count validations without a new
        best."""
        state, config = self.state, self.config
        assert self.task.validate is not None
        state.model.eval()
        with torch.no_grad():
            metrics = self.task.validate(state.model)
        state.model.train()
        metric = metrics.get("metric")
        if metric is not None:
            if not state.best or metric > state.best.get("metric", -math.inf):
                where = {"epoch": state.epoch}
                if config.eval_every:
                    where["step"] = state.step
                state.best = {**where, **metrics}
                self.save_model(state.epoch, metrics)
                state.bad_evals = 0
            else:
                state.bad_evals += 1
        state.last_eval = {"step": state.step, "metrics": metrics}
        return metrics

    def validate_and_log(self) -> None:
        """A validation between two steps (``eval_every``): logged, and maybe an early stop."""
        self.log("eval", **_prefixed(self.validate()))
        if self.should_stop():
            self.stop()

    def end_epoch(self, lr: float) -> None:
        """After an epoch's last batch: validate (unless the last step just did), log the
        epoch, step the schedule, check early stopping, checkpoint the next epoch's start."""
        state, config = self.state, self.config
        epoch, metrics = state.epoch, {}
        if self.task.validate is not None:
            last = state.last_eval
            if config.eval_every and last is not None and last["step"] == state.step:
                metrics = last["metrics"]  # validated at this very step already
            else:
                metrics = self.validate()
        loss, count = state.epoch_loss
        values = {"train_loss": loss / max(count, 1), "lr": lr, "time": time.time() - self.started}
        values.update(_prefixed(metrics))
        self.log("epoch", **values)
        if self.rank == 0 and config.epoch_lines:
            shown = ", ".join(f"{k} {v:.4g}" for k, v in values.items() if isinstance(v, float))
            print(
                f"{self.prefix}epoch {epoch}/{config.epochs}: {shown}", file=sys.stderr, flush=True
            )
        state.schedule.step(epoch, metrics.get("metric"))  # the next epoch's lr: at its start
        stop = self.should_stop()
        state.next_epoch()
        if stop:
            self.stop(epoch)
        self.save()
        if stop:
            self.say_stopped()

    def should_stop(self) -> bool:
        """Early stopping: ``patience`` validations in a row without a new best."""
        if self.config.patience is None:
            return False
        stop = self.state.bad_evals >= self.config.patience
        if self.world > 1:  # every rank validates on its own: follow rank 0
            flag = torch.tensor([float(stop)], device=self.device)
            dist.broadcast(flag, src=0)
            stop = bool(flag.item())
        return stop

    def stop(self, epoch: int | None = None) -> None:
        """Stop early in ``epoch`` (default: the current one) at this step, and log it (before
        the checkpoint that records the stop, which so covers the line)."""
        state = self.state
        epoch = state.epoch if epoch is None else epoch
        state.stopped = {"epoch": epoch, "step": state.step}
        self.logger.log({"kind": "stop", **state.stopped, "bad_evals": state.bad_evals})

    def say_stopped(self) -> None:
        """The early stop's line on stderr (after the progress bar is gone)."""
        state = self.state
        if self.rank == 0 and self.config.epoch_lines and state.stopped is not None:
            epoch, step = state.stopped["epoch"], state.stopped["step"]
            print(
                f"{self.prefix}early stop at epoch {epoch}, step {step}: no new best in "
                f"{state.bad_evals} validations (best: epoch {state.best.get('epoch')})",
                file=sys.stderr,
                flush=True,
            )

    @property
    def prefix(self) -> str:
        return f"[{self.config.name}] " if self.config.name else ""

    def save(self) -> None:
        """Checkpoint the state (``checkpoint.pt``): every rank hands rank 0 its carried
        state mid-epoch; rank 0 writes, with the task's state, config and extras."""
        state, task = self.state, self.task
        carried = None
        if task.stateful_loss is not None and state.batch > 0:
            carried = self._gather_carry()
        if self.rank != 0:
            return
        state.metric_lines = self.logger.lines
        checkpoint = state.to_checkpoint(carried)
        checkpoint["task_state"] = None if task.state is None else task.state[0]()
        checkpoint["config"], checkpoint["extra"] = task.config, task.extra
        save_checkpoint(self.run_dir / "checkpoint.pt", checkpoint)

    def _gather_carry(self) -> list[Any] | None:
        """Every rank's carried state, on the CPU, in rank order (on rank 0; None elsewhere)."""
        local = map_tensors(lambda t: t.detach().cpu(), self.state.carry)
        if self.world == 1:
            return [local]
        gathered: list[Any] = [None] * self.world
        dist.gather_object(local, gathered if self.rank == 0 else None, dst=0)
        return gathered if self.rank == 0 else None

    def save_model(self, epoch: int, metrics: dict[str, float]) -> None:
        """The model for eval/viz (``model.pt``): weights, config, extras, its validation."""
        if self.rank != 0:
            return
        save_checkpoint(
            self.run_dir / "model.pt",
            {
                "format": CHECKPOINT_FORMAT,
                "model": self.state.model.state_dict(),
                "config": self.task.config,
                "extra": self.task.extra,
                "epoch": epoch,
                "step": self.state.step,
                "valid": metrics,
            },
        )


def _prefixed(metrics: dict[str, float]) -> dict[str, float]:
    """Validation metrics as logged: ``valid_<name>``."""
    return {f"valid_{k}": v for k, v in metrics.items()}
