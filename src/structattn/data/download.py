"""``structattn download NAME``: fetch a data set by name into a data root, with checksums.

The data sets, where they come from and what is kept of them are in the package's
``manifest.json`` (:func:`manifest`): per data set its folder inside a root (laid out like
``../shared/data``), a licence line printed on download, the recipes that need it, and its
*sources*: an upstream URL, the archive format (``tar.gz``, ``zip`` or ``plain`` for a file
downloaded as is) and, for every file kept, its path in the folder, its member inside the
archive, its size and sha256 (``null``: unpinned, see below).

What a download does (:func:`download`), into ``<root>/<folder>`` (``root``: ``--data-dir``,
else ``$STRUCTATTN_DATA`` when set, else the user cache :func:`structattn.io.user_data_cache`):

1. files already present with the pinned sha256 are kept (all present: nothing to do), unless
   ``force``;
2. each needed source is fetched into ``<root>/.downloads/<archive>.part`` (resumed with an
   HTTP ``Range`` request when the server allows, else restarted), renamed when complete and
   checked against the archive's sha256 when the manifest pins one;
3. only the manifest's members are extracted (never a link or a path outside the folder),
   each into a hidden temporary file beside its final path, hashed on the way;
4. when every kept file has its pinned sha256 the temporary files are renamed into place;
   one mismatch and nothing is installed (one error naming the file, the expected and the
   actual sha256). An unpinned file (no sha256 in the manifest) is installed with a warning
   and the sha256 it got is recorded in ``<file>.sha256`` beside it.

A cut download therefore leaves only ``.part`` and hidden temporary files, which no loader
reads and the next run resumes or removes. ``source`` (``--from``) replaces the upstream: a
folder laid out like ``../shared/data`` (or the data set's own folder), whose files are copied
and verified, or a folder or URL base holding the upstream archives and files by their file
names. The standard library does the work (urllib, hashlib, tarfile, zipfile); tqdm draws the
progress bar when it is installed. Nothing touches the network at import.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import secrets
import sys
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import IO, Any

from ..io import DATA_ENV, atomic_write_text, user_data_cache

__all__ = [
    "MANIFEST_PATH",
    "ChecksumError",
    "DataSet",
    "DownloadError",
    "KeptFile",
    "Source",
    "default_root",
    "download",
    "file_sha256",
    "format_list",
    "load_manifest",
    "manifest",
]

MANIFEST_PATH = Path(__file__).with_name("manifest.json")
FORMATS = ("tar.gz", "zip", "plain")
#: what a truncated or corrupted archive raises while it is read
BAD_ARCHIVE = (zipfile.BadZipFile, tarfile.TarError, gzip.BadGzipFile, zlib.error, EOFError)
CHUNK = 1 << 20  # bytes read and hashed at a time
TIMEOUT = 60.0  # seconds without data before a connection is given up


class DownloadError(RuntimeError):
    """A data set could not be downloaded or verified; the message says why and what to do."""


class ChecksumError(DownloadError):
    """A file or archive does not have its pinned sha256 (or size): nothing was installed."""


@dataclass(frozen=True)
class KeptFile:
    """One file a data set keeps: ``path`` in its folder, ``member`` in the archive (``None``
    for a plain download), pinned ``sha256`` and ``size`` (``None``: unknown), and
    ``head_lines`` (keep only the member's first lines, e.g. the GloVe 10k subset)."""

    path: str
    member: str | None
    sha256: str | None
    size: int | None
    head_lines: int | None = None


@dataclass(frozen=True)
class Source:
    """An upstream archive (or plain file) and the files kept from it."""

    url: str
    format: str  # one of FORMATS
    sha256: str | None  # of the archive itself (None: not pinned; its kept files may be)
    size: int | None
    files: tuple[KeptFile, ...]

    @property
    def filename(self) -> str:
        """The archive's file name (the last part of the URL): what ``--from`` looks for."""
        return PurePosixPath(urllib.parse.urlparse(self.url).path).name


@dataclass(frozen=True)
class DataSet:
    """A manifest entry (see the module docstring)."""

    name: str
    folder: str  # inside a data root, e.g. "ptb"
    description: str
    licence: str
    recipes: tuple[str, ...]  # recipes whose default settings read it
    optional_for: tuple[str, ...]  # recipes that read it with a flag
    sources: tuple[Source, ...]
    notes: str

    @property
    def files(self) -> tuple[KeptFile, ...]:
        return tuple(kept for source in self.sources for kept in source.files)

    @property
    def pinned(self) -> bool:
        """Every kept file has a sha256 in the manifest."""
        return all(kept.sha256 is not None for kept in self.files)


def _safe_relative(path: str, what: str) -> str:
    """``path`` when it is a plain relative POSIX path inside its folder, else an error."""
    parts = PurePosixPath(path).parts
    if (
        not path
        or "\\" in path
        or PurePosixPath(path).is_absolute()
        or any(part in ("..", ".", "") for part in parts)
        or ":" in parts[0]
    ):
        raise DownloadError(f"{what}: unsafe path {path!r} (must stay inside the data set folder)")
    return path


def _kept(entry: dict[str, Any], where: str) -> KeptFile:
    path = _safe_relative(str(entry["path"]), where)
    member = entry.get("member")
    return KeptFile(
        path=path,
        member=None if member is None else str(member),
        sha256=entry.get("sha256"),
        size=entry.get("size"),
        head_lines=entry.get("head_lines"),
    )


def load_manifest(path: str | os.PathLike[str] = MANIFEST_PATH) -> dict[str, DataSet]:
    """The data sets of a manifest file by name (checked: formats, safe paths)."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    sets: dict[str, DataSet] = {}
    for name, entry in raw["datasets"].items():
        where = f"manifest {path}: data set {name!r}"
        sources = []
        for src in entry["sources"]:
            if src["format"] not in FORMATS:
                raise DownloadError(f"{where}: format {src['format']!r} is not one of {FORMATS}")
            files = tuple(_kept(f, where) for f in src["files"])
            if src["format"] == "plain" and len(files) != 1:
                raise DownloadError(f"{where}: a plain source keeps exactly one file")
            sources.append(
                Source(src["url"], src["format"], src.get("sha256"), src.get("size"), files)
            )
        sets[name] = DataSet(
            name=name,
            folder=_safe_relative(str(entry["folder"]), where),
            description=entry["description"],
            licence=entry["licence"],
            recipes=tuple(entry.get("recipes", ())),
            optional_for=tuple(entry.get("optional_for", ())),
            sources=tuple(sources),
            notes=entry.get("notes", ""),
        )
    return sets


@lru_cache(maxsize=1)
def _shipped() -> dict[str, DataSet]:
    return load_manifest(MANIFEST_PATH)


def manifest() -> dict[str, DataSet]:
    """The package's manifest (read once)."""
    return _shipped()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# ---- progress ------------------------------------------------------------------------------
class _Progress:
    """tqdm's bar when tqdm is installed, else a plain one line on stderr."""

    def __init__(self, label: str, total: int | None, initial: int = 0) -> None:
        self.label, self.total, self.done = label, total, initial
        self._bar: Any = None
        self._shown = -1
        try:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, initial=initial, unit="B", unit_scale=True, desc=label, leave=False
            )
        except ImportError:
            self._show()

    def update(self, count: int) -> None:
        self.done += count
        if self._bar is not None:
            self._bar.update(count)
        else:
            self._show()

    def _show(self) -> None:
        mb = self.done // 1_000_000
        if mb == self._shown:
            return
        self._shown = mb
        of = f" of {self.total / 1e6:.1f}" if self.total else ""
        print(f"\r{self.label}: {self.done / 1e6:.1f}{of} MB", end="", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)


