"""Checkpoints: written atomically (temp file + rename), verified (the archive's CRC-32s)
and loaded without executing code.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts saved with
``torch.save`` and read back with ``torch.load(weights_only=True)``, which refuses anything
that would need pickle to run code.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .artefacts import ArtefactError

__all__ = [
    "CheckpointError",
    "get_rng_state",
    "load_checkpoint",
    "save_checkpoint",
    "set_rng_state",
]


class CheckpointError(ArtefactError, RuntimeError):
    """A checkpoint is missing, unreadable or not one of ours (an :class:`ArtefactError`;
    also a ``RuntimeError``, as it was before that type)."""


#: the keys that every file of this name holds (``model.pt``: what eval and viz load)
_REQUIRED_KEYS = {"model.pt": ("model", "config")}


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically: a crash leaves the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        Path(tmp).unlink(missing_ok=True)
        if _disk_full(error):
            raise CheckpointError(
                path, "cannot write it: no space left on device (the previous file is intact)"
            ) from None
        raise
    return path


def _disk_full(error: BaseException) -> bool:
    """Whether a failed save ran out of space: ``ENOSPC``, or torch's zip writer's
    ``[enforce fail at inline_container.cc] ... unexpected pos`` or ``... write failed``."""
    if isinstance(error, OSError):
        return error.errno == errno.ENOSPC
    text = str(error)
    short = "unexpected pos" in text or "write failed" in text
    return isinstance(error, RuntimeError) and "inline_container" in text and short


def load_checkpoint(
    path: str | os.PathLike[str], map_location: str | torch.device | None = "cpu"
) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (no code is executed)."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory; expected a checkpoint file")
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    _verify_archive(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # noqa: BLE001 - any failure means a corrupt/foreign file
        raise CheckpointError(f"cannot read checkpoint {path}: {_reason(error)}") from None
    if not isinstance(state, dict) or "format" not in state:
        raise CheckpointError(f"{path} is not a structattn checkpoint")
    missing = [key for key in _REQUIRED_KEYS.get(path.name, ()) if key not in state]
    if missing:
        raise CheckpointError(path, f"has no {', '.join(map(repr, missing))}: not a trained model")
    if "config" in state and not isinstance(state["config"], dict):
        raise CheckpointError(path, f"its config is a {type(state['config']).__name__}, not a dict")
    return state


def _verify_archive(path: Path) -> None:
    """Check the CRC-32 of every record of ``path`` (``torch.save`` writes a zip archive
    with one checksum per tensor): a flipped bit is a :class:`CheckpointError`, not weights
    that load. Reading the file once costs little next to loading it."""
    try:
        if not zipfile.is_zipfile(path):
            return  # not an archive: torch.load says why it cannot read it
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise CheckpointError(path, f"corrupt archive ({error}); restore or retrain it") from None
    if bad is not None:
        raise CheckpointError(
            path, f"corrupt: the checksum of its record {bad} does not match (a changed byte); "
            "restore or retrain it"
        )  # fmt: skip


def _reason(error: Exception) -> str:
    """One line for why ``torch.load`` failed: the weights-only refusal of a pickled Python
    object is said plainly (torch's own text suggests loading unsafely, which we never do)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if isinstance(error, pickle.UnpicklingError):
        boilerplate = (
            "Weights only load failed",
            "Please file an issue",
            "Check the documentation",
        )
        lines = [line for line in lines if not line.startswith(boilerplate)]
        if any("GLOBAL" in line or "global" in line for line in lines):
            return (
                "it holds pickled Python objects, which are never loaded (a structattn "
                "checkpoint holds only tensors, numbers, strings, lists and dicts)"
            )
    return lines[0] if lines else type(error).__name__


def get_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch (and CUDA) RNG states as checkpoint-safe values."""
    np_state: tuple[Any, ...] = np.random.get_state(legacy=True)  # type: ignore[assignment]  # noqa: NPY002
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [
            np_state[0],
            torch.from_numpy(np_state[1].astype(np.int64)),
            *(int(v) if i < 2 else float(v) for i, v in enumerate(np_state[2:])),
        ],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))  # noqa: NPY002
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
