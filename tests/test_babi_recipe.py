"""The bAbI recipe: training through the CLI, selection, predictions, linear start, Figure 5."""

from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from structattn.cli import main
from structattn.data.babi import (
    BabiVocabulary,
    answer_accuracy,
    fact_sequence_accuracy,
    parse_babi_lines,
    read_babi,
)
from structattn.models import MemoryQA
from structattn.models.memory_qa import forward_batch
from structattn.recipes import babi
from structattn.training import Task, TrainConfig, fit
from structattn.viz.babi import format_runs

PEOPLE = ["mary", "john", "sandra", "daniel"]
PLACES = ["garden", "kitchen", "office", "hallway"]


def _story(rng: random.Random) -> list[str]:
    """A task-2-like story: people move, one picks up an object, where is the object?"""
    lines: list[str] = []
    where: dict[str, str] = {}
    holder = rng.choice(PEOPLE)
    pick_line = 0
    for _ in range(rng.randint(3, 6)):
        person, place = rng.choice(PEOPLE), rng.choice(PLACES)
        where[person] = place
        lines.append(f"{person.title()} went to the {place}.")
    where.setdefault(holder, rng.choice(PLACES))
    lines.append(f"{holder.title()} got the football there.")
    pick_line = len(lines)
    place = rng.choice(PLACES)
    lines.append(f"{holder.title()} went to the {place}.")
    move_line = len(lines)
    numbered = [f"{i} {text}" for i, text in enumerate(lines, start=1)]
    numbered.append(f"{len(lines) + 1} Where is the football?\t{place}\t{pick_line} {move_line}")
    return numbered


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("babi")
    rng = random.Random(0)
    for split, stories in (("train", 60), ("test", 20)):
        text = "\n".join(line for _ in range(stories) for line in _story(rng)) + "\n"
        (root / f"qa2_two-supporting-facts_{split}.txt").write_text(text)
    return root


def _cli(*args: str) -> int:
    return main(["--threads", "1", *args])


