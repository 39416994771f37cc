"""Reading a run's files (``done.json``, ``summary.json``, ``config.json``,
``metrics.jsonl``): one error type that names the file and says what is wrong with it.

Training and the recipes' run orchestration both read these files, so the reader lives here,
below :mod:`structattn.recipes`. The command line prints an :class:`ArtefactError` as one
line, ``structattn: error: <file>: <what is wrong>``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["ArtefactError", "read_json_object", "read_jsonl_objects", "read_text"]


class ArtefactError(ValueError):
    """A file of a run (or a trained model) is missing, unreadable or malformed."""

    def __init__(self, path: str | os.PathLike[str], problem: str | None = None) -> None:
        """``ArtefactError(path, problem)``: "<path>: <problem>"; ``ArtefactError(message)``
        for a message that names the file itself."""
        super().__init__(str(path) if problem is None else f"{path}: {problem}")
        self.path = None if problem is None else Path(path)
        self.problem = str(path) if problem is None else problem


def read_text(path: str | os.PathLike[str]) -> str:
    """The text of ``path``; :class:`ArtefactError` naming it when it is unreadable."""
    path = Path(path)
    if path.is_dir():
        raise ArtefactError(path, "is a directory; expected a file")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ArtefactError(path, "no such file") from None
    except UnicodeDecodeError as error:
        raise ArtefactError(path, f"not UTF-8 text ({error.reason})") from None
    except OSError as error:
        raise ArtefactError(path, f"cannot read it ({error.strerror or error})") from None


def read_json_object(path: str | os.PathLike[str], keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON object in ``path``, which must hold ``keys``; :class:`ArtefactError`
    naming the file otherwise (unreadable, empty, not JSON, not an object, a key missing)."""
    path = Path(path)
    text = read_text(path)
    if not text.strip():
        raise ArtefactError(path, "is empty")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ArtefactError(path, f"not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ArtefactError(path, f"expected a JSON object, found a {type(value).__name__}")
    missing = [key for key in keys if key not in value]
    if missing:
        raise ArtefactError(path, f"has no {', '.join(map(repr, missing))}")
    return value


def read_jsonl_objects(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The JSON objects of ``path``, one per line. A line that is not JSON (one cut short by
    a killed run) is skipped; a line holding another JSON value is an :class:`ArtefactError`
    naming the file and the line."""
    path = Path(path)
    records = []
    for number, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(value, dict):
            kind = type(value).__name__
            raise ArtefactError(path, f"line {number}: expected a JSON object, found a {kind}")
        records.append(value)
    return records
