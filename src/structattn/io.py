"""Text files for the data loaders and recipes: atomic writes, UTF-8 reads with line numbers,
an OS file lock (:func:`file_lock`) and where the data sets are (:func:`data_dir`).

The data-directory rule, the same for every recipe and loader (the first that applies wins):

1. an explicit folder (a recipe's ``--data-dir``; ``data_dir(..., explicit=...)``);
2. ``$STRUCTATTN_DATA/<data set folder>``: a root laid out like ``../shared/data``
   (``<root>/babi/en``, ``<root>/ptb``, ``<root>/glove``, ...);
3. ``~/.cache/structattn/data/<data set folder>`` (``$XDG_CACHE_HOME/structattn/data``
   when ``XDG_CACHE_HOME`` is set);
4. ``../shared/data/<data set folder>`` next to the working directory, then next to the
   checkout (this project's own machines).

Steps 2-4 are tried per data set: a root that lacks one data set does not hide another
root that has it. :func:`data_roots` lists the roots of steps 2-4 in order.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sized
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "DATA_ENV",
    "DataRoot",
    "FileLockBusyError",
    "atomic_write_text",
    "check_splits",
    "data_dir",
    "data_roots",
    "empty_file_error",
    "file_lock",
    "read_sentences",
    "read_utf8",
    "shared_data_dir",
    "user_data_cache",
]

DATA_ENV = "STRUCTATTN_DATA"  # environment variable: a root laid out like ../shared/data


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


def empty_file_error(
    path: str | os.PathLike[str], expected: str, download: str | None = None
) -> ValueError:
    """The error of a data file with nothing in it (a cut download or copy, a full disk):
    ``"<path>: empty file (expected <expected>)"``, and, for a data set that ``structattn
    download`` fetches (``download``: its name), the command that fetches it again (it
    replaces files that fail their checksum). Readers raise it rather than return no
    examples, which a recipe would train or score on without a word."""
    message = f"{path}: empty file (expected {expected})"
    if download:
        message += f"; a cut download or copy? `structattn download {download}` fetches it again"
    return ValueError(message)


def check_splits(splits: Mapping[str, Sized], where: str, optional: tuple[str, ...] = ()) -> None:
    """``ValueError`` naming the first empty split of ``splits`` (and ``where`` they come
    from: a folder, a data set) unless it is in ``optional``: an empty training split trains
    nothing, and an empty validation or test split would score as perfect (perplexity 1,
    accuracy of nothing). Recipes call it on the splits they load."""
    for name, examples in splits.items():
        if len(examples) == 0 and name not in optional:
            raise ValueError(
                f"{where}: the {name} split is empty (an empty split trains nothing or scores "
                "as perfect): check its file, or the sizes and filters that cut it"
            )


class FileLockBusyError(TimeoutError):
    """Another process holds a :func:`file_lock` and did not release it in time.
    ``holder`` is the process id its holder wrote in the file (``"unknown"`` if none)."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is locked by another process (pid {holder})")
        self.path = path
        self.holder = holder


def _holder(fd: int) -> str:
    """The process id a lock's holder wrote in its file, or ``"unknown"``."""
    try:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    except OSError:  # pragma: no cover - a file we opened ourselves
        return "unknown"


@contextmanager
def file_lock(
    path: str | os.PathLike[str],
    *,
    timeout: float | None = None,
    on_wait: Callable[[str], None] | None = None,
    remove: bool = False,
    poll: float = 0.1,
) -> Iterator[bool]:
    """Hold an exclusive OS lock (``fcntl.flock``) on ``path`` (created, with its folder)
    for the block; the holder writes its process id in the file.

    The OS releases the lock when its holder dies (even by ``kill -9``), so a lock never
    outlives a killed process. ``timeout``: ``None`` waits as long as the holder holds it,
    ``0`` does not wait, ``t > 0`` waits up to ``t`` seconds; when it runs out,
    :class:`FileLockBusyError` names the holder's process id. ``on_wait(holder)`` is called
    once, with that id, before waiting (a progress message). ``remove``: delete the file on
    release, while still held (a later holder then locks a new file; one that locked the
    deleted file notices and locks the new one). Yields ``True``; where ``fcntl`` is missing
    (Windows) nothing is locked and it yields ``False``.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield False
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
    announced = False
    while True:
        fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder(fd)
            if deadline is not None and time.monotonic() >= deadline:
                os.close(fd)
                raise FileLockBusyError(target, holder) from None
            if on_wait is not None and not announced:
                on_wait(holder)
            announced = True
            if deadline is None:
                fcntl.flock(fd, fcntl.LOCK_EX)  # the OS wakes us when the holder lets go
            else:
                os.close(fd)
                time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
                continue
        try:  # the file we locked may have been removed by its last holder: lock the new one
            same = os.stat(target).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield True
    finally:
        if remove:
            target.unlink(missing_ok=True)
        os.close(fd)  # releases the lock


class DataRoot(NamedTuple):
    """A folder that may hold data sets (laid out like ``../shared/data``) and why it is
    searched (shown in errors)."""

    path: Path
    source: str


def user_data_cache() -> Path:
    """``$XDG_CACHE_HOME/structattn/data`` when ``XDG_CACHE_HOME`` is an absolute path (the
    XDG rule ignores a relative one), else ``~/.cache/structattn/data``. Not created."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(cache) if cache and Path(cache).is_absolute() else Path.home() / ".cache"
    return base / "structattn" / "data"


