"""Cost of the second-order training path of our CRFs, relative to computing the marginals.

Usage::

    .venv-bench/bin/python benchmarks/second_order.py [--repeats R] [--batch B] [--threads T]

For each structure and size, times (interleaved, see ``timing.py``) three calls on the same
float32 potentials that require grad: ``marginals`` (the marginals, built with their graph
as structured attention does), ``marginals fwd+bwd`` (the marginals, then the backward of
``(marginals * w).sum()``: what one training step of a structured attention layer pays)
and ``log Z fwd+bwd``. marginals fwd+bwd / marginals is the median over repeats of the
ratio within a repeat, printed as ``ratio`` (issue 6, target 5: <= 3).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from timing import time_interleaved

import structattn


def _configs(batch: int) -> list[tuple[str, Callable[[], object], tuple[torch.Tensor, ...]]]:
    """(label, distribution factory, leaves) for every measured configuration."""
    gen = torch.Generator().manual_seed(0)
    out: list[tuple[str, Callable[[], object], tuple[torch.Tensor, ...]]] = []
    for size in (20, 40, 80):
        arcs = torch.randn(batch, size, size, generator=gen).requires_grad_(True)
        out.append((f"tree N={size}", partial(structattn.DependencyCRF, arcs), (arcs,)))
        nonproj = partial(structattn.NonProjectiveDependencyCRF, arcs)
        out.append((f"nonproj N={size}", nonproj, (arcs,)))
    for size, labels in ((50, 2), (100, 10), (100, 25), (200, 10)):
        unary = torch.randn(batch, size, labels, generator=gen).requires_grad_(True)
        pairwise = torch.randn(labels, labels, generator=gen).requires_grad_(True)
        chain = partial(structattn.LinearChainCRF, unary, pairwise)
        out.append((f"chain N={size} C={labels}", chain, (unary, pairwise)))
    return out


def _measure(
    build: Callable[[], object], leaves: tuple[torch.Tensor, ...], repeats: int
) -> tuple[dict[str, float], float]:
    """Median seconds of marginals / marginals fwd+bwd / log Z fwd+bwd, and the median
    within-repeat ratio marginals fwd+bwd / marginals."""
    weight = torch.randn_like(leaves[0])

    def marginals() -> object:
        return build().marginals  # type: ignore[attr-defined]

    def marg_fb() -> object:
        loss = (build().marginals * weight).sum()  # type: ignore[attr-defined]
        return torch.autograd.grad(loss, leaves)

    def logz_fb() -> object:
        logz = build().log_partition  # type: ignore[attr-defined]
        return torch.autograd.grad(logz.sum(), leaves)

    res = time_interleaved({"marg": marginals, "marg_fb": marg_fb, "logz_fb": logz_fb}, repeats, 2)
    ratio = statistics.median(
        b / a for a, b in zip(res["marg"].samples, res["marg_fb"].samples, strict=True)
    )
    return {k: t.median for k, t in res.items()}, ratio


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# B={args.batch}, float32, {args.threads} threads, median ms over {args.repeats}")
    print("| structure | marginals ms | marginals fwd+bwd ms | log Z fwd+bwd ms | ratio |")
    print("|---|---|---|---|---|")
    for label, build, leaves in _configs(args.batch):
        times, ratio = _measure(build, leaves, args.repeats)
        ms = " | ".join(f"{times[k] * 1e3:.2f}" for k in ("marg", "marg_fb", "logz_fb"))
        print(f"| {label} | {ms} | {ratio:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
