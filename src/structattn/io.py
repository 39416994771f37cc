"""Text files for the data loaders and recipes: atomic writes and UTF-8 reads with line numbers."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

__all__ = ["atomic_write_text", "read_sentences", "read_utf8", "shared_data_dir"]


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write a temporary file next to ``path`` (usual permissions, unlike ``mkstemp``'s
    0600), then rename it over ``path``: readers never see a partial file. Missing parent
    folders are created."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def read_utf8(path: str | os.PathLike[str]) -> str:
    """The text of ``path``; invalid UTF-8 raises ``ValueError("<path>:<line>: ...")``."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        lineno = data.count(b"\n", 0, err.start) + 1
        raise ValueError(f"{path}:{lineno}: not valid UTF-8 ({err.reason})") from None


def read_sentences(source: str | os.PathLike[str]) -> list[list[str]]:
    """Plain sentences of a file (``-``: stdin), one per line, tokens split by whitespace;
    blank lines skipped. ``ValueError`` when there is none."""
    text = sys.stdin.read() if str(source) == "-" else read_utf8(source)
    sentences = [line.split() for line in text.splitlines() if line.strip()]
    if not sentences:
        where = "stdin" if str(source) == "-" else source
        raise ValueError(f"{where}: no sentences to parse (one per line, tokens split by spaces)")
    return sentences


def shared_data_dir(*parts: str, what: str, hint: str = "") -> Path:
    """``../shared/data/<parts...>`` relative to the working directory, else to the repository
    (the layout of a checkout next to the shared data). Raises ``FileNotFoundError`` naming
    ``what``, the paths tried and ``--data-dir`` (plus ``hint``) when neither exists."""
    relative = Path("..", "shared", "data", *parts)
    repository = Path(__file__).resolve().parents[2]  # src/structattn/io.py -> repo
    candidates = [Path.cwd() / relative, repository / relative]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate.resolve()
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"{what} not found (tried {tried}); pass --data-dir{hint}")
