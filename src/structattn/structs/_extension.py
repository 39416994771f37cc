"""The optional C++ kernels of Eisner's algorithm (``_eisner.cpp``), built on first use.

The PyTorch code in :mod:`structattn.structs.dependency` is the reference; the C++ port runs
the same passes without Python overhead and with the batch split over the CPU threads, about
2x faster on CPU. It is compiled once by :func:`torch.utils.cpp_extension.load` (needs a C++
compiler and ``ninja``: ``pip install ninja``; cached under ``TORCH_EXTENSIONS_DIR``, by
default ``~/.cache/torch_extensions``). Without them structattn warns once and uses the
PyTorch code. ``STRUCTATTN_EXTENSION=0`` turns the kernels off; ``STRUCTATTN_EXTENSION=require``
makes a failed build an error (CI uses it, so that the kernels are really tested)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

__all__ = ["eisner_kernels", "kernels_disabled"]

_log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("_eisner.cpp")
_state: dict[str, ModuleType | None] = {}
_disabled = False


def _build() -> ModuleType | None:
    mode = os.environ.get("STRUCTATTN_EXTENSION", "1").strip().lower()
    if mode in ("0", "off", "false", "no"):
        return None
    try:
        from torch.utils.cpp_extension import load

        start = time.perf_counter()
        # a cached build loads in well under a second; say so only when it compiles
        notice = threading.Timer(
            1.0, _log.info, ("structattn: compiling the C++ Eisner kernels (once, ~30 s) ...",)
        )
        notice.start()
        try:
            module = load(
                name="structattn_eisner",
                sources=[str(_SOURCE)],
                extra_cflags=["-O2", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
            )
        finally:
            notice.cancel()
        seconds = time.perf_counter() - start
        if seconds > 1.0:
            _log.info("structattn: C++ Eisner kernels ready (%.0f s)", seconds)
        return module
    except Exception as err:  # no compiler, no ninja, unsupported platform, ...
        if mode == "require":
            raise RuntimeError(f"structattn: cannot build the C++ Eisner kernels: {err}") from err
        warnings.warn(
            "structattn: the C++ Eisner kernels could not be built "
            f"({type(err).__name__}: {str(err).strip()[:300]}); using the PyTorch "
            "implementation (about 2x slower on CPU). Install a C++ compiler and "
            "`pip install ninja`, or set STRUCTATTN_EXTENSION=0 to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def eisner_kernels(arc_scores: Tensor) -> ModuleType | None:
    """The compiled kernels if they apply to ``arc_scores`` (CPU, float32 or float64) and
    can be built, else None (use the PyTorch code)."""
    if (
        _disabled
        or arc_scores.device.type != "cpu"
        or arc_scores.dtype not in (torch.float32, torch.float64)
    ):
        return None
    if "eisner" not in _state:
        _state["eisner"] = _build()
    return _state["eisner"]


@contextlib.contextmanager
def kernels_disabled() -> Iterator[None]:
    """Within this block, Eisner runs the PyTorch code (for tests and comparisons)."""
    global _disabled
    before, _disabled = _disabled, True
    try:
        yield
    finally:
        _disabled = before
