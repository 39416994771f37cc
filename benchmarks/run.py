"""Benchmark structattn against torch-struct, supar and pytorch-crf, side by side.

Usage (peers live in a separate venv, see the Makefile's ``bench`` target)::

    .venv-bench/bin/python benchmarks/run.py [--quick] [--only tree|chain|nonproj]
        [--repeats R] [--back-to-back K] [--json OUT.json] [--plot OUT.png]
        [--clone v4|v3|default]

``--clone`` times the C++ kernels built for one SIMD target only (``STRUCTATTN_KERNEL_TARGET``,
see ``structs/_extension.py``; its own build, 3-5 minutes the first time) with PyTorch's own
CPU kernels at the same level (``ATEN_CPU_CAPABILITY``: avx512 / avx2 / default), as a CPU of
that level would run them; the header names the target that ran.

For every size, all libraries get the same inputs (converted to each library's layout by
``peers.py``, outside the timed region). Before anything is timed, each peer's log Z,
marginals, gradients of the marginal loss and MAP are compared with a float64 reference
(ours in float64, itself checked against brute-force enumeration on tiny problems), and so
are ours; a library that disagrees gets a ``FAIL`` line (a peer is then not timed for that
configuration). Timings are medians
over repeats in which the libraries are interleaved (see ``timing.py``); the ratio
ours / best-peer is the median of the ratios measured within each repeat, i.e. of calls made
back to back in one process. Each repeat also times ours ``--back-to-back`` K times in a row
(column ``ours b2b ms``): ours warm, as the peak rates of the lower bound (``bound.py``) are
measured; ``ours/bound`` divides the interleaved (cold) time, ``b2b/bound`` the warm one.

Measurements (float32, ``torch.set_num_threads(2)`` unless ``--threads``):

* ``tree``    projective DependencyCRF, B=32, N in {10, 20, 40, 80} (positions incl. ROOT):
  ``logz_fb`` (log Z forward+backward), ``marg_fb`` (marginals, then backward of
  ``(marginals * w).sum()``: second order), ``argmax`` (MAP); full / variable lengths,
  multi-root / single-root. Plus the peak extra memory of ``marg_fb`` / ``logz_fb`` at N=80.
* ``chain``   LinearChainCRF, B=32, N in {20, 50, 100, 200}, C in {2, 10, 25}: ``logz_fb``
  ``marg`` (marginals, forward, on potentials that require grad) and ``marg_fb``.
* ``chainmap`` LinearChainCRF's MAP (Viterbi decode), B=32, N in {20, 50, 100}, C in {10, 50}:
  ``argmax`` beside pytorch-crf's ``CRF.decode``, torch-struct's and supar's ``argmax``, each
  library's own output timed (``peers.py``: ``decode``), checked by its MAP score.
* ``nonproj`` NonProjectiveDependencyCRF (when structattn has it), B=32, N in {10..80}:
  ``logz_fb``, ``marg_fb`` and ``argmax`` (torch-struct has no non-projective argmax).
* ``span`` TreeCRF (CKY), B=32, N in {10, 20, 40}, L in {1, 10}, and ``semi``
  SemiMarkovCRF, B=32, N in {50, 100}, K in {4, 10}, C in {2, 10}: ``logz_fb`` and
  ``marg_fb`` (``spans.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script or loaded by path: siblings are importable
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bound import Rates, bound_seconds, latency_floor_seconds, measure_rates, row_work
from peers import Adapter, State, adapters_for
from problems import Problem, brute_chain, brute_tree, make_chain, make_tree
from spans import SPAN_OPS, SPAN_SECTIONS, run_section
from spans import problems as span_problems
from timing import peak_memory_bytes, time_interleaved
from torch import Tensor

SECTIONS = ("tree", "chain", "chainmap", "nonproj", *SPAN_SECTIONS)
#: sections over linear chains (the chain adapters of peers.py, the chain problems)
CHAIN_SECTIONS = ("chain", "chainmap")
# sections run only when named by --only (their own table: benchmarks/tree_ops.py)
EXTRA_SECTIONS = ("treeops",)
OPS = {
    **dict.fromkeys(SPAN_SECTIONS, SPAN_OPS),
    "tree": ("logz_fb", "marg_fb", "argmax"),
    "chain": ("logz_fb", "marg", "marg_fb"),
    "chainmap": ("argmax",),
    "nonproj": ("logz_fb", "marg_fb", "argmax"),
}
OP_TITLES = {
    "logz_fb": "log Z fwd+bwd",
    "marg_fb": "marginals fwd+bwd",
    "marg": "marginals",
    "argmax": "argmax (MAP)",
}
#: agreement with the float64 reference required before timing (float32 results): log Z
#: relative to max(1, |log Z|), marginals absolute (they lie in [0, 1]), gradients of the
#: marginal loss relative to their max, MAP score relative. Marginal and gradient tolerances
#: grow with N beyond 50 (``tolerance``): float32 rounding accumulates along the N sequential
#: steps of the dynamic programs (a forward-backward over N=200, C=2 is ~3e-4 off in float32
#: in ours, supar and pytorch-crf alike).
#: The gradient of a parameter shared by all positions (the chains' [C, C] transitions) is a
#: sum of B (N - 1) signed terms that largely cancel: float32 summation leaves ~6e-3 of its
#: max in ours at N = 200, C = 2 (autograd of autograd, as supar: 0.7), hence 10x.
TOLERANCE = {"logz": 1e-4, "marg": 1e-4, "grad": 1e-3, "grad_shared": 1e-2, "argmax": 1e-4}


def tolerance(key: str, size: int) -> float:
    """Tolerance of error ``key`` at N = ``size`` (see TOLERANCE)."""
    scale = max(1.0, size / 50) if key in ("marg", "grad", "grad_shared") else 1.0
    return TOLERANCE[key] * scale


@dataclass
class Settings:
    """What to run."""

    sections: tuple[str, ...]
    batch: int
    repeats: int
    warmup: int
    back_to_back: int  # ours' extra calls per repeat, timed back to back (0: none)
    tree_sizes: tuple[int, ...]
    nonproj_sizes: tuple[int, ...]
    chain_sizes: tuple[int, ...]
    chain_labels: tuple[int, ...]
    chain_map_sizes: tuple[int, ...]
    chain_map_labels: tuple[int, ...]
    memory: bool
    seed: int
    quick: bool
    threads: int


@dataclass
class Row:
    """One timed configuration: median seconds per library."""

    section: str
    op: str
    size: int
    labels: int
    lengths: str
    root: str
    times: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    bound: float | None = None  # lower bound on the time (s) on this machine (bound.py)
    latency_floor: float | None = None  # steps x one small op's latency (s): peers' floor
    warm: list[float] = field(default_factory=list)  # ours called back to back (s)

    @property
    def ours_warm(self) -> float | None:
        """Median seconds of ours called back to back (None when not measured)."""
        return statistics.median(self.warm) if self.warm else None

    @property
    def warm_over_bound(self) -> float | None:
        """ours called back to back / the row's lower bound: the like-for-like ratio (the
        bound's peak rates are measured in a tight loop)."""
        warm = self.ours_warm
        return warm / self.bound if warm is not None and self.bound else None

    @property
    def over_bound(self) -> float | None:
        """ours / the row's lower bound (1 = every element at the peak rate)."""
        if "ours" not in self.times or not self.bound:
            return None
        return self.times["ours"] / self.bound

    @property
    def best_peer(self) -> str | None:
        """The peer with the lowest median time (None if no peer was timed)."""
        peers = {lib: t for lib, t in self.times.items() if lib != "ours"}
        return min(peers, key=peers.__getitem__) if peers else None

    @property
    def ratio(self) -> float | None:
        """ours / best peer: the median over repeats of the ratio measured *within* each
        repeat (the two calls ran back to back), robust to the machine's slow drifts."""
        best = self.best_peer
        if "ours" not in self.samples or best is None:
            return None
        ours, peer = self.samples["ours"], self.samples[best]
        return statistics.median(o / p for o, p in zip(ours, peer, strict=True))

    @property
    def ratio_of_medians(self) -> float | None:
        best = self.best_peer
        if "ours" not in self.times or best is None:
            return None
        return self.times["ours"] / self.times[best]