# ---- fetching ------------------------------------------------------------------------------
def _is_url(text: str) -> bool:
    return urllib.parse.urlparse(text).scheme.lower() in ("http", "https", "ftp", "file")


def _fetch(url: str, part: Path) -> None:
    """Download ``url`` into ``part``, resuming a partial ``part`` with a ``Range`` request;
    a server that answers with the whole file restarts it. ``OSError`` on failure."""
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"User-Agent": "structattn-download"})
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT)
    except urllib.error.HTTPError as error:
        if error.code != 416 or not have:  # 416: the range is past the end
            raise
        part.unlink()  # cannot tell a finished part from a changed file: restart
        _fetch(url, part)
        return
    with response:
        status = getattr(response, "status", None)
        resumed = bool(have) and status == 206
        if have and not resumed:
            print(f"{url}: the server does not resume downloads; restarting", file=sys.stderr)
        length = response.headers.get("Content-Length")
        total = int(length) + (have if resumed else 0) if length else None
        bar = _Progress(PurePosixPath(urllib.parse.urlparse(url).path).name, total, have * resumed)
        try:
            with open(part, "ab" if resumed else "wb") as out:
                while chunk := response.read(CHUNK):
                    out.write(chunk)
                    bar.update(len(chunk))
        finally:
            bar.close()
        if total is not None and part.stat().st_size != total:
            raise OSError(f"connection closed after {part.stat().st_size} of {total} bytes")