@pytest.mark.parametrize("model", ["memn2n", "unary-crf", "binary-crf"])
def test_cli_train_eval_each_model(model: str, data_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / model
    common = ["--data-dir", str(data_dir), "--progress", "false", "--batch-size", "8"]
    args = ["train", "babi", "--task", "2", "--model", model, "--runs", "2", "--epochs", "3"]
    assert _cli(*args, "--linear-start", "1", "--out", str(out), *common) == 0
    shown = json.loads(capsys.readouterr().out)
    summary = json.loads((out / "summary.json").read_text())
    assert shown["ans"] == summary["ans"] and summary["runs"] == 2 and summary["hops"] == 2
    assert {r["seed"] for r in summary["run_scores"]} == {0, 1}
    for run in ("run_00", "run_01"):
        done = json.loads((out / run / "done.json").read_text())
        assert done["test"]["questions"] == 20 and 0 <= done["test"]["ans"] <= 100
        assert (out / run / "model.pt").exists() and (out / run / "metrics.jsonl").exists()
        epochs = [json.loads(line) for line in (out / run / "metrics.jsonl").open()]
        last = [e["train_loss"] for e in epochs if e.get("kind") == "epoch"][-1]
        assert done["final_train_loss"] == last  # the last epoch's, kept in the record
    assert summary["converged"] == sum(r["final_train_loss"] < 0.1 for r in summary["run_scores"])
    # the best run is the best on validation, and Ans % is its test accuracy
    best = max(summary["run_scores"], key=lambda r: (r["valid"]["ans"], -r["valid"]["loss"]))
    assert summary["best_run"] == best["run"] and summary["ans"] == best["test"]["ans"]

    # eval: predictions JSONL from which anyone can recompute both metrics
    predictions = tmp_path / f"{model}.jsonl"
    assert _cli("eval", "babi", "--checkpoint", str(out), "--predictions", str(predictions)) == 0
    printed = capsys.readouterr().out
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert len(rows) == 20
    keys = {
        "task",
        "story",
        "question_index",
        "answer",
        "predicted_answer",
        "supporting_facts",
        "predicted_facts",
    }
    assert all(set(r) == keys for r in rows)
    gold = read_babi(data_dir / "qa2_two-supporting-facts_test.txt")
    for row, ex in zip(rows, gold, strict=True):
        assert (row["story"], row["question_index"]) == (ex.story, ex.question_index)
        assert (
            row["supporting_facts"] == list(ex.support_lines) and len(row["predicted_facts"]) == 2
        )
        assert all(line in ex.memory_lines for line in row["predicted_facts"])
    ans = 100 * answer_accuracy([r["predicted_answer"] for r in rows], [r["answer"] for r in rows])
    fact = 100 * fact_sequence_accuracy(
        [r["predicted_facts"] for r in rows], [r["supporting_facts"] for r in rows]
    )
    assert f"Ans {ans:.1f}%" in printed and f"Fact {fact:.1f}%" in printed
    assert ans == pytest.approx(summary["ans"]) and fact == pytest.approx(summary["best_run_fact"])

    # no silent overwrite; --resume keeps finished runs and adds missing ones
    assert _cli(*args, "--out", str(out), *common) == 2
    assert "--resume" in capsys.readouterr().err
    before = (out / "run_00" / "done.json").read_text()
    more = [*args[:7], "3", *args[8:]]  # --runs 3
    assert args[6:8] == ["--runs", "2"]
    assert _cli(*more, "--linear-start", "1", "--out", str(out), "--resume", *common) == 0
    assert (out / "run_00" / "done.json").read_text() == before
    assert json.loads((out / "summary.json").read_text())["runs"] == 3


def test_reproduce_prints_table_beside_paper(data_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "repro"
    args = ["reproduce", "babi", "--tasks", "2", "--models", "memn2n,binary-crf"]
    common = ["--runs", "1", "--epochs", "1", "--data-dir", str(data_dir), "--progress", "false"]
    assert _cli(*args, "--out", str(out), *common) == 0
    printed = capsys.readouterr().out
    assert "MemN2N (paper)" in printed and "87.3 / 46.8" in printed  # Table 4, task 2
    assert "84.7 / 81.8" in printed and "Unary" not in printed.splitlines()[0]
    results = json.loads((out / "results.json").read_text())
    assert [c["cell"] for c in results["cells"]] == [
        {"task": 2, "model": "memn2n"},
        {"task": 2, "model": "binary-crf"},
    ]
    assert results["paper"]["cells"]["memn2n"]["2"] == [87.3, 46.8]
    assert (out / "table.md").read_text().startswith("|")
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "ans.png").exists() and (out / "fact.png").exists()
    assert _cli(*args, "--tasks", "2,x", "--out", str(out), *common) == 2


def test_summarize_selection_and_fact_mean(tmp_path: Path) -> None:
    scores = [  # (valid ans, valid loss, test ans, test fact, last epoch's training loss)
        (80.0, 0.5, 70.0, 10.0, 0.05),
        (90.0, 0.9, 60.0, 20.0, 0.1),  # not below 0.1: not converged
        (90.0, 0.4, 65.0, 40.0, 0.02),  # best: ties on accuracy, lower loss
        (50.0, 0.1, 99.0, 90.0, 0.5),
    ]
    for i, (va, vl, ta, tf, final) in enumerate(scores):
        run = tmp_path / f"run_{i:02d}"
        run.mkdir()
        epochs = [
            {"kind": "epoch", "epoch": e, "train_loss": loss} for e, loss in [(1, 3.0), (2, final)]
        ]
        lines = [json.dumps(e) for e in epochs] + ['{"kind": "epo']  # a line cut short
        (run / "metrics.jsonl").write_text("\n".join(lines))
        record = {
            "run": run.name,
            "seed": i,
            "best_epoch": 1,
            "seconds": 2.0,
            "valid": {"ans": va, "loss": vl, "fact": 0.0, "questions": 10},
            "test": {"ans": ta, "fact": tf, "loss": 1.0, "questions": 10},
        }
        (run / "done.json").write_text(json.dumps(record))
    config = babi.BabiConfig(task=2, fact_runs=2)
    summary = babi.summarize(tmp_path, config, predictions=False)
    assert summary is not None
    assert summary["best_run"] == "run_02" and summary["ans"] == 65.0
    assert summary["fact"] == pytest.approx((40.0 + 20.0) / 2) and summary["fact_runs"] == 2
    # done.json records without the final loss (older runs) read it from metrics.jsonl
    assert [r["final_train_loss"] for r in summary["run_scores"]] == [0.02, 0.1, 0.05, 0.5]
    assert summary["converged"] == 2
    table = format_runs({2: {"binary-crf": summary}})
    assert "| 2 | 4, 2, 2.0 |" in table and "converged" in table
    record = json.loads((tmp_path / "run_00" / "done.json").read_text())
    (tmp_path / "run_00" / "done.json").write_text(json.dumps({**record, "final_train_loss": 9.0}))
    assert babi.summarize(tmp_path, config, predictions=False)["converged"] == 1  # kept value wins
    assert babi.summarize(tmp_path / "empty", config) is None


def test_linear_start_schedule_and_state_dict() -> None:
    for name in ("memn2n", "binary-crf"):
        model = MemoryQA(12, 4, 2, 5, name)
        babi.set_linear_start(model, True)
        assert model.linear_start and not model.normalize_potentials
        state = model.state_dict()
        babi.set_linear_start(model, False)
        assert not model.linear_start and model.normalize_potentials == (name != "memn2n")
        model.load_state_dict(state)  # the mode travels with the weights
        assert model.linear_start and not model.normalize_potentials


def test_linear_start_ends_on_the_validation_criterion() -> None:
    fixed = babi.BabiConfig(linear_start=3)
    assert [babi.in_linear_start(fixed, e, {}) for e in range(1, 6)] == [1, 1, 1, 0, 0]
    config = babi.BabiConfig(linear_start=5, linear_start_end="validation")
    falling = {1: 2.0, 2: 1.5, 3: 1.2, 4: 1.1, 5: 1.0}
    assert [babi.in_linear_start(config, e, falling) for e in range(1, 7)] == [1] * 5 + [0]
    # epoch 3 does not fall below the lowest before it (1.5): it is linear start's last
    rises = {1: 2.0, 2: 1.5, 3: 1.7, 4: 1.0}
    assert [babi.in_linear_start(config, e, rises) for e in range(1, 6)] == [1, 1, 1, 0, 0]
    equal = {1: 2.0, 2: 2.0}  # not lower is not falling
    assert [babi.in_linear_start(config, e, equal) for e in (1, 2, 3)] == [1, 1, 0]
    with pytest.raises(ValueError, match="no validation loss"):
        babi.in_linear_start(config, 3, {1: 2.0})
    with pytest.raises(ValueError, match="needs a validation set"):
        babi.BabiConfig(linear_start_end="validation", valid_fraction=0.0)
    with pytest.raises(ValueError, match="linear_start_end"):
        babi.BabiConfig(linear_start_end="loss")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="linear_start_lr"):
        babi.BabiConfig(linear_start_lr=-0.1)


