"""The optional C++ kernels (``_kernels.cpp``), built on first use: Eisner's inside and
outside passes, Hessian-vector product and MAP (``_eisner.cpp``), the LU path of the
matrix-tree theorem (``_matrix_tree.cpp``), the linear-chain passes (``_chain.cpp``) and
Viterbi (``_viterbi.cpp``), CKY with its label passes (``_cky.cpp``) and the semi-Markov
passes (``_semi_markov.cpp``).

The PyTorch code in :mod:`structattn.structs.dependency` and
:mod:`structattn.structs.nonprojective` is the reference; the C++ ports run the same
operations without Python overhead and with the batch split over the CPU threads (faster
on CPU; the timings are in benchmarks/README.md). It is compiled once by
:func:`torch.utils.cpp_extension.load` (needs a C++ compiler and ``ninja``: ``pip install
ninja``). Without them structattn warns once and uses the PyTorch code.
``STRUCTATTN_EXTENSION=0`` turns the kernels off; ``STRUCTATTN_EXTENSION=require`` makes a
failed build an error (CI uses it, so that the kernels are really tested).

**The build cache.** A build is cached under ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``) in a directory named by :func:`build_name`: a hash of
everything that makes two builds differ (the interpreter and environment, torch's path,
version and C++ ABI, the compiler (``CXX``) and flags, and the text of the sources and
headers), so that two environments, or two checkouts, each keep their own build instead of
rebuilding each other's, while every launcher of one environment (``python``, ``python3``,
the ``structattn`` console script) shares one build. A build takes 2-5 minutes on a 2-core
machine; it is announced once per process on stderr (or through the ``structattn`` logger
where logging shows its INFO records, as the CLI's does: never twice). :func:`build_kernels`
builds ahead of time (a Docker image, a CI step whose cache of ``TORCH_EXTENSIONS_DIR`` is
keyed by :func:`build_name`). A process killed during a build leaves no lock that blocks
later ones (:func:`_build_lock`).

**SIMD targets.** With GCC >= 12 on x86-64 Linux the vector loops are compiled for three
targets (``target_clones``: x86-64-v4 = AVX-512, x86-64-v3 = AVX2, baseline x86-64) and the
loader picks the highest the CPU supports. ``STRUCTATTN_KERNEL_TARGET=v4|v3|default`` instead
builds the kernels for that one target only (``-march=x86-64-v4`` / ``-march=x86-64-v3`` /
``-march=x86-64``, under its own :func:`build_name`), so that every clone can be tested and
timed on one CPU that supports it (tests/test_kernels.py, ``benchmarks/run.py --clone``);
unset, ``auto`` or ``clones``: the three clones. The kernels' ``simd_target()`` says which
target runs (:func:`simd_target`). Timing as an AVX2 CPU would also needs
``ATEN_CPU_CAPABILITY=avx2`` (PyTorch's own kernels), which ``benchmarks/run.py --clone v3``
sets."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from ..io import file_lock

__all__ = [
    "KERNEL_TARGETS",
    "build_kernels",
    "build_name",
    "kernel_target",
    "kernels",
    "kernels_disabled",
    "loaded_target",
    "simd_target",
]

_log = logging.getLogger(__name__)
_HERE = Path(__file__).parent
#: the compiled sources and the headers they include (all of them are hashed)
_SOURCES = [_HERE / f"_{name}.cpp" for name in ("kernels", "eisner", "matrix_tree", "chain", "cky")]
_SOURCES.append(_HERE / "_viterbi.cpp")  # Viterbi for linear chains (TORCH_LIBRARY op)
_SOURCES.append(_HERE / "_semi_markov.cpp")  # semi-Markov CRF passes (TORCH_LIBRARY op)
_HEADERS = sorted(_HERE.glob("_*.h"))
#: seconds a build may take before it is announced (a cached load takes well under one)
_NOTICE_DELAY = 1.0
#: environment variables the compiler reads
_COMPILER_ENV = ("CXX", "CC", "CXXFLAGS", "CFLAGS", "CPPFLAGS", "LDFLAGS")
_state: dict[str, ModuleType | None] = {}
_disabled = False
_announced = False  # the compiling notice was shown in this process
_lock = threading.Lock()


def _mode() -> str:
    """ "off", "require" or "on" (the default) from ``STRUCTATTN_EXTENSION``."""
    value = os.environ.get("STRUCTATTN_EXTENSION", "1").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    return "require" if value in ("require", "required") else "on"


#: ``STRUCTATTN_KERNEL_TARGET`` values: the ``-march`` of a one-target build
KERNEL_TARGETS = {"v4": "x86-64-v4", "v3": "x86-64-v3", "default": "x86-64"}


def kernel_target() -> str | None:
    """The one target the kernels are built for (a key of :data:`KERNEL_TARGETS`) from
    ``STRUCTATTN_KERNEL_TARGET``, or None for the usual build (one clone per target, picked
    at load). Raises ValueError for another value, or a target on a non-x86-64 machine."""
    value = os.environ.get("STRUCTATTN_KERNEL_TARGET", "").strip().lower()
    if value in ("", "auto", "clones"):
        return None
    if value not in KERNEL_TARGETS:
        raise ValueError(
            f"STRUCTATTN_KERNEL_TARGET must be one of {', '.join(KERNEL_TARGETS)} or auto, "
            f"not {value!r}"
        )
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise ValueError(
            f"STRUCTATTN_KERNEL_TARGET={value} needs an x86-64 machine, not {platform.machine()}"
        )
    return value


def _flags() -> tuple[list[str], list[str]]:
    """(compiler flags, linker flags): OpenMP runs the batch chunks in parallel (without it
    they run one by one); Linux only. A one-target build (:func:`kernel_target`) adds its
    ``-march`` and ``-DSTRUCTATTN_ONE_TARGET`` (no clones: _kernels.h)."""
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    target = kernel_target()
    one = [] if target is None else [f"-march={KERNEL_TARGETS[target]}"]
    one += [] if target is None else [f"-DSTRUCTATTN_ONE_TARGET={KERNEL_TARGETS[target]}"]
    return ["-O2", *openmp, *one], openmp


def build_name(
    files: Sequence[Path] | None = None,
    cflags: Sequence[str] | None = None,
    ldflags: Sequence[str] | None = None,
) -> str:
    """The name of the kernels' build, ``structattn_kernels_<hash>``: also its directory
    under ``TORCH_EXTENSIONS_DIR``. The hash (16 hex digits of SHA-256) covers the
    interpreter (its resolved path, the environment's prefix and the version: not the name
    it was launched by), torch (path, version, C++ ABI), the folder of the sources (two
    checkouts sharing a build would rebuild it in turn: torch's build file names the
    sources by path), the platform, the compiler's
    environment (``CXX``, ``CXXFLAGS``, ...), the flags and the text of ``files`` (by default
    the kernels' sources and headers): a build differs exactly when the name does. Reads the
    sources (cheap), once per process in practice."""
    if files is None:
        files = _SOURCES + _HEADERS
    if cflags is None or ldflags is None:
        default_cflags, default_ldflags = _flags()
        cflags = default_cflags if cflags is None else cflags
        ldflags = default_ldflags if ldflags is None else ldflags
    facts = [
        os.path.realpath(sys.executable),  # python, python3, a console script: one build
        sys.prefix,
        sys.version,
        platform.machine(),
        torch.__version__,
        str(Path(torch.__file__).parent),
        str(_HERE),  # the checkout: torch's build file names the sources by path
        str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")),
        *(f"{key}={os.environ.get(key, '')}" for key in _COMPILER_ENV),
        "cflags=" + " ".join(cflags),
        "ldflags=" + " ".join(ldflags),
    ]
    digest = hashlib.sha256()
    for fact in facts:
        digest.update(fact.encode() + b"\0")
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return "structattn_kernels_" + digest.hexdigest()[:16]


def _logging_shows_info() -> bool:
    """Whether an INFO record of structattn's logger reaches a handler that emits it (the
    CLI sets one up; a library user's program usually has none)."""
    if not _log.isEnabledFor(logging.INFO):
        return False
    logger: logging.Logger | None = _log
    while logger is not None:
        if any(handler.level <= logging.INFO for handler in logger.handlers):
            return True
        if not logger.propagate:
            break
        logger = logger.parent
    return False


def _notify(message: str) -> None:
    """Show ``message``: through logging if it shows structattn's INFO records, else on the
    current stderr (one channel, so the CLI does not show it twice)."""
    if _logging_shows_info():
        _log.info(message)
    else:
        print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _build_lock(root: Path, name: str) -> Iterator[None]:
    """Hold an OS file lock (``flock``) on ``<root>/<name>.flock`` around torch's build.

    torch guards a build with a ``lock`` file in the build directory that a process killed
    while holding it (Ctrl-C during a first build) leaves behind, and every later process then
    waits for it forever. The OS releases a ``flock`` when its holder dies, so whoever holds
    this one is the only structattn process in torch's build: a ``lock`` file found then is
    stale and is removed. Waiting for a live builder is announced once. Without ``fcntl``
    (Windows) torch's own lock alone applies."""

    def waiting(holder: str) -> None:
        _notify(
            "structattn: waiting for another process that is building the C++ kernels "
            f"(pid {holder})"
        )

    with file_lock(root / f"{name}.flock", on_wait=waiting) as locked:
        stale = root / name / "lock"
        if locked and stale.exists():
            _log.warning("structattn: removing a stale kernel build lock %s", stale)
            stale.unlink(missing_ok=True)
        yield


def _build_root(name: str, default_root: Callable[[], str]) -> Path:
    """The folder that holds torch's build directory of ``name`` (where :func:`_build_lock`
    must look for its stale ``lock``): without ``TORCH_EXTENSIONS_DIR`` torch builds in a
    subfolder of its default root named by the Python version and accelerator
    (``py311_cpu``), which the lock missed, so a stale lock there still blocked every later
    build (#37.3.1; seen again in #42's builds)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, False)).parent
    except (ImportError, OSError):  # a torch without it: its documented root
        return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or default_root())


def _build(mode: str) -> ModuleType | None:
    if mode == "off":
        return None
    try:
        from torch.utils.cpp_extension import get_default_build_root, load

        cflags, ldflags = _flags()
        name = build_name(_SOURCES + _HEADERS, cflags, ldflags)
        announced = threading.Event()

        def notice() -> None:  # a cached load takes well under a second: only a compile
            global _announced
            if not _announced:
                _announced = True
                announced.set()
                _notify(
                    "structattn: compiling the C++ kernels (once per environment, 2-5 "
                    f"minutes; cached as {name} in {root}, set TORCH_EXTENSIONS_DIR to "
                    "change it) ..."
                )

        root = _build_root(name, get_default_build_root)
        start = time.perf_counter()
        timer = threading.Timer(_NOTICE_DELAY, notice)
        timer.daemon = True
        timer.start()
        try:
            with _build_lock(root, name):
                module = load(
                    name=name,
                    sources=[str(path) for path in _SOURCES],
                    extra_cflags=cflags,
                    extra_ldflags=ldflags,
                )
        finally:
            timer.cancel()
        if announced.is_set():
            _notify(f"structattn: C++ kernels ready ({time.perf_counter() - start:.0f} s)")
        return module
    except Exception as err:  # no compiler, no ninja, unsupported platform, ...
        if mode == "require":
            raise RuntimeError(f"structattn: cannot build the C++ kernels: {err}") from err
        warnings.warn(
            "structattn: the C++ kernels could not be built "
            f"({type(err).__name__}: ...{str(err).strip()[-400:]}); using the PyTorch "
            "implementation (slower on CPU). Install a C++ compiler and "
            "`pip install ninja`, or set STRUCTATTN_EXTENSION=0 to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def build_kernels() -> ModuleType:
    """Build (or load from the cache) the C++ kernels now, raising ``RuntimeError`` if they
    cannot be built: for a Docker image or a CI step, so that the first use does not wait.
    ``python -c "from structattn.structs import build_kernels; build_kernels()"``
    """
    with _lock:
        module = _state.get("module")
        if module is None:
            module = _state["module"] = _build("require")
    assert module is not None
    return module


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
                _state["module"] = _build(_mode())
    return _state["module"]


_targets: dict[int, str | None] = {}  # id of a loaded module -> its SIMD target


def _target_of(module: ModuleType | None) -> str | None:
    """What ``module.simd_target()`` says (None without kernels, or for a build older than
    that query)."""
    if module is None or not hasattr(module, "simd_target"):
        return None
    return str(module.simd_target())


def loaded_target() -> str | None:
    """The SIMD target of the kernels this process loaded (``x86-64-v4``, ``x86-64-v3`` or
    ``x86-64``; see :func:`simd_target`), or None if none are loaded yet (or none could be):
    no build, one dictionary look-up (what the dispatch by measurement in
    ``dependency.py`` reads on every call)."""
    module = _state.get("module")
    if module is None:
        return None
    key = id(module)
    if key not in _targets:
        _targets[key] = _target_of(module)
    return _targets[key]


def simd_target() -> str | None:
    """The SIMD target the loaded kernels run here (``x86-64-v4``, ``x86-64-v3`` or
    ``x86-64``: the clone the loader picked for this CPU, or the one target of a
    ``STRUCTATTN_KERNEL_TARGET`` build), or None when no kernels are loaded (or their build
    predates this query). Builds them if needed."""
    module = kernels(torch.zeros(1, 2, 2))
    if module is None or not hasattr(module, "simd_target"):
        return None
    return str(module.simd_target())


@contextlib.contextmanager
def kernels_disabled() -> Iterator[None]:
    """Within this block, the PyTorch code runs instead of the kernels (tests, comparisons)."""
    global _disabled
    before, _disabled = _disabled, True
    try:
        yield
    finally:
        _disabled = before
