"""The NLI recipe (SAN 4.4, Table 5) and the EWT parser recipe: the model's variants, a tiny
task learned, the parser's loss on non-projective trees, predictions files, the table with
its paired bootstrap, and the pipeline (hard-parent) and pretrained variants end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from structattn.cli import main
from structattn.data.classification import word_vocabulary
from structattn.data.conllu import parse_conllu, read_conllu
from structattn.models.nli import DecomposableAttention
from structattn.models.parser import ArcParser, decode_heads, predict_heads
from structattn.recipes import nli, parser, runs
from structattn.recipes.config import replace_path
from structattn.viz.nli import format_table

needs_data = pytest.mark.data("sick", "ud_english_ewt", "glove")


def _inputs(batch: int = 3, n: int = 6, m: int = 4) -> tuple[torch.Tensor, ...]:
    premise = torch.randint(1, 20, (batch, n))
    hypothesis = torch.randint(1, 20, (batch, m))
    pl = torch.tensor([n, 3, 2][:batch])
    hl = torch.tensor([m, 4, 1][:batch])
    pmask = torch.arange(n) < pl[:, None]
    hmask = torch.arange(m) < hl[:, None]
    return premise.masked_fill(~pmask, 0), pmask, hypothesis.masked_fill(~hmask, 0), hmask


@pytest.mark.parametrize("intra", ["none", "simple", "structured", "hard-parent"])
def test_every_variant_forward_backward_and_padding(intra: str) -> None:
    table = torch.randn(20, 5)
    model = DecomposableAttention(table, hidden_dim=8, intra=intra, parser_dim=4, dropout=0.0)
    p, pm, h, hm = _inputs()
    heads = {}
    if intra == "hard-parent":
        heads = {
            "premise_heads": torch.tensor(
                [[0, 1, 2, 3, 4, 5], [2, 0, 2, 0, 0, 0], [0, 1, 0, 0, 0, 0]]
            ),
            "hypothesis_heads": torch.tensor([[0, 1, 1, 3], [0, 1, 2, 3], [0, 0, 0, 0]]),
        }  # fmt: skip
    out = model(p, pm, h, hm, **heads)
    assert out.logits.shape == (3, 3) and torch.isfinite(out.logits).all()
    out.logits.sum().backward()
    trained = [q for q in model.parameters() if q.requires_grad]
    assert all(q.grad is not None and torch.isfinite(q.grad).all() for q in trained)
    assert model.embed.weight.grad is None  # the embeddings stay fixed
    # item 2 alone, trimmed to its own lengths, gives the same logits (padding invariance)
    alone = model(
        p[2:, :2], pm[2:, :2], h[2:, :1], hm[2:, :1],
        **{k: v[2:, : (2 if k.startswith("p") else 1)] for k, v in heads.items()},
    )  # fmt: skip
    torch.testing.assert_close(alone.logits, out.logits[2:], atol=1e-5, rtol=1e-5)
    if intra in ("simple", "structured"):
        assert out.premise_marginals is not None
        # every word has one (soft) parent: the columns of the real words sum to 1
        sums = out.premise_marginals[1, :, 1:4].sum(0)
        torch.testing.assert_close(sums, torch.ones(3), atol=1e-5, rtol=0)


def test_soft_children_widen_the_inputs() -> None:
    model = DecomposableAttention(torch.randn(20, 5), hidden_dim=8, intra="structured",
                                  parser_dim=4, children=True)  # fmt: skip
    p, pm, h, hm = _inputs()
    x, _ = model.represent(p, pm)
    assert x.shape == (3, 6, 24) and model(p, pm, h, hm).logits.shape == (3, 3)
    with pytest.raises(ValueError, match="children"):
        DecomposableAttention(torch.randn(20, 5), intra="simple", children=True)


def test_structured_and_simple_weights_differ() -> None:
    torch.manual_seed(1)
    table = torch.randn(20, 5)
    p, pm, h, hm = _inputs()
    outs = {}
    for intra in ("simple", "structured"):
        torch.manual_seed(2)
        model = DecomposableAttention(table, hidden_dim=8, intra=intra, parser_dim=4)
        outs[intra] = model.eval()(p, pm, h, hm).premise_marginals
    assert not torch.allclose(outs["simple"], outs["structured"], atol=1e-3)


def test_tiny_model_learns_entailment_by_overlap() -> None:
    """Entailment: the hypothesis is a subset of the premise's words; contradiction: it
    shares none. Needs the cross-sentence alignment to work (bag-of-words alone fails)."""
    torch.manual_seed(0)
    table = torch.randn(40, 8)
    b, n, m = 256, 5, 3
    premise = torch.randint(1, 40, (b, n))
    label = torch.randint(0, 2, (b,))
    own = premise[:, torch.randperm(n)[:m]]
    other = torch.randint(1, 40, (b, m))
    hypothesis = torch.where(label[:, None] == 0, own, other)
    mask_p = torch.ones(b, n, dtype=torch.bool)
    mask_h = torch.ones(b, m, dtype=torch.bool)
    model = DecomposableAttention(table, hidden_dim=16, intra="structured", parser_dim=4, classes=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(60):
        loss = torch.nn.functional.cross_entropy(
            model(premise, mask_p, hypothesis, mask_h).logits, label
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    accuracy = model.eval()(premise, mask_p, hypothesis, mask_h).logits.argmax(-1) == label
    assert accuracy.float().mean() > 0.9


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="attention"):
        nli.NLIConfig(attention="tree")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="children"):
        nli.NLIConfig(attention="simple", children=True)
    with pytest.raises(ValueError, match="needs a trained parser"):
        nli._needs_parser(nli.NLIConfig(attention="hard-parent"))


def test_table_with_paired_bootstrap() -> None:
    def summary(variant: str, correct: list[str]) -> dict[str, object]:
        records = [
            {"test": {"accuracy": 100 * c.count("1") / len(c), "correct": c},
             "valid": {"accuracy": 50.0}}
            for c in correct
        ]  # fmt: skip
        s = nli._summarize(nli.NLIConfig(attention=variant), records)  # type: ignore[arg-type]
        return {**s, "runs": len(records)}

    results = {
        ("sick", "none"): summary("none", ["1100" * 50, "1000" * 50]),
        ("sick", "structured"): summary("structured", ["1110" * 50, "1111" * 50]),
    }
    assert results[("sick", "none")]["correct_runs"].startswith("2100")
    table = format_table(results)
    assert "37.5 +- 17.7 (2)" in table and "86.8" in table
    assert "[+50.0, p 0.00]" in table  # structured beats none on these pairs


def _write_tree(tmp_path: Path) -> Path:
    # "a b c d": arcs 2 -> 4 cross 1 -> 3 (non-projective), ROOT -> 1
    text = (
        "# sent_id = x\n# text = a b c d\n"
        "1\ta\ta\tX\t_\t_\t0\troot\t_\t_\n"
        "2-3\tbc\t_\t_\t_\t_\t_\t_\t_\t_\n"
        "2\tb\tb\tX\t_\t_\t1\tdep\t_\t_\n"
        "3\tc\tc\tPUNCT\t_\t_\t1\tpunct\t_\t_\n"
        "3.1\te\t_\t_\t_\t_\t_\t_\t_\t_\n"
        "4\td\td\tX\t_\t_\t2\tdep\t_\t_\n\n"
    )
    path = tmp_path / "t.conllu"
    path.write_text(text)
    return path


def test_parser_loss_on_non_projective_trees_and_conllu_predictions(tmp_path: Path) -> None:
    sentences = read_conllu(_write_tree(tmp_path)) * 3
    table = torch.randn(6, 4)
    words = word_vocabulary([s.words for s in sentences])
    model = ArcParser(table, hidden_dim=8, parser_dim=4)
    from structattn.data.conllu import heads_tensor
    from structattn.distributions import NonProjectiveDependencyCRF, structured_nll

    ids = torch.tensor([words.encode(s.words) for s in sentences])
    lengths = torch.tensor([4, 4, 4])
    heads, _ = heads_tensor(sentences)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(60):  # the gold tree is non-projective: the loss stays finite and falls
        crf = NonProjectiveDependencyCRF(model(ids, lengths), lengths + 1, multiroot=False)
        loss = structured_nll(crf, heads, reduction="token")
        assert torch.isfinite(loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5
    # decoding: CLE finds the crossing arc, Eisner the best projective tree
    scores = torch.full((1, 5, 5), -5.0)
    for m, h in enumerate(sentences[0].heads or (), start=1):
        scores[0, h, m] = 5.0
    assert decode_heads(scores, torch.tensor([4]), "cle")[0].tolist() == [-1, 0, 1, 1, 2]
    eisner = decode_heads(scores, torch.tensor([4]), "eisner")[0].tolist()
    assert eisner != [-1, 0, 1, 1, 2] and eisner[:3] == [-1, 0, 1]
    assert predict_heads(model, words, [s.words for s in sentences[:1]])[0][0] == 0
    out = tmp_path / "p.conllu"
    parser._write_predictions(out, sentences[:1], [[0, 1, 1, 1]])
    before, after = _write_tree(tmp_path).read_text(), out.read_text()
    changed = [
        (a, b) for a, b in zip(before.splitlines(), after.splitlines(), strict=True) if a != b
    ]
    assert changed == [("4\td\td\tX\t_\t_\t2\tdep\t_\t_", "4\td\td\tX\t_\t_\t1\tdep\t_\t_")]
    assert parse_conllu(after)[0].heads == (0, 1, 1, 1)


@needs_data
def test_hard_parent_and_pretrained_through_a_parser_run(tmp_path: Path) -> None:
    parser_config = replace_path(parser.RECIPE.presets["quick"].config, {"max_train": 32})
    run = tmp_path / "parser"
    runs.train_cell(parser.RECIPE, parser_config, run)
    trained, _, _ = parser.load_trained(run)
    # eval parser on any CoNLL-U file: predicted HEADs written, everything else kept
    tree = _write_tree(tmp_path)
    out = tmp_path / "pred.conllu"
    assert main(["--threads", "1", "eval", "parser", "--checkpoint", str(run), "--conllu",
                 str(tree), "--predictions", str(out)]) == 0  # fmt: skip
    (predicted,) = read_conllu(out)
    assert predicted.words == ("a", "b", "c", "d") and predicted.lines[0] == "# sent_id = x"
    assert predicted.lines[3].startswith("2-3\tbc") and predicted.heads is not None
    base = replace_path(nli.RECIPE.presets["quick"].config, {"max_train": 16, "parser": str(run)})
    # the pretrained variant starts from the parser's projection and arc scorer
    config = replace_path(base, {"attention": "pretrained"})
    splits, words, table = nli.prepare(config)
    model = nli.build_model(config, table.weight)
    # the quick parser also reads trained word vectors and characters: said, not hidden
    with pytest.warns(UserWarning, match="--word-min-count, --char-dim"):
        nli.load_pretrained_parser(model, config)
    assert model.syntactic is not None
    torch.testing.assert_close(model.project.weight, trained.project.weight)
    torch.testing.assert_close(model.syntactic.scorer.s.weight, trained.scorer.s.weight)
    with pytest.raises(ValueError, match="differs in"), pytest.warns(UserWarning):
        nli.load_pretrained_parser(model, replace_path(config, {"hidden_dim": 17}))
    with pytest.raises(ValueError, match="parser_layers"), pytest.warns(UserWarning):
        nli.load_pretrained_parser(model, replace_path(config, {"parser_layers": 2}))
    # --pretrained-parser: pretrained reads its own parser run; hard-parent keeps --parser
    other = replace_path(config, {"parser": str(tmp_path / "none"), "pretrained_parser": str(run)})
    nli._needs_parser(other)
    with pytest.warns(UserWarning):
        nli.load_pretrained_parser(nli.build_model(other, table.weight), other)
    with pytest.raises(ValueError, match="pretrained-parser"):
        nli._needs_parser(replace_path(config, {"parser": str(tmp_path / "none")}))
    with pytest.raises(ValueError, match="no parser run"):
        nli._needs_parser(replace_path(other, {"attention": "hard-parent"}))
    # hard-parent: heads of every sentence from the parser, a whole run through the runner
    cell = tmp_path / "hard"
    summary = runs.train_cell(nli.RECIPE, replace_path(base, {"attention": "hard-parent"}), cell)
    assert summary is not None and summary["attention"] == "hard-parent"
    first = json.loads((cell / "test_predictions.jsonl").read_text().splitlines()[0])
    assert set(first) == {"index", "premise", "hypothesis", "gold", "predicted"}
    assert first["predicted"] in ("entailment", "neutral", "contradiction")


@pytest.mark.data("glove")
def test_branching_baselines_and_induced_trees() -> None:
    assert nli.branching_heads(3, "right") == [2, 3, 0]
    assert nli.branching_heads(3, "left") == [0, 1, 2]
    config = nli.NLIConfig(hidden_dim=8, parser_dim=4)
    model = nli.build_model(config, torch.randn(5, 50))
    sentences = [["The", "men", "fight", "."], ["a"], ["unseen-word", "deli"]]
    heads = nli.induced_heads(model, config, sentences)
    assert [len(h) for h in heads] == [4, 1, 2] and heads[1] == [0]
    assert all(0 <= h <= len(s) for s, hs in zip(sentences, heads, strict=True) for h in hs)
    with pytest.raises(ValueError, match="no syntactic attention"):
        nli.induced_heads(nli.build_model(nli.NLIConfig(attention="none"), torch.randn(5, 50)),
                          nli.NLIConfig(attention="none"), sentences)  # fmt: skip
