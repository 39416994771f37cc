"""The tree operations of issue 41 beside the peers that have them, side by side in one
process: k best projective trees (torch-struct, supar), k best non-projective trees (no peer
has them: ours alone), labelled projective trees (torch-struct) and the second-order
(adjacent-sibling) projective CRF (supar's ``Dependency2oCRF``); SparseMAP on projective and
non-projective trees (no peer: ours alone, beside our marginals and MAP as yardsticks).

Usage (``run.py --only treeops`` runs the same rows)::

    PYTHONPATH=src .venv-bench/bin/python benchmarks/tree_ops.py [--quick] [--repeats R]
        [--batch B] [--threads T] [--sizes 10,20] [--match second-order --match SparseMAP]

Float32, full lengths, multi-root, B trees of N positions (ROOT included). Before timing,
each peer's values are compared with ours (``agree``: the largest absolute difference of
the k best scores or of log Z). Times are medians over interleaved repeats (``timing.py``);
``ratio`` is the median over repeats of ours / the fastest peer within the repeat.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from timing import time_interleaved
from torch import Tensor

import structattn

PEERS = ("torch-struct", "supar")


@dataclass
class OpRow:
    """One timed operation at one size: median ms per library, ours / fastest peer."""

    op: str
    size: int
    ms: dict[str, float]
    ratio: float | None
    agree: dict[str, float]


def _root_on_diagonal(scores: Tensor) -> Tensor:
    """Ours [B, N, N(, L)] -> torch-struct's [B, n, n(, L)]: arcs between words, ROOT -> m
    on the diagonal."""
    words = scores[:, 1:, 1:].clone()
    index = torch.arange(words.shape[1])
    words[:, index, index] = scores[:, 0, 1:]
    return words


def _import_peers() -> dict[str, Any]:
    peers: dict[str, Any] = {}
    warnings.filterwarnings("ignore", message=".*does not define `arg_constraints`")
    warnings.filterwarnings("ignore", message="Using a non-tuple sequence")
    try:
        import torch_struct

        peers["torch-struct"] = torch_struct
    except ImportError:
        pass
    try:
        import supar.structs

        peers["supar"] = supar.structs
    except ImportError:
        pass
    return peers


def _fwd_bwd(value: Callable[[], Tensor], leaves: Sequence[Tensor]) -> Callable[[], object]:
    def call() -> object:
        out = value()
        return torch.autograd.grad(out.sum(), list(leaves))

    return call


def _marg_fwd_bwd(
    marginals: Callable[[], Tensor], leaves: Sequence[Tensor], weight: Tensor
) -> Callable[[], object]:
    def call() -> object:
        out = marginals()
        return torch.autograd.grad((out * weight).sum(), list(leaves))

    return call


def _configs(
    batch: int, sizes: Sequence[int], k: int, labels: int, peers: dict[str, Any]
) -> list[tuple[str, int, dict[str, Callable[[], object]], dict[str, float]]]:
    """(op, N, {library: call}, {peer: agreement}) for every row."""
    gen = torch.Generator().manual_seed(0)
    return [row for size in sizes for row in _configs_at(batch, size, k, labels, peers, gen)]


def _configs_at(
    batch: int, size: int, k: int, labels: int, peers: dict[str, Any], gen: torch.Generator
) -> list[tuple[str, int, dict[str, Callable[[], object]], dict[str, float]]]:
    """The rows of one size."""
    out = []
    ts, sp = peers.get("torch-struct"), peers.get("supar")
    words = torch.full((batch,), size - 1, dtype=torch.long)
    arcs = torch.randn(batch, size, size, generator=gen)
    # ---- k best projective trees
    fns: dict[str, Callable[[], object]] = {
        "ours": lambda a=arcs: structattn.DependencyCRF(a).topk(k)
    }
    ours_top = structattn.DependencyCRF(arcs.double()).topk(k)[0]  # [k, B]
    agree = {}
    if ts is not None:
        pot = _root_on_diagonal(arcs)
        fns["torch-struct"] = lambda p=pot: ts.DependencyCRF(p, lengths=words).topk(k)
        p64 = pot.double()
        top = ts.DependencyCRF(p64, lengths=words).topk(k)
        agree["torch-struct"] = float(((top * p64).sum((-1, -2)) - ours_top).abs().max())
    if sp is not None:
        s_arc = arcs.transpose(1, 2).contiguous()
        fns["supar"] = lambda s=s_arc: sp.DependencyCRF(s, words, multiroot=True).topk(k)
        heads = sp.DependencyCRF(s_arc.double(), words, multiroot=True).topk(k)  # [B, N, k]
        a64 = arcs.double()
        scores = torch.stack(
            [a64.gather(1, heads[:, :, r].unsqueeze(1)).squeeze(1)[:, 1:].sum(-1) for r in range(k)]
        )
        agree["supar"] = float((scores - ours_top).abs().max())
    out.append((f"topk k={k} projective", size, fns, agree))
    # ---- k best non-projective trees (no peer)
    nonproj: dict[str, Callable[[], object]] = {
        "ours": lambda a=arcs: structattn.NonProjectiveDependencyCRF(a).topk(k)
    }
    out.append((f"topk k={k} non-projective", size, nonproj, {}))
    # ---- labelled projective trees: log Z fwd+bwd and marginals fwd+bwd
    lab = torch.randn(batch, size, size, labels, generator=gen).requires_grad_(True)
    weight = torch.randn(batch, size, size, labels, generator=gen)
    logz = {"ours": _fwd_bwd(lambda s=lab: structattn.DependencyCRF(s).log_partition, [lab])}
    marg = {
        "ours": _marg_fwd_bwd(lambda s=lab: structattn.DependencyCRF(s).marginals, [lab], weight)
    }
    agree = {}
    if ts is not None:
        lpot = _root_on_diagonal(lab.detach()).requires_grad_(True)
        lweight = _root_on_diagonal(weight)
        # torch-struct's labelled potentials must require grad (it writes into a view)
        logz["torch-struct"] = _fwd_bwd(
            lambda p=lpot: ts.DependencyCRF(p, lengths=words).partition, [lpot]
        )
        marg["torch-struct"] = _marg_fwd_bwd(
            lambda p=lpot: ts.DependencyCRF(p, lengths=words).marginals,
            [lpot],
            lweight,
        )
        l64 = lpot.detach().double().requires_grad_(True)
        theirs = ts.DependencyCRF(l64, lengths=words).partition.detach()
        mine = structattn.DependencyCRF(lab.detach().double()).log_partition
        agree["torch-struct"] = float((theirs - mine).abs().max())
    out.append((f"labelled L={labels} log Z fwd+bwd", size, logz, agree))
    out.append((f"labelled L={labels} marginals fwd+bwd", size, marg, agree))
    # ---- second order: log Z fwd+bwd and MAP
    arc2 = torch.randn(batch, size, size, generator=gen).requires_grad_(True)
    sib2 = torch.randn(batch, size, size, size, generator=gen).requires_grad_(True)

    def ours2(a: Tensor = arc2, s: Tensor = sib2) -> Tensor:
        return structattn.SecondOrderDependencyCRF(a, s).log_partition

    logz2 = {"ours": _fwd_bwd(ours2, [arc2, sib2])}
    map2: dict[str, Callable[[], object]] = {
        "ours": lambda a=arc2, s=sib2: (
            structattn.SecondOrderDependencyCRF(a.detach(), s.detach()).argmax
        )
    }
    agree = {}
    if sp is not None:
        s_arc2 = arc2.detach().transpose(1, 2).contiguous().requires_grad_(True)
        s_sib2 = sib2.detach().permute(0, 2, 1, 3).contiguous().requires_grad_(True)

        def supar2(a: Tensor = s_arc2, s: Tensor = s_sib2) -> Tensor:
            return sp.Dependency2oCRF((a, s), words, multiroot=True).log_partition

        logz2["supar"] = _fwd_bwd(supar2, [s_arc2, s_sib2])
        map2["supar"] = lambda a=s_arc2, s=s_sib2: (
            sp.Dependency2oCRF((a.detach(), s.detach()), words, multiroot=True).argmax
        )
        theirs = sp.Dependency2oCRF(
            (s_arc2.double(), s_sib2.double()), words, multiroot=True
        ).log_partition
        mine = structattn.SecondOrderDependencyCRF(
            arc2.detach().double(), sib2.detach().double()
        ).log_partition
        agree["supar"] = float((theirs.detach() - mine).abs().max())
    out.append(("second-order log Z fwd+bwd", size, logz2, agree))
    out.append(("second-order argmax (MAP)", size, map2, agree))
    # ---- SparseMAP (no peer has it): ours, with our marginals and MAP as the yardsticks
    for name, cls in (
        ("projective", structattn.DependencyCRF),
        ("non-projective", structattn.NonProjectiveDependencyCRF),
    ):
        scores = arcs.detach()
        out.append(
            (f"SparseMAP {name}", size, {"ours": lambda c=cls, a=scores: c(a).sparsemap()}, {})
        )
        out.append(
            (
                f"{name} marginals (yardstick)",
                size,
                {"ours": lambda c=cls, a=scores: c(a).marginals},
                {},
            )
        )
        out.append(
            (f"{name} argmax (yardstick)", size, {"ours": lambda c=cls, a=scores: c(a).argmax}, {})
        )
    return out


def run_rows(
    batch: int,
    sizes: Sequence[int],
    repeats: int,
    warmup: int,
    k: int = 5,
    labels: int = 20,
    match: Sequence[str] = (),
) -> list[OpRow]:
    """Time every row (see the module docstring); with ``match``, only the rows whose op
    contains one of those strings."""
    peers = _import_peers()
    rows = []
    for op, size, fns, agree in _configs(batch, sizes, k, labels, peers):
        if match and not any(m in op for m in match):
            continue
        timings = time_interleaved(fns, repeats, warmup)
        ms = {name: t.median * 1e3 for name, t in timings.items()}
        others = [name for name in timings if name != "ours"]
        ratio = None
        if others:
            per_repeat = [
                ours / min(timings[name].samples[r] for name in others)
                for r, ours in enumerate(timings["ours"].samples)
            ]
            ratio = statistics.median(per_repeat)
        rows.append(OpRow(op, size, ms, ratio, agree))
        print(_line(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _line(row: OpRow) -> str:
    cells = [row.op, str(row.size), f"{row.ms['ours']:.2f}"]
    cells += [f"{row.ms[p]:.2f}" if p in row.ms else "-" for p in PEERS]
    cells.append("-" if row.ratio is None else f"{row.ratio:.2f}")
    cells.append(", ".join(f"{p} {e:.1e}" for p, e in row.agree.items()) or "-")
    return "| " + " | ".join(cells) + " |"


def format_table(rows: Sequence[OpRow]) -> str:
    head = "| op | N | ours ms | torch-struct ms | supar ms | ours / fastest peer | agree |"
    rule = "|---|---|---|---|---|---|---|"
    return "\n".join([head, rule, *(_line(r) for r in rows)])


def to_json(rows: Sequence[OpRow]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", default=None, help="comma-separated N (default 10,20,40)")
    parser.add_argument(
        "--match", action="append", default=[], help="only the ops containing this (repeatable)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = (6,) if args.quick else (10, 20, 40)
    if args.sizes:
        sizes = tuple(int(n) for n in args.sizes.split(","))
    rows = run_rows(
        args.batch or (2 if args.quick else 16),
        sizes,
        args.repeats or (2 if args.quick else 7),
        1 if args.quick else 2,
        k=5,
        labels=3 if args.quick else 20,
        match=args.match,
    )
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
