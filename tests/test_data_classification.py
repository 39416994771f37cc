"""Sentence / pair classification: readers (SICK, SNLI, SST), vocabularies, batches,
accuracy and the confusion matrix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from shared_data import DATA

from structattn.data.classification import (
    NLI_LABELS,
    SST_BINARY_LABELS,
    SST_FINE_LABELS,
    ClassificationExample,
    LabelVocabulary,
    WordVocabulary,
    make_batches,
    parse_sst_tree,
    read_sick,
    read_snli,
    read_snli_jsonl,
    read_sst,
    split_holdout,
    tokenize,
)
from structattn.metrics import ConfusionMatrix, accuracy, paired_bootstrap

SICK_HEADER = (
    "pair_ID\tsentence_A\tsentence_B\tentailment_label\trelatedness_score\tentailment_AB\t"
    "entailment_BA\tsentence_A_original\tsentence_B_original\tsentence_A_dataset\t"
    "sentence_B_dataset\tSemEval_set"
)


def sick_row(pair_id: int, a: str, b: str, label: str, split: str, score: str = "3.5") -> str:
    return "\t".join([str(pair_id), a, b, label, score, "_", "_", a, b, "F", "F", split])


def test_read_sick(tmp_path: Path) -> None:
    rows = [
        SICK_HEADER,
        sick_row(1, "A man isn't playing", "A man plays", "CONTRADICTION", "TRAIN"),
        sick_row(2, "Two dogs, running", "Dogs run", "ENTAILMENT", "TRIAL"),
        sick_row(3, "A cat", "A dog", "NEUTRAL", "TEST", "1.2"),
    ]
    path = tmp_path / "SICK.txt"
    path.write_bytes("\r\n".join(rows).encode())  # CRLF, no final line end (as the release)
    splits = read_sick(path)
    assert {k: len(v) for k, v in splits.items()} == {"train": 1, "valid": 1, "test": 1}
    first = splits["train"][0]
    assert first.tokens == ("A", "man", "is", "n't", "playing")
    assert first.pair == ("A", "man", "plays") and first.label == "contradiction"
    assert first.source == f"{path}:2" and first.index == 0
    assert splits["valid"][0].tokens == ("Two", "dogs", ",", "running")
    assert splits["test"][0].score == 1.2
    assert tokenize("can't, 2.5") == ["ca", "n't", ",", "2.5"]
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join([*rows[:2], sick_row(2, "a", "b", "MAYBE", "TRAIN")]))
    with pytest.raises(ValueError, match=r"bad.txt:3: unknown entailment label 'maybe'"):
        read_sick(bad)
    bad.write_text("\n".join([*rows[:2], "1\ta\tb"]))
    with pytest.raises(ValueError, match=r"bad.txt:3: 3 fields, expected 12"):
        read_sick(bad)
    bad.write_text("pair_ID\tsentence_A\n")
    with pytest.raises(ValueError, match=r"bad.txt:1: header lacks"):
        read_sick(bad)


def test_read_snli_parallel_and_jsonl(tmp_path: Path) -> None:
    for name, text in (
        ("s1.dev", "A man sleeps . \nTwo dogs . \n"),
        ("s2.dev", "A person rests . \nCats . \n"),
        ("labels.dev", "entailment\ncontradiction\n"),
    ):
        (tmp_path / name).write_text(text)
    pairs = read_snli(tmp_path, "dev")
    assert [(p.tokens, p.pair, p.label) for p in pairs] == [
        (("A", "man", "sleeps", "."), ("A", "person", "rests", "."), "entailment"),
        (("Two", "dogs", "."), ("Cats", "."), "contradiction"),
    ]
    (tmp_path / "labels.dev").write_text("entailment\n-\n")
    with pytest.raises(ValueError, match=r"labels.dev:2: label '-'"):
        read_snli(tmp_path, "dev")
    (tmp_path / "labels.dev").write_text("entailment\n")
    with pytest.raises(ValueError, match="2 premises, 2 hypotheses and 1 labels"):
        read_snli(tmp_path, "dev")

    rows = [
        {
            "sentence1": "A man sleeps.",
            "sentence2": "A person rests.",
            "sentence1_binary_parse": "( ( A man ) ( sleeps . ) )",
            "gold_label": "entailment",
        },
        {"sentence1": "Dogs run.", "sentence2": "Cats sit.", "gold_label": "-"},
        {"sentence1": "Dogs aren't cats.", "sentence2": "Dogs.", "gold_label": "neutral"},
    ]
    path = tmp_path / "snli_1.0_dev.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples, skipped = read_snli_jsonl(path)
    assert skipped == 1 and [e.index for e in examples] == [0, 2]
    assert examples[0].tokens == ("A", "man", "sleeps", ".")  # from the binary parse
    assert examples[1].tokens == ("Dogs", "are", "n't", "cats", ".")  # tokenize()
    path.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"snli_1.0_dev.jsonl:2: not JSON"):
        read_snli_jsonl(path)


def test_sst_trees(tmp_path: Path) -> None:
    tree = parse_sst_tree("(3 (2 It) (4 (2 's) (4 (3 great) (2 .))))")
    assert tree.leaves() == ["It", "'s", "great", "."] and tree.label == 3
    assert [n.label for n in tree.nodes()] == [3, 2, 4, 2, 4, 3, 2]
    # the leaf with inner whitespace of the real data (a no-break space, then a space)
    assert parse_sst_tree("(2 (2 8\xa0 1\\/2) (2 x))").leaves() == ["8_1\\/2", "x"]
    path = tmp_path / "train.txt"
    path.write_text("(3 (2 It) (4 good))\n(2 (2 So) (2 so))\n(0 (1 Bad) (2 .))\n")
    fine = read_sst(path)
    assert [(e.tokens, e.label) for e in fine] == [
        (("It", "good"), "positive"),
        (("So", "so"), "neutral"),
        (("Bad", "."), "very negative"),
    ]
    binary = read_sst(path, "binary")
    assert [(e.label, e.index) for e in binary] == [("positive", 0), ("negative", 2)]
    phrases = read_sst(path, "binary", phrases=True)
    assert [(e.tokens, e.label) for e in phrases] == [
        (("It", "good"), "positive"),
        (("good",), "positive"),
        (("Bad", "."), "negative"),
        (("Bad",), "negative"),
    ]
    assert LabelVocabulary(SST_FINE_LABELS).encode("very positive") == 4
    assert LabelVocabulary(SST_BINARY_LABELS).encode("positive") == 1
    for text, message in (
        ("(3 (2 It) (4 good)", "expected '\\)' at the end"),
        ("(3 (2 It) x (4 good))", "a word and a subtree"),
        ("(3 (2 It)))", "text after the tree"),
        ("(3 (2 It)) x", "text after the tree"),
        ("(7 (2 It))", "label 0-4"),
        ("(3 )", "no word or children"),
        ("", "empty line"),
    ):
        path.write_text("(2 ok)\n" + text + "\n")
        with pytest.raises(ValueError, match=f"train.txt:2: .*{message}"):
            read_sst(path)


def test_vocabularies_and_batches() -> None:
    examples = [
        ClassificationExample(("a", "b", "c"), "neutral", pair=("a",), index=0),
        ClassificationExample(("a",), "entailment", pair=("b", "d"), index=1),
        ClassificationExample(("b", "b", "b", "b"), "contradiction", pair=("a",), index=2),
    ]
    words = WordVocabulary.build(examples)
    assert words.tokens[:2] == ("<pad>", "<unk>") and words.tokens[2] == "b"  # most frequent
    labels = LabelVocabulary(NLI_LABELS)
    assert LabelVocabulary.from_dict(labels.to_dict()) == labels
    with pytest.raises(ValueError, match="unknown label"):
        labels.encode("maybe")
    (batch,) = make_batches(examples, words, labels, batch_size=3, order="original")
    assert batch.tokens.shape == (3, 4) and batch.lengths.tolist() == [3, 1, 4]
    assert batch.tokens[1].tolist() == [words.encode(["a"])[0], 0, 0, 0]  # right padding
    assert batch.pair is not None and batch.pair.shape == (3, 2)
    assert batch.labels.tolist() == [1, 0, 2] and batch.indices.tolist() == [0, 1, 2]
    assert batch.mask.sum().item() == 8 and batch.pair_mask is not None
    # sorted: longest first; indices map rows back to the examples
    batches = list(make_batches(examples, words, labels, batch_size=2, order="sorted"))
    assert [b.indices.tolist() for b in batches] == [[2, 0], [1]]
    # bucket: every example exactly once, deterministic per seed
    many = [ClassificationExample(("w",) * (1 + i % 7), "neutral", index=i) for i in range(50)]
    runs = [
        [b.indices.tolist() for b in make_batches(many, words, labels, 4, seed=s)]
        for s in (0, 0, 1)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert sorted(i for b in runs[0] for i in b) == list(range(50))
    spans = [
        max(len(many[i].tokens) for i in b) - min(len(many[i].tokens) for i in b) for b in runs[0]
    ]
    assert max(spans) <= 1  # buckets hold similar lengths
    with pytest.raises(ValueError, match="has no words"):
        next(make_batches([ClassificationExample((), "neutral", source="f:3")], words, labels, 1))
    kept, held = split_holdout(many, 0.1, seed=0)
    assert (
        len(held) == 5 and len(kept) == 45 and not {e.index for e in kept} & {e.index for e in held}
    )


def test_word_vocabulary_without_examples() -> None:
    """#38.10c: a vocabulary from plain token lists or strings, no ClassificationExample."""
    words = WordVocabulary.from_sentences([["the", "cat"], "the dog  sat", ("a", "The")])
    assert words.tokens == ("<pad>", "<unk>", "the", "cat", "dog", "sat", "a", "The")
    assert words.encode(["the", "bird"]) == [2, words.unk_id]
    lines = iter(["b a", "b <pad> <unk>", ""])  # any iterable; specials and blanks not words
    assert WordVocabulary.from_sentences(lines).tokens == ("<pad>", "<unk>", "b", "a")
    rare = WordVocabulary.from_sentences(["a b", "A c"], min_count=2, lower=True)
    assert rare.tokens == ("<pad>", "<unk>", "a")
    assert WordVocabulary.from_sentences(["a b c"], max_size=3).tokens == ("<pad>", "<unk>", "a")
    assert WordVocabulary.from_sentences([]).tokens == ("<pad>", "<unk>")
    # the same as build over examples, and a round trip through to_dict
    examples = [ClassificationExample(("x", "y"), "neutral", pair=("y",))]
    assert WordVocabulary.build(examples) == WordVocabulary.from_sentences([["x", "y"], ["y"]])
    assert WordVocabulary.from_dict(words.to_dict()) == words
    for bad, match in (
        ({"sentences": "a b"}, "one string"),
        ({"sentences": [[1, 2]]}, "sentence 0"),
        ({"sentences": ["a"], "min_count": 0}, "min_count"),
        ({"sentences": ["a"], "max_size": 1}, "max_size"),
    ):
        with pytest.raises(ValueError, match=match):
            WordVocabulary.from_sentences(**bad)  # type: ignore[arg-type]


