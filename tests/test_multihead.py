"""StructuredMultiheadAttention as a drop-in nn.MultiheadAttention (issue #20 items 1-4, #14.7).

Transformer layers in train and eval, with and without grad (PyTorch's fused fast path and
the encoder's nested-tensor path must not bypass the structured heads), float and boolean
masks, length-1 and unbatched inputs, and nn.MultiheadAttention state dicts.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structattn.attention import StructuredMultiheadAttention

NORMALIZERS = ["softmax", "sigmoid", "segmentation", "projective", "non-projective", "mean-field"]
STRUCTURED = ["softmax", "softmax", "projective", "segmentation"]
E, H = 16, 4
# key padding, PyTorch's convention: True = padding; lengths 5, 3, 1
KPM = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4])


def _randomise(mha: StructuredMultiheadAttention) -> StructuredMultiheadAttention:
    """Non-zero structured parameters, so that every one of them changes the output."""
    with torch.no_grad():
        for name, p in mha.named_parameters():
            if name in ("transitions", "root_key", "root_value", "coupling"):
                p.normal_()
    return mha


def _smha(normalizer, embed_dim: int = E, heads: int = H, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return _randomise(
        StructuredMultiheadAttention(embed_dim, heads, normalizer=normalizer, **kwargs)
    )


def _encoder_layer(normalizer, **kwargs) -> nn.TransformerEncoderLayer:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True, **kwargs)
    layer.self_attn = _smha(normalizer, batch_first=True)
    return layer


def _manual_encoder_layer(layer: nn.TransformerEncoderLayer, x: Tensor, kpm: Tensor | None):
    """The post-norm encoder layer written out, with the attention called directly."""
    a = layer.self_attn(x, x, x, key_padding_mask=kpm, need_weights=False)[0]
    h = layer.norm1(x + a)
    return layer.norm2(h + layer.linear2(F.relu(layer.linear1(h))))


GRAD_MODES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "grad": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}


@contextlib.contextmanager
def _no_torch_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested-tensor prototype notices
        yield


# ---- #20.1: Transformer layers ------------------------------------------------------------
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("mode", list(GRAD_MODES))
@pytest.mark.parametrize("padded", [False, True])
def test_encoder_layer_uses_structured_heads(train: bool, mode: str, padded: bool) -> None:
    layer = _encoder_layer(STRUCTURED).train(train)
    x = torch.randn(3, 5, E)
    kpm = KPM if padded else None
    with torch.no_grad():
        expected = _manual_encoder_layer(layer, x, kpm)
    with GRAD_MODES[mode]():
        out = layer(x, src_key_padding_mask=kpm)
    real = ~KPM if padded else torch.ones(3, 5, dtype=torch.bool)
    torch.testing.assert_close(out[real], expected[real])
    # and the structured heads matter: a softmax-only layer gives something else
    softmax = _encoder_layer("softmax").train(train)
    softmax.self_attn.load_state_dict(layer.self_attn.state_dict(), strict=False)
    with torch.no_grad():
        assert not torch.allclose(softmax(x, src_key_padding_mask=kpm)[real], expected[real])


def _spy(monkeypatch, method: str) -> list[int]:
    """Count the calls of a StructuredMultiheadAttention method."""
    calls: list[int] = []
    original = getattr(StructuredMultiheadAttention, method)

    def spy(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StructuredMultiheadAttention, method, spy)
    return calls


def test_softmax_only_encoder_layer_keeps_the_fast_path_and_matches_torch(monkeypatch) -> None:
    fused_calls = _spy(monkeypatch, "merge_masks")
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True).eval()
    ours = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True).eval()
    ours.load_state_dict(ref.state_dict())
    ours.self_attn = StructuredMultiheadAttention.from_torch(ref.self_attn)
    assert ours.self_attn._qkv_same_embed_dim  # PyTorch may take its fused kernel
    x = torch.randn(3, 5, E)
    with torch.inference_mode():
        for kpm in (None, KPM):
            torch.testing.assert_close(
                ours(x, src_key_padding_mask=kpm), ref(x, src_key_padding_mask=kpm)
            )
    assert len(fused_calls) == 2  # PyTorch's fused kernel ran


@pytest.mark.parametrize("swap_after_building", [False, True])
def test_transformer_encoder_nested_tensor_path(swap_after_building: bool, monkeypatch) -> None:
    nested_calls = _spy(monkeypatch, "_forward_nested")
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True)
    if not swap_after_building:
        layer.self_attn = _smha(STRUCTURED, batch_first=True)
    with _no_torch_warnings():
        encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
    if swap_after_building:  # the encoder's __init__ saw nn.MultiheadAttention
        assert encoder.use_nested_tensor
        for i, enc_layer in enumerate(encoder.layers):
            torch.manual_seed(i)
            enc_layer.self_attn = _smha(STRUCTURED, batch_first=True)
    encoder.eval()
    x = torch.randn(3, 5, E)
    expected = x
    with torch.no_grad():
        for enc_layer in encoder.layers:
            expected = _manual_encoder_layer(enc_layer, expected, KPM)
        for context in (torch.no_grad, torch.inference_mode, contextlib.nullcontext):
            with context(), _no_torch_warnings():
                out = encoder(x, src_key_padding_mask=KPM)
            torch.testing.assert_close(out[~KPM], expected[~KPM])
    # the encoder's nested-tensor path is off when it sees structured heads at __init__; when
    # they arrive later it is taken, and the layers run forward() on nested tensors
    assert bool(nested_calls) == swap_after_building
    encoder.train()
    out = encoder(x, src_key_padding_mask=KPM)
    torch.testing.assert_close(out[~KPM], expected[~KPM])
    out[~KPM].sum().backward()


def test_softmax_only_transformer_encoder_matches_torch_in_eval() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True)
    ref = nn.TransformerEncoder(layer, 2).eval()
    ours = nn.TransformerEncoder(layer, 2).eval()
    ours.load_state_dict(ref.state_dict())
    for enc_layer in ours.layers:
        enc_layer.self_attn = StructuredMultiheadAttention.from_torch(enc_layer.self_attn)
    assert ours.use_nested_tensor
    x = torch.randn(3, 5, E)
    with torch.no_grad(), _no_torch_warnings():
        torch.testing.assert_close(
            ours(x, src_key_padding_mask=KPM), ref(x, src_key_padding_mask=KPM)
        )


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("mode", ["grad", "no_grad"])
def test_decoder_layer_with_structured_heads(train: bool, mode: str) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(E, H, 32, dropout=0.0, batch_first=True).train(train)
    # causal self-attention: segmentation chains over each query's prefix; cross-attention
    # over the memory with sigmoid / mean-field heads
    layer.self_attn = _smha(["softmax", "segmentation", "sigmoid", "mean-field"], batch_first=True)
    layer.multihead_attn = _smha(
        ["softmax", "segmentation", "sigmoid", "mean-field"], batch_first=True
    )
    tgt, memory = torch.randn(3, 4, E), torch.randn(3, 5, E)
    causal = nn.Transformer.generate_square_subsequent_mask(4)  # float, -inf above diagonal
    with GRAD_MODES[mode]():
        out = layer(tgt, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=KPM)
    a = layer.self_attn(tgt, tgt, tgt, attn_mask=causal.isinf(), need_weights=False)[0]
    h = layer.norm1(tgt + a)
    c = layer.multihead_attn(h, memory, memory, key_padding_mask=KPM, need_weights=False)[0]
    h = layer.norm2(h + c)
    expected = layer.norm3(h + layer.linear2(F.relu(layer.linear1(h))))
    torch.testing.assert_close(out, expected)
    # causal: a target step does not see later steps
    tgt2 = tgt.clone()
    tgt2[:, 2:] += 1.0
    with torch.no_grad():
        out2 = layer(tgt2, memory, tgt_mask=causal, memory_key_padding_mask=KPM)
    torch.testing.assert_close(out2[:, :2], out[:, :2].detach())


def test_tree_heads_reject_causal_masks_clearly() -> None:
    mha = _smha(STRUCTURED, batch_first=True)
    x = torch.randn(2, 4, E)
    with pytest.raises(ValueError, match="'projective' heads.*attn_mask"):
        mha(x, x, x, is_causal=True, attn_mask=nn.Transformer.generate_square_subsequent_mask(4))
    with pytest.raises(ValueError, match="'projective' heads.*attn_mask"):
        mha(x, x, x, attn_mask=torch.zeros(4, 4))


# ---- #20.2: float and boolean masks -------------------------------------------------------
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_float_key_padding_mask_equals_boolean(normalizer: str) -> None:
    mha = _smha(normalizer, batch_first=True).double()
    x = torch.randn(3, 5, E, dtype=torch.float64)
    float_kpm = torch.zeros(3, 5, dtype=torch.float64).masked_fill(KPM, float("-inf"))
    a, wa = mha(x, x, x, key_padding_mask=KPM, average_attn_weights=False)
    b, wb = mha(x, x, x, key_padding_mask=float_kpm, average_attn_weights=False)
    torch.testing.assert_close(b, a)
    torch.testing.assert_close(wb, wa)
    # and both equal each item alone (padding invariance)
    for i, n in enumerate((~KPM).sum(-1).tolist()):
        alone, _ = mha(x[i : i + 1, :n], x[i : i + 1, :n], x[i : i + 1, :n])
        torch.testing.assert_close(a[i : i + 1, :n], alone)


@pytest.mark.parametrize("normalizer", ["softmax", "sigmoid", "segmentation", "mean-field"])
def test_attn_mask_forms_agree(normalizer: str) -> None:
    mha = _smha(normalizer, batch_first=True).double()
    x = torch.randn(3, 5, E, dtype=torch.float64)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)  # True = not allowed
    causal_float = torch.zeros(5, 5, dtype=torch.float64).masked_fill(causal, float("-inf"))
    per_head = causal.expand(3 * H, 5, 5)
    ref, _ = mha(x, x, x, attn_mask=causal, key_padding_mask=KPM)
    for kwargs in (
        {"attn_mask": causal_float, "key_padding_mask": KPM},
        {"attn_mask": per_head, "key_padding_mask": KPM},
        {"attn_mask": causal, "key_padding_mask": KPM.double().masked_fill(KPM, float("-inf"))},
        {"attn_mask": causal, "is_causal": True, "key_padding_mask": KPM},
    ):
        out, _ = mha(x, x, x, **kwargs)
        torch.testing.assert_close(out, ref)
    # causal: the first query sees only the first key
    x2 = x.clone()
    x2[:, 1:] += 1.0
    out2, _ = mha(x2, x2, x2, attn_mask=causal, key_padding_mask=KPM)
    torch.testing.assert_close(out2[:, 0], ref[:, 0])


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finfo_min_in_a_float_mask_means_padding(normalizer: str, dtype: torch.dtype) -> None:
    """#38.8: Hugging Face marks padding with an additive finfo(dtype).min; it used to be a
    bias for tree heads (outputs differed by 0.11); at or below finfo.min / 2 is padding."""
    mha = _smha(normalizer, batch_first=True).to(dtype)
    x = torch.randn(3, 5, E, dtype=dtype)
    ref, w_ref = mha(x, x, x, key_padding_mask=KPM, average_attn_weights=False)
    for floor in (torch.finfo(dtype).min, torch.finfo(dtype).min / 2):
        hf = torch.zeros(3, 5, dtype=dtype).masked_fill(KPM, floor)
        out, w = mha(x, x, x, key_padding_mask=hf, average_attn_weights=False)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(w, w_ref)
    # the narrower dtype decides: float32's min in a float64 mask of float32 scores
    if dtype == torch.float32:
        wide = torch.zeros(3, 5, dtype=torch.float64).masked_fill(KPM, torch.finfo(dtype).min)
        torch.testing.assert_close(mha(x, x, x, key_padding_mask=wide)[0], ref)
    # a large negative value above the floor stays a bias (softmax: the same weights)
    biased = torch.zeros(3, 5, dtype=dtype).masked_fill(KPM, -1e4)
    out, w = mha(x, x, x, key_padding_mask=biased, average_attn_weights=False)
    if normalizer in ("projective", "non-projective", "segmentation"):
        assert not torch.equal(w, w_ref)  # padded keys stay in the structure, with low scores


@pytest.mark.parametrize("normalizer", ["softmax", "sigmoid", "segmentation", "mean-field"])
def test_finfo_min_in_a_float_attn_mask_means_not_allowed(normalizer: str) -> None:
    mha = _smha(normalizer, batch_first=True)
    x = torch.randn(3, 5, E)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    hf = torch.zeros(5, 5).masked_fill(causal, torch.finfo(torch.float32).min)
    ref, _ = mha(x, x, x, attn_mask=causal, key_padding_mask=KPM)
    torch.testing.assert_close(mha(x, x, x, attn_mask=hf, key_padding_mask=KPM)[0], ref)


def test_float_masks_are_added_to_the_scores() -> None:
    mha = _smha("sigmoid", batch_first=True).double()
    x = torch.randn(2, 4, E, dtype=torch.float64)
    bias = torch.randn(4, 4, dtype=torch.float64)
    _, w = mha(x, x, x, attn_mask=bias, average_attn_weights=False)
    q, k, _ = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, -1)
    q, k = (t.view(2, 4, H, E // H).transpose(1, 2) for t in (q, k))
    scores = q @ k.transpose(-1, -2) / (E // H) ** 0.5
    torch.testing.assert_close(w, torch.sigmoid(scores + bias))


def test_masks_structured_heads_cannot_honour_raise_naming_the_argument() -> None:
    x = torch.randn(2, 4, E)
    seg = _smha("segmentation", batch_first=True)
    gappy = torch.tensor([[False, True, False, False]] * 2)
    with pytest.raises(ValueError, match="key_padding_mask"):
        seg(x, x, x, key_padding_mask=gappy)
    with pytest.raises(ValueError, match="attn_mask"):
        seg(x, x, x, attn_mask=torch.tensor([[False, True, False, False]] * 4))
    with pytest.raises(ValueError, match="key_padding_mask"):
        seg(x, x, x, key_padding_mask=torch.ones(2, 4, dtype=torch.bool))  # nothing left
    with pytest.raises(ValueError, match="key_padding_mask"):
        seg(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))  # wrong shape
    with pytest.raises(ValueError, match="key_padding_mask"):
        seg(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.long))  # wrong dtype
    with pytest.raises(ValueError, match="attn_mask"):
        seg(x, x, x, attn_mask=torch.full((4, 4), float("nan")))


# ---- #20.3: length 1 ----------------------------------------------------------------------
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_length_one(normalizer: str) -> None:
    mha = _smha(normalizer, embed_dim=16, heads=2, batch_first=True)
    x = torch.randn(4, 1, 16, requires_grad=True)
    out, w = mha(x, x, x)
    assert out.shape == (4, 1, 16) and w is not None and w.shape == (4, 1, 1)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


# ---- #20.4: unbatched input ---------------------------------------------------------------
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("normalizer", ["softmax", STRUCTURED])
def test_unbatched_input(batch_first: bool, normalizer) -> None:
    mha = _smha(normalizer, batch_first=batch_first)
    x = torch.randn(5, E)
    kpm = torch.tensor([False] * 3 + [True] * 2)
    for kwargs in ({}, {"key_padding_mask": kpm}, {"average_attn_weights": False}):
        out, w = mha(x, x, x, **kwargs)
        batched = x.unsqueeze(0 if batch_first else 1)
        bkw = {k: v.unsqueeze(0) if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        ref, wref = mha(batched, batched, batched, **bkw)
        torch.testing.assert_close(out, ref.squeeze(0 if batch_first else 1))
        assert w is not None and wref is not None
        torch.testing.assert_close(w, wref.squeeze(0))
    if normalizer == "softmax":
        torch_mha = nn.MultiheadAttention(E, H, batch_first=batch_first)
        torch_mha.load_state_dict(mha.state_dict())
        for kwargs in ({}, {"key_padding_mask": kpm}, {"attn_mask": torch.randn(H, 5, 5)}):
            a, wa = torch_mha(x, x, x, **kwargs)
            b, wb = mha(x, x, x, **kwargs)
            torch.testing.assert_close(b, a)
            torch.testing.assert_close(wb, wa)


# ---- #14.7: nn.MultiheadAttention state dicts ---------------------------------------------
@pytest.mark.parametrize("kdim", [None, 5])
def test_softmax_only_has_exactly_torch_parameters(kdim) -> None:
    ref = nn.MultiheadAttention(E, H, kdim=kdim, vdim=kdim, batch_first=True)
    ours = StructuredMultiheadAttention(E, H, kdim=kdim, vdim=kdim, batch_first=True)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    ours.load_state_dict(ref.state_dict())  # strict
    q, kv = torch.randn(2, 3, E), torch.randn(2, 4, kdim or E)
    torch.testing.assert_close(ours(q, kv, kv)[0], ref(q, kv, kv)[0])
    ref.load_state_dict(ours.state_dict())  # and back


def test_loading_a_torch_state_dict_initialises_structured_parameters_and_warns() -> None:
    ref = nn.MultiheadAttention(E, H, batch_first=True)
    ours = _smha(STRUCTURED, batch_first=True)
    with pytest.warns(UserWarning, match="root_key.*initial"):
        ours.load_state_dict(ref.state_dict())  # strict
    torch.testing.assert_close(ours.in_proj_weight, ref.in_proj_weight)
    fresh = StructuredMultiheadAttention(E, H, batch_first=True, normalizer=STRUCTURED)
    assert (ours.root_value == 0).all() and (ours.transitions == 0).all()
    assert ours.root_key.shape == fresh.root_key.shape
    # inside a Transformer layer: a layer trained with nn.MultiheadAttention
    layer = _encoder_layer(STRUCTURED)
    with pytest.warns(UserWarning, match="transitions"):
        layer.load_state_dict(nn.TransformerEncoderLayer(E, H, 32, batch_first=True).state_dict())
    # an SMHA state dict loads silently
    other = StructuredMultiheadAttention(E, H, batch_first=True, normalizer=STRUCTURED)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other.load_state_dict(ours.state_dict())


def test_structured_parameters_only_for_heads_that_use_them() -> None:
    mha = StructuredMultiheadAttention(E, H, normalizer=["sigmoid", "segmentation"] * 2)
    names = {n for n, _ in mha.named_parameters()}
    assert "transitions" in names and not names & {"root_key", "root_value", "coupling"}
    assert mha.transitions.shape == (2, 2, 2)  # one 2x2 matrix per segmentation head


def test_state_dicts_of_the_per_head_layout_still_load() -> None:
    # up to 0.1.0 every structured parameter had a slot for each head
    mha = StructuredMultiheadAttention(E, H, normalizer=["softmax", "projective"] * 2)
    old = mha.state_dict()
    old["root_key"] = torch.randn(H, E // H)
    old["root_value"] = torch.randn(H, E // H)
    mha.load_state_dict(old)
    torch.testing.assert_close(mha.root_key, old["root_key"][[1, 3]])
    torch.testing.assert_close(mha.root_value, old["root_value"][[1, 3]])


# ---- head groups as views, the one-node tree marginals (issue #20.7) ------------------------
@pytest.mark.parametrize(
    "normalizer",
    [
        ["softmax", "softmax", "projective", "projective"],  # consecutive groups: views
        ["projective", "softmax", "segmentation", "projective"],  # scattered: gathers
        ["softmax", "projective", "projective", "segmentation"],
    ],
)
def test_head_groups_equal_heads_computed_one_by_one(normalizer: list[str]) -> None:
    """Every head's weights and the output equal those of a layer whose heads all use that
    head's normaliser (same projections), whatever the grouping of the heads."""
    torch.manual_seed(0)
    layer = StructuredMultiheadAttention(16, 4, batch_first=True, normalizer=normalizer).double()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4])
    out, weights = layer(x, x, x, key_padding_mask=padding, average_attn_weights=False)
    for head, kind in enumerate(normalizer):
        single = StructuredMultiheadAttention(16, 4, batch_first=True, normalizer=kind).double()
        state = {k: v for k, v in layer.state_dict().items() if k in single.state_dict()}
        slot = [i for i, n in enumerate(normalizer) if n == kind].index(head)
        for name in ("transitions", "root_key", "root_value"):
            if name in single.state_dict():
                state[name] = getattr(layer, name)[slot].expand_as(getattr(single, name))
        single.load_state_dict(state)
        _, alone = single(x, x, x, key_padding_mask=padding, average_attn_weights=False)
        torch.testing.assert_close(weights[:, head], alone[:, head])


