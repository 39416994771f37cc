"""GloVe-format word vectors: reading (errors with file:line), embedding matrices, coverage
and the hashing of unknown words."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from shared_data import DATA

from structattn.data.classification import WordVocabulary, read_sick
from structattn.data.embeddings import (
    build_embedding_matrix,
    default_glove_path,
    read_word_vectors,
    unknown_vectors,
    word_bucket,
)


def write(tmp_path: Path, text: str, name: str = "vec.txt") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_read_small_file(tmp_path: Path) -> None:
    path = write(tmp_path, "the 1 0 0\ncat 0 3 4\nat name@x.com 1 1 1\ncat 9 9 9\n")
    vectors = read_word_vectors(path)
    assert vectors.words == ("the", "cat", "at name@x.com") and vectors.dim == 3
    assert vectors.duplicates == 1  # the second "cat" is dropped, the first kept
    assert vectors.vectors[1].tolist() == [0.0, 3.0, 4.0]
    assert read_word_vectors(path, words=["CAT"]).words == ("cat",)  # matched lower-cased
    assert read_word_vectors(path, max_words=1).words == ("the",)
    header = write(tmp_path, "2 3\na 1 2 3\nb 4 5 6", "w2v.txt")  # word2vec header, no final \n
    assert read_word_vectors(header).words == ("a", "b")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a 1 2 3\nb 1 2\n", r"vec.txt:2: 2 values, expected 3"),
        ("a 1 2 3\nb 1 2 3 4\n", r"vec.txt:2: 4 values, expected 3"),
        ("a 1 2 3\nb 1 x 3\n", r"vec.txt:2: value 'x' is not a number"),
        ("a 1 2 3\n\nb 1 2 3\n", r"vec.txt:2: empty line"),
        ("a 1 2 3\nb 1 nan 3\n", r"vec.txt:2: a value is not finite"),
        ("", r"vec.txt:1: empty file"),
        ("a\n", r"vec.txt:1: a word without values"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_word_vectors(write(tmp_path, text))


def test_word_bucket_is_deterministic_across_processes() -> None:
    # fixed values: a salted hash (Python's hash() of a str) would change them per process
    words = ["deli", "fighting", "<unk>", "Überraschung", ""]
    assert [word_bucket(w) for w in words] == [31, 60, 31, 68, 56]
    assert len({word_bucket(f"w{i}") for i in range(2000)}) == 100  # every bucket is used
    with pytest.raises(ValueError, match="buckets"):
        word_bucket("a", 0)


def test_embedding_matrix_rows_and_coverage(tmp_path: Path) -> None:
    path = write(tmp_path, "the 3 0 4\ncat 0 0 0\nman 1 1 1\n")
    vocab = WordVocabulary(("<pad>", "<unk>", "The", "cat", "zebra", "yak"))
    counts = Counter({"The": 10, "cat": 5, "zebra": 2, "yak": 1})
    emb = build_embedding_matrix(vocab, read_word_vectors(path), counts=counts, seed=3)
    gaussian = unknown_vectors(100, 3, seed=3)
    assert emb.weight.shape == (6, 3)
    assert emb.weight[0].abs().sum() == 0  # <pad>
    assert torch.allclose(emb.weight[2], torch.tensor([0.6, 0.0, 0.8]))  # lower-case, unit
    assert emb.weight[3].abs().sum() == 0  # a zero vector stays zero
    assert emb.pretrained.tolist() == [False, False, True, True, False, False]
    for i, word in ((1, "<unk>"), (4, "zebra"), (5, "yak")):
        assert emb.bucket[i] == word_bucket(word)
        assert torch.equal(emb.weight[i], gaussian[word_bucket(word)])
    cov = emb.coverage
    assert (cov.types, cov.types_covered, cov.tokens, cov.tokens_covered) == (4, 2, 18, 15)
    assert cov.token_rate == pytest.approx(15 / 18) and "2/4 types" in str(cov)
    raw = build_embedding_matrix(
        ["The"], read_word_vectors(path), normalize=False, lower_fallback=False
    )
    assert not raw.pretrained[0] and raw.bucket[0] == word_bucket("The")
    none = build_embedding_matrix(["zebra"], read_word_vectors(path), unknown_buckets=0)
    assert none.weight.abs().sum() == 0 and none.bucket.tolist() == [-1]


def test_unknown_vectors_are_standard_gaussian() -> None:
    g = unknown_vectors(100, 300, seed=0)
    assert torch.equal(g, unknown_vectors(100, 300, seed=0))
    assert not torch.equal(g, unknown_vectors(100, 300, seed=1))
    assert abs(g.mean().item()) < 0.02 and abs(g.std().item() - 1) < 0.02


@pytest.mark.data("glove", "sick")
def test_shipped_glove_covers_sick() -> None:
    vectors = read_word_vectors(default_glove_path())
    assert len(vectors) == 10_000 and vectors.dim == 50 and vectors.words[0] == "the"
    splits = read_sick(DATA / "sick" / "SICK.txt")
    vocab = WordVocabulary.build(splits["train"])
    counts = Counter(t for ex in splits["train"] for t in (*ex.tokens, *(ex.pair or ())))
    emb = build_embedding_matrix(vocab, vectors, counts=counts)
    norms = emb.weight[emb.pretrained].norm(dim=1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5)
    # the 10k most frequent GloVe words cover 79,216 of SICK train's 86,219 tokens (91.9%)
    # but only 1,321 of its 2,252 types: "slicing", "onion", "flute" ... are hashed
    cov = emb.coverage
    assert (cov.types, cov.types_covered, cov.tokens, cov.tokens_covered) == (
        2252,
        1321,
        86219,
        79216,
    )
