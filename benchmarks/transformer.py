"""Structured heads inside a Transformer: time per training step (issue 20, item 7).

Usage::

    .venv/bin/python benchmarks/transformer.py [--repeats R] [--threads T] [--quick]

A sentence classifier as a user builds it on SST-2: token embeddings, a 2-layer
``nn.TransformerEncoder`` (d = 64, 4 heads, feed-forward 128, ``batch_first``), mean pooling
over real tokens, a linear layer to 2 classes. One timed call is one Adam training step
(forward, cross-entropy, backward, update) on a fixed batch of B = 32 sentences of lengths
drawn from [L/2, L] (L = 20) with a boolean ``src_key_padding_mask``. Every configuration
starts from the same seed and runs on the same batch; calls are interleaved (``timing.py``)
and ``ratio`` is the median, over repeats, of the configuration's time divided by that of
``nn.MultiheadAttention`` within the same repeat.

Configurations: ``nn.MultiheadAttention`` (the reference), ``StructuredMultiheadAttention``
with four softmax heads, with two projective-tree heads (+ two softmax), with two
segmentation heads (+ two softmax), and with one projective and one segmentation head.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from timing import time_interleaved
from torch import Tensor, nn

from structattn import StructuredMultiheadAttention

#: name -> head normalisers (None: plain ``nn.MultiheadAttention``)
CONFIGS: dict[str, Sequence[str] | None] = {
    "nn.MultiheadAttention": None,
    "SMHA 4 softmax": ["softmax"] * 4,
    "SMHA 2 projective": ["softmax", "softmax", "projective", "projective"],
    "SMHA 2 segmentation": ["softmax", "softmax", "segmentation", "segmentation"],
    "SMHA projective + segmentation": ["softmax", "softmax", "projective", "segmentation"],
}


class Classifier(nn.Module):
    """Embeddings -> TransformerEncoder -> masked mean -> linear."""

    def __init__(
        self, vocab: int, dim: int, heads: int, layers: int, normalizer: Sequence[str] | None
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=2 * dim, dropout=0.1, batch_first=True
        )
        if normalizer is not None:
            layer.self_attn = StructuredMultiheadAttention(
                dim, heads, dropout=0.1, batch_first=True, normalizer=list(normalizer)
            )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(dim, 2)

    def forward(self, tokens: Tensor, padding: Tensor) -> Tensor:
        h = self.encoder(self.embed(tokens), src_key_padding_mask=padding)  # [B, L, D]
        keep = (~padding).unsqueeze(-1).to(h.dtype)  # [B, L, 1]
        pooled = (h * keep).sum(1) / keep.sum(1)  # [B, D]
        return self.out(pooled)  # [B, 2]


def make_batch(batch: int, length: int, vocab: int) -> tuple[Tensor, Tensor, Tensor]:
    """Tokens [B, L], padding mask [B, L] (True = pad, as torch), labels [B]."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
    tokens = torch.randint(1, vocab, (batch, length), generator=gen)
    padding = torch.arange(length) >= lengths[:, None]
    tokens = tokens.masked_fill(padding, 0)
    labels = torch.randint(0, 2, (batch,), generator=gen)
    return tokens, padding, labels


def training_steps(
    batch: int, length: int, dim: int, heads: int, layers: int, vocab: int = 1000
) -> dict[str, Callable[[], object]]:
    """One training-step callable per configuration (same seed, same batch)."""
    tokens, padding, labels = make_batch(batch, length, vocab)
    fns: dict[str, Callable[[], object]] = {}
    for name, normalizer in CONFIGS.items():
        torch.manual_seed(0)
        model = Classifier(vocab, dim, heads, layers, normalizer)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step(model: nn.Module = model, optimizer: torch.optim.Optimizer = optimizer) -> None:
            loss = F.cross_entropy(model(tokens, padding), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        fns[name] = step
    return fns


def measure(repeats: int, warmup: int, quick: bool) -> dict[str, dict[str, float]]:
    """Median ms per step and median ratio to ``nn.MultiheadAttention`` per configuration."""
    sizes = dict(batch=4, length=6, dim=16, heads=4, layers=1) if quick else {}
    fns = training_steps(
        **{"batch": 32, "length": 20, "dim": 64, "heads": 4, "layers": 2, **sizes}  # type: ignore[arg-type]
    )
    timings = time_interleaved(fns, repeats, warmup)
    reference = timings["nn.MultiheadAttention"].samples
    return {
        name: {
            "ms": 1000 * t.median,
            "ratio": statistics.median(s / r for s, r in zip(t.samples, reference, strict=True)),
        }
        for name, t in timings.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = measure(args.repeats, args.warmup, args.quick)
    sizes = "1 layer, d = 16, B = 4, L = 6" if args.quick else "2 layers, d = 64, B = 32, L = 20"
    print(
        f"threads {args.threads}, repeats {args.repeats}; TransformerEncoder, 4 heads, {sizes}; "
        "ratio = time / nn.MultiheadAttention's (median)"
    )
    print(f"{'attention':<32} {'ms/step':>8} {'ratio':>7}")
    for name, row in results.items():
        print(f"{name:<32} {row['ms']:>8.1f} {row['ratio']:>7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
