"""Why small calls are slower in `run.py` than warm: one DependencyCRF MAP (B = 32, N = 40,
variable lengths) timed after a plain cache flush, after freeing large buffers (as a peer's
call does between ours in the interleaved benchmark) and after a peer-like op; then the C++
kernel alone and the float64 copy. Run: .venv/bin/python benchmarks/cold_call.py (issue 22)."""

import statistics
import time
from collections.abc import Callable

import torch

from structattn.distributions import DependencyCRF
from structattn.structs.dependency import _map_kernels


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    batch, size = 32, 40
    scores = torch.randn(batch, size, size)
    lengths = torch.randint(size // 2, size + 1, (batch,))
    lengths[0] = size
    junk = torch.empty(4 * 1024 * 1024, dtype=torch.float64)

    def timed(call: Callable[[], object], between: Callable[[], object], n: int = 150) -> str:
        samples = []
        for _ in range(n):
            between()
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
        return f"{statistics.median(samples) * 1e3:.3f}"

    def flush() -> None:  # 32 MB written: caches cold, no memory freed
        junk.add_(1.0)

    def churn() -> None:  # 4 x 32 MB allocated, written and freed
        for _ in range(4):
            x = torch.ones(8 * 1024 * 1024)
            del x

    def peer_like() -> None:  # a logsumexp over a [32, 40, 40, 40] temporary
        x = torch.randn(32, 40, 40, 40)
        x.logsumexp(-1).mul(2).sum()
        del x

    def argmax() -> object:
        return DependencyCRF(scores, lengths).argmax

    print("DependencyCRF(...).argmax, ms (median of 150):")
    print("  after a cache flush", timed(argmax, flush))
    print("  after freeing 4 x 32 MB", timed(argmax, churn))
    print("  after a peer-like op", timed(argmax, peer_like))
    kernels = _map_kernels(scores)
    if kernels is not None:
        prepared = scores.double()
        prepared[:, :, 0] = float("-inf")
        last = lengths - 1

        def kernel() -> object:
            return kernels.eisner_map(prepared, last, True)

        print(
            "the C++ MAP kernel alone (flush / freeing):",
            timed(kernel, flush),
            "/",
            timed(kernel, churn),
        )

    def copy() -> object:
        return scores.to(torch.float64, copy=True)

    print("the float64 copy (flush / freeing):", timed(copy, flush), "/", timed(copy, churn))

    def tiny() -> object:
        return scores.sum()

    print(
        "a sum over the scores (back to back / freeing):",
        timed(tiny, lambda: None),
        "/",
        timed(tiny, churn),
    )


if __name__ == "__main__":
    main()
