"""The mean-field attention recipe (Liu et al.): models, data files, a tiny model that learns,
the J = 0 / k = 0 reductions and the free-energy check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from structattn.attention import (
    MeanFieldAttention,
    SigmoidAttention,
    VariationalAttention,
)
from structattn.cli import main
from structattn.data.synthetic import CountingExample, SortingExample
from structattn.data.synthetic_batches import SyntheticBatch
from structattn.recipes import mfa
from structattn.recipes.config import replace_path
from structattn.structs.mean_field import mean_field_free_energy, mean_field_marginals

TINY = replace_path(
    mfa._QUICK, {"embedding_dim": 6, "hidden_dim": 8, "attention_dim": 4, "iterations": 3}
)
ALL_MODELS = ("rnn", "lstm", "bilstm", "attention", "vae", "mfa0", "mfa3")


@pytest.fixture(autouse=True)
def _python_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRUCTATTN_EXTENSION", "0")


def _examples(task: str) -> list[CountingExample | SortingExample]:
    if task == "counting":
        return [CountingExample("0110", 1), CountingExample("1", 1), CountingExample("10101", 3)]
    return [
        SortingExample((3, 1, 2), (1, 2, 3)),
        SortingExample((5,), (5,)),
        SortingExample((9, 0, 4, 4, 7), (0, 4, 4, 7, 9)),
    ]


def _outputs(model: torch.nn.Module, batch: SyntheticBatch) -> torch.Tensor:
    if batch.target_in.shape[1] == 0:
        return model(batch.source, batch.source_mask)[0]  # [B]
    return model(batch.source, batch.source_mask, batch.target_in)  # [B, T, V]


@pytest.mark.parametrize("task", mfa.TASKS)
@pytest.mark.parametrize("model", ALL_MODELS)
def test_forward_backward_and_padding_invariance(task: str, model: str) -> None:
    config = replace_path(TINY, {"task": task, "model": model})
    net = mfa.build_model(config)
    examples = _examples(task)
    cpu = torch.device("cpu")
    batch = mfa.collate(examples, cpu, config.max_value)
    loss, n, tokens = mfa.batch_loss(net, batch)  # training mode (VAE samples, adds KL)
    loss.backward()
    assert torch.isfinite(loss) and n == 3 and tokens >= 3
    unused = ("attention.pair_",) if model == "mfa0" else ()  # J does not enter with k = 0
    grads = {k: p.grad for k, p in net.named_parameters() if not k.startswith(unused)}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    net.eval()
    with torch.no_grad():
        together = _outputs(net, batch)
        for i, ex in enumerate(examples):
            alone = _outputs(net, mfa.collate([ex], cpu, config.max_value))
            if task == "counting":
                torch.testing.assert_close(together[i], alone[0], atol=1e-5, rtol=1e-5)
            else:
                t = len(ex.values) + 1
                torch.testing.assert_close(together[i, :t], alone[0, :t], atol=1e-5, rtol=1e-5)


def test_mfa_with_zero_interactions_is_sigmoid_attention() -> None:
    torch.manual_seed(0)
    attention = MeanFieldAttention(6, 5, hidden_dim=4, iterations=4)
    torch.nn.init.zeros_(attention.pair_memory.weight)  # J = 0
    query, memory = torch.randn(2, 3, 5), torch.randn(2, 7, 6)
    mask = torch.arange(7) < torch.tensor([[7], [4]])
    out = attention(query, memory, mask)
    sigmoid = torch.sigmoid(out.unary) * mask.unsqueeze(1)
    torch.testing.assert_close(out.weights, sigmoid)
    # the same as SigmoidAttention with the MFA's unary MLP as its scorer
    reference = SigmoidAttention(6, 5, "mlp", 4)
    reference.scorer.memory_proj.load_state_dict(attention.unary_memory.state_dict())
    reference.scorer.query_proj.load_state_dict(attention.unary_query.state_dict())
    reference.scorer.v.load_state_dict(attention.unary_out.state_dict())
    torch.testing.assert_close(reference(query, memory, mask).weights, out.weights)
    # and k = 0 gives sigmoid(phi) whatever J is
    attention.iterations = 0
    torch.nn.init.normal_(attention.pair_memory.weight)
    out0 = attention(query, memory, mask)
    torch.testing.assert_close(out0.weights, torch.sigmoid(out0.unary) * mask.unsqueeze(1))


def test_free_energy_never_rises_for_weak_couplings() -> None:
    """Parallel mean-field updates decrease F when the couplings are weak enough (here
    ||J|| < 1: the update is a contraction); report-only for trained models."""
    torch.manual_seed(1)
    unary = torch.randn(16, 9) * 2
    pairwise = torch.randn(16, 9, 9) * 0.3
    pairwise = 0.5 * (pairwise + pairwise.transpose(1, 2))
    pairwise = pairwise - torch.diag_embed(torch.diagonal(pairwise, dim1=1, dim2=2))
    pairwise = pairwise / torch.linalg.matrix_norm(pairwise, ord=2).clamp(min=1).view(-1, 1, 1)
    trajectory = mean_field_marginals(unary, pairwise, 10, return_trajectory=True)
    energy = torch.stack([mean_field_free_energy(unary, pairwise, q) for q in trajectory])
    assert (energy[1:] - energy[:-1] <= 1e-5).all()


def test_variational_attention_kl_and_eval_mean() -> None:
    torch.manual_seed(0)
    layer = VariationalAttention(4, 3, kl_weight=0.5)
    query, memory = torch.randn(2, 3), torch.randn(2, 5, 4)
    out = layer(query, memory)
    assert out.kl.shape == (2,) and (out.kl >= 0).all()
    torch.testing.assert_close(layer.penalty(), 0.5 * out.kl.sum())
    assert float(layer.penalty()) == 0.0  # reset after use
    layer.eval()
    out = layer(query, memory)
    torch.testing.assert_close(out.context, out.mean)


def test_tiny_mfa_learns_tiny_counting() -> None:
    """20 epochs on 256 strings of length 3-8: MSE on held-out strings falls far below the
    variance of the counts (a model that ignores the input cannot)."""
    torch.set_num_threads(1)
    config = replace_path(
        TINY,
        {"task": "counting", "model": "mfa", "iterations": 1, "train_size": 256,
         "min_length": 3, "max_length": 8, "batch_size": 32, "valid_size": 64},
    )  # fmt: skip
    data = mfa.load_data(config)
    net = mfa.build_model(config)
    opt = torch.optim.Adam(net.parameters(), lr=0.02)
    cpu = torch.device("cpu")
    for epoch in range(20):
        for examples in mfa.batches_for_epoch(data["train"], 32, 0, epoch):
            loss, n, _ = mfa.batch_loss(net, mfa.collate(examples, cpu, 99))
            opt.zero_grad()
            (loss / n).backward()
            opt.step()
    counts = torch.tensor([float(e.count) for e in data["valid"]])
    mse = mfa.validate(net, data["valid"], cpu, 99)["mse"]
    assert mse < 0.25 * float(counts.var())


def test_data_command_files_train_and_malformed_line(tmp_path: Path, capsys) -> None:
    out = tmp_path / "data"
    assert main(["data", "mfa", "--task", "sorting", "--out", str(out), "--max-value", "9"]) == 0
    assert "test.tsv: 2500 examples" in capsys.readouterr().out
    lines = (out / "test.tsv").read_text().splitlines()
    assert len(lines) == 25 * 100 and lines[0].count("\t") == 1
    assert len((out / "train.tsv").read_text().splitlines()) == 100_000
    # small files through --data-dir: train and eval read them
    (out / "train.tsv").write_text("3 1 2\t1 2 3\n5 4\t4 5\n" * 8)
    (out / "valid.tsv").write_text("2 1\t1 2\n")
    (out / "test.tsv").write_text("2 1\t1 2\n7 7 0\t0 7 7\n")
    run = tmp_path / "run"
    args = ["train", "mfa", "--preset", "quick", "--data-dir", str(out), "--out", str(run)]
    assert main(["--threads", "1", *args]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["runs"] == 1
    predictions = tmp_path / "p.jsonl"
    assert main(["eval", "mfa", "--checkpoint", str(run), "--predictions", str(predictions)]) == 0
    first = json.loads(predictions.read_text().splitlines()[0])
    assert set(first) == {"index", "input", "target", "predicted", "nll"}
    bad = tmp_path / "bad.tsv"
    bad.write_text("2 1\t1 2\n3 1\t3 1\n")
    assert main(["eval", "mfa", "--checkpoint", str(run), "--data", str(bad)]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err


def test_counting_through_the_cli_with_predictions(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    args = ["train", "mfa", "--preset", "quick", "--task", "counting", "--model", "mfa1"]
    assert main(["--threads", "1", *args, "--out", str(run)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["model"] == "mfa1" and "free_energy" in summary
    predictions = tmp_path / "p.jsonl"
    assert main(["eval", "mfa", "--checkpoint", str(run), "--predictions", str(predictions)]) == 0
    record = json.loads(predictions.read_text().splitlines()[0])
    assert set(record) == {"index", "input", "target", "predicted"}
    assert isinstance(record["predicted"], float) and set(record["input"]) <= {"0", "1"}


def test_config_errors_and_mfa_shorthand() -> None:
    config = mfa.MFAConfig(model="mfa1")
    assert (config.model, config.iterations, config.name) == ("mfa", 1, "mfa1")
    assert mfa.RECIPE.cell(config) == "sorting/mfa1"
    with pytest.raises(ValueError, match="model"):
        mfa.MFAConfig(model="gru")
    with pytest.raises(ValueError, match="task"):
        mfa.MFAConfig(task="lm2")
    with pytest.raises(ValueError, match="min_length"):
        mfa.MFAConfig(min_length=9, max_length=3)
    with pytest.raises(ValueError, match="max_value"):
        mfa.collate([SortingExample((12,), (12,))], torch.device("cpu"), 9)


def test_mean_field_lm_windows_and_causality() -> None:
    from structattn.models.mean_field_lm import MeanFieldLanguageModel

    torch.manual_seed(0)
    lm = MeanFieldLanguageModel(13, 6, 8, iterations=3, attention_dim=4, memory_size=4).eval()
    x = torch.randint(0, 13, (2, 9))
    cpu = torch.device("cpu")
    with torch.no_grad():
        full, _ = lm(x, lm.initial_state(2, cpu))
        state, parts = lm.initial_state(2, cpu), []
        for a, b in ((0, 3), (3, 5), (5, 9)):  # the same stream in BPTT windows
            out, state = lm(x[:, a:b], state)
            parts.append(out)
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
        changed = x.clone()
        changed[:, 6:] = (changed[:, 6:] + 1) % 13  # the future does not leak backwards
        later, _ = lm(changed, lm.initial_state(2, cpu))
        torch.testing.assert_close(later[:, :6], full[:, :6])
        assert not torch.allclose(later[:, 6:], full[:, 6:])


def test_mfa_lm_config_and_models() -> None:
    from structattn.models.mean_field_lm import MeanFieldLanguageModel
    from structattn.recipes import mfa_lm

    config = mfa_lm.MFALMConfig(corpus="wikitext-2")
    assert config.lm.corpus == "wikitext-2" and mfa_lm.RECIPE.cell(config) == "wikitext-2/mfa"
    assert isinstance(mfa_lm.build_model(config, 50), MeanFieldLanguageModel)
    lstm = mfa_lm.build_model(replace_path(config, {"model": "lstm"}), 50)
    assert not isinstance(lstm, MeanFieldLanguageModel)
    with pytest.raises(ValueError, match="model"):
        mfa_lm.MFALMConfig(model="gru")
