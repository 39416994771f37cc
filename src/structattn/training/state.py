"""The training state: what the loop carries from step to step, which is what a checkpoint
holds and a resume restores.

:class:`TrainState` is that state in one dataclass. Its progress fields (the ones made with
``_saved``) go into a checkpoint under their own names, so the list of what a checkpoint
holds is written once, here: :meth:`TrainState.to_checkpoint` writes them and
:meth:`TrainState.from_checkpoint` reads them back, taking each field's ``before`` value
when a checkpoint was written before the field existed. The model, optimiser and schedule
are the live objects (their ``state_dict`` is saved), the RNG states are the process's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .checkpoint import CheckpointError, get_rng_state, set_rng_state
from .config import TrainConfig
from .optim import LRSchedule, PlateauSchedule, make_optimizer, make_schedule

__all__ = ["CHECKPOINT_FORMAT", "TrainState", "map_tensors"]

CHECKPOINT_FORMAT = "structattn-checkpoint-v1"  # new keys are optional: no new version

_ALWAYS: Any = object()  # ``before`` of the fields every checkpoint holds


def _saved(default: Any = MISSING, *, factory: Any = MISSING, before: Any = _ALWAYS) -> Any:
    """A progress field, saved under its own name; ``before``: the value a checkpoint written
    before the field existed stands for."""
    return field(default=default, default_factory=factory, metadata={"before": before})


@dataclass
class TrainState:
    """Everything a training run advances, at a point between two optimiser steps: before
    batch ``batch`` (0-based) of epoch ``epoch`` (1-based); ``batch == 0`` at an epoch's start.
    """

    model: nn.Module  # the model itself (not its DDP wrapper)
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule | PlateauSchedule  # the epoch-level learning-rate schedule
    optimizer_name: str  # TrainConfig.optimizer (a resume must use the same)
    epoch: int = _saved(1)  # the epoch in progress (1-based)
    batch: int = _saved(0)  # the next batch of that epoch (0-based)
    step: int = _saved(0)  # optimiser steps so far
    best: dict[str, float] = _saved(factory=dict)  # the best validation's metrics, with its
    # "epoch" (and "step" when validating every N steps); empty before the first validation
    bad_evals: int = _saved(0, before=0)  # validations in a row without a new best
    last_eval: dict[str, Any] | None = _saved(None, before=None)  # {"step", "metrics"} of
    # the latest validation
    stopped: dict[str, int] | None = _saved(None, before=None)  # {"epoch", "step"} of an
    # early stop
    epoch_loss: tuple[float, int] = _saved((0.0, 0), before=(0.0, 0))  # the epoch's summed
    # training loss so far and the examples or tokens it sums over
    metric_lines: int | None = _saved(0, before=None)  # lines of metrics.jsonl written up to
    # this state (None: a checkpoint from before the count; its lines are cut by step)
    carry: Any = None  # this rank's carried state (Task.stateful_loss), detached; saved
    # gathered from every rank (to_checkpoint's ``carried``)

    @classmethod
    def start(cls, model: nn.Module, config: TrainConfig) -> TrainState:
        """The state before the first step: ``config``'s optimiser and schedule."""
        optimizer = make_optimizer(model.parameters(), config)
        return cls(model, optimizer, make_schedule(config), config.optimizer)

    def next_epoch(self) -> None:
        """Move to the start of the next epoch: its streams and loss start afresh."""
        self.epoch, self.batch = self.epoch + 1, 0
        self.epoch_loss, self.carry = (0.0, 0), None

    def to_checkpoint(self, carried: list[Any] | None = None) -> dict[str, Any]:
        """The checkpoint of this state (plain values and tensors, for ``weights_only``
        loading). ``carried``: every rank's carried state on the CPU, in rank order (mid-epoch
        with ``stateful_loss``; ``None`` otherwise)."""
        progress = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata}
        return {
            "format": CHECKPOINT_FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "optimizer_name": self.optimizer_name,
            "schedule": self.schedule.state_dict(),
            "rng": get_rng_state(),
            **progress,
            "carry": carried,
        }

    @classmethod
    def from_checkpoint(
        cls,
        saved: dict[str, Any],
        model: nn.Module,
        config: TrainConfig,
        *,
        path: Path | str = "the checkpoint",
        rank: int = 0,
        world: int = 1,
        device: torch.device | None = None,
    ) -> TrainState:
        """The state ``saved`` holds (written by :meth:`to_checkpoint`, by any version),
        loaded into ``model`` and a new optimiser and schedule made from ``config``; restores
        the RNG states. ``rank`` of ``world`` processes takes its carried state, on ``device``.
        ``path`` names the checkpoint in errors (``CheckpointError``)."""
        if saved.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path} has an unknown format")
        state = cls.start(model, config)
        for name, was, now in (
            ("optimizer", saved.get("optimizer_name", "sgd"), config.optimizer),
            ("lr_schedule", saved["schedule"].get("kind", "step"), config.lr_schedule),
        ):
            if was != now:
                raise CheckpointError(
                    f"{path} was trained with {name}={was!r}; cannot resume with {now!r}"
                )
        model.load_state_dict(saved["model"])
        state.optimizer.load_state_dict(saved["optimizer"])
        state.schedule.load_state_dict(saved["schedule"])
        set_rng_state(saved["rng"])
        for f in fields(state):
            if not f.metadata:
                continue
            if f.name not in saved and f.metadata["before"] is _ALWAYS:
                raise CheckpointError(f"{path} has no {f.name!r}")
            setattr(state, f.name, saved.get(f.name, f.metadata["before"]))
        state.epoch_loss = (state.epoch_loss[0], state.epoch_loss[1])  # a list, when saved
        carried = saved.get("carry")
        if carried is not None:
            if len(carried) != world:
                raise CheckpointError(
                    f"{path} holds the carried state of {len(carried)} processes: resume it "
                    f"with {len(carried)}, not {world}"
                )
            state.carry = map_tensors(lambda t: t.to(device or t.device), carried[rank])
        return state


def map_tensors(fn: Callable[[Tensor], Tensor], state: Any) -> Any:
    """``state`` with ``fn`` applied to every tensor in it (plain tuples,
    lists and dicts); ``TypeError`` for anything a checkpoint could not hold."""
    if isinstance(state, Tensor):
        return fn(state)
    if type(state) in (tuple, list):
        return type(state)(map_tensors(fn, x) for x in state)
    if type(state) is dict:
        return {key: map_tensors(fn, value) for key, value in state.items()}
    if state is None or isinstance(state, bool | int | float | str):
        return state
    raise TypeError(
        "a carried state must hold tensors, numbers, strings, None and plain tuples, lists "
        f"and dicts of them (it is saved in checkpoints); got {type(state).__name__}"
    )
