"""Padded batches of id sequences, and length-bucketed batch orders, shared by the recipes.

- :func:`pad_sequences`: ragged rows of ids -> one right-padded LongTensor ``[B, W]``;
- :func:`bucket_batches`: items in batches of similar lengths, in a random order fixed by
  ``(seed, epoch)`` (training);
- :func:`length_chunks`: item indices sorted by length, in chunks (evaluation: little padding,
  results put back in input order by the caller).

This module imports torch, so it is not re-exported from :mod:`structattn.data`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

__all__ = ["bucket_batches", "length_chunks", "pad_sequences"]

T = TypeVar("T")


def pad_sequences(
    rows: Sequence[Sequence[int]],
    pad: int = 0,
    width: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Right-pad ``B`` rows of ids into a LongTensor ``[B, W]``.

    Row ``b`` is at ``out[b, :len(rows[b])]``, the rest of the row is ``pad``. ``W`` is
    ``width`` (default: the longest row; 0 for no rows or only empty rows). A row longer than
    ``width`` is a ``ValueError``. The tensor is built on the CPU and moved to ``device``
    (default: left there).

    >>> pad_sequences([[5, 6, 7], [8]])
    tensor([[5, 6, 7],
            [8, 0, 0]])
    """
    longest = max((len(row) for row in rows), default=0)
    if width is None:
        width = longest
    elif longest > width:
        raise ValueError(f"a row of {longest} ids does not fit width={width}")
    out = torch.full((len(rows), width), pad, dtype=torch.long)  # [B, W]
    for b, row in enumerate(rows):
        if len(row):
            out[b, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out if device is None else out.to(device)


def bucket_batches(
    items: Sequence[T], batch_size: int, seed: int, epoch: int, length: Callable[[T], int]
) -> list[list[T]]:
    """Batches of ``batch_size`` items of similar ``length`` (ties broken at random), in a
    random order; both fixed by ``(seed, epoch)``, so a resumed run sees the same batches."""
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
    rng = random.Random(seed * 100_003 + epoch)
    order = sorted(range(len(items)), key=lambda i: (length(items[i]), rng.random()))
    batches = [
        [items[i] for i in order[s : s + batch_size]] for s in range(0, len(order), batch_size)
    ]
    rng.shuffle(batches)
    return batches


def length_chunks(items: Sequence[T], size: int, length: Callable[[T], int]) -> list[list[int]]:
    """Indices of ``items`` sorted by ``length`` (stable), in chunks of at most ``size``."""
    if size < 1:
        raise ValueError(f"`size` must be >= 1, got {size}")
    order = sorted(range(len(items)), key=lambda i: length(items[i]))
    return [order[s : s + size] for s in range(0, len(order), size)]