def test_projective_tree_weights_equal_the_distribution_marginals() -> None:
    """The tree heads' one-node marginals (structs.dependency.eisner_marginals): values,
    gradients and second derivatives equal DependencyCRF's, with padding and length 1."""
    from structattn import DependencyCRF
    from structattn.attention.normalizers import self_attention_tree_weights

    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(4, 2, 6, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    root = torch.randn(4, 2, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([6, 1, 4, 2]).view(4, 1).expand(-1, 2)
    weights, share = self_attention_tree_weights(scores, root, lengths, "projective")

    arcs = scores.new_zeros(4, 2, 7, 7)
    arcs[..., 0, 1:] = root
    arcs[..., 1:, 1:] = scores.transpose(-1, -2)
    marginals = DependencyCRF(arcs.reshape(8, 7, 7), (lengths + 1).reshape(8)).marginals
    marginals = marginals.reshape(4, 2, 7, 7)
    torch.testing.assert_close(weights, marginals[..., 1:, 1:].transpose(-1, -2))
    torch.testing.assert_close(share, marginals[..., 0, 1:])
    direction = torch.randn(weights.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((weights * direction).sum(), (scores, root), create_graph=True)
    want = torch.autograd.grad(
        (marginals[..., 1:, 1:].transpose(-1, -2) * direction).sum(), (scores, root),
        create_graph=True,
    )  # fmt: skip
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    third = torch.autograd.grad(got[0].pow(2).sum(), scores)[0]
    torch.testing.assert_close(third, torch.autograd.grad(want[0].pow(2).sum(), scores)[0])
    short = torch.tensor([4, 1]).view(2, 1).expand(-1, 2)
    assert torch.autograd.gradgradcheck(
        lambda s, r: self_attention_tree_weights(s, r, short, "projective"),
        (
            scores.detach()[:2, :, :4, :4].requires_grad_(),
            root.detach()[:2, :, :4].requires_grad_(),
        ),
    )
