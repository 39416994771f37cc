"""The training loop shared by all recipes: checkpoints, resumption, logging, DDP."""

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .loop import LRSchedule, Task, TrainConfig, fit, load_model_state

__all__ = [
    "CheckpointError",
    "LRSchedule",
    "Task",
    "TrainConfig",
    "fit",
    "load_checkpoint",
    "load_model_state",
    "save_checkpoint",
]
