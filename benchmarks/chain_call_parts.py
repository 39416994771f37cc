"""Where a small chain call's time goes (B = 32, shared [C, C] matrix, warm calls, median
ms): the distribution's construction with and without its input checks, log Z fwd+bwd
through LinearChainCRF, the C++ kernel's forward-backward alone (also per item and step, on
one thread), and a differentiable op that computes nothing (bound.py's ``call_s``). The
figures behind the C = 2 rows of benchmarks/README.md (issue 22).
Run: .venv/bin/python benchmarks/chain_call_parts.py [--quick]"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from structattn import LinearChainCRF
from structattn.structs.linear_chain import _chain_kernels, _kernel_pass

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, loaded by path too
from bound import _Null  # noqa: E402
from warm_calls import timed  # noqa: E402


def report(n: int, c: int, variable: bool, calls: int) -> str:
    """One size's parts, as a line."""
    torch.manual_seed(0)
    unary = torch.randn(32, n, c, requires_grad=True)
    pairwise = torch.randn(c, c, requires_grad=True)
    lengths = torch.randint(n // 2, n + 1, (32,)) if variable else None
    if lengths is not None:
        lengths[0] = n
    steps = 32 * (n - 1) if lengths is None else int((lengths - 1).sum())

    def grad(dist: LinearChainCRF) -> object:
        return torch.autograd.grad(dist.log_partition.sum(), (unary, pairwise))

    def null() -> object:
        return torch.autograd.grad(_Null.apply(unary, pairwise).sum(), (unary, pairwise))

    parts = {
        "construct (checks)": lambda: LinearChainCRF(unary, pairwise, lengths),
        "construct (no checks)": lambda: LinearChainCRF(
            unary, pairwise, lengths, validate_args=False
        ),
        "log Z fwd+bwd": lambda: grad(LinearChainCRF(unary, pairwise, lengths)),
        "log Z fwd+bwd (no checks)": lambda: grad(
            LinearChainCRF(unary, pairwise, lengths, validate_args=False)
        ),
        "null autograd op": null,
    }
    module = _chain_kernels(unary, pairwise, "auto")
    if module is not None:
        parts["kernel alone"] = lambda: _kernel_pass(module, unary, pairwise, lengths, 2)
    cells = [f"{name} {timed(fn, n=calls, warmup=calls // 10):.4f}" for name, fn in parts.items()]
    if module is not None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            one = timed(parts["kernel alone"], n=calls, warmup=calls // 10)
        finally:
            torch.set_num_threads(threads)
        cells.append(f"kernel on one thread {one * 1e6 / steps:.1f} ns per item and step")
    kind = "variable" if variable else "full"
    return f"N = {n}, C = {c}, {kind} lengths (ms): " + "; ".join(cells)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small size, few calls")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    sizes = ((8, 2, True),) if args.quick else ((50, 2, False), (100, 2, True), (200, 2, False))
    for n, c, variable in sizes:
        print(report(n, c, variable, 10 if args.quick else 400), flush=True)


if __name__ == "__main__":
    main()
