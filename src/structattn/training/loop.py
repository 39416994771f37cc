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

Run directory::

    config.json       the recipe's configuration
    metrics.jsonl     one JSON object per logged step, validation and epoch
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
from .config import TrainConfig
from .optim import LRSchedule, PlateauSchedule, make_optimizer, make_schedule

__all__ = [
    "CHECKPOINT_FORMAT",
    "LRSchedule",
    "PlateauSchedule",
    "Task",
    "TrainConfig",
    "fit",
    "load_model_state",
]

CHECKPOINT_FORMAT = "structattn-checkpoint-v1"

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


def _map_tensors(fn: Callable[[Tensor], Tensor], state: Any) -> Any:
    """``state`` with ``fn`` applied to every tensor in it (plain tuples, lists and dicts)."""
    if isinstance(state, Tensor):
        return fn(state)
    if type(state) in (tuple, list):
        return type(state)(_map_tensors(fn, x) for x in state)
    if type(state) is dict:
        return {key: _map_tensors(fn, value) for key, value in state.items()}
    if state is None or isinstance(state, bool | int | float | str):
        return state
    raise TypeError(
        "a carried state must hold tensors, numbers, strings, None and plain tuples, lists "
        f"and dicts of them (it is saved in checkpoints); got {type(state).__name__}"
    )


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
    model = task.model.to(device)
    optimizer = make_optimizer(model.parameters(), config)
    schedule = make_schedule(config)
    normalizer = config.loss_normalizer
    start_epoch, start_batch, step = 1, 0, 0
    best: dict[str, float] = {}
    bad_evals = 0  # validations in a row without a new best (early stopping)
    last_eval: dict[str, Any] | None = None  # {"step", "metrics"} of the latest validation
    stopped: dict[str, int] | None = None  # {"epoch", "step"} once early stopping fired
    carry: Any = None  # the state the task carries from batch to batch (stateful_loss)
    total_loss, total_count = 0.0, 0  # this epoch's so far (mid-epoch checkpoints keep them)
    if resume:
        path = run_dir / "checkpoint.pt"
        state = load_checkpoint(path)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path} has an unknown format")
        for name, saved, current in (
            ("optimizer", state.get("optimizer_name", "sgd"), config.optimizer),
            ("lr_schedule", state["schedule"].get("kind", "step"), config.lr_schedule),
        ):
            if saved != current:
                raise CheckpointError(
                    f"{path} was trained with {name}={saved!r}; cannot resume with {current!r}"
                )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        set_rng_state(state["rng"])
        start_epoch, start_batch, step = state["epoch"], state["batch"], state["step"]
        best = state["best"]
        bad_evals = state.get("bad_evals", 0)
        last_eval = state.get("last_eval")
        stopped = state.get("stopped")
        total_loss, total_count = state.get("epoch_loss", [0.0, 0])
        if task.state is not None:
            task.state[1](state.get("task_state"))
        carried = state.get("carry")
        if carried is not None and task.stateful_loss is not None:
            if len(carried) != world:
                raise CheckpointError(
                    f"{path} holds the carried state of {len(carried)} processes: resume it "
                    f"with {len(carried)}, not {world}"
                )
            carry = _map_tensors(lambda t: t.to(device), carried[rank])
        if rank == 0:  # forget what was logged after this checkpoint: it is redone
            _truncate_log(run_dir / "metrics.jsonl", step)
    elif rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(task.config, indent=2) + "\n")
        (run_dir / "metrics.jsonl").write_text("")
    train_model: nn.Module = model
    if world > 1:
        train_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )

    def gather_carry() -> list[Any] | None:
        """Every rank's carried state, on the CPU, in rank order (on rank 0; None elsewhere)."""
        local = _map_tensors(lambda t: t.detach().cpu(), carry)  # checkpoints only
        if world == 1:
            return [local]
        gathered: list[Any] = [None] * world
        dist.gather_object(local, gathered if rank == 0 else None, dst=0)
        return gathered if rank == 0 else None

    def checkpoint(epoch: int, batch: int) -> None:
        """The full training state before batch ``batch`` (0-based) of ``epoch`` (1-based)."""
        carried = gather_carry() if task.stateful_loss is not None and batch > 0 else None
        if rank != 0:
            return
        save_checkpoint(
            run_dir / "checkpoint.pt",
            {
                "format": CHECKPOINT_FORMAT,
                "model": _unwrap(model).state_dict(),
                "optimizer": optimizer.state_dict(),
                "optimizer_name": config.optimizer,
                "schedule": schedule.state_dict(),
                "rng": get_rng_state(),
                "epoch": epoch,
                "batch": batch,
                "step": step,
                "best": best,
                "bad_evals": bad_evals,
                "last_eval": last_eval,
                "stopped": stopped,
                "carry": carried,
                "epoch_loss": [total_loss, total_count] if batch > 0 else [0.0, 0],
                "task_state": None if task.state is None else task.state[0](),
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
                "step": step,
                "valid": metrics,
            },
        )

    def validate(epoch: int) -> dict[str, float]:
        """Validate; keep the best model; count validations without a new best."""
        nonlocal best, bad_evals, last_eval
        assert task.validate is not None
        model.eval()
        with torch.no_grad():
            metrics = task.validate(_unwrap(model))
        model.train()
        metric = metrics.get("metric")
        if metric is not None:
            if not best or metric > best.get("metric", -math.inf):
                where = {"epoch": epoch, "step": step} if config.eval_every else {"epoch": epoch}
                best = {**where, **metrics}
                save_model(epoch, metrics)
                bad_evals = 0
            else:
                bad_evals += 1
        last_eval = {"step": step, "metrics": metrics}
        return metrics

    def should_stop() -> bool:
        """Early stopping: ``patience`` validations in a row without a new best."""
        if config.patience is None:
            return False
        stop = bad_evals >= config.patience
        if world > 1:  # every rank validates on its own: follow rank 0
            flag = torch.tensor([float(stop)], device=device)
            dist.broadcast(flag, src=0)
            stop = bool(flag.item())
        return stop

    def report_stop(epoch: int) -> None:
        logger.log({"kind": "stop", "epoch": epoch, "step": step, "bad_evals": bad_evals})
        if rank == 0 and config.epoch_lines:
            prefix = f"[{config.name}] " if config.name else ""
            print(
                f"{prefix}early stop at epoch {epoch}, step {step}: no new best in "
                f"{bad_evals} validations (best: epoch {best.get('epoch')})",
                file=sys.stderr,
                flush=True,
            )

    started = time.time()
    for epoch in range(start_epoch, config.epochs + 1):
        if stopped is not None:  # resumed after an early stop: nothing left to do
            break
        if task.on_epoch_start is not None:
            task.on_epoch_start(_unwrap(model), epoch)
        lr_now = schedule.lr if task.epoch_lr is None else task.epoch_lr(epoch, schedule.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr_now
        model.train()
        batches = task.batches(epoch)
        if start_batch == 0:
            carry = None  # each epoch starts its streams afresh
            total_loss, total_count = 0.0, 0  # the epoch's summed loss and examples or tokens
        bar = logger.bar(len(batches), start_batch, f"epoch {epoch}/{config.epochs}")
        window_tokens, window_start = 0, time.time()
        for index in range(start_batch, len(batches)):
            examples = batches[index]
            local = examples[rank::world]
            if not local:
                raise ValueError(f"batch {index} has {len(examples)} examples for {world} ranks")
            batch = task.collate(local, device)
            n_examples: Count
            n_tokens: Count
            if task.stateful_loss is not None:
                loss_sum, n_examples, n_tokens, carry = task.stateful_loss(
                    train_model, batch, carry
                )
                carry = _map_tensors(Tensor.detach, carry)  # truncate backpropagation here
            else:
                assert task.loss is not None
                loss_sum, n_examples, n_tokens = task.loss(train_model, batch)
            totals: Tensor | None = None
            if world > 1:  # the global loss and counts, before backward (one collective)
                totals = torch.stack(
                    [
                        torch.as_tensor(x, dtype=torch.float64, device=device)
                        for x in (loss_sum.detach(), n_examples, n_tokens)
                    ]
                )
                dist.all_reduce(totals)
                n_examples, n_tokens = totals[1], totals[2]
            loss = _scale_loss(loss_sum, normalizer, world, n_examples, n_tokens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if config.max_grad_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            step += 1
            if totals is not None:
                value_f, examples_f, tokens_f = totals.tolist()
                batch_examples, batch_tokens = round(examples_f), round(tokens_f)
            else:
                value_f = float(loss_sum.detach())
                batch_examples, batch_tokens = int(n_examples), int(n_tokens)
            if not math.isfinite(value_f):
                raise FloatingPointError(
                    f"training loss is {value_f} at epoch {epoch}, step {step}"
                )
            per = batch_tokens if normalizer == "tokens" else batch_examples
            total_loss += value_f
            total_count += per
            window_tokens += batch_tokens
            if bar is not None:
                bar.update(1)
                rate = window_tokens / max(time.time() - window_start, 1e-9)
                bar.set_postfix(
                    loss=f"{value_f / max(per, 1):.3f}",
                    lr=f"{lr_now:.3g}",
                    tok_s=f"{rate:.0f}",
                )
            if step % config.log_every == 0:
                now = time.time()
                logger.log(
                    {
                        "kind": "train",
                        "epoch": epoch,
                        "step": step,
                        "loss": value_f / max(per, 1),
                        "lr": lr_now,
                        "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                    }
                )
                window_tokens, window_start = 0, now
            if config.eval_every and step % config.eval_every == 0:
                metrics = validate(epoch)
                logger.log(
                    {
                        "kind": "eval",
                        "epoch": epoch,
                        "step": step,
                        **{f"valid_{k}": v for k, v in metrics.items()},
                    }
                )
                if should_stop():
                    stopped = {"epoch": epoch, "step": step}
            if stopped is not None or (
                config.checkpoint_every and step % config.checkpoint_every == 0
            ):
                checkpoint(epoch, index + 1)
            if stopped is not None:
                break
        if bar is not None:
            bar.close()
        if stopped is not None:
            report_stop(epoch)
            break
        start_batch = 0
        metrics = {}
        if task.validate is not None:
            if config.eval_every and last_eval is not None and last_eval["step"] == step:
                metrics = last_eval["metrics"]  # validated at this very step already
            else:
                metrics = validate(epoch)
        metric = metrics.get("metric")
        record = {
            "kind": "epoch",
            "epoch": epoch,
            "step": step,
            "train_loss": total_loss / max(total_count, 1),
            "lr": lr_now,
            "time": time.time() - started,
            **{f"valid_{k}": v for k, v in metrics.items()},
        }
        logger.log(record)
        if rank == 0 and config.epoch_lines:
            shown = ", ".join(f"{k} {v:.4g}" for k, v in record.items() if isinstance(v, float))
            prefix = f"[{config.name}] " if config.name else ""
            print(f"{prefix}epoch {epoch}/{config.epochs}: {shown}", file=sys.stderr, flush=True)
        schedule.step(epoch, metric)  # the next epoch's lr is set at its start
        if should_stop():
            stopped = {"epoch": epoch, "step": step}
        checkpoint(epoch + 1, 0)
        if stopped is not None:
            report_stop(epoch)
            break
    if task.validate is None:  # no model selection: the last model is the model
        save_model(config.epochs, {})
    summary: dict[str, Any] = {
        "best": best,
        "epochs": config.epochs,
        "seconds": time.time() - started,
    }
    if config.patience is not None:
        summary["stopped"] = stopped
    return summary
