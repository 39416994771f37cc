"""One prepared check of structattn on an accelerator (issue 38, GPU): run it on a CUDA
machine and commit the Markdown file it writes.

1. Correctness: every distribution (log Z and marginals, float32 on the device) against the
   float64 result on the CPU, and every attention layer's forward and backward on the device
   in float32 and under autocast (float16 on CUDA, bfloat16 on the CPU) against float32.
2. Host synchronisations with ``validate_args=False`` (CUDA: ``torch.cuda.set_sync_debug_mode``;
   on the CPU the same calls are counted by wrapping ``Tensor.item`` / ``tolist`` / ``bool``).
3. Speed: log Z forward+backward and marginals forward+backward (B = 32, N = 20 / 40 / 80),
   ours beside torch-struct and supar when they are installed, on the same device.

Run: ``python benchmarks/gpu_check.py`` (CUDA when available; ``--device cpu`` runs the same
checks on the CPU, as CI does with ``--quick``). About 2-4 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))  # problems.py, peers.py
from peers import adapters_for  # noqa: E402
from problems import Problem, make_chain, make_tree  # noqa: E402

from structattn import (  # noqa: E402
    DependencyCRF,
    LinearChainCRF,
    NonProjectiveDependencyCRF,
    SemiMarkovCRF,
    SplitTreeDistribution,
    TreeCRF,
)
from structattn.attention import (  # noqa: E402
    MeanFieldAttention,
    MemoryCRFAttention,
    SegmentationAttention,
    StructuredMultiheadAttention,
    SyntacticAttention,
)
from structattn.structs import kernels_disabled  # noqa: E402
from structattn.structs.mean_field import mean_field_marginals  # noqa: E402

D = 16  # feature size of the layers' inputs


def distributions(x: Tensor, n: int) -> dict[str, Callable[[bool], Any]]:
    """Each distribution built from the leading entries of ``x`` [B, N, N, K]."""
    b = x.shape[0]
    lengths = torch.full((b,), n, dtype=torch.long, device=x.device)
    lengths[0] = max(2, n - 2)  # one shorter item: padding on the device too
    return {
        "LinearChainCRF": lambda v: LinearChainCRF(
            x[..., 0, :4], x[0, :4, :4, 1], lengths, validate_args=v
        ),
        "DependencyCRF": lambda v: DependencyCRF(x[..., 2], lengths, validate_args=v),
        "NonProjectiveDependencyCRF": lambda v: NonProjectiveDependencyCRF(
            x[..., 3], lengths, validate_args=v
        ),
        "TreeCRF": lambda v: TreeCRF(x[..., 4], lengths, validate_args=v),
        "SemiMarkovCRF": lambda v: SemiMarkovCRF(
            x[:, :, :3, 5:8], x[0, :3, :3, 8], lengths, validate_args=v
        ),
        "SplitTreeDistribution": lambda v: SplitTreeDistribution(
            x[:, :, 0, 9], lengths, validate_args=v
        ),
    }


def check_distributions(device: torch.device, n: int) -> list[list[str]]:
    """Rows: distribution, max |log Z diff|, max |marginals diff| (device float32 vs CPU
    float64), gradient finite."""
    torch.manual_seed(0)
    x = torch.randn(4, n, n, 10, dtype=torch.float64)
    rows = []
    reference = distributions(x, n)
    ours = distributions(x.to(device, torch.float32).requires_grad_(True), n)
    for name, make in ours.items():
        dist, ref = make(True), reference[name](True)
        logz = (dist.log_partition.double().cpu() - ref.log_partition).abs().max().item()
        marginals = dist.marginals
        diff = (marginals.double().cpu() - ref.marginals).abs().max().item()
        marginals.pow(2).sum().backward()
        rows.append([name, f"{logz:.1e}", f"{diff:.1e}", "yes"])
    u = torch.randn(4, n, dtype=torch.float64)
    j = torch.randn(4, n, n, dtype=torch.float64) * 0.3
    got = mean_field_marginals(u.to(device).float(), j.to(device).float(), 5)
    diff = (got.double().cpu() - mean_field_marginals(u, j, 5)).abs().max().item()
    rows.append(["mean_field_marginals", "-", f"{diff:.1e}", "-"])
    return rows


def layers() -> dict[str, Callable[[], torch.nn.Module]]:
    heads = {
        f"StructuredMultiheadAttention ({kind})": (
            lambda kind=kind: StructuredMultiheadAttention(D, 2, batch_first=True, normalizer=kind)
        )
        for kind in ("projective", "non-projective", "segmentation", "mean-field")
    }
    return {
        "SegmentationAttention": lambda: SegmentationAttention(D),
        "MeanFieldAttention": lambda: MeanFieldAttention(D),
        "SyntacticAttention (projective)": lambda: SyntacticAttention(D),
        "SyntacticAttention (non-projective)": lambda: SyntacticAttention(
            D, structure="non-projective"
        ),
        "MemoryCRFAttention": lambda: MemoryCRFAttention(D, 3),
        **heads,
    }


def _run_layer(layer: torch.nn.Module, name: str, query: Tensor, memory: Tensor) -> Tensor:
    if name.startswith("StructuredMultihead"):
        return layer(memory, memory, memory)[0]
    if name.startswith("SyntacticAttention"):
        return layer(memory).parents
    if name == "MemoryCRFAttention":
        return layer(query[:, 0], memory, memory).context
    return layer(query, memory).context


def check_layers(device: torch.device, half: torch.dtype) -> list[list[str]]:
    """Rows: layer, float32 forward+backward finite, max |diff| under autocast vs float32."""
    rows = []
    for name, make in layers().items():
        torch.manual_seed(0)
        layer = make().to(device)
        query = torch.randn(4, 3, D, device=device)
        memory = torch.randn(4, 7, D, device=device, requires_grad=True)
        full = _run_layer(layer, name, query, memory)
        full.float().sum().backward()
        finite = bool(torch.isfinite(full).all()) and bool(torch.isfinite(memory.grad).all())
        with torch.autocast(device.type, dtype=half):
            mixed = _run_layer(layer, name, query, memory)
        mixed.float().sum().backward()
        diff = (mixed.float() - full.float()).abs().max().item()
        rows.append([name, "yes" if finite else "NO", f"{diff:.1e}"])
    return rows


@contextlib.contextmanager
def counted_syncs(device: torch.device) -> Iterator[list[str]]:
    """Host synchronisations inside the block: CUDA's sync debug mode, or on the CPU the
    calls that would synchronise on a GPU (``item``, ``tolist``, ``bool``, ``int``,
    ``float``, ``nonzero``)."""
    seen: list[str] = []
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                yield seen
            seen.extend(str(w.message)[:60] for w in caught if "synchroniz" in str(w.message))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero")
    saved = {name: getattr(Tensor, name) for name in names}

    def wrap(name: str) -> Callable[..., Any]:
        original = saved[name]

        def call(self: Tensor, *args: Any, **kwargs: Any) -> Any:
            seen.append(name)
            return original(self, *args, **kwargs)

        return call

    for name in names:
        setattr(Tensor, name, wrap(name))
    try:
        yield seen
    finally:
        for name, original in saved.items():
            setattr(Tensor, name, original)


def check_syncs(device: torch.device, n: int) -> list[list[str]]:
    """Rows: distribution, host syncs of log Z + marginals with validate_args=False."""
    torch.manual_seed(0)
    x = torch.randn(4, n, n, 10, device=device)
    rows = []
    # on the CPU the PyTorch code, the path a GPU runs (the C++ kernels need no syncs)
    for name, make in distributions(x, n).items():
        pytorch_code = kernels_disabled() if device.type == "cpu" else contextlib.nullcontext()
        with pytorch_code:
            _ = make(False).marginals  # warm-up (first-call caches)
            with counted_syncs(device) as seen:
                dist = make(False)
                _ = dist.log_partition, dist.marginals
        rows.append([name, str(len(seen)), ", ".join(sorted(set(seen))) or "-"])
    return rows


def _timed(call: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls after one warm-up."""
    call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _on(problem: Problem, device: torch.device) -> Problem:
    lengths = None if problem.lengths is None else problem.lengths.to(device)
    tensors = tuple(t.to(device) for t in problem.tensors)
    return Problem(problem.kind, tensors, lengths, problem.multiroot, problem.weight.to(device))


