"""Generic encoder-decoder (models/seq2seq.py) and beam search (models/decoding.py)."""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn

from structattn.attention import (
    MeanFieldAttention,
    SegmentationAttention,
    SigmoidAttention,
    SoftmaxAttention,
)
from structattn.models import (
    ATTENTIONS,
    ENCODERS,
    BeamResult,
    KeyedAttention,
    RecurrentEncoder,
    Seq2Seq,
    Seq2SeqConfig,
    StructuredSeq2Seq,
    beam_search,
    greedy_search,
    sequence_nll,
)

PAD, BOS, EOS = 0, 1, 2
LAYER_TYPES = {
    "softmax": SoftmaxAttention,
    "sigmoid": SigmoidAttention,
    "segmentation": SegmentationAttention,
    "mean-field": MeanFieldAttention,
}
#: configurations covering every code path: recurrent or not, bidirectional (packed), start
#: state zeros / final, input feeding or not, self-attention none / simple / structured
CONFIGS = {
    "nmt": dict(encoder_layers=2, decoder_layers=2, init_decoder="final"),
    "birnn-zeros": dict(
        encoder_layers=1, decoder_layers=2, bidirectional=True, init_decoder="zeros"
    ),
    "rnn-zeros-no-feed": dict(
        encoder_layers=1, decoder_layers=1, init_decoder="zeros", input_feeding=False
    ),
    "rnn-structured": dict(encoder_layers=1, decoder_layers=1, self_attention="structured"),
    "tree-transduction": dict(
        encoder_layers=0,
        decoder_layers=1,
        self_attention="simple",
        prepend_root=False,  # source position 0 is ROOT (needs 2 positions per item)
        init_decoder="zeros",
        input_feeding=False,
    ),
}


def tiny(**overrides: object) -> Seq2SeqConfig:
    settings: dict = dict(
        source_vocab_size=11,
        target_vocab_size=7,
        embedding_dim=6,
        hidden_dim=6,
        parser_hidden=3,
        dropout=0.0,
    )
    settings.update(overrides)
    return Seq2SeqConfig(**settings)


def model_of(config: Seq2SeqConfig, scale: float = 0.5) -> Seq2Seq:
    model = Seq2Seq(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-scale, scale)
    return model


def ragged(lengths: list[int], vocab: int, low: int = 3) -> tuple[Tensor, Tensor]:
    """Ids [B, max] (padding 0 at the end) and the mask, for the given lengths."""
    n = max(lengths)
    ids = torch.randint(low, vocab, (len(lengths), n))
    mask = torch.arange(n) < torch.tensor(lengths).unsqueeze(-1)
    return ids.masked_fill(~mask, PAD), mask


def batch(config: Seq2SeqConfig) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """source, source_mask, target_in, target_out of three items of different lengths."""
    source, mask = ragged([5, 3, 2], config.source_vocab_size)
    target, target_mask = ragged([4, 1, 2], config.target_vocab)
    target_in = torch.cat([torch.full((3, 1), BOS), target], 1)  # [B, T+1]
    lengths = target_mask.sum(-1)
    target_out = torch.cat([target, torch.zeros(3, 1, dtype=torch.long)], 1)
    target_out[torch.arange(3), lengths] = EOS
    return source, mask, target_in, target_out


