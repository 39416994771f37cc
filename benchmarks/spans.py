"""The span rows of ``run.py`` (issue 39): TreeCRF (CKY) and the semi-Markov CRF, ours beside
torch-struct (``TreeCRF``, ``SemiMarkovCRF``) and supar (``ConstituencyCRF``; supar 1.1.4
has no semi-Markov CRF and its ``ConstituencyCRF`` takes unlabelled span scores only).

* ``span``: TreeCRF, B = 32, N in {10, 20, 40} words, L in {1, 10} labels, full lengths:
  ``logz_fb`` (log Z forward+backward) and ``marg_fb`` (marginals, then the backward of
  ``(marginals * w).sum()``: second order).
* ``semi``: SemiMarkovCRF with a shared [C, C] transition matrix, B = 32, N in {50, 100},
  K in {4, 10}, C in {2, 10}, full lengths: the same two ops.

Conversions (linear, so every library computes the same distribution; each is checked
against ours in float64 before anything is timed, as the other sections of ``run.py``):

* torch-struct ``TreeCRF``: ``log_potentials`` [B, N, N, L] = ours (unlabelled: L = 1);
  ``lengths`` count words as ours.
* supar ``ConstituencyCRF``: fencepost chart [B, N + 1, N + 1] with ``scores[b, i, j + 1]``
  = ours ``[b, i, j]``, ``lens`` count words.
* torch-struct ``SemiMarkovCRF``: ``edge[b, i, k + 1, c, a]`` = ``segment_scores[b, i, k, c]
  + transitions[a, c]`` (a segment labelled c of length k + 1 starting at i after one
  labelled a); at i = 0 the previous label is pinned to a = 0 with no transition (a -1e5
  constant elsewhere: torch-struct would sum over a free first label); ``k = 0`` -1e5.
  Its ``lengths`` count fenceposts (ours + 1). torch-struct's linear scan is wrong for
  batches of mixed lengths (checked: log Z of the longer items differs from brute force),
  hence full lengths here. Not run at K C >= 100 (``TORCH_STRUCT_MAX_STATES``: memory).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from bound import bound_seconds, latency_floor_seconds, row_work
from problems import Problem
from timing import peak_memory_bytes, time_interleaved
from torch import Tensor

SPAN_SECTIONS = ("span", "semi")
SPAN_OPS = ("logz_fb", "marg_fb")
NEG = -1e5  # a forbidden entry in a peer's layout (finite: their passes are not -inf safe)
#: K C from which torch-struct's semi-Markov CRF is not run (K = 10, C = 10 took over 15 GB
#: at N = 50, B = 32 and was killed by the kernel's OOM killer)
TORCH_STRUCT_MAX_STATES = 100


@dataclass(frozen=True)
class SpanProblem(Problem):
    """One batch in our parametrisation (float32 unless cast), full lengths: ``tensors``
    (span_scores,) or (segment_scores, transitions); ``weight`` the marginal loss's
    weights, the shape of tensors[0]. ``batch``, ``size`` and ``to`` are
    :class:`problems.Problem`'s."""

    @property
    def labels(self) -> int:
        """L for trees (1 = unlabelled, ours [B, N, N]), C for semi-Markov."""
        x = self.tensors[0]
        if self.kind == "span":
            return x.shape[3] if x.dim() == 4 else 1
        return x.shape[3]

    @property
    def width(self) -> int:
        """K for semi-Markov (0 for trees)."""
        return self.tensors[0].shape[2] if self.kind == "semi" else 0

    @property
    def label(self) -> str:
        if self.kind == "span":
            return f"N={self.size} L={self.labels}"
        return f"N={self.size} K={self.width} C={self.labels}"


def make_span(batch: int, size: int, labels: int, seed: int = 0) -> SpanProblem:
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, size, size) if labels == 1 else (batch, size, size, labels)
    scores = torch.randn(shape, generator=gen)
    return SpanProblem("span", (scores,), None, True, torch.randn(shape, generator=gen))


def make_semi(batch: int, size: int, width: int, labels: int, seed: int = 0) -> SpanProblem:
    gen = torch.Generator().manual_seed(seed)
    segments = torch.randn(batch, size, width, labels, generator=gen)
    transitions = torch.randn(labels, labels, generator=gen)
    weight = torch.randn(batch, size, width, labels, generator=gen)
    return SpanProblem("semi", (segments, transitions), None, True, weight)


# ---- libraries: each maps our leaves to its log Z and marginals (of tensors[0], ours) -----
@dataclass
class Library:
    name: str
    #: (problem) -> (leaves, log Z fn, marginals fn in our layout) or a reason it can't
    prepare: Callable[[SpanProblem], Any]


