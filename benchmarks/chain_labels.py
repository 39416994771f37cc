"""Where the C++ chain kernel stops paying off: log Z fwd+bwd and marginals fwd+bwd of a
LinearChainCRF with one shared [C, C] matrix, the batched PyTorch code against the kernel
(median ms of warm calls, B = 32, 2 threads), for the sizes behind ``_SHARED_LABELS`` and
``_SHARED_BUFFER`` in structs/linear_chain.py (issue 22).
Run: .venv/bin/python benchmarks/chain_labels.py [--quick]"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

import structattn.structs.linear_chain as lc
from structattn import LinearChainCRF

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, loaded by path too
from warm_calls import timed  # noqa: E402

#: (N, C, variable lengths)
SIZES = (
    (20, 25, False),
    (30, 25, False),
    (50, 25, False),
    (50, 25, True),
    (100, 25, False),
    (100, 25, True),
    (120, 25, False),
    (200, 25, False),
    (200, 20, False),
    (30, 28, False),
    (60, 28, True),
    (20, 32, False),
    (60, 32, False),
)


def row(n: int, c: int, variable: bool, calls: int, warmup: int) -> str:
    """One size: batched vs kernel, log Z fwd+bwd / marginals fwd+bwd (ms)."""
    unary = torch.randn(32, n, c, requires_grad=True)
    pairwise = torch.randn(c, c, requires_grad=True)
    lengths = torch.randint(n // 2, n + 1, (32,)) if variable else None
    if lengths is not None:
        lengths[0] = n
    weight = torch.randn(32, n, c)

    def logz() -> object:
        dist = LinearChainCRF(unary, pairwise, lengths)
        return torch.autograd.grad(dist.log_partition.sum(), (unary, pairwise))

    def marginals() -> object:
        dist = LinearChainCRF(unary, pairwise, lengths)
        return torch.autograd.grad((dist.marginals * weight).sum(), (unary, pairwise))

    served = lc._chain_kernels(unary, pairwise, "auto") is not None
    saved = lc._KERNEL_LABELS, lc._SHARED_LABELS
    cells = []
    try:
        for name, labels in (("batched", 0), ("kernel", 64)):
            lc._KERNEL_LABELS = lc._SHARED_LABELS = labels  # 0: never the kernel; 64: always
            a = timed(logz, n=calls, warmup=warmup)
            b = timed(marginals, n=calls, warmup=warmup)
            cells.append(f"{name} {a:.3f} / {b:.3f}")
    finally:
        lc._KERNEL_LABELS, lc._SHARED_LABELS = saved
    mib = 32 * (n - 1) * c * c * 8 / 2**20
    kind = "variable" if variable else "full"
    return (
        f"N = {n}, C = {c}, {kind} lengths, buffer {mib:.1f} MiB (served: {served}): "
        "log Z fwd+bwd / marginals fwd+bwd ms: " + " vs ".join(cells)
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small sizes, few calls")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    torch.manual_seed(0)
    sizes = ((10, 20, True), (12, 30, False)) if args.quick else SIZES
    calls, warmup = (3, 1) if args.quick else (60, 6)
    for n, c, variable in sizes:
        print(row(n, c, variable, calls, warmup), flush=True)


if __name__ == "__main__":
    main()