# ---- shapes, names, configuration -----------------------------------------------------------
def test_shapes_and_names() -> None:
    config = tiny(bidirectional=True, encoder_layers=2, decoder_layers=2)
    model = Seq2Seq(config)
    source, mask, target_in, _ = batch(config)
    assert model(source, mask, target_in).shape == (3, target_in.shape[1], 7)
    assert isinstance(model.encoder, RecurrentEncoder) and model.self_attention is None
    assert isinstance(model.attention, SoftmaxAttention) and isinstance(model.decoder, nn.LSTM)
    assert model.decoder.input_size == 6 + 6  # input feeding: [y_j; h~_{j-1}]
    encoded = model.encode(source, mask)
    assert encoded.memory.shape == (3, 5, config.memory_dim) and encoded.self_attention is None
    _, state = model.init_state(source, mask)
    assert state.hidden.shape == state.cell.shape == (3, 2, 6) and state.feed.shape == (3, 6)
    structured = Seq2Seq(tiny(self_attention="structured", encoder_layers=1, decoder_layers=1))
    assert structured.config.memory_dim == 12
    parse = structured.encode(source, mask).self_attention
    assert parse is not None and parse.marginals.shape == (3, 6, 6)  # learned ROOT first


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="self_attention"):
        tiny(self_attention="tree")
    with pytest.raises(ValueError, match="attention"):
        tiny(attention="hard")
    with pytest.raises(ValueError, match="as many encoder as decoder layers"):
        tiny(encoder_layers=1, decoder_layers=2, init_decoder="final")
    with pytest.raises(ValueError, match="bidirectional"):
        tiny(encoder_layers=0, decoder_layers=1, init_decoder="zeros", bidirectional=True)
    with pytest.raises(ValueError, match="share_embeddings"):
        tiny(share_embeddings=True)
    with pytest.raises(ValueError, match="dropout"):
        tiny(dropout=1.0)
    with pytest.raises(ValueError, match="source_mask"):
        model = Seq2Seq(tiny())
        model(
            torch.ones(1, 3, dtype=torch.long),
            torch.tensor([[True, False, True]]),
            torch.ones(1, 2, dtype=torch.long),
        )


def test_shared_vocabulary_and_embeddings() -> None:
    model = Seq2Seq(tiny(target_vocab_size=None, share_embeddings=True))
    assert model.target_embedding is model.source_embedding
    assert model.output.out_features == 11
    separate = Seq2Seq(tiny(target_vocab_size=None))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(separate) - count(model) == 11 * 6


# ---- padding invariance, gradients, attention kinds -----------------------------------------
@pytest.mark.parametrize("name", CONFIGS)
def test_padded_batch_gives_each_items_logits(name: str) -> None:
    config = tiny(**CONFIGS[name])
    model = model_of(config)
    source, mask, target_in, target_out = batch(config)
    logits = model(source, mask, target_in)
    for i in range(3):
        n, t = int(mask[i].sum()), int((target_out[i] != PAD).sum())
        alone = model(source[i : i + 1, :n], mask[i : i + 1, :n], target_in[i : i + 1, :t])
        torch.testing.assert_close(logits[i, :t], alone[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_every_attention_plugs_in_and_trains(attention: str) -> None:
    config = tiny(attention=attention, dropout=0.2)
    model = Seq2Seq(config).train()
    assert isinstance(model.attention, LAYER_TYPES[attention])
    source, mask, target_in, target_out = batch(config)
    loss = model.loss(source, mask, target_in, target_out)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads if g is not None)
    assert (
        model.attention.scorer.proj.weight.grad is not None if attention != "mean-field" else True
    )


def test_penalty_of_the_attention_is_added_to_the_loss() -> None:
    config = tiny(attention="segmentation")
    model = model_of(config)
    assert isinstance(model.attention, SegmentationAttention)
    with torch.no_grad():
        model.attention.transitions.fill_(1.0)
    assert model.penalty().item() == pytest.approx(0.005 * 4)  # SAN: 0.005 ||b||^2
    source, mask, target_in, target_out = batch(config)
    logits = model(source, mask, target_in)
    for reduction in ("mean", "sum"):
        nll = sequence_nll(logits, target_out, PAD, reduction)
        total = model.loss(source, mask, target_in, target_out, reduction)
        assert (total - nll).item() == pytest.approx(0.02)
    model.zero_grad()
    model.penalty().backward()
    torch.testing.assert_close(
        model.attention.transitions.grad, torch.full((2, 2), 0.01, dtype=torch.float64)
    )
    assert float(model_of(tiny()).penalty()) == 0.0  # softmax: no penalty


def test_any_layer_with_the_call_and_a_penalty_can_be_injected() -> None:
    class Out(NamedTuple):
        context: Tensor

    class MeanOfMemory(nn.Module):
        """Uniform attention with a made-up penalty: the duck-typed contract."""

        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.tensor(3.0))

        def forward(self, query: Tensor, memory: Tensor, mask: Tensor) -> Out:
            weights = mask.unsqueeze(1).to(memory.dtype) / mask.sum(-1).view(-1, 1, 1)
            context = torch.bmm(weights.expand(-1, query.shape[1], -1), memory)
            return Out(self.weight * context)

        def penalty(self) -> Tensor:
            return self.weight**2

    config = tiny()
    model = Seq2Seq(config, attention=MeanOfMemory())
    assert model.penalty().item() == 9.0
    source, mask, target_in, target_out = batch(config)
    assert model(source, mask, target_in).shape == (3, target_in.shape[1], 7)
    layer = MeanFieldAttention(config.memory_dim, config.hidden_dim, iterations=1)
    model = Seq2Seq(config, attention=layer)
    assert model.attention is layer and torch.isfinite(model(source, mask, target_in)).all()


