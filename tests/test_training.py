"""The shared training loop (structattn.training) on toy tasks: a tiny classifier and a tiny
LSTM language model trained with truncated BPTT, on synthetic data."""

from __future__ import annotations

import json
import os
import shutil
import socket
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structattn.training import (
    CheckpointError,
    LRSchedule,
    PlateauSchedule,
    Task,
    TrainConfig,
    fit,
    load_checkpoint,
    load_model_state,
    make_optimizer,
    save_checkpoint,
)

QUIET = {"progress": False, "epoch_lines": False, "log_every": 1}


# ---- toy tasks ---------------------------------------------------------------------------
def _classifier_data() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 5, generator=g)
    y = (x @ torch.randn(5, 3, generator=g)).argmax(-1)
    return x[:24], y[:24], x[24:], y[24:]


class _Classifier(nn.Module):
    def __init__(self, dropout: float = 0.2) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def classifier_task(
    metrics: list[float] | None = None,
    dropout: float = 0.2,
    crash_at: int | None = None,
    validate: bool = True,
) -> Task:
    """24 examples in 4 shuffled batches of 6; ``metrics``: a scripted validation metric
    sequence instead of the real one; ``crash_at``: KeyboardInterrupt at that training step."""
    x, y, vx, vy = _classifier_data()
    torch.manual_seed(0)
    model = _Classifier(dropout)
    calls = {"train": 0, "valid": 0}

    def batches(epoch: int) -> list[list[int]]:
        order = torch.randperm(24, generator=torch.Generator().manual_seed(epoch)).tolist()
        return [order[i : i + 6] for i in range(0, 24, 6)]

    def loss(m: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, int, int]:
        calls["train"] += 1
        if calls["train"] == crash_at:
            raise KeyboardInterrupt
        inputs, labels = batch
        return F.cross_entropy(m(inputs), labels, reduction="sum"), len(labels), 2 * len(labels)

    def valid(m: nn.Module) -> dict[str, float]:
        calls["valid"] += 1
        if metrics is not None:
            return {"metric": metrics[calls["valid"] - 1]}
        value = float(F.cross_entropy(m(vx), vy))
        return {"metric": -value, "loss": value}

    task = Task(
        model=model,
        batches=batches,
        collate=lambda idx, device: (x[idx].to(device), y[idx].to(device)),
        loss=loss,
        validate=valid if validate else None,
        config={"toy": "classifier"},
        extra={"vocab": ["a", "b"]},
    )
    task.calls = calls  # type: ignore[attr-defined]
    return task


class _LanguageModel(nn.Module):
    def __init__(self, vocab: int = 7, dim: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens: Tensor, state: Any) -> tuple[Tensor, Any]:
        hidden, state = self.lstm(self.drop(self.embed(tokens)), state)  # [B, T, D]
        return self.out(self.drop(hidden)), state


ROWS, BPTT, SEGMENTS = 4, 3, 5  # 4 streams of 15 (+1) tokens: 5 batches of 3 steps per epoch


def lm_task(
    dropout: float = 0.1,
    crash_at: int | None = None,
    carry: bool = True,
    seen: list[Any] | None = None,
) -> Task:
    """Truncated BPTT over 4 parallel token streams; the LSTM state goes from batch to batch."""
    g = torch.Generator().manual_seed(2)
    stream = torch.randint(0, 7, (ROWS, BPTT * SEGMENTS + 1), generator=g)  # [B, L + 1]
    torch.manual_seed(0)
    model = _LanguageModel(dropout=dropout)
    calls = {"train": 0}

    def batches(epoch: int) -> list[list[tuple[int, int]]]:
        return [[(row, k) for row in range(ROWS)] for k in range(SEGMENTS)]

    def collate(examples: list[tuple[int, int]], device: torch.device) -> tuple[Tensor, Tensor]:
        rows, start = [r for r, _ in examples], examples[0][1] * BPTT
        window = stream[rows, start : start + BPTT + 1].to(device)  # [b, T + 1]
        return window[:, :-1], window[:, 1:]

    def stateful_loss(
        m: nn.Module, batch: tuple[Tensor, Tensor], state: Any
    ) -> tuple[Tensor, int, int, Any]:
        calls["train"] += 1
        if calls["train"] == crash_at:
            raise KeyboardInterrupt
        if seen is not None:
            seen.append(state)
        inputs, targets = batch
        logits, new_state = m(inputs, state if carry else None)  # [b, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        return loss, inputs.shape[0], inputs.numel(), new_state

    def validate(m: nn.Module) -> dict[str, float]:
        logits, _ = m(stream[:, :-1], None)
        ppl = float(F.cross_entropy(logits.flatten(0, 1), stream[:, 1:].flatten()).exp())
        return {"metric": -ppl, "perplexity": ppl}

    task = Task(
        model=model,
        batches=batches,
        collate=collate,
        stateful_loss=stateful_loss,
        validate=validate,
        config={"toy": "lm"},
    )
    task.calls = calls  # type: ignore[attr-defined]
    return task


LM_CONFIG = TrainConfig(epochs=2, lr=1.0, max_grad_norm=5.0, normalize_by="tokens", **QUIET)


def _weights(run_dir: Path, which: str = "checkpoint.pt") -> dict[str, Tensor]:
    return load_checkpoint(run_dir / which)["model"]