@dataclass
class Check:
    """Agreement of one library with a reference on one configuration."""

    section: str
    config: str
    library: str
    reference: str  # "ours" or "brute force"
    errors: dict[str, float]
    ok: bool


@dataclass
class Results:
    machine: dict[str, Any]
    settings: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    rates: Rates | None = None  # the machine's measured peak rates (bound.py)
    tree_ops: list[dict[str, Any]] = field(default_factory=list)  # tree_ops.py's rows

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def our_failures(self) -> list[Check]:
        """Failed checks of ours (in float32 vs float64, or vs brute force): the run's exit
        status. A peer that disagrees is a finding, printed, not an error of the benchmark."""
        return [c for c in self.failures if c.library.startswith("ours")]

    def to_json(self) -> dict[str, Any]:
        rows = [
            dict(
                asdict(r),
                best_peer=r.best_peer,
                ratio=r.ratio,
                ratio_of_medians=r.ratio_of_medians,
                over_bound=r.over_bound,
                ours_warm=r.ours_warm,
                warm_over_bound=r.warm_over_bound,
            )
            for r in self.rows
        ]
        return {
            "machine": self.machine,
            "settings": self.settings,
            "rows": rows,
            "checks": [asdict(c) for c in self.checks],
            "memory": self.memory,
            "messages": self.messages,
            "rates": None if self.rates is None else self.rates.as_dict(),
            "tree_ops": self.tree_ops,
            "failures": len(self.failures),
            "our_failures": len(self.our_failures),
        }


