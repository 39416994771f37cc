"""The C++ kernels against our own PyTorch code, per SIMD clone (issue 42, items 3-4).

Usage::

    .venv-bench/bin/python benchmarks/clone_audit.py --clone v3 [--only tree|chain|nonproj]
        [--sizes 63,64,65] [--repeats R] [--threads T] [--json OUT]

Every row times one operation of ours in one process, interleaved
(``timing.time_interleaved``): ``kernels`` (what a user gets: the loaded kernels and the
dispatch of ``structs/``) and ``pytorch`` (the same call under ``kernels_disabled()``, i.e.
``STRUCTATTN_EXTENSION=0``'s code). For projective log Z and marginals both kernel paths are
timed, forced through ``dependency._FUSED_SIZES`` of the loaded clone: ``fused`` (the fused
Eisner loops) and ``aten`` (the kernels' per-width ATen path); ``dispatch`` names the one the
dispatch picks for that size on that clone, whose times are the ``kernels`` columns.
``--clone`` selects the one-target build and PyTorch's CPU capability as ``run.py --clone``
does. Columns: the minimum over repeats (ms) and ``X / PyTorch``, the median over repeats of
the ratio measured within one repeat (calls back to back); below 1 the kernels are faster.

Operations, float32, B = 32, standard-normal potentials, full lengths (``--variable-lengths``:
drawn as ``run.py``'s "var" rows, uniformly from [N/2, N] with one item at N):

* ``tree``    DependencyCRF, N in {10, 20, 40, 63, 64, 65, 80, 81, 96, 97} (positions incl.
  ROOT; 64 / 65 is the kept-weights rule's step at B = 32, 96 / 97 the fused loops' limit):
  ``logz_fb`` (log Z, backward of its sum), ``marg_fb`` (marginals, backward of
  ``(marginals * w).sum()``), ``argmax`` (MAP).
* ``chain``   LinearChainCRF with one shared [C, C] transition matrix, N in {20, 100, 200},
  C in {2, 10, 16, 25}: ``logz_fb``, ``marg_fb``. ``--kernel-everywhere`` lifts the chain
  dispatch's limits (``linear_chain._ONE_THREAD_LABELS``, ``_KERNEL_LABELS``,
  ``_SHARED_LABELS``, ``_SHARED_BUFFER``), so that ``kernels`` times the kernel itself where
  the dispatch would pick the PyTorch code (how those limits are measured).
* ``nonproj`` NonProjectiveDependencyCRF (matrix-tree theorem; MAP by Chu-Liu-Edmonds), N in
  {10, 20, 40, 80}: ``logz_fb``, ``marg_fb``, ``argmax``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: siblings are importable
    sys.path.insert(0, str(Path(__file__).resolve().parent))

SECTIONS = ("tree", "chain", "nonproj")
TREE_SIZES = (10, 20, 40, 63, 64, 65, 80, 81, 96, 97)
CHAIN_SIZES = (20, 100, 200)
CHAIN_LABELS = (2, 10, 16, 25)
NONPROJ_SIZES = (10, 20, 40, 80)


@contextlib.contextmanager
def _fused_limit(limit: int) -> Iterator[None]:
    """Projective trees up to ``limit`` positions on the kernels' fused Eisner loops, larger
    ones on their per-width ATen path, on the loaded clone (``dependency._FUSED_SIZES``)."""
    from structattn.structs import _extension, dependency

    target = _extension.loaded_target() or ""
    saved = dict(dependency._FUSED_SIZES)
    dependency._FUSED_SIZES[target] = limit
    try:
        yield
    finally:
        dependency._FUSED_SIZES.clear()
        dependency._FUSED_SIZES.update(saved)


@contextlib.contextmanager
def _chain_limits_lifted() -> Iterator[None]:
    """Every chain on the kernel (the dispatch's label, thread and buffer limits lifted)."""
    from structattn.structs import linear_chain as lc

    names = ("_ONE_THREAD_LABELS", "_KERNEL_LABELS", "_SHARED_LABELS", "_SHARED_BUFFER")
    saved = {name: getattr(lc, name) for name in names}
    for name in names:
        setattr(lc, name, 1 << 40)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(lc, name, value)


def _ops(
    section: str, n: int, labels: int, batch: int, variable: bool = False
) -> dict[str, Callable[[], object]]:
    """The timed calls of one configuration (fresh leaves, fixed seed)."""
    import torch

    import structattn

    torch.manual_seed(0)
    lengths = None
    if variable:
        lengths = torch.randint(max(2, n // 2), n + 1, (batch,))
        lengths[0] = n
    if section == "chain":
        unary = torch.randn(batch, n, labels, requires_grad=True)
        pairwise = torch.randn(labels, labels, requires_grad=True)
        weight = torch.randn(batch, n, labels)

        def chain() -> Any:
            return structattn.LinearChainCRF(unary, pairwise, lengths=lengths)

        leaves: tuple[Any, ...] = (unary, pairwise)
        make: Callable[[], Any] = chain
    else:
        scores = torch.randn(batch, n, n, requires_grad=True)
        weight = torch.randn(batch, n, n)
        leaves = (scores,)
        if section == "tree":

            def tree() -> Any:
                return structattn.DependencyCRF(scores, lengths=lengths)

            make = tree
        else:
            from structattn.distributions.nonprojective import NonProjectiveDependencyCRF

            def nonproj() -> Any:
                return NonProjectiveDependencyCRF(scores, lengths=lengths)

            make = nonproj

    def logz_fb() -> object:
        return torch.autograd.grad(make().log_partition.sum(), leaves)

    def marg_fb() -> object:
        return torch.autograd.grad((make().marginals * weight).sum(), leaves)

    def argmax() -> object:
        with torch.no_grad():
            return make().argmax

    ops: dict[str, Callable[[], object]] = {"logz_fb": logz_fb, "marg_fb": marg_fb}
    if section != "chain":
        ops["argmax"] = argmax
    return ops


def _variants(
    section: str, op: str, call: Callable[[], object], forced_paths: bool = True
) -> dict[str, Callable[[], object]]:
    """``kernels`` (the dispatch's choice) and ``pytorch``; for projective log Z and
    marginals ``fused`` and ``aten`` (both kernel paths forced) instead of ``kernels`` unless
    not ``forced_paths``."""
    from structattn.structs._extension import kernels_disabled
    from structattn.structs.dependency import _FUSED_SIZE

    def pytorch() -> object:
        with kernels_disabled():
            return call()

    def forced(limit: int) -> Callable[[], object]:
        def run() -> object:
            with _fused_limit(limit):
                return call()

        return run

    if forced_paths and section == "tree" and op != "argmax":
        return {"fused": forced(_FUSED_SIZE), "aten": forced(0), "pytorch": pytorch}
    return {"kernels": call, "pytorch": pytorch}


def audit_row(
    section: str,
    n: int,
    labels: int,
    op: str,
    call: Callable[[], object],
    repeats: int,
    forced_paths: bool = True,
) -> dict[str, Any]:
    from timing import time_interleaved

    variants = _variants(section, op, call, forced_paths)
    results = time_interleaved(variants, repeats, warmup=1)
    row: dict[str, Any] = {"section": section, "n": n, "labels": labels, "op": op}
    if section == "tree" and op != "argmax":  # what the dispatch picks on this clone
        from structattn.structs.dependency import _fused

        row["dispatch"] = "fused" if _fused(n) else "aten"
    if "fused" in results:
        results["kernels"] = results[row["dispatch"]]
    for name, result in results.items():
        row[f"{name}_ms"] = result.minimum * 1e3
    torch_ = results["pytorch"].samples
    for name in ("kernels", "fused", "aten"):
        if name in results:
            pairs = zip(results[name].samples, torch_, strict=True)
            row[f"{name}/pytorch"] = statistics.median(k / t for k, t in pairs)
    return row


def configs(
    section: str, sizes: Sequence[int] | None, labels: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    if section == "tree":
        return [(n, 0) for n in sizes or TREE_SIZES]
    if section == "nonproj":
        return [(n, 0) for n in sizes or NONPROJ_SIZES]
    return [(n, c) for n in sizes or CHAIN_SIZES for c in labels or CHAIN_LABELS]


def format_row(row: dict[str, Any]) -> str:
    def ms(key: str) -> str:
        return f"{row[key]:.2f}" if key in row else ""

    def ratio(key: str) -> str:
        return f"{row[key]:.2f}" if key in row else ""

    size = f"{row['n']}" + (f", C = {row['labels']}" if row["section"] == "chain" else "")
    return (
        f"| {row['section']} | {size} | {row['op']} | {row.get('dispatch', '')} | "
        f"{ms('kernels_ms')} | {ms('pytorch_ms')} | **{ratio('kernels/pytorch')}** | "
        f"{ratio('fused/pytorch')} | {ratio('aten/pytorch')} |"
    )


HEADER = (
    "| section | N | op | dispatch | kernels ms | PyTorch ms | kernels / PyTorch | "
    "fused / PyTorch | ATen path / PyTorch |\n|---|---|---|---|---|---|---|---|---|"
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from run import CLONE_CAPABILITY

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clone", choices=tuple(CLONE_CAPABILITY))
    parser.add_argument("--only", action="append", choices=SECTIONS)
    parser.add_argument("--sizes", help="comma-separated N (default: the section's sizes)")
    parser.add_argument("--labels", help="chains: comma-separated C (default: 2,10,16,25)")
    parser.add_argument("--ops", help="comma-separated operations (default: all)")
    parser.add_argument(
        "--dispatch-only",
        action="store_true",
        help="projective trees: time only the path the dispatch picks (not both forced)",
    )
    parser.add_argument(
        "--variable-lengths",
        action="store_true",
        help="lengths uniform in [N/2, N] (one item at N) instead of full lengths",
    )
    parser.add_argument(
        "--kernel-everywhere",
        action="store_true",
        help="chains: lift the dispatch's limits, so that 'kernels' times the kernel itself",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", metavar="OUT")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from run import force_clone

    args = parse_args(argv)
    force_clone(args.clone)  # before torch's first CPU kernel and the kernels' load
    import torch

    from structattn.structs._extension import kernels, simd_target

    torch.set_num_threads(args.threads)
    if kernels(torch.zeros(1, 2, 2)) is None:
        print("the C++ kernels are not loaded: nothing to compare", file=sys.stderr)
        return 1
    capability = torch.backends.cpu.get_cpu_capability()
    print(
        f"# kernels' SIMD target {simd_target()}, ATen CPU capability {capability}, "
        f"MKL_ENABLE_INSTRUCTIONS {os.environ.get('MKL_ENABLE_INSTRUCTIONS', 'unset')}, "
        f"{args.threads} thread(s), B = {args.batch}, min of {args.repeats} interleaved repeats, "
        f"{'variable' if args.variable_lengths else 'full'} lengths"
        + (", chain limits lifted" if args.kernel_everywhere else "")
    )
    print(HEADER, flush=True)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
    wanted = set(args.ops.split(",")) if args.ops else None
    labels = [int(c) for c in args.labels.split(",")] if args.labels else None
    rows = []
    lifted = _chain_limits_lifted() if args.kernel_everywhere else contextlib.nullcontext()
    with lifted:
        for section in args.only or SECTIONS:
            for n, c in configs(section, sizes, labels):
                ops = _ops(section, n, c, args.batch, args.variable_lengths)
                for op, call in ops.items():
                    if wanted is not None and op not in wanted:
                        continue
                    forced = not args.dispatch_only
                    row = audit_row(section, n, c, op, call, args.repeats, forced)
                    row["lengths"] = "variable" if args.variable_lengths else "full"
                    rows.append(row)
                    print(format_row(row), flush=True)
                    if args.json:
                        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