def _records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _assert_same_weights(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ---- configuration -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lr": 0.0}, "`lr` must be a positive"),
        ({"epochs": -1}, "`epochs`"),
        ({"decay_factor": 1.5}, "`decay_factor`"),
        ({"max_grad_norm": 0.0}, "`max_grad_norm`"),
        ({"eval_every": 0}, "`eval_every`"),
        ({"patience": 0}, "`patience`"),
        ({"optimizer": "rmsprop"}, "`optimizer` must be one of"),
        ({"lr_schedule": "cosine"}, "`lr_schedule` must be one of"),
        ({"normalize_by": "words"}, "`normalize_by` must be one of"),
        ({"momentum": 0.9, "optimizer": "adam"}, 'only applies with optimizer="sgd"'),
        ({"betas": (0.8, 0.9)}, 'only applies with optimizer="adam"'),
        ({"betas": (0.9, 1.0), "optimizer": "adam"}, "`betas`"),
        ({"eps": 1e-6}, 'optimizer="adam" or "adagrad"'),
        ({"initial_accumulator_value": 0.1}, 'optimizer="adagrad"'),
        ({"lr_schedule": "plateau", "decay_start": 2}, 'only applies with lr_schedule="step"'),
        ({"plateau_patience": 1}, 'only applies with lr_schedule="plateau"'),
        ({"lr_schedule": "plateau", "plateau_threshold": -1.0}, "`plateau_threshold`"),
        ({"min_lr": 2.0}, "`min_lr`"),
        ({"sum_loss": True, "normalize_by": "tokens"}, "sum_loss"),
    ],
)
def test_config_rejects_bad_values(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{"epochs": 1, "lr": 1.0, **changes})


def test_config_defaults_are_plain_sgd_with_the_step_schedule() -> None:
    config = TrainConfig(epochs=1, lr=0.5)
    assert (config.optimizer, config.lr_schedule, config.loss_normalizer) == (
        "sgd",
        "step",
        "examples",
    )
    assert replace(config, sum_loss=True).loss_normalizer == "none"
    assert replace(config, sum_loss=True, normalize_by="none").loss_normalizer == "none"
    optimizer = make_optimizer(nn.Linear(2, 2).parameters(), config)
    reference = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.5)
    assert type(optimizer) is torch.optim.SGD
    assert optimizer.state_dict()["param_groups"] == reference.state_dict()["param_groups"]


def test_optimizer_factory_settings() -> None:
    params = list(nn.Linear(2, 2).parameters())
    adagrad = make_optimizer(
        params, TrainConfig(1, 0.05, optimizer="adagrad", initial_accumulator_value=0.1)
    )
    assert isinstance(adagrad, torch.optim.Adagrad)
    assert adagrad.param_groups[0]["initial_accumulator_value"] == 0.1
    assert torch.equal(adagrad.state[params[0]]["sum"], torch.full((2, 2), 0.1))
    adam = make_optimizer(
        params, TrainConfig(1, 1e-3, optimizer="adam", betas=(0.8, 0.99), eps=1e-6)
    )
    assert isinstance(adam, torch.optim.Adam)
    assert adam.param_groups[0]["betas"] == (0.8, 0.99) and adam.param_groups[0]["eps"] == 1e-6
    sgd = make_optimizer(params, TrainConfig(1, 0.1, momentum=0.9, weight_decay=1e-4))
    assert sgd.param_groups[0]["momentum"] == 0.9
    assert sgd.param_groups[0]["weight_decay"] == 1e-4


def test_task_needs_exactly_one_loss() -> None:
    model = nn.Linear(1, 1)
    with pytest.raises(ValueError, match="exactly one"):
        Task(model, lambda e: [], lambda x, d: x)
    with pytest.raises(ValueError, match="exactly one"):
        Task(model, lambda e: [], lambda x, d: x, loss=lambda m, b: b, stateful_loss=lambda *a: a)


def test_fit_needs_validation_for_plateau_eval_every_and_patience(tmp_path: Path) -> None:
    for changes in ({"lr_schedule": "plateau"}, {"eval_every": 2}, {"patience": 2}):
        config = TrainConfig(epochs=1, lr=0.1, **QUIET, **changes)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="needs a validation metric"):
            fit(classifier_task(validate=False), config, tmp_path / "run")


# ---- schedules ---------------------------------------------------------------------------
def test_step_schedule_follows_the_papers() -> None:
    schedule = LRSchedule(TrainConfig(epochs=13, lr=1.0, decay_start=9, decay_on_plateau=True))
    lrs = [schedule.step(e, metric=float(e)) for e in range(1, 14)]  # always improving
    assert lrs[:8] == [1.0] * 8 and lrs[8] == 0.5 and lrs[12] == 1 / 32
    schedule = LRSchedule(TrainConfig(epochs=13, lr=1.0, decay_start=9, decay_on_plateau=True))
    lrs = [schedule.step(e, metric=m) for e, m in enumerate([1, 2, 3, 2, 5], start=1)]
    assert lrs == [1.0, 1.0, 1.0, 0.5, 0.25]  # plateau at epoch 4 starts the decay
    schedule = LRSchedule(TrainConfig(epochs=100, lr=0.01, decay_every=25))
    lrs = [schedule.step(e, None) for e in range(1, 101)]
    assert lrs[23] == 0.01 and lrs[24] == 0.005 and lrs[99] == 0.01 / 16


def test_per_epoch_decay_and_min_lr() -> None:
    config = TrainConfig(epochs=5, lr=1.0, decay_start=1, decay_factor=0.85, min_lr=0.7)
    schedule = LRSchedule(config)
    lrs = [schedule.step(e, None) for e in range(1, 5)]
    assert lrs == [0.85, pytest.approx(0.7225), 0.7, 0.7]


def _plateau(**changes: Any) -> PlateauSchedule:
    return PlateauSchedule(TrainConfig(epochs=9, lr=1.0, lr_schedule="plateau", **changes))