def _archive(ds: DataSet, source: Source, origin: str | None, root: Path) -> Path:
    """A local path to ``source``'s archive: the file itself in a local ``--from`` folder,
    else downloaded into ``<root>/.downloads`` (``.part`` until complete, then verified)."""
    base = origin if origin is not None else source.url.rsplit("/", 1)[0]
    if origin is not None and not _is_url(origin):
        local = Path(origin) / source.filename
        if not local.is_file():
            raise DownloadError(
                f"data set {ds.name!r}: {local} not found in the mirror {origin} (a mirror holds "
                f"the upstream files by name, {source.filename}, or is laid out like "
                f"../shared/data with {ds.folder}/ inside)"
            )
        _check_archive(ds, source, local)
        return local
    url = f"{base.rstrip('/')}/{source.filename}" if origin is not None else source.url
    folder = root / ".downloads"
    folder.mkdir(parents=True, exist_ok=True)
    done = folder / source.filename
    if done.is_file() and _archive_ok(source, done):
        return done
    part = done.with_name(done.name + ".part")
    try:
        _fetch(url, part)
    except (OSError, urllib.error.URLError) as error:
        reason = getattr(error, "reason", None) or error
        kept = part.is_file() and part.stat().st_size > 0
        if not kept:
            part.unlink(missing_ok=True)
        resume = f" A partial download is kept in {part} and resumed by the next run." * kept
        raise DownloadError(
            f"could not download data set {ds.name!r} from {url}: {reason}.\n"
            f"To fix: when offline or behind a proxy, `structattn download {ds.name} --from "
            f"MIRROR` (a folder laid out like ../shared/data, or one holding {source.filename}); "
            f"or copy the data set's folder to <root>/{ds.folder} and set {DATA_ENV}=<root>."
            f"{resume}"
        ) from None
    os.replace(part, done)
    _check_archive(ds, source, done)
    return done


def _archive_ok(source: Source, path: Path) -> bool:
    if source.size is not None and path.stat().st_size != source.size:
        return False
    return source.sha256 is None or file_sha256(path) == source.sha256


def _check_archive(ds: DataSet, source: Source, path: Path) -> None:
    if source.sha256 is None:
        return
    actual = file_sha256(path)
    if actual != source.sha256:
        if path.parent.name == ".downloads":
            path.unlink()  # never reused
        raise ChecksumError(
            f"data set {ds.name!r}: checksum mismatch for {path}: expected sha256 "
            f"{source.sha256}, got {actual}; nothing installed"
        )


# ---- extracting ----------------------------------------------------------------------------
def _norm(member: str) -> str:
    """An archive member's name without a leading ``./`` (tar archives differ)."""
    while member.startswith("./"):
        member = member[2:]
    return member


