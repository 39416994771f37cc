"""structattn.integrations.huggingface (#38.8): structured heads in Hugging Face BERT /
RoBERTa models, randomly initialised from small configs (no downloads).

Softmax heads compute what the original model computed (both of Hugging Face's mask forms:
the eager additive finfo.min mask and the sdpa boolean mask); structured heads are padding
invariant under both; save_pretrained / from_pretrained keep heads and weights; what is not
supported is refused with a ValueError saying so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install structattn[hf])"
)

from structattn.integrations.huggingface import (  # noqa: E402
    StructuredSelfAttention,
    from_pretrained,
    structure_attention,
    structured_model_class,
)

IMPLEMENTATIONS = ["eager", "sdpa"]
HEADS = 4
# right padding: lengths 6, 4, 2 (1 = a real token, Hugging Face's convention)
MASK = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4])


def _config(kind: str = "bert", impl: str = "eager", **overrides: Any) -> Any:
    settings: dict[str, Any] = {
        "vocab_size": 60,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "intermediate_size": 32,
        "max_position_embeddings": 40,
        "attn_implementation": impl,
        **overrides,
    }
    if kind == "roberta":
        return transformers.RobertaConfig(**settings)
    return transformers.BertConfig(**settings)


def _model(kind: str = "bert", impl: str = "eager", seed: int = 0, **overrides: Any) -> Any:
    torch.manual_seed(seed)
    model_class = transformers.RobertaModel if kind == "roberta" else transformers.BertModel
    return model_class(_config(kind, impl, **overrides)).eval()


def _ids(seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 60, (3, 6), generator=generator)


def _randomise(model: torch.nn.Module) -> None:
    """Non-zero structured parameters (root_value and coupling start at 0)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, StructuredSelfAttention):
                for name, p in module.attention.named_parameters():
                    if name in ("transitions", "root_key", "root_value", "coupling"):
                        p.normal_()


@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_softmax_heads_compute_what_the_model_computed(kind: str, impl: str) -> None:
    """The pretrained q/k/v weights are converted: softmax heads give the original outputs
    (padded batch; with and without a mask) and the original gradients."""
    model = _model(kind, impl)
    ids = _ids()
    with torch.no_grad():
        before = model(ids, attention_mask=MASK)
        unmasked = model(ids).last_hidden_state
    structure_attention(model, "softmax")
    assert all(
        isinstance(layer.attention.self, StructuredSelfAttention) for layer in model.encoder.layer
    )
    with torch.no_grad():
        after = model(ids, attention_mask=MASK)
        torch.testing.assert_close(model(ids).last_hidden_state, unmasked)
    torch.testing.assert_close(after.last_hidden_state, before.last_hidden_state)
    torch.testing.assert_close(after.pooler_output, before.pooler_output)
    # the same parameters, trained the same way: one backward through both
    reference = _model(kind, impl)
    loss = model(ids, attention_mask=MASK).last_hidden_state.square().sum()
    loss.backward()
    reference(ids, attention_mask=MASK).last_hidden_state.square().sum().backward()
    for ours, theirs in zip(model.encoder.layer, reference.encoder.layer, strict=True):
        packed = ours.attention.self.attention.in_proj_weight.grad
        hf = theirs.attention.self
        expected = torch.cat([hf.query.weight.grad, hf.key.weight.grad, hf.value.weight.grad])
        torch.testing.assert_close(packed, expected)


def test_output_attentions_collects_the_structured_weights() -> None:
    """Softmax heads: Hugging Face's attentions; tree heads: their marginals, rows summing
    to 1 minus the ROOT's share over the real keys, 0 at padding."""
    model = _model("bert", "eager")
    ids = _ids()
    with torch.no_grad():
        before = model(ids, attention_mask=MASK, output_attentions=True).attentions
        structure_attention(model, "softmax")
        after = model(ids, attention_mask=MASK, output_attentions=True).attentions
    assert len(after) == len(before) == 2
    for ours, theirs in zip(after, before, strict=True):
        torch.testing.assert_close(ours, theirs)
    structure_attention(model, "projective")
    with torch.no_grad():
        trees = model(ids, attention_mask=MASK, output_attentions=True).attentions
    assert len(trees) == 2 and trees[0].shape == (3, HEADS, 6, 6)
    padded = (MASK == 0).view(3, 1, 1, 6).expand_as(trees[0])
    assert trees[0][padded].abs().max() == 0 and (trees[0].sum(-1) <= 1 + 1e-5).all()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_causal_decoder_with_cross_attention(impl: str) -> None:
    """A decoder's causal mask (eager: additive 4-D; sdpa: boolean, or none and is_causal)
    reaches softmax heads as an attn_mask; cross-attention keeps Hugging Face's modules;
    a key/value cache is refused in one clear line."""
    overrides = {"is_decoder": True, "add_cross_attention": True}
    ids, memory = _ids(), torch.randn(3, 5, 16)
    for mask in (None, MASK):
        model = _model("bert", impl, **overrides)
        with torch.no_grad():
            before = model(ids, attention_mask=mask, encoder_hidden_states=memory, use_cache=False)
            structure_attention(model, "softmax")
            after = model(ids, attention_mask=mask, encoder_hidden_states=memory, use_cache=False)
        torch.testing.assert_close(after.last_hidden_state, before.last_hidden_state)
        layer = model.encoder.layer[0]
        assert not isinstance(layer.crossattention.self, StructuredSelfAttention)
    with pytest.raises(ValueError, match="use_cache=False"):
        model(ids, encoder_hidden_states=memory)
    tree = structure_attention(_model("bert", impl, **overrides), "projective")
    with pytest.raises(ValueError, match="'projective' heads do not take `attn_mask`"):
        tree(ids, encoder_hidden_states=memory, use_cache=False)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_structured_heads_see_padding_as_padding(impl: str) -> None:
    """Tree and chain heads: Hugging Face's padding (finfo.min or the boolean mask) is
    padding, so each item's outputs equal those of the item alone (they differed by 0.11
    when finfo.min was taken as a bias)."""
    heads = ["projective", "non-projective", "segmentation", "softmax"]
    model = structure_attention(_model("bert", impl), heads)
    _randomise(model)
    ids = _ids()
    with torch.no_grad():
        out = model(ids, attention_mask=MASK).last_hidden_state
        for i, n in enumerate(MASK.sum(-1).tolist()):
            alone = model(ids[i : i + 1, :n]).last_hidden_state
            torch.testing.assert_close(out[i : i + 1, :n], alone, atol=2e-5, rtol=1e-4)
    other = structure_attention(_model("bert", "sdpa" if impl == "eager" else "eager"), heads)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(other(ids, attention_mask=MASK).last_hidden_state, out)