def test_plateau_schedule_decays_each_epoch_without_improvement() -> None:
    schedule = _plateau()  # best-so-far, no threshold: halve at each non-improving epoch
    lrs = [schedule.step(e, m) for e, m in enumerate([1, 2, 2, 3, 1, 4], start=1)]
    assert lrs == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    schedule = _plateau(decay_factor=0.85, plateau_reference="previous")  # LSTMN / OpenNMT
    lrs = [schedule.step(e, m) for e, m in enumerate([1, 3, 2, 2.5, 4], start=1)]
    assert lrs == [1.0, 1.0, 0.85, 0.85, 0.85]  # 2.5 beats the previous 2 (not the best 3)
    schedule = _plateau(plateau_patience=1)  # decay after the second bad epoch in a row
    lrs = [schedule.step(e, m) for e, m in enumerate([1, 0, 0, 0, 0], start=1)]
    assert lrs == [1.0, 1.0, 0.5, 0.5, 0.25]
    with pytest.raises(ValueError, match="needs a validation metric"):
        schedule.step(6, None)


def test_plateau_schedule_threshold_means_significant_improvement() -> None:
    schedule = _plateau(plateau_threshold=0.5)  # absolute
    lrs = [schedule.step(e, m) for e, m in enumerate([1.0, 1.4, 1.6, 2.0], start=1)]
    assert lrs == [1.0, 0.5, 1.0 * 0.5, 0.25]  # 1.4 and 2.0 are within 0.5 of the best
    assert schedule.reference == 1.6
    schedule = _plateau(plateau_threshold=0.1, plateau_threshold_mode="rel")
    lrs = [schedule.step(e, m) for e, m in enumerate([-100.0, -95.0, -85.0], start=1)]
    assert lrs == [1.0, 0.5, 0.5]  # -95 is within 10% of -100; -85 beats -90
    restored = _plateau(plateau_threshold=0.1, plateau_threshold_mode="rel")
    restored.load_state_dict(schedule.state_dict())
    assert restored.step(4, -85.0) == schedule.step(4, -85.0) == 0.25


def test_fit_applies_the_plateau_schedule(tmp_path: Path) -> None:
    task = classifier_task(metrics=[1.0, 2.0, 1.0, 0.5])
    config = TrainConfig(epochs=4, lr=0.1, lr_schedule="plateau", **QUIET)
    fit(task, config, tmp_path / "run")
    assert [r["lr"] for r in _records(tmp_path / "run", "epoch")] == [0.1, 0.1, 0.1, 0.05]
    train_lrs = {r["epoch"]: r["lr"] for r in _records(tmp_path / "run", "train")}
    assert train_lrs == {1: 0.1, 2: 0.1, 3: 0.1, 4: 0.05}
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt")["schedule"]["lr"] == 0.025


# ---- the optimisation step ---------------------------------------------------------------
def _by_hand(
    config: TrainConfig, scale: Callable[[Tensor, int], Tensor], epochs: int
) -> dict[str, Tensor]:
    """The loop written out: forward, scaled loss, backward, clipping, optimiser step."""
    task = classifier_task(validate=False)
    optimizer = make_optimizer(task.model.parameters(), config)
    for epoch in range(1, epochs + 1):
        for idx in task.batches(epoch):
            loss_sum, n, _ = task.loss(task.model, task.collate(idx, torch.device("cpu")))
            optimizer.zero_grad(set_to_none=True)
            scale(loss_sum, n).backward()
            if config.max_grad_norm is not None:
                nn.utils.clip_grad_norm_(task.model.parameters(), config.max_grad_norm)
            optimizer.step()
    return task.model.state_dict()


@pytest.mark.parametrize(
    ("changes", "scale"),
    [
        ({}, lambda loss, n: loss * (1 / n)),  # the default: mean over the batch's examples
        ({"sum_loss": True}, lambda loss, n: loss * 1),  # MemN2N
        ({"normalize_by": "none"}, lambda loss, n: loss * 1),
        ({"normalize_by": "tokens"}, lambda loss, n: loss * (1 / (2 * n))),  # 2 tokens each
        ({"optimizer": "adam", "betas": (0.8, 0.9)}, lambda loss, n: loss * (1 / n)),
        ({"optimizer": "adagrad", "initial_accumulator_value": 0.1}, lambda l, n: l * (1 / n)),
        ({"momentum": 0.9, "weight_decay": 0.01}, lambda loss, n: loss * (1 / n)),
    ],
)
def test_fit_is_the_written_out_loop(
    tmp_path: Path, changes: dict[str, Any], scale: Callable[[Tensor, int], Tensor]
) -> None:
    """Bit for bit: the default is today's plain SGD on the mean loss, clipped."""
    config = TrainConfig(epochs=2, lr=0.1, max_grad_norm=0.5, **QUIET, **changes)
    fit(classifier_task(validate=False), config, tmp_path / "run")
    _assert_same_weights(_weights(tmp_path / "run", "model.pt"), _by_hand(config, scale, 2))


def test_loss_is_logged_per_example_or_per_token(tmp_path: Path) -> None:
    for normalize_by in ("examples", "tokens"):
        config = TrainConfig(epochs=1, lr=0.1, normalize_by=normalize_by, **QUIET)
        fit(classifier_task(validate=False, dropout=0.0), config, tmp_path / normalize_by)
    per_example = [r["loss"] for r in _records(tmp_path / "examples", "train")]
    per_token = [r["loss"] for r in _records(tmp_path / "tokens", "train")]
    assert per_token[0] == pytest.approx(per_example[0] / 2)  # same first batch and weights