@contextlib.contextmanager
def _members(source: Source, path: Path) -> Iterator[Callable[[KeptFile], IO[bytes]]]:
    """A function opening a kept file's member of the archive at ``path`` (regular files
    only; a link, a folder or a missing member is an error)."""
    if source.format == "plain":
        yield lambda kept: open(path, "rb")
    elif source.format == "zip":
        with zipfile.ZipFile(path) as archive:
            infos = {_norm(info.filename): info for info in archive.infolist()}

            def open_zip(kept: KeptFile) -> IO[bytes]:
                info = infos.get(_norm(kept.member or ""))
                if info is None or info.is_dir():
                    raise DownloadError(f"{path}: no file member {kept.member!r}")
                return archive.open(info)

            yield open_zip
    else:
        with tarfile.open(path, "r:gz") as tar:
            entries = {_norm(info.name): info for info in tar.getmembers()}

            def open_tar(kept: KeptFile) -> IO[bytes]:
                info = entries.get(_norm(kept.member or ""))
                if info is None or not info.isfile():  # links and devices are refused
                    raise DownloadError(f"{path}: no regular file member {kept.member!r}")
                handle = tar.extractfile(info)
                assert handle is not None  # a regular file
                return handle

            yield open_tar


def _temp_beside(final: Path) -> Path:
    return final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _stage(handle: IO[bytes], final: Path, head_lines: int | None) -> tuple[Path, str]:
    """Copy ``handle`` (its first ``head_lines`` lines) into a hidden temporary file beside
    ``final``; returns it and its sha256."""
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = _temp_beside(final)
    digest = hashlib.sha256()
    with open(temp, "xb") as out:
        if head_lines is None:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
        else:
            for count, line in enumerate(handle):
                if count >= head_lines:
                    break
                digest.update(line)
                out.write(line)
    return temp, digest.hexdigest()


def _inside(folder: Path, relative: str) -> Path:
    """``folder/relative``, refusing anything that resolves outside ``folder``."""
    final = (folder / relative).resolve()
    if not final.is_relative_to(folder.resolve()):
        raise DownloadError(f"unsafe path {relative!r}: outside {folder}")
    return final


def _present(folder: Path, kept: KeptFile) -> bool:
    """``kept`` is installed and verified: its pinned sha256, or for an unpinned file the
    sha256 recorded beside it at download."""
    path = folder / kept.path
    if not path.is_file() or (kept.size is not None and path.stat().st_size != kept.size):
        return False
    expected = kept.sha256
    if expected is None:
        record = path.with_name(path.name + ".sha256")
        if not record.is_file():
            return False
        expected = record.read_text(encoding="utf-8").split()[0] if record.stat().st_size else ""
    return file_sha256(path) == expected


def _remove_stale(folder: Path) -> None:
    """Hidden temporary files left by a cut run (never read by a loader)."""
    if folder.is_dir():
        for temp in folder.rglob(".*.tmp"):
            temp.unlink(missing_ok=True)


def _mirror_folder(ds: DataSet, origin: str | None) -> Path | None:
    """A local ``--from`` folder laid out like ``../shared/data`` (``<origin>/<folder>``) or
    the data set's own folder, when it holds every kept file; else ``None``."""
    if origin is None or _is_url(origin):
        return None
    for candidate in (Path(origin) / ds.folder, Path(origin)):
        if all((candidate / kept.path).is_file() for kept in ds.files):
            return candidate
    return None


def _install(ds: DataSet, staged: list[tuple[KeptFile, Path, str]], folder: Path) -> None:
    """Check every staged file; rename all into place only when all match."""
    bad = []
    for kept, temp, actual in staged:
        size = temp.stat().st_size
        if kept.sha256 is not None and actual != kept.sha256:
            bad.append(f"{folder / kept.path}: expected sha256 {kept.sha256}, got {actual}")
        elif kept.size is not None and size != kept.size:
            bad.append(f"{folder / kept.path}: expected {kept.size} bytes, got {size}")
    if bad:
        for _, temp, _ in staged:
            temp.unlink(missing_ok=True)
        raise ChecksumError(
            f"data set {ds.name!r}: checksum mismatch, nothing installed:\n  " + "\n  ".join(bad)
        )
    for kept, temp, actual in staged:
        final = folder / kept.path
        os.replace(temp, final)
        if kept.sha256 is None:
            atomic_write_text(final.with_name(final.name + ".sha256"), f"{actual}  {final.name}\n")
            print(
                f"WARNING: {final} is unpinned (the manifest has no sha256 for it): got sha256 "
                f"{actual}, recorded in {final.name}.sha256; compare it with a trusted copy",
                file=sys.stderr,
            )


