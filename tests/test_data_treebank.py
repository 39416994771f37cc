"""Treebank reading (.mrg), WSJ10 preprocessing, bracket F1 and the baseline trees."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("nltk")

from structattn.data.treebank import (  # noqa: E402
    binarised_spans,
    branching_spans,
    lm_tokens,
    load_treebank,
    normalise_word,
    parse_mrg,
    random_spans,
    read_mrg,
    tree_spans_with_root,
)
from structattn.metrics import bracket_f1  # noqa: E402

MRG = """
( (S
    (NP-SBJ (DT The) (NN cat) )
    (, ,)
    (VP (VBD sat)
      (NP (-NONE- *T*-1) )
      (PP (IN on) (NP (DT the) (NN mat) )))
    (. .) ))
( (S (NP-SBJ (PRP It) ) (VP (VBD cost) (NP ($ $) (CD 61) (-NONE- *U*) ))
  (`` ``) ))
"""


def test_parse_mrg_strips_punctuation_empty_elements_and_empty_constituents() -> None:
    first, second = parse_mrg(MRG, "toy.mrg")
    assert first.words == ("the", "cat", "sat", "on", "the", "mat")
    assert first.line == 2 and first.tree_index == 0 and first.file == "toy.mrg"
    # S, NP-SBJ, VP, PP, NP; the NP holding only -NONE- is gone
    assert first.spans == {(0, 6), (0, 2), (2, 6), (3, 6), (4, 6)}
    assert first.tree == "((the cat) (sat (on (the mat))))"
    # $ removed, digits -> N, the NP left with one word gives no span, unary VP/NP collapse
    assert second.words == ("it", "cost", "N")
    assert second.spans == {(0, 3), (1, 3)}
    assert second.tree == "(it (cost N))"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("( (S (NN a) ))\n(NN b) ))", r"toy.mrg:2: unbalanced"),
        ("\n( (S (NN a) )", r"toy.mrg:2: tree not closed"),
        ("( (S (NN a) ))\nfoo", r"toy.mrg:2: text outside"),
        ("( (S a b) )", r"toy.mrg:1: a word 'a' without"),
    ],
)
def test_malformed_files_report_file_and_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_mrg(text, "toy.mrg")


@pytest.mark.data("nltk_treebank_sample")
def test_the_shared_sample_counts() -> None:
    trees = load_treebank()
    assert len(trees) == 3914
    assert trees[0].words[:6] == ("pierre", "vinken", "N", "years", "old", "will")
    assert len(read_mrg(_combined() / trees[0].file)) == 2
    wsj10 = [s for s in trees if 1 <= len(s.words) <= 10]
    assert len(wsj10) == 555


@pytest.mark.data("nltk_treebank_sample")
def test_wsj10_conventions_on_the_sample() -> None:
    prpn = load_treebank(max_words=10, convention="prpn")
    standard = load_treebank(max_words=10, convention="standard")
    assert (len(prpn), len(standard)) == (555, 531)
    kept = {(s.file, s.tree_index) for s in standard}
    dropped = [s for s in prpn if (s.file, s.tree_index) not in kept]
    assert sum(len(s.words) == 1 for s in dropped) == 13
    repeats = [s for s in dropped if len(s.words) > 1]
    assert len(repeats) == 11 and all(
        any(t.original == s.original for t in standard) for s in repeats
    )


def test_load_treebank_conventions(tmp_path) -> None:  # type: ignore[no-untyped-def]
    one_word = "( (S (NP (NNP Detroit)) (. .) ))\n"
    (tmp_path / "a.mrg").write_text(MRG + one_word + MRG)
    assert [len(s.words) for s in load_treebank(tmp_path)] == [6, 3, 1, 6, 3]
    standard = load_treebank(tmp_path, convention="standard")
    assert [(len(s.words), s.tree_index) for s in standard] == [(6, 0), (3, 1)]
    assert standard[0].original[:2] == ("The", "cat")
    with pytest.raises(ValueError, match="`convention`"):
        load_treebank(tmp_path, convention="klein")  # type: ignore[arg-type]


def test_load_treebank_filters_by_length(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "a.mrg").write_text(MRG)
    (tmp_path / "b.mrg").write_text("( (S (NP (-NONE- *)) (. .) ))\n" + MRG)
    assert [len(s.words) for s in load_treebank(tmp_path)] == [6, 3, 6, 3]  # empty one dropped
    assert [s.file for s in load_treebank(tmp_path, max_words=3)] == ["a.mrg", "b.mrg"]
    with pytest.raises(FileNotFoundError, match="no .mrg"):
        load_treebank(tmp_path / "missing")


def _combined():  # type: ignore[no-untyped-def]
    from structattn.data.treebank import default_treebank_dir

    return default_treebank_dir()


def test_words_for_a_vocabulary() -> None:
    assert normalise_word("1.5") == "N.N" and normalise_word("Nov.") == "nov."
    assert lm_tokens(["the", "zyx"], {"the": 3}) == ["the", "<unk>"]


def test_baseline_trees_on_hand_made_sentences() -> None:
    assert branching_spans(4, "right") == {(0, 4), (1, 4), (2, 4)}
    assert branching_spans(4, "left") == {(0, 2), (0, 3), (0, 4)}
    assert branching_spans(5, "balanced") == {(0, 5), (0, 3), (0, 2), (3, 5)}
    assert branching_spans(1, "left") == frozenset()
    # SPLIT on decreasing distances is right-branching, on increasing ones left-branching
    assert tree_spans_with_root([4, 3, 2, 1]) == branching_spans(4, "right")
    assert tree_spans_with_root([1, 2, 3, 4]) == branching_spans(4, "left")
    spans = random_spans(7, random.Random(0))
    assert len(spans) == 6 and (0, 7) in spans
    with pytest.raises(ValueError, match="kind"):
        branching_spans(3, "middle")  # type: ignore[arg-type]


def test_bracket_f1_hand_computed_both_conventions() -> None:
    gold = [{(0, 5), (0, 2), (2, 5)}, {(0, 2)}]
    pred = [{(0, 5), (1, 5), (2, 5), (3, 5)}, {(0, 2)}]
    lengths = [5, 2]
    without = bracket_f1(pred, gold, lengths)
    # sentence 1: pred {(1,5),(2,5),(3,5)} vs gold {(0,2),(2,5)}: P 1/3, R 1/2, F1 0.4;
    # sentence 2: both empty without the root -> 1
    assert without.sentence_f1 == pytest.approx((0.4 + 1.0) / 2)
    assert without.corpus_precision == pytest.approx(1 / 3)
    assert without.corpus_recall == pytest.approx(1 / 2)
    assert without.corpus_f1 == pytest.approx(0.4)
    rooted = bracket_f1(pred, gold, lengths, include_root=True)
    # sentence 1: P 2/4, R 2/3 -> F1 4/7; sentence 2: 1; corpus 3/5 and 3/4
    assert rooted.sentence_f1 == pytest.approx((4 / 7 + 1.0) / 2)
    assert rooted.corpus_f1 == pytest.approx(2 * 0.6 * 0.75 / 1.35)
    with pytest.raises(ValueError, match="predictions"):
        bracket_f1(pred, gold[:1], lengths)


def test_binary_upper_bound() -> None:
    gold = {(0, 6), (0, 2), (2, 6)}  # (a b) and a flat 4-word constituent (c d e f)
    best = binarised_spans(gold, 6)
    assert gold <= best and len(best) == 5
    assert bracket_f1([best], [gold], [6], include_root=True).corpus_recall == 1.0
