"""Padded batches of the synthetic tasks (:mod:`.synthetic`: chunk counting and sorting).

Token ids: 0 padding, 1 ``BOS``, 2 ``EOS``; counting bits "0" -> 1 and "1" -> 2; a sorting
value v -> v + 3 (a vocabulary of ``max_value + 4`` ids). This module imports torch, so it
is not re-exported from :mod:`structattn.data`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from .batching import pad_sequences
from .synthetic import CountingExample, SortingExample

__all__ = ["BOS", "EOS", "PAD", "SyntheticBatch", "collate", "example_length"]

PAD, BOS, EOS = 0, 1, 2  # token ids; counting bits are 1 ("0") and 2 ("1"), sorting v -> v + 3

Example = CountingExample | SortingExample


class SyntheticBatch(NamedTuple):
    source: Tensor  # [B, N] ids (padding 0 at the end)
    source_mask: Tensor  # [B, N] True at real positions
    target_in: Tensor  # [B, T] BOS + sorted ids (sorting; [B, 0] for counting)
    target_out: Tensor  # [B, T] sorted ids + EOS, 0 = padding (sorting)
    counts: Tensor  # [B] float chunk counts (counting; zeros for sorting)


def example_length(example: Example) -> int:
    """The input length N of an example (bits or values)."""
    return len(example.bits) if isinstance(example, CountingExample) else len(example.values)


def collate(examples: Sequence[Example], device: torch.device, max_value: int) -> SyntheticBatch:
    """Pad examples of one task into a :class:`SyntheticBatch` (sorting values above
    ``max_value`` are an error); T = N + 1 for sorting."""
    n = max(map(example_length, examples))
    if isinstance(examples[0], SortingExample):
        sorting = [e for e in examples if isinstance(e, SortingExample)]
        for ex in sorting:
            if max(ex.values) > max_value:
                raise ValueError(f"value {max(ex.values)} is above max_value={max_value}")
        targets = [[v + 3 for v in ex.target] for ex in sorting]
        source = pad_sequences([[v + 3 for v in ex.values] for ex in sorting], PAD, n)
        target_in = pad_sequences([[BOS, *y] for y in targets], PAD, n + 1)
        target_out = pad_sequences([[*y, EOS] for y in targets], PAD, n + 1)
        count = torch.zeros(len(examples))
    else:
        counting = [e for e in examples if isinstance(e, CountingExample)]
        source = pad_sequences([[1 + int(c) for c in ex.bits] for ex in counting], PAD, n)
        target_in = target_out = torch.zeros(len(examples), 0, dtype=torch.long)
        count = torch.tensor([float(ex.count) for ex in counting])
    return SyntheticBatch(
        source.to(device),
        (source != PAD).to(device),
        target_in.to(device),
        target_out.to(device),
        count.to(device),
    )
