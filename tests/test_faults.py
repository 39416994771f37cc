"""Faults a demanding user meets (issue 37, section 3): malformed or corrupt run files, a
full disk, two writers into one --out, a killed parent of worker processes. Each test
failed before its fix."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from test_recipes import TOY

from structattn import recipes
from structattn.cli import main
from structattn.recipes import runs
from structattn.training import CheckpointError, load_checkpoint, save_checkpoint
from structattn.training import checkpoint as checkpoint_module


@pytest.fixture(autouse=True)
def _toy() -> Iterator[None]:
    recipes.register(TOY)
    yield
    recipes.unregister("toy")


@pytest.fixture(autouse=True)
def _python_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRUCTATTN_EXTENSION", "0")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished toy cell (run_00, run_01), trained once; tests work on copies."""
    recipes.register(TOY)
    try:
        out = tmp_path_factory.mktemp("trained") / "cell"
        assert _cli("train", "toy", "--preset", "quick", "--out", str(out)) == 0
    finally:
        recipes.unregister("toy")
    return out


def _cli(*args: str) -> int:
    return main(["--threads", "1", *args])


def _copy(trained: Path, tmp_path: Path) -> Path:
    out = tmp_path / "cell"
    shutil.copytree(trained, out)
    return out


def _one_error(capsys: pytest.CaptureFixture[str], path: Path) -> str:
    """The command's stderr: one line, ``structattn: error: <path>...``."""
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err], err
    assert err.startswith("structattn: error: ") and str(path) in err, err
    return err


def _resume(out: Path) -> int:
    return _cli("train", "toy", "--preset", "quick", "--out", str(out), "--resume")


# ---- 7. malformed artefacts: one line naming the file ---------------------------------------
@pytest.mark.parametrize(
    ("text", "problem"),
    [("{}", "has no 'run', 'seconds'"), ('{\n  "run": "run_00",\n  "se', "not valid JSON")],
)
def test_malformed_done_json(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, problem: str
) -> None:
    """``{}`` gave ``KeyError: 'run'``; a truncated file a JSON error naming no file."""
    out = _copy(trained, tmp_path)
    capsys.readouterr()
    done = out / "run_00" / "done.json"
    done.write_text(text)
    assert _resume(out) == 2
    assert problem in _one_error(capsys, done)


