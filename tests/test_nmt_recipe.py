"""The NMT recipe (SAN 4.2): model shapes, beam = greedy at width 1, the penalty in the loss,
BLEU = sacrebleu's = a hand count, a tiny model that learns, the CLI and its bad-input errors."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from structattn.attention import SegmentationAttention, SigmoidAttention, SoftmaxAttention
from structattn.cli import main
from structattn.data.parallel import ParallelPair, TranslationVocabulary
from structattn.data.translation import encode_sources
from structattn.metrics import bleu, bleu_significance, chrf
from structattn.models import translate
from structattn.recipes import nmt
from structattn.recipes.config import replace_path
from structattn.viz.nmt import format_table

sacrebleu = pytest.importorskip("sacrebleu")

WORDS = {"ねこ": "cat", "いぬ": "dog", "とり": "bird", "さかな": "fish", "うま": "horse"}


@pytest.fixture(autouse=True)
def _python_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRUCTATTN_EXTENSION", "0")


def _toy_corpus(root: Path, sizes: dict[str, int], seed: int = 0) -> Path:
    """A toy 'Japanese' -> English corpus: 1-4 animal words, translated word by word."""
    rng = random.Random(seed)
    keys = sorted(WORDS)
    for stem, size in sizes.items():
        ja, en = [], []
        for _ in range(size):
            words = [rng.choice(keys) for _ in range(rng.randint(1, 4))]
            ja.append(" ".join(words))
            en.append(" ".join(WORDS[w] for w in words))
        (root / f"{stem}.ja").write_text("\n".join(ja) + "\n", encoding="utf-8")
        (root / f"{stem}.en").write_text("\n".join(en) + "\n", encoding="utf-8")
    return root


def _toy_config(root: Path, **changes: object) -> nmt.NMTConfig:
    base = replace_path(
        nmt.QUICK_CONFIG,
        {"data_dir": str(root), "min_count": 1, "train_size": 0, "valid_size": 0,
         "test_size": 0, "dropout": 0.0, "embedding_dim": 24, "hidden_dim": 24},
    )  # fmt: skip
    return replace_path(base, dict(changes))


def _vocabs(config: nmt.NMTConfig) -> nmt.Vocabularies:
    splits, _ = nmt.load_data(config)
    return nmt.build_vocabularies(config, splits["train"])


@pytest.mark.parametrize(
    ("attention", "layer"),
    [("simple", SoftmaxAttention), ("sigmoid", SigmoidAttention),
     ("structured", SegmentationAttention)],
)  # fmt: skip
def test_model_shapes_and_layers(tmp_path: Path, attention: str, layer: type) -> None:
    config = _toy_config(_toy_corpus(tmp_path, {"train": 20, "dev": 4, "test": 4}),
                         attention=attention, layers=2)  # fmt: skip
    vocabs = _vocabs(config)
    model = nmt.build_model(config, vocabs)
    assert isinstance(model.attention, layer)
    assert model.config.input_feeding and model.config.decoder_layers == 2
    assert all(p.abs().max() <= config.init_range for p in model.parameters())
    pairs = nmt.load_data(config)[0]["train"][:3]
    batch = nmt.collate(pairs, vocabs, "char", torch.device("cpu"))
    longest = max(p.source_chars for p in pairs)
    assert batch.source.shape == (3, longest)
    assert batch.source_mask.sum(-1).tolist() == [p.source_chars for p in pairs]
    logits = model(batch.source, batch.source_mask, batch.target_in)
    assert logits.shape == (*batch.target_in.shape, len(vocabs.target))
    assert batch.target_in[:, 0].eq(vocabs.target.bos_id).all()


def test_beam_one_is_greedy(tmp_path: Path) -> None:
    config = _toy_config(_toy_corpus(tmp_path, {"train": 20, "dev": 4, "test": 4}))
    vocabs = _vocabs(config)
    model = nmt.build_model(config, vocabs).eval()
    for p in model.parameters():  # sharper, varied distributions than the small init
        p.data.mul_(30)
    sources = [tuple("ねこいぬ"), tuple("とり"), tuple("うまさかなねこ")]
    beam = translate(model, sources, vocabs, beam_size=1, max_length=12)
    source, mask = encode_sources(sources, vocabs.source, torch.device("cpu"))
    with torch.no_grad():
        _, state = model.init_state(source, mask)
        memory = model.encode(source, mask).memory
        tokens = torch.full((3,), vocabs.target.bos_id)
        greedy: list[list[int]] = [[], [], []]
        finished = [False] * 3
        for _ in range(min(12, 2 * source.shape[1] + 10) + 1):
            logits, state = model.decode_step(tokens, state, memory, mask)
            tokens = logits.argmax(-1)
            for i, t in enumerate(tokens.tolist()):
                if not finished[i]:
                    if t == vocabs.target.eos_id:
                        finished[i] = True
                    else:
                        greedy[i].append(t)
    expected = [vocabs.target.decode(g[:12]) for g in greedy]
    assert beam == expected
    assert any(beam)  # the check is not vacuous


def test_penalty_reaches_the_loss(tmp_path: Path) -> None:
    config = _toy_config(_toy_corpus(tmp_path, {"train": 20, "dev": 4, "test": 4}),
                         attention="structured", penalty=0.5)  # fmt: skip
    vocabs = _vocabs(config)
    model = nmt.build_model(config, vocabs)
    assert isinstance(model.attention, SegmentationAttention) and model.attention.lam == 2.0
    batch = nmt.collate(nmt.load_data(config)[0]["train"][:5], vocabs, "char", torch.device("cpu"))
    with torch.no_grad():
        model.attention.transitions.copy_(torch.tensor([[1.0, -2.0], [0.5, 3.0]]))
    model.eval()
    loss, examples, _ = nmt.sequence_loss(model, batch)
    logits = model(batch.source, batch.source_mask, batch.target_in)
    nll = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch.target_out.flatten(), ignore_index=0, reduction="sum"
    )
    assert examples == 5
    assert float((loss - nll).detach()) == pytest.approx(5 * 0.5 * (1 + 4 + 0.25 + 9), rel=1e-5)
    loss.backward()  # the penalty's gradient reaches b
    assert model.attention.transitions.grad is not None


def _hand_bleu(hyps: list[str], refs: list[str]) -> float:
    """multi-bleu.perl's BLEU by direct n-gram counting."""
    matches, totals = [0] * 4, [0] * 4
    hyp_len = ref_len = 0
    for h, r in zip(hyps, refs, strict=True):
        hw, rw = h.split(), r.split()
        hyp_len, ref_len = hyp_len + len(hw), ref_len + len(rw)
        for n in range(1, 5):
            hn = Counter(tuple(hw[i : i + n]) for i in range(len(hw) - n + 1))
            rn = Counter(tuple(rw[i : i + n]) for i in range(len(rw) - n + 1))
            matches[n - 1] += sum(min(c, rn[g]) for g, c in hn.items())
            totals[n - 1] += max(len(hw) - n + 1, 0)
    if min(matches) == 0:
        return 0.0
    log_p = sum(math.log(m / t) for m, t in zip(matches, totals, strict=True)) / 4
    brevity = min(0.0, 1 - ref_len / hyp_len)
    return 100 * math.exp(log_p + brevity)


