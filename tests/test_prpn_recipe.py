"""PRPN recipe pieces: parsing sentences with a model, the baselines, eval errors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nltk")

from structattn.data.treebank import TreebankSentence, parse_mrg  # noqa: E402
from structattn.models.prpn_lm import PRPNConfig, PRPNLanguageModel  # noqa: E402
from structattn.recipes.prpn import (  # noqa: E402
    PRPNRecipeConfig,
    build_model,
    parse_baselines,
    parse_sentences,
)
from structattn.trees import tree_spans  # noqa: E402

TOY = "( (S (NP (DT the) (NN cat)) (VP (VBD sat) (PP (IN on) (NP (DT the) (NN mat))))) )"


def test_parse_sentences_gives_one_binary_tree_per_sentence_in_any_batching() -> None:
    torch.manual_seed(0)
    model = PRPNLanguageModel(PRPNConfig(vocab_size=12, embed_dim=6, hidden_dim=8))
    vocab = {w: i + 2 for i, w in enumerate("the cat sat on mat a dog".split())}

    def encode(words: list[str]) -> list[int]:
        return [vocab.get(w, 1) for w in words]

    sentences = [["the", "cat", "sat"], ["a"], ["the", "dog", "sat", "on", "the", "mat"]]
    batched = parse_sentences(model, sentences, encode, batch_size=3)
    alone = [parse_sentences(model, [s], encode)[0] for s in sentences]
    for (d, tree), (d1, tree1), words in zip(batched, alone, sentences, strict=True):
        assert len(d) == len(words) and tree == tree1
        assert d == pytest.approx(d1, abs=1e-6)
        assert len(tree_spans(tree, include_root=True)) == len(words) - 1


def test_baselines_on_a_hand_made_sentence() -> None:
    (sentence,) = parse_mrg(TOY)
    assert isinstance(sentence, TreebankSentence)
    scores = parse_baselines([sentence], seeds=2)
    # gold without root: (0,2) (2,6) (3,6) (4,6); right-branching: (1,6) (2,6) (3,6) (4,6)
    assert scores["RBRANCH"]["uf1_corpus"] == pytest.approx(75.0)
    # left-branching: (0,2) (0,3) (0,4) (0,5) -> 1 of 4
    assert scores["LBRANCH"]["uf1_corpus"] == pytest.approx(25.0)
    assert scores["UPPER BOUND"]["uf1_corpus_root"] == pytest.approx(100.0)


def test_build_model_variants() -> None:
    assert isinstance(
        build_model(PRPNRecipeConfig(model="prpn-bt", embed_size=4, hidden_size=4), 10),
        PRPNLanguageModel,
    )
    lstm = build_model(PRPNRecipeConfig(model="lstm", embed_size=4, hidden_size=4), 10)
    assert not isinstance(lstm, PRPNLanguageModel)
    with pytest.raises(ValueError, match="model"):
        PRPNRecipeConfig(model="gru")  # type: ignore[arg-type]


@pytest.mark.data("ptb", "nltk_treebank_sample")
def test_eval_parses_plain_sentences(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """train quick -> eval --task parse --sentences FILE prints one bracketed tree per line."""
    from structattn.cli import main

    run = tmp_path / "run"
    assert main(["train", "prpn", "--preset", "quick", "--out", str(run)]) == 0
    text = tmp_path / "s.txt"
    text.write_text("the cat sat on the mat\n\nit costs 61 dollars\n")
    capsys.readouterr()
    checkpoint = next(p.parent for p in run.rglob("model.pt"))
    args = ["eval", "prpn", "--checkpoint", str(checkpoint), "--task", "parse"]
    assert main([*args, "--sentences", str(text)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("(")]
    assert len(lines) == 2 and "61" in lines[1] and lines[0].count("(") == 5  # 6 words
    assert main([*args, "--max-words", "3"]) == 0
    out = capsys.readouterr().out
    assert "<= 3 words" in out and "right-branching" in out
    assert main([*args, "--max-words", "4", "--decode", "all"]) == 0
    out = capsys.readouterr().out
    assert "most likely tree" in out and "sampled draws" in out and "standard convention" in out
    for decode in ("map", "sample"):
        parse = ["parse", "prpn", "--checkpoint", str(checkpoint), "--input", str(text)]
        assert main([*parse, "--decode", decode]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 2 and lines[0].count("(") == 5


@pytest.mark.data("ptb", "nltk_treebank_sample")
def test_quick_marginal_objective_train_eval_resume_viz(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """#40: the exact latent-variable objective through the CLI: train -> refused re-train ->
    eval -> resume -> parse -> viz on the quick preset, and its test perplexity is finite."""
    import json
    import math

    from test_recipes import _smoke

    _smoke("prpn", tmp_path, capsys, ["--model", "prpn-bt", "--objective", "marginal"])
    (done,) = tmp_path.rglob("done.json")
    config = json.loads((done.parent / "config.json").read_text())
    assert config["objective"] == "marginal" and config["model"] == "prpn-bt"
    summary = json.loads(done.read_text())
    assert math.isfinite(summary["test"]["perplexity"]) and summary["test"]["perplexity"] > 1
    with pytest.raises(ValueError, match="objective"):
        PRPNRecipeConfig(model="lstm", objective="marginal")
