"""Warm per-call times (median of repeated calls, B = 32, 2 threads) of the rows changed in
issue 22's stops 33 and 34: linear-chain log Z fwd+bwd with a shared transition matrix (full
and variable lengths), and the tree CRF's masking of a variable-length batch (``_parts``)
forward and backward. Run it at two
commits to compare them: .venv/bin/python benchmarks/warm_calls.py"""

import statistics
import time
from collections.abc import Callable

import torch

from structattn import DependencyCRF, LinearChainCRF


def timed(call: Callable[[], object], n: int = 300, warmup: int = 30) -> float:
    """Median milliseconds of ``n`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    batch = 32
    for size, labels in ((50, 10), (200, 10), (50, 4), (100, 2)):
        unary = torch.randn(batch, size, labels, requires_grad=True)
        pairwise = torch.randn(labels, labels, requires_grad=True)
        ms = timed(lambda u=unary, p=pairwise: LinearChainCRF(u, p).log_partition.sum().backward())
        print(f"chain log Z fwd+bwd N = {size}, C = {labels}: {ms:.3f} ms")
        lengths = torch.randint(size // 2, size + 1, (batch,))
        lengths[0] = size
        ms = timed(
            lambda u=unary, p=pairwise, n=lengths: (
                LinearChainCRF(u, p, n).log_partition.sum().backward()
            )
        )
        print(f"chain log Z fwd+bwd N = {size}, C = {labels}, variable lengths: {ms:.3f} ms")
    size = 40
    scores = torch.randn(batch, size, size, requires_grad=True)
    lengths = torch.randint(size // 2, size + 1, (batch,))
    lengths[0] = size
    dist = DependencyCRF(scores, lengths)

    def parts() -> None:
        dist._parts(scores)[0].sum().backward()

    print(f"tree masking fwd+bwd N = {size}, variable lengths: {timed(parts):.3f} ms")


if __name__ == "__main__":
    main()
