"""Training settings shared by every recipe: :class:`TrainConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["TrainConfig"]


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
