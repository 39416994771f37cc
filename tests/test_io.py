"""structattn.io's data-directory rule: --data-dir, then $STRUCTATTN_DATA, then the user
cache, then ../shared/data next to the working directory or the checkout; the error text;
and the OS file lock (file_lock)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from structattn.data.babi import default_data_dir as babi_data_dir
from structattn.io import (
    DATA_ENV,
    FileLockBusyError,
    data_dir,
    data_roots,
    file_lock,
    shared_data_dir,
    user_data_cache,
)

NAME = "structattn-test-set"  # a data set folder that no real root holds


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A home without a cache, no $STRUCTATTN_DATA, the working directory ``tmp/work``
    (so ``tmp/shared/data`` is the ../shared/data next to it); the four roots by name."""
    tmp_path = tmp_path.resolve()
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv(DATA_ENV, raising=False)
    monkeypatch.chdir(work)
    return {
        "env": tmp_path / "env",
        "cache": home / ".cache" / "structattn" / "data",
        "shared": tmp_path / "shared" / "data",
        "explicit": tmp_path / "mine",
    }


def _make(root: Path, *parts: str) -> Path:
    folder = root.joinpath(*parts)
    folder.mkdir(parents=True)
    return folder.resolve()


def test_precedence(places: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    shared = _make(places["shared"], NAME, "en")
    assert data_dir(NAME, "en", what="x") == shared  # ../shared/data next to the cwd
    cache = _make(places["cache"], NAME, "en")
    assert data_dir(NAME, "en", what="x") == cache  # the user cache beats ../shared
    monkeypatch.setenv(DATA_ENV, str(places["env"]))
    assert data_dir(NAME, "en", what="x") == cache  # $STRUCTATTN_DATA lacks it: next root
    env = _make(places["env"], NAME, "en")
    assert data_dir(NAME, "en", what="x") == env  # $STRUCTATTN_DATA beats the cache
    explicit = _make(places["explicit"])
    assert data_dir(NAME, "en", what="x", explicit=explicit) == explicit  # --data-dir wins
    assert data_dir(NAME, "en", what="x", explicit="") == env  # "" = no --data-dir
    assert shared_data_dir(NAME, "en", what="x") == env  # the old name, same rule


def test_loaders_follow_the_rule(places: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    env = _make(places["env"], "babi", "en")
    monkeypatch.setenv(DATA_ENV, str(places["env"]))
    assert babi_data_dir() == env


def test_user_cache_honours_xdg(places: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    assert user_data_cache() == places["cache"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(places["env"]))
    assert user_data_cache() == places["env"] / "structattn" / "data"
    folder = _make(places["env"], "structattn", "data", NAME)
    assert data_dir(NAME, what="x") == folder
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # ignored, as the XDG rule says
    assert user_data_cache() == places["cache"]


def test_roots_in_order(places: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    checkout = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
    expected = [places["cache"], places["shared"], checkout.resolve()]
    assert [root.path for root in data_roots()] == expected
    monkeypatch.setenv(DATA_ENV, str(places["env"]))
    roots = data_roots()
    assert [root.path for root in roots] == [places["env"], *expected]
    assert roots[0].source == "$STRUCTATTN_DATA"
    monkeypatch.setenv(DATA_ENV, str(places["cache"]))  # the same folder is listed once
    assert [root.path for root in data_roots()] == expected


def test_error_names_the_set_every_place_and_the_fix(
    places: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DATA_ENV, str(places["env"]))
    with pytest.raises(FileNotFoundError) as caught:
        data_dir(NAME, "en", what="The test set", hint=" pointing at the folder with a.txt")
    message = str(caught.value)
    assert message.startswith("The test set not found")
    tried = [
        str(places["env"] / NAME / "en"),
        str(places["cache"] / NAME / "en"),
        str(places["shared"] / NAME / "en"),
    ]
    positions = [message.index(path) for path in tried]
    assert positions == sorted(positions)  # in the order they were tried
    assert "$STRUCTATTN_DATA" in message and "user cache" in message
    assert "pass --data-dir pointing at the folder with a.txt" in message
    assert f"{DATA_ENV}=<root>" in message and f"<root>/{NAME}/en" in message
    assert f"put the data set in {places['cache'] / NAME / 'en'}." in message
    assert "now unset" not in message
    monkeypatch.delenv(DATA_ENV)
    with pytest.raises(FileNotFoundError, match=r"\(now unset\)"):
        data_dir(NAME, what="x")
    with pytest.raises(FileNotFoundError, match="--data-dir .*mine is not a folder"):
        data_dir(NAME, what="x", explicit=places["explicit"])


# ---- file_lock: the one OS lock of the kernel build and the run directory writer ----------
_HOLDER = """
import sys, time
from structattn.io import file_lock
with file_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_file_lock_refuses_waits_and_names_the_holder(tmp_path: Path) -> None:
    """timeout=0 refuses at once, timeout=t waits t seconds, both naming the holder's pid;
    on_wait is called once; the lock is free again after the block."""
    path = tmp_path / "sub" / "x.lock"
    with file_lock(path) as locked:
        assert locked and path.read_text() == f"{os.getpid()}\n"
        with pytest.raises(FileLockBusyError, match=rf"pid {os.getpid()}\)") as busy:
            with file_lock(path, timeout=0):
                pass  # pragma: no cover
        assert busy.value.holder == str(os.getpid()) and busy.value.path == path
        seen: list[str] = []
        start = time.monotonic()
        with pytest.raises(FileLockBusyError):
            with file_lock(path, timeout=0.3, on_wait=seen.append, poll=0.05):
                pass  # pragma: no cover
        assert time.monotonic() - start >= 0.3 and seen == [str(os.getpid())]
    with file_lock(path, timeout=0):
        pass
    assert path.exists()  # kept unless remove=True


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_file_lock_waits_for_a_live_holder(tmp_path: Path) -> None:
    """timeout=None waits until the holder lets go (a thread holding it for 0.3 s)."""
    path = tmp_path / "x.lock"
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with file_lock(path):
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    assert entered.wait(10)
    seen: list[str] = []
    threading.Timer(0.3, release.set).start()
    start = time.monotonic()
    with file_lock(path, on_wait=seen.append):
        assert time.monotonic() - start >= 0.25
    thread.join(10)
    assert seen == [str(os.getpid())]


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_file_lock_dies_with_its_holder(tmp_path: Path) -> None:
    """kill -9 of the holder releases the lock at once (nothing stale to remove)."""
    path = tmp_path / "x.lock"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        with pytest.raises(FileLockBusyError, match=f"pid {holder.pid}"):
            with file_lock(path, timeout=0):
                pass  # pragma: no cover
        holder.kill()
        holder.wait(10)
        with file_lock(path, timeout=5):
            pass
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_file_lock_remove(tmp_path: Path) -> None:
    """remove=True deletes the file on release; a waiter that had opened the deleted file
    locks the new one instead, so two holders never overlap."""
    path = tmp_path / "x.lock"
    inside: list[int] = []
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with file_lock(path, remove=True):
            inside.append(1)
            entered.set()
            release.wait(10)
            inside.remove(1)

    thread = threading.Thread(target=hold)
    thread.start()
    assert entered.wait(10)
    threading.Timer(0.2, release.set).start()
    with file_lock(path, timeout=10, poll=0.01, remove=True):
        assert not inside and path.exists()
    thread.join(10)
    assert not path.exists()
