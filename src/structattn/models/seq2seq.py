"""Encoder-decoder with optional syntactic self-attention (Kim et al. 2017, Appendix A.2)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import SoftmaxAttention, SyntacticAttention, SyntacticAttentionOutput

__all__ = ["ENCODERS", "BeamResult", "StructuredSeq2Seq"]

#: encoder variants: no self-attention, softmax ("simple") or tree-CRF ("structured") parents
ENCODERS = {"none": None, "simple": "softmax", "structured": "projective"}


class BeamResult(NamedTuple):
    """Best hypothesis per item: token ids (no BOS/EOS) and total log-probability."""

    tokens: list[list[int]]
    scores: Tensor  # [B]


class StructuredSeq2Seq(nn.Module):
    r"""The tree-transduction model of SAN (Appendix A.2).

    Source x_1..x_n (position 0 is the root symbol ``$``) with embeddings x_i. Encoder:

    * ``"none"``: x^_i = x_i;
    * ``"simple"``: x^_i = [x_i; sum_k softmax_k(theta_ki) x_k];
    * ``"structured"``: x^_i = [x_i; sum_k p(z_ki = 1 | x) x_k] (projective tree CRF marginals);

    with theta from a biLSTM over the source embeddings (:class:`SyntacticAttention`).
    Decoder: h'_j = LSTM(y_j, h'_{j-1}); alpha = softmax_i(x^_i W h'_j); m_j = sum_i alpha_i x^_i;
    h_j = tanh(U [m_j; h'_j]); p(y_{j+1}) = softmax(V h_j + b).

    Args:
        vocab_size: size of the shared source/target vocabulary.
        dim: l, embedding and LSTM size (paper: 50).
        encoder: ``"none"``, ``"simple"`` or ``"structured"``.
        parser_hidden: size of each parsing-LSTM direction (paper: 50).
        padding_idx: the padding token id.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int = 50,
        encoder: str = "structured",
        parser_hidden: int = 50,
        padding_idx: int = 0,
    ) -> None:
        super().__init__()
        if encoder not in ENCODERS:
            raise ValueError(f"`encoder` must be one of {tuple(ENCODERS)}, got {encoder!r}")
        self.encoder = encoder
        self.padding_idx = padding_idx
        self.source_embedding = nn.Embedding(vocab_size, dim, padding_idx=padding_idx)
        self.target_embedding = nn.Embedding(vocab_size, dim, padding_idx=padding_idx)
        structure = ENCODERS[encoder]
        self.self_attention = (
            None
            if structure is None
            else SyntacticAttention(dim, parser_hidden, structure=structure, prepend_root=False)
        )
        source_dim = dim if structure is None else 2 * dim
        self.decoder = nn.LSTM(dim, dim, batch_first=True)
        self.attention = SoftmaxAttention(source_dim, dim, scorer="bilinear")  # x^_i W h'_j
        self.combine = nn.Linear(source_dim + dim, dim, bias=False)  # U
        self.output = nn.Linear(dim, vocab_size)  # V, b

    def encode(
        self, source: Tensor, source_mask: Tensor
    ) -> tuple[Tensor, SyntacticAttentionOutput | None]:
        """Source representations [B, N, Ds] (and the self-attention output, if any)."""
        x = self.source_embedding(source)  # [B, N, l]
        if self.self_attention is None:
            return x, None
        parse = self.self_attention(x, source_mask)
        return torch.cat([x, parse.parents], dim=-1), parse  # [B, N, 2l]

    def _predict(self, hidden: Tensor, memory: Tensor, source_mask: Tensor) -> Tensor:
        """Logits [B, T, V] from decoder states h' [B, T, l]."""
        context = self.attention(hidden, memory, source_mask).context  # m_j [B, T, Ds]
        combined = torch.tanh(self.combine(torch.cat([context, hidden], dim=-1)))
        return self.output(combined)

    def forward(self, source: Tensor, source_mask: Tensor, target_in: Tensor) -> Tensor:
        """Teacher-forced logits [B, T, V] for target inputs [B, T] (BOS + tokens)."""
        memory, _ = self.encode(source, source_mask)
        hidden, _ = self.decoder(self.target_embedding(target_in))  # [B, T, l]
        return self._predict(hidden, memory, source_mask)

    @torch.no_grad()
    def beam_search(
        self,
        source: Tensor,
        source_mask: Tensor,
        bos: int,
        eos: int,
        beam_size: int = 5,
        max_length: int = 200,
    ) -> BeamResult:
        """Batched beam search; with ``beam_size=1`` it is greedy decoding.

        At every step the ``beam_size`` best continuations are kept; one ending in EOS is a
        finished hypothesis (and leaves the beam). An item stops when its best continuation
        is EOS; the result is its best finished hypothesis by total log-probability.
        """
        batch = source.shape[0]
        k = beam_size
        memory, _ = self.encode(source, source_mask)
        memory = memory.repeat_interleave(k, dim=0)  # [B*K, N, Ds]
        mask = source_mask.repeat_interleave(k, dim=0)
        device = source.device
        scores = torch.full((batch, k), float("-inf"), device=device, dtype=memory.dtype)
        scores[:, 0] = 0.0  # one live hypothesis to start with
        tokens = torch.full((batch, k, max_length + 1), eos, dtype=torch.long, device=device)
        best_score = torch.full((batch,), float("-inf"), device=device, dtype=memory.dtype)
        best_tokens = torch.full((batch, max_length + 1), eos, dtype=torch.long, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        last = torch.full((batch * k, 1), bos, dtype=torch.long, device=device)
        state: tuple[Tensor, Tensor] | None = None
        offsets = (torch.arange(batch, device=device) * k).unsqueeze(-1)  # [B, 1]
        for t in range(max_length + 1):
            hidden, state = self.decoder(self.target_embedding(last), state)
            logp = F.log_softmax(self._predict(hidden, memory, mask)[:, 0], dim=-1)
            vocab = logp.shape[-1]
            if t == max_length:  # out of room: force EOS
                forced = torch.full_like(logp, float("-inf"))
                forced[:, eos] = 0.0
                logp = logp + forced
            cand = scores.unsqueeze(-1) + logp.view(batch, k, vocab)  # [B, K, V]
            top, index = cand.view(batch, -1).topk(k, dim=-1)  # [B, K]
            beam, token = index // vocab, index % vocab
            tokens = tokens.gather(1, beam.unsqueeze(-1).expand_as(tokens)).clone()
            tokens[:, :, t] = token
            flat = (offsets + beam).view(-1)
            state = (state[0][:, flat], state[1][:, flat])
            ended = (token == eos) & torch.isfinite(top) & ~done.unsqueeze(-1)
            ended_score = top.masked_fill(~ended, float("-inf"))
            candidate, which = ended_score.max(-1)  # best hypothesis ending now
            better = candidate > best_score
            best_score = torch.where(better, candidate, best_score)
            chosen = tokens[torch.arange(batch, device=device), which]  # [B, L]
            best_tokens = torch.where(better.unsqueeze(-1), chosen, best_tokens)
            done = done | (token[:, 0] == eos) | ~torch.isfinite(top[:, 0])
            scores = top.masked_fill(ended | done.unsqueeze(-1), float("-inf"))
            last = token.view(-1, 1)
            if bool(done.all()):
                break
        out = []
        for row in best_tokens.tolist():
            out.append(row[: row.index(eos)] if eos in row else row)
        return BeamResult(out, best_score)
