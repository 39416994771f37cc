"""The source distribution and the wheel hold what they must (issue 38.9): the sdist's test
suite collects (oracles, conftest), the build files, a licence, the typing marker."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tracked_copy(target: Path) -> Path:
    """The repository's files as a fresh clone has them (git's list, else the tree less
    build outputs), copied to ``target``: builds never touch the working tree."""
    for name in _tracked_files():
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    return target


def _tracked_files() -> list[Path]:
    """The files a fresh clone has: git's list, else the tree less build outputs."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout.decode()
        files = [Path(name) for name in listed.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", ".venv-bench", "build", "dist", "runs"}
        files = [
            p.relative_to(ROOT)
            for p in ROOT.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(ROOT).parts)
        ]
    return files


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[str], str]:
    """(sdist member names, wheel member names, wheel METADATA) built by setuptools' PEP 517
    backend in a subprocess."""
    source = _tracked_copy(tmp_path_factory.mktemp("source"))
    out = tmp_path_factory.mktemp("dist")
    names = []
    for hook in ("build_sdist", "build_wheel"):  # one process each (the backend keeps state)
        code = f"import sys, setuptools.build_meta as b; print('BUILT', b.{hook}(sys.argv[1]))"
        result = subprocess.run(
            [sys.executable, "-c", code, str(out)], cwd=source, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr[-3000:]
        line = [x for x in result.stdout.splitlines() if x.startswith("BUILT ")][-1]
        names.append(line.split()[1])
    sdist_name, wheel_name = names
    with tarfile.open(out / sdist_name) as sdist:
        sdist_files = [m.name.split("/", 1)[1] for m in sdist.getmembers() if m.isfile()]
    with zipfile.ZipFile(out / wheel_name) as wheel:
        wheel_files = wheel.namelist()
        metadata = next(n for n in wheel_files if n.endswith(".dist-info/METADATA"))
        meta = wheel.read(metadata).decode()
    return sdist_files, wheel_files, meta


def test_sdist_holds_the_test_suite_and_build_files(built: tuple[list[str], ...]) -> None:
    sdist = set(built[0])
    for name in (
        "tests/oracles.py",
        "tests/conftest.py",
        "tests/test_packaging.py",
        "constraints.txt",
        "Makefile",
        "LICENSE",
        "README.md",
        "pyproject.toml",
        "src/structattn/py.typed",
        "src/structattn/data/manifest.json",
        "src/structattn/structs/_eisner.cpp",
        "src/structattn/structs/_kernels.h",
    ):
        assert name in sdist, name
    tracked = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "tests").glob("*.py")
        if p.relative_to(ROOT) in _tracked_files()
    }
    assert tracked <= sdist
    assert not any("__pycache__" in name for name in sdist)


def test_wheel_holds_the_kernels_sources_typing_marker_and_licence(
    built: tuple[list[str], list[str], str],
) -> None:
    _, wheel, meta = built
    names = set(wheel)
    assert "structattn/py.typed" in names
    assert "structattn/data/manifest.json" in names  # structattn download's data sets
    for source in ("_kernels.cpp", "_eisner.cpp", "_matrix_tree.cpp", "_chain.cpp", "_kernels.h"):
        assert f"structattn/structs/{source}" in names, source
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith("tests/") for n in names)
    assert "License-Expression: MIT" in meta
