"""End-to-end cost of structured attention in training (issue 6, target 6).

Usage::

    .venv/bin/python benchmarks/end_to_end.py [--repeats R] [--threads T] [--quick]

Two comparisons, each timed interleaved (see ``timing.py``) on the same inputs; ``ratio`` is
the median over repeats of structured / simple measured within a repeat:

* **tree transduction** — SGD training steps (forward, backward, clipping, update) of the
  paper's model (``TreeTransductionConfig`` defaults: l = 50, batch 20) with structured
  (dependency-CRF) vs simple (softmax) self-attention, on real batches of the generated data
  (depth 2-4 training formulas): every timed call runs the same first 40 batches of the
  first epoch (source lengths 11-66), and the times printed are per step.
* **decoder step** — a teacher-forced LSTM decoder (hidden 256, 20 target steps, 32
  sentences, 30 source positions, 1,000-word output layer) attending with
  ``SegmentationAttention`` vs ``SoftmaxAttention`` at every step: forward and backward of
  the summed cross-entropy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from timing import time_interleaved
from torch import nn

from structattn.attention import SegmentationAttention, SoftmaxAttention
from structattn.data.tree_transduction import Vocabulary, generate_splits
from structattn.recipes.tree_transduction import (
    TreeTransductionConfig,
    batches_for_epoch,
    build_model,
    collate,
    sequence_loss,
)


def _ratio(fns: dict[str, Callable[[], object]], repeats: int, warmup: int) -> dict[str, float]:
    """Median ms of each callable and the median within-repeat ratio structured / simple."""
    timings = time_interleaved(fns, repeats, warmup)
    simple, structured = timings["simple"].samples, timings["structured"].samples
    ratio = statistics.median(b / a for a, b in zip(simple, structured, strict=True))
    return {
        "simple_ms": 1000 * timings["simple"].median,
        "structured_ms": 1000 * timings["structured"].median,
        "ratio": ratio,
    }


def tree_transduction(repeats: int, warmup: int, quick: bool) -> dict[str, float]:
    """Training steps of the tree-transduction model, structured vs simple attention: each
    call runs the same ``_STEPS`` batches (a fixed slice of an epoch, so that the ratio is
    that of training time, not of one batch's length)."""
    splits = generate_splits(seed=0)
    vocab = Vocabulary.build(splits["train"])
    config = TreeTransductionConfig()
    batches = batches_for_epoch(splits["train"], config.batch_size, 0, 1)
    batches = batches[: 2 if quick else _STEPS]
    collated = [collate(b, vocab, torch.device("cpu")) for b in batches]
    steps: dict[str, Callable[[], object]] = {}
    for attention in ("simple", "structured"):
        model = build_model(TreeTransductionConfig(attention=attention), vocab)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)

        def run(model: nn.Module = model, optimizer: torch.optim.Optimizer = optimizer) -> None:
            for batch in collated:
                loss, n, _ = sequence_loss(model, batch)
                optimizer.zero_grad(set_to_none=True)
                (loss / n).backward()
                nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                optimizer.step()

        steps[attention] = run
    result = _ratio(steps, repeats, warmup)
    result["simple_ms"] /= len(collated)  # per step
    result["structured_ms"] /= len(collated)
    return result


#: training batches per timed call in :func:`tree_transduction` (the first 40 of the first
#: epoch: source lengths 11-66)
_STEPS = 40


class _Decoder(nn.Module):
    def __init__(self, attention: nn.Module, hidden: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.cell = nn.LSTMCell(2 * hidden, hidden)
        self.attention = attention
        self.out = nn.Linear(2 * hidden, vocab)

    def forward(
        self, memory: torch.Tensor, mask: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        batch, steps = target.shape
        h = memory.new_zeros(batch, self.cell.hidden_size)
        c = torch.zeros_like(h)
        feed = torch.zeros_like(h)  # input feeding
        loss = memory.new_zeros(())
        inputs = self.embed(target)
        for t in range(steps - 1):
            h, c = self.cell(torch.cat([inputs[:, t], feed], -1), (h, c))
            context = self.attention(h, memory, mask).context
            feed = context
            logits = self.out(torch.cat([h, context], -1))
            loss = loss + F.cross_entropy(logits, target[:, t + 1], reduction="sum")
        return loss


def decoder_step(repeats: int, warmup: int, quick: bool) -> dict[str, float]:
    """Teacher-forced decoder with segmentation vs softmax attention, fwd + bwd."""
    gen = torch.Generator().manual_seed(0)
    batch, source, hidden, vocab, steps = (4, 8, 32, 50, 4) if quick else (32, 30, 256, 1000, 21)
    memory = torch.randn(batch, source, hidden, generator=gen)
    lengths = torch.randint(source // 2, source + 1, (batch,), generator=gen)
    mask = torch.arange(source) < lengths[:, None]
    target = torch.randint(0, vocab, (batch, steps), generator=gen)
    fns: dict[str, Callable[[], object]] = {}
    for name, attention in (
        ("simple", SoftmaxAttention(hidden)),
        ("structured", SegmentationAttention(hidden)),
    ):
        torch.manual_seed(0)
        model = _Decoder(attention, hidden, vocab)
        leaf = memory.clone().requires_grad_(True)

        def run(model: nn.Module = model, leaf: torch.Tensor = leaf) -> None:
            model.zero_grad(set_to_none=True)
            model(leaf, mask, target).backward()

        fns[name] = run
    return _ratio(fns, repeats, warmup)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, repeats {args.repeats}; ratio = structured / simple (median)")
    print(f"{'comparison':<42} {'simple ms':>10} {'struct ms':>10} {'ratio':>7}")
    rows = (
        ("tree transduction: training step (batch 20)", tree_transduction),
        ("decoder: segmentation vs softmax attention", decoder_step),
    )
    for label, fn in rows:
        result = fn(args.repeats, args.warmup, args.quick)
        print(
            f"{label:<42} {result['simple_ms']:>10.1f} {result['structured_ms']:>10.1f} "
            f"{result['ratio']:>7.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