def test_validation_linear_start_in_training_and_resume(data_dir: Path, tmp_path: Path) -> None:
    """The switch follows the logged validation losses, linear start has its own lr, and a
    run resumed right after the switch's epoch continues as one trained in a go."""
    train = babi.TrainConfig(epochs=5, lr=0.02, sum_loss=True, progress=False)
    config = babi.BabiConfig(
        data_dir=str(data_dir),
        model="memn2n",
        batch_size=8,
        linear_start=4,
        linear_start_end="validation",
        linear_start_lr=0.01,
        runs=1,
        train=train,
    )

    def records(run: Path) -> list[dict]:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["kind"] == "epoch"]

    babi.train_run(config, tmp_path / "full")
    full = records(tmp_path / "full")
    losses = {r["epoch"]: r["valid_loss"] for r in full}
    linear = [babi.in_linear_start(config, r["epoch"], losses) for r in full]
    end = linear.index(False)  # epochs in linear start
    assert 1 <= end < config.linear_start and not any(linear[end:]), (linear, losses)
    assert [r["lr"] for r in full] == [0.01 if lin else 0.02 for lin in linear]
    split = replace(config, train=replace(train, epochs=end))
    babi.train_run(split, tmp_path / "split")
    babi.train_run(config, tmp_path / "split", resume=True)
    again = records(tmp_path / "split")
    assert [r["lr"] for r in again] == [r["lr"] for r in full]
    assert [r["valid_loss"] for r in again] == pytest.approx([r["valid_loss"] for r in full])


