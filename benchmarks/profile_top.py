"""Top PyTorch ops of one benchmark configuration, per library (``torch.profiler``).

Usage::

    .venv-bench/bin/python benchmarks/profile_top.py tree marg_fb 80 [--labels C]
        [--var] [--single-root] [--batch 32] [--threads 2] [--top 8]

Prints, for ours and each installed peer, the wall time of one call and the ops with the
largest self CPU time (with their call counts): a hint of *why* one library is slower.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from peers import adapters_for
from problems import make_chain, make_tree


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("section", choices=("tree", "chain", "nonproj"))
    parser.add_argument("op", choices=("logz_fb", "marg_fb", "marg", "argmax"))
    parser.add_argument("size", type=int)
    parser.add_argument("--labels", type=int, default=10)
    parser.add_argument("--var", action="store_true", help="variable lengths")
    parser.add_argument("--single-root", action="store_true")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*does not define `arg_constraints`")
    if args.section == "chain":
        problem = make_chain(args.batch, args.size, args.labels, args.var)
    else:
        problem = make_tree(
            args.batch, args.size, args.var, not args.single_root, args.section == "tree"
        )
    adapters, skipped = adapters_for(args.section)
    for message in skipped:
        print(message)
    for adapter in adapters:
        if args.op not in adapter.ops:
            continue
        fn = adapter.op(args.op, adapter.prepare(problem))
        fn()  # warm-up
        start = time.perf_counter()
        fn()
        wall = time.perf_counter() - start
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        print(f"\n### {adapter.library}: {wall * 1e3:.1f} ms per call (unprofiled)")
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