def test_bleu_significance_and_table(tmp_path: Path) -> None:
    rng = random.Random(0)
    words = [f"w{i}" for i in range(30)]
    refs = [" ".join(rng.choices(words, k=8)) for _ in range(60)]
    good = [r if i % 3 else " ".join(rng.choices(words, k=8)) for i, r in enumerate(refs)]
    bad = [" ".join(rng.choices(words, k=8)) for _ in refs]
    near = [refs[0], *bad[1:]]  # one sentence of 60 better
    out = bleu_significance({"simple": bad, "a": good, "b": near}, refs, "simple", 200)
    assert out["simple"]["p_value"] is None
    assert out["a"]["bleu"] == pytest.approx(bleu(good, refs))
    assert out["a"]["p_value"] is not None and out["a"]["p_value"] < 0.05  # clearly better
    assert out["b"]["p_value"] is not None and out["b"]["p_value"] > 0.05  # not significant
    low, high = out["a"]["low"], out["a"]["high"]
    assert low is not None and high is not None and low < out["a"]["bleu"] < high
    with pytest.raises(ValueError, match="baseline"):
        bleu_significance({"a": good}, refs, "simple")
    with pytest.raises(ValueError, match="hypotheses"):
        bleu_significance({"simple": bad, "a": good[:-1]}, refs, "simple")
    for name, hyps in (("simple", bad), ("structured", good)):
        cell = tmp_path / f"char-{name}"
        cell.mkdir()
        lines = [
            json.dumps({"hypothesis": h, "reference": r}) for h, r in zip(hyps, refs, strict=True)
        ]
        (cell / "test_predictions.jsonl").write_text("\n".join(lines) + "\n")
    table = nmt.significance_table(tmp_path)
    assert "CHAR" in table and "Structured" in table and "WORD" not in table
    assert nmt.significance_table(tmp_path / "nothing") == ""
    # reproduce's plots hook writes the table beside the figures
    assert nmt.RECIPE.report.plots is not None
    results = {("char", "simple"): {"bleu": 1.0}, ("char", "structured"): {"bleu": 2.0}}
    written = nmt.RECIPE.report.plots(results, tmp_path)
    assert tmp_path / "significance.md" in written
    assert (tmp_path / "significance.md").read_text() == table + "\n"


