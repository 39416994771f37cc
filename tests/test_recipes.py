"""The recipe platform: every registered recipe through the CLI, an example recipe added
through the public registry, run-directory rules, atomic result files, dependency checks."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from shared_data import real_data
from torch import nn

from structattn import recipes
from structattn.cli import main
from structattn.data.conllu import check_tree, parse_conllu
from structattn.recipes import GridAxis, Preset, Recipe, Reporting, Tools, runs
from structattn.recipes.config import config_from_dict, config_to_dict, replace_path
from structattn.training import Task, TrainConfig, fit, load_model_state

BABI = real_data("babi") / "en"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


# ---- the example: a complete recipe in ~60 lines -----------------------------------------------
@dataclass(frozen=True)
class ToyConfig:
    """Which of 3 inputs is largest? (a toy classification task)"""

    model: Literal["linear", "mlp"] = "linear"  # the variant
    size: int = 96  # training examples (validation and test: 48 each)
    runs: int = 2  # seeded runs (train.seed, train.seed + 1, ...); the best on validation counts
    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(epochs=4, lr=0.5, progress=False, epoch_lines=False)
    )

    def __post_init__(self) -> None:
        if self.size < 16:
            raise ValueError(f"`size` must be >= 16, got {self.size}")


def toy_data(config: ToyConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    x = torch.randn(config.size + 96, 3, generator=torch.Generator().manual_seed(0))
    y = x.argmax(-1)
    cut = [0, config.size, config.size + 48, config.size + 96]
    names = ("train", "valid", "test")
    return {s: (x[a:b], y[a:b]) for s, a, b in zip(names, cut, cut[1:], strict=False)}


def toy_model(config: ToyConfig) -> nn.Module:
    torch.manual_seed(config.train.seed)
    if config.model == "linear":
        return nn.Linear(3, 3)
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 3))


def toy_accuracy(model: nn.Module, split: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return 100.0 * float((model(split[0]).argmax(-1) == split[1]).float().mean())


def toy_train(config: ToyConfig, run_dir: Path, resume: bool) -> dict[str, Any]:
    data = toy_data(config)
    x, y = data["train"]
    task = Task(
        model=toy_model(config),
        batches=lambda epoch: [list(range(i, i + 16)) for i in range(0, len(y), 16)],
        collate=lambda index, device: (x[index], y[index]),
        loss=lambda m, b: (nn.functional.cross_entropy(m(b[0]), b[1], reduction="sum"), 16, 16),
        validate=lambda m: {"metric": toy_accuracy(m, data["valid"])},
        config={"recipe": "toy", **config_to_dict(config)},
    )
    return fit(task, config.train, run_dir, resume=resume)


def toy_load(run_dir: Path) -> tuple[nn.Module, ToyConfig]:
    state = load_model_state(run_dir)  # weights_only=True
    config = config_from_dict(ToyConfig, state["config"])
    model = toy_model(config)
    model.load_state_dict(state["model"])
    return model, config


def toy_score(config: ToyConfig, run_dir: Path) -> dict[str, Any]:
    model, _ = toy_load(run_dir)
    data = toy_data(config)
    x, y = data["test"]
    predicted = model(x).argmax(-1).tolist()
    records = [{"gold": g, "predicted": p} for g, p in zip(y.tolist(), predicted, strict=True)]
    runs.write_jsonl(run_dir / "test_predictions.jsonl", records)  # one line per example
    return {
        "valid": {"accuracy": toy_accuracy(model, data["valid"])},
        "test": {"accuracy": toy_accuracy(model, data["test"])},
    }


def toy_evaluate(run_dir: Path, options: Any, device: str, predictions: Path | None) -> str:
    model, config = toy_load(run_dir)
    scores = toy_score(config, run_dir)
    if predictions is not None:
        lines = (run_dir / "test_predictions.jsonl").read_text().splitlines()
        runs.write_jsonl(predictions, [json.loads(line) for line in lines])
    return f"test accuracy {scores['test']['accuracy']:.1f}%"


def toy_viz(checkpoint: Path, options: Any, out: Path | None) -> list[Path]:
    from structattn import viz

    model, config = toy_load(runs.resolve_run(TOY, checkpoint))
    weight = next(model.parameters()).detach()
    path = (out or checkpoint) / "weights.png"
    return [viz.attention_heatmap(weight, None, ["x0", "x1", "x2"], path, title=config.model)]


TOY_QUICK = replace_path(ToyConfig(), {"size": 32, "train.epochs": 2})
TOY = Recipe(
    name="toy",
    summary="which input is largest (the example recipe of tests/test_recipes.py)",
    config=ToyConfig,  # its `runs` field: each cell is `runs` seeded runs
    presets={
        "paper": Preset(ToyConfig(), "the full toy"),
        "cpu": Preset(ToyConfig(), "the same on a CPU"),
        "quick": Preset(TOY_QUICK, "32 examples, 2 epochs"),
    },
    grid=(GridAxis("variants", "model", ("linear", "mlp")),),
    train=toy_train,
    score=toy_score,
    evaluate=toy_evaluate,
    report=Reporting(paper={"linear": {"accuracy": 99.0}, "mlp": {"accuracy": 99.5}}),
    tools=Tools(viz=toy_viz),
)
RECIPE = TOY  # what a worker process looks up when it imports this module


def test_recipe_record_checks_its_fields() -> None:
    """The variant is the grid's last axis, a `runs` config field makes a multi-run recipe;
    a grid axis outside the config or a missing preset is refused."""
    from dataclasses import replace

    assert TOY.variant.field == "model" and TOY.multi_run and TOY.cell(TOY_QUICK) == "linear"
    assert not recipes.get("tree-transduction").multi_run
    with pytest.raises(ValueError, match="`grid` axis"):
        replace(TOY, grid=(GridAxis("widths", "width", (1, 2)),))
    with pytest.raises(ValueError, match="presets"):
        replace(TOY, presets={"paper": TOY.presets["paper"]})


@pytest.fixture
def toy() -> Any:
    recipes.register(TOY)
    yield TOY
    recipes.unregister("toy")


@pytest.fixture(autouse=True)
def _python_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The PyTorch code: no C++ build inside these tests."""
    monkeypatch.setenv("STRUCTATTN_EXTENSION", "0")