def default_root() -> Path:
    """Where a download goes without ``--data-dir``: ``$STRUCTATTN_DATA`` when set (the first
    root the data-directory rule searches), else the user cache."""
    variable = os.environ.get(DATA_ENV, "")
    return Path(variable).expanduser() if variable else user_data_cache()


def download(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    source: str | os.PathLike[str] | None = None,
    force: bool = False,
) -> Path:
    """Download data set ``name`` into ``<data_dir or default_root()>/<its folder>`` from its
    upstream (or the mirror ``source``); returns the folder. Raises :class:`DownloadError`."""
    sets = manifest()
    if name not in sets:
        raise DownloadError(
            f"no data set {name!r}; `structattn download --list` shows them: {', '.join(sets)}"
        )
    ds = sets[name]
    origin = None if source is None else os.fspath(source)
    root = Path(data_dir) if data_dir else default_root()
    folder = root / ds.folder
    for kept in ds.files:
        _inside(folder, kept.path)
    print(f"{ds.name}: {ds.description}\nLicence: {ds.licence}")
    _remove_stale(folder)
    todo = [kept for kept in ds.files if force or not _present(folder, kept)]
    if not todo:
        print(f"{ds.name}: already present and verified in {folder} (--force downloads again)")
        return folder
    wanted = {kept.path for kept in todo}
    staged: list[tuple[KeptFile, Path, str]] = []
    mirror = _mirror_folder(ds, origin)
    try:
        if mirror is not None:
            for kept in todo:
                with open(mirror / kept.path, "rb") as handle:
                    staged.append((kept, *_stage(handle, folder / kept.path, None)))
        else:
            for src in ds.sources:
                needed = [kept for kept in src.files if kept.path in wanted]
                if not needed:
                    continue
                path = _archive(ds, src, origin, root)
                try:
                    with _members(src, path) as open_member:
                        for kept in needed:
                            with open_member(kept) as handle:
                                final = folder / kept.path
                                staged.append((kept, *_stage(handle, final, kept.head_lines)))
                except BAD_ARCHIVE as error:
                    raise ChecksumError(
                        f"data set {ds.name!r}: {path} is not a valid {src.format} archive "
                        f"({error}); nothing installed"
                    ) from None
        _install(ds, staged, folder)
    except BaseException as error:
        for _, temp, _ in staged:
            temp.unlink(missing_ok=True)
        if isinstance(error, ChecksumError):  # a bad archive is fetched afresh next time
            for src in ds.sources:
                (root / ".downloads" / src.filename).unlink(missing_ok=True)
        raise
    if mirror is None:
        for src in ds.sources:
            done = root / ".downloads" / src.filename
            if done.is_file() and all(_present(folder, kept) for kept in src.files):
                done.unlink()  # installed: the archive is not needed any more
    print(f"{ds.name}: {len(todo)} file(s) installed and verified in {folder}")
    return folder


def format_list(present: Callable[[DataSet], bool] | None = None) -> str:
    """``structattn download --list``: every data set, its licence, pinned or not, the
    recipes that need it and (with ``present``) whether it is present."""
    lines = []
    for ds in manifest().values():
        state = "" if present is None else (" [present]" if present(ds) else " [missing]")
        pinned = "pinned" if ds.pinned else "UNPINNED (sha256 recorded at download)"
        lines.append(f"{ds.name}{state}: {ds.description}")
        lines.append(f"    folder <root>/{ds.folder}; {len(ds.files)} files, {pinned}")
        lines.append(f"    licence: {ds.licence}")
        if ds.recipes or ds.optional_for:
            optional = f"; optional for {', '.join(ds.optional_for)}" if ds.optional_for else ""
            lines.append(f"    recipes: {', '.join(ds.recipes) or '-'}{optional}")
    return "\n".join(lines)