def test_bleu_matches_sacrebleu_and_a_hand_count() -> None:
    hyps = ["the cat sat on the mat .", "i can 't tell who will win", "he is kind ."]
    refs = ["the cat sat on a mat .", "i can 't tell who will arrive first .", "he is kind ."]
    ours = bleu(hyps, refs)
    theirs = sacrebleu.corpus_bleu(hyps, [refs], tokenize="none", smooth_method="none").score
    assert ours == pytest.approx(theirs)
    assert ours == pytest.approx(_hand_bleu(hyps, refs), abs=1e-6)
    assert 0 < ours < 100 and bleu(refs, refs) == pytest.approx(100.0)
    assert bleu(["a b"], ["c d"]) == 0.0  # no smoothing, as multi-bleu.perl
    assert 0 < chrf(hyps, refs) < 100
    with pytest.raises(ValueError, match="hypotheses"):
        bleu(["a"], ["a", "b"])


def test_a_tiny_model_learns_to_translate_characters(tmp_path: Path) -> None:
    root = _toy_corpus(tmp_path, {"train": 300, "dev": 20, "test": 20})
    config = _toy_config(root, attention="structured", batch_size=8, **{"train.epochs": 12,
                         "train.epoch_lines": False, "train.decay_on_plateau": False})  # fmt: skip
    summary = nmt.train(config, tmp_path / "run")
    assert summary["best"]["perplexity"] < 1.5  # from ~|V| = 9 at the start
    scores = nmt.score(config, tmp_path / "run")["test"]
    # the toy targets are 1-3 words: corpus BLEU rests on a handful of 4-grams and moves by
    # 10+ points with float rounding (C++ kernels vs PyTorch), so chrF and exact matches
    # carry the check (an untrained model scores near 0 on both)
    assert scores["chrf"] > 60, scores
    records = [json.loads(x) for x in (tmp_path / "run" / "test_predictions.jsonl").open()]
    exact = sum(r["hypothesis"] == r["reference"] for r in records) / len(records)
    assert exact >= 0.4, (exact, scores)
    assert [r["index"] for r in records] == list(range(20))
    hyp = (tmp_path / "run" / "test_predictions.hyp.txt").read_text().splitlines()
    assert hyp == [r["hypothesis"] for r in records]
    assert scores["filter"]["train"] == {"kept": 300, "total": 300}