def test_fit_rejects_a_non_finite_loss(tmp_path: Path) -> None:
    task = classifier_task(validate=False)
    task.loss = lambda m, b: (torch.tensor(float("nan"), requires_grad=True), 6, 6)
    with pytest.raises(FloatingPointError, match="nan"):
        fit(task, TrainConfig(epochs=1, lr=0.1, **QUIET), tmp_path / "run")


def test_epoch_hook_runs_before_each_epoch_also_after_resume(tmp_path: Path) -> None:
    seen: list[int] = []
    task = classifier_task()
    task.on_epoch_start = lambda model, epoch: seen.append(epoch)
    fit(task, TrainConfig(epochs=2, lr=0.1, **QUIET), tmp_path / "run")
    task = classifier_task()
    task.on_epoch_start = lambda model, epoch: seen.append(epoch)
    fit(task, TrainConfig(epochs=3, lr=0.1, **QUIET), tmp_path / "run", resume=True)
    assert seen == [1, 2, 3]


def test_epoch_lr_and_task_state_survive_a_resume(tmp_path: Path) -> None:
    """``epoch_lr`` sets each epoch's lr (logged); ``state`` is checkpointed and restored."""

    def task_with_state() -> tuple[Task, dict[str, Any]]:
        task = classifier_task()
        kept: dict[str, Any] = {"seen": []}
        task.on_epoch_start = lambda model, epoch: kept["seen"].append(epoch)
        task.epoch_lr = lambda epoch, lr: 0.01 if epoch == 2 else lr
        task.state = (lambda: {"seen": list(kept["seen"])}, lambda s: kept.update(s or {}))
        return task, kept

    config = TrainConfig(epochs=3, lr=0.1, decay_every=1, **QUIET)
    task, kept = task_with_state()
    fit(task, config, tmp_path / "full")
    assert kept["seen"] == [1, 2, 3]
    assert [r["lr"] for r in _records(tmp_path / "full", "epoch")] == pytest.approx(
        [0.1, 0.01, 0.025]  # the schedule still halves each epoch under the override
    )
    task, kept = task_with_state()
    fit(task, replace(config, epochs=2), tmp_path / "split")
    task, kept = task_with_state()
    fit(task, config, tmp_path / "split", resume=True)
    assert kept["seen"] == [1, 2, 3]  # restored from the checkpoint, then epoch 3
    assert load_checkpoint(tmp_path / "split" / "checkpoint.pt")["task_state"] == {
        "seen": [1, 2, 3]
    }
    _assert_same_weights(_weights(tmp_path / "full"), _weights(tmp_path / "split"))


# ---- checkpoints and resumption ----------------------------------------------------------
RESUME_CONFIG = TrainConfig(
    epochs=3,
    lr=0.05,
    max_grad_norm=1.0,
    optimizer="adam",
    lr_schedule="plateau",
    plateau_threshold=0.01,
    **QUIET,
)


def test_resume_is_bit_for_bit(tmp_path: Path) -> None:
    """3 epochs in one go == 1 epoch, then resumed to 3 (dropout, Adam, plateau schedule)."""
    fit(classifier_task(), RESUME_CONFIG, tmp_path / "full")
    fit(classifier_task(), replace(RESUME_CONFIG, epochs=1), tmp_path / "split")
    fit(classifier_task(), RESUME_CONFIG, tmp_path / "split", resume=True)
    for which in ("checkpoint.pt", "model.pt"):
        _assert_same_weights(
            _weights(tmp_path / "full", which), _weights(tmp_path / "split", which)
        )
    full, split = (load_checkpoint(tmp_path / d / "checkpoint.pt") for d in ("full", "split"))
    assert full["schedule"] == split["schedule"] and full["best"] == split["best"]
    assert torch.equal(
        full["optimizer"]["state"][0]["exp_avg_sq"], split["optimizer"]["state"][0]["exp_avg_sq"]
    )
    for kind in ("train", "epoch"):
        a, b = _records(tmp_path / "full", kind), _records(tmp_path / "split", kind)
        assert [r.get("loss", r.get("train_loss")) for r in a] == [
            r.get("loss", r.get("train_loss")) for r in b
        ]


def test_resume_after_a_crash_mid_epoch(tmp_path: Path) -> None:
    """Killed between checkpoints, a run resumes from the last one, bit for bit."""
    config = replace(RESUME_CONFIG, epochs=2, checkpoint_every=3)  # 4 steps per epoch
    fit(classifier_task(), config, tmp_path / "full")
    with pytest.raises(KeyboardInterrupt):  # killed during step 8; last checkpoint: step 6
        fit(classifier_task(crash_at=8), config, tmp_path / "crash")
    state = load_checkpoint(tmp_path / "crash" / "checkpoint.pt")
    assert (state["epoch"], state["batch"], state["step"]) == (2, 2, 6)
    assert len(_records(tmp_path / "crash", "train")) == 7  # step 7 was logged before
    fit(classifier_task(), config, tmp_path / "crash", resume=True)
    _assert_same_weights(_weights(tmp_path / "full"), _weights(tmp_path / "crash"))
    for kind, key in (("train", "loss"), ("epoch", "train_loss")):  # the epoch's mean too
        a, b = ([r[key] for r in _records(tmp_path / d, kind)] for d in ("full", "crash"))
        assert a == b and len(a) == {"train": 8, "epoch": 2}[kind]


