"""Sentence and sentence-pair classifiers of Cheng et al. (2016, sec. 5.2 and 5.3).

* :class:`SentenceEncoder`: an LSTM (``nn.LSTM``) or an LSTMN (:class:`~structattn.nn.LSTMN`)
  of ``num_layers`` layers over embedded words with a length mask; returns the hidden tape
  (zeros at padding), the LSTMN's memory tape and intra-attention.
* :class:`SentenceClassifier` (SST): embeddings -> encoder -> average of the hidden vectors
  over the real words -> 2-layer ReLU classifier with dropout.
* :class:`PairClassifier` (NLI): a premise and a hypothesis encoder; the average of each
  hidden tape, concatenated, into the same classifier. ``kind``:

  - ``"lstm"`` / ``"lstmn"``: two independent encoders (no inter-attention);
  - ``"lstm-attention"``: Rocktaschel et al.'s (2016) word-by-word attention: the hypothesis
    LSTM starts from the premise LSTM's final state (conditional encoding) and
    :class:`WordByWordAttention` attends over the premise tape at every hypothesis word,
    carrying the attended representation ``r_t`` from word to word; the hypothesis tape is
    ``tanh(W^p r_t + W^x h_t)``;
  - ``"lstmn-shallow"``: LSTMN encoders; the hypothesis is read by an
    :class:`~structattn.nn.LSTMNDecoder` with shallow fusion, its tape ``tanh(W [h_t; g~_t])``;
  - ``"lstmn-deep"``: the same decoder with deep fusion (the attended premise memory enters the
    hypothesis memory through a gate), its tape ``h_t``.

Padding never changes an item's result (the LSTM runs left to right, so right padding only
follows the real words; the LSTMN layers mask). Embeddings can start from a pretrained table
and have a per-row gradient scale (:meth:`TextEmbedding.set_gradient_scale`): the paper scales
the gradient of pretrained rows by 0.35 (SST) or freezes them (NLI) in the first epoch.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn

from ..nn.lstmn import LSTMN, LSTMNDecoder

__all__ = [
    "PAIR_MODELS",
    "EncodedSentence",
    "PairClassifier",
    "SentenceClassifier",
    "SentenceEncoder",
    "TextEmbedding",
    "WordByWordAttention",
    "masked_mean",
]

PAIR_MODELS = ("lstm", "lstm-attention", "lstmn", "lstmn-shallow", "lstmn-deep")


class EncodedSentence(NamedTuple):
    """Output of :class:`SentenceEncoder` (zeros at padded positions)."""

    hidden: Tensor  # [B, T, H] top layer's hidden tape
    memory: Tensor | None  # [B, T, H] LSTMN memory tape (None for the LSTM)
    attention: Tensor | None  # [B, L, T, T] LSTMN intra-attention of every layer
    final: tuple[Tensor, Tensor] | None = None  # LSTM (h, c) after each item's last word


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Average of ``x`` [B, T, H] over the True positions of ``mask`` [B, T] -> [B, H]."""
    weights = mask.to(x.dtype).unsqueeze(-1)  # [B, T, 1]
    return (x * weights).sum(1) / weights.sum(1).clamp_min(1.0)


class TextEmbedding(nn.Module):
    """Word embeddings (``padding_idx`` 0) with an optional pretrained start and a per-row
    gradient scale (``[V]``, default all ones)."""

    grad_scale: Tensor  # [V] buffer: the gradient of row i is multiplied by grad_scale[i]

    def __init__(self, vocab_size: int, dim: int, pretrained: Tensor | None = None) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, dim, padding_idx=0)
        if pretrained is not None:
            if tuple(pretrained.shape) != (vocab_size, dim):
                raise ValueError(
                    f"pretrained table {tuple(pretrained.shape)} != ({vocab_size}, {dim})"
                )
            with torch.no_grad():
                self.embedding.weight.copy_(pretrained)
        self.register_buffer("grad_scale", torch.ones(vocab_size), persistent=False)
        self.embedding.weight.register_hook(lambda grad: grad * self.grad_scale.unsqueeze(-1))

    def set_gradient_scale(self, scale: Tensor | float) -> None:
        """Multiply the gradient of row i by ``scale[i]`` (or one number for all rows)."""
        self.grad_scale.copy_(torch.as_tensor(scale, dtype=self.grad_scale.dtype))

    def forward(self, ids: Tensor) -> Tensor:
        """``ids`` [B, T] -> [B, T, D]."""
        return self.embedding(ids)


