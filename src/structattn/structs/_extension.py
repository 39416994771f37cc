"""The optional C++ kernels (``_kernels.cpp``), built on first use: Eisner's inside and
outside passes and Hessian-vector product (``_eisner.cpp``) and the LU path of the
matrix-tree theorem (``_matrix_tree.cpp``).

The PyTorch code in :mod:`structattn.structs.dependency` and
:mod:`structattn.structs.nonprojective` is the reference; the C++ ports run the same
operations without Python overhead and with the batch split over the CPU threads (about 2x
faster Eisner on CPU). It is compiled once by :func:`torch.utils.cpp_extension.load` (needs a C++
compiler and ``ninja``: ``pip install ninja``; cached under ``TORCH_EXTENSIONS_DIR``, by
default ``~/.cache/torch_extensions``). Without them structattn warns once and uses the
PyTorch code. ``STRUCTATTN_EXTENSION=0`` turns the kernels off; ``STRUCTATTN_EXTENSION=require``
makes a failed build an error (CI uses it, so that the kernels are really tested)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

__all__ = ["kernels", "kernels_disabled"]

_log = logging.getLogger(__name__)
_SOURCES = [
    Path(__file__).with_name(f"_{name}.cpp") for name in ("kernels", "eisner", "matrix_tree")
]
_state: dict[str, ModuleType | None] = {}
_disabled = False
_lock = threading.Lock()


def _mode() -> str:
    """ "off", "require" or "on" (the default) from ``STRUCTATTN_EXTENSION``."""
    value = os.environ.get("STRUCTATTN_EXTENSION", "1").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    return "require" if value in ("require", "required") else "on"


def _build() -> ModuleType | None:
    mode = _mode()
    if mode == "off":
        return None
    try:
        from torch.utils.cpp_extension import load

        start = time.perf_counter()
        # a cached build loads in well under a second; say so only when it compiles
        notice = threading.Timer(
            1.0, _log.info, ("structattn: compiling the C++ kernels (once, about a minute) ...",)
        )
        notice.start()
        try:
            # one build per torch version (a module built for another one would not load);
            # OpenMP runs the batch chunks in parallel (without it they run one by one)
            openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
            module = load(
                name="structattn_kernels_torch" + re.sub(r"\W", "_", torch.__version__),
                sources=[str(path) for path in _SOURCES],
                extra_cflags=["-O2", *openmp],
                extra_ldflags=openmp,
            )
        finally:
            notice.cancel()
        seconds = time.perf_counter() - start
        if seconds > 1.0:
            _log.info("structattn: C++ kernels ready (%.0f s)", seconds)
        return module
    except Exception as err:  # no compiler, no ninja, unsupported platform, ...
        if mode == "require":
            raise RuntimeError(f"structattn: cannot build the C++ kernels: {err}") from err
        warnings.warn(
            "structattn: the C++ kernels could not be built "
            f"({type(err).__name__}: ...{str(err).strip()[-400:]}); using the PyTorch "
            "implementation (projective trees about 2x slower on CPU). Install a C++ compiler and "
            "`pip install ninja`, or set STRUCTATTN_EXTENSION=0 to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def kernels(scores: Tensor) -> ModuleType | None:
    """The compiled kernels if they apply to ``scores`` (CPU, float32 or float64) and can be
    built, else None (use the PyTorch code)."""
    if (
        _disabled
        or scores.device.type != "cpu"
        or scores.dtype not in (torch.float32, torch.float64)
    ):
        return None
    if "module" not in _state:
        with _lock:  # one build (and at most one warning) when threads arrive together
            if "module" not in _state:
                _state["module"] = _build()
    return _state["module"]


@contextlib.contextmanager
def kernels_disabled() -> Iterator[None]:
    """Within this block, the PyTorch code runs instead of the kernels (tests, comparisons)."""
    global _disabled
    before, _disabled = _disabled, True
    try:
        yield
    finally:
        _disabled = before
