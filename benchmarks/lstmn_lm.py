"""LSTMN vs LSTM language models: training tokens per second (issue 17).

Usage::

    .venv/bin/python benchmarks/lstmn_lm.py [--repeats R] [--threads T] [--quick]

One timed call is one SGD training step of the ``lstmn-lm`` recipe at the paper's size
(vocabulary 10,000, embeddings 150, hidden 300, B = 40 rows, a BPTT window of 35 tokens;
forward, cross-entropy, backward, clipping, update), with the state carried from the
previous call (detached), as in training. Configurations: RNN, LSTM (``nn.LSTM``), LSTMN
with memory spans 35 and 100 (the tape carried across windows is full after the first
calls); calls are interleaved (``timing.py``); ``ratio`` = median within-repeat time over
the LSTM's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from timing import time_interleaved
from torch import nn

from structattn.models.language_model import LSTMNLanguageModel, RNNLanguageModel, detach_state

CONFIGS = ("RNN", "LSTM", "LSTMN span 35", "LSTMN span 100")


def make_model(name: str, vocab: int, embed: int, hidden: int) -> nn.Module:
    """The language model of a configuration."""
    if name.startswith("LSTMN"):
        return LSTMNLanguageModel(vocab, embed, hidden, memory_span=int(name.split()[-1]))
    return RNNLanguageModel(vocab, embed, hidden, cell="rnn" if name == "RNN" else "lstm")


def training_steps(
    batch: int, bptt: int, vocab: int, embed: int, hidden: int
) -> dict[str, Callable[[], object]]:
    """One training-step callable per configuration (same seed, same window)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, bptt + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    fns: dict[str, Callable[[], object]] = {}
    for name in CONFIGS:
        torch.manual_seed(0)
        model = make_model(name, vocab, embed, hidden)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.65)
        carried: dict[str, Any] = {"state": model.initial_state(batch, torch.device("cpu"))}  # type: ignore[operator]

        def step(
            model: nn.Module = model, optimizer: torch.optim.Optimizer = optimizer, carried=carried
        ) -> None:
            logits, state = model(inputs, carried["state"])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            carried["state"] = detach_state(state)

        fns[name] = step
    return fns


def measure(repeats: int, warmup: int, quick: bool) -> dict[str, dict[str, float]]:
    """Median tokens/s and median time ratio to the LSTM's per configuration."""
    sizes = dict(batch=4, bptt=6, vocab=50, embed=8, hidden=8) if quick else {}
    settings = {"batch": 40, "bptt": 35, "vocab": 10_000, "embed": 150, "hidden": 300, **sizes}
    timings = time_interleaved(training_steps(**settings), repeats, warmup)
    reference = timings["LSTM"].samples
    tokens = settings["batch"] * settings["bptt"]
    return {
        name: {
            "tokens_per_s": tokens / t.median,
            "ratio": statistics.median(s / r for s, r in zip(t.samples, reference, strict=True)),
        }
        for name, t in timings.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = measure(args.repeats, args.warmup, args.quick)
    sizes = "V 50, E = H = 8, B = 4, T = 6" if args.quick else "V 10k, E 150, H 300, B 40, T 35"
    print(f"threads {args.threads}, repeats {args.repeats}; one SGD step, {sizes}")
    print(f"{'model':<16} {'tokens/s':>9} {'ratio':>7}")
    for name, row in results.items():
        print(f"{name:<16} {row['tokens_per_s']:>9.0f} {row['ratio']:>7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