def _cli(*args: str) -> int:
    return main(["--threads", "1", *args])


def _smoke(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    """train -> refused re-train -> eval -> resume -> viz on the quick preset."""
    recipe = recipes.get(name)
    out = tmp_path / "run"
    assert _cli("train", name, "--preset", "quick", "--out", str(out), *extra) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["out"] == str(out) and summary["runs"] >= 1
    done = sorted(out.glob("**/done.json"))
    assert done and all(runs.run_state(p.parent) == "done" for p in done)
    before = {p: p.read_text() for p in out.glob("**/*.json*")}

    # an existing run is never overwritten silently
    assert _cli("train", name, "--preset", "quick", "--out", str(out), *extra) == 2
    assert "--resume" in capsys.readouterr().err
    assert {p: p.read_text() for p in out.glob("**/*.json*")} == before

    predictions = tmp_path / "predictions.jsonl"
    assert _cli("eval", name, "--checkpoint", str(out), "--predictions", str(predictions)) == 0
    assert f"predictions written to {predictions}" in capsys.readouterr().out
    lines = predictions.read_text().splitlines()
    assert lines and all(isinstance(json.loads(line), dict) for line in lines)

    # --resume keeps the finished runs as they are
    assert _cli("train", name, "--preset", "quick", "--out", str(out), "--resume", *extra) == 0
    assert json.loads(capsys.readouterr().out)["best_run"] == summary["best_run"]
    assert {p: p.read_text() for p in out.glob("**/done.json")} == {
        p: t for p, t in before.items() if p.name == "done.json"
    }

    if recipe.tools.parse is not None:
        _check_parse(name, out, tmp_path, capsys)

    if recipe.tools.viz is not None and HAS_MATPLOTLIB:
        assert _cli("viz", name, "--checkpoint", str(out), "--out", str(tmp_path / "viz")) == 0
        files = [Path(line) for line in capsys.readouterr().out.split()]
        assert files and all(f.stat().st_size > 1000 for f in files)


def _check_parse(name: str, out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``structattn parse``: one structure per input line over exactly its words."""
    sentences = [["the", "cat", "sat", "on", "the", "mat"], ["dogs", "bark"], ["yes"]]
    source = tmp_path / "sentences.txt"
    source.write_text("".join(" ".join(s) + "\n\n" for s in sentences))  # blank lines skipped
    target = tmp_path / "parsed.txt"
    assert _cli("parse", name, "--checkpoint", str(out), "--input", str(source),
                "--output", str(target)) == 0  # fmt: skip
    assert "3 sentences parsed" in capsys.readouterr().err
    text = target.read_text()
    if name == "parser":  # CoNLL-U: a tree of heads over the words
        parsed = parse_conllu(text)
        assert [list(p.words) for p in parsed] == sentences
        for p in parsed:
            assert p.heads is not None
            check_tree(p.heads, single_root=False)
    else:  # bracketed binary trees with the words in order
        trees = text.splitlines()
        assert len(trees) == 3 and all(t.count("(") == t.count(")") for t in trees)
        assert [t.replace("(", " ").replace(")", " ").split() for t in trees] == sentences
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert _cli("parse", name, "--checkpoint", str(out), "--input", str(empty)) == 2
    assert "no sentences to parse" in capsys.readouterr().err


def _extra_args(name: str) -> list[str]:
    if name == "babi":
        if not BABI.is_dir():
            pytest.skip(f"bAbI data not found at {BABI}")
        return ["--data-dir", str(BABI.resolve())]
    return []


# the real data sets each recipe's quick preset reads (tests/conftest.py skips a missing one)
RECIPE_DATA = {
    "babi": ("babi",),
    "lstmn-lm": ("ptb",),
    "lstmn-sst": ("sst", "glove"),
    "lstmn-nli": ("sick", "glove"),
    "nmt": ("small_parallel_enja",),
    "prpn": ("ptb",),
    "nli": ("sick", "glove"),
    "parser": ("ud_english_ewt", "glove"),
    "mfa-lm": ("ptb",),
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.data(*RECIPE_DATA[n])) if n in RECIPE_DATA else n
     for n in recipes.names()],
)  # fmt: skip
def test_every_recipe_train_eval_resume_viz(name: str, tmp_path: Path, capsys) -> None:
    _smoke(name, tmp_path, capsys, _extra_args(name))


def test_example_recipe_through_the_cli(toy: Recipe, tmp_path: Path, capsys) -> None:
    assert "toy" in recipes.names()
    assert _cli("list") == 0
    listed = capsys.readouterr().out
    assert "toy: which input is largest" in listed and "linear, mlp" in listed
    assert "tree-transduction" in listed and "babi" in listed and "quick" in listed
    _smoke("toy", tmp_path / "smoke", capsys, [])
    # reproduce: the grid variants x settings, our table beside the paper's
    out = tmp_path / "repro"
    assert _cli("reproduce", "toy", "--preset", "quick", "--out", str(out), "--runs", "1") == 0
    printed = capsys.readouterr().out
    assert "accuracy (paper)" in printed and "99.5" in printed
    results = json.loads((out / "results.json").read_text())
    assert [c["cell"]["model"] for c in results["cells"]] == ["linear", "mlp"]
    assert results["paper"] == {"linear": {"accuracy": 99.0}, "mlp": {"accuracy": 99.5}}
    assert (out / "table.md").read_text().startswith("|   Cell | accuracy (ours)")
    assert (out / "mlp" / "summary.json").exists() and (out / "mlp" / "run_00").is_dir()
    # again: nothing to train with --resume, refused without
    assert _cli("reproduce", "toy", "--preset", "quick", "--out", str(out), "--runs", "1") == 2
    assert _cli("reproduce", "toy", "--preset", "quick", "--out", str(out), "--resume") == 0
    assert len(list((out / "mlp").glob("run_*/done.json"))) == 2  # the second seed was added
    assert _cli("reproduce", "toy", "--out", str(out), "--variants", "linear,rnn") == 2


def test_run_directory_rules(toy: Recipe, tmp_path: Path, capsys) -> None:
    config = replace_path(TOY_QUICK, {"runs": 1})
    out = tmp_path / "cell"
    assert runs.run_state(out / "run_00") == "new"
    runs.train_cell(toy, config, out)
    assert runs.run_state(out / "run_00") == "done"
    with pytest.raises(FileExistsError, match="--resume"):
        runs.plan_runs(toy, config, out, resume=False, force=False)
    with pytest.raises(ValueError, match="not both"):
        runs.plan_runs(toy, config, out, resume=True, force=True)
    assert runs.plan_runs(toy, config, out, resume=True, force=False) == []
    # a partial run (killed after a checkpoint) resumes; a finished one is kept
    (out / "run_00" / "done.json").unlink()
    assert runs.run_state(out / "run_00") == "partial"
    (job,) = runs.plan_runs(toy, config, out, resume=True, force=False)
    assert job.resume and job.config.train.seed == 0
    # --force deletes the old run and trains it again
    marker = out / "run_00" / "metrics.jsonl"
    marker.write_text("stale\n")
    summary = runs.train_cell(toy, config, out, force=True)
    assert summary is not None and "stale" not in marker.read_text()
    assert json.loads((out / "summary.json").read_text())["best_run"] == "run_00"
    # --resume continues a run only with its own settings (more epochs are fine)
    with pytest.raises(ValueError, match="size 32 -> 48"):
        runs.plan_runs(toy, replace_path(config, {"size": 48}), out, resume=True, force=False)
    longer = replace_path(config, {"train.epochs": 5, "runs": 2})
    assert [j.run_dir.name for j in runs.plan_runs(toy, longer, out, True, False)] == ["run_01"]
    # every training flag of TrainConfig is a flag, nested flat names are kept
    assert _cli("train", "toy", "--out", str(out), "--preset", "quick", "--epochs", "1",
                "--lr", "0.1", "--force", "--runs", "1") == 0  # fmt: skip
    saved = json.loads((out / "run_00" / "config.json").read_text())
    assert saved["train"]["epochs"] == 1 and saved["train"]["lr"] == 0.1 and saved["size"] == 32
    assert _cli("train", "toy", "--out", str(out), "--size", "3") == 2
    assert "`size` must be >= 16" in capsys.readouterr().err


def test_runs_in_parallel_processes(toy: Recipe, tmp_path: Path) -> None:
    """--jobs 2: two spawned workers (the example recipe is found by importing its module)."""
    config = replace_path(TOY_QUICK, {"runs": 2})
    summary = runs.train_cell(toy, config, tmp_path / "cell", jobs=2)
    assert summary is not None and summary["runs"] == 2
    assert {r["seed"] for r in summary["run_scores"]} == {0, 1}
    best = max(summary["run_scores"], key=lambda r: r["valid"]["accuracy"])
    assert summary["valid"]["accuracy"] == best["valid"]["accuracy"]
    assert (tmp_path / "cell" / "test_predictions.jsonl").read_text() == (
        tmp_path / "cell" / summary["best_run"] / "test_predictions.jsonl"
    ).read_text()


def test_atomic_result_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = runs.write_json(tmp_path / "results.json", {"a": 1})
    runs.write_jsonl(tmp_path / "p.jsonl", [{"x": 1}, {"x": 2}])
    assert [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()] == [
        {"x": 1},
        {"x": 2},
    ]

    def crash(*args: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", crash)
    with pytest.raises(OSError, match="disk full"):
        runs.write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl", "results.json"]


@dataclass(frozen=True)
class Inner:
    seed: int = 0  # clashes with the outer seed: --inner-seed
    sizes: tuple[int, ...] = (1, 2)  # comma-separated
    pair: tuple[float, float] = (0.9, 0.99)  # exactly two
    limit: float | None = None  # "none" gives None


@dataclass(frozen=True)
class Outer:
    kind: Literal["a", "b"] = "a"
    seed: int = 1
    flag: bool = False
    inner: Inner = field(default_factory=Inner)


def test_config_flags_and_dicts() -> None:
    import argparse

    from structattn.recipes.config import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, Outer)
    args = parser.parse_args(
        ["--kind", "b", "--inner-seed", "5", "--sizes", "3,4,5", "--limit", "0.5", "--flag", "yes"]
    )
    config = config_from_args(Outer, args)
    assert config == Outer("b", 1, True, Inner(5, (3, 4, 5), (0.9, 0.99), 0.5))
    args = parser.parse_args(["--limit", "none", "--pair", "0.1,0.2"])
    assert config_from_args(Outer, args, base=config).inner.limit is None
    for bad in (["--kind", "c"], ["--pair", "1,2,3"], ["--flag", "maybe"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    assert config_from_dict(Outer, json.loads(json.dumps(config_to_dict(config)))) == config
    # configs saved before TrainConfig was nested (flat epochs, lr, seed) still load
    from structattn.recipes.tree_transduction import TreeTransductionConfig

    old = {"attention": "simple", "epochs": 5, "lr": 0.5, "seed": 3, "dim": 8}
    loaded = config_from_dict(TreeTransductionConfig, old)
    assert (loaded.attention, loaded.dim, loaded.train.epochs, loaded.train.seed) == (
        "simple",
        8,
        5,
        3,
    )
    assert loaded.train.decay_start == 9  # the rest: the paper's


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--quick"],
        ["viz", "tree-transduction", "--checkpoint", "nowhere"],
        ["viz", "babi", "--checkpoint", "nowhere"],
    ],
)
def test_missing_plot_package_stops_first(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Without matplotlib, commands that plot stop at once with one line naming the extra."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.chdir(tmp_path)
    assert _cli(*argv, "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and 'pip install "structattn[recipes]"' in err[0] and "matplotlib" in err[0]
    )
    assert not (tmp_path / "out").exists()


def test_demo_without_matplotlib_fails_at_once(tmp_path: Path) -> None:
    """A fresh interpreter where matplotlib cannot be imported (as after a bare
    ``pip install structattn``): ``structattn demo`` stops before generating any data."""
    import subprocess
    import time

    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from structattn.cli import main\n"
        f"sys.exit(main(['demo', '--out', {str(tmp_path / 'demo')!r}]))\n"
    )
    started = time.time()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "structattn: error: `structattn demo` needs matplotlib, which is not installed: "
        'pip install "structattn[recipes]"'
    )
    assert time.time() - started < 60 and not (tmp_path / "demo").exists()


def test_train_without_tqdm_runs_with_a_notice(
    toy: Recipe, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    args = ["train", "toy", "--preset", "quick", "--runs", "1", "--progress", "true"]
    assert _cli(*args, "--out", str(tmp_path / "toy")) == 0
    err = capsys.readouterr().err
    assert 'no progress bars without tqdm (pip install "structattn[recipes]")' in err


def test_shared_selection_and_seed_summary() -> None:
    """One selection rule for the classification recipes: accuracy first, the NLL breaks
    ties without ever outweighing an accuracy step; seeds summarised as mean / sample std."""
    from structattn.metrics import seed_spread
    from structattn.recipes.tables import (
        accuracy_metric,
        mean_std_text,
        seed_summary,
        valid_accuracy,
    )

    assert accuracy_metric(0.51, 99.0) > accuracy_metric(0.50, 0.0)
    assert accuracy_metric(0.5, 0.1) > accuracy_metric(0.5, 0.2)
    assert valid_accuracy({"valid": {"accuracy": 70.0, "loss": 0.5}}, scale=0.01) == pytest.approx(
        0.7 - 5e-7
    )
    assert valid_accuracy({"valid": None}) == -math.inf
    spread = seed_spread([1, 2, 3])
    assert spread == {"mean": 2.0, "std": 1.0, "runs": [1.0, 2.0, 3.0]}
    assert seed_spread([4])["std"] == 0.0
    with pytest.raises(ValueError):
        seed_spread([])
    records = [{"test": {"accuracy": a}, "valid": {"accuracy": a}} for a in (80.0, 70.0)]
    summary = seed_summary(records)
    assert summary["test"] == {"accuracy": 80.0} and summary["coverage"] is None  # best first
    assert mean_std_text(summary) == "75.0 +- 7.1 (n=2)"


@pytest.mark.data("ptb", "wikitext-2")
def test_reproduce_also_makes_the_other_tables(tmp_path: Path, capsys) -> None:
    for name in recipes.names():  # every companion is a registered recipe
        assert all(other in recipes.names() for other in recipes.get(name).report.reproduce_also)
    out = tmp_path / "mfa"
    args = ("reproduce", "mfa", "--preset", "quick", "--out", str(out), "--tasks", "sorting",
            "--models", "lstm")  # fmt: skip
    assert _cli(*args) == 0
    printed = capsys.readouterr().out
    assert "== mfa-lm:" in printed and "wikitext-2" in printed  # Tables 2-3 after Table 1
    cells = json.loads((out / "mfa-lm" / "results.json").read_text())["cells"]
    assert {(c["cell"]["corpus"], c["cell"]["model"]) for c in cells} == {
        (corpus, model) for corpus in ("ptb", "wikitext-2") for model in ("rnn", "lstm", "mfa")
    }
    assert _cli(*args, "--resume", "--skip-also") == 0
    assert "== mfa-lm:" not in capsys.readouterr().out


def test_load_vocabulary_run_refuses_another_recipes_run(toy: Recipe, tmp_path: Path) -> None:
    from structattn.recipes.lstmn_sst import LSTMNSSTConfig, build_model
    from structattn.recipes.runs import load_vocabulary_run

    runs.train_cell(toy, replace_path(TOY_QUICK, {"runs": 1}), tmp_path / "cell")
    with pytest.raises(ValueError, match="is not an lstmn-sst run"):
        load_vocabulary_run(tmp_path / "cell" / "run_00", "cpu", "lstmn-sst", LSTMNSSTConfig,
                            build_model)  # fmt: skip


def test_resume_after_a_kill_during_the_first_config_write(toy: Recipe, tmp_path: Path) -> None:
    """An empty config.json and no checkpoint (a kill or a full disk during a run's first
    write) made every later ``--resume`` fail with a JSON error (issue 37.3.4): the run now
    starts afresh with a notice."""
    config = replace_path(TOY_QUICK, {"runs": 1})
    out = tmp_path / "cell"
    run = out / "run_00"
    run.mkdir(parents=True)
    (run / "config.json").write_text("")
    assert runs.run_state(run) != "done"
    runs.train_cell(toy, config, out, resume=True)
    assert runs.run_state(run) == "done"
    assert json.loads((run / "config.json").read_text())["recipe"] == "toy"