class SentenceEncoder(nn.Module):
    """``num_layers`` of LSTM or LSTMN over ``inputs`` [B, T, D] with ``mask`` [B, T]."""

    def __init__(
        self,
        kind: Literal["lstm", "lstmn"],
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if kind not in ("lstm", "lstmn"):
            raise ValueError(f"`kind` must be lstm or lstmn, got {kind!r}")
        self.kind = kind
        self.hidden_size = hidden_size
        self.rnn: nn.Module
        if kind == "lstm":
            between = dropout if num_layers > 1 else 0.0
            self.rnn = nn.LSTM(
                input_size, hidden_size, num_layers, batch_first=True, dropout=between
            )
        else:
            self.rnn = LSTMN(input_size, hidden_size, num_layers, dropout)

    def forward(
        self,
        inputs: Tensor,
        mask: Tensor,
        state: tuple[Tensor, Tensor] | None = None,
        final_state: bool = False,
    ) -> EncodedSentence:
        """-> :class:`EncodedSentence` (hidden tape [B, T, H], zeros at padding).

        LSTM only: ``state`` ((h, c), each [num_layers, B, H]) starts the recurrence;
        ``final_state=True`` also returns the state after each item's last real word (the
        sequences are packed by length for that, which needs the lengths on the CPU)."""
        if self.kind == "lstm":
            if not final_state:
                hidden, _ = self.rnn(inputs, state)  # right padding only follows real words
                return EncodedSentence(hidden * mask.unsqueeze(-1).to(hidden.dtype), None, None)
            lengths = mask.sum(1).clamp_min(1).cpu()  # packing's API takes CPU lengths
            packed = nn.utils.rnn.pack_padded_sequence(
                inputs, lengths, batch_first=True, enforce_sorted=False
            )
            out, final = self.rnn(packed, state)
            hidden, _ = nn.utils.rnn.pad_packed_sequence(
                out, batch_first=True, total_length=inputs.shape[1]
            )  # [B, T, H], zeros at padding
            return EncodedSentence(hidden, None, None, final)
        if state is not None or final_state:
            raise ValueError("`state` and `final_state` are for the LSTM encoder")
        out = self.rnn(inputs, mask)
        return EncodedSentence(out.hidden, out.memory, out.layer_attention)


class _Classifier(nn.Sequential):
    """2-layer ReLU classifier with dropout: in -> hidden -> classes."""

    def __init__(self, inputs: int, hidden: int, classes: int, dropout: float) -> None:
        super().__init__(
            nn.Dropout(dropout),
            nn.Linear(inputs, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, classes),
        )


class SentenceClassifier(nn.Module):
    """Embeddings -> encoder -> mean of the hidden tape -> 2-layer ReLU MLP (logits [B, C])."""

    def __init__(
        self,
        kind: Literal["lstm", "lstmn"],
        vocab_size: int,
        embed_dim: int,
        hidden_size: int,
        classes: int,
        num_layers: int = 1,
        dropout: float = 0.5,
        pretrained: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.embedding = TextEmbedding(vocab_size, embed_dim, pretrained)
        self.encoder = SentenceEncoder(kind, embed_dim, hidden_size, num_layers)
        self.classifier = _Classifier(hidden_size, hidden_size, classes, dropout)

    def encode(self, tokens: Tensor, mask: Tensor) -> EncodedSentence:
        """``tokens`` [B, T] ids, ``mask`` [B, T] -> the encoder's tapes."""
        return self.encoder(self.embedding(tokens), mask)

    def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
        """``tokens`` [B, T], ``mask`` [B, T] -> logits [B, C]."""
        return self.classifier(masked_mean(self.encode(tokens, mask).hidden, mask))


class WordByWordAttention(nn.Module):
    """Word-by-word attention of Rocktaschel et al. (2016, sec. 2.4), hidden size H.

    For every hypothesis state ``h_t`` (in order): ``M_t = tanh(W^y Y + (W^h h_t +
    W^r r_{t-1}) 1^T)``, ``alpha_t = softmax(w^T M_t)`` over the real premise words,
    ``r_t = Y alpha_t + tanh(W^t r_{t-1})`` (``r_0 = 0``); the output tape is
    ``tanh(W^p r_t + W^x h_t)``. Padded hypothesis positions keep ``r`` unchanged and give
    zeros."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        h = hidden_size
        self.premise_proj = nn.Linear(h, h, bias=False)  # W^y
        self.hypothesis_proj = nn.Linear(h, h, bias=False)  # W^h
        self.carry_proj = nn.Linear(h, h, bias=False)  # W^r
        self.score = nn.Linear(h, 1, bias=False)  # w
        self.carry = nn.Linear(h, h, bias=False)  # W^t
        self.out_attended = nn.Linear(h, h, bias=False)  # W^p
        self.out_hidden = nn.Linear(h, h, bias=False)  # W^x

    def forward(
        self, hypothesis: Tensor, hypothesis_mask: Tensor, premise: Tensor, premise_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``hypothesis`` [B, T, H], ``premise`` [B, S, H] with masks [B, T], [B, S] ->
        (tape [B, T, H], attention [B, T, S]; zeros at padding)."""
        keys = self.premise_proj(premise)  # [B, S, H]
        queries = self.hypothesis_proj(hypothesis)  # [B, T, H]
        blocked = ~premise_mask  # [B, S]
        low = torch.finfo(keys.dtype).min
        carried = hypothesis.new_zeros(hypothesis.shape[0], hypothesis.shape[2])  # r: [B, H]
        tape, weights = [], []
        for t in range(hypothesis.shape[1]):  # sequential: r_t depends on r_{t-1}
            m = torch.tanh(keys + (queries[:, t] + self.carry_proj(carried)).unsqueeze(1))
            alpha = torch.softmax(self.score(m).squeeze(-1).masked_fill(blocked, low), -1)
            alpha = alpha.masked_fill(blocked, 0.0)  # [B, S] (an empty premise: zeros)
            step = torch.bmm(alpha.unsqueeze(1), premise).squeeze(1) + torch.tanh(
                self.carry(carried)
            )  # [B, H]
            carried = torch.where(hypothesis_mask[:, t, None], step, carried)
            tape.append(carried)
            weights.append(alpha)
        keep = hypothesis_mask.unsqueeze(-1)  # [B, T, 1]
        attended = torch.stack(tape, 1)  # [B, T, H]
        out = torch.tanh(self.out_attended(attended) + self.out_hidden(hypothesis))
        return out.masked_fill(~keep, 0.0), torch.stack(weights, 1).masked_fill(~keep, 0.0)


class PairClassifier(nn.Module):
    """Premise and hypothesis encoders (see the module docstring for ``kind``), averaged
    tapes concatenated into a 2-layer ReLU MLP (logits [B, C])."""

    def __init__(
        self,
        kind: str,
        vocab_size: int,
        embed_dim: int,
        hidden_size: int,
        classes: int = 3,
        dropout: float = 0.2,
        pretrained: Tensor | None = None,
    ) -> None:
        super().__init__()
        if kind not in PAIR_MODELS:
            raise ValueError(f"`kind` must be one of {PAIR_MODELS}, got {kind!r}")
        self.kind = kind
        cell: Literal["lstm", "lstmn"] = "lstmn" if kind.startswith("lstmn") else "lstm"
        self.embedding = TextEmbedding(vocab_size, embed_dim, pretrained)
        self.premise = SentenceEncoder(cell, embed_dim, hidden_size)
        self.hypothesis: nn.Module
        self.attention: WordByWordAttention | None = None
        self.combine: nn.Linear | None = None
        if kind in ("lstmn-shallow", "lstmn-deep"):
            self.hypothesis = LSTMNDecoder(embed_dim, hidden_size, kind.split("-")[1])
        else:
            self.hypothesis = SentenceEncoder(cell, embed_dim, hidden_size)
        if kind == "lstm-attention":
            self.attention = WordByWordAttention(hidden_size)
        if kind == "lstmn-shallow":
            self.combine = nn.Linear(2 * hidden_size, hidden_size)
        self.dropout = nn.Dropout(dropout)
        self.classifier = _Classifier(2 * hidden_size, hidden_size, classes, dropout)

    def encode(
        self, premise: Tensor, premise_mask: Tensor, hypothesis: Tensor, hypothesis_mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Tapes of both sentences: premise [B, S, H], hypothesis [B, T, H] (zeros at
        padding) and the inter-attention [B, T, S] (None without one)."""
        conditional = self.attention is not None  # Rocktaschel et al.'s conditional encoding
        source = self.premise(
            self.dropout(self.embedding(premise)), premise_mask, final_state=conditional
        )
        target_in = self.dropout(self.embedding(hypothesis))  # [B, T, D]
        inter: Tensor | None = None
        keep = hypothesis_mask.unsqueeze(-1)  # [B, T, 1]
        if isinstance(self.hypothesis, LSTMNDecoder):
            out = self.hypothesis(
                target_in, source.hidden, source.memory, hypothesis_mask, premise_mask
            )
            tape, inter = out.hidden, out.source_attention
            if self.combine is not None:  # shallow fusion: combine h_t with g~_t
                tape = torch.tanh(self.combine(torch.cat([tape, out.context], -1)))
                tape = tape.masked_fill(~keep, 0.0)
        elif self.attention is not None:
            tape = self.hypothesis(target_in, hypothesis_mask, source.final).hidden  # [B, T, H]
            tape, inter = self.attention(tape, hypothesis_mask, source.hidden, premise_mask)
        else:
            tape = self.hypothesis(target_in, hypothesis_mask).hidden  # [B, T, H]
        return source.hidden, tape, inter

    def forward(
        self, premise: Tensor, premise_mask: Tensor, hypothesis: Tensor, hypothesis_mask: Tensor
    ) -> Tensor:
        """ids and masks of both sentences ([B, S], [B, T]) -> logits [B, C]."""
        source, target, _ = self.encode(premise, premise_mask, hypothesis, hypothesis_mask)
        features = torch.cat(
            [masked_mean(source, premise_mask), masked_mean(target, hypothesis_mask)], -1
        )  # [B, 2H]
        return self.classifier(features)
