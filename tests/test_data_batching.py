"""structattn.data.batching: padded id tensors and length-bucketed batch orders."""

from __future__ import annotations

import pytest
import torch

from structattn.data.batching import bucket_batches, length_chunks, pad_sequences


def test_pad_sequences_shapes_values_and_width() -> None:
    out = pad_sequences([[5, 6, 7], [8], []])
    assert out.dtype == torch.long and out.shape == (3, 3)  # [B, longest]
    assert out.tolist() == [[5, 6, 7], [8, 0, 0], [0, 0, 0]]
    assert pad_sequences([(1, 2)], pad=-1, width=4).tolist() == [[1, 2, -1, -1]]
    assert pad_sequences([], width=2).shape == (0, 2)
    assert pad_sequences([[], []]).shape == (2, 0)
    assert pad_sequences([[1]], device="cpu").device.type == "cpu"
    with pytest.raises(ValueError, match="width=2"):
        pad_sequences([[1, 2, 3]], width=2)


def test_bucket_batches_cover_every_item_once_in_a_seeded_order() -> None:
    items = [("x" * n, i) for i, n in enumerate([5, 1, 3, 3, 2, 5, 4, 1, 2, 3])]
    batches = bucket_batches(items, 3, seed=1, epoch=0, length=lambda item: len(item[0]))
    assert sorted(x for b in batches for x in b) == sorted(items)
    assert [len(b) for b in batches].count(1) == 1 and all(len(b) <= 3 for b in batches)
    for b in batches:  # each batch holds neighbours in the length order
        spread = max(len(x[0]) for x in b) - min(len(x[0]) for x in b)
        assert spread <= 2
    again = bucket_batches(items, 3, seed=1, epoch=0, length=lambda item: len(item[0]))
    assert again == batches
    others = [bucket_batches(items, 3, 1, e, lambda item: len(item[0])) for e in range(1, 6)]
    assert any(o != batches for o in others)  # another epoch, another order
    with pytest.raises(ValueError, match="batch_size"):
        bucket_batches(items, 0, 0, 0, len)


def test_length_chunks_sorted_and_stable() -> None:
    words = ["ccc", "a", "bb", "d", "eee"]
    assert length_chunks(words, 2, len) == [[1, 3], [2, 0], [4]]
    assert length_chunks([], 4, len) == []
    with pytest.raises(ValueError, match="size"):
        length_chunks(words, 0, len)
