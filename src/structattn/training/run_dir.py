"""The text files of a run directory and what a killed run leaves there.

``config.json`` and ``metrics.jsonl`` are written by rename
(:func:`structattn.io.atomic_write_text`), so a kill or a full disk leaves the old file or
the new one, never a partial one; the loop appends to ``metrics.jsonl`` line by line. A kill
can still leave a writer's temporary file: :func:`remove_stale_temp_files` removes them when
a run starts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ..io import atomic_write_text
from .artefacts import ArtefactError, read_json_object, read_text
from .checkpoint import CheckpointError, load_checkpoint

__all__ = [
    "TEMP_FILES",
    "notice",
    "cut_metrics",
    "read_run_config",
    "remove_stale_temp_files",
    "repair_config",
    "write_config",
]

#: the temporary files of the checkpoint writer (``save_checkpoint``: ``.NAME.<random>``) and
#: of the text writer (``atomic_write_text``: ``.NAME.<pid>.<random>.tmp``) for a run's files
TEMP_FILES = (".checkpoint.pt.*", ".model.pt.*", ".config.json.*", ".metrics.jsonl.*")


def notice(message: str) -> None:
    """One line on stderr, for what a run does on its own (e.g. start afresh)."""
    print(f"structattn: {message}", file=sys.stderr, flush=True)


def remove_stale_temp_files(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files that writers killed before their rename left in
    ``run_dir`` (:data:`TEMP_FILES`); returns them. Call it before the run writes anything."""
    removed = []
    for pattern in TEMP_FILES:
        for path in sorted(Path(run_dir).glob(pattern)):
            if path.is_file():
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def write_config(run_dir: str | os.PathLike[str], config: dict[str, Any]) -> Path:
    """``run_dir/config.json``: the recipe's configuration as indented JSON, atomically."""
    return atomic_write_text(Path(run_dir) / "config.json", json.dumps(config, indent=2) + "\n")


def repair_config(run_dir: str | os.PathLike[str], config: dict[str, Any]) -> None:
    """Write ``config`` (the checkpoint's copy, on resume) when ``run_dir/config.json`` is
    missing or unreadable."""
    if not isinstance(_read_json_object(Path(run_dir) / "config.json"), dict):
        write_config(run_dir, config)


def _read_json_object(path: Path) -> dict[str, Any] | str:
    """The JSON object in ``path``, or why it is unreadable."""
    try:
        return read_json_object(path)
    except ArtefactError as error:
        return "empty" if error.problem == "is empty" else error.problem


def read_run_config(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The configuration a run was started with: its ``config.json``, else the copy in its
    ``checkpoint.pt`` (the file is empty after a kill or a full disk during its first write
    by an older version). ``None`` when the run has no configuration yet, or an unreadable
    one and no checkpoint: it starts afresh (a notice on stderr says so).
    ``CheckpointError`` when both are unreadable."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        return None
    config = _read_json_object(path)
    if isinstance(config, dict):
        return config
    checkpoint = path.with_name("checkpoint.pt")
    if checkpoint.exists():
        saved = load_checkpoint(checkpoint).get("config")
        if not isinstance(saved, dict):
            raise CheckpointError(f"{path} is unreadable ({config}) and {checkpoint} has none")
        return saved
    notice(f"{path} is unreadable ({config}) and there is no checkpoint: the run starts afresh")
    return None


def cut_metrics(path: str | os.PathLike[str], lines: int | None, step: int) -> int:
    """Cut ``metrics.jsonl`` back to what a checkpoint covers, before a resume redoes the
    rest: its first ``lines`` lines, or (``lines=None``: a checkpoint written before the
    count) the records up to step ``step``. A line cut short by a kill is dropped. The file
    is rewritten atomically (a kill leaves it whole); returns how many lines it keeps."""
    path = Path(path)
    if not path.exists():
        return 0
    text = read_text(path).split("\n")
    kept = []
    for line in text if lines is None else text[:lines]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the last line, cut short by the kill
            continue
        if lines is not None or (isinstance(record, dict) and record.get("step", 0) <= step):
            kept.append(line)
    atomic_write_text(path, "".join(x + "\n" for x in kept))
    return len(kept)
