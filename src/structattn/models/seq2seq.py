r"""Attentional encoder-decoders: one generic :class:`Seq2Seq` and the SAN tree-transduction model.

:class:`Seq2Seq` covers the encoder-decoders of the papers:

* tree transduction (Kim et al. 2017, sec. 4.1, A.2): embeddings-only encoder with syntactic
  self-attention, one-layer decoder, softmax attention (:class:`StructuredSeq2Seq`);
* NMT (sec. 4.2, A.3; Luong et al. 2015): multi-layer LSTM encoder and decoder with input
  feeding, softmax / sigmoid / segmentation attention, character- or word-level source;
* mean-field attention (Liu et al., Algorithm 2): the same with :class:`MeanFieldAttention`.

The model, with source x_1..x_n, target inputs y_1..y_m (BOS first) and l = ``hidden_dim``:

.. math::
    h_i &= \text{LSTM}_{enc}(x_i, h_{i-1})
        \quad (\text{or } h_i = x_i \text{ with no encoder layers}) \\
    \hat h_i &= [h_i; \textstyle\sum_k p(z_{ki} = 1 \mid x)\, h_k]
        \quad (\text{with encoder self-attention}; \hat h_i = h_i \text{ otherwise}) \\
    h'_j &= \text{LSTM}_{dec}([y_j; \tilde h_{j-1}], h'_{j-1})
        \quad (\text{input feeding}; [y_j] \text{ without}) \\
    c_j &= \text{attention}(h'_j, \hat h_{1..n}).\text{context} \\
    \tilde h_j &= \tanh(U [c_j; h'_j]) \\
    p(y_{j+1} \mid x, y_{1..j}) &= \text{softmax}(V \tilde h_j + b)

Decoding is :func:`~structattn.models.decoding.beam_search` against :meth:`Seq2Seq.decode_step`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ..attention import (
    MeanFieldAttention,
    SegmentationAttention,
    SigmoidAttention,
    SoftmaxAttention,
    SpanSelfAttention,
    SpanSelfAttentionOutput,
    SyntacticAttention,
    SyntacticAttentionOutput,
)
from ..names import (
    MEMORY_STRUCTURES,
    VARIANT_STRUCTURES,
    ArcStructure,
    MemoryStructure,
    SelfAttentionVariant,
    SpanStructure,
)
from .decoding import BeamResult, beam_search

__all__ = [
    "ATTENTIONS",
    "ENCODERS",
    "SELF_ATTENTION",
    "BeamResult",
    "DecoderState",
    "EncoderOutput",
    "KeyedAttention",
    "RecurrentEncoder",
    "Seq2Seq",
    "Seq2SeqConfig",
    "StructuredSeq2Seq",
    "make_attention",
    "sequence_nll",
    "source_lengths",
]

#: encoder self-attention: none, softmax ("simple") or projective tree-CRF ("structured")
#: parents, as the ``structure`` of :class:`SyntacticAttention`; or constituents of a
#: constituency-tree CRF ("constituency", :class:`SpanSelfAttention`)
SELF_ATTENTION: dict[SelfAttentionVariant, ArcStructure | SpanStructure | None] = {
    variant: structure for variant, structure in VARIANT_STRUCTURES.items()
}
SELF_ATTENTION["constituency"] = "constituency"
#: former name of :data:`SELF_ATTENTION` (the ``encoder`` argument of StructuredSeq2Seq)
ENCODERS = SELF_ATTENTION
#: decoder attention layers by name (see :func:`make_attention`)
ATTENTIONS = MEMORY_STRUCTURES
INIT_DECODER = ("zeros", "final")


@dataclass(frozen=True)
class Seq2SeqConfig:
    """Settings of a :class:`Seq2Seq` (defaults: SAN's NMT model, Appendix A.3)."""

    source_vocab_size: int  # source token ids (characters for the char-level NMT source)
    target_vocab_size: int | None = None  # target ids; None = the source vocabulary (shared)
    embedding_dim: int = 500  # size of the source and target embeddings
    hidden_dim: int = 500  # l: size of the encoder outputs and of the decoder LSTM
    encoder_layers: int = 2  # recurrent encoder layers (0 = embeddings only, SAN A.2)
    bidirectional: bool = False  # biLSTM encoder, hidden_dim / 2 per direction
    self_attention: SelfAttentionVariant = "none"  # none|simple|structured|constituency
    parser_hidden: int = 50  # per-direction size of the self-attention's parsing biLSTM
    prepend_root: bool = True  # self-attention ROOT: learned (True) or source position 0 ('$')
    decoder_layers: int = 2  # decoder LSTM layers
    attention: MemoryStructure = "softmax"  # decoder's: softmax|sigmoid|segmentation|mean-field
    scorer: str = "bilinear"  # potentials h_i^T W h'_j (softmax, sigmoid, segmentation)
    input_feeding: bool = True  # Luong: the decoder also reads the last attentional vector
    init_decoder: str = "final"  # decoder start: zeros | final (encoder's last h, c per layer)
    dropout: float = 0.3  # between LSTM layers and on the attentional vector
    share_embeddings: bool = False  # one embedding table for source and target
    padding_idx: int = 0  # the padding token id (source and target)

    def __post_init__(self) -> None:
        def positive(name: str, value: int) -> None:
            if value < 1:
                raise ValueError(f"`{name}` must be >= 1, got {value}")

        positive("source_vocab_size", self.source_vocab_size)
        positive("target_vocab_size", self.target_vocab)
        positive("embedding_dim", self.embedding_dim)
        positive("hidden_dim", self.hidden_dim)
        positive("decoder_layers", self.decoder_layers)
        if self.encoder_layers < 0:
            raise ValueError(f"`encoder_layers` must be >= 0, got {self.encoder_layers}")
        if self.self_attention not in SELF_ATTENTION:
            raise ValueError(
                f"`self_attention` must be one of {tuple(SELF_ATTENTION)}, "
                f"got {self.self_attention!r}"
            )
        if self.attention not in ATTENTIONS:
            raise ValueError(f"`attention` must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.init_decoder not in INIT_DECODER:
            raise ValueError(
                f"`init_decoder` must be one of {INIT_DECODER}, got {self.init_decoder!r}"
            )
        if self.init_decoder == "final" and self.encoder_layers != self.decoder_layers:
            raise ValueError(
                "`init_decoder='final'` needs as many encoder as decoder layers, got "
                f"{self.encoder_layers} and {self.decoder_layers}"
            )
        if self.bidirectional and (self.encoder_layers == 0 or self.hidden_dim % 2):
            raise ValueError("`bidirectional` needs encoder_layers >= 1 and an even hidden_dim")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {self.dropout}")
        if self.share_embeddings and self.target_vocab != self.source_vocab_size:
            raise ValueError("`share_embeddings` needs one vocabulary for source and target")
        if not 0 <= self.padding_idx < min(self.source_vocab_size, self.target_vocab):
            raise ValueError(f"`padding_idx` must be a token id, got {self.padding_idx}")

    @property
    def target_vocab(self) -> int:
        """Size of the target vocabulary."""
        return self.source_vocab_size if self.target_vocab_size is None else self.target_vocab_size

    @property
    def encoder_dim(self) -> int:
        """Size of h_i: the recurrent encoder's outputs, or the embeddings without one."""
        return self.hidden_dim if self.encoder_layers else self.embedding_dim

    @property
    def memory_dim(self) -> int:
        """Size of the attended memory h^_i ([h_i; parents] with self-attention)."""
        return self.encoder_dim * (1 if SELF_ATTENTION[self.self_attention] is None else 2)


def make_attention(
    name: MemoryStructure, memory_dim: int, query_dim: int, scorer: str = "bilinear"
) -> nn.Module:
    """A decoder attention layer by name: ``"softmax"``, ``"sigmoid"``, ``"segmentation"``
    (SAN's settings: lambda = 2, penalty 0.005 on b) or ``"mean-field"`` (Liu et al., k = 3;
    its potentials have their own MLPs, ``scorer`` is not used)."""
    if name == "softmax":
        return SoftmaxAttention(memory_dim, query_dim, scorer)
    if name == "sigmoid":
        return SigmoidAttention(memory_dim, query_dim, scorer)
    if name == "segmentation":
        return SegmentationAttention(memory_dim, query_dim, scorer)
    if name == "mean-field":
        return MeanFieldAttention(memory_dim, query_dim)
    raise ValueError(f"`attention` must be one of {ATTENTIONS}, got {name!r}")


def sequence_nll(
    logits: Tensor, target: Tensor, padding_idx: int = 0, reduction: str = "mean"
) -> Tensor:
    """Token cross-entropy of ``logits`` [B, T, V] for ``target`` [B, T] without the padding:
    ``"sum"`` over tokens, ``"mean"`` per real token, or ``"none"`` ([B, T], 0 at padding)."""
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"`reduction` must be 'sum', 'mean' or 'none', got {reduction!r}")
    nll = F.cross_entropy(
        logits.flatten(0, 1), target.flatten(), ignore_index=padding_idx, reduction=reduction
    )
    return nll.view_as(target) if reduction == "none" else nll


def source_lengths(source: Tensor, source_mask: Tensor) -> Tensor:
    """Lengths [B] of a source [B, N] from its mask: a BoolTensor [B, N], True at real
    positions, which come first, at least one per item (ValueError otherwise; one host sync)."""
    if source.dim() != 2:
        raise ValueError(f"`source` must have shape [B, N], got {tuple(source.shape)}")
    if (
        not isinstance(source_mask, Tensor)
        or source_mask.dtype != torch.bool
        or source_mask.shape != source.shape
    ):
        got = tuple(source_mask.shape) if isinstance(source_mask, Tensor) else source_mask
        raise ValueError(
            f"`source_mask` must be a BoolTensor of the source's shape {tuple(source.shape)} "
            f"with True at real positions, got {got}"
        )
    lengths = source_mask.sum(-1)  # [B]
    positions = torch.arange(source.shape[1], device=source_mask.device)
    prefix = positions < lengths.unsqueeze(-1)  # [B, N]
    if bool((prefix != source_mask).any() | (lengths == 0).any()):
        raise ValueError(
            "`source_mask` must put the real positions first (padding at the end) and leave "
            "at least one per item"
        )
    return lengths


@runtime_checkable
class KeyedAttention(Protocol):
    """An attention layer whose query-independent work on the memory can be done once per
    sequence: ``keys = precompute(memory, mask)``, then ``layer(query, memory, mask,
    keys=keys)`` at every decoder step (the same output as without ``keys``)."""

    def precompute(self, memory: Tensor, mask: Tensor | None = None) -> Any: ...


class EncoderOutput(NamedTuple):
    """What the decoder attends to."""

    memory: Tensor  # [B, N, M] h^_i (M = config.memory_dim)
    # the encoder's parse, if any (SpanSelfAttentionOutput for "constituency")
    self_attention: SyntacticAttentionOutput | SpanSelfAttentionOutput | None


class DecoderState(NamedTuple):
    """The decoder's recurrent state, batch first (rows can be reordered by beam search)."""

    hidden: Tensor  # [B, L, l] h' of every decoder layer
    cell: Tensor  # [B, L, l] LSTM cells
    feed: Tensor  # [B, l] the last attentional vector h~ (0 at the start)


class RecurrentEncoder(nn.Module):
    """Multi-layer (bi)LSTM over padded, batch-first sequences.

    ``forward(x [B, N, D], lengths [B], final=True) -> (outputs [B, N, H], (h, c) | None)``
    with outputs 0 at padding and the last state of every layer ``h, c`` [B, L, H] taken at
    each item's own length (the two directions side by side: hidden_dim / 2 each).

    A bidirectional encoder, or one asked for its final states, packs the sequences so that
    padding never reaches real positions; packing needs the lengths on the host (one
    transfer per batch, as ``pack_padded_sequence`` requires). A unidirectional encoder
    without final states runs on the padded batch directly (padding at the end cannot reach
    earlier positions).
    """

    def __init__(
        self,
        input_dim: int,
        hidden_dim: int,
        num_layers: int,
        bidirectional: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.directions = 2 if bidirectional else 1
        self.lstm = nn.LSTM(
            input_dim,
            hidden_dim // self.directions,
            num_layers,
            batch_first=True,
            bidirectional=bidirectional,
            dropout=dropout if num_layers > 1 else 0.0,
        )

    def forward(
        self, x: Tensor, lengths: Tensor, final: bool = True
    ) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        if self.directions == 1 and not final:
            outputs, _ = self.lstm(x)  # [B, N, H]
            keep = torch.arange(x.shape[1], device=x.device) < lengths.unsqueeze(-1)  # [B, N]
            return outputs * keep.unsqueeze(-1).to(outputs.dtype), None
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        outputs, (h, c) = self.lstm(packed)
        outputs, _ = pad_packed_sequence(outputs, batch_first=True, total_length=x.shape[1])
        return outputs, (self._per_layer(h), self._per_layer(c))

    def _per_layer(self, state: Tensor) -> Tensor:
        """[L * dirs, B, H / dirs] -> [B, L, H] (directions side by side)."""
        layers_dirs, batch, size = state.shape
        layers = layers_dirs // self.directions
        state = state.view(layers, self.directions, batch, size)  # [L, dirs, B, H/dirs]
        return state.permute(2, 0, 1, 3).reshape(batch, layers, self.directions * size)


class Seq2Seq(nn.Module):
    r"""Encoder-decoder with pluggable decoder attention (see the module docstring).

    Args:
        config: the architecture (:class:`Seq2SeqConfig`).
        attention: the decoder attention layer; default ``make_attention(config.attention,
            config.memory_dim, config.hidden_dim, config.scorer)``. Any module called as
            ``attention(query [B, T, l], memory [B, N, M], mask [B, N]) -> out`` with
            ``out.context`` [B, T, M] fits; a ``penalty()`` method, if it has one, is added
            to the loss by :meth:`penalty` / :meth:`loss`. A layer that is a
            :class:`KeyedAttention` (e.g. :class:`MeanFieldAttention`) gets its
            ``precompute(memory, mask)`` once per sequence as ``keys=`` at every step.

    Submodules: ``source_embedding``, ``target_embedding`` (the same module with
    ``share_embeddings``), ``encoder`` (:class:`RecurrentEncoder`, None with 0 layers),
    ``self_attention`` (the encoder's :class:`SyntacticAttention` or None), ``decoder``
    (``nn.LSTM``), ``attention`` (the decoder's), ``combine`` (U), ``output`` (V, b).

    Inputs: ``source`` [B, N] ids, ``source_mask`` [B, N] bool (True = real, padding at the
    end, at least one real token), ``target_in`` [B, T] (BOS + target, padded at the end).

    Example:
        >>> config = Seq2SeqConfig(20, 15, embedding_dim=8, hidden_dim=8, dropout=0.0)
        >>> model = Seq2Seq(config)
        >>> source, mask = torch.randint(1, 20, (2, 5)), torch.ones(2, 5, dtype=torch.bool)
        >>> model(source, mask, torch.randint(1, 15, (2, 4))).shape
        torch.Size([2, 4, 15])
    """

    def __init__(self, config: Seq2SeqConfig, attention: nn.Module | None = None) -> None:
        super().__init__()
        self.config = config
        self.padding_idx = config.padding_idx
        dim, hidden = config.embedding_dim, config.hidden_dim
        # registration order = parameters() order, which fixes a seeded initialisation
        self.source_embedding = nn.Embedding(config.source_vocab_size, dim, config.padding_idx)
        self.target_embedding = (
            self.source_embedding
            if config.share_embeddings
            else nn.Embedding(config.target_vocab, dim, config.padding_idx)
        )
        self.encoder = (
            RecurrentEncoder(
                dim, hidden, config.encoder_layers, config.bidirectional, config.dropout
            )
            if config.encoder_layers
            else None
        )
        structure = SELF_ATTENTION[config.self_attention]
        self.self_attention: SyntacticAttention | SpanSelfAttention | None = None
        if structure == "constituency" or structure == "semi-markov":  # no ROOT: spans
            self.self_attention = SpanSelfAttention(
                config.encoder_dim, config.parser_hidden, structure=structure
            )
        elif structure is not None:
            self.self_attention = SyntacticAttention(
                config.encoder_dim,
                config.parser_hidden,
                structure=structure,
                prepend_root=config.prepend_root,
            )
        self.decoder = nn.LSTM(
            dim + (hidden if config.input_feeding else 0),
            hidden,
            config.decoder_layers,
            batch_first=True,
            dropout=config.dropout if config.decoder_layers > 1 else 0.0,
        )
        self.attention = (
            attention
            if attention is not None
            else make_attention(config.attention, config.memory_dim, hidden, config.scorer)
        )
        self.combine = nn.Linear(config.memory_dim + hidden, hidden, bias=False)  # U
        self.output = nn.Linear(hidden, config.target_vocab)  # V, b
        self.dropout = nn.Dropout(config.dropout)

    # ---- encoder ----------------------------------------------------------------------------
    def encode(self, source: Tensor, source_mask: Tensor) -> EncoderOutput:
        """The memory h^ [B, N, M] (and the self-attention's parse, if any)."""
        return self._encode(source, source_mask)[0]

    def _encode(
        self, source: Tensor, source_mask: Tensor
    ) -> tuple[EncoderOutput, tuple[Tensor, Tensor] | None]:
        """The encoder output and the encoder's final (h, c) [B, L, l] (None without LSTM)."""
        lengths = source_lengths(source, source_mask)
        x = self.source_embedding(source)  # [B, N, E]
        final = None
        if self.encoder is not None:
            need_final = self.config.init_decoder == "final"
            x, final = self.encoder(x, lengths, need_final)  # [B, N, l]
        if self.self_attention is None:
            return EncoderOutput(x, None), final
        parse = self.self_attention(x, source_mask)
        context = parse.parents if isinstance(parse, SyntacticAttentionOutput) else parse.context
        return EncoderOutput(torch.cat([x, context], dim=-1), parse), final  # [B, N, 2l]

    def init_state(self, source: Tensor, source_mask: Tensor) -> tuple[EncoderOutput, DecoderState]:
        """Encode the source; the decoder's start state (zeros or the encoder's last)."""
        encoded, final = self._encode(source, source_mask)
        batch, layers, hidden = source.shape[0], self.config.decoder_layers, self.config.hidden_dim
        memory = encoded.memory
        if self.config.init_decoder == "final" and final is not None:
            h, c = final
        else:
            h = c = memory.new_zeros(batch, layers, hidden)
        return encoded, DecoderState(h, c, memory.new_zeros(batch, hidden))

    # ---- decoder ----------------------------------------------------------------------------
    def precompute(self, memory: Tensor, source_mask: Tensor) -> Any:
        """The attention's per-sequence keys for :meth:`decode_step` (None unless the
        attention is a :class:`KeyedAttention`)."""
        if isinstance(self.attention, KeyedAttention):
            return self.attention.precompute(memory, source_mask)
        return None

    def _attend(
        self, hidden: Tensor, memory: Tensor, source_mask: Tensor, keys: Any = None
    ) -> Tensor:
        """Attentional vectors h~ = tanh(U [c; h']) [B, T, l] for decoder states h' [B, T, l]."""
        if keys is None:
            context = self.attention(hidden, memory, source_mask).context  # c [B, T, M]
        else:
            context = self.attention(hidden, memory, source_mask, keys=keys).context
        return torch.tanh(self.combine(torch.cat([context, hidden], dim=-1)))

    def _drop(self, x: Tensor) -> Tensor:
        return self.dropout(x) if self.config.dropout > 0 else x

    def _decode(
        self,
        inputs: Tensor,
        state: DecoderState,
        memory: Tensor,
        source_mask: Tensor,
        keys: Any = None,
    ) -> tuple[Tensor, DecoderState]:
        """One decoder step: embedded inputs [B, E] -> attentional vector h~ [B, l], state."""
        if self.config.input_feeding:
            inputs = torch.cat([inputs, state.feed], dim=-1)  # [B, E + l]
        hx = (state.hidden.transpose(0, 1).contiguous(), state.cell.transpose(0, 1).contiguous())
        hidden, (h, c) = self.decoder(inputs.unsqueeze(1), hx)  # [B, 1, l], [L, B, l]
        attentional = self._attend(hidden, memory, source_mask, keys)[:, 0]  # [B, l]
        return attentional, DecoderState(h.transpose(0, 1), c.transpose(0, 1), attentional)

    def decode_step(
        self,
        tokens: Tensor,
        state: DecoderState,
        memory: Tensor,
        source_mask: Tensor,
        keys: Any = None,
    ) -> tuple[Tensor, DecoderState]:
        """Logits [B, V] of the token after ``tokens`` [B], and the next state (``keys``:
        :meth:`precompute` of ``memory``, optional)."""
        embedded = self.target_embedding(tokens)  # [B, E]
        attentional, state = self._decode(embedded, state, memory, source_mask, keys)
        return self.output(self._drop(attentional)), state

    def forward(self, source: Tensor, source_mask: Tensor, target_in: Tensor) -> Tensor:
        """Teacher-forced logits [B, T, V] for target inputs [B, T] (BOS + tokens)."""
        encoded, state = self.init_state(source, source_mask)
        memory = encoded.memory
        keys = self.precompute(memory, source_mask)  # once per sequence (None: not keyed)
        inputs = self.target_embedding(target_in)  # [B, T, E]
        if not self.config.input_feeding:  # all steps in one LSTM call
            hx = (
                state.hidden.transpose(0, 1).contiguous(),
                state.cell.transpose(0, 1).contiguous(),
            )
            hidden, _ = self.decoder(inputs, hx)  # [B, T, l]
            attentional = self._attend(hidden, memory, source_mask, keys)  # [B, T, l]
        else:  # h~_{j-1} is an input of step j
            steps = []
            for j in range(inputs.shape[1]):
                out, state = self._decode(inputs[:, j], state, memory, source_mask, keys)
                steps.append(out)
            attentional = torch.stack(steps, dim=1)  # [B, T, l]
        return self.output(self._drop(attentional))

    # ---- training ---------------------------------------------------------------------------
    def penalty(self) -> Tensor:
        """Sum of the attention layers' ``penalty()`` (e.g. segmentation's L2 on b); 0 if none."""
        total = self.output.bias.new_zeros(())
        for layer in (self.self_attention, self.attention):
            penalty = getattr(layer, "penalty", None)
            if callable(penalty):
                total = total + penalty()
        return total

    def loss(
        self,
        source: Tensor,
        source_mask: Tensor,
        target_in: Tensor,
        target_out: Tensor,
        reduction: str = "mean",
    ) -> Tensor:
        """Teacher-forced NLL of ``target_out`` [B, T] (target + EOS, padded with
        ``padding_idx``), ``"mean"`` per token or ``"sum"``, plus :meth:`penalty` (once)."""
        if reduction not in ("mean", "sum"):
            raise ValueError(f"`reduction` must be 'mean' or 'sum', got {reduction!r}")
        logits = self(source, source_mask, target_in)
        return sequence_nll(logits, target_out, self.padding_idx, reduction) + self.penalty()

    # ---- inference --------------------------------------------------------------------------
    @torch.no_grad()
    def beam_search(
        self,
        source: Tensor,
        source_mask: Tensor,
        bos: int,
        eos: int,
        beam_size: int = 5,
        max_length: int = 200,
        min_length: int = 0,
        length_penalty: float = 0.0,
    ) -> BeamResult:
        """Batched beam search (greedy with ``beam_size=1``): the best target per item, see
        :func:`~structattn.models.decoding.beam_search`. Call ``model.eval()`` first."""
        encoded, state = self.init_state(source, source_mask)
        memory = encoded.memory.repeat_interleave(beam_size, dim=0)  # [B*K, N, M]
        mask = source_mask.repeat_interleave(beam_size, dim=0)  # [B*K, N]
        keys = self.precompute(memory, mask)

        def step(tokens: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
            logits, state = self.decode_step(tokens, state, memory, mask, keys)
            return F.log_softmax(logits, dim=-1), state

        return beam_search(
            step,
            state,
            source.shape[0],
            bos,
            eos,
            beam_size,
            max_length,
            min_length,
            length_penalty,
        )


class StructuredSeq2Seq(Seq2Seq):
    r"""The tree-transduction model of SAN (Appendix A.2), a configuration of :class:`Seq2Seq`.

    Source x_1..x_n (position 0 is the root symbol ``$``) with embeddings x_i. Encoder
    (no recurrent layers):

    * ``"none"``: x^_i = x_i;
    * ``"simple"``: x^_i = [x_i; sum_k softmax_k(theta_ki) x_k];
    * ``"structured"``: x^_i = [x_i; sum_k p(z_ki = 1 | x) x_k] (projective tree CRF marginals);
    * ``"constituency"``: x^_i = [x_i; sum_k w_ik x_k] with w the expected normalised
      membership of k in i's constituents under a constituency-tree CRF over the source
      (:class:`SpanSelfAttention`, :func:`~structattn.attention.spans.span_membership`; not
      in the paper);

    with theta from a biLSTM over the source embeddings (:class:`SyntacticAttention`).
    Decoder (one layer, no input feeding, zero start state): h'_j = LSTM(y_j, h'_{j-1});
    alpha = softmax_i(x^_i W h'_j); m_j = sum_i alpha_i x^_i; h_j = tanh(U [m_j; h'_j]);
    p(y_{j+1}) = softmax(V h_j + b).

    Args:
        vocab_size: size of the shared source/target vocabulary.
        dim: l, embedding and LSTM size (paper: 50).
        encoder: the encoder's self-attention: ``"none"``, ``"simple"``, ``"structured"`` or
            ``"constituency"``.
        parser_hidden: size of each parsing-LSTM direction (paper: 50).
        padding_idx: the padding token id.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int = 50,
        encoder: SelfAttentionVariant = "structured",
        parser_hidden: int = 50,
        padding_idx: int = 0,
    ) -> None:
        if encoder not in SELF_ATTENTION:
            raise ValueError(f"`encoder` must be one of {tuple(SELF_ATTENTION)}, got {encoder!r}")
        super().__init__(
            Seq2SeqConfig(
                source_vocab_size=vocab_size,
                embedding_dim=dim,
                hidden_dim=dim,
                encoder_layers=0,
                self_attention=encoder,
                parser_hidden=parser_hidden,
                prepend_root=False,  # the source starts with the root symbol '$'
                decoder_layers=1,
                attention="softmax",
                scorer="bilinear",
                input_feeding=False,
                init_decoder="zeros",
                dropout=0.0,
                padding_idx=padding_idx,
            )
        )
