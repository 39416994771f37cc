"""The ``structattn`` command line."""

from __future__ import annotations

import subprocess
import sys

from structattn.cli import main


def test_tour_prints_worked_example(capsys) -> None:
    assert main(["tour"]) == 0
    text = capsys.readouterr().out
    assert "MAP tree" in text and "Viterbi" in text and "Mean-field" in text


def test_console_script_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "structattn.cli", "tour"], capture_output=True, text=True, check=True
    )
    assert "MAP tree" in out.stdout
