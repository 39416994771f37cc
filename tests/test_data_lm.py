"""Word-level LM corpora: reading, vocabulary, batchify / BPTT windows, perplexity, real
PTB and WikiText-2 files."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from shared_data import DATA

from structattn.data.lm import (
    LMVocabulary,
    batchify,
    bptt_windows,
    corpus_files,
    corpus_stats,
    evaluate_stream,
    line_nll,
    load_lm_corpus,
    read_lm_lines,
)
from structattn.metrics import perplexity


def write_corpus(directory: Path, train: str, valid: str, test: str, prefix: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for split, text in (("train", train), ("valid", valid), ("test", test)):
        (directory / f"{prefix}{split}.txt").write_text(text, encoding="utf-8")
    return directory


def test_vocabulary_and_streams(tmp_path: Path) -> None:
    d = write_corpus(tmp_path, " the cat <unk> \n the dog \n\n", " the bird \n", " cat \n", "ptb.")
    corpus = load_lm_corpus(d)
    # <eos> 0, <unk> 1, then by count (the 2, cat/dog 1 each: first occurrence first)
    assert corpus.vocab.tokens == ("<eos>", "<unk>", "the", "cat", "dog")
    assert corpus.lines["train"] == [["the", "cat", "<unk>"], ["the", "dog"], []]
    # every line, the blank one too, ends with <eos>
    assert corpus.streams["train"].tolist() == [2, 3, 1, 0, 2, 4, 0, 0]
    assert corpus.streams["valid"].tolist() == [2, 1, 0]  # unknown "bird" -> <unk>
    stats = corpus_stats(corpus)
    assert stats["vocab_size"] == 5
    assert stats["splits"]["train"] == {"lines": 3, "words": 5, "tokens": 8, "unk": 1, "oov": 0}
    assert stats["splits"]["valid"] == {"lines": 1, "words": 2, "tokens": 3, "unk": 1, "oov": 1}
    assert LMVocabulary.from_dict(corpus.vocab.to_dict()) == corpus.vocab
    assert corpus.vocab.decode([2, 0]) == ["the", "<eos>"]
    with pytest.raises(ValueError, match="out of range"):
        corpus.vocab.decode([5])


def test_vocabulary_limits() -> None:
    lines = [["a", "b", "a", "c", "c", "c"]]
    assert LMVocabulary.build(lines).tokens == ("<eos>", "<unk>", "c", "a", "b")
    assert LMVocabulary.build(lines, min_count=2).tokens == ("<eos>", "<unk>", "c", "a")
    assert LMVocabulary.build(lines, max_size=3).tokens == ("<eos>", "<unk>", "c")
    with pytest.raises(ValueError, match="must start with"):
        LMVocabulary(("a", "<eos>", "<unk>"))


def test_corpus_file_names(tmp_path: Path) -> None:
    write_corpus(tmp_path / "wt", "a\n", "a\n", "a\n")
    assert corpus_files(tmp_path / "wt")["valid"].name == "valid.txt"
    (tmp_path / "wt" / "ptb.test.txt").write_text("a\n")
    with pytest.raises(FileNotFoundError, match="exactly one test file"):
        corpus_files(tmp_path / "wt")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        corpus_files(tmp_path / "missing")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"a b\r\nc\n", "bad.txt:1: carriage return"),
        (b"a b\nc <eos> d\n", "bad.txt:2: the token <eos> is reserved"),
        (b"a\nb\x00c\n", "bad.txt:2: control character"),
        (b"a\n\xff\n", "bad.txt:2: not valid UTF-8"),
        (b"", "bad.txt: empty corpus file"),
    ],
)
def test_malformed_lines(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message):
        read_lm_lines(path)


def test_batchify_and_windows_tile_the_stream() -> None:
    stream = torch.arange(23)
    data = batchify(stream, 4)  # [4, 5], the last 3 tokens dropped
    assert data.shape == (4, 5)
    assert data.flatten().tolist() == list(range(20))  # row b continues row b - 1
    windows = list(bptt_windows(data, 3))
    assert [w.inputs.shape for w in windows] == [(4, 3), (4, 1)]
    assert [w.start for w in windows] == [0, 3]
    for w in windows:  # targets are the inputs shifted by one
        assert torch.equal(w.targets, data[:, w.start + 1 : w.start + 1 + w.inputs.shape[1]])
    # continuity: concatenating the windows gives each row back, every target once
    inputs = torch.cat([w.inputs for w in windows], dim=1)
    targets = torch.cat([w.targets for w in windows], dim=1)
    assert torch.equal(inputs, data[:, :-1]) and torch.equal(targets, data[:, 1:])
    assert sum(w.tokens for w in windows) == 4 * (5 - 1)
    # resuming part-way gives the same later windows
    assert [w.start for w in bptt_windows(data, 3, start=3)] == [3]
    assert batchify(stream, 1).shape == (1, 23)
    with pytest.raises(ValueError, match="too short"):
        batchify(torch.arange(3), 2)
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        next(bptt_windows(stream, 3))


def test_uniform_model_perplexity_is_vocab_size() -> None:
    vocab_size = 7
    data = batchify(torch.randint(0, vocab_size, (101,)), 3)

    def uniform(inputs: torch.Tensor, state: int | None) -> tuple[torch.Tensor, int]:
        calls = (state or 0) + 1
        return torch.zeros(*inputs.shape, vocab_size, dtype=torch.float64), calls

    result = evaluate_stream(uniform, data, bptt=5, keep_token_nll=True)
    assert result.tokens == 3 * (33 - 1)
    assert result.perplexity == pytest.approx(vocab_size, rel=1e-12)
    assert result.mean_nll == pytest.approx(math.log(vocab_size))
    assert result.token_nll is not None and result.token_nll.shape == (3, 32)


def test_perplexity_of_a_hand_stream_is_exp_mean_nll() -> None:
    # a bigram table over 3 words; the NLL summed by hand over a stream of 6 tokens
    table = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6]])
    stream = torch.tensor([0, 1, 1, 2, 2, 0])
    expected = -sum(math.log(table[a, b]) for a, b in zip(stream[:-1], stream[1:], strict=True))

    def bigram(inputs: torch.Tensor, state: None) -> tuple[torch.Tensor, None]:
        return table[inputs].log(), None  # [B, T, V] log-probabilities as logits

    for bptt in (1, 2, 10):  # the window size does not change a stateless model's NLL
        result = evaluate_stream(bigram, batchify(stream, 1), bptt=bptt)
        assert result.tokens == 5
        assert result.total_nll == pytest.approx(expected)
        assert result.perplexity == pytest.approx(math.exp(expected / 5))
        # per-line NLL (the predictions file): lines "0 1 1 2 2 0" has no <eos> id here, so
        # take 2 as <eos>: lines [0 1 1 2] [2] [0]; the first token is not predicted
        result = evaluate_stream(bigram, batchify(stream, 1), bptt=bptt, keep_token_nll=True)
        assert result.token_nll is not None
        lines = line_nll(stream, result.token_nll, eos_id=2)
        assert [n for _, n in lines] == [3, 1, 1]
        assert sum(x for x, _ in lines) == pytest.approx(expected)
    assert perplexity(5 * math.log(3), 5) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="positive"):
        perplexity(1.0, 0)


@pytest.mark.parametrize(
    ("name", "vocab", "tokens"),
    [
        pytest.param(
            "ptb",
            10_000,
            {"train": 929_589, "valid": 73_760, "test": 82_430},
            marks=pytest.mark.data("ptb"),
        ),
        pytest.param(
            "wikitext-2",
            33_278,
            {"train": 2_088_628, "valid": 217_646, "test": 245_569},
            marks=pytest.mark.data("wikitext-2"),
        ),
    ],
)
def test_real_corpora(name: str, vocab: int, tokens: dict[str, int]) -> None:
    directory = DATA / name
    if not directory.is_dir():
        pytest.skip(f"{directory} not present")
    corpus = load_lm_corpus(directory)
    stats = corpus_stats(corpus)
    assert stats["vocab_size"] == vocab  # the published sizes (with <eos>)
    assert {s: v["tokens"] for s, v in stats["splits"].items()} == tokens
    assert all(v["oov"] == 0 for v in stats["splits"].values())  # closed vocabularies
