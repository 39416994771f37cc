"""Padded batches of translation pairs (Kim et al. 2017, sec. 4.2): the source and target
vocabularies of a training set, source ids with their mask, and teacher-forcing batches.

Sources are tokens of one ``unit`` (:func:`~.parallel.source_tokens`: ``"char"``, the
Japanese line without its word boundaries, or ``"word"``, the KyTea tokens); targets are
English words. Id 0 is padding on both sides (:class:`~.parallel.TranslationVocabulary`).
This module imports torch, so it is not re-exported from :mod:`structattn.data`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from .batching import pad_sequences
from .parallel import ParallelPair, SourceUnit, TranslationVocabulary, source_tokens

__all__ = ["TranslationBatch", "Vocabularies", "collate", "encode_sources", "vocabularies"]


class TranslationBatch(NamedTuple):
    source: Tensor  # [B, N] source ids (padding 0 at the end)
    source_mask: Tensor  # [B, N] True at real positions
    target_in: Tensor  # [B, T] <s> + target
    target_out: Tensor  # [B, T] target + </s> (0 = padding)


class Vocabularies(NamedTuple):
    source: TranslationVocabulary  # characters or words
    target: TranslationVocabulary  # English words


def vocabularies(pairs: Sequence[ParallelPair], unit: SourceUnit, min_count: int) -> Vocabularies:
    """Source (tokens of ``unit``) and target vocabularies of ``pairs``: every token seen at
    least ``min_count`` times."""
    source = TranslationVocabulary.build((source_tokens(p, unit) for p in pairs), min_count)
    target = TranslationVocabulary.build((p.target for p in pairs), min_count)
    return Vocabularies(source, target)


def encode_sources(
    sources: Sequence[Sequence[str]], vocab: TranslationVocabulary, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Padded source ids [B, N] and mask [B, N] (every source needs >= 1 token)."""
    ids = [vocab.encode(s) for s in sources]
    source = pad_sequences(ids, 0, device=device)
    return source, source != vocab.pad_id


def collate(
    pairs: Sequence[ParallelPair], vocabs: Vocabularies, unit: str, device: torch.device
) -> TranslationBatch:
    """Pad pairs into a :class:`TranslationBatch` (sources as ``unit``: "char" or "word")."""
    source, mask = encode_sources(
        [source_tokens(p, unit) for p in pairs],  # type: ignore[arg-type]
        vocabs.source,
        device,
    )
    targets = [vocabs.target.encode(p.target) for p in pairs]
    width = max(map(len, targets)) + 1
    target_in = pad_sequences([[vocabs.target.bos_id, *y] for y in targets], 0, width, device)
    target_out = pad_sequences([[*y, vocabs.target.eos_id] for y in targets], 0, width, device)
    return TranslationBatch(source, mask, target_in, target_out)