def test_temporal_options_reach_the_model() -> None:
    vocab = BabiVocabulary.build(
        parse_babi_lines(["1 Mary went home.", "2 Where is Mary?\thome\t1"])
    )
    zero = babi.build_model(babi.BabiConfig(temporal_init="zero"), vocab)
    assert zero.temporal_encoding and zero.temporal.abs().sum() == 0
    off = babi.build_model(babi.BabiConfig(temporal_encoding=False), vocab)
    assert not off.temporal_encoding and off.temporal.abs().sum() > 0
    with pytest.raises(ValueError, match="temporal_init"):
        babi.BabiConfig(temporal_init="small")  # type: ignore[arg-type]


def test_crf_linear_start_reaches_the_model() -> None:
    vocab = BabiVocabulary.build(
        parse_babi_lines(["1 Mary went home.", "2 Where is Mary?\thome\t1"])
    )
    for mode in ("log-softmax", "unary", "scores"):
        config = babi.BabiConfig(model="binary-crf", crf_linear_start=mode)  # type: ignore[arg-type]
        assert babi.build_model(config, vocab).crf_linear_start == mode
    with pytest.raises(ValueError, match="crf_linear_start"):
        babi.BabiConfig(crf_linear_start="linear")  # type: ignore[arg-type]


def test_crf_query_reaches_the_model_and_trains(data_dir: Path, tmp_path: Path, capsys) -> None:
    vocab = BabiVocabulary.build(
        parse_babi_lines(["1 Mary went home.", "2 Where is Mary?\thome\t1"])
    )
    for model in ("unary-crf", "binary-crf"):
        for query in ("memory", "hop", "both"):
            config = babi.BabiConfig(model=model, crf_query=query)  # type: ignore[arg-type]
            built = babi.build_model(config, vocab)
            assert built.crf is not None and built.crf.query_mode == query
            assert (built.crf.query_update is None) == (query != "both")  # Q in "both" only
    with pytest.raises(ValueError, match="crf_query"):
        babi.BabiConfig(crf_query="greedy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tying"):
        babi.BabiConfig(tying="none")  # type: ignore[arg-type]
    assert babi.build_model(babi.BabiConfig(tying="separate"), vocab).answer is not None
    with pytest.raises(ValueError, match="crf_edge_unary"):
        babi.BabiConfig(crf_edge_unary="twice")  # type: ignore[arg-type]
    built = babi.build_model(babi.BabiConfig(crf_edge_unary="per-edge"), vocab)
    assert built.crf is not None and built.crf.edge_unary == "per-edge"
    with pytest.raises(ValueError, match="query_init"):
        babi.BabiConfig(crf_query="memory", query_init="identity")
    with pytest.raises(ValueError, match="query_init"):
        babi.BabiConfig(crf_query="hop", query_init="identity")
    out = tmp_path / "run"
    common = ["--data-dir", str(data_dir), "--progress", "false", "--batch-size", "8"]
    args = ["train", "babi", "--task", "2", "--model", "binary-crf", "--crf-query", "memory"]
    args += ["--tying", "separate"]
    assert _cli(*args, "--runs", "1", "--epochs", "2", "--out", str(out), *common) == 0
    trained = json.loads(capsys.readouterr().out)
    assert json.loads((out / "run_00" / "config.json").read_text())["crf_query"] == "memory"
    assert _cli("eval", "babi", "--checkpoint", str(out)) == 0  # rebuilds the memory-mode model
    assert f"Ans {trained['ans']:.1f}%" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["memn2n", "binary-crf"])