def test_checkpoint_contents_and_weights_only_loading(tmp_path: Path) -> None:
    fit(classifier_task(), replace(RESUME_CONFIG, epochs=1), tmp_path / "run")
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert state["format"] == "structattn-checkpoint-v1"
    assert {"model", "optimizer", "optimizer_name", "schedule", "rng", "epoch", "batch"} <= set(
        state
    )
    assert {"step", "best", "bad_evals", "last_eval", "stopped", "carry", "epoch_loss"} <= set(
        state
    )
    assert (state["epoch"], state["batch"], state["step"]) == (2, 0, 4)
    assert state["optimizer_name"] == "adam" and state["schedule"]["kind"] == "plateau"
    assert state["config"] == {"toy": "classifier"} and state["extra"] == {"vocab": ["a", "b"]}
    model = load_model_state(tmp_path / "run")  # the best model, for eval/viz
    assert model["epoch"] == 1 and set(model["valid"]) == {"metric", "loss"}
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"toy": "classifier"}
    with pytest.raises(CheckpointError, match="optimizer='adam'; cannot resume with 'sgd'"):
        fit(classifier_task(), TrainConfig(epochs=2, lr=0.1, **QUIET), tmp_path / "run", True)


def test_resume_from_a_checkpoint_without_the_new_fields(tmp_path: Path) -> None:
    """Checkpoints written before optimizers, schedules, TBPTT and early stopping existed."""
    config = TrainConfig(epochs=2, lr=0.1, decay_start=1, **QUIET)
    fit(classifier_task(), config, tmp_path / "full")
    fit(classifier_task(), replace(config, epochs=1), tmp_path / "old")
    state = load_checkpoint(tmp_path / "old" / "checkpoint.pt")
    for key in ("optimizer_name", "bad_evals", "last_eval", "stopped", "carry", "epoch_loss"):
        del state[key]
    del state["schedule"]["kind"]
    save_checkpoint(tmp_path / "old" / "checkpoint.pt", state)
    fit(classifier_task(), config, tmp_path / "old", resume=True)
    _assert_same_weights(_weights(tmp_path / "full"), _weights(tmp_path / "old"))


