"""The training loop shared by all recipes: optimisers, schedules, the training state and its
checkpoints, resumption, truncated BPTT, early stopping, logging, DDP."""

from .artefacts import ArtefactError, read_json_object, read_jsonl_objects
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .loop import Task, fit, load_model_state
from .optim import LRSchedule, PlateauSchedule, make_optimizer, make_schedule
from .run_dir import read_run_config
from .state import TrainState

__all__ = [
    "ArtefactError",
    "CheckpointError",
    "LRSchedule",
    "PlateauSchedule",
    "Task",
    "TrainConfig",
    "TrainState",
    "fit",
    "load_checkpoint",
    "load_model_state",
    "make_optimizer",
    "make_schedule",
    "read_json_object",
    "read_jsonl_objects",
    "read_run_config",
    "save_checkpoint",
]
