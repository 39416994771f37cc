"""Optimisers and learning-rate schedules selected by :class:`TrainConfig`.

:func:`make_optimizer` builds ``torch.optim.SGD`` (the default, plain SGD), ``Adam`` or
``Adagrad``; :func:`make_schedule` builds the epoch-level schedule:

- ``"step"`` (:class:`LRSchedule`, the default): the papers' halving. After each epoch the
  lr is multiplied by ``decay_factor`` from epoch ``decay_start`` on, or from the first epoch
  whose validation metric did not improve when ``decay_on_plateau`` (once started, the decay
  continues every epoch: OpenNMT's ``start_decay_at``), or every ``decay_every`` epochs.
  ``decay_start=1`` with ``decay_factor=0.85`` is a plain per-epoch decay.
- ``"plateau"`` (:class:`PlateauSchedule`): the lr is multiplied by ``decay_factor`` after
  each epoch whose validation metric does not improve *significantly* on the reference (the
  best epoch so far, or the previous epoch), once ``plateau_patience`` such epochs have
  passed in a row; this is ``torch.optim.lr_scheduler.ReduceLROnPlateau`` for a
  higher-is-better metric, per epoch.

Both never go below ``min_lr``, and save and restore their state with the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .config import TrainConfig

__all__ = ["LRSchedule", "PlateauSchedule", "make_optimizer", "make_schedule"]


def make_optimizer(
    parameters: Iterable[nn.Parameter], config: TrainConfig
) -> torch.optim.Optimizer:
    """The optimiser named by ``config.optimizer`` with the config's lr and settings."""
    extra: dict[str, Any] = {} if config.eps is None else {"eps": config.eps}
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            parameters, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    if config.optimizer == "adam":
        betas = (float(config.betas[0]), float(config.betas[1]))
        return torch.optim.Adam(
            parameters, lr=config.lr, betas=betas, weight_decay=config.weight_decay, **extra
        )
    if config.optimizer == "adagrad":
        return torch.optim.Adagrad(
            parameters,
            lr=config.lr,
            weight_decay=config.weight_decay,
            initial_accumulator_value=config.initial_accumulator_value,
            **extra,
        )
    raise ValueError(f"unknown optimizer {config.optimizer!r}")  # TrainConfig rejects it first


class LRSchedule:
    """The papers' schedule: multiply the lr by ``decay_factor`` (halve it by default) after
    each epoch from ``decay_start`` on, or from the first epoch whose validation metric did not
    improve (whichever comes first), or every ``decay_every`` epochs."""

    kind = "step"

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
            self.lr = max(self.lr * c.decay_factor, c.min_lr)
        return self.lr

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "lr": self.lr, "decaying": self.decaying, "best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr, self.decaying, self.best = state["lr"], state["decaying"], state["best"]


class PlateauSchedule:
    """Multiply the lr by ``decay_factor`` when validation stops improving significantly.

    An epoch improves when ``metric > reference + margin``, where the reference is the best
    metric so far (``plateau_reference="best"``; the best only moves on an improvement) or
    the previous epoch's (``"previous"``), and the margin is ``plateau_threshold`` (``"abs"``)
    or ``plateau_threshold * |reference|`` (``"rel"``). After more than ``plateau_patience``
    non-improving epochs in a row the lr decays and the count restarts; the first epoch always
    improves. Needs a validation metric every epoch.
    """

    kind = "plateau"

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.lr = config.lr
        self.reference: float | None = None
        self.bad_epochs = 0

    def improves(self, metric: float) -> bool:
        """Whether ``metric`` improves significantly on the current reference."""
        if self.reference is None:
            return True
        c = self.config
        scale = abs(self.reference) if c.plateau_threshold_mode == "rel" else 1.0
        return metric > self.reference + c.plateau_threshold * scale

    def step(self, epoch: int, metric: float | None) -> float:
        """Update after ``epoch`` (1-based) with its validation metric (higher is better)."""
        c = self.config
        if metric is None:
            raise ValueError(
                f'lr_schedule="plateau" needs a validation metric after every epoch (epoch '
                f'{epoch} has none): task.validate must return {{"metric": ...}}'
            )
        improved = self.improves(metric)
        if improved or c.plateau_reference == "previous":
            self.reference = metric
        self.bad_epochs = 0 if improved else self.bad_epochs + 1
        if self.bad_epochs > c.plateau_patience:
            self.lr = max(self.lr * c.decay_factor, c.min_lr)
            self.bad_epochs = 0
        return self.lr

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "lr": self.lr,
            "reference": self.reference,
            "bad_epochs": self.bad_epochs,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr, self.reference = state["lr"], state["reference"]
        self.bad_epochs = state["bad_epochs"]


def make_schedule(config: TrainConfig) -> LRSchedule | PlateauSchedule:
    """The schedule named by ``config.lr_schedule``."""
    if config.lr_schedule == "plateau":
        return PlateauSchedule(config)
    return LRSchedule(config)
