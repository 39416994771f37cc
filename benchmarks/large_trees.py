"""Trees of hundreds of words (issue 37.3.12): every operation of DependencyCRF and
NonProjectiveDependencyCRF on one sentence, seconds per call (min of ``--repeats``), with
the non-projective sampler both ways (Sherman-Morrison updates, the default, and the
recomputing sampler it replaced), and the O(N^3) work of each operation divided by the
time (what bounds it).

Run: .venv/bin/python benchmarks/large_trees.py [--sizes 100,200,500] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import structattn.structs.nonprojective as nonprojective
from structattn import DependencyCRF, NonProjectiveDependencyCRF
from structattn._validation import length_mask


def seconds(call: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def rows(n: int, repeats: int, old_sampler_max: int) -> list[tuple[str, float]]:
    torch.manual_seed(0)
    scores = torch.randn(1, n, n, requires_grad=True)
    weight = torch.randn(1, n, n)

    def marginals_backward(cls: type) -> Callable[[], object]:
        def run() -> object:
            return torch.autograd.grad((cls(scores).marginals * weight).sum(), scores)

        return run

    out = [
        ("projective log Z", seconds(lambda: DependencyCRF(scores).log_partition, repeats)),
        ("projective marginals", seconds(lambda: DependencyCRF(scores).marginals, repeats)),
        ("projective marginals fwd+bwd", seconds(marginals_backward(DependencyCRF), repeats)),
        ("projective MAP", seconds(lambda: DependencyCRF(scores).argmax, repeats)),
        ("projective sample(1)", seconds(lambda: DependencyCRF(scores).sample(1), repeats)),
        (
            "non-projective marginals fwd+bwd",
            seconds(marginals_backward(NonProjectiveDependencyCRF), repeats),
        ),
        (
            "non-projective MAP",
            seconds(lambda: NonProjectiveDependencyCRF(scores).argmax, repeats),
        ),
        (
            "non-projective sample(1)",
            seconds(lambda: NonProjectiveDependencyCRF(scores).sample(1), repeats),
        ),
    ]
    if n <= old_sampler_max:
        detached = scores.detach()
        real = length_mask(None, 1, n, detached.device)
        masked = detached.masked_fill(~nonprojective._arc_mask(real), float("-inf"))
        ok = torch.ones(1, dtype=torch.bool)

        def old() -> object:
            return nonprojective._sample_by_conditioning(masked, real, ok, None, True)

        out.append(("non-projective sample(1), recomputing sampler", seconds(old, 1)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,200,500")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--old-sampler-max", type=int, default=200, help="largest N for the O(N^4) sampler"
    )
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, B = 1, float32")
    print("| N | operation | seconds | N^3 / s (1e9) |")
    print("|---|---|---|---|")
    for n in (int(x) for x in args.sizes.split(",")):
        for name, sec in rows(n, args.repeats, args.old_sampler_max):
            print(f"| {n} | {name} | {sec:.3f} | {n**3 / sec / 1e9:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