# ---- environment ---------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """CPU model and SIMD level, cores, torch version and threads, BLAS / LAPACK, whether
    the C++ kernels loaded, peer versions."""
    from importlib import metadata

    from structattn.structs import _extension

    cpu = _cpuinfo_field("model name") or platform.processor() or "unknown"
    versions: dict[str, str | None] = {}
    for dist in ("torch", "structattn", "torch-struct", "supar", "pytorch-crf"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    lapack = re.search(r"LAPACK_INFO=(\w+)", config)
    built = _extension.kernels(torch.zeros(1, 2, 2)) is not None  # builds them if needed
    target = _extension.simd_target() if built else None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "simd": simd_level(),
        "kernel_target": target,  # what the kernels' vector loops run here (None: not loaded)
        "kernel_target_forced": os.environ.get("STRUCTATTN_KERNEL_TARGET"),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS"),
        "kernels_loaded": built,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "blas": blas.group(1) if blas else None,
        "lapack": lapack.group(1) if lapack else None,
        "kernels": _extension._mode(),  # STRUCTATTN_EXTENSION: on, off or require
        "python": platform.python_version(),
        "versions": versions,
    }


#: the CPU flags of the x86-64 levels our kernels are compiled for (v4 = AVX-512, v3 = AVX2)
_LEVELS = {
    "x86-64-v4 (AVX-512)": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
    "x86-64-v3 (AVX2)": ("avx2", "fma", "bmi1", "bmi2", "movbe"),
}


def _cpuinfo_field(name: str) -> str | None:
    """The first ``name`` line's value in /proc/cpuinfo (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def simd_level() -> str:
    """The SIMD clone of the C++ kernels this CPU gets (from its /proc/cpuinfo flags): the
    kernels are compiled for x86-64-v4, x86-64-v3 and baseline x86-64 and the loader picks
    the highest the CPU supports, so two machines of different levels time different code."""
    flags = set((_cpuinfo_field("flags") or "").split())
    for level, needed in _LEVELS.items():
        if flags.issuperset(needed):
            return level
    return "x86-64 baseline" if flags else "unknown"


def _say(*parts: object) -> None:
    print(*parts, flush=True)


class Progress:
    """``[i/total] label (elapsed)`` lines on stderr."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        print(f"[{self.done}/{self.total}] {label}  ({elapsed:.0f}s)", file=sys.stderr, flush=True)


# ---- correctness ---------------------------------------------------------------------------
def _max_abs(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _rel(a: Tensor, b: Tensor, floor: float) -> float:
    scale = max(floor, float(b.double().abs().max())) if b.numel() else 1.0
    return _max_abs(a, b) / scale


def _tree_score(arcs: Tensor, heads: Tensor, problem: Problem) -> Tensor:
    """Score of heads [B, N] under our arc scores, float64, [B]; -inf if heads are invalid."""
    mask = problem.modifier_mask
    lengths = problem.full_lengths.unsqueeze(-1)
    bad = ((heads < 0) | (heads >= lengths)) & mask
    safe = heads.masked_fill(~mask | bad, 0)
    score = arcs.double().gather(1, safe.unsqueeze(1)).squeeze(1).masked_fill(~mask, 0.0).sum(-1)
    return score.masked_fill(bad.any(-1), float("-inf"))


def _chain_score(labels: Tensor, problem: Problem) -> Tensor:
    """Score of labels [B, N] under our chain potentials, float64, [B]; -inf if a real
    position's label is out of range."""
    unary, pairwise = (t.double() for t in problem.tensors)
    mask = problem.mask
    bad = ((labels < 0) | (labels >= unary.shape[-1])) & mask
    safe = labels.masked_fill(~mask | bad, 0)
    node = unary.gather(2, safe.unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0.0).sum(-1)
    edge = pairwise[safe[:, :-1], safe[:, 1:]].masked_fill(~mask[:, 1:], 0.0).sum(-1)
    return (node + edge).masked_fill(bad.any(-1), float("-inf"))


@dataclass
class Outputs:
    """What one library computes on one problem, in our layout."""

    logz: Tensor
    marginals: Tensor
    grads: tuple[Tensor, ...] | None
    map_score: Tensor | None


def outputs(adapter: Adapter, state: State, ops: Sequence[str]) -> Outputs:
    """log Z, marginals, gradients of the marginal loss and MAP score (all in our layout)."""
    logz = adapter.log_partition(state).detach()
    native = adapter.marginals(state)
    marginals = adapter.marginals_ours(state, native)
    grads = None
    if "marg_fb" in ops:
        native_grads = torch.autograd.grad(
            (native * state.weight).sum(), state.natives, allow_unused=True
        )
        grads = adapter.to_ours(state, native_grads)
    map_score = None
    if "argmax" in ops:
        best = adapter.argmax(state)
        if state.problem.kind == "chain":
            map_score = _chain_score(best, state.problem)
        else:
            map_score = _tree_score(state.problem.tensors[0], best, state.problem)
    return Outputs(logz, marginals, grads, map_score)