@pytest.mark.parametrize("feeding", [True, False])
def test_keyed_attention_precomputed_once_gives_the_same_model(feeding: bool) -> None:
    # MeanFieldAttention is a KeyedAttention: its memory projections are computed once per
    # sequence (#19); the same logits, gradients and greedy outputs as calling the layer in
    # full at every step, and forward hooks still see every step
    class Plain(nn.Module):  # the same layer, not keyed
        def __init__(self, layer: nn.Module) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, query: Tensor, memory: Tensor, mask: Tensor) -> Any:
            return self.layer(query, memory, mask)

    config = tiny(input_feeding=feeding)
    torch.manual_seed(0)
    layer = MeanFieldAttention(config.memory_dim, config.hidden_dim, iterations=3)
    keyed = Seq2Seq(config, attention=layer).double()
    plain = Seq2Seq(config, attention=Plain(layer)).double()
    plain.load_state_dict({k.replace("attention.", "attention.layer.", 1): v
                           for k, v in keyed.state_dict().items()})  # fmt: skip
    assert isinstance(keyed.attention, KeyedAttention)
    assert not isinstance(plain.attention, KeyedAttention)
    source, mask, target_in, _ = batch(config)
    calls: list[int] = []
    handle = layer.register_forward_hook(lambda *_: calls.append(1))
    out = keyed(source, mask, target_in)
    handle.remove()
    assert len(calls) == (target_in.shape[1] if feeding else 1)
    ref = plain(source, mask, target_in)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    seed = torch.randn_like(out)
    got = torch.autograd.grad((out * seed).sum(), list(keyed.parameters()))
    want = torch.autograd.grad((ref * seed).sum(), list(plain.parameters()))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    keyed.eval()
    plain.eval()
    assert (
        keyed.beam_search(source, mask, BOS, EOS, 2, 6).tokens
        == plain.beam_search(source, mask, BOS, EOS, 2, 6).tokens
    )


def test_dropout_only_in_training() -> None:
    config = tiny(dropout=0.5)
    model = Seq2Seq(config)
    source, mask, target_in, _ = batch(config)
    assert not torch.equal(model(source, mask, target_in), model(source, mask, target_in))
    model.eval()
    torch.testing.assert_close(model(source, mask, target_in), model(source, mask, target_in))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_runs_without_autograd(mode: str) -> None:
    config = tiny(attention="segmentation", self_attention="structured")
    model = Seq2Seq(config).eval()
    source, mask, target_in, target_out = batch(config)
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        logits = model(source, mask, target_in)
        loss = model.loss(source, mask, target_in, target_out)
        result = model.beam_search(source, mask, BOS, EOS, beam_size=2, max_length=4)
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    assert len(result.tokens) == 3 and torch.isfinite(result.scores).all()


