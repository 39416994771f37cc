"""The shared language-model code: models.language_model and recipes._lm (#17)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from structattn.models.language_model import LanguageModel, RNNLanguageModel, detach_state
from structattn.recipes._lm import (
    LMEvalOptions,
    LMRecipeParts,
    LMSettings,
    evaluate_lm,
    lm_stream,
    load_corpus,
    train_lm,
)
from structattn.recipes.config import replace_path
from structattn.training import TrainConfig, load_model_state


@dataclass(frozen=True)
class TinyConfig:
    """A LM recipe config: model fields, ``lm`` and ``train``."""

    cell: str = "lstm"  # rnn or lstm
    size: int = 16  # embedding and hidden size
    lm: LMSettings = field(default_factory=lambda: LMSettings(batch_size=4, bptt=6,
                                                              eval_batch_size=2))  # fmt: skip
    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(
            epochs=4, lr=0.02, optimizer="adam", normalize_by="tokens", progress=False,
            epoch_lines=False, max_grad_norm=5.0,
        )
    )  # fmt: skip


def tiny_model(config: TinyConfig, vocab_size: int) -> nn.Module:
    torch.manual_seed(config.train.seed)
    return RNNLanguageModel(vocab_size, config.size, config.size, cell=config.cell)  # type: ignore[arg-type]


def write_corpus(directory: Path, lines: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid", "test"):
        (directory / f"ptb.{split}.txt").write_text("".join(f" {line} \n" for line in lines))
    return directory


class Bigram(nn.Module):
    """A fixed bigram model (logits from a table) that counts its windows and keeps the
    states it was given."""

    def __init__(self, table: Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(table.clone())
        self.seen: list[Any] = []

    def initial_state(self, batch: int, device: torch.device) -> tuple[Tensor, Tensor]:
        return torch.zeros(batch, device=device), torch.zeros(batch, device=device)

    def forward(self, inputs: Tensor, state: Any) -> tuple[Tensor, Any]:
        self.seen.append(state)
        count = state[0] + inputs.shape[1]  # tokens read so far, per row
        carried = state[1] + self.table.sum()  # something with a graph
        return self.table[inputs], (count, carried)


def test_rnn_lm_shapes_interface_and_errors() -> None:
    for cell in ("rnn", "lstm"):
        model = RNNLanguageModel(13, 6, 6, num_layers=2, cell=cell, dropout=0.2, tie_weights=True)  # type: ignore[arg-type]
        assert isinstance(model, LanguageModel)
        state = model.initial_state(3, torch.device("cpu"))
        logits, new = model(torch.randint(0, 13, (3, 5)), state)
        assert logits.shape == (3, 5, 13) and len(new) == (1 if cell == "rnn" else 2)
        assert new[0].shape == (2, 3, 6)
        assert model.output.weight is model.embedding.weight
    with pytest.raises(ValueError, match="tied weights"):
        RNNLanguageModel(13, 6, 8, tie_weights=True)
    with pytest.raises(ValueError, match="cell"):
        RNNLanguageModel(13, 6, 8, cell="gru")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="LongTensor"):
        model = RNNLanguageModel(13, 6, 8)
        model(torch.zeros(2, 3), model.initial_state(2, torch.device("cpu")))


def test_detach_state_keeps_nesting() -> None:
    x = torch.ones(2, requires_grad=True) * 2
    state = {"a": (x, [x, None]), "b": 3}
    out = detach_state(state)
    assert out["b"] == 3 and out["a"][1][1] is None
    assert not out["a"][0].requires_grad and not out["a"][1][0].requires_grad
    assert torch.equal(out["a"][0], x)


def test_perplexity_of_a_hand_made_stream_is_exp_mean_nll(tmp_path: Path) -> None:
    table = torch.log_softmax(torch.randn(5, 5, generator=torch.Generator().manual_seed(1)), -1)
    stream = torch.tensor([2, 3, 4, 0, 3, 3, 0, 4, 2, 0])  # three sentences
    nll = [
        -float(table[a, b]) for a, b in zip(stream[:-1].tolist(), stream[1:].tolist(), strict=True)
    ]
    model = Bigram(table)
    out = tmp_path / "p.jsonl"
    vocab = load_corpus(LMSettings(data_dir=str(write_corpus(tmp_path / "c", ["a b c"])))).vocab
    result = evaluate_lm(model, stream, 1, 4, vocab, "test", out)
    assert result["tokens"] == 9
    assert result["perplexity"] == pytest.approx(math.exp(sum(nll) / 9), rel=1e-6)
    assert result["nll"] == pytest.approx(sum(nll) / 9, rel=1e-6)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert set(lines[0]) == {"split", "tokens", "nll", "perplexity"} and lines[0]["tokens"] == 9
    assert [x["tokens"] for x in lines[1:]] == [3, 3, 3]  # the first token is not predicted
    assert [x["index"] for x in lines[1:]] == [0, 1, 2]
    assert sum(x["nll"] for x in lines[1:]) == pytest.approx(sum(nll), rel=1e-6)
    assert lines[1]["nll"] == pytest.approx(sum(nll[:3]), rel=1e-6)
    assert lines[2]["sentence"] == "b b" and lines[1]["sentence"] == "a b c"
    # the state is carried across the windows of 4: 0, 4, 8 tokens read before each window
    assert [float(s[0][0]) for s in model.seen] == [0.0, 4.0, 8.0]
    # batch 2: one row per half of the stream, no per-sentence lines
    result = evaluate_lm(model, stream, 2, 4, vocab, "test", out)
    assert result["tokens"] == 8 and len(out.read_text().splitlines()) == 1


def test_training_carries_a_detached_state_and_restarts_it_each_epoch(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", ["a b c d", "e f"] * 20)
    config = replace_path(TinyConfig(), {"lm.data_dir": str(corpus), "train.epochs": 2})
    models: list[Bigram] = []

    def build(config: TinyConfig, vocab_size: int) -> nn.Module:
        models.append(Bigram(torch.zeros(vocab_size, vocab_size)))
        return models[-1]

    train_lm(config, tmp_path / "run", False, build, "tiny")
    seen = models[0].seen
    data_rows = lm_stream(config.lm, "train").numel() // 4
    windows = math.ceil((data_rows - 1) / 6)
    train_states = [s for s in seen if s[0].shape == (4,)]  # the validation passes use 2 rows
    assert len(train_states) == 2 * windows
    counts = [float(s[0][0]) for s in train_states]
    assert counts[:windows] == [6.0 * k for k in range(windows)]  # carried window to window
    assert counts[windows] == 0.0  # restarted at the second epoch
    assert all(not s[1].requires_grad for s in train_states)  # detached


def test_a_tiny_lstm_learns_a_repetitive_corpus(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", ["the cat sat on the mat", "a dog ran"] * 30)
    config = replace_path(TinyConfig(), {"lm.data_dir": str(corpus)})
    parts = LMRecipeParts("tiny", TinyConfig, tiny_model)
    summary = parts.train(config, tmp_path / "run")
    # 8 words + <eos>, <unk>: untrained, perplexity ~9; the corpus is almost deterministic
    assert -summary["best"]["metric"] < 1.6
    scores = parts.score(config, tmp_path / "run")
    assert scores["test"]["perplexity"] < 1.6
    assert scores["valid"]["perplexity"] == pytest.approx(-summary["best"]["metric"])
    lines = (tmp_path / "run" / "test_predictions.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 60
    text = parts.evaluate(tmp_path / "run", LMEvalOptions(split="valid", batch_size=2), "cpu", None)
    assert "valid: perplexity" in text and "batch 2" in text
    assert load_model_state(tmp_path / "run")["extra"]["vocab_size"] == 10
    with pytest.raises(ValueError, match="not a other run"):
        LMRecipeParts("other", TinyConfig, tiny_model).load(tmp_path / "run")


def test_settings_errors_and_cuts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bptt"):
        LMSettings(bptt=0)
    with pytest.raises(ValueError, match="train_tokens"):
        LMSettings(train_tokens=1)
    corpus = write_corpus(tmp_path / "c", ["a b c d"] * 10)
    settings = LMSettings(data_dir=str(corpus), train_tokens=7, eval_tokens=5)
    assert lm_stream(settings, "train").numel() == 7 and lm_stream(settings, "test").numel() == 5
    assert len(load_corpus(settings).vocab) == 6  # the whole train file


@pytest.mark.parametrize("recipe", ["mfa-lm", "lstmn-lm"])
def test_rnn_trains_with_its_own_lr_and_the_window_loss_is_per_row(recipe: str) -> None:
    from structattn import recipes
    from structattn.recipes.config import config_from_dict, config_to_dict

    config_class = recipes.get(recipe).config
    lstm = config_class(model="lstm")
    assert lstm.train.lr == 0.65 and lstm.train.normalize_by == "examples"
    rnn = config_class(model="rnn")
    assert rnn.train.lr == rnn.rnn_lr == 0.2
    assert config_from_dict(config_class, config_to_dict(rnn)) == rnn  # saved = what ran
    assert config_class(model="rnn", rnn_lr=0.3).train.lr == 0.3
    with pytest.raises(ValueError, match="rnn_lr"):
        config_class(model="rnn", rnn_lr=0.0)