def _ours(problem: SpanProblem) -> Any:
    from structattn import SemiMarkovCRF, TreeCRF

    leaves = tuple(t.detach().clone().requires_grad_() for t in problem.tensors)

    def dist() -> Any:
        if problem.kind == "span":
            return TreeCRF(leaves[0])
        return SemiMarkovCRF(leaves[0], leaves[1])

    return leaves, lambda: dist().log_partition, lambda: dist().marginals


def _torch_struct(problem: SpanProblem) -> Any:
    import torch_struct

    if problem.kind == "span":
        x = problem.tensors[0]
        native = (x if x.dim() == 4 else x.unsqueeze(-1)).detach().clone().requires_grad_()

        def span_marginals() -> Tensor:
            m = torch_struct.TreeCRF(native).marginals
            return m if x.dim() == 4 else m.squeeze(-1)

        return (native,), lambda: torch_struct.TreeCRF(native).partition, span_marginals
    if problem.width * problem.labels >= TORCH_STRUCT_MAX_STATES:
        return (
            f"torch-struct's semi-Markov scan keeps [K C, K C] matrices: over 15 GB at "
            f"K C = {problem.width * problem.labels} (OOM-killed at N = 50, B = 32)"
        )
    segments, transitions = problem.tensors
    native = semi_to_torch_struct(segments, transitions).detach().requires_grad_()

    def semi_marginals() -> Tensor:  # [B, N, K + 1, C, C] -> ours [B, N, K, C]
        return torch_struct.SemiMarkovCRF(native).marginals[:, :, 1:].sum(-1)

    return (native,), lambda: torch_struct.SemiMarkovCRF(native).partition, semi_marginals


def semi_to_torch_struct(segments: Tensor, transitions: Tensor) -> Tensor:
    """Our segment scores [B, N, K, C] and transitions [C, C] as torch-struct's edge
    potentials [B, N, K + 1, C, C] (see the module docstring)."""
    batch, size, width, labels = segments.shape
    edge = segments.unsqueeze(-1) + transitions.T.reshape(1, 1, 1, labels, labels)
    first = torch.full((labels,), NEG, dtype=segments.dtype)
    first[0] = 0.0
    edge = torch.cat([segments[:, :1].unsqueeze(-1) + first, edge[:, 1:]], 1)
    empty = segments.new_full((batch, size, 1, labels, labels), NEG)
    return torch.cat([empty, edge], 2)


def _supar(problem: SpanProblem) -> Any:
    from supar.structs import ConstituencyCRF

    if problem.kind != "span":
        return "supar has no semi-Markov CRF"
    if problem.labels != 1:
        return "supar's ConstituencyCRF takes unlabelled span scores only"
    x = problem.tensors[0]
    batch, size, _ = x.shape
    native = x.new_zeros(batch, size + 1, size + 1)
    native[:, :size, 1:] = x
    native = native.detach().requires_grad_()
    lens = torch.full((batch,), size, dtype=torch.long)
    return (
        (native,),
        lambda: ConstituencyCRF(native, lens).log_partition,
        lambda: ConstituencyCRF(native, lens).marginals[:, :size, 1:],
    )


def libraries() -> tuple[list[Library], list[str]]:
    """Ours and the installed peers (and a message per missing one)."""
    libs = [Library("ours", _ours)]
    missing = []
    for name, module, prepare in (
        ("torch-struct", "torch_struct", _torch_struct),
        ("supar", "supar", _supar),
    ):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"{name} not installed: no {name} rows")
            continue
        libs.append(Library(name, prepare))
    return libs, missing


# ---- checks and timing ---------------------------------------------------------------------
def _op(op: str, leaves: tuple[Tensor, ...], logz: Any, marginals: Any, weight: Tensor) -> Any:
    if op == "logz_fb":
        return lambda: torch.autograd.grad(logz().sum(), leaves)
    return lambda: torch.autograd.grad((marginals() * weight).sum(), leaves)


def check(problem: SpanProblem, libs: list[Library]) -> dict[str, dict[str, float] | str]:
    """log Z (relative) and marginals (absolute) of each library in float32 against ours in
    float64; a string where a library does not handle the problem."""
    ref_leaves, ref_logz, ref_marg = _ours(problem.to(torch.float64))
    want_logz = ref_logz().detach()
    want_marg = ref_marg().detach()
    out: dict[str, dict[str, float] | str] = {}
    for lib in libs:
        prepared = lib.prepare(problem)
        if isinstance(prepared, str):
            out[lib.name] = prepared
            continue
        _, logz, marg = prepared
        got_logz = logz().detach().double()
        got_marg = marg().detach().double()
        scale = max(1.0, float(want_logz.abs().max()))
        out[lib.name] = {
            "logz": float((got_logz - want_logz).abs().max()) / scale,
            "marg": float((got_marg - want_marg).abs().max()),
        }
    return out