def test_metrics_line_not_an_object(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``[1, 2]`` line in metrics.jsonl gave an AttributeError (a summary reads the last
    training loss there for records written before done.json kept it)."""
    out = _copy(trained, tmp_path)
    capsys.readouterr()
    done = out / "run_01" / "done.json"
    record = json.loads(done.read_text())
    del record["final_train_loss"]
    done.write_text(json.dumps(record))
    metrics = out / "run_01" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + "[1, 2]\n")
    assert _resume(out) == 2
    assert "expected a JSON object, found a list" in _one_error(capsys, metrics)


def test_metrics_a_directory(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """metrics.jsonl a directory gave an IsADirectoryError traceback on resume."""
    out = _copy(trained, tmp_path)
    capsys.readouterr()
    (out / "run_01" / "done.json").unlink()  # a partial run: resumed from its checkpoint
    metrics = out / "run_01" / "metrics.jsonl"
    metrics.unlink()
    metrics.mkdir()
    assert _resume(out) == 2
    assert "is a directory" in _one_error(capsys, metrics)


def test_config_json_a_list_resumes(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A list in config.json: --resume takes the checkpoint's copy and repairs the file."""
    out = _copy(trained, tmp_path)
    (out / "run_01" / "done.json").unlink()
    config = out / "run_01" / "config.json"
    config.write_text("[1, 2]\n")
    assert _resume(out) == 0
    assert isinstance(json.loads(config.read_text()), dict)


def test_model_without_config(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model.pt without ``config`` gave ``KeyError: 'config'`` from eval."""
    out = _copy(trained, tmp_path)
    capsys.readouterr()
    model = out / "run_00" / "model.pt"
    state = torch.load(model, weights_only=True)
    del state["config"]
    torch.save(state, model)
    assert _cli("eval", "toy", "--checkpoint", str(out / "run_00")) == 2
    assert "has no 'config'" in _one_error(capsys, model)


class _Payload:
    def __reduce__(self):  # type: ignore[no-untyped-def]  # pragma: no cover - must never run
        return (print, ("pickle payload ran",))


def test_pickle_payload_refused_in_one_line(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The weights-only refusal was 6 lines of torch text suggesting weights_only=False."""
    out = _copy(trained, tmp_path)
    capsys.readouterr()
    model = out / "run_00" / "model.pt"
    torch.save({"format": "structattn-checkpoint-v1", "payload": _Payload()}, model)
    assert _cli("eval", "toy", "--checkpoint", str(out / "run_00")) == 2
    err = _one_error(capsys, model)
    assert "pickled Python objects" in err and "weights_only" not in err
    assert "payload ran" not in capsys.readouterr().out


# ---- 5. a bit flip in model.pt or checkpoint.pt ---------------------------------------------
def _flip_tensor_byte(path: Path) -> None:
    """Flip one bit inside the largest tensor stored in ``path`` (torch's zip archive)."""
    with zipfile.ZipFile(path) as archive:
        info = max(
            (i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size
        )
    raw = bytearray(path.read_bytes())
    header = info.header_offset  # local header: 30 bytes, the name, the extra field
    name_length, extra_length = struct.unpack("<HH", raw[header + 26 : header + 30])
    start = header + 30 + name_length + extra_length
    raw[start + info.file_size // 2] ^= 0x40
    path.write_bytes(bytes(raw))


def test_bit_flip_in_model_is_detected(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A flipped bit in model.pt's weights: eval exited 0 with a slightly different score."""
    out = _copy(trained, tmp_path)
    capsys.readouterr()
    assert _cli("eval", "toy", "--checkpoint", str(out / "run_00")) == 0  # intact: loads
    capsys.readouterr()
    model = out / "run_00" / "model.pt"
    _flip_tensor_byte(model)
    assert _cli("eval", "toy", "--checkpoint", str(out / "run_00")) == 2
    assert "checksum" in _one_error(capsys, model)


def test_bit_flip_in_checkpoint_is_detected(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A flipped checkpoint.pt resumed and trained on."""
    out = _copy(trained, tmp_path)
    capsys.readouterr()
    (out / "run_01" / "done.json").unlink()
    checkpoint = out / "run_01" / "checkpoint.pt"
    _flip_tensor_byte(checkpoint)
    assert _resume(out) == 2
    assert "checksum" in _one_error(capsys, checkpoint)


# ---- 6. a full disk while saving ------------------------------------------------------------
_FULL_DISK = [
    OSError(errno.ENOSPC, "No space left on device"),
    RuntimeError(
        "[enforce fail at inline_container.cc:672] . unexpected pos 8064 vs 7958\n"
        "frame #0: c10::ThrowEnforceNotMet(...)\n" + "frame #n: ...\n" * 40
    ),
]


def _fill_disk(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    """torch.save writes a little, then fails as it does when the disk is full."""

    def save(state: object, handle: Any) -> None:
        handle.write(b"PK\x03\x04partial")
        raise error

    monkeypatch.setattr(checkpoint_module.torch, "save", save)


@pytest.mark.parametrize("error", _FULL_DISK, ids=["ENOSPC", "enforce-fail"])
def test_disk_full_on_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    """A 45-line traceback before; now one error naming the path, the old file intact."""
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"format": "structattn-checkpoint-v1", "value": 1})
    _fill_disk(monkeypatch, error)
    with pytest.raises(CheckpointError) as raised:
        save_checkpoint(path, {"format": "structattn-checkpoint-v1", "value": 2})
    assert str(raised.value) == f"{path}: cannot write it: no space left on device " + (
        "(the previous file is intact)"
    )
    monkeypatch.undo()
    assert load_checkpoint(path)["value"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temp file left


@pytest.mark.parametrize("error", _FULL_DISK, ids=["ENOSPC", "enforce-fail"])
def test_disk_full_in_train_is_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: BaseException,
) -> None:
    _fill_disk(monkeypatch, error)
    assert _cli("train", "toy", "--preset", "quick", "--out", str(tmp_path / "cell")) == 2
    err = _one_error(capsys, tmp_path / "cell" / "run_00")
    assert "no space left on device" in err


# ---- 2. two writers into one --out ----------------------------------------------------------
_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("locked", flush=True)
time.sleep(120)
"""


def test_second_writer_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two `train`s into one --out both exited 0 with the runs mixed; now the second is
    refused in one line while the first holds the directory's lock, and a writer killed
    with -9 leaves nothing that blocks the next one (the OS releases the lock)."""
    out = tmp_path / "cell"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(out / ".structattn.lock")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        assert _cli("train", "toy", "--preset", "quick", "--out", str(out)) == 2
        err = _one_error(capsys, out)
        assert f"is being written by another structattn process (pid {holder.pid})" in err
        assert "use another --out" in err
        assert _cli("reproduce", "toy", "--preset", "quick", "--out", str(out)) == 2
        assert f"(pid {holder.pid})" in _one_error(capsys, out)
        assert runs.run_state(out / "run_00") == "new"  # nothing written
    finally:
        holder.kill()
        holder.wait()
    assert _cli("train", "toy", "--preset", "quick", "--out", str(out)) == 0
    assert not (out / ".structattn.lock").exists()  # released and removed


def test_lock_is_held_during_the_run(tmp_path: Path) -> None:
    """While `train_cell` runs, a second writer is refused (checked from inside a run)."""
    out = tmp_path / "cell"
    seen: list[str] = []
    train = TOY.train

    def train_and_try(config: Any, run_dir: Path, resume: bool) -> dict[str, Any]:
        with pytest.raises(runs.RunDirectoryBusyError, match="another structattn process"):
            with runs.writer_lock(out):
                pass  # pragma: no cover
        seen.append(run_dir.name)
        return train(config, run_dir, resume)

    recipe = replace(TOY, train=train_and_try)
    config = TOY.presets["quick"].config
    assert runs.train_cell(recipe, config, out) is not None
    assert seen == ["run_00", "run_01"]


# ---- 8. workers die with their parent -------------------------------------------------------
_SLEEPER = """
import os, time
from dataclasses import replace
from pathlib import Path
from test_recipes import TOY

def train(config, run_dir, resume):
    (Path(os.environ["SLEEPER_DIR"]) / f"worker_{os.getpid()}").write_text("")
    time.sleep(120)
    return {}

RECIPE = replace(TOY, name="sleeper", train=train)
"""

_PARENT = """
import sys
sys.path[:0] = sys.argv[1:3]
import sleeper
from structattn import recipes
from structattn.recipes import runs
recipes.register(sleeper.RECIPE)
jobs = runs.plan_runs(sleeper.RECIPE, sleeper.RECIPE.presets["quick"].config, sys.argv[3],
                      False, False)
runs.execute(sleeper.RECIPE, jobs, workers=2)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its new parent to reap it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:  # pragma: no cover - no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.mark.skipif(sys.platform == "win32", reason="kill -9 of a process tree: POSIX")
def test_workers_exit_when_the_parent_is_killed(tmp_path: Path) -> None:
    """Killing the parent of `train --jobs 2` left its workers running (one finished a run
    after the parent died); now they exit within seconds."""
    (tmp_path / "sleeper.py").write_text(_SLEEPER)
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "STRUCTATTN_EXTENSION": "0"}
    env["SLEEPER_DIR"] = str(tmp_path)
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, tests, str(tmp_path), str(tmp_path / "out" / "cell")],
        env=env,
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and time.monotonic() < deadline and parent.poll() is None:
            workers = [int(p.name.split("_")[1]) for p in tmp_path.glob("worker_*")]
            time.sleep(0.2)
        assert len(workers) == 2, "the workers did not start"
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, workers)), "a worker outlived its killed parent"
    finally:
        parent.kill()
        parent.wait()
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
