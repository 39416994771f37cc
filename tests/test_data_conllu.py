"""CoNLL-U reader (multiword tokens, empty nodes, comments, errors), writer, UAS / LAS,
projectivity, and UD English-EWT."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from shared_data import real_data

import structattn
from structattn.data.conllu import (
    attachment_scores,
    check_tree,
    conllu_stats,
    format_conllu,
    heads_tensor,
    is_projective,
    non_projective_arcs,
    parse_conllu,
    read_conllu,
    write_conllu,
)

EWT = real_data("ud_english_ewt")


def row(*cols: object) -> str:
    return "\t".join(str(c) for c in cols)


def word(i: object, form: str, upos: str, head: object, rel: str) -> str:
    return row(i, form, form.lower(), upos, "_", "_", head, rel, "_", "_")


SENTENCE_1 = [
    "# newdoc id = d1",
    "# sent_id = s1",
    "# text = I don't know.",
    word(1, "I", "PRON", 3, "nsubj"),
    row("2-3", "don't", "_", "_", "_", "_", "_", "_", "_", "_"),
    word(2, "do", "AUX", 4, "aux"),
    word(3, "n't", "PART", 4, "advmod"),
    word(4, "know", "VERB", 0, "root"),
    word(5, ".", "PUNCT", 4, "punct"),
]
SENTENCE_2 = [
    "# sent_id = s2",
    word(1, "Sue", "PROPN", 2, "nsubj"),
    word(2, "likes", "VERB", 0, "root"),
    word(3, "tea", "NOUN", 2, "obj"),
    word(4, "and", "CCONJ", 6, "cc"),
    word(5, "Bob", "PROPN", 2, "conj"),
    row("5.1", "likes", "like", "VERB", "_", "_", "_", "_", "2:conj", "_"),
    word(6, "coffee", "NOUN", 3, "conj:and"),
    word(7, "$", "SYM", 6, "nmod"),
]
TEXT = "\n".join(SENTENCE_1) + "\n\n" + "\n".join(SENTENCE_2) + "\n\n"


def test_reader_skips_multiword_tokens_and_empty_nodes(tmp_path: Path) -> None:
    path = tmp_path / "two.conllu"
    path.write_text(TEXT, encoding="utf-8")
    first, second = read_conllu(path)
    assert first.words == ("I", "do", "n't", "know", ".")
    assert first.heads == (3, 4, 4, 0, 4)  # 1 -> 3 is deliberately odd (scored below)
    assert first.upos[-1] == "PUNCT" and first.deprels[-1] == "punct"  # type: ignore[index]
    assert first.sent_id == "s1" and first.text == "I don't know."
    assert first.comments == tuple(SENTENCE_1[:3]) and first.line == 1
    assert first.line_of(2) == 6  # line 5 is the multiword token 2-3
    assert second.words == ("Sue", "likes", "tea", "and", "Bob", "coffee", "$")
    assert second.heads == (2, 0, 2, 6, 2, 3, 6)  # 5.1 left out
    assert second.line == 11 and second.line_of(6) == 18  # line 17 is the empty node 5.1
    assert format_conllu([first, second]) == TEXT  # byte for byte
    stats = conllu_stats([first, second])
    assert stats["sentences"] == 2 and stats["words"] == 12 and stats["punct"] == 1
    assert stats["multiword_tokens"] == 1 and stats["empty_nodes"] == 1
    # both cross: 3 -> 1 and 4 -> 2 in the first, 6 -> 4 and 2 -> 5 in the second
    assert stats["non_projective"] == 2


def test_writer_replaces_only_heads(tmp_path: Path) -> None:
    sentences = parse_conllu(TEXT)
    new_heads = [[4, 4, 4, 0, 4], [2, 0, 2, 5, 2, 5, 6]]
    out = write_conllu(tmp_path / "pred.conllu", sentences, heads=new_heads)
    written = out.read_text(encoding="utf-8").split("\n")
    original = TEXT.split("\n")
    assert len(written) == len(original)
    for a, b in zip(written, original, strict=True):
        ca, cb = a.split("\t"), b.split("\t")
        assert ca[:6] == cb[:6] and ca[7:] == cb[7:]  # only HEAD may differ
    assert [s.heads for s in parse_conllu("\n".join(written))] == [tuple(h) for h in new_heads]
    with pytest.raises(ValueError, match="4 heads for 5 words"):
        format_conllu(sentences, heads=[[0, 1, 1, 1], new_heads[1]])


def test_unparsed_input_and_last_block_without_blank_line() -> None:
    text = row(1, "Hi", "_", "INTJ", "_", "_", "_", "_", "_", "_") + "\n"
    (s,) = parse_conllu(text)
    assert s.heads is None and s.deprels is None and s.words == ("Hi",)
    with pytest.raises(ValueError, match="no gold heads"):
        attachment_scores([s], [[0]])


@pytest.mark.parametrize(
    ("lines", "where", "message"),
    [
        ([word(1, "a", "X", 0, "root"), "1\ta\tb"], 2, "expected 10 TAB-separated columns"),
        ([word(1, "a", "X", 0, "root"), word(3, "b", "X", 1, "dep")], 2, "word ID 3, expected 2"),
        ([word(1, "a", "X", 0, "root"), word(2, "b", "X", 5, "dep")], 2, "HEAD 5 out of range"),
        ([word(1, "a", "X", 0, "root"), word(2, "b", "X", "x", "dep")], 2, "not a word number"),
        ([word(1, "a", "X", 2, "dep"), word(2, "b", "X", 1, "dep")], 1, "cycle in the heads"),
        ([word(1, "a", "X", 1, "dep")], 1, "its own head"),
        ([word(1, "a", "X", 0, "root"), word(2, "b", "X", 0, "root")], 2, "2 words attached"),
        (["# only a comment"], 1, "sentence without words"),
        ([word(1, "a", "X", 0, "root"), "# late"], 2, "comment line after"),
        ([row("2-3", *"_" * 9), word(1, "a", "X", 0, "root")], 1, "should start at word 1"),
        ([word(1, "a", "X", 0, "root"), "1a" + word(2, "b", "X", 1, "d")[1:]], 2, "bad ID"),
        ([word(1, "a", "X", 0, "root") + "\r"], 1, "carriage return"),
    ],
)
def test_malformed_input_names_file_and_line(lines: list[str], where: int, message: str) -> None:
    text = "# sent_id = ok\n" + word(1, "ok", "X", 0, "root") + "\n\n" + "\n".join(lines) + "\n\n"
    with pytest.raises(ValueError, match=f"^bad.conllu:{where + 3}: .*{message}"):
        parse_conllu(text, source="bad.conllu")


def test_attachment_scores_by_hand() -> None:
    sentences = parse_conllu(TEXT)
    # sentence 1 (5 words, "." is PUNCT): heads right at 2, 3, 4, 5 (4 of 5; 4 of 4 non-punct
    # minus word 1 -> 3 of 4); labels right at 2 and 5 only
    # sentence 2 (7 words, no PUNCT; "$" is SYM and is scored): heads right at 1, 2, 3, 7
    pred_heads = [[4, 4, 4, 0, 4], [2, 0, 2, 5, 3, 5, 6]]
    pred_rels = [
        ["nsubj", "aux", "obj", "dep", "punct"],
        ["nsubj", "root", "obj", "cc", "conj", "conj", "amod"],
    ]
    scores = attachment_scores(sentences, pred_heads, pred_rels)
    # heads right: s1 words 2..5 (4), s2 words 1, 2, 3, 7 (4) -> 8 / 12
    assert scores.words == 12 and scores.words_no_punct == 11
    assert scores.uas == pytest.approx(8 / 12)
    assert scores.uas_no_punct == pytest.approx(7 / 11)
    # head and label right: s1 words 2 (aux), 5 (punct); s2 words 1, 2, 3 (nmod != amod) -> 5
    assert scores.las == pytest.approx(5 / 12)
    assert scores.las_no_punct == pytest.approx(4 / 11)
    # with subtypes compared, "conj" vs gold "conj:and" of word 6 would differ; word 6 has a
    # wrong head anyway, so build a case where only the subtype differs
    one = parse_conllu(word(1, "a", "X", 0, "root") + "\n" + word(2, "b", "X", 1, "obl:tmod"))
    assert attachment_scores(one, [[0, 1]], [["root", "obl"]]).las == 1.0
    assert attachment_scores(one, [[0, 1]], [["root", "obl"]], deprel_subtypes=True).las == 0.5
    assert attachment_scores(one, [[0, 1]]).to_dict()["uas"] == 1.0
    with pytest.raises(ValueError, match="has 2 words, got 3 heads"):
        attachment_scores(one, [[0, 1, 1]])


def _dominates(heads: list[int], h: int, d: int) -> bool:
    while d != 0:
        d = heads[d - 1]
        if d == h:
            return True
    return h == 0


def _projective_by_dominance(heads: list[int]) -> bool:
    """Every word strictly between a head and its dependent is dominated by the head."""
    for d, h in enumerate(heads, start=1):
        for k in range(min(h, d) + 1, max(h, d)):
            if not _dominates(heads, h, k):
                return False
    return True


def _trees(n: int) -> list[list[int]]:
    out = []
    for heads in itertools.product(range(n + 1), repeat=n):
        try:
            check_tree(list(heads))
        except ValueError:
            continue
        out.append(list(heads))
    return out


def test_projectivity_on_known_trees() -> None:
    assert is_projective([0]) and is_projective([2, 0, 2])
    assert not is_projective([3, 4, 0, 3])  # 3 -> 1 crosses 4 -> 2, which crosses 0 -> 3
    assert non_projective_arcs([3, 4, 0, 3]) == [(3, 1), (4, 2), (0, 3)]
    assert not is_projective([0, 4, 1, 1])
    # the root arc counts: 2 is the root and the arc 3 -> 1 spans it
    assert not is_projective([3, 0, 2])
    # brute force: the crossing test equals the dominance definition on every tree, and the
    # numbers of projective single-root trees are the known ones (1, 2, 7, 30, 143)
    counts = []
    for n in range(1, 6):
        trees = _trees(n)
        assert all(is_projective(t) == _projective_by_dominance(t) for t in trees)
        assert all(is_projective(t) == (not non_projective_arcs(t)) for t in trees)
        counts.append(sum(map(is_projective, trees)))
    assert counts == [1, 2, 7, 30, 143]


def test_check_tree() -> None:
    check_tree([0, 1, 1])
    check_tree([0, 0], single_root=False)
    for heads, message in (([], "empty"), ([0, 3], "out of range"), ([2, 1], "cycle")):
        with pytest.raises(ValueError, match=message):
            check_tree(heads)


@pytest.mark.parametrize(
    ("split", "sentences", "words", "non_projective"),
    [("dev", 2001, 25147, 31), ("test", 2077, 25094, 26)],
)
@pytest.mark.data("ud_english_ewt")
def test_ud_english_ewt(split: str, sentences: int, words: int, non_projective: int) -> None:
    path = EWT / f"en_ewt-ud-{split}.conllu"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    parsed = read_conllu(path)
    stats = conllu_stats(parsed)
    assert (stats["sentences"], stats["words"], stats["non_projective"]) == (
        sentences,
        words,
        non_projective,
    )
    assert stats["empty_nodes"] > 0 and stats["multiword_tokens"] > 0
    assert format_conllu(parsed) == path.read_text(encoding="utf-8")  # byte-identical
    heads, lengths = heads_tensor(parsed)  # the core's layout: ROOT at 0, -1 at ROOT/padding
    assert heads.shape == (sentences, 1 + max(map(len, parsed))) and (heads[:, 0] == -1).all()
    assert int((~structattn.is_projective(heads, lengths)).sum()) == non_projective
    gold = attachment_scores(parsed, [s.heads or () for s in parsed])
    assert gold.uas == gold.uas_no_punct == 1.0
    if split != "dev":
        return
    conllu = pytest.importorskip("conllu")  # cross-check against the conllu package
    reference = conllu.parse(path.read_text(encoding="utf-8"))
    assert len(reference) == len(parsed)
    for ours, theirs in zip(parsed, reference, strict=True):
        words_only = [t for t in theirs if isinstance(t["id"], int)]
        assert ours.words == tuple(t["form"] for t in words_only)
        assert ours.heads == tuple(t["head"] for t in words_only)
        assert ours.deprels == tuple(t["deprel"] for t in words_only)
