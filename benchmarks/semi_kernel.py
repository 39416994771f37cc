"""The semi-Markov CRF's C++ kernels (``structs/_semi_markov.cpp``) against our PyTorch path
(``kernels_disabled()``) in one process, alternated: ``SemiMarkovCRF`` log Z fwd+bwd and
marginals fwd+bwd (then the backward of ``(marginals * w).sum()``), B = 32, float32, shared
C x C transitions, one thread, best of ``--repeats`` calls per round (issue 39).
``PYTHONPATH=src .venv/bin/python benchmarks/semi_kernel.py --rounds 2``"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
from torch import Tensor

from structattn import SemiMarkovCRF
from structattn.structs._extension import kernels, kernels_disabled

SIZES = ((50, 4, 2), (50, 10, 10), (100, 4, 2), (100, 4, 10), (100, 10, 10))


def best_ms(call: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls after one untimed call, in milliseconds."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def step(scores: Tensor, transitions: Tensor, weight: Tensor | None) -> None:
    """log Z fwd+bwd (``weight`` None) or marginals fwd+bwd."""
    x = scores.detach().requires_grad_()
    t = transitions.detach().requires_grad_()
    dist = SemiMarkovCRF(x, t)
    loss = dist.log_partition.sum() if weight is None else (dist.marginals * weight).sum()
    loss.backward()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternations (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="calls per round (default 5)")
    args = parser.parse_args(argv)
    if kernels(torch.zeros(1, 2, 2)) is None:
        raise SystemExit("the C++ kernels are not built (STRUCTATTN_EXTENSION=0?)")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print("| op | N | K | C | PyTorch path ms | kernel ms | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for size, width, labels in SIZES:
        scores = torch.randn(32, size, width, labels)
        transitions = torch.randn(labels, labels)
        for name, weight in (
            ("log Z fwd+bwd", None),
            ("marginals fwd+bwd", torch.randn_like(scores)),
        ):
            pairs = []
            call = functools.partial(step, scores, transitions, weight)
            for _ in range(args.rounds):
                kernel = best_ms(call, args.repeats)
                with kernels_disabled():
                    python = best_ms(call, args.repeats)
                pairs.append((python, kernel))
            cells = (
                " / ".join(f"{p:.1f}" for p, _ in pairs),
                " / ".join(f"{k:.1f}" for _, k in pairs),
            )
            ratios = [p / k for p, k in pairs]
            print(
                f"| {name} | {size} | {width} | {labels} | {cells[0]} | {cells[1]} | "
                f"{min(ratios):.1f}-{max(ratios):.1f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