def test_heads_per_layer_and_per_head_and_restructuring() -> None:
    model = _model()
    ids = _ids()
    with torch.no_grad():
        before = model(ids, attention_mask=MASK).last_hidden_state
    structure_attention(model, {1: ["projective", "softmax", "mean-field", "sigmoid"]})
    first, second = (layer.attention.self for layer in model.encoder.layer)
    assert first.normalizers == ("softmax",) * HEADS
    assert second.normalizers == ("projective", "softmax", "mean-field", "sigmoid")
    assert model.config.structattn == {
        "normalizer": {"1": ["projective", "softmax", "mean-field", "sigmoid"]},
        "mean_field_iterations": 3,
    }
    # structured again: the projections are kept, so softmax heads are the original again
    structure_attention(model, "softmax")
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=MASK).last_hidden_state, before)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_save_pretrained_and_from_pretrained(tmp_path: Path, impl: str) -> None:
    heads = {0: ["projective", "segmentation", "softmax", "non-projective"], 1: "projective"}
    model = structure_attention(_model("bert", impl), heads)
    _randomise(model)
    ids = _ids()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["structattn"]["normalizer"]["1"] == "projective"
    loaded = from_pretrained(transformers.BertModel, str(tmp_path)).eval()
    assert isinstance(loaded, transformers.BertModel)
    assert type(loaded) is structured_model_class(transformers.BertModel)
    assert loaded.encoder.layer[0].attention.self.normalizers == tuple(heads[0])
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(ids, attention_mask=MASK).last_hidden_state,
            model(ids, attention_mask=MASK).last_hidden_state,
        )
    # a task head on top: the same
    task = structure_attention(
        transformers.BertForSequenceClassification(_config(impl=impl, num_labels=3)), "projective"
    )
    task.save_pretrained(tmp_path / "task")
    again = from_pretrained(transformers.BertForSequenceClassification, str(tmp_path / "task"))
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(ids).logits, task.eval()(ids).logits)
    # a folder saved without structured heads is refused, saying what to do
    _model().save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="no `structattn` settings"):
        from_pretrained(transformers.BertModel, str(tmp_path / "plain"))


def test_fine_tuning_step_trains_the_structured_parameters() -> None:
    model = transformers.BertForSequenceClassification(_config(num_labels=2))
    structure_attention(model, ["projective", "softmax", "segmentation", "mean-field"])
    model.train()
    out = model(_ids(), attention_mask=MASK, labels=torch.tensor([0, 1, 1]))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    mha = model.bert.encoder.layer[0].attention.self.attention
    for name in ("in_proj_weight", "root_key", "transitions", "coupling"):
        grad = getattr(mha, name).grad
        assert grad is not None and torch.isfinite(grad).all(), name


def test_refusals_name_what_is_unsupported() -> None:
    model = structure_attention(_model(), "projective")
    module = model.encoder.layer[0].attention.self
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="cross-attention"):
        module(x, encoder_hidden_states=torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match="head_mask"):
        module(x, None, torch.ones(HEADS))
    with pytest.raises(ValueError, match="attn_implementation='eager' or 'sdpa'"):
        module(x, attention_mask=object())
    with pytest.raises(ValueError, match=r"\[B, 1 or H, 1 or L, L\]"):
        module(x, attention_mask=torch.zeros(2, 1, 5, 4))
    with pytest.raises(ValueError, match="no BERT-style self-attention"):
        structure_attention(torch.nn.Linear(2, 2), "softmax")
    with pytest.raises(ValueError, match="layers 0..1"):
        structure_attention(_model(), {2: "softmax"})
    with pytest.raises(ValueError, match="layer 0: .*`normalizer`"):
        structure_attention(_model(), ["projective", "softmax"])  # 2 names for 4 heads
    # transformers 4's positional call (hidden_states, attention_mask, head_mask, ...) and
    # its [B, 1, 1, S] additive mask
    padding = torch.zeros(2, 1, 1, 5).masked_fill(
        torch.tensor([False, True]).view(2, 1, 1, 1) & (torch.arange(5) >= 3), -3.4e38
    )
    out, weights = module(x, padding)
    assert out.shape == (2, 5, 16) and weights.shape == (2, HEADS, 5, 5)
    torch.testing.assert_close(out[1:, :3], module(x[1:, :3])[0])