def test_follows_the_device_of_its_inputs() -> None:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    config = tiny(bidirectional=True, encoder_layers=2, decoder_layers=2)
    for device in devices:
        model = Seq2Seq(config).to(device).eval()
        source, mask, target_in, _ = (t.to(device) for t in batch(config))
        assert model(source, mask, target_in).device.type == device
        assert model.beam_search(source, mask, BOS, EOS, 2, 4).scores.device.type == device


# ---- beam search ----------------------------------------------------------------------------
@torch.no_grad()
def exhaustive(
    model: Seq2Seq,
    source: Tensor,
    mask: Tensor,
    max_length: int,
    min_length: int = 0,
    length_penalty: float = 0.0,
) -> tuple[list[int], float]:
    """The best target of one item by scoring every sequence with teacher forcing."""
    vocab = model.config.target_vocab
    tokens = [v for v in range(vocab) if v != EOS]
    best: tuple[float, list[int], float] = (-math.inf, [], -math.inf)
    for length in range(min_length, max_length + 1):
        for seq in itertools.product(tokens, repeat=length):
            target_in = torch.tensor([[BOS, *seq]])
            logp = torch.log_softmax(model(source, mask, target_in)[0], -1)  # [L+1, V]
            score = float(logp[torch.arange(length + 1), torch.tensor([*seq, EOS])].sum())
            norm = score / ((5 + length + 1) / 6) ** length_penalty
            if norm > best[0]:
                best = (norm, list(seq), score)
    return best[1], best[2]


@pytest.mark.parametrize(
    "min_length, length_penalty", [(0, 0.0), (2, 0.0), (0, 1.0)], ids=["plain", "min2", "lp1"]
)
def test_a_beam_as_wide_as_all_sequences_finds_the_best_one(
    min_length: int, length_penalty: float
) -> None:
    config = tiny(target_vocab_size=4, encoder_layers=1, decoder_layers=1)
    model = model_of(config, scale=1.5)  # peaked, varied distributions
    source, mask = ragged([4, 2], 11)
    max_length = 3
    result = model.beam_search(
        source, mask, BOS, EOS, 4**max_length, max_length, min_length, length_penalty
    )
    for i in range(2):
        n = int(mask[i].sum())
        tokens, score = exhaustive(
            model,
            source[i : i + 1, :n],
            mask[i : i + 1, :n],
            max_length,
            min_length,
            length_penalty,
        )
        assert result.tokens[i] == tokens
        assert float(result.scores[i]) == pytest.approx(score, abs=1e-9)
        assert len(tokens) >= min_length


def test_beam_of_one_is_greedy_decoding() -> None:
    config = tiny(attention="sigmoid")
    model = model_of(config, scale=1.0)
    source, mask = ragged([5, 3, 2], 11)
    beam = model.beam_search(source, mask, BOS, EOS, beam_size=1, max_length=6)
    for i in range(3):  # greedy by hand, teacher-forced on its own output
        n = int(mask[i].sum())
        tokens, score = [BOS], 0.0
        for step in range(7):
            with torch.no_grad():
                logits = model(source[i : i + 1, :n], mask[i : i + 1, :n], torch.tensor([tokens]))
            logp = torch.log_softmax(logits[0, -1], -1)
            token = int(logp.argmax()) if step < 6 else EOS
            score += float(logp[token])
            if token == EOS:
                break
            tokens.append(token)
        assert beam.tokens[i] == tokens[1:]
        assert float(beam.scores[i]) == pytest.approx(score, abs=1e-9)


