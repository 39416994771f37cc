"""LSTMN sentence and pair classifiers and the lstmn-sst recipe's data (#17)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from structattn.data.classification import ClassificationExample, WordVocabulary
from structattn.data.classification import default_classification_data_dir as data_dir
from structattn.models.lstmn_text import (
    PAIR_MODELS,
    PairClassifier,
    SentenceClassifier,
    SentenceEncoder,
    WordByWordAttention,
    masked_mean,
)
from structattn.recipes.lstmn_sst import (
    LSTMNSSTConfig,
    _summarize,
    _table,
    evaluate,
    labels_of,
    load_splits,
)

try:
    SST = data_dir("sst") / "trees"
except FileNotFoundError:  # pragma: no cover - the shared data is missing
    SST = Path("/nonexistent")
needs_sst = pytest.mark.data("sst")


@needs_sst
def test_sst_counts_on_the_real_files() -> None:
    fine = load_splits(LSTMNSSTConfig(task="fine"))
    assert [len(fine[s]) for s in ("train", "valid", "test")] == [8544, 1101, 2210]
    binary = load_splits(LSTMNSSTConfig(task="binary"))
    assert [len(binary[s]) for s in ("train", "valid", "test")] == [6920, 872, 1821]
    assert {ex.label for ex in binary["test"]} == {"negative", "positive"}
    cut = load_splits(LSTMNSSTConfig(train_size=7, eval_size=3))
    assert [len(cut[s]) for s in ("train", "valid", "test")] == [7, 3, 3]


@needs_sst
@pytest.mark.slow
def test_sst_phrase_training_set() -> None:
    phrases = load_splits(LSTMNSSTConfig(task="fine", phrases=True))
    assert len(phrases["train"]) == 318582 and len(phrases["valid"]) == 1101  # train only


def test_padding_does_not_change_an_item() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(2, 30, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 2:] = False
    tokens = tokens.masked_fill(~mask, 0)
    for kind in ("lstm", "lstmn"):
        model = SentenceClassifier(kind, 30, 6, 5, classes=5, num_layers=2).eval()  # type: ignore[arg-type]
        batch = model(tokens, mask)
        alone = model(tokens[1:2, :4], mask[1:2, :4])
        assert torch.allclose(batch[1], alone[0], atol=1e-5)
    for kind in PAIR_MODELS:
        pair = PairClassifier(kind, 30, 6, 5).eval()
        batch = pair(tokens, mask, tokens.flip(0), mask.flip(0))
        alone = pair(tokens[1:2, :4], mask[1:2, :4], tokens[1:2, :4], mask[1:2, :4])
        assert torch.allclose(batch[1], alone[0], atol=1e-5), kind
        with torch.no_grad():
            _, _, inter = pair.encode(tokens, mask, tokens, mask)
        if kind in ("lstm", "lstmn"):
            assert inter is None
        else:
            assert inter is not None and inter.shape == (3, 7, 7)
            assert torch.allclose(inter[0].sum(-1), torch.ones(7), atol=1e-5)
            assert float(inter[2, :, 2:].abs().sum()) == 0.0  # padded premise words
    with pytest.raises(ValueError, match="kind"):
        PairClassifier("gru", 30, 6, 5)


def test_word_by_word_attention_follows_rocktaschel_equations() -> None:
    """The module on a padded batch == the paper's equations on each item alone (float64)."""
    torch.manual_seed(0)
    att = WordByWordAttention(4).double()
    hyp, prem = torch.randn(2, 5, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    hyp_mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
    prem_mask = torch.tensor([[True] * 3, [True, True, False]])
    with torch.no_grad():
        tape, weights = att(hyp, hyp_mask, prem, prem_mask)
    for b, (t_len, s_len) in enumerate([(5, 3), (2, 2)]):
        y = prem[b, :s_len]  # [S, H]
        r = torch.zeros(4, dtype=torch.float64)
        for t in range(t_len):
            h = hyp[b, t]
            m = torch.tanh(
                y @ att.premise_proj.weight.T
                + h @ att.hypothesis_proj.weight.T
                + r @ att.carry_proj.weight.T
            )
            alpha = torch.softmax(m @ att.score.weight[0], 0)
            r = alpha @ y + torch.tanh(r @ att.carry.weight.T)
            out = torch.tanh(r @ att.out_attended.weight.T + h @ att.out_hidden.weight.T)
            assert torch.allclose(weights[b, t, :s_len], alpha)
            assert torch.allclose(tape[b, t], out)
        assert float(weights[b, t_len:].abs().sum() + weights[b, :, s_len:].abs().sum()) == 0.0
        assert float(tape[b, t_len:].abs().sum()) == 0.0


def test_lstm_encoder_final_state_is_the_last_real_word() -> None:
    torch.manual_seed(0)
    enc = SentenceEncoder("lstm", 3, 4).eval()
    x = torch.randn(2, 5, 3)
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
    out = enc(x, mask, final_state=True)
    alone = enc(x[1:, :2], mask[1:, :2], final_state=True)
    assert out.final is not None and alone.final is not None
    assert torch.allclose(out.final[0][:, 1], alone.final[0][:, 0], atol=1e-6)
    assert torch.allclose(out.final[1][:, 1], alone.final[1][:, 0], atol=1e-6)
    assert torch.allclose(out.hidden[1, :2], alone.hidden[0], atol=1e-6)
    assert float(out.hidden[1, 2:].abs().sum()) == 0.0
    started = enc(x, mask, state=out.final)  # a given start state changes the tape
    assert not torch.allclose(started.hidden[0], out.hidden[0])
    with pytest.raises(ValueError, match="LSTM encoder"):
        SentenceEncoder("lstmn", 3, 4)(x, mask, final_state=True)


def test_masked_mean_and_gradient_scale() -> None:
    x = torch.tensor([[[1.0], [3.0], [100.0]]])
    assert masked_mean(x, torch.tensor([[True, True, False]])).item() == 2.0
    model = SentenceClassifier("lstm", 10, 4, 4, classes=2)
    scale = torch.ones(10)
    scale[3] = 0.0
    model.embedding.set_gradient_scale(scale)
    tokens = torch.tensor([[3, 4]])
    model(tokens, torch.ones_like(tokens, dtype=torch.bool)).sum().backward()
    grad = model.embedding.embedding.weight.grad
    assert grad is not None and grad[3].abs().sum() == 0 and grad[4].abs().sum() > 0


def test_a_tiny_lstmn_learns_which_word_decides(tmp_path: Path) -> None:
    """Label = whether 'good' or 'bad' occurs (anywhere): the LSTMN must learn it."""
    gen = torch.Generator().manual_seed(0)
    words = ["a", "the", "film", "is", "was", "very"]
    examples = []
    for i in range(80):
        body = [words[int(j)] for j in torch.randint(0, len(words), (5,), generator=gen)]
        cue = "good" if i % 2 else "bad"
        body.insert(int(torch.randint(0, 6, (1,), generator=gen)), cue)
        examples.append(ClassificationExample(tuple(body), "positive" if i % 2 else "negative"))
    vocab = WordVocabulary.build(examples)
    labels = labels_of("binary")
    torch.manual_seed(0)
    model = SentenceClassifier("lstmn", len(vocab), 8, 8, classes=2, dropout=0.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    tokens = torch.tensor([vocab.encode(ex.tokens) for ex in examples])
    gold = torch.tensor([labels.encode(ex.label) for ex in examples])
    mask = torch.ones_like(tokens, dtype=torch.bool)
    for _ in range(40):
        loss = F.cross_entropy(model(tokens, mask), gold)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    out = tmp_path / "p.jsonl"
    result = evaluate(model, examples, vocab, labels, out)
    assert result["accuracy"] == 100.0
    first = json.loads(out.read_text().splitlines()[0])
    assert set(first) == {"index", "sentence", "gold", "predicted"} and first["gold"] == 0


def test_summary_and_table_of_several_seeds() -> None:
    config = LSTMNSSTConfig(model="lstmn", task="binary")
    records = [
        {"test": {"accuracy": 80.0}, "valid": {"accuracy": 81.0}},
        {"test": {"accuracy": 84.0}, "valid": {"accuracy": 80.0}},
    ]
    summary = _summarize(config, records)
    assert summary["test_mean"] == 82.0 and summary["test"]["accuracy"] == 80.0
    assert summary["test_std"] == pytest.approx(2.8284, abs=1e-3)
    table = _table({("binary", "lstmn"): summary})
    assert "82.0 +- 2.8 (n=2)" in table and "86.3" in table
    with pytest.raises(ValueError, match="task"):
        LSTMNSSTConfig(task="neutral")  # type: ignore[arg-type]


@pytest.mark.data("sick")
def test_nli_pairs_config_and_table() -> None:
    from structattn.recipes.lstmn_nli import LSTMNNLIConfig, load_pairs
    from structattn.recipes.lstmn_nli import _summarize as nli_summarize
    from structattn.recipes.lstmn_nli import _table as nli_table

    try:
        splits = load_pairs(LSTMNNLIConfig(max_train=30, max_eval=10))
    except FileNotFoundError:  # pragma: no cover - the shared data is missing
        pytest.skip("SICK not found")
    assert [len(splits[s]) for s in ("train", "valid", "test")] == [30, 10, 10]
    assert all(ex.pair for ex in splits["train"])
    with pytest.raises(ValueError, match="dataset"):
        LSTMNNLIConfig(dataset="mnli")  # type: ignore[arg-type]
    config = LSTMNNLIConfig(model="lstmn-deep", hidden_size=300)
    summary = nli_summarize(config, [{"test": {"accuracy": 70.0}, "valid": {"accuracy": 71.0}}])
    table = nli_table({(300, "lstmn-deep"): summary})
    assert "LSTMN deep fusion" in table and "85.7" in table and "70.0 +- 0.0 (n=1)" in table


@pytest.mark.data("sick", "glove")
def test_nli_first_epoch_trains_only_the_rows_without_a_vector(tmp_path: Path) -> None:
    from structattn.data.embeddings import build_embedding_matrix, read_word_vectors
    from structattn.recipes.config import replace_path
    from structattn.recipes.lstmn_nli import RECIPE as NLI
    from structattn.recipes.lstmn_nli import load_trained
    from structattn.recipes.lstmn_nli import train as nli_train

    config = replace_path(NLI.presets["quick"].config, {"train.seed": 3})
    try:
        nli_train(config, tmp_path / "run")
    except FileNotFoundError:  # pragma: no cover - the shared data is missing
        pytest.skip("SICK or GloVe not found")
    model, vocab, _ = load_trained(tmp_path / "run")
    matrix = build_embedding_matrix(vocab, read_word_vectors(None, words=vocab.tokens))
    weight = model.embedding.embedding.weight.detach()
    glove = matrix.pretrained
    assert glove.any() and (~glove[2:]).any()
    assert torch.equal(weight[glove], matrix.weight[glove])  # frozen in epoch 1
    assert not torch.allclose(weight[~glove][1:], matrix.weight[~glove][1:])  # <unk>, OOV moved
