"""The training loop shared by all recipes: optimisers, schedules, checkpoints, resumption,
truncated BPTT, early stopping, logging, DDP."""

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .loop import Task, fit, load_model_state
from .optim import LRSchedule, PlateauSchedule, make_optimizer, make_schedule

__all__ = [
    "CheckpointError",
    "LRSchedule",
    "PlateauSchedule",
    "Task",
    "TrainConfig",
    "fit",
    "load_checkpoint",
    "load_model_state",
    "make_optimizer",
    "make_schedule",
    "save_checkpoint",
]