@pytest.mark.parametrize("name", ["nmt", "rnn-structured", "tree-transduction"])
def test_beam_search_of_a_batch_equals_one_item_at_a_time(name: str) -> None:
    config = tiny(**CONFIGS[name], attention="segmentation")
    model = model_of(config, scale=1.0)
    source, mask = ragged([5, 2, 3, 4], 11)
    together = model.beam_search(source, mask, BOS, EOS, beam_size=3, max_length=5)
    wider = model.beam_search(source, mask, BOS, EOS, beam_size=6, max_length=5)
    assert (wider.scores >= together.scores - 1e-9).all()  # here, not in general
    for i in range(4):
        n = int(mask[i].sum())
        alone = model.beam_search(source[i : i + 1, :n], mask[i : i + 1, :n], BOS, EOS, 3, 5)
        assert alone.tokens[0] == together.tokens[i]
        assert float(alone.scores[0]) == pytest.approx(float(together.scores[i]), abs=1e-9)


class MarkovChain:
    """A toy step function: log p(next | last, position) from a table, with the position kept
    in a [1, R] state (batch in dim 1, so the search needs a custom reorder)."""

    def __init__(self, vocab: int, max_length: int) -> None:
        self.table = torch.randn(max_length + 1, vocab, vocab, dtype=torch.float64).log_softmax(-1)

    def step(self, tokens: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        position = state["position"][0]  # [R]
        return self.table[position, tokens], {"position": state["position"] + 1}

    def score(self, seq: list[int]) -> float:
        path = [BOS, *seq, EOS]
        return sum(float(self.table[t, path[t], path[t + 1]]) for t in range(len(seq) + 1))


def test_generic_search_with_a_custom_state_layout() -> None:
    vocab, max_length = 5, 3
    chain = MarkovChain(vocab, max_length)
    state = {"position": torch.zeros(1, 2, dtype=torch.long)}  # 2 identical items
    reorder = lambda s, rows: {"position": s["position"][:, rows]}  # noqa: E731
    result = beam_search(
        chain.step, state, 2, BOS, EOS, vocab**max_length, max_length, reorder=reorder
    )
    others = [v for v in range(vocab) if v != EOS]
    candidates = [
        list(s) for n in range(max_length + 1) for s in itertools.product(others, repeat=n)
    ]
    best = max(candidates, key=chain.score)
    assert result.tokens == [best, best]
    assert float(result.scores[0]) == pytest.approx(chain.score(best), abs=1e-12)
    greedy = greedy_search(chain.step, state, 2, BOS, EOS, max_length, reorder=reorder)
    narrow = beam_search(chain.step, state, 2, BOS, EOS, 1, max_length, reorder=reorder)
    assert greedy.tokens == narrow.tokens and torch.equal(greedy.scores, narrow.scores)


def test_search_arguments_are_checked() -> None:
    chain = MarkovChain(4, 2)
    state = {"position": torch.zeros(1, 1, dtype=torch.long)}
    with pytest.raises(ValueError, match="beam_size"):
        beam_search(chain.step, state, 1, BOS, EOS, 0)
    with pytest.raises(ValueError, match="min_length"):
        beam_search(chain.step, state, 1, BOS, EOS, 2, max_length=2, min_length=3)


# ---- the tree-transduction configuration ----------------------------------------------------
#: parameter names of StructuredSeq2Seq("structured") checkpoints written before the generic model
LEGACY_KEYS = [
    "source_embedding.weight",
    "target_embedding.weight",
    *(
        f"self_attention.scorer.{d}_lstm.{w}_l0"
        for d in ("forward", "backward")
        for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    ),
    "self_attention.scorer.w_head.weight",
    "self_attention.scorer.w_mod.weight",
    "self_attention.scorer.w_mod.bias",
    "self_attention.scorer.s.weight",
    "decoder.weight_ih_l0",
    "decoder.weight_hh_l0",
    "decoder.bias_ih_l0",
    "decoder.bias_hh_l0",
    "attention.scorer.proj.weight",
    "combine.weight",
    "output.weight",
    "output.bias",
]


def test_structured_seq2seq_keeps_its_checkpoint_format() -> None:
    model = StructuredSeq2Seq(30, 8, "structured", 4)
    state = model.state_dict()
    assert list(state) == LEGACY_KEYS
    assert state["combine.weight"].shape == (8, 24) and state["decoder.weight_ih_l0"].shape == (
        32,
        8,
    )
    other = StructuredSeq2Seq(30, 8, "structured", 4)
    other.load_state_dict({k: v.clone() for k, v in state.items()})  # strict
    assert model.encoder is None and model.config.self_attention == "structured"
    assert set(ENCODERS) == {"none", "simple", "structured", "constituency"}
    with pytest.raises(ValueError, match="`encoder` must be one of"):
        StructuredSeq2Seq(30, encoder="tree")


@pytest.mark.parametrize("encoder", ["none", "simple"])
def test_structured_seq2seq_computes_appendix_a2(encoder: str) -> None:
    """Logits from the equations of SAN A.2 written out with the model's own submodules."""
    model = StructuredSeq2Seq(12, 6, encoder, 3).double()
    source, mask = ragged([5, 3], 12)
    target_in = torch.randint(3, 12, (2, 4))
    x = model.source_embedding(source)  # [B, N, l]
    if model.self_attention is not None:
        x = torch.cat([x, model.self_attention(x, mask).parents], -1)  # x^ [B, N, 2l]
    h, _ = model.decoder(model.target_embedding(target_in))  # h' [B, T, l]
    theta = model.attention.scorer.proj(h) @ x.transpose(1, 2)  # x^_i W h'_j [B, T, N]
    alpha = theta.masked_fill(~mask.unsqueeze(1), -math.inf).softmax(-1)
    m = alpha @ x
    expected = model.output(torch.tanh(model.combine(torch.cat([m, h], -1))))
    torch.testing.assert_close(model(source, mask, target_in), expected)
    result = model.beam_search(source, mask, BOS, EOS, 2, 5)
    assert isinstance(result, BeamResult) and len(result.tokens) == 2


def test_readme_example() -> None:
    import torch

    from structattn.models import Seq2Seq, Seq2SeqConfig

    # SAN's NMT model (A.3) at toy size: 2-layer LSTMs, input feeding, segmentation attention
    config = Seq2SeqConfig(
        source_vocab_size=100,  # characters
        target_vocab_size=50,  # words
        embedding_dim=32,
        hidden_dim=32,
        attention="segmentation",  # or softmax, sigmoid, mean-field
    )
    model = Seq2Seq(config)
    source = torch.randint(3, 100, (4, 12))  # [B, N], 0 = padding at the end
    source_mask = source != 0
    target_in = torch.randint(3, 50, (4, 7))  # BOS + target
    target_out = torch.randint(3, 50, (4, 7))  # target + EOS
    loss = model.loss(source, source_mask, target_in, target_out)  # NLL + attention penalty
    loss.backward()
    model.eval()
    best = model.beam_search(source, source_mask, bos=1, eos=2, beam_size=5, max_length=20)
    print(best.tokens[0], best.scores[0])


@pytest.mark.parametrize("attention", ["segmentation", "mean-field"])
def test_loss_falls_on_a_toy_sorting_task(attention: str) -> None:
    """Liu et al.'s sorting task at toy size: a few Adam steps lower the loss."""
    config = tiny(source_vocab_size=10, target_vocab_size=10, attention=attention)
    model = Seq2Seq(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    source = torch.randint(3, 10, (16, 5))
    target = source.sort(-1).values
    target_in = torch.cat([torch.full((16, 1), BOS), target], 1)
    target_out = torch.cat([target, torch.full((16, 1), EOS)], 1)
    losses = []
    for _ in range(30):
        loss = model.loss(source, source != PAD, target_in, target_out)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.7 * losses[0]
