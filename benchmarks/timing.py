"""Timing and memory helpers shared by the benchmark harness.

* :func:`time_interleaved` runs several callables side by side: after a warm-up, every
  repeat calls each of them once (in a rotated order), so slow drifts of a noisy machine hit
  all libraries alike and the ratios measured in one repeat are comparable.
* :func:`peak_memory_bytes` measures the peak of the bytes held by PyTorch's CPU allocator
  during one call, relative to the start of the call, from the allocation/free events that
  ``torch.profiler`` records with ``profile_memory=True``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["TimingResult", "peak_memory_bytes", "time_interleaved"]


@dataclass
class TimingResult:
    """Wall-clock samples (seconds) of one callable."""

    samples: list[float] = field(default_factory=list)
    warm: list[float] = field(default_factory=list)  # back-to-back calls (time_interleaved)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def minimum(self) -> float:
        return min(self.samples)

    @property
    def spread(self) -> float:
        """Relative interquartile range (0 when fewer than 4 samples)."""
        if len(self.samples) < 4:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.samples, n=4)
        return (q3 - q1) / self.median if self.median > 0 else 0.0


def time_interleaved(
    fns: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    back_to_back: Mapping[str, int] | None = None,
) -> dict[str, TimingResult]:
    """Median-ready timings of ``fns``, interleaved inside the repeat loop.

    Each callable is first called ``warmup`` times (not timed). Then, ``repeats`` times,
    every callable is called once and timed with :func:`time.perf_counter`; the order of the
    callables is rotated from one repeat to the next so none is always first (cache state,
    allocator state, CPU frequency). CPU PyTorch ops are synchronous, so wall-clock time of
    the call is the compute time. The garbage collector is disabled while timing (its young
    generations are collected between repeats).

    ``back_to_back`` {name: K}: after each repeat's interleaved calls, that callable is also
    called 2 K times in a row and the last K are timed (``TimingResult.warm``): its time
    with its own data in cache and the thread pool awake, as in a tight loop, which is how
    the peak rates of ``bound.py`` are measured. The interleaved call is the one after
    another library's call (cold caches, memory just freed, sleeping threads).
    """
    names = list(fns)
    results = {name: TimingResult() for name in names}
    for _ in range(warmup):
        for name in names:
            fns[name]()
    gc_was_enabled = gc.isenabled()
    try:
        for r in range(repeats):
            gc.collect(1)  # young generations only: a full collection costs ~0.1 s with torch
            gc.disable()
            shift = r % len(names) if names else 0
            for name in names[shift:] + names[:shift]:
                start = time.perf_counter()
                fns[name]()
                results[name].samples.append(time.perf_counter() - start)
            for name, calls in (back_to_back or {}).items():
                for _ in range(calls):  # the first calls after another library's are still
                    fns[name]()  # cold (tree MAP, N = 40: the 2nd 1.3x, the 3rd 1.1x warm)
                for _ in range(calls):
                    start = time.perf_counter()
                    fns[name]()
                    results[name].warm.append(time.perf_counter() - start)
            if gc_was_enabled:
                gc.enable()
    finally:
        if gc_was_enabled:
            gc.enable()
    return results


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (kineto prints a line at each profiler start/stop)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_memory_bytes(fn: Callable[[], object]) -> int:
    """Peak extra CPU memory (bytes) allocated by PyTorch during one call of ``fn``.

    ``torch.profiler`` with ``profile_memory=True`` records one ``[memory]`` event per
    allocation (positive size) and per free (negative size) of the CPU allocator. The running
    sum of these events in time order is the memory held at each instant relative to the
    start of the call; its maximum is the peak *extra* memory (inputs allocated before the
    call are not counted; the result of ``fn`` and the autograd graph it keeps alive are).
    Memory allocated outside PyTorch's allocator (Python objects, library workspaces) is
    not seen. The call runs with one torch thread: the profiler records only the calling
    thread's allocations, and our C++ kernels allocate in one worker thread per batch chunk
    (with 2 threads the main thread would see only its own half).
    """
    gc.collect()
    activities = [torch.profiler.ProfilerActivity.CPU]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    fused = _fused_pool()
    if fused is not None:
        fused_before = fused.fused_memory()[0]
        fused.fused_memory_reset_peak()
    try:
        with (
            _quiet_stderr(),
            torch.profiler.profile(activities=activities, profile_memory=True) as prof,
        ):
            out = fn()
            del out
    finally:
        torch.set_num_threads(threads)
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort(key=lambda e: e.start_ns())  # stable: same-time events keep their order
    running = peak = 0
    for event in events:
        running += event.nbytes()
        peak = max(peak, running)
    if fused is not None:  # our fused kernels' buffers, outside PyTorch's allocator: their
        # peak is added to PyTorch's (an upper bound where the two peaks are apart in time)
        peak += max(fused.fused_memory()[1] - fused_before, 0)
    return peak


def _fused_pool() -> Any:
    """structattn's compiled kernels when they count their fused path's buffers, else None."""
    try:
        from structattn.structs._extension import kernels
    except ImportError:
        return None
    module = kernels(torch.zeros(1))
    return module if module is not None and hasattr(module, "fused_memory") else None