def check_speed(device: torch.device, sizes: list[int], repeats: int) -> list[list[str]]:
    """Rows: structure, N, op, ms of ours and of each installed peer."""
    rows = []
    for kind in ("tree", "nonproj", "chain"):
        adapters, _ = adapters_for(kind)
        for n in sizes:
            cpu_problem = (
                make_chain(32, n, 10, variable=True)
                if kind == "chain"
                else make_tree(32, n, variable=True, multiroot=True, projective=kind == "tree")
            )
            problem = _on(cpu_problem, device)
            for op in ("logz_fb", "marg_fb"):
                cells = []
                for adapter in adapters:
                    reason = adapter.supports(problem)
                    if reason is not None or op not in adapter.ops:
                        cells.append(f"{adapter.library}: -")
                        continue
                    try:
                        state = adapter.prepare(problem)
                        ms = _timed(adapter.op(op, state), device, repeats)
                        cells.append(f"{adapter.library}: {ms:.2f}")
                    except Exception as err:  # noqa: BLE001 - a peer's failure is a finding
                        cells.append(f"{adapter.library}: FAIL ({type(err).__name__})")
                rows.append([kind, str(n), op, "; ".join(cells)])
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="N = 6 / 20 only, 2 repeats")
    parser.add_argument("--out", default=None, help="Markdown file (default benchmarks/...)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    half = torch.float16 if device.type == "cuda" else torch.bfloat16
    n = 6
    sizes, repeats = ([20], 2) if args.quick else ([20, 40, 80], 10)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    out = Path(args.out or Path(__file__).parent / f"gpu_check_{device.type}.md")
    parts = [
        "# structattn on one device: correctness, host syncs, speed",
        "",
        f"Device: {device} ({name or platform.machine()}), torch {torch.__version__}; "
        f"command: `python benchmarks/gpu_check.py {' '.join(argv or sys.argv[1:])}`",
        "",
        f"## Distributions (N = {n}, float32 on the device vs float64 on the CPU)",
        table(
            ["distribution", "max abs log Z diff", "max abs marginal diff", "grad ok"],
            check_distributions(device, n),
        ),
        "",
        f"## Layers (float32 and autocast {str(half).split('.')[-1]}, B = 4)",
        table(
            ["layer", "fwd+bwd finite", "max abs diff autocast vs float32"],
            check_layers(device, half),
        ),  # fmt: skip
        "",
        "## Host synchronisations with validate_args=False (log Z + marginals)",
        table(["distribution", "syncs", "calls"], check_syncs(device, n)),
        "",
        f"## Speed (B = 32, variable lengths, median ms of {repeats})",
        table(["structure", "N", "op", "ms per library"], check_speed(device, sizes, repeats)),
        "",
    ]
    out.write_text("\n".join(parts))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
