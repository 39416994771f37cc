"""LSTMN language modelling (#17): tapes carried across windows, the memory span, the
LSTMN LM and the lstmn-lm recipe's config and models."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from structattn.models.language_model import LSTMNLanguageModel, RNNLanguageModel
from structattn.nn import DepthGatedLSTM, GatedFeedbackLSTM
from structattn.nn.lstmn import LSTMN, LSTMNCell, LSTMNState
from structattn.recipes.lstmn_lm import MODELS, RECIPE, LSTMNLMConfig, _table, build_model


def _cut(state: LSTMNState, span: int) -> LSTMNState:
    """Slot 0 and the last ``span`` slots (what forward keeps with ``memory_span``)."""
    if state.hidden.shape[1] <= span + 1:
        return state
    index = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(-span, 0)])
    index = index + torch.where(index < 0, state.hidden.shape[1], 0)
    return LSTMNState(
        state.hidden[:, index], state.memory[:, index], state.keys[:, index],
        state.valid[:, index], state.summary,
    )  # fmt: skip


def test_windows_with_the_carried_state_equal_one_pass() -> None:
    torch.manual_seed(0)
    cell = LSTMNCell(3, 5).double()
    x = torch.randn(2, 9, 3, dtype=torch.float64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 2] = mask[1, 6] = False  # padded steps inside the windows
    whole = cell(x, mask)
    first = cell(x[:, :4], mask[:, :4])
    second = cell(x[:, 4:], mask[:, 4:], state=first.final_state)
    assert torch.allclose(torch.cat([first.hidden, second.hidden], 1), whole.hidden)
    assert torch.allclose(second.final_state.memory, whole.final_state.memory)
    # attention of the second window: over the 5 starting slots (slot 0 too) then its own 5
    assert second.attention.shape == (2, 5, 10)
    assert torch.allclose(second.attention[:, :, 1:], whole.attention[:, 4:])


@pytest.mark.parametrize("span", [1, 2, 4])
def test_memory_span_matches_step_by_step_with_a_cut_tape(span: int) -> None:
    torch.manual_seed(1)
    cell = LSTMNCell(3, 4).double()
    x = torch.randn(2, 8, 3, dtype=torch.float64)
    out = cell(x[:, :5], memory_span=span)
    out2 = cell(x[:, 5:], state=out.final_state, memory_span=span)
    state = None
    hidden = []
    for t in range(8):
        step = cell.step(x[:, t], state)
        hidden.append(step.hidden)
        state = _cut(step.state, span)
    reference = torch.stack(hidden, 1)
    assert torch.allclose(torch.cat([out.hidden, out2.hidden], 1), reference)
    assert out2.final_state.hidden.shape[1] == min(span + 1, 9)  # slot 0 + the span
    rows = out.attention  # [B, 5, 5]: each row attends to at most `span` words
    assert ((rows > 0).sum(-1) <= span).all()
    with pytest.raises(ValueError, match="memory_span"):
        cell(x, memory_span=0)


def test_stack_state_and_span() -> None:
    torch.manual_seed(2)
    stack = LSTMN(3, 4, num_layers=2).eval()
    x = torch.randn(2, 6, 3)
    whole = stack(x)
    a = stack(x[:, :2])
    b = stack(x[:, 2:], state=a.final_state)
    assert torch.allclose(torch.cat([a.hidden, b.hidden], 1), whole.hidden, atol=1e-6)
    assert b.layer_attention.shape == (2, 2, 4, 7)
    with pytest.raises(ValueError, match="2 layer states"):
        stack(x, state=a.final_state[:1])


def test_lstmn_lm_carries_its_tape_across_windows() -> None:
    torch.manual_seed(3)
    model = LSTMNLanguageModel(20, 6, 6, num_layers=2, memory_span=50).eval()
    ids = torch.randint(0, 20, (3, 12))
    start = model.initial_state(3, torch.device("cpu"))
    whole, _ = model(ids, start)
    left, state = model(ids[:, :5], start)
    right, state = model(ids[:, 5:], state)
    assert torch.allclose(torch.cat([left, right], 1), whole, atol=1e-5)
    assert all(type(layer) is tuple for layer in state)  # plain tuples: checkpointable
    short = LSTMNLanguageModel(20, 6, 6, memory_span=3)
    _, state = short(ids, short.initial_state(3, torch.device("cpu")))
    assert state[0][0].shape == (3, 4, 6)  # slot 0 + 3 slots carried
    logits, _ = short(ids[:, :2], state)
    assert logits.shape == (3, 2, 20)


def test_config_models_and_table() -> None:
    for name in MODELS:
        config = LSTMNLMConfig(model=name, embed_size=4, hidden_size=4)  # type: ignore[arg-type]
        model = build_model(config, 30)
        lstmn = isinstance(model, LSTMNLanguageModel)
        assert lstmn == name.startswith("lstmn")
        assert isinstance(model, LSTMNLanguageModel | RNNLanguageModel)
        depth = len(model.lstmn.layers) if lstmn else model.num_layers  # type: ignore[union-attr]
        assert depth == (3 if name.endswith("-3") else 1)
        logits, _ = model(torch.zeros(2, 3, dtype=torch.long), model.initial_state(2, "cpu"))  # type: ignore[operator]
        assert logits.shape == (2, 3, 30)
        kinds = {"glstm-3": GatedFeedbackLSTM, "dlstm-3": DepthGatedLSTM}
        if name in kinds:
            assert isinstance(model.rnn, kinds[name])  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="memory_span"):
        LSTMNLMConfig(memory_span=0)
    with pytest.raises(ValueError, match="model"):
        LSTMNLMConfig(model="gru")  # type: ignore[arg-type]
    assert LSTMNLMConfig().train.lr == 0.65 and LSTMNLMConfig().lm.batch_size == 40
    assert RECIPE.presets["paper"].config.hidden_size == 300
    table = _table({("lstmn",): {"test": {"perplexity": 120.0}, "valid": {"perplexity": 125.0}}})
    assert "LSTMN" in table and "120.0" in table and "108" in table


def test_benchmark_script_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks/lstmn_lm.py --quick`` prints tokens/s and a ratio per model (LSTM: 1)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "lstmn_lm.py"
    sys.path.insert(0, str(path.parent))  # its `timing` helper
    try:
        spec = importlib.util.spec_from_file_location("structattn_bench_lstmn_lm", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        threads = torch.get_num_threads()
        try:
            assert (
                module.main(["--quick", "--repeats", "1", "--warmup", "0", "--threads", "1"]) == 0
            )
        finally:
            torch.set_num_threads(threads)
    finally:
        sys.path.remove(str(path.parent))
    rows = capsys.readouterr().out.splitlines()[2:]
    ratios = {line.rsplit(None, 2)[0]: float(line.split()[-1]) for line in rows}
    assert set(ratios) == set(module.CONFIGS) and ratios["LSTM"] == 1.0
