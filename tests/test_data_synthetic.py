"""Chunk counting and sorting generators and files (mean-field attention, sec. 3.1-3.2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from structattn.data.synthetic import (
    CountingExample,
    SortingExample,
    count_chunks,
    counting_examples,
    read_counting,
    read_sorting,
    sorting_examples,
    write_examples,
)


@pytest.mark.parametrize(
    ("bits", "count"),
    [
        ("00100101111", 3),  # the paper's example
        ("0", 0),
        ("1", 1),
        ("0000000", 0),
        ("1111111", 1),
        ("10101", 3),
        ("0110110", 2),
        ("", 0),
    ],
)
def test_count_chunks_on_hand_made_strings(bits: str, count: int) -> None:
    assert count_chunks(bits) == count


def test_count_chunks_rejects_other_characters() -> None:
    with pytest.raises(ValueError, match="only 0 and 1"):
        count_chunks("0120")


def test_counting_generator_lengths_targets_and_seeds() -> None:
    train = counting_examples(500, range(10, 31), seed=0, split="train")
    assert len(train) == 500 and {len(e.bits) for e in train} <= set(range(10, 31))
    assert len({len(e.bits) for e in train}) > 15  # the lengths are spread
    assert all(e.count == count_chunks(e.bits) for e in train)
    assert train == counting_examples(500, range(10, 31), seed=0, split="train")
    assert train != counting_examples(500, range(10, 31), seed=1, split="train")
    assert train[:5] != counting_examples(5, range(10, 31), seed=0, split="test")[:5]
    test = counting_examples(0, range(1, 101), seed=0, split="test", per_length=3)
    assert [len(e.bits) for e in test] == [n for n in range(1, 101) for _ in range(3)]


def test_sorting_generator_sorts_and_respects_the_range() -> None:
    train = sorting_examples(300, range(5, 16), seed=0, split="train", max_value=20)
    assert all(5 <= len(e.values) <= 15 for e in train)
    assert all(list(e.target) == sorted(e.values) for e in train)
    assert all(0 <= v <= 20 for e in train for v in e.values)
    assert {v for e in train for v in e.values} == set(range(21))
    test = sorting_examples(0, [1, 25], seed=0, split="test", per_length=2)
    assert [len(e.values) for e in test] == [1, 1, 25, 25]
    with pytest.raises(ValueError, match="max_value"):
        sorting_examples(3, [4], seed=0, split="train", max_value=-1)
    with pytest.raises(ValueError, match="lengths"):
        sorting_examples(3, [0, 4], seed=0, split="train")


def test_files_round_trip(tmp_path: Path) -> None:
    counting = counting_examples(20, range(1, 8), seed=3, split="valid")
    sorting = sorting_examples(20, range(1, 8), seed=3, split="valid")
    assert read_counting(write_examples(tmp_path / "c.txt", counting)) == counting
    assert read_sorting(write_examples(tmp_path / "s.txt", sorting)) == sorting
    assert (tmp_path / "c.txt").read_text().splitlines()[0].count("\t") == 1


@pytest.mark.parametrize(
    ("reader", "text", "message"),
    [
        (read_counting, "0101\t2\n0110\n", r"c\.txt:2: expected two tab-separated"),
        (read_counting, "0101\t2\n0121\t2\n", r"c\.txt:2: the input must be"),
        (read_counting, "0101\t2\n0111\t2\n", r"c\.txt:2: count '2' is not"),
        (read_sorting, "3 1\t1 3\n3 x\t3 x\n", r"c\.txt:2: fields must be integers"),
        (read_sorting, "3 1\t1 3\n3 1\t3 1\n", r"c\.txt:2: the target is not the sorted"),
    ],
)
def test_malformed_lines_name_file_and_line(reader, text: str, message: str, tmp_path) -> None:
    path = tmp_path / "c.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        reader(path)


def test_examples_are_plain_records() -> None:
    assert CountingExample("011", 1) == CountingExample("011", 1)
    assert SortingExample((2, 1), (1, 2)).target == (1, 2)
