"""Smoke test of ``benchmarks/recipe_steps.py`` (issue 22, item 4): every row runs with the
recipes' quick presets and gives a finite ratio; a row that cannot be built is printed as
``n/a: reason``; the timed step is a real training step. No timing assertions."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from structattn.training import TrainConfig

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "recipe_steps.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("structattn_bench_recipe_steps", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.data("glove", "ptb", "sick", "small_parallel_enja")
def test_quick_table_has_every_row_with_a_finite_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = _load()
    out = tmp_path / "steps.json"
    argv = ["--quick", "--repeats", "1", "--warmup", "0", "--threads", "1", "--json", str(out)]
    threads = torch.get_num_threads()
    try:
        assert module.main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # main() sets the thread count process-wide
    names = [row.name for row in module.ROWS]
    assert {"tree-transduction", "nmt", "nli", "mfa", "lstmn-lm", "prpn", "transformer"} <= set(
        names
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["recipe"] for r in rows] == names
    for r in rows:
        assert "error" not in r, r
        for key in ("structured_ms", "simple_ms", "ratio"):
            assert math.isfinite(r[key]) and r[key] > 0, r
        assert r["met"] == (r["ratio"] <= r["target"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(names)  # header + one line per row
    for name in names:
        assert any(line.split("|")[1].strip() == name for line in table), name


def test_a_row_that_cannot_be_built_is_printed_as_na() -> None:
    module = _load()

    def broken(quick: bool, count: int) -> object:
        raise AttributeError("module has no attribute 'build_model'")

    row = module.Row("broken", "structured", "simple", 1.5, broken)
    result = module.measure(row, True, 1, 1, 0)
    assert result["error"].startswith("AttributeError")
    line = module.format_table([result]).splitlines()[-1]
    assert "n/a: AttributeError: module has no attribute 'build_model'" in line


def test_training_call_is_fits_step() -> None:
    """Loss / examples, backward, clipping to max_grad_norm, SGD: checked by hand; the
    state returned by the loss is carried (detached) to the next batch."""
    module = _load()
    model = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(model.weight)
    x = torch.tensor([[3.0, 4.0], [3.0, 4.0]])  # 2 examples
    seen: list[object] = []

    def loss(m: nn.Module, batch: torch.Tensor, state: object) -> tuple:
        seen.append(state)
        return -m(batch).sum(), batch.shape[0], 0, torch.ones(1, requires_grad=True) * 2

    train = TrainConfig(epochs=1, lr=0.5, max_grad_norm=1.0)
    call = module.training_call(model, loss, [x, x], train)
    total = call()
    # step 1: grad of -(w.x) summed over 2 examples / 2 = -(3, 4), norm 5 -> clipped to
    # -(0.6, 0.8); SGD 0.5 -> w = (0.3, 0.4); step 2's loss: -2 * (0.9 + 1.6) = -5
    assert torch.allclose(model.weight, torch.tensor([[0.6, 0.8]]))
    assert torch.isclose(total, torch.tensor(-5.0))
    assert seen[0] is None and isinstance(seen[1], torch.Tensor)
    assert not seen[1].requires_grad


def test_only_takes_the_row_names() -> None:
    module = _load()
    with pytest.raises(SystemExit) as stop:
        module.main(["--only", "no-such-recipe"])
    assert stop.value.code == 2
