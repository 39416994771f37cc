"""Every ```python block of the README runs (examples are part of the tested API)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
#: optional dependencies a block may import: it is skipped where one is missing
OPTIONAL = ("transformers",)
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int) -> None:
    optional = [m for m in OPTIONAL if re.search(rf"^\s*(from|import) {m}\b", BLOCKS[index], re.M)]
    missing = [m for m in optional if not _installed(m)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (an optional dependency), not installed")
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {})
