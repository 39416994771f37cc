"""Tests without the data (#37): on a copy of the repository with no ``../shared`` next to it
(a user's clone), the tests marked ``@pytest.mark.data`` are skipped with a reason naming the
data set, the rest run; with STRUCTATTN_REQUIRE_DATA=1 (what ``.ci/run`` sets) the same tests
are errors. Runs pytest in a subprocess on a copy, so it does not depend on whether this
machine has ``../shared``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# fast files with data tests and plain tests side by side: 4 data tests, one per data set
FILES = ("test_data_treebank.py", "test_data_lm.py", "test_data_classification.py")
DATA_TESTS = {
    "test_data_treebank.py::test_the_shared_sample_counts": "nltk_treebank_sample",
    "test_data_treebank.py::test_wsj10_conventions_on_the_sample": "nltk_treebank_sample",
    "test_data_lm.py::test_real_corpora[ptb": "ptb",
    "test_data_lm.py::test_real_corpora[wikitext-2": "wikitext-2",
    "test_data_classification.py::test_real_sick": "sick",
    "test_data_classification.py::test_real_snli": "snli_devtest",
    "test_data_classification.py::test_real_sst": "sst",
}


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """src/, the chosen test files, conftest.py and pyproject.toml copied to
    ``<tmp>/clone``: its ``../shared`` (and the working directory's) does not exist."""
    base = tmp_path_factory.mktemp("nodata")
    repo = base / "clone"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", repo / "src", ignore=ignore)
    (repo / "tests").mkdir()
    for name in ("conftest.py", "oracles.py", "shared_data.py", *FILES):
        shutil.copy2(ROOT / "tests" / name, repo / "tests" / name)
    shutil.copy2(ROOT / "pyproject.toml", repo / "pyproject.toml")
    assert not (base / "shared").exists()
    return repo


def _pytest(repo: Path, require: bool) -> subprocess.CompletedProcess[str]:
    """pytest on the copy with every data location pointed at empty places: no
    STRUCTATTN_* variable, HOME and XDG_CACHE_HOME (a user cache folder) inside the copy."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRUCTATTN_")}
    env.update(
        PYTHONPATH=str(repo / "src"),
        HOME=str(repo / "home"),
        XDG_CACHE_HOME=str(repo / "home" / ".cache"),
        STRUCTATTN_EXTENSION="0",  # no C++ build in the copy
        COLUMNS="1000",  # summary lines whole
    )
    if require:
        env["STRUCTATTN_REQUIRE_DATA"] = "1"
    files = [f"tests/{name}" for name in FILES]
    command = [sys.executable, "-m", "pytest", "-q", "-rsE", "-p", "no:cacheprovider", *files]
    return subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=300)


def _count(output: str, outcome: str) -> int:
    found = re.search(rf"(\d+) {outcome}", output.strip().splitlines()[-1])
    return int(found.group(1)) if found else 0


def test_data_tests_skip_with_the_data_set_named_and_the_rest_pass(clone: Path) -> None:
    result = _pytest(clone, require=False)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert str(ROOT) not in out  # the lookup never reached this checkout's ../shared
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == _count(out, "skipped") == len(DATA_TESTS), out
    for name in DATA_TESTS.values():
        reason = f"data set {name!r} not found ("  # then the places tried
        assert any(reason in line and "STRUCTATTN_DATA" in line for line in skipped), (name, out)
    assert _count(out, "passed") > 20 and _count(out, "failed") == _count(out, "error") == 0


def test_require_data_turns_the_skips_into_errors(clone: Path) -> None:
    result = _pytest(clone, require=True)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    errors = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert _count(out, "error") == len(DATA_TESTS) and _count(out, "skipped") == 0, out
    for test, name in DATA_TESTS.items():
        line = next((e for e in errors if test in e), "")
        assert "STRUCTATTN_REQUIRE_DATA is set" in line and f"data set {name!r}" in line, out
    assert _count(out, "passed") > 20 and _count(out, "failed") == 0