def test_accuracy_and_confusion_matrix_by_hand() -> None:
    gold = ["entailment", "entailment", "neutral", "contradiction", "neutral", "neutral"]
    pred = ["entailment", "neutral", "neutral", "neutral", "neutral", "contradiction"]
    assert accuracy(pred, gold) == pytest.approx(3 / 6)
    cm = ConfusionMatrix.build(gold, pred, labels=NLI_LABELS)
    assert cm.matrix == ((1, 1, 0), (0, 2, 1), (0, 1, 0))  # rows gold, columns predicted
    assert cm.accuracy == pytest.approx(0.5) and cm.total == 6
    assert cm.precision("entailment") == 1.0 and cm.recall("entailment") == 0.5
    assert cm.f1("entailment") == pytest.approx(2 / 3)
    assert cm.precision("neutral") == pytest.approx(2 / 4) and cm.recall(
        "neutral"
    ) == pytest.approx(2 / 3)
    assert cm.f1("neutral") == pytest.approx(2 * 0.5 * (2 / 3) / (0.5 + 2 / 3))
    assert cm.precision("contradiction") == 0.0 and cm.f1("contradiction") == 0.0
    assert cm.macro_f1 == pytest.approx((2 / 3 + 4 / 7 + 0) / 3)
    d = cm.to_dict()
    assert d["per_class"]["neutral"]["support"] == 3 and d["matrix"][1] == [0, 2, 1]
    assert "accuracy 50.0 %" in cm.format()
    with pytest.raises(ValueError, match="not one of"):
        ConfusionMatrix.build(["x"], ["entailment"], labels=NLI_LABELS)
    with pytest.raises(ValueError, match="2 predictions for 1"):
        accuracy([1, 2], [1])
    assert torch.tensor(cm.matrix).sum().item() == 6


