"""Projective trees over consecutive sizes in steady state (issue 42).

``DependencyCRF(torch.randn(B, N, N)).log_partition`` forward + backward (``--op logz_fb``)
or the marginals with the backward of a loss on them (``--op marg_fb``), each size's calls
back to back (as in training: the fused path's memory pool stays warm), min ms over
``--rounds`` blocks of ``--calls`` calls; for each size with the split weights kept by the
library's rule (``kept``) and all recomputed (``recomputed``, ``_CACHE_ELEMENTS`` = 0)::

    .venv/bin/python benchmarks/steady_sizes.py [--clone v3|default] --sizes 58,60,62,64,66

(``clone_audit.py`` interleaves each call with the PyTorch code's, which measures the
ratio between the two but leaves the kernels' memory pool cold more often: single sizes
there jump by up to 2x from run to run.)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: siblings are importable
    sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: Sequence[str] | None = None) -> int:
    from run import CLONE_CAPABILITY, force_clone

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clone", choices=tuple(CLONE_CAPABILITY))
    parser.add_argument("--sizes", default="58,60,61,62,64,66,68", help="comma-separated N")
    parser.add_argument("--op", choices=("logz_fb", "marg_fb"), default="logz_fb")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)
    force_clone(args.clone)
    import torch

    from structattn import DependencyCRF
    from structattn.structs import _extension, dependency

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(
        f"# kernels' SIMD target {_extension.simd_target()}, {args.threads} thread(s), "
        f"B = {args.batch}, {args.op}, min of {args.rounds} x {args.calls} calls (ms)"
    )
    budget = dependency._CACHE_ELEMENTS
    try:
        for n in (int(s) for s in args.sizes.split(",")):
            scores = torch.randn(args.batch, n, n, requires_grad=True)
            weight = torch.randn(args.batch, n, n)

            def call(scores: torch.Tensor = scores, weight: torch.Tensor = weight) -> None:
                crf = DependencyCRF(scores)
                if args.op == "logz_fb":
                    torch.autograd.grad(crf.log_partition.sum(), scores)
                else:
                    torch.autograd.grad((crf.marginals * weight).sum(), scores)

            times = {}
            for name, elements in (("kept", budget), ("recomputed", 0)):
                dependency._CACHE_ELEMENTS = elements
                call()  # warm
                best = float("inf")
                for _ in range(args.rounds * args.calls):
                    start = time.perf_counter()
                    call()
                    best = min(best, time.perf_counter() - start)
                times[name] = best * 1e3
            print(f"N = {n}: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()), flush=True)
    finally:
        dependency._CACHE_ELEMENTS = budget
    return 0


if __name__ == "__main__":
    sys.exit(main())
