"""PRPN language models vs a same-size LSTM: training tokens per second (issues 18, 40).

Usage::

    .venv/bin/python benchmarks/prpn_lm.py [--repeats R] [--threads T] [--quick]
        [--models lstm,bradley-terry,bradley-terry-marginal]

One timed call is one Adam training step of a word-level LM on PTB-sized data (V = 10,000):
forward over a BPTT window of B = 64 streams x T = 35 tokens with the carried state,
cross-entropy, backward, update. Sizes of the ``prpn`` recipe's ``cpu`` preset (embedding =
hidden = 200, 1 layer, memory K = 15, convolution L = 5). Calls are interleaved
(``timing.py``); ``ratio`` is the median, over repeats, of a model's time divided by the
LSTM's within the same repeat (robust to the load of a shared machine).
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

from structattn.models import PRPNConfig, PRPNLanguageModel, RNNLanguageModel

MODELS = ("lstm", "stick-breaking", "bradley-terry", "none", "bradley-terry-marginal")
#: ``bradley-terry-marginal``: the exact latent-variable objective (#40, ``objective="marginal"``)


def training_steps(
    batch: int, steps: int, size: int, vocab: int, models: tuple[str, ...] = MODELS[:4]
) -> dict[str, Callable[[], object]]:
    """One training-step callable per model (same seed, same window, state carried)."""
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(vocab, (batch, steps + 1), generator=gen)
    fns: dict[str, Callable[[], object]] = {}
    for name in models:
        torch.manual_seed(0)
        if name == "lstm":
            model: torch.nn.Module = RNNLanguageModel(
                vocab, size, size, cell="lstm", dropout=0.2, tie_weights=True
            )
        elif name == "bradley-terry-marginal":
            config = PRPNConfig(
                vocab, size, size, num_layers=1, gate="bradley-terry", objective="marginal"
            )
            model = PRPNLanguageModel(config)
        else:
            config = PRPNConfig(vocab, size, size, num_layers=1, gate=name)  # type: ignore[arg-type]
            model = PRPNLanguageModel(config)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        carry = {"state": model.initial_state(batch, torch.device("cpu"))}  # type: ignore[operator]

        def step(
            model: torch.nn.Module = model,
            optimizer: torch.optim.Optimizer = optimizer,
            carry: dict = carry,  # type: ignore[type-arg]
        ) -> None:
            logits, state = model(inputs[:, :-1], carry["state"])
            carry["state"] = tuple(s.detach() for s in state)
            loss = F.cross_entropy(logits.reshape(-1, vocab), inputs[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        fns[name] = step
    return fns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument(
        "--models", default=",".join(MODELS[:4]), help=f"comma-separated, of {MODELS}"
    )
    args = parser.parse_args(argv)
    models = tuple(m for m in args.models.split(",") if m)
    if "lstm" not in models or any(m not in MODELS for m in models):
        parser.error(f"--models: 'lstm' (the reference) and others of {MODELS}")
    torch.set_num_threads(args.threads)
    sizes = (4, 6, 8, 50) if args.quick else (64, 35, 200, 10_000)
    batch, steps, size, vocab = sizes
    timings = time_interleaved(
        training_steps(batch, steps, size, vocab, models), args.repeats, args.warmup
    )
    reference = timings["lstm"].samples
    print(
        f"threads {args.threads}, repeats {args.repeats}; B = {batch}, T = {steps}, "
        f"E = H = {size}, V = {vocab}, 1 layer; ratio = time / LSTM's (median)"
    )
    print(f"{'model':<16} {'ms/step':>8} {'tokens/s':>9} {'ratio':>6}")
    for name, t in timings.items():
        ratio = statistics.median(s / r for s, r in zip(t.samples, reference, strict=True))
        print(
            f"{name:<16} {1000 * t.median:>8.1f} {batch * steps / t.median:>9.0f} {ratio:>6.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