def test_cli_eval_on_files_and_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _toy_corpus(tmp_path / "data", {"train": 40, "dev": 4, "test": 4}) if (
        (tmp_path / "data").mkdir() or True
    ) else None  # fmt: skip
    assert root is not None
    out = tmp_path / "run"
    args = ["--threads", "1", "train", "nmt", "--preset", "quick", "--data-dir", str(root),
            "--min-count", "1", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    capsys.readouterr()
    src, ref = tmp_path / "in.ja", tmp_path / "in.en"
    src.write_text("ねこ いぬ\n" + "とり " * 30 + "\n", encoding="utf-8")  # line 2: 60 chars
    ref.write_text("cat dog\nbird\n", encoding="utf-8")
    predictions = tmp_path / "p.jsonl"
    common = ["eval", "nmt", "--checkpoint", str(out)]
    assert main([*common, "--source-file", str(src), "--reference-file", str(ref),
                 "--predictions", str(predictions)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "BLEU" in printed and "over the 50-character training filter" in printed
    records = [json.loads(x) for x in predictions.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1] and records[0]["reference"] == "cat dog"
    assert set(records[0]) == {"index", "source", "hypothesis", "reference"}
    assert (tmp_path / "p.hyp.txt").read_text().count("\n") == 2
    # bad input: errors name the file and line, nothing is decoded
    src.write_text("ねこ\n\nいぬ\n", encoding="utf-8")
    assert main([*common, "--source-file", str(src)]) == 2
    assert f"{src}:2: empty line" in capsys.readouterr().err
    src.write_bytes("ねこ\n".encode() + b"\x80\x81\n")
    assert main([*common, "--source-file", str(src)]) == 2
    assert f"{src}:2: not valid UTF-8" in capsys.readouterr().err
    src.write_text("ねこ\nいぬ\nとり\n", encoding="utf-8")
    assert main([*common, "--source-file", str(src), "--reference-file", str(ref)]) == 2
    assert "2 lines for 3 source lines" in capsys.readouterr().err


def test_table_and_config_checks() -> None:
    table = format_table({"char": {"simple": 1.0, "sigmoid": 2.0, "structured": None}})
    assert "CHAR" in table and "12.6" in table and "14.6" in table and "WORD" not in table
    with pytest.raises(ValueError, match="source"):
        nmt.NMTConfig(source="byte")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lam"):
        nmt.NMTConfig(lam=0.0)
    pair = ParallelPair(("ねこ",), ("cat",), 1)
    vocab = TranslationVocabulary.build([("ね", "こ")])
    vocabs = nmt.Vocabularies(vocab, TranslationVocabulary.build([("cat",)]))
    batch = nmt.collate([pair], vocabs, "word", torch.device("cpu"))
    assert batch.source.tolist() == [[vocab.unk_id]]  # a word unseen as a token -> <unk>


def test_attention_panels_checks_and_writes(tmp_path: Path) -> None:
    viz = pytest.importorskip("structattn.viz")
    pytest.importorskip("matplotlib")
    panels = [("a", torch.rand(3, 5), ["x", "y", "z"]), ("b", torch.rand(2, 5), ["u", "v"])]
    path = viz.attention_panels(panels, list("abcde"), tmp_path / "p.png", title="t")
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="every panel needs"):
        viz.attention_panels([*panels, ("c", torch.rand(2, 4), ["u", "v"])], None, path)
    with pytest.raises(ValueError, match="row labels"):
        viz.attention_panels([("a", torch.rand(3, 5), ["x"])], None, path)
    with pytest.raises(ValueError, match="at least one"):
        viz.attention_panels([], None, path)
