"""structattn.data.parallel: real counts, filters, errors with file:line."""

from __future__ import annotations

from pathlib import Path

import pytest

from structattn.data.parallel import (
    ParallelPair,
    TranslationVocabulary,
    default_enja_data_dir,
    filter_pairs,
    read_lines,
    read_parallel,
    source_tokens,
    type_counts,
)


def _enja() -> Path:
    try:
        return default_enja_data_dir()
    except FileNotFoundError:
        pytest.skip("small_parallel_enja is not available")


@pytest.mark.data("small_parallel_enja")
def test_real_corpus_counts_filters_and_vocabulary() -> None:
    data = _enja()
    sizes = {}
    for split in ("train", "dev", "test"):
        pairs = read_parallel(data / f"{split}.ja", data / f"{split}.en")
        kept, report = filter_pairs(pairs, 50, 50)
        assert report.kept == report.total == len(kept)  # the paper's filter keeps every pair
        sizes[split] = len(pairs)
    assert sizes == {"train": 50_000, "dev": 500, "test": 500}
    train = read_parallel(data / "train.ja", data / "train.en")
    first = train[0]
    assert first.line == 1 and first.target[:3] == ("i", "can", "'t")
    assert "".join(source_tokens(first, "char")) == "".join(first.source)
    chars = type_counts(source_tokens(p, "char") for p in train)
    words = type_counts(p.source for p in train)
    english = type_counts(p.target for p in train)
    frequent = {k: sum(c >= 10 for c in v.values()) for k, v in
                {"char": chars, "word": words, "en": english}.items()}  # fmt: skip
    assert (len(chars), len(words), len(english)) == (1938, 8774, 6634)
    assert frequent == {"char": 1136, "word": 1729, "en": 1581}
    vocab = TranslationVocabulary.build((p.target for p in train), min_count=10)
    assert len(vocab) == 1581 + 4
    rare = next(t for t, c in english.items() if c < 10)
    assert vocab.encode([rare, "the"]) == [vocab.unk_id, vocab.encode(["the"])[0]]
    assert vocab.encode(["the"])[0] > vocab.eos_id


def test_filters_count_each_side() -> None:
    pairs = [
        ParallelPair(("ab", "c"), ("x",) * 2, 1),  # 3 chars, 2 words
        ParallelPair(("abcd",), ("x",), 2),  # 4 chars: too long at 3
        ParallelPair(("a",), ("x",) * 3, 3),  # 3 words: too long at 2
    ]
    kept, report = filter_pairs(pairs, 3, 2)
    assert [p.line for p in kept] == [1]
    assert (report.total, report.kept, report.long_source, report.long_target) == (3, 1, 1, 1)
    assert filter_pairs(pairs, None, None)[1].kept == 3
    assert source_tokens(pairs[0], "char") == ("a", "b", "c")
    assert source_tokens(pairs[0], "word") == ("ab", "c")
    with pytest.raises(ValueError, match="unit"):
        source_tokens(pairs[0], "byte")  # type: ignore[arg-type]


def test_vocabulary_cutoff_order_and_round_trip() -> None:
    vocab = TranslationVocabulary.build([("b", "a", "a"), ("b", "c")], min_count=2)
    assert vocab.tokens == ("<pad>", "<unk>", "<s>", "</s>", "a", "b")  # ties by code point
    assert (vocab.pad_id, vocab.unk_id, vocab.bos_id, vocab.eos_id) == (0, 1, 2, 3)
    assert vocab.decode(vocab.encode(["c", "a"])) == ["<unk>", "a"]
    assert TranslationVocabulary.from_dict(vocab.to_dict()) == vocab
    with pytest.raises(ValueError, match="min_count"):
        TranslationVocabulary.build([], min_count=0)


def test_malformed_files_name_file_and_line(tmp_path: Path) -> None:
    ja, en = tmp_path / "a.ja", tmp_path / "a.en"
    ja.write_text("私 は\n猫 だ\n", encoding="utf-8")
    en.write_text("i am\na cat\n", encoding="utf-8")
    assert [p.target for p in read_parallel(ja, en)] == [("i", "am"), ("a", "cat")]
    en.write_text("i am\na cat\nextra\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{en}:3: no matching line in {ja}"):
        read_parallel(ja, en)
    en.write_text("i am\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{en}:2: empty line"):
        read_parallel(ja, en)
    ja.write_bytes("私 は\n".encode() + b"\xff\xfe\n")
    with pytest.raises(ValueError, match=rf"{ja}:2: not valid UTF-8"):
        read_lines(ja)
    blank = tmp_path / "blank.txt"
    blank.write_text("a\n   \nb", encoding="utf-8")  # no final newline is fine
    assert read_lines(blank, allow_empty=True) == [("a",), (), ("b",)]
    with pytest.raises(ValueError, match=rf"{blank}:2: empty line"):
        read_lines(blank)
