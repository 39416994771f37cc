"""torch.compile against eager: one StructuredMultiheadAttention layer, forward and backward
(a loss on its output), per head type, with ``validate_args=False`` (issue 38.4).

For each head type the layer runs eagerly and compiled with ``fullgraph=True`` by inductor
(and ``aot_eager``); the script prints the compile time (the first call), the median
milliseconds of warm calls and the eager / compiled ratio (> 1: compiled is faster), and checks
that the compiled gradients equal the eager ones. The dynamic programs run as structattn's
custom operators in the compiled graph (the C++ kernels where built); what inductor compiles
is the rest of the layer (projections, masking, weights times values).

One thread by default: on a loaded 2-core machine, two OpenMP threads that spin-wait for
each other made the eager C++ tree kernels 20 times slower (measured), which no comparison
should include.

Run: python benchmarks/compile_speed.py [--quick] [--batch 16 --length 20 --threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from structattn.attention import StructuredMultiheadAttention

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, loaded by path too
from warm_calls import timed  # noqa: E402

HEADS = (
    "projective",
    "non-projective",
    "segmentation",
    "mean-field",
    "constituency",
    "semi-markov",
)


def _step(model: StructuredMultiheadAttention) -> Callable[[Tensor, Tensor], Tensor]:
    def step(x: Tensor, padding: Tensor) -> Tensor:
        out = model(x, x, x, key_padding_mask=padding, need_weights=False)[0]
        return out.square().mean()

    return step


def _run(step: Callable[[Tensor, Tensor], Tensor], x: Tensor, padding: Tensor) -> list[Tensor]:
    leaf = x.detach().requires_grad_(True)
    step(leaf, padding).backward()
    assert leaf.grad is not None
    return [leaf.grad]


def row(head: str, backend: str, batch: int, length: int, calls: int, warmup: int) -> str:
    torch.manual_seed(0)
    model = StructuredMultiheadAttention(
        64, 4, batch_first=True, normalizer=head, validate_args=False
    )
    x = torch.randn(batch, length, 64)
    lengths = torch.randint(length // 2, length + 1, (batch,))
    lengths[0] = length
    padding = torch.arange(length) >= lengths.unsqueeze(-1)  # True = padding
    eager = _step(model)
    torch._dynamo.reset()
    compiled = torch.compile(eager, fullgraph=True, backend=backend)
    start = time.perf_counter()
    got = _run(compiled, x, padding)
    compile_s = time.perf_counter() - start
    torch.testing.assert_close(got, _run(eager, x, padding), rtol=1e-4, atol=1e-6)
    eager_ms = timed(lambda: _run(eager, x, padding), calls, warmup)
    compiled_ms = timed(lambda: _run(compiled, x, padding), calls, warmup)
    return (
        f"| {head} | {backend} | {compile_s:.1f} | {eager_ms:.2f} | {compiled_ms:.2f} | "
        f"{eager_ms / compiled_ms:.2f}x |"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few calls, aot_eager only")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--heads", nargs="+", default=list(HEADS), choices=HEADS)
    parser.add_argument("--backends", nargs="+", default=["inductor", "aot_eager"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    calls, warmup = (5, 2) if args.quick else (args.calls, 5)
    backends = ["aot_eager"] if args.quick else args.backends
    print(
        f"StructuredMultiheadAttention(64, 4 heads) fwd+bwd, B = {args.batch}, "
        f"L = {args.length}, {args.threads} threads, median of {calls} warm calls"
    )
    print("| heads | backend | compile s | eager ms | compiled ms | eager / compiled |")
    print("|---|---|---|---|---|---|")
    for head in args.heads:
        for backend in backends:
            print(row(head, backend, args.batch, args.length, calls, warmup), flush=True)


if __name__ == "__main__":
    main()