def problems(section: str, quick: bool, batch: int, seed: int) -> list[SpanProblem]:
    if section == "span":
        sizes = (6, 10) if quick else (10, 20, 40)
        return [make_span(batch, n, labels, seed) for labels in (1, 10) for n in sizes]
    sizes = (8, 16) if quick else (50, 100)
    return [
        make_semi(batch, n, k, c, seed)
        for n in sizes
        for k in ((2, 4) if quick else (4, 10))
        for c in (2, 10)
    ]


def run_section(
    section: str,
    settings: Any,
    results: Any,
    make_row: Callable[..., Any],
    make_check: Callable[..., Any],
    progress: Any,
    say: Callable[..., None],
) -> None:
    """Check, then time every op of ``section`` (``span`` or ``semi``) for every library,
    interleaved; append ``Row`` objects (``make_row``) to ``results.rows`` and ``Check``
    objects (``make_check``, our float64 the reference) to ``results.checks``."""
    warnings.filterwarnings("ignore", message=".*does not define `arg_constraints`")
    libs, missing = libraries()
    for message in missing:
        say(f"[{section}] {message}")
        results.messages.append(f"[{section}] {message}")
    for problem in problems(section, settings.quick, settings.batch, settings.seed):
        checks = check(problem, libs)
        failed = set()
        for name, errors in checks.items():
            if isinstance(errors, str):
                continue
            ok = errors["logz"] <= 1e-4 and errors["marg"] <= 1e-4 * max(1.0, problem.size / 50)
            line = (
                f"{'OK  ' if ok else 'FAIL'} {section} {problem.label} {name} vs ours in float64: "
                f"logz {errors['logz']:.1e}, marg {errors['marg']:.1e}"
            )
            results.messages.append(line)
            results.checks.append(make_check(section, problem.label, name, "float64", errors, ok))
            say(line)
            if not ok:
                failed.add(name)
                say(f"FAIL {section} {problem.label}: {name} disagrees with ours in float64")
        for op in SPAN_OPS:
            progress.step(f"{section} {op} {problem.label}")
            fns = {}
            skipped = {}
            for lib in libs:
                reason = checks[lib.name]
                if isinstance(reason, str):
                    skipped[lib.name] = reason
                    continue
                if lib.name in failed and lib.name != "ours":
                    skipped[lib.name] = "FAIL"
                    continue
                leaves, logz, marg = lib.prepare(problem)
                fns[lib.name] = _op(op, leaves, logz, marg, problem.weight)
            warm = {"ours": settings.back_to_back} if settings.back_to_back else {}
            timings = time_interleaved(fns, settings.repeats, settings.warmup, warm)
            root = "-" if section == "span" else f"K={problem.width}"
            row = make_row(section, op, problem.size, problem.labels, "full", root)
            if results.rates is not None:
                work = span_work(section, op, problem)
                row.bound = bound_seconds(work, results.rates)
                row.latency_floor = latency_floor_seconds(work, results.rates)
            row.times = {lib: t.median for lib, t in timings.items()}
            row.samples = {lib: t.samples for lib, t in timings.items()}
            row.warm = timings["ours"].warm if "ours" in timings else []
            row.skipped = skipped
            results.rows.append(row)
            times = ", ".join(f"{lib} {t * 1e3:.2f} ms" for lib, t in row.times.items())
            ratio = "n/a" if row.ratio is None else f"{row.ratio:.2f}"
            say(f"  {section} {op} {problem.label}: {times}; ours/best {ratio}")
    if settings.memory:
        run_span_memory(section, settings, results)


def run_span_memory(section: str, settings: Any, results: Any) -> None:
    """Peak extra memory of each library's ops on the section's largest problem."""
    libs, _ = libraries()
    every = problems(section, settings.quick, settings.batch, settings.seed)
    largest = max(p.size for p in every)
    chosen = [p for p in every if p.size == largest and p.labels in (1, 10)]
    for problem, lib in [
        (p, lib) for p in (chosen if section == "span" else every[-1:]) for lib in libs
    ]:
        prepared = lib.prepare(problem)
        if isinstance(prepared, str):
            continue
        leaves, logz, marg = prepared
        for op in SPAN_OPS:
            fn = _op(op, leaves, logz, marg, problem.weight)  # noqa: B023
            fn()  # warm-up
            results.memory.append(
                {
                    "section": section,
                    "op": op,
                    "size": problem.size,
                    "batch": problem.batch,
                    "library": f"{lib.name} ({problem.label})",
                    "peak_bytes": peak_memory_bytes(fn),
                }
            )


def span_work(section: str, op: str, problem: SpanProblem) -> Any:
    lengths = torch.full((problem.batch,), problem.size, dtype=torch.long)
    return row_work(section, op, lengths, problem.labels, problem.width)