def test_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match="is a directory"):
        load_checkpoint(tmp_path)
    (tmp_path / "corrupt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(tmp_path / "corrupt.pt")
    torch.save({"x": 1}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a structattn checkpoint"):
        load_checkpoint(tmp_path / "foreign.pt")
    save_checkpoint(tmp_path / "other" / "checkpoint.pt", {"format": "someone-else"})
    with pytest.raises(CheckpointError, match="unknown format"):
        fit(classifier_task(), TrainConfig(1, 0.1, **QUIET), tmp_path / "other", resume=True)


def test_checkpoint_refuses_code_execution(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):  # pragma: no cover - must never run
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    torch.save({"format": "x", "payload": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "evil.pt")
    assert not (tmp_path / "pwned").exists()


def test_atomic_save_keeps_old_file_on_failure(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    save_checkpoint(path, {"format": "structattn-checkpoint-v1", "value": 1})

    class Unsaveable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        save_checkpoint(path, {"format": "structattn-checkpoint-v1", "value": Unsaveable()})
    assert load_checkpoint(path)["value"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]  # no temp files left


# ---- the training state and a killed run's files -----------------------------------------
#: the keys of a checkpoint as the loop wrote them before TrainState (6f3ca50)
TODAYS_KEYS = {
    "format", "model", "optimizer", "optimizer_name", "schedule", "rng", "epoch", "batch",
    "step", "best", "bad_evals", "last_eval", "stopped", "carry", "epoch_loss", "task_state",
    "config", "extra",
}  # fmt: skip


def test_train_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    """Every progress field of TrainState is saved under its name and read back (through a
    file, with weights_only=True); a checkpoint holds today's keys plus ``metric_lines``."""
    from dataclasses import fields

    from structattn.training import TrainState

    config = TrainConfig(epochs=2, lr=0.1, **QUIET)
    state = TrainState.start(nn.Linear(2, 2), config)
    state.epoch, state.batch, state.step, state.best = 2, 3, 7, {"epoch": 1, "metric": 0.5}
    state.bad_evals, state.stopped, state.metric_lines = 1, {"epoch": 2, "step": 7}, 9
    state.last_eval, state.epoch_loss = {"step": 6, "metrics": {"metric": 0.4}}, (1.5, 12)
    carried = [(torch.ones(1, 2, 3), torch.zeros(1, 2, 3))]
    save_checkpoint(tmp_path / "state.pt", state.to_checkpoint(carried))
    saved = torch.load(tmp_path / "state.pt", weights_only=True)
    assert set(saved) == TODAYS_KEYS - {"task_state", "config", "extra"} | {"metric_lines"}
    restored = TrainState.from_checkpoint(saved, nn.Linear(2, 2), config)
    for f in fields(TrainState):
        if f.name not in ("model", "optimizer", "schedule", "carry"):
            assert getattr(restored, f.name) == getattr(state, f.name), f.name
    _assert_same_weights(restored.model.state_dict(), state.model.state_dict())
    assert torch.equal(restored.carry[0], carried[0][0])
    with pytest.raises(CheckpointError, match="has no 'step'"):
        without_step = {key: value for key, value in saved.items() if key != "step"}
        TrainState.from_checkpoint(without_step, nn.Linear(2, 2), config)


def test_resume_from_a_checkpoint_in_todays_format(tmp_path: Path) -> None:
    """A checkpoint written before TrainState (no ``metric_lines``: its metric lines are cut
    by step) still resumes mid-epoch, bit for bit, with the same metrics log."""
    config = replace(RESUME_CONFIG, epochs=2, checkpoint_every=3)
    fit(classifier_task(), config, tmp_path / "full")
    with pytest.raises(KeyboardInterrupt):  # killed during step 8; last checkpoint: step 6
        fit(classifier_task(crash_at=8), config, tmp_path / "old")
    state = load_checkpoint(tmp_path / "old" / "checkpoint.pt")
    assert set(state) == TODAYS_KEYS | {"metric_lines"}
    old = {key: state[key] for key in TODAYS_KEYS}
    old["epoch_loss"] = list(old["epoch_loss"])  # as the old loop wrote it
    save_checkpoint(tmp_path / "old" / "checkpoint.pt", old)
    fit(classifier_task(), config, tmp_path / "old", resume=True)
    _assert_same_weights(_weights(tmp_path / "full"), _weights(tmp_path / "old"))
    for kind, key in (("train", "loss"), ("epoch", "train_loss")):
        a, b = ([r[key] for r in _records(tmp_path / d, kind)] for d in ("full", "old"))
        assert a == b and len(a) == {"train": 8, "epoch": 2}[kind]


def _die_writing(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Every open for writing of a file whose name holds ``name`` dies at its first write,
    as a kill -9 there would: the file is created (or emptied), nothing is written."""
    import builtins
    import io

    real_open = io.open

    class Dying:
        def __init__(self, handle: Any) -> None:
            self.handle = handle

        def __enter__(self) -> Dying:
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.close()

        def write(self, text: str) -> int:
            raise KeyboardInterrupt

    def dying_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(file, mode, *args, **kwargs)
        if not isinstance(file, int) and name in str(file) and set(mode) & {"w", "x"}:
            return Dying(handle)
        return handle

    monkeypatch.setattr(io, "open", dying_open)
    monkeypatch.setattr(builtins, "open", dying_open)


def test_a_kill_while_writing_config_json_leaves_no_empty_one(tmp_path: Path) -> None:
    """config.json is written by rename: a kill (or a full disk) during its first write
    leaves none, not an empty one that a --resume cannot read (#37)."""
    with pytest.MonkeyPatch.context() as patch:
        _die_writing(patch, "config.json")
        with pytest.raises(KeyboardInterrupt):
            fit(classifier_task(), TrainConfig(epochs=1, lr=0.1, **QUIET), tmp_path / "run")
    assert not (tmp_path / "run" / "config.json").exists()
    assert not [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".")]


def test_a_kill_while_resume_cuts_the_metrics_log_keeps_it(tmp_path: Path) -> None:
    """A resume rewrites metrics.jsonl without the lines after its checkpoint; a kill during
    that rewrite leaves the whole file (it left it empty), and the next resume finishes the
    run with the full run's log (#37)."""
    config = replace(RESUME_CONFIG, epochs=2, checkpoint_every=3)
    fit(classifier_task(), config, tmp_path / "full")
    with pytest.raises(KeyboardInterrupt):  # killed during step 8; last checkpoint: step 6
        fit(classifier_task(crash_at=8), config, tmp_path / "crash")
    before = (tmp_path / "crash" / "metrics.jsonl").read_text()
    assert before.count("\n") == 8  # 7 steps and epoch 1
    with pytest.MonkeyPatch.context() as patch:
        _die_writing(patch, "metrics.jsonl")
        with pytest.raises(KeyboardInterrupt):
            fit(classifier_task(), config, tmp_path / "crash", resume=True)
    assert (tmp_path / "crash" / "metrics.jsonl").read_text() == before
    fit(classifier_task(), config, tmp_path / "crash", resume=True)
    _assert_same_weights(_weights(tmp_path / "full"), _weights(tmp_path / "crash"))
    for kind, key in (("train", "loss"), ("epoch", "train_loss")):
        a, b = ([r[key] for r in _records(tmp_path / d, kind)] for d in ("full", "crash"))
        assert a == b and len(a) == {"train": 8, "epoch": 2}[kind]


def test_a_kill_after_a_checkpoint_at_an_epochs_last_step_logs_the_epoch_once(
    tmp_path: Path,
) -> None:
    """4 steps per epoch, a checkpoint every 4: epoch 1's last step is checkpointed (batch 4
    of 4), the epoch's line logged, and the run is killed while writing the checkpoint of
    epoch 2's start. The checkpoint says how many metric lines it covers, so the resume,
    which redoes the epoch's end, logs it once (it was logged twice: same step) (#37)."""
    config = replace(RESUME_CONFIG, epochs=2, checkpoint_every=4)
    fit(classifier_task(), config, tmp_path / "full")
    task, saves = classifier_task(), []

    def task_state() -> None:  # called by every checkpoint
        saves.append(len(saves))
        if len(saves) == 2:
            raise KeyboardInterrupt

    task.state = (task_state, lambda saved: None)
    with pytest.raises(KeyboardInterrupt):
        fit(task, config, tmp_path / "crash")
    state = load_checkpoint(tmp_path / "crash" / "checkpoint.pt")
    assert (state["epoch"], state["batch"], state["step"]) == (1, 4, 4)
    assert [r["epoch"] for r in _records(tmp_path / "crash", "epoch")] == [1]
    fit(classifier_task(), config, tmp_path / "crash", resume=True)
    assert [r["epoch"] for r in _records(tmp_path / "crash", "epoch")] == [1, 2]
    _assert_same_weights(_weights(tmp_path / "full"), _weights(tmp_path / "crash"))
    for kind, key in (("train", "loss"), ("epoch", "train_loss")):
        a, b = ([r[key] for r in _records(tmp_path / d, kind)] for d in ("full", "crash"))
        assert a == b


def test_resume_with_no_checkpoint_and_an_empty_config_starts_afresh(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kill during the first write of config.json (by an older version) left it empty and
    no checkpoint: a resume starts the run afresh with a notice, instead of failing (#37);
    ``read_run_config`` (for the recipes' config check) says the same, and with a
    checkpoint reads the checkpoint's copy."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("")
    (run / "metrics.jsonl").write_text('{"kind": "train", "epo')
    config = TrainConfig(epochs=1, lr=0.1, **QUIET)
    fit(classifier_task(), config, run, resume=True)
    assert "the run starts afresh" in capsys.readouterr().err
    assert json.loads((run / "config.json").read_text()) == {"toy": "classifier"}
    fit(classifier_task(), config, tmp_path / "fresh")
    _assert_same_weights(_weights(tmp_path / "fresh"), _weights(run))
    a, b = ([r["loss"] for r in _records(d, "train")] for d in (tmp_path / "fresh", run))
    assert a == b and len(_records(run, "epoch")) == 1  # the old log is gone

    from structattn.training import read_run_config

    assert read_run_config(run) == {"toy": "classifier"}
    (run / "config.json").write_text("")
    assert read_run_config(run) == {"toy": "classifier"}  # the checkpoint's copy
    (run / "checkpoint.pt").unlink()
    capsys.readouterr()
    assert read_run_config(run) is None
    assert "config.json is unreadable (empty)" in capsys.readouterr().err
    assert read_run_config(tmp_path / "new") is None


def test_stale_temp_files_are_removed_when_a_run_starts(tmp_path: Path) -> None:
    """Temporary files of writers killed before their rename are removed at the start of
    a run and of a resume; other files stay (#37)."""
    run = tmp_path / "run"
    run.mkdir()
    stale = (
        ".checkpoint.pt.k2j9x1ab",
        ".model.pt.0q8z7y6w",
        ".config.json.4242.0a1b2c3d.tmp",
        ".metrics.jsonl.4242.deadbeef.tmp",
    )
    (run / ".keep").write_text("not the loop's")
    config = TrainConfig(epochs=1, lr=0.1, **QUIET)
    for resume in (False, True):
        for name in stale:
            (run / name).write_bytes(b"cut short")
        fit(classifier_task(), replace(config, epochs=1 + resume), run, resume=resume)
        assert [p.name for p in run.iterdir() if p.name.startswith(".")] == [".keep"]
    assert len(_records(run, "epoch")) == 2


# ---- truncated backpropagation through time ----------------------------------------------
def test_tbptt_carries_the_detached_state_within_an_epoch(tmp_path: Path) -> None:
    seen: list[Any] = []
    fit(lm_task(seen=seen), LM_CONFIG, tmp_path / "carry")
    assert len(seen) == 2 * SEGMENTS
    for i, state in enumerate(seen):
        if i % SEGMENTS == 0:
            assert state is None  # each epoch starts afresh
        else:
            h, c = state
            assert h.shape == (1, ROWS, 8) and not h.requires_grad and h.grad_fn is None
    fit(lm_task(carry=False), LM_CONFIG, tmp_path / "reset")
    a, b = _weights(tmp_path / "carry"), _weights(tmp_path / "reset")
    assert not torch.equal(a["lstm.weight_hh_l0"], b["lstm.weight_hh_l0"])  # the state mattered
    losses = [r["train_loss"] for r in _records(tmp_path / "carry", "epoch")]
    assert losses[1] < losses[0] < 2.5  # per token: ln 7 = 1.95 at chance


def test_tbptt_resume_is_bit_for_bit(tmp_path: Path) -> None:
    """A toy LSTM LM: 2 epochs == 1 + resume 1, and == a crash mid-epoch + resume."""
    fit(lm_task(), LM_CONFIG, tmp_path / "full")
    fit(lm_task(), replace(LM_CONFIG, epochs=1), tmp_path / "split")
    fit(lm_task(), LM_CONFIG, tmp_path / "split", resume=True)
    _assert_same_weights(_weights(tmp_path / "full"), _weights(tmp_path / "split"))
    config = replace(LM_CONFIG, checkpoint_every=3)
    with pytest.raises(KeyboardInterrupt):  # killed during step 8 of 10; checkpoint at step 6
        fit(lm_task(crash_at=8), config, tmp_path / "crash")
    state = load_checkpoint(tmp_path / "crash" / "checkpoint.pt")
    assert (state["epoch"], state["batch"], state["step"]) == (2, 1, 6)
    h, c = state["carry"][0]  # one process; the state after batch 1 of epoch 2
    assert h.shape == (1, ROWS, 8) and h.abs().sum() > 0
    save_checkpoint(tmp_path / "two" / "checkpoint.pt", {**state, "carry": state["carry"] * 2})
    with pytest.raises(CheckpointError, match="carried state of 2 processes: resume it with 2"):
        fit(lm_task(), config, tmp_path / "two", resume=True)
    fit(lm_task(), config, tmp_path / "crash", resume=True)
    _assert_same_weights(_weights(tmp_path / "full"), _weights(tmp_path / "crash"))
    losses = [[r["loss"] for r in _records(tmp_path / d, "train")] for d in ("full", "crash")]
    assert losses[0] == losses[1]


def test_tbptt_state_must_be_checkpointable(tmp_path: Path) -> None:
    task = lm_task()
    inner = task.stateful_loss
    assert inner is not None
    task.stateful_loss = lambda m, b, s: (*inner(m, b, None)[:3], object())
    with pytest.raises(TypeError, match="carried state must hold tensors"):
        fit(task, LM_CONFIG, tmp_path / "run")


# ---- validation every N steps, best model, early stopping --------------------------------
def test_eval_every_keeps_the_best_model(tmp_path: Path) -> None:
    """4 steps per epoch, eval_every=2: one validation at steps 2, 4, 6, 8 (an epoch's end
    reuses the validation of its last step)."""
    task = classifier_task(metrics=[1.0, 3.0, 2.0, 0.0])
    config = TrainConfig(epochs=2, lr=0.1, eval_every=2, **QUIET)
    summary = fit(task, config, tmp_path / "run")
    assert task.calls["valid"] == 4  # type: ignore[attr-defined]
    evals = _records(tmp_path / "run", "eval")
    assert [(r["step"], r["valid_metric"]) for r in evals] == [(2, 1), (4, 3), (6, 2), (8, 0)]
    epochs = _records(tmp_path / "run", "epoch")
    assert [(r["step"], r["valid_metric"]) for r in epochs] == [(4, 3.0), (8, 0.0)]
    assert summary["best"] == {"epoch": 1, "step": 4, "metric": 3.0}
    saved = load_model_state(tmp_path / "run")
    assert (saved["epoch"], saved["step"]) == (1, 4)
    assert "stopped" not in summary  # no patience: no early-stopping entry (as before)


def test_early_stopping_and_resume_after_it(tmp_path: Path) -> None:
    metrics = [1.0, 2.0, 1.5, 1.9, 2.0, 5.0]  # no new best at steps 6, 8 (epoch 2 end), 9
    task = classifier_task(metrics=metrics)
    config = TrainConfig(epochs=5, lr=0.1, eval_every=3, patience=3, **QUIET)
    summary = fit(task, config, tmp_path / "run")
    assert summary["stopped"] == {"epoch": 3, "step": 9}
    assert summary["best"] == {"epoch": 1, "step": 4, "metric": 2.0}
    assert task.calls["train"] == 9  # type: ignore[attr-defined]
    stop = _records(tmp_path / "run", "stop")
    assert [(r["epoch"], r["step"], r["bad_evals"]) for r in stop] == [(3, 9, 3)]
    state = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert state["stopped"] == {"epoch": 3, "step": 9} and state["step"] == 9
    before = _weights(tmp_path / "run")
    again = classifier_task(metrics=metrics)
    summary = fit(again, config, tmp_path / "run", resume=True)
    assert summary["stopped"] == {"epoch": 3, "step": 9}
    assert again.calls == {"train": 0, "valid": 0}  # type: ignore[attr-defined]
    _assert_same_weights(before, _weights(tmp_path / "run"))


def test_early_stopping_per_epoch(tmp_path: Path) -> None:
    task = classifier_task(metrics=[1.0, 0.5, 0.7, 0.9])
    summary = fit(task, TrainConfig(epochs=9, lr=0.1, patience=2, **QUIET), tmp_path / "run")
    assert summary["stopped"] == {"epoch": 3, "step": 12} and summary["best"]["epoch"] == 1
    assert len(_records(tmp_path / "run", "epoch")) == 3


# ---- data parallel -----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank: train the toy LM with a crash mid-epoch 2, then resume; rank 0 keeps a copy
    of the checkpoint the crash left."""
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        config = replace(LM_CONFIG, checkpoint_every=3)
        try:
            fit(lm_task(dropout=0.0, crash_at=8), config, Path(out))
        except KeyboardInterrupt:
            pass
        if rank == 0:
            (Path(out) / "crash.pt").write_bytes((Path(out) / "checkpoint.pt").read_bytes())
        dist.barrier()
        fit(lm_task(dropout=0.0), config, Path(out), resume=True)
        dist.barrier()  # as fit does with a group of its own: no rank leaves while a peer sends
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes_match_one(tmp_path: Path) -> None:
    """Two gloo processes on the CPU (TBPTT, per-token loss, a crash mid-epoch and a resume)
    give the single-process weights: each rank holds half the streams and their state."""
    import torch.multiprocessing as mp

    fit(lm_task(dropout=0.0), replace(LM_CONFIG, checkpoint_every=3), tmp_path / "single")
    for attempt in range(2):
        try:
            mp.start_processes(
                _ddp_worker,
                args=(2, _free_port(), str(tmp_path / "ddp")),
                nprocs=2,
                start_method="spawn",
            )
            break
        except mp.ProcessExitedException as error:
            # Gloo can abort a process in its own teardown (SIGABRT, "terminate called without
            # an active exception"; seen once in CI, not reproduced here in 15 runs): one fresh
            # try, from scratch. A Python error in a rank is a ProcessRaisedException: no retry.
            if attempt == 1 or error.signal_name is None:
                raise
            warnings.warn(f"DDP run retried: {error}", stacklevel=1)
            shutil.rmtree(tmp_path / "ddp", ignore_errors=True)
    crash = load_checkpoint(tmp_path / "ddp" / "crash.pt")
    assert (crash["epoch"], crash["batch"], crash["step"]) == (2, 1, 6)
    assert [h.shape for h, _ in crash["carry"]] == [(1, ROWS // 2, 8)] * 2  # rows 0, 2 | 1, 3
    single, ddp = _weights(tmp_path / "single"), _weights(tmp_path / "ddp")
    for key in single:
        torch.testing.assert_close(single[key], ddp[key], rtol=1e-5, atol=1e-6)
    a, b = (_records(tmp_path / d, "train") for d in ("single", "ddp"))
    assert len(a) == len(b) == 2 * SEGMENTS  # rank 0 alone writes the log
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-5)