def compare(got: Outputs, ref: Outputs) -> dict[str, float]:
    """Errors of ``got`` against ``ref`` (see TOLERANCE)."""
    errors = {
        "logz": _rel(got.logz, ref.logz, 1.0),
        "marg": _max_abs(got.marginals, ref.marginals),
    }
    if got.grads is not None and ref.grads is not None:
        # a leaf of lower rank than the first (the chains' shared [C, C] transitions) gets the
        # gradient summed over every position of every item: checked with its own tolerance
        rank = ref.grads[0].dim()
        pairs = list(zip(got.grads, ref.grads, strict=True))
        errors["grad"] = max(_rel(g, r, 1e-6) for g, r in pairs if r.dim() == rank)
        shared = [_rel(g, r, 1e-6) for g, r in pairs if r.dim() < rank]
        if shared:
            errors["grad_shared"] = max(shared)
    if got.map_score is not None and ref.map_score is not None:
        diff = (got.map_score - ref.map_score).abs()
        errors["argmax"] = float((diff / ref.map_score.abs().clamp(min=1.0)).max())
    return errors


def _failed_ops(errors: dict[str, float], size: int) -> frozenset[str]:
    """The ops a peer is not timed on after its check failed: a wrong second-order gradient
    rules out ``marg_fb`` only, a wrong MAP ``argmax`` only, a wrong log Z or marginals
    everything."""
    bad = _failed_checks(errors, size)
    if bad <= {"grad", "grad_shared"}:
        return frozenset({"marg_fb"})
    if bad == {"argmax"}:
        return frozenset({"argmax"})
    return frozenset({"logz_fb", "marg", "marg_fb", "argmax"})


def _failed_checks(errors: dict[str, float], size: int) -> set[str]:
    """The error keys that are not finite or above their tolerance at N = ``size``."""
    return {k for k, v in errors.items() if not (math.isfinite(v) and v <= tolerance(k, size))}


def _ok(errors: dict[str, float], size: int) -> bool:
    return not _failed_checks(errors, size)


def _fail_line(check: Check, size: int) -> str:
    detail = ", ".join(
        f"{k} {v:.2e} (tol {tolerance(k, size):.0e})" for k, v in check.errors.items()
    )
    return (
        f"FAIL {check.section} {check.config}: {check.library} disagrees with "
        f"{check.reference}: {detail}"
    )


def brute_force_checks(section: str, adapters: list[Adapter], results: Results) -> None:
    """Every library (and ours in float64, the reference of the timed configurations)
    against float64 enumeration on tiny problems (log Z and marginals)."""
    if section in CHAIN_SECTIONS:
        problems = [make_chain(3, 4, 3, variable=True, seed=1)]
    else:
        projective = section == "tree"
        problems = [
            make_tree(3, 5, variable=True, multiroot=mr, projective=projective, seed=1)
            for mr in (True, False)
        ]
    for problem in problems:
        logz, marg = brute_chain(problem) if section in CHAIN_SECTIONS else brute_tree(problem)
        ref = Outputs(logz, marg, None, None)
        config = _config_label(problem)
        runs = [(a.library, a, problem) for a in adapters]
        runs.insert(1, ("ours (float64)", adapters[0], problem.to(torch.float64)))
        for library, adapter, prob in runs:
            try:
                got = outputs(adapter, adapter.prepare(prob), ())
                errors = compare(got, ref)
            except Exception as err:  # noqa: BLE001 - reported as a failure
                errors = {"logz": float("nan")}
                results.messages.append(f"{library} raised {type(err).__name__}: {err}")
            ok = _ok(errors, problem.size)
            check = Check(section, f"tiny {config}", library, "brute force", errors, ok)
            results.checks.append(check)
            if not check.ok:
                _say(_fail_line(check, problem.size))


# ---- one configuration -----------------------------------------------------------------------
def _config_label(problem: Problem) -> str:
    parts = [f"N={problem.size}"]
    if problem.kind == "chain":
        parts.append(f"C={problem.num_labels}")
    parts.append("full" if problem.lengths is None else "var")
    if problem.kind != "chain":
        parts.append("multiroot" if problem.multiroot else "single-root")
    return " ".join(parts)