def data_roots() -> list[DataRoot]:
    """The roots searched for a data set, in order (steps 2-4 of the module's rule):
    ``$STRUCTATTN_DATA`` (when set), the user cache, ``../shared/data`` next to the working
    directory, then next to the checkout; absolute paths, the same folder listed once."""
    roots: list[DataRoot] = []
    variable = os.environ.get(DATA_ENV, "")
    if variable:
        roots.append(DataRoot(Path(variable).expanduser(), f"${DATA_ENV}"))
    try:
        roots.append(DataRoot(user_data_cache(), "user cache"))
    except RuntimeError:  # no home directory to be found: skip the cache
        pass
    shared = Path("..", "shared", "data")
    repository = Path(__file__).resolve().parents[2]  # src/structattn/io.py -> checkout
    roots.append(DataRoot(Path.cwd() / shared, "../shared/data next to the working directory"))
    roots.append(DataRoot(repository / shared, "../shared/data next to the checkout"))
    unique: list[DataRoot] = []
    for root in roots:
        resolved = DataRoot(root.path.resolve(), root.source)
        if all(resolved.path != kept.path for kept in unique):
            unique.append(resolved)
    return unique


def data_dir(
    *parts: str,
    what: str,
    hint: str = "",
    explicit: str | os.PathLike[str] | None = None,
) -> Path:
    """The folder of a data set: ``explicit`` when given (a recipe's ``--data-dir``), else
    ``<root>/<parts...>`` for the first of :func:`data_roots` that has it (resolved).

    ``parts`` is the data set's folder inside a root (``"babi", "en"``); ``what`` names the
    data set in errors; ``hint`` is appended to the ``--data-dir`` advice (e.g. which files
    the folder holds). Raises ``FileNotFoundError`` naming the data set, every place tried
    in order and how to fix it (``--data-dir``, ``STRUCTATTN_DATA``, the user cache,
    ``structattn download``).
    """
    if explicit is not None and str(explicit):
        folder = Path(explicit)
        if not folder.is_dir():
            raise FileNotFoundError(f"{what} not found: --data-dir {folder} is not a folder")
        return folder
    roots = data_roots()
    for root in roots:
        candidate = root.path.joinpath(*parts)
        if candidate.is_dir():
            return candidate.resolve()
    inside = "/".join(parts)
    tried = "\n".join(f"  {root.path.joinpath(*parts)}  ({root.source})" for root in roots)
    unset = "" if os.environ.get(DATA_ENV) else " (now unset)"
    cache = [root.path for root in roots if root.source == "user cache"]
    in_cache = f"; or put the data set in {cache[0].joinpath(*parts)}" if cache else ""
    raise FileNotFoundError(
        f"{what} not found. Tried, in order:\n{tried}\n"
        f"To fix: pass --data-dir{hint}; or set {DATA_ENV}=<root>{unset}, a folder laid out "
        f"like ../shared/data with the data set in <root>/{inside}{in_cache}. "
        f"Or fetch it: `structattn download {parts[0] if parts else '<name>'}` "
        f"(`structattn download --list` shows the data sets)."
    )


def shared_data_dir(*parts: str, what: str, hint: str = "") -> Path:
    """The folder of a data set by the data-directory rule without an explicit folder:
    the same as :func:`data_dir` (the name the loaders have always called)."""
    return data_dir(*parts, what=what, hint=hint)
