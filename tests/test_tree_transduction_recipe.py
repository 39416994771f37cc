"""Tree-transduction recipe and its CLI on tiny data (the training loop's own tests are in
tests/test_training.py; this file keeps the recipe-level ones: loss falls, resume, the
trained model round trip, beam search, the CLI under torchrun)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from structattn.cli import main
from structattn.data.tree_transduction import Pair, generate_splits, write_splits
from structattn.recipes.config import replace_path
from structattn.recipes.tree_transduction import (
    TreeTransductionConfig,
    collate,
    correct_before_first_error,
    load_data,
    load_trained,
    train,
)
from structattn.training import (
    load_checkpoint,
)

TINY = replace_path(
    TreeTransductionConfig(dim=8, parser_hidden=4, train_size=40, valid_size=10, batch_size=10),
    {"train.epochs": 2, "train.progress": False, "train.log_every": 1},
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data")
    splits = generate_splits(0, train_per_depth=20, valid_per_depth=4, test_per_depth=3)
    write_splits(splits, out)
    return out


def _losses(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if r["kind"] == "train"]


def test_metric_correct_before_first_error() -> None:
    assert correct_before_first_error("a b c d".split(), "a b c d".split()) == 1.0
    assert correct_before_first_error("a b x d".split(), "a b c d".split()) == 0.5
    assert correct_before_first_error("a b".split(), "a b c d".split()) == 0.5
    assert correct_before_first_error("x b c d".split(), "a b c d".split()) == 0.0
    assert correct_before_first_error("a b c d e f".split(), "a b c d".split()) == 1.0


@pytest.mark.parametrize("attention", ["none", "simple", "structured", "constituency"])
def test_cli_train_eval_smoke(attention: str, data_dir: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / attention
    args = ["train", "tree-transduction", "--attention", attention, "--out", str(run)]
    args += ["--data-dir", str(data_dir), "--epochs", "1", "--dim", "8", "--parser-hidden", "4"]
    args += ["--batch-size", "10", "--train-size", "20", "--progress", "false"]
    assert main(args) == 0
    for name in ("config.json", "metrics.jsonl", "checkpoint.pt", "model.pt", "done.json"):
        assert (run / name).exists()
    # the run is scored on the test split when it finishes
    done = json.loads((run / "done.json").read_text())
    assert set(done["test"]["per_depth"]) == {"2", "3", "4", "5", "6"}
    # train again into the same directory: refused (was a silent overwrite of config.json
    # and metrics.jsonl), unless --force
    saved = {n: (run / n).read_text() for n in ("config.json", "metrics.jsonl", "done.json")}
    assert main(args) == 2
    assert "--resume" in capsys.readouterr().err
    assert {n: (run / n).read_text() for n in saved} == saved
    assert main([*args, "--force"]) == 0
    losses = _losses(run) or [
        json.loads(x)["train_loss"] for x in (run / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(torch.isfinite(torch.tensor(losses)))
    predictions = tmp_path / "pred.jsonl"
    args = [
        "eval",
        "tree-transduction",
        "--checkpoint",
        str(run),
        "--data",
        str(data_dir / "test.tsv"),
    ]
    assert main([*args, "--predictions", str(predictions), "--beam-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "Depth" in out and "overall" in out
    records = [json.loads(x) for x in predictions.read_text().splitlines()]
    assert len(records) == len((data_dir / "test.tsv").read_text().splitlines())
    for r in records:
        assert {"source", "target", "prediction", "score"} <= set(r)
        assert isinstance(r["score"], float)


def test_training_loss_falls(tmp_path: Path) -> None:
    config = replace_path(  # memorise 6 pairs (75 SGD steps): the loss must fall clearly
        TINY, {"attention": "structured", "dim": 16, "train_size": 6, "batch_size": 2,
               "valid_size": 4, "train.epochs": 25, "train.decay_start": 100,
               "train.decay_on_plateau": False},
    )  # fmt: skip
    train(config, tmp_path / "run")
    epochs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in epochs if r["kind"] == "epoch"]
    assert all(map(math.isfinite, losses)) and losses[-1] < 0.75 * losses[0], losses


def test_resume_gives_the_same_losses(tmp_path: Path) -> None:
    config = replace(TINY, attention="structured")
    train(config, tmp_path / "full")
    train(replace_path(config, {"train.epochs": 1}), tmp_path / "split")
    train(config, tmp_path / "split", resume=True)
    assert _losses(tmp_path / "full") == pytest.approx(_losses(tmp_path / "split"), rel=1e-6)
    a = load_checkpoint(tmp_path / "full" / "model.pt")["model"]
    b = load_checkpoint(tmp_path / "split" / "model.pt")["model"]
    for key in a:
        torch.testing.assert_close(a[key], b[key])


def test_trained_model_round_trip_and_a_missing_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(replace_path(TINY, {"attention": "structured", "train.epochs": 1}), run)
    model, vocab, config = load_trained(run)
    assert config.attention == "structured"
    pairs = load_data(config)["test"][:5]
    batch = collate(pairs, vocab, torch.device("cpu"))
    again, _, _ = load_trained(run)
    torch.testing.assert_close(
        model(batch.source, batch.source_mask, batch.target_in),
        again(batch.source, batch.source_mask, batch.target_in),
    )
    assert (
        main(
            ["eval", "tree-transduction", "--checkpoint", str(tmp_path / "nowhere"), "--data", "x"]
        )
        == 2
    )


def test_beam_search_of_size_one_is_greedy(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(replace(TINY, attention="structured", train_size=40), run)
    model, vocab, config = load_trained(run)
    model = model.double()  # no float32 near-ties between batched and one-by-one decoding
    pairs: list[Pair] = load_data(config)["test"][:6]
    batch = collate(pairs, vocab, torch.device("cpu"))
    beam = model.beam_search(batch.source, batch.source_mask, vocab.bos_id, vocab.eos_id, 1, 30)
    for i in range(len(pairs)):  # greedy decoding, one item at a time, by hand
        src, mask = batch.source[i : i + 1], batch.source_mask[i : i + 1]
        tokens = [vocab.bos_id]
        score = 0.0
        with torch.no_grad():
            for step in range(31):
                logits = model(src, mask, torch.tensor([tokens]))[0, -1]
                logp = torch.log_softmax(logits, -1)
                nxt = int(logp.argmax()) if step < 30 else vocab.eos_id  # max length: stop
                score += float(logp[nxt])
                if nxt == vocab.eos_id:
                    break
                tokens.append(nxt)
        assert beam.tokens[i] == tokens[1:]
        assert beam.scores[i].item() == pytest.approx(score, abs=1e-4)
    wide = model.beam_search(batch.source, batch.source_mask, vocab.bos_id, vocab.eos_id, 4, 30)
    assert (wide.scores >= beam.scores - 1e-5).all()


def test_ddp_two_processes_match_single_process(tmp_path: Path, data_dir: Path) -> None:
    """The documented command under torchrun --nproc_per_node=2 (gloo) gives the
    single-process result with the same global batch (the loop's own DDP test, on a toy
    model, is in tests/test_training.py)."""
    common = [
        "train",
        "tree-transduction",
        "--attention",
        "structured",
        "--data-dir",
        str(data_dir),
    ]
    common += ["--epochs", "2", "--dim", "8", "--parser-hidden", "4", "--batch-size", "10"]
    common += ["--train-size", "40", "--valid-size", "8", "--progress", "false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = tmp_path / "single"
    subprocess.run(
        [sys.executable, "-m", "structattn.cli", "--threads", "1", *common, "--out", str(single)],
        check=True,
        env=env,
        capture_output=True,
    )
    ddp = tmp_path / "ddp"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + ["-m", "structattn.cli", "--threads", "1", *common, "--out", str(ddp)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    a = load_checkpoint(single / "checkpoint.pt")["model"]
    b = load_checkpoint(ddp / "checkpoint.pt")["model"]
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)
    assert _losses(single) == pytest.approx(_losses(ddp), rel=1e-4)
    # rank 0 alone writes the log: one line per step, not two
    assert len(_losses(ddp)) == len(_losses(single))


@pytest.mark.slow
def test_demo_quick_runs(tmp_path: Path) -> None:
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "results.json").read_text())
    assert set(summary["per_depth"]) == {"simple", "structured"}
    for path in summary["plots"]:
        assert Path(path).stat().st_size > 1000
    assert (tmp_path / "simple" / "model.pt").exists() and (
        tmp_path / "structured" / "model.pt"
    ).exists()