def run_config(
    section: str,
    problem: Problem,
    adapters: list[Adapter],
    settings: Settings,
    results: Results,
    progress: Progress,
) -> None:
    """Check every library (ours included) against the float64 reference on ``problem``,
    then time each op, the libraries interleaved.

    The reference is our implementation run in float64 on the same inputs (itself checked
    against brute-force enumeration on tiny problems). A float32 result is compared with it,
    not with another float32 result: float32 libraries can legitimately differ from each
    other by twice their own rounding error. A peer that fails is not timed on the ops the
    failed check covers (:func:`_failed_ops`); ours is timed anyway (and the run exits 1).
    """
    config = _config_label(problem)
    ours = adapters[0]
    ref = outputs(ours, ours.prepare(problem.to(torch.float64)), OPS[section])
    states: dict[str, State] = {}
    skipped: dict[str, str] = {}
    failed: dict[str, frozenset[str]] = {}  # per peer, the ops its failed checks rule out
    for adapter in adapters:
        reason = adapter.supports(problem)
        if reason is not None:
            skipped[adapter.library] = reason
            continue
        state = adapter.prepare(problem)
        try:
            errors = compare(
                outputs(adapter, state, [o for o in OPS[section] if o in adapter.ops]), ref
            )
        except Exception as err:  # noqa: BLE001 - a crashing peer is reported, not timed
            errors = {"logz": float("nan")}
            results.messages.append(f"{adapter.library} {section} {config} raised {err!r}")
        check = Check(
            section, config, adapter.library, "float64", errors, _ok(errors, problem.size)
        )
        results.checks.append(check)
        if not check.ok:
            _say(_fail_line(check, problem.size))
            if not adapter.is_ours:
                failed[adapter.library] = _failed_ops(errors, problem.size)
        states[adapter.library] = state
    for op in OPS[section]:
        progress.step(f"{section} {OP_TITLES[op]} {config}")
        fns = {
            a.library: a.op(op, states[a.library])
            for a in adapters
            if a.library in states and op in a.ops and op not in failed.get(a.library, ())
        }
        warm = {"ours": settings.back_to_back} if "ours" in fns and settings.back_to_back else {}
        timings = time_interleaved(fns, settings.repeats, settings.warmup, warm)
        row = Row(
            section,
            op,
            problem.size,
            problem.num_labels,
            "full" if problem.lengths is None else "var",
            "-" if section in CHAIN_SECTIONS else ("multi" if problem.multiroot else "single"),
        )
        if results.rates is not None:
            kind = "chain" if section in CHAIN_SECTIONS else section
            work = row_work(kind, op, problem.full_lengths, problem.num_labels)
            row.bound = bound_seconds(work, results.rates)
            row.latency_floor = latency_floor_seconds(work, results.rates)
        row.times = {lib: t.median for lib, t in timings.items()}
        row.samples = {lib: t.samples for lib, t in timings.items()}
        row.warm = timings["ours"].warm if "ours" in timings else []
        row.skipped = {
            **skipped,
            **{lib: "FAIL" for lib, ops in failed.items() if op in ops},
            **{a.library: "no such op" for a in adapters[1:] if op not in a.ops},
        }
        results.rows.append(row)


def run_memory(section: str, adapters: list[Adapter], settings: Settings, results: Results) -> None:
    """Peak extra memory of the dependency CRF's marginals (and log Z) at the largest N."""
    sizes = settings.tree_sizes if section == "tree" else settings.nonproj_sizes
    problem = make_tree(
        settings.batch, max(sizes), False, True, projective=section == "tree", seed=settings.seed
    )
    for adapter in adapters:
        state = adapter.prepare(problem)
        for op in ("marg_fb", "logz_fb"):
            if op not in adapter.ops:
                continue
            fn = adapter.op(op, state)
            fn()  # warm-up
            peak = peak_memory_bytes(fn)
            results.memory.append(
                {
                    "section": section,
                    "op": op,
                    "size": problem.size,
                    "batch": problem.batch,
                    "library": adapter.library,
                    "peak_bytes": peak,
                }
            )


def _problems(section: str, settings: Settings) -> list[Problem]:
    out: list[Problem] = []
    seed = settings.seed
    if section in CHAIN_SECTIONS:
        sizes, labels = (
            (settings.chain_sizes, settings.chain_labels)
            if section == "chain"
            else (settings.chain_map_sizes, settings.chain_map_labels)
        )
        for n in sizes:
            for c in labels:
                for variable in (False, True):
                    out.append(make_chain(settings.batch, n, c, variable, seed=seed))
    else:
        sizes = settings.tree_sizes if section == "tree" else settings.nonproj_sizes
        for n in sizes:
            for variable in (False, True):
                for multiroot in (True, False):
                    out.append(
                        make_tree(
                            settings.batch, n, variable, multiroot, section == "tree", seed=seed
                        )
                    )
    return out


# ---- output --------------------------------------------------------------------------------
def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