def test_fact_supervision_loss_is_the_gold_chains_nll(model: str, data_dir: Path) -> None:
    config = babi.BabiConfig(task=2, model=model, data_dir=str(data_dir), embed_dim=6)
    splits, vocab = babi.load_data(config)
    examples = splits["train"][:4]
    batch = vocab.encode_batch(examples)
    assert batch.support is not None and batch.support.shape == (4, 2)
    assert batch.support.tolist() == [list(ex.support) for ex in examples]
    net = babi.build_model(config, vocab).double()
    out = forward_batch(net, batch)
    if out.distribution is None:
        want = -sum(
            out.attention[b, k, f].log() for b, ex in enumerate(examples)
            for k, f in enumerate(ex.support)
        )  # fmt: skip
    else:
        want = -out.distribution.log_prob(batch.support).sum()
    torch.testing.assert_close(babi.fact_nll(out, batch.support), want)
    # rows that cannot be scored add nothing: a fact outside the memory (-2), a chain of
    # another length, and (CRF) a chain the no-repeat constraint forbids
    support = batch.support.clone()
    support[0, 1] = -2
    wider = torch.cat([support, torch.full((4, 1), -1)], 1)
    wider[1, 2] = 0  # three facts for K = 2
    wider[2, 1] = wider[2, 0]  # the same fact twice in a row
    kept = [3] if out.distribution is not None else [2, 3]
    loss = babi.fact_nll(out, wider)
    assert torch.isfinite(loss)
    if out.distribution is None:
        part = -sum(out.attention[b, k, wider[b, k]].log() for b in kept for k in range(2))
    else:
        part = -out.distribution.log_prob(batch.support)[kept].sum()
    torch.testing.assert_close(loss, part)
    grads = torch.autograd.grad(loss, [p for p in net.parameters() if p.requires_grad])
    assert all(torch.isfinite(g).all() for g in grads)
    with pytest.raises(ValueError, match="fact_supervision"):
        babi.BabiConfig(fact_supervision=-1.0)


def test_fact_supervision_epochs_is_a_curriculum() -> None:
    """With ``fact_supervision_epochs`` N the chains are supervised in epochs 1..N only."""
    always = babi.BabiConfig(fact_supervision=0.5)
    first3 = babi.BabiConfig(fact_supervision=0.5, fact_supervision_epochs=3)
    assert [babi.fact_supervision_weight(always, e) for e in (1, 3, 4, 100)] == [0.5] * 4
    assert [babi.fact_supervision_weight(first3, e) for e in (1, 3, 4, 100)] == [0.5, 0.5, 0, 0]
    with pytest.raises(ValueError, match="fact_supervision_epochs"):
        babi.BabiConfig(fact_supervision_epochs=-1)
    with pytest.raises(ValueError, match="needs a `fact_supervision` weight"):
        babi.BabiConfig(fact_supervision_epochs=3)  # would silently do nothing


def test_fact_supervision_stops_after_its_epochs(
    data_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """In training the chains' NLL enters the loss in the first N epochs, then never."""
    calls: list[int] = []
    original = babi.fact_nll
    epoch = [0]
    original_start = babi.in_linear_start

    def counting(out, support):
        calls.append(epoch[0])
        return original(out, support)

    def start(config, e, losses):
        epoch[0] = e
        return original_start(config, e, losses)

    monkeypatch.setattr(babi, "fact_nll", counting)
    monkeypatch.setattr(babi, "in_linear_start", start)
    train = babi.TrainConfig(epochs=3, lr=0.01, sum_loss=True, progress=False)
    config = babi.BabiConfig(
        data_dir=str(data_dir),
        batch_size=8,
        fact_supervision=1.0,
        fact_supervision_epochs=2,
        runs=1,
        train=train,
    )
    babi.train_run(config, tmp_path / "run")
    assert calls and set(calls) == {1, 2}, sorted(set(calls))


def test_fact_supervision_teaches_the_chain(data_dir: Path, tmp_path: Path, capsys) -> None:
    """With the gold chains reversed (move, then pick-up), answer-only training learns its
    own order and misses them; supervision on them teaches the reversed order."""
    reversed_dir = tmp_path / "reversed"
    reversed_dir.mkdir()
    for path in data_dir.glob("*.txt"):
        lines = []
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 3:
                parts[2] = " ".join(reversed(parts[2].split()))
            lines.append("\t".join(parts))
        (reversed_dir / path.name).write_text("\n".join(lines) + "\n")
    facts = {}
    for weight in ("0", "2"):
        out = tmp_path / f"w{weight}"
        args = ["train", "babi", "--task", "2", "--model", "binary-crf", "--runs", "1"]
        common = ["--data-dir", str(reversed_dir), "--progress", "false", "--batch-size", "8"]
        extra = ["--epochs", "15", "--fact-supervision", weight, "--init-std", "0.316"]
        assert _cli(*args, *extra, "--out", str(out), *common) == 0
        facts[weight] = json.loads(capsys.readouterr().out)["fact"]
    assert facts["2"] > 90 > facts["0"], facts


def test_fit_calls_epoch_hook_and_sum_loss_scales_lr(tmp_path: Path) -> None:
    """Summed-loss SGD with lr equals mean-loss SGD with lr * batch size (equal batches)."""
    data = torch.randn(12, 3)
    target = data @ torch.tensor([1.0, -2.0, 0.5])
    seen: list[int] = []
    finals = []
    for sum_loss, lr in ((True, 0.01), (False, 0.04)):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)

        def loss(m, batch):
            x, y = batch
            return ((m(x).squeeze(-1) - y) ** 2).sum(), len(y), len(y)

        task = Task(
            model=model,
            batches=lambda epoch: [list(range(i, i + 4)) for i in (0, 4, 8)],
            collate=lambda idx, dev: (data[idx], target[idx]),
            loss=loss,
            on_epoch_start=lambda m, epoch: seen.append(epoch),
        )
        config = TrainConfig(epochs=2, lr=lr, progress=False, sum_loss=sum_loss, epoch_lines=False)
        fit(task, config, tmp_path / str(sum_loss))
        finals.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert seen == [1, 2, 1, 2]
    assert torch.allclose(finals[0], finals[1], atol=1e-6)


