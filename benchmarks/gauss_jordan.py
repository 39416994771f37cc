"""The two inversions of the matrix-tree kernels' LU path, timed (issue 42).

``matrix_tree_lu`` (``structs/_matrix_tree.cpp``) inverts the Laplacians of a batch either by
Gauss-Jordan elimination on SIMD lanes (eight matrices at once, ``method=1``) or by LAPACK
(``method=2``). This script times both on the loaded kernels, B = 32 float32 scores, min
over warm calls (ms)::

    .venv-bench/bin/python benchmarks/gauss_jordan.py [--clone v3] [--threads 2]
    .venv-bench/bin/python benchmarks/gauss_jordan.py --so PATH/structattn_kernels_<hash>.so

``--clone`` selects a one-target build as ``run.py --clone`` does; ``--so`` loads one built
module file as it is (from the torch extensions cache), so that two builds (say before and
after a change of the C++ sources) can be timed in alternating processes: a process loads
one build.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: siblings are importable
    sys.path.insert(0, str(Path(__file__).resolve().parent))


def _load(path: str | None) -> tuple[Any, str]:
    """(the kernels' module, a description of the build)."""
    import torch

    if path is None:
        from structattn.structs._extension import kernels, simd_target

        module = kernels(torch.zeros(1, 2, 2))
        if module is None:
            raise SystemExit("the C++ kernels are not loaded: nothing to time")
        return module, f"kernels' SIMD target {simd_target()}"
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, f"build {Path(path).name} ({module.simd_target()})"


def main(argv: Sequence[str] | None = None) -> int:
    from run import CLONE_CAPABILITY, force_clone

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clone", choices=tuple(CLONE_CAPABILITY))
    parser.add_argument("--so", help="a built kernels module file to load instead")
    parser.add_argument("--sizes", default="20,40,80,120", help="comma-separated N")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=21, help="timed calls per size")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    force_clone(args.clone)
    import torch

    module, build = _load(args.so)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"# {build}, {args.threads} thread(s), B = {args.batch}, min of {args.calls} calls (ms)")
    for n in (int(s) for s in args.sizes.split(",")):
        scores = torch.randn(args.batch, n, n)
        times = {}
        for method, name in ((1, "Gauss-Jordan"), (2, "LAPACK")):
            for _ in range(3):
                module.matrix_tree_lu(scores, None, True, 1e12, True, method, 1e6)
            samples = []
            for _ in range(args.calls):
                start = time.perf_counter()
                module.matrix_tree_lu(scores, None, True, 1e12, True, method, 1e6)
                samples.append(time.perf_counter() - start)
            times[name] = min(samples) * 1e3
        print(f"N = {n}: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