def test_paired_bootstrap() -> None:
    gold_a = [1, 1, 1, 0] * 100  # 75 % correct
    same = paired_bootstrap(gold_a, gold_a, samples=500)
    assert same.difference == 0.0 and same.p_value == 1.0 and same.low == same.high == 0.0
    better = paired_bootstrap(gold_a, [1, 1, 0, 0] * 100, samples=2000, seed=1)
    assert better.difference == pytest.approx(0.25) and better.p_value == 0.0
    assert better.low < 0.25 < better.high
    # one differing item in 400: not significant
    close = paired_bootstrap(gold_a, [0, *gold_a[1:]], samples=2000)
    assert close.p_value > 0.3
    assert paired_bootstrap(gold_a, gold_a, samples=10, seed=3) == paired_bootstrap(
        gold_a, gold_a, samples=10, seed=3
    )
    with pytest.raises(ValueError, match="equal length"):
        paired_bootstrap([1, 0], [1])


def _real(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not present")
    return path


@pytest.mark.data("sick")
def test_real_sick() -> None:
    splits = read_sick(_real(DATA / "sick" / "SICK.txt"))
    assert {k: len(v) for k, v in splits.items()} == {"train": 4439, "valid": 495, "test": 4906}
    labels = [e.label for v in splits.values() for e in v]
    assert [labels.count(x) for x in NLI_LABELS] == [2821, 5595, 1424]


@pytest.mark.data("snli_devtest")
def test_real_snli() -> None:
    snli = _real(DATA / "snli_devtest")
    assert len(read_snli(snli, "dev")) == 9842 and len(read_snli(snli, "test")) == 9824


@pytest.mark.data("sst")
def test_real_sst() -> None:
    sst = _real(DATA / "sst" / "trees")
    # dev and test (train, 8,544 trees, takes ~1 s more: its lines are counted instead)
    fine = [read_sst(sst / f"{s}.txt") for s in ("dev", "test")]
    assert [len(f) for f in fine] == [1101, 2210]
    # binary = the non-neutral sentences (read_sst(..., "binary") is tested on hand files)
    assert [sum(e.label != "neutral" for e in f) for f in fine] == [872, 1821]
    assert (sst / "train.txt").read_text(encoding="utf-8").count("\n") == 8544