def test_viz_figure5(data_dir: Path, tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    common = ["--data-dir", str(data_dir), "--progress", "false", "--runs", "1", "--epochs", "1"]
    for model in ("binary-crf", "memn2n"):
        out = tmp_path / model
        assert _cli("train", "babi", "--model", model, "--out", str(out), *common) == 0
    capsys.readouterr()
    png = tmp_path / "fig.png"
    args = ["viz", "babi", "--checkpoint", str(tmp_path / "binary-crf"), "--question", "3"]
    assert _cli(*args, "--out", str(png)) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert _cli("viz", "babi", "--checkpoint", str(tmp_path / "memn2n"), "--question", "0") == 2
    assert "MemN2N" in capsys.readouterr().err
    assert _cli(*args[:-1], "999") == 2


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model"):
        babi.BabiConfig(model="lstm").check()
    with pytest.raises(ValueError, match="runs"):
        babi.BabiConfig(runs=0).check()
    with pytest.raises(ValueError, match="query_init"):
        babi.BabiConfig(query_init="zeros").check()
    vocab = babi.BabiVocabulary(("<pad>", "<unk>", "a", "b"))
    model = babi.build_model(babi.BabiConfig(embed_dim=4, query_init="identity"), vocab)
    assert model.crf is not None and torch.equal(model.crf.query_update.weight, torch.eye(4))
    with pytest.raises(FileNotFoundError):
        babi.train(replace(babi.BabiConfig(), data_dir=str(tmp_path)), tmp_path / "out")


def test_memn2n_code_options_train_and_reload(data_dir: Path, tmp_path: Path, capsys) -> None:
    """--random-noise, --position-encoding padded and --init-std reach the model; the
    padded widths are saved with the run and the reloaded model scores the same."""
    out = tmp_path / "options"
    args = ["train", "babi", "--task", "2", "--model", "binary-crf", "--runs", "1"]
    args += ["--epochs", "2", "--data-dir", str(data_dir), "--progress", "false"]
    args += ["--random-noise", "0.1", "--position-encoding", "padded", "--init-std", "0.3"]
    assert _cli(*args, "--out", str(out)) == 0
    capsys.readouterr()
    model, _, config = babi.load_trained(out)
    assert (config.random_noise, config.position_encoding, config.init_std) == (0.1, "padded", 0.3)
    splits, _ = babi.load_data(config)
    assert model.pe_width == babi.padded_widths(splits) and model.random_noise == 0.1
    done = json.loads((out / "run_00" / "done.json").read_text())
    assert babi.score(config, out / "run_00")["test"]["ans"] == pytest.approx(done["test"]["ans"])
