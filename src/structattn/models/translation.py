"""Translation with a trained :class:`~.seq2seq.Seq2Seq` (Kim et al. 2017, sec. 4.2, Figure 4):
beam search over token sequences, teacher-forced perplexity, and the attention weights of
one decoded sentence (with the Viterbi segmentation of a segmentation attention).

Token <-> id maps and padded batches are :mod:`structattn.data.translation`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..attention import SegmentationAttention
from ..data.parallel import ParallelPair
from ..data.translation import Vocabularies, collate, encode_sources
from .seq2seq import Seq2Seq, sequence_nll

__all__ = ["translate", "translation_attention", "translation_perplexity"]


@torch.no_grad()
def translation_perplexity(
    model: Seq2Seq,
    pairs: Sequence[ParallelPair],
    vocabs: Vocabularies,
    unit: str,
    device: torch.device,
) -> float:
    """Teacher-forced per-token perplexity (EOS included, no penalty)."""
    total, tokens = 0.0, 0
    for start in range(0, len(pairs), 100):
        batch = collate(pairs[start : start + 100], vocabs, unit, device)
        logits = model(batch.source, batch.source_mask, batch.target_in)
        total += float(sequence_nll(logits, batch.target_out, 0, "sum"))
        tokens += int((batch.target_out != 0).sum())
    return math.exp(total / max(tokens, 1))


@torch.no_grad()
def translate(
    model: Seq2Seq,
    sources: Sequence[Sequence[str]],
    vocabs: Vocabularies,
    device: torch.device | str = "cpu",
    beam_size: int = 5,
    max_length: int = 100,
    batch_size: int = 50,
) -> list[list[str]]:
    """Beam-search translations (target tokens, possibly empty) of source token sequences
    (each non-empty), in input order. At most ``min(max_length, 2 N + 10)`` tokens for a
    source of N tokens."""
    if any(len(s) == 0 for s in sources):
        raise ValueError("every source needs at least one token")
    device = torch.device(device)
    model.eval()
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    results: dict[int, list[str]] = {}
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        source, mask = encode_sources([sources[i] for i in chunk], vocabs.source, device)
        limit = min(max_length, 2 * source.shape[1] + 10)
        beam = model.beam_search(
            source, mask, vocabs.target.bos_id, vocabs.target.eos_id, beam_size, limit
        )
        for i, tokens in zip(chunk, beam.tokens, strict=True):
            results[i] = vocabs.target.decode(tokens)
    return [results[i] for i in range(len(sources))]


@torch.no_grad()
def translation_attention(
    model: Seq2Seq, source: Sequence[str], target: Sequence[str], vocabs: Vocabularies
) -> tuple[Tensor, Tensor | None]:
    """Teacher-forced attention weights [T, N] of ``target`` (decoded words, then </s>) over
    the model's ``source`` tokens, and for segmentation attention the Viterbi segmentation
    z [T, N] of every step (None otherwise)."""
    model.eval()
    src, mask = encode_sources([source], vocabs.source, torch.device("cpu"))
    ids = vocabs.target.encode(target)
    target_in = torch.tensor([[vocabs.target.bos_id, *ids]])  # [1, T]
    weights: list[Tensor] = []
    queries: list[Tensor] = []
    memories: list[Tensor] = []

    def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        queries.append(args[0])  # [1, 1, l]
        memories.append(args[1])  # [1, N, M]
        weights.append(out.weights)  # [1, 1, N]

    handle = model.attention.register_forward_hook(hook)
    try:
        model(src, mask, target_in)
    finally:
        handle.remove()
    alpha = torch.cat(weights, dim=1)[0]  # [T, N]
    segments = None
    if isinstance(model.attention, SegmentationAttention):
        query = torch.cat(queries, dim=1)  # [1, T, l]
        segments = model.attention.decode(query, memories[0], mask)[0]  # [T, N]
    return alpha, segments
