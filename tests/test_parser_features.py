"""The parser recipe's parser-side inputs (issue 16): trained word vectors, a character CNN,
UPOS vectors and dropout. Shapes, padding invariance, save / load, errors for bad values, and
a tiny parser that learns a tiny treebank through ``parser.train``."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from structattn.models.parser import (
    ArcParser,
    WordFeatures,
    encode_words,
    parse_sentences,
    predict_heads,
)
from structattn.recipes import parser
from structattn.recipes.config import replace_path

SENTENCES = [["The", "cat", "sat", "."], ["A", "dog", "barked", "loudly", "today", "!"], ["Hi"]]
TAGS = [["DET", "NOUN", "VERB", "PUNCT"], ["DET", "NOUN", "VERB", "ADV", "NOUN", "PUNCT"], ["INTJ"]]


def _treebank(sentences: int, seed: int) -> list[str]:
    """CoNLL-U blocks of a toy treebank whose heads follow from the words: ``[Adv] D N V
    [D N]``, the verb the root and the head of the nouns and the adverb, each noun the head
    of its determiner. Nouns, verbs and adverbs are made-up words (no GloVe vector; the 100
    hashed vectors collide), so the parser has to learn them."""
    rng = random.Random(seed)
    nouns = [f"zork{i}um" for i in range(12)]
    verbs = [f"blim{i}ed" for i in range(8)]
    blocks = []
    for k in range(sentences):
        words = [rng.choice(["the", "a"]), rng.choice(nouns), rng.choice(verbs)]
        heads, tags = [2, 3, 0], ["DET", "NOUN", "VERB"]
        if rng.random() < 0.5:
            words += [rng.choice(["the", "a"]), rng.choice(nouns)]
            heads += [5, 3]
            tags += ["DET", "NOUN"]
        if rng.random() < 0.5:
            words = [rng.choice(["quux", "frobly"]), *words]
            heads = [4] + [h + 1 if h else 0 for h in heads]
            tags = ["ADV", *tags]
        lines = [f"# sent_id = s{k}"] + [
            f"{i}\t{w}\t{w}\t{t}\t_\t_\t{h}\tdep\t_\t_"
            for i, (w, t, h) in enumerate(zip(words, tags, heads, strict=True), start=1)
        ]
        blocks.append("\n".join(lines) + "\n")
    return blocks


def _write(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", 240, 0), ("dev", 40, 1), ("test", 40, 2)):
        text = "\n".join(_treebank(n, seed)) + "\n"
        (folder / f"en_ewt-ud-{split}.conllu").write_text(text)


def _model(dropout: float = 0.0) -> tuple[ArcParser, WordFeatures]:
    from structattn.data.conllu import parse_conllu

    text = "".join(
        "".join(
            f"{i}\t{w}\t_\t{t}\t_\t_\t_\t_\t_\t_\n"
            for i, (w, t) in enumerate(zip(s, ts, strict=True), 1)
        )
        + "\n"
        for s, ts in zip(SENTENCES, TAGS, strict=True)
    )
    train = parse_conllu(text, source="t")
    config = parser.ParserConfig(hidden_dim=8, parser_dim=4, word_min_count=1, char_dim=5,
                                 upos=True, dropout=dropout)  # fmt: skip
    features = WordFeatures.build(config, train)
    torch.manual_seed(0)
    return parser.build_model(config, torch.randn(20, 6), features), features


def test_feature_shapes_and_padding_invariance() -> None:
    model, features = _model(dropout=0.5)
    model.eval()  # dropout off
    ids = torch.tensor([[3, 4, 5, 6, 0, 0], [7, 8, 9, 10, 11, 12], [13, 0, 0, 0, 0, 0]])
    lengths = torch.tensor([4, 6, 1])
    inputs = features.encode(SENTENCES, TAGS, torch.device("cpu"))
    assert inputs["trained"].shape == (3, 6) and inputs["tags"].shape == (3, 6)
    assert inputs["chars"].shape == (3, 6, 6)  # "barked", "loudly": 6 characters
    assert model.char_vectors(inputs["chars"]).shape == (3, 6, 8)
    batched = model(ids, lengths, **inputs)
    assert batched.shape == (3, 7, 7)
    for b, s in enumerate(SENTENCES):  # alone (narrower padding, fewer characters)
        alone = model(ids[b : b + 1, : len(s)], lengths[b : b + 1],
                      **features.encode([s], [TAGS[b]], torch.device("cpu")))  # fmt: skip
        n = len(s) + 1
        torch.testing.assert_close(alone[0], batched[b, :n, :n])
    # the words' own characters matter; unknown words and characters map to <unk>
    unseen = features.encode([["Zzyzx"]], [["NOUN"]], torch.device("cpu"))
    assert unseen["trained"].tolist() == [[1]] and unseen["chars"][0, 0, 0].item() == 1
    # dropout is active in training mode only
    model.train()
    assert not torch.allclose(model(ids, lengths, **inputs), batched)


def test_missing_inputs_and_bad_values_are_errors() -> None:
    model, features = _model()
    ids, lengths = torch.tensor([[3, 4]]), torch.tensor([2])
    with pytest.raises(ValueError, match="`trained` input"):
        model(ids, lengths)
    with pytest.raises(ValueError, match="UPOS"):
        features.encode([["a", "b"]], None, torch.device("cpu"))
    for bad in ({"word_min_count": -1}, {"char_dim": -2}, {"max_chars": 0},
                {"dropout": 1.0}, {"word_dropout": -0.1}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            parser.ParserConfig(**bad)  # type: ignore[arg-type]
    again = WordFeatures.from_dict(features.to_dict())
    assert again.to_dict() == features.to_dict()
    assert WordFeatures.from_dict(None).to_dict()["trained"] is None  # older runs


def _train_tiny(
    tmp_path: Path, **fields: Any
) -> tuple[parser.ParserConfig, ArcParser, Any, parser.ParserConfig]:
    """Train the quick preset with word vectors and ``fields`` on the toy treebank for 6
    epochs; -> (config, the loaded model, its words, its loaded config)."""
    _write(tmp_path / "data")
    config = replace_path(
        parser.RECIPE.presets["quick"].config,
        {"data_dir": str(tmp_path / "data"), "max_train": 0, "max_eval": 0, "arc_scale": 10.0,
         "word_min_count": 2, "train.epochs": 6, "train.lr": 0.02, **fields},
    )  # fmt: skip
    parser.train(config, tmp_path / "run")
    model, words, loaded = parser.load_trained(tmp_path / "run")
    return config, model, words, loaded


@pytest.mark.data("glove")
def test_a_tiny_parser_with_word_and_character_inputs_learns_a_tiny_treebank(
    tmp_path: Path,
) -> None:
    config, model, words, loaded = _train_tiny(tmp_path, char_dim=8, dropout=0.1)
    assert model.word_embed is not None and model.char_conv is not None
    assert loaded.word_min_count == 2
    dev = parser.load_data(config)["dev"]
    scores, _ = parser.evaluate(model, words, dev, loaded)
    assert scores["uas"] > 80, scores  # chance (a random tree): about 40
    # any words: the saved vocabularies of the parser-side inputs are used again
    heads = parse_sentences(model, loaded, [["the", "zork3um", "blim2ed"], ["new"]])
    assert heads == [[2, 3, 0], [0]]


@pytest.mark.data("glove")
def test_an_auxiliary_tagger_learns_upos_and_the_parser_still_reads_words_alone(
    tmp_path: Path,
) -> None:
    config, model, words, loaded = _train_tiny(tmp_path, upos_aux=1.0, parser_layers=2)
    assert model.tagger is not None and model.features.tags is None  # tags are not an input
    dev = parser.load_data(config)["dev"]
    scores, _ = parser.evaluate(model, words, dev, loaded)
    assert scores["upos_accuracy"] > 95, scores  # 5 tags, one per word class
    assert scores["uas"] > 80, scores
    # evaluate scores the tagger from its one pass; tag_accuracy is the separate pass
    assert scores["upos_accuracy"] == pytest.approx(100 * parser.tag_accuracy(model, words, dev))
    assert _ == predict_heads(model, words, [s.words for s in dev])
    # the tagger's logits of a sentence do not depend on the batch's padding
    batch = dev[:3]
    ids, lengths = encode_words([s.words for s in batch], words, torch.device("cpu"))
    inputs = model.features.encode([s.words for s in batch], None, torch.device("cpu"))
    _, tags = model.scores_and_tags(ids, lengths, **inputs)
    assert tags is not None
    for b, s in enumerate(batch):
        n = len(s)
        one = {k: v[b : b + 1, :n] for k, v in inputs.items()}
        _, alone = model.scores_and_tags(ids[b : b + 1, :n], lengths[b : b + 1], **one)
        assert alone is not None
        torch.testing.assert_close(alone[0], tags[b, :n])
    # the plain-sentence path needs no tags
    assert len(parse_sentences(model, loaded, [["the", "zork3um", "blim2ed"]])[0]) == 3
    with pytest.raises(ValueError, match="upos_aux"):
        parser.ParserConfig(upos_aux=-1.0)
    plain, _ = _model()
    with pytest.raises(ValueError, match="auxiliary tagger"):
        parser.tag_accuracy(plain, words, dev)


def test_the_cpu_preset_parser_fits_the_nli_cpu_preset() -> None:
    """The NLI ``pretrained`` variant loads the parser's projection and scorer: the sizes
    of the two cpu presets must agree; the parser-side inputs are on, gold UPOS is not."""
    from structattn.recipes import nli

    ours, theirs = parser.RECIPE.presets["cpu"].config, nli.RECIPE.presets["cpu"].config
    assert (ours.hidden_dim, ours.parser_dim, ours.parser_layers) == (
        theirs.hidden_dim, theirs.parser_dim, theirs.parser_layers
    )  # fmt: skip
    assert ours.word_min_count == 2 and ours.char_dim > 0 and not ours.upos and ours.upos_aux > 0
