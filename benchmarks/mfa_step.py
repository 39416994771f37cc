"""Mean-field attention vs softmax attention: time per training step (issue 19).

Usage::

    .venv/bin/python benchmarks/mfa_step.py [--repeats R] [--threads T] [--quick]

The sorting model of the ``mfa`` recipe (one-layer LSTM encoder-decoder with input feeding,
embeddings 32, hidden 64, attention MLP / rank of J 32) on one fixed batch of B = 64
sequences of lengths 5-15 (integers 0-99). One timed call is one Adam training step
(forward, summed NLL, backward, update). Every configuration starts from the same seed and
runs on the same batch; calls are interleaved (``timing.py``) and ``ratio`` is the median,
over repeats, of the configuration's time divided by that of the softmax (Bahdanau)
attention within the same repeat (``vs keys``: the same against ``attention+keys``).
Target of the issue: MFA_5 <= 1.5x.

``attention+keys`` is the softmax model with its layer's memory projection W h computed
once per sequence instead of at every decoder step (what ``MeanFieldAttention.precompute``
does for MFA; a benchmark-local subclass, not a library layer): a stricter reference.
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
from timing import time_interleaved
from torch import Tensor

from structattn.attention import AttentionOutput, SoftmaxAttention
from structattn.attention.scorers import MLPScorer
from structattn.data.synthetic import sorting_examples
from structattn.recipes import mfa
from structattn.recipes.config import replace_path

CONFIGS = ("attention", "attention+keys", "mfa0", "mfa1", "mfa5", "vae", "lstm")


class KeyedSoftmaxAttention(SoftmaxAttention):
    """Softmax attention with an MLP scorer whose W h + b is computed once per sequence
    (``precompute``; Seq2Seq then passes it as ``keys=`` at every step): the same numbers."""

    def precompute(self, memory: Tensor, mask: Tensor | None = None) -> tuple[Tensor, ...]:
        assert isinstance(self.scorer, MLPScorer) and mask is not None
        return self.scorer.memory_proj(memory), memory, mask  # [B, N, H], [B, N, M], [B, N]

    def forward(self, query, memory, mask=None, values=None, keys=None) -> AttentionOutput:
        if keys is None:
            return super().forward(query, memory, mask, values)
        projected, memory, mask = keys
        scorer = self.scorer
        assert isinstance(scorer, MLPScorer) and query.dim() == 3
        hidden = projected.unsqueeze(1) + scorer.query_proj(query).unsqueeze(2)  # [B, Q, N, H]
        scores = scorer.v(torch.tanh(hidden)).squeeze(-1)  # [B, Q, N]
        weights = self.normalize(scores, mask)
        return AttentionOutput(torch.bmm(weights, memory), weights, scores)


def training_steps(batch: int, hidden: int) -> dict[str, Callable[[], object]]:
    """One training-step callable per model (same seed, same batch)."""
    examples = sorting_examples(batch, range(5, 16), 0, "bench")
    data = mfa.collate(examples, torch.device("cpu"), 99)
    fns: dict[str, Callable[[], object]] = {}
    for name in CONFIGS:
        model_name = "attention" if name == "attention+keys" else name
        config = replace_path(mfa.MFAConfig(), {"model": model_name, "hidden_dim": hidden})
        model = mfa.build_model(config)
        if name == "attention+keys":  # the same parameters, W h once per sequence
            keyed = KeyedSoftmaxAttention(hidden, hidden, "mlp", config.attention_dim)
            keyed.load_state_dict(model.attention.state_dict())
            model.attention = keyed
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step(model: torch.nn.Module = model, optimizer: torch.optim.Optimizer = optimizer):
            loss, n, _ = mfa.batch_loss(model, data)
            optimizer.zero_grad(set_to_none=True)
            (loss / n).backward()
            optimizer.step()

        fns[name] = step
    return fns


def measure(repeats: int, warmup: int, quick: bool) -> dict[str, dict[str, float]]:
    """Median ms per step and median ratios to the softmax attention (``ratio``) and to the
    keyed softmax attention (``keyed``) per configuration."""
    fns = training_steps(8, 16) if quick else training_steps(64, 64)
    timings = time_interleaved(fns, repeats, warmup)

    def ratio(samples: list[float], reference: str) -> float:
        pairs = zip(samples, timings[reference].samples, strict=True)
        return statistics.median(s / r for s, r in pairs)

    return {
        name: {
            "ms": 1000 * t.median,
            "ratio": ratio(t.samples, "attention"),
            "keyed": ratio(t.samples, "attention+keys"),
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
    print(f"threads {args.threads}, repeats {args.repeats}; sorting seq2seq, B = 64, lengths 5-15")
    print(f"{'model':<15} {'ms/step':>8} {'ratio':>7} {'vs keys':>8}")
    for name, row in results.items():
        line = f"{name:<15} {row['ms']:>8.1f} {row['ratio']:>7.2f} {row['keyed']:>8.2f}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