#: the columns that tell a section's rows apart, after op and N (trees: lengths, root)
_KEY_COLUMNS = {
    "chain": ("C", "lengths"),
    "chainmap": ("C", "lengths"),
    "span": ("L",),
    "semi": ("K", "C"),
}


def _key_cells(r: Row) -> list[str]:
    if r.section in CHAIN_SECTIONS:
        return [str(r.labels), r.lengths]
    if r.section == "span":
        return [str(r.labels)]
    if r.section == "semi":
        return [r.root[2:], str(r.labels)]  # root holds "K=<width>"
    return [r.lengths, r.root]


def format_table(results: Results, section: str) -> str:
    """Markdown table of one section's rows."""
    rows = [r for r in results.rows if r.section == section]
    if not rows:
        return ""
    libs = ["ours"] + sorted({lib for r in rows for lib in (*r.times, *r.skipped) if lib != "ours"})
    head = ["op", "N", *_KEY_COLUMNS.get(section, ("lengths", "root"))]
    head += [f"{lib} ms" for lib in libs] + ["ours/best", "bound ms", "ours/bound"]
    head += ["ours b2b ms", "b2b/bound"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [OP_TITLES[r.op], str(r.size), *_key_cells(r)]
        for lib in libs:
            if lib in r.times:
                cells.append(_ms(r.times[lib]))
            else:
                cells.append("FAIL" if r.skipped.get(lib) == "FAIL" else "-")
        cells.append("n/a" if r.ratio is None else f"{r.ratio:.2f}")
        cells.append(_ms(r.bound))
        cells.append("-" if r.over_bound is None else f"{r.over_bound:.2f}")
        cells.append(_ms(r.ours_warm))
        cells.append("-" if r.warm_over_bound is None else f"{r.warm_over_bound:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_memory(results: Results) -> str:
    if not results.memory:
        return ""
    lines = ["| structure | op | N | B | library | peak extra MiB |", "|---|---|---|---|---|---|"]
    for m in results.memory:
        lines.append(
            f"| {m['section']} | {OP_TITLES[m['op']]} | {m['size']} | {m['batch']} | "
            f"{m['library']} | {m['peak_bytes'] / 2**20:.2f} |"
        )
    return "\n".join(lines)


def format_checks(results: Results) -> str:
    """One line per (section, library, reference): worst errors over all configurations."""
    worst: dict[tuple[str, str, str], dict[str, float]] = {}
    counts: dict[tuple[str, str, str], list[int]] = {}
    for c in results.checks:
        key = (c.section, c.library, c.reference)
        agg = worst.setdefault(key, {})
        for k, v in c.errors.items():
            agg[k] = max(agg.get(k, 0.0), v) if math.isfinite(v) else float("nan")
        tally = counts.setdefault(key, [0, 0])
        tally[0] += 1
        tally[1] += int(c.ok)
    lines = []
    for (section, lib, ref), agg in worst.items():
        total, passed = counts[(section, lib, ref)]
        errs = ", ".join(f"{k} {v:.1e}" for k, v in agg.items())
        status = "OK  " if passed == total else "FAIL"
        lines.append(
            f"{status} {section:8s} {lib:14s} vs {ref:11s} {passed}/{total} configs; worst {errs}"
        )
    return "\n".join(lines)


def plot(results: Results, path: str) -> bool:
    """Time vs N (log-log), ours vs peers, full lengths / multi-root. False if no matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        _say(f"matplotlib not installed: no plot written to {path}")
        return False
    panels: list[tuple[str, str, int]] = []
    for section in SECTIONS:
        if section in SPAN_SECTIONS:
            continue  # in the tables only
        for op in OPS[section]:
            labels = sorted({r.labels for r in results.rows if r.section == section and r.op == op})
            for c in labels:
                if section == "chain" and op in ("marg", "marg_fb"):
                    continue  # the chain row shows log Z fwd+bwd per C (marginals: in the table)
                panels.append((section, op, c))
    if not panels:
        return False
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    styles = {"ours": ("C3", "o"), "torch-struct": ("C0", "s"), "supar": ("C2", "^")}
    styles["pytorch-crf"] = ("C4", "D")
    for ax, (section, op, c) in zip(axes.flat, panels, strict=False):
        sel = [
            r
            for r in results.rows
            if r.section == section
            and r.op == op
            and r.labels == c
            and r.lengths == "full"
            and r.root in ("multi", "-")
        ]
        libs = sorted({lib for r in sel for lib in r.times}, key=lambda x: (x != "ours", x))
        for lib in libs:
            pts = sorted((r.size, r.times[lib] * 1e3) for r in sel if lib in r.times)
            color, marker = styles.get(lib, ("C7", "x"))
            ax.plot(*zip(*pts, strict=True), marker=marker, color=color, label=lib)
        name = {"tree": "projective tree", "nonproj": "non-projective"}.get(section, "chain")
        title = f"{name}: {OP_TITLES[op]}" + (f", C={c}" if section in CHAIN_SECTIONS else "")
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log")
        ax.set_yscale("log")
        sizes = sorted({r.size for r in sel})
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("N")
        ax.set_ylabel("ms (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    batch = results.settings.get("batch")
    fig.suptitle(
        f"B={batch}, float32, {results.machine['torch_threads']} threads, full lengths, "
        "multi-root (lower is better)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- entry point -----------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats (CI smoke)")
    parser.add_argument(
        "--only",
        action="append",
        choices=SECTIONS + EXTRA_SECTIONS,
        help="run only this section (repeatable; treeops: k-best, labelled and second-order "
        "trees, run only when named)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 9)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls (default 2)")
    parser.add_argument(
        "--back-to-back",
        type=int,
        default=3,
        metavar="K",
        help="per repeat, also call ours 2K times in a row and time the last K (warm; 0: off; "
        "default 3)",
    )
    parser.add_argument("--batch", type=int, default=None, help="batch size (default 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    parser.add_argument("--json", metavar="OUT", help="write machine-readable results")
    parser.add_argument("--plot", metavar="OUT.png", help="plot time vs N (needs matplotlib)")
    parser.add_argument(
        "--clone",
        choices=tuple(CLONE_CAPABILITY),
        help="time the C++ kernels built for this SIMD target only (x86-64-v4 / -v3 / "
        "baseline) and PyTorch's CPU kernels at the same level, as such a CPU would",
    )
    return parser.parse_args(argv)


#: ``--clone``: the ATEN_CPU_CAPABILITY matching each one-target build of the kernels
CLONE_CAPABILITY = {"v4": "avx512", "v3": "avx2", "default": "default"}
#: ... and the MKL_ENABLE_INSTRUCTIONS (MKL's BLAS and LAPACK: the LU of the matrix-tree
#: code, ours and the peers', and every bmm) closest to each level (MKL has no plain SSE2
#: setting; SSE4_2 is its lowest)
CLONE_MKL = {"v4": "AVX512", "v3": "AVX2", "default": "SSE4_2"}


def force_clone(clone: str | None) -> None:
    """Select ``--clone``: set STRUCTATTN_KERNEL_TARGET, ATEN_CPU_CAPABILITY and (unless set
    already) MKL_ENABLE_INSTRUCTIONS before the kernels load and before PyTorch's first CPU
    kernel and MKL's first call pick their level (each is read once)."""
    if clone is None:
        return
    os.environ["STRUCTATTN_KERNEL_TARGET"] = clone
    os.environ["ATEN_CPU_CAPABILITY"] = CLONE_CAPABILITY[clone]
    os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", CLONE_MKL[clone])


def settings_from(args: argparse.Namespace) -> Settings:
    quick = bool(args.quick)
    return Settings(
        sections=tuple(s for s in SECTIONS + EXTRA_SECTIONS if s in (args.only or SECTIONS)),
        batch=args.batch or (4 if quick else 32),
        repeats=args.repeats or (2 if quick else 9),
        warmup=args.warmup if args.warmup is not None else (1 if quick else 2),
        back_to_back=max(args.back_to_back, 0),
        tree_sizes=(6, 10) if quick else (10, 20, 40, 80),
        nonproj_sizes=(6, 10) if quick else (10, 20, 40, 80),
        chain_sizes=(8, 16) if quick else (20, 50, 100, 200),
        chain_labels=(2, 5) if quick else (2, 10, 25),
        chain_map_sizes=(8, 16) if quick else (20, 50, 100),
        chain_map_labels=(3, 5) if quick else (10, 50),
        memory=not args.no_memory,
        seed=args.seed,
        quick=quick,
        threads=args.threads,
    )


def _adapters(section: str) -> tuple[list[Adapter], list[str]]:
    """``adapters_for`` the section's structure, only those with an op of the section (ours
    first)."""
    adapters, skipped = adapters_for("chain" if section in CHAIN_SECTIONS else section)
    ops = set(OPS[section])
    return [a for a in adapters if a.is_ours or ops & a.ops], skipped


def run(settings: Settings, json_path: str | None = None) -> Results:
    """Run the selected sections; print tables as they complete (and update ``json_path``)."""
    torch.set_num_threads(settings.threads)
    torch.set_default_dtype(torch.float32)
    # torch-struct's distributions do not define ``arg_constraints`` (one warning per call)
    warnings.filterwarnings("ignore", message=".*does not define `arg_constraints`")
    # supar's ``pad`` indexes with a list of slices (a torch deprecation warning)
    warnings.filterwarnings("ignore", message="Using a non-tuple sequence")
    results = Results(machine_info(), asdict(settings))
    results.rates = measure_rates(quick=settings.quick)
    r = results.rates
    _say(
        f"peak rates ({settings.threads} threads): logsumexp {r.log_per_s / 1e9:.2f} G elem/s, "
        f"max-plus {r.max_per_s / 1e9:.2f} G elem/s, bmm {r.mad_per_s / 1e9:.2f} G mad/s; "
        f"small-op latency {r.latency_s * 1e6:.1f} us; a null autograd round trip "
        f"{r.call_s * 1e6:.1f} us (benchmarks/bound.py)"
    )
    plan: list[tuple[str, list[Adapter], list[Problem]]] = []
    spans = [s for s in settings.sections if s in SPAN_SECTIONS]
    span_steps = sum(
        len(SPAN_OPS) * len(span_problems(s, settings.quick, settings.batch, settings.seed))
        for s in spans
    )
    for section in settings.sections:
        if section in EXTRA_SECTIONS or section in SPAN_SECTIONS:
            continue
        adapters, skipped = _adapters(section)
        for message in skipped:
            _say(f"[{section}] {message}")
            results.messages.append(f"[{section}] {message}")
        if adapters:
            plan.append((section, adapters, _problems(section, settings)))
    progress = Progress(sum(len(OPS[s]) * len(p) for s, _, p in plan) + span_steps)
    for section, adapters, problems in plan:
        brute_force_checks(section, adapters, results)
        for problem in problems:
            run_config(section, problem, adapters, settings, results, progress)
            if json_path:  # partial results survive an interrupted long run
                Path(json_path).write_text(json.dumps(results.to_json(), indent=1))
        if settings.memory and section in ("tree", "nonproj"):
            run_memory(section, adapters, settings, results)
        _say(
            f"\n## {section}  (median ms over {settings.repeats} interleaved repeats; ours b2b: "
            f"median of {settings.back_to_back} back-to-back calls per repeat)\n"
        )
        _say(format_table(results, section))
    for section in spans:
        run_section(section, settings, results, Row, Check, progress, _say)
        if json_path:
            Path(json_path).write_text(json.dumps(results.to_json(), indent=1))
        _say(
            f"\n## {section}  (median ms over {settings.repeats} interleaved repeats; ours b2b: "
            f"median of {settings.back_to_back} back-to-back calls per repeat)\n"
        )
        _say(format_table(results, section))
    if "treeops" in settings.sections:
        import tree_ops

        sizes = (6,) if settings.quick else (10, 20, 40)
        labels = 3 if settings.quick else 20
        rows = tree_ops.run_rows(
            settings.batch, sizes, settings.repeats, settings.warmup, 5, labels
        )
        results.tree_ops = tree_ops.to_json(rows)
        _say(f"\n## treeops  (median ms over {settings.repeats} interleaved repeats)\n")
        _say(tree_ops.format_table(rows))
    memory = format_memory(results)
    if memory:
        _say("\n## peak extra memory (torch.profiler allocator events)\n")
        _say(memory)
    _say("\n## correctness (checked before timing)\n")
    _say(format_checks(results) or "(nothing checked)")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 1 if ours disagreed with a reference (a peer that disagrees
    is reported, not timed there, and does not change the exit status)."""
    args = parse_args(argv)
    force_clone(args.clone)
    settings = settings_from(args)
    m = machine_info()
    _say(
        f"# structattn benchmark: {m['cpu']}, {m['cores']} cores, torch "
        f"{m['versions']['torch']}, {settings.threads} threads, float32, B={settings.batch}"
    )
    forced = m["kernel_target_forced"]
    target = m["kernel_target"] or "none"
    _say(
        f"# kernels' SIMD target {target}"
        + (f" (forced: STRUCTATTN_KERNEL_TARGET={forced})" if forced else "")
        + f", CPU level {m['simd']}, ATen CPU capability {m['aten_capability']}"
        + (f", MKL_ENABLE_INSTRUCTIONS={m['mkl_instructions']}" if m["mkl_instructions"] else "")
    )
    _say(
        f"# BLAS {m['blas']}, LAPACK {m['lapack']}, "
        f"OMP_NUM_THREADS {m['omp_num_threads']}, STRUCTATTN_EXTENSION {m['kernels']}, "
        f"C++ kernels {'loaded' if m['kernels_loaded'] else 'NOT loaded (PyTorch code timed)'}"
    )
    results = run(settings, args.json)
    if args.json:
        Path(args.json).write_text(json.dumps(results.to_json(), indent=1))
    if args.plot:
        plot(results, args.plot)
    return exit_status(results)


def exit_status(results: Results) -> int:
    """1 if a check of ours failed, else 0; says how many FAIL lines were whose."""
    peers = len(results.failures) - len(results.our_failures)
    if peers:
        _say(f"\n{peers} peer FAIL line(s) above: those peers were not timed there (findings).")
    if results.our_failures:
        _say(f"\n{len(results.our_failures)} FAIL line(s) of ours above.")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
