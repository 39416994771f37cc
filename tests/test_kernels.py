"""The C++ kernels (structs/_eisner.cpp, _matrix_tree.cpp) against the PyTorch code they port,
and how they are built, required, turned off and replaced when they cannot be built."""

from __future__ import annotations

import itertools
import os
import warnings

import pytest
import torch
from torch import Tensor

from structattn import DependencyCRF
from structattn.structs import _extension, dependency
from structattn.structs._extension import kernels, kernels_disabled


@pytest.fixture(autouse=True)
def _fused_loops_on_every_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused loops serve up to _FUSED_SIZE positions whatever the SIMD target, so that
    every target's clone of them is tested (the dispatch by measurement, which routes some
    targets' sizes to the ATen path, is tested on its own below)."""
    monkeypatch.setattr(dependency, "_FUSED_SIZES", {})


def _passes(scores: Tensor, lengths: Tensor, multiroot: bool) -> tuple[Tensor, ...]:
    """log Z, the marginals, a Hessian-vector product and the plain log Z gradient."""
    x = scores.clone().requires_grad_(True)
    logz = dependency.eisner_log_partition(x, lengths, multiroot)
    (marginals,) = torch.autograd.grad(logz.sum(), x, create_graph=True)
    direction = torch.randn(scores.shape, generator=torch.Generator().manual_seed(4))
    (hvp,) = torch.autograd.grad((marginals * direction.to(scores.dtype)).sum(), x)
    x2 = scores.clone().requires_grad_(True)
    seed = torch.linspace(-1.0, 2.0, scores.shape[0], dtype=scores.dtype)
    (plain,) = torch.autograd.grad(
        dependency.eisner_log_partition(x2, lengths, multiroot), x2, seed
    )
    return logz.detach(), marginals.detach(), hvp, plain


def _scores(batch: int, size: int, dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scores = (torch.randn(batch, size, size, generator=gen) * 3).to(dtype)
    scores[:, :, 0] = float("-inf")
    if batch > 1:  # forbidden arcs that still leave trees
        scores[1] = scores[1].masked_fill(torch.rand(size, size, generator=gen) < 0.2, -torch.inf)
        scores[1, 0, 1:] = 0.0
        scores[1, 1:, 1:].diagonal().fill_(0.0)
        scores[1, torch.arange(1, size - 1), torch.arange(2, size)] = 0.0
    lengths = torch.randint(2, size + 1, (batch,), generator=gen)
    lengths[0] = size
    return scores, lengths


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize(
    "path", ["fused", "fused-recomputed", "fused-partly", "cached", "recomputed", "partly"]
)
@pytest.mark.parametrize("multiroot", [True, False], ids=["multiroot", "oneroot"])
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-5)], ids=["f64", "f32"]
)
def test_kernels_equal_the_pytorch_code(
    multiroot: bool, path: str, dtype: torch.dtype, tol: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """log Z, marginals, Hessian-vector product and log Z's gradient agree (lengths, -inf
    arcs, one- and two-position items, more items than one group of SIMD lanes; the fused
    loops, or the per-width ATen path with the split weights kept, recomputed, or kept for
    the narrow widths only), with the batch in one chunk and in two (two threads)."""
    if not path.startswith("fused"):
        monkeypatch.setattr(dependency, "_FUSED_SIZE", 0)
    if path.endswith("recomputed"):
        monkeypatch.setattr(dependency, "_CACHE_ELEMENTS", 0)
    if path.endswith("partly"):
        monkeypatch.setattr(dependency, "_kept_widths", lambda batch, size: size // 2)
        monkeypatch.setattr(
            dependency, "_kept_mask", lambda batch, size: [w % 2 == 1 for w in range(1, size)]
        )
    for batch, size in [(1, 2), (3, 6), (7, 12), (19, 9)]:
        scores, lengths = _scores(batch, size, dtype, seed=batch)
        with kernels_disabled():
            reference = _passes(scores, lengths, multiroot)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = _passes(scores, lengths, multiroot)
            for a, b in zip(got, reference, strict=True):
                assert torch.isfinite(a).all()
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_fused_path_on_long_trees_beyond_the_memory_pool(
    keep: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused loops at the sizes they now take (up to _FUSED_SIZE = 96 positions), their
    split weights kept (more than the 64 MiB memory pool keeps: B = 20, N = 90, three groups
    of lanes) or recomputed, against the PyTorch code in float64."""
    if kernels(torch.zeros(1)) is None:
        pytest.skip("the C++ kernels are not built here")
    assert dependency._fused(96) and not dependency._fused(97)
    monkeypatch.setattr(dependency, "_CACHE_ELEMENTS", 1 << 30 if keep else 0)
    scores, lengths = _scores(20, 90, torch.float64, seed=3)
    with kernels_disabled():
        reference = _passes(scores, lengths, False)
    torch.set_num_threads(2)
    got = _passes(scores, lengths, False)
    for a, b in zip(got, reference, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("size", [63, 64, 65, 66, 67])
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_fused_path_with_a_padded_chart_stride(
    size: int, keep: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At N = 64-66 the fused charts' rows are padded to 67 (cache aliasing of 4 KB rows,
    #42): log Z, marginals, a Hessian-vector product and seeded gradients (multiroot) and
    the MAP tree and its score (one root) against the PyTorch code in float64, at the
    sizes on both sides of the padded band, weights kept or recomputed."""
    module = kernels(torch.zeros(1))
    if module is None or not hasattr(module, "eisner_map"):
        pytest.skip("the fused C++ kernels are not built here")
    assert dependency._fused(size)
    monkeypatch.setattr(dependency, "_CACHE_ELEMENTS", 1 << 30 if keep else 0)
    scores, lengths = _scores(9, size, torch.float64, seed=size)
    with kernels_disabled():
        reference = _passes(scores, lengths, True)
    got = _passes(scores, lengths, True)
    for a, b in zip(got, reference, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    crf = DependencyCRF(scores, lengths, multiroot=False)
    tree = crf.argmax
    with kernels_disabled():
        want = DependencyCRF(scores, lengths, multiroot=False).argmax
    torch.testing.assert_close(tree, want)
    torch.testing.assert_close(crf.log_prob(tree), crf.log_prob(want))


def test_fused_memory_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused path's buffers (outside PyTorch's allocator) are counted by
    ``fused_memory``: kept split weights cost O(B N^3), recomputed ones O(B N^2)."""
    module = kernels(torch.zeros(1))
    if module is None or not hasattr(module, "fused_memory"):
        pytest.skip("the fused C++ kernels are not built here")
    scores, lengths = _scores(16, 40, torch.float64, seed=5)
    peaks = {}
    for keep in (True, False):
        monkeypatch.setattr(dependency, "_CACHE_ELEMENTS", 1 << 30 if keep else 0)
        x = scores.clone().requires_grad_(True)
        before = module.fused_memory()[0]
        module.fused_memory_reset_peak()
        logz = dependency.eisner_log_partition(x, lengths, True)
        logz.sum().backward()
        peaks[keep] = module.fused_memory()[1] - before
        del logz
    # kept weights per lane of the group holding the longest item (packed for its span)
    span = int(lengths.max())
    terms = 3 * sum(w * (span - w) for w in range(1, span))
    assert peaks[True] >= terms * 8 * 8  # eight lanes, 8 bytes each
    # 1.4 vs 3.8 MB here (the weights packed for each group's span); the gap grows with N
    assert peaks[False] < peaks[True] / 2


@pytest.mark.parametrize("multiroot", [True, False], ids=["multiroot", "oneroot"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_dependency_argmax_reads_the_kernels_heads(multiroot: bool, dtype: torch.dtype) -> None:
    """DependencyCRF.argmax takes the MAP kernel's heads directly (no autograd pass): the
    same trees as the PyTorch code's backtrack, -1 at ROOT, padding and items with no tree
    (lengths, -inf arcs, an item whose arcs leave no tree, one-word items)."""
    if kernels(torch.zeros(1)) is None:
        pytest.skip("the C++ kernels are not built here")
    for batch, size in [(1, 2), (5, 7), (19, 12)]:
        scores, lengths = _scores(batch, size, dtype, seed=size)
        if batch > 2:
            scores[2, :, 1:] = float("-inf")  # no arc into any word: no tree
        scores[:, torch.arange(size), torch.arange(size)] = float("nan")  # never read
        scores[:, 1:, 0] = float("inf")  # arcs into ROOT: ignored
        if batch > 1:  # padding: ignored
            scores[1, int(lengths[1]) :] = scores[1, :, int(lengths[1]) :] = float("nan")
        crf = DependencyCRF(scores, lengths, multiroot=multiroot, validate_args=False)
        assert dependency.eisner_argmax(scores, lengths, multiroot) is not None
        got = crf.argmax
        with kernels_disabled():
            want = DependencyCRF(scores, lengths, multiroot=multiroot, validate_args=False).argmax
        assert torch.equal(got, want), (got, want)
        if batch > 2:
            assert (got[2] == -1).all()
        assert (got[:, 0] == -1).all()


_bt = dependency._eisner_backtrack
_backtracks: list[int] = []


def _counted(*args: object) -> Tensor:
    """The PyTorch backtrack, counted in ``_backtracks``."""
    _backtracks.append(1)
    return _bt(*args)  # type: ignore[arg-type]


def _map(scores: Tensor, lengths: Tensor, multiroot: bool) -> tuple[Tensor, Tensor]:
    """The best tree's score and its arcs times a per-item seed (the MAP backward)."""
    x = scores.clone().requires_grad_(True)
    best = dependency.eisner_max(x, lengths, multiroot)
    seed = torch.linspace(0.5, 2.0, scores.shape[0], dtype=scores.dtype)
    (arcs,) = torch.autograd.grad(best, x, seed)
    return best.detach(), arcs


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("multiroot", [True, False], ids=["multiroot", "oneroot"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_map_kernel_equals_the_pytorch_code(
    multiroot: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused MAP kernel finds the same tree and score as the PyTorch max-inside pass and
    backtrack (lengths, -inf arcs, an item with no tree; one chunk and two; more items than
    one group of SIMD lanes)."""
    assert hasattr(kernels(torch.zeros(1)), "eisner_map")
    monkeypatch.setattr(dependency, "_eisner_backtrack", _counted)
    for batch, size in [(1, 2), (3, 6), (7, 12), (19, 9)]:
        scores, lengths = _scores(batch, size, dtype, seed=batch + 100)
        if batch > 2:
            scores[2, :, 1] = float("-inf")  # word 1 has no head: no tree
            lengths[2] = size
        with kernels_disabled():
            reference = _map(scores, lengths, multiroot)
        assert _backtracks, "the reference did not run the PyTorch backtrack"
        for threads in (1, 2):
            torch.set_num_threads(threads)
            _backtracks.clear()
            best, arcs = _map(scores, lengths, multiroot)
            assert not _backtracks, "the kernel was not used"
            torch.testing.assert_close(best, reference[0], rtol=1e-6, atol=1e-6)
            if batch > 2:
                assert torch.isneginf(best[2])
                keep = torch.arange(batch) != 2  # no tree: the arcs are not a tree either way
                torch.testing.assert_close(arcs[keep], reference[1][keep], rtol=0, atol=0)
            else:
                torch.testing.assert_close(arcs, reference[1], rtol=0, atol=0)


@pytest.mark.usefixtures("built_kernels")
def test_map_above_the_kernel_size_uses_the_pytorch_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trees longer than _MAP_FUSED_SIZE go to the PyTorch code (the same trees)."""
    scores, lengths = _scores(5, 9, torch.float64, seed=3)
    fused = _map(scores, lengths, True)
    monkeypatch.setattr(dependency, "_MAP_FUSED_SIZE", 8)
    calls = []
    monkeypatch.setattr(dependency, "_eisner_backtrack", lambda *a: calls.append(1) or _bt(*a))
    fallback = _map(scores, lengths, True)
    assert calls, "the PyTorch backtrack was not used"
    torch.testing.assert_close(fallback, fused, rtol=0, atol=1e-12)


@pytest.mark.usefixtures("built_kernels")
def test_parallel_work_threshold() -> None:
    """The work threshold's setter returns the previous value, the default is 1e5 (the tests'
    small_chunks fixture sets it to 0 to split small batches)."""
    module = kernels(torch.zeros(1, 2, 2))
    before = module.set_parallel_work(123.0)
    try:
        assert module.set_parallel_work(before) == 123.0
    finally:
        module.set_parallel_work(before)
    assert before == 1e5


@pytest.mark.usefixtures("built_kernels")
def test_kernels_no_tree_gives_minus_inf_and_finite_gradients() -> None:
    """An item without any tree has log Z = -inf, and its gradients stay finite (zero)."""
    scores, lengths = _scores(3, 6, torch.float64, seed=9)
    scores[2, :, 3] = float("-inf")  # word 3 has no head
    logz, marginals, hvp, plain = _passes(scores, lengths.fill_(6), True)
    assert torch.isneginf(logz[2]) and torch.isfinite(logz[:2]).all()
    for grad in (marginals, hvp, plain):
        assert torch.isfinite(grad).all() and grad[2].abs().sum() == 0


@pytest.mark.usefixtures("built_kernels")
def test_kernels_serve_the_distributions() -> None:
    """The distributions go through the kernels on CPU: an empty batch, inference mode and
    inference tensors included."""
    arcs = torch.randn(4, 7, 7, requires_grad=True)
    marginals = DependencyCRF(arcs, torch.tensor([7, 3, 5, 2])).marginals
    with kernels_disabled():
        reference = DependencyCRF(arcs, torch.tensor([7, 3, 5, 2])).marginals
    torch.testing.assert_close(marginals, reference, rtol=1e-5, atol=1e-6)
    empty = DependencyCRF(torch.randn(0, 5, 5, requires_grad=True)).marginals
    assert empty.shape == (0, 5, 5)
    # under inference mode (the worker threads run outside it) and on inference tensors
    from structattn import NonProjectiveDependencyCRF

    with torch.inference_mode():
        frozen = arcs.detach().clone()
        inside = DependencyCRF(frozen, torch.tensor([7, 3, 5, 2])).marginals
        tree = NonProjectiveDependencyCRF(frozen).marginals
    torch.testing.assert_close(inside, reference.detach(), rtol=1e-5, atol=1e-6)
    outside = NonProjectiveDependencyCRF(frozen).marginals
    torch.testing.assert_close(tree, outside, rtol=0, atol=0)
    assert torch.allclose(tree.sum((1, 2)), torch.full((4,), 6.0))


def test_kernels_only_serve_cpu_float() -> None:
    """Half precision (and, by the same test, other devices) stays on the PyTorch code."""
    assert kernels(torch.zeros(1, 2, 2, dtype=torch.bfloat16)) is None
    assert kernels(torch.zeros(1, 2, 2, dtype=torch.float16)) is None
    with kernels_disabled():
        assert kernels(torch.zeros(1, 2, 2)) is None


def test_kernels_are_built_where_required() -> None:
    """With STRUCTATTN_EXTENSION=require (the test target sets it) the kernels must build:
    CI tests them, not only the fallback."""
    if os.environ.get("STRUCTATTN_EXTENSION", "").lower() != "require":
        pytest.skip("STRUCTATTN_EXTENSION=require is not set")
    assert kernels(torch.zeros(1, 2, 2)) is not None


def test_failed_build_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler (simulated): one warning, the PyTorch code runs; required: an error;
    turned off: silent."""
    import torch.utils.cpp_extension as cpp

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError("no compiler here")

    monkeypatch.setattr(cpp, "load", fail)
    monkeypatch.setattr(_extension, "_state", {})
    monkeypatch.setenv("STRUCTATTN_EXTENSION", "1")
    scores = torch.randn(2, 4, 4)
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        assert kernels(scores) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels(scores) is None  # decided once, no second warning
        assert torch.isfinite(DependencyCRF(scores).marginals).all()

    monkeypatch.setattr(_extension, "_state", {})
    monkeypatch.setenv("STRUCTATTN_EXTENSION", "require")
    with pytest.raises(RuntimeError, match="cannot build the C\\+\\+ kernels"):
        kernels(scores)

    monkeypatch.setattr(_extension, "_state", {})
    monkeypatch.setenv("STRUCTATTN_EXTENSION", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels(scores) is None


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("multiroot", [True, False], ids=["multiroot", "oneroot"])
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-5)], ids=["f64", "f32"]
)
def test_matrix_tree_kernels_equal_the_pytorch_code(
    multiroot: bool, dtype: torch.dtype, tol: float
) -> None:
    """Non-projective log Z, marginals and the backward of a loss on the marginals agree
    (lengths, -inf arcs, an item without a tree on the exact fallback), with one and two
    chunks, below and above kFusedWords (one loop for the weights and the marginals, or
    ATen ops)."""
    from structattn import NonProjectiveDependencyCRF

    def passes(scores: Tensor, lengths: Tensor) -> tuple[Tensor, ...]:
        x = scores.clone().requires_grad_(True)
        dist = NonProjectiveDependencyCRF(x, lengths, multiroot=multiroot)
        logz, marginals = dist.log_partition, dist.marginals
        weights = torch.randn(scores.shape, generator=torch.Generator().manual_seed(2))
        (grad,) = torch.autograd.grad((marginals * weights.to(dtype)).sum() + logz.sum(), x)
        return logz.detach(), marginals.detach(), grad

    for batch, size in [(1, 2), (3, 6), (7, 12), (4, 33), (3, 34)]:
        scores, lengths = _scores(batch, size, dtype, seed=batch + 10)
        if batch > 2:
            scores[2, :, 3] = float("-inf")  # word 3 has no head: no tree
            lengths[2] = size
        with kernels_disabled():
            reference = passes(scores, lengths)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = passes(scores, lengths)
            for a, b in zip(got, reference, strict=True):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("method", [0, 1, 2], ids=["auto", "gauss-jordan", "lapack"])
@pytest.mark.parametrize("multiroot", [True, False], ids=["multiroot", "oneroot"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_matrix_tree_inversions_equal_the_pytorch_code(
    method: int, multiroot: bool, dtype: torch.dtype
) -> None:
    """Both inversions of the kernels' LU path (Gauss-Jordan on SIMD lanes, LAPACK) and their
    automatic mix (a chunk's last, partial group of eight goes to LAPACK when it holds few
    items) give the log-determinant, inverse and kept items of the PyTorch code: batches
    that do and do not fill the lanes, one word, padding, items with no tree and
    ill-conditioned items."""
    from structattn.structs.nonprojective import _lu_operations

    module = kernels(torch.zeros(1, dtype=dtype))
    assert module is not None
    gen = torch.Generator().manual_seed(method)
    threads = torch.get_num_threads()
    # (9, 82) and (10, 82): one chunk of 8 + 1 or 8 + 2 items, the remainder below
    # 1 + 81 // 20 = 5 (LAPACK), or two chunks of 4 + 5 or 5 + 5 items
    cases = [(1, 2), (7, 5), (8, 9), (19, 16), (0, 4), (9, 82), (10, 82)]
    try:
        for (batch, size), chunks in itertools.product(cases, (1, 2)):
            torch.set_num_threads(chunks)
            scores = (torch.randn(batch, size, size, generator=gen) * 3).to(dtype)
            lengths = torch.randint(2, size + 1, (batch,), generator=gen)
            if batch > 2:
                scores[1, :, 1] = float("-inf")  # word 1 has no head: no tree (singular)
                scores[2, 1, 2] = scores[2, 2, 1] = 1000.0  # a cycle of best heads far above
                # every other arc: the rescaled Laplacian is nearly singular (not kept)
                lengths[2] = size
            real = torch.arange(size) < lengths[:, None]
            for mask in (None, real):
                want = _lu_operations(scores, mask, multiroot, 1e7, True)
                got = module.matrix_tree_lu(scores, mask, multiroot, 1e7, True, method, 20.0)
                assert got[3].tolist() == want[3].tolist()  # the same items kept
                keep = want[3]
                assert got[4].tolist() == (keep & (want[4] > 20.0)).tolist()  # precise
                assert got[5:] == (bool(keep.all()), bool(got[4].any()))
                if batch > 2:
                    assert keep.tolist()[:3] == [True, False, False]
                torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=0)  # weights
                torch.testing.assert_close(got[0][keep], want[0][keep], rtol=1e-12, atol=1e-12)
                scale = want[2][keep].abs().amax(dim=(1, 2), keepdim=True).clamp(min=1)
                torch.testing.assert_close(
                    got[2][keep] / scale, want[2][keep] / scale, rtol=0, atol=1e-12
                )
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="method"):
        module.matrix_tree_lu(scores, None, multiroot, 1e7, True, 3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_matrix_tree_weights_of_nan_and_inf_scores(dtype: torch.dtype) -> None:
    """The kernels' one-loop weights (few words) treat NaN, +inf and a word with no arc as
    the ATen ops of the PyTorch code do (amax, then nan_to_num of the column shifts): the
    same weights, NaN included, and the same log-determinant shifts for the finite items."""
    from structattn.structs.nonprojective import _lu_operations

    module = kernels(torch.zeros(1, dtype=dtype))
    assert module is not None
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(4, 6, 6, generator=gen).to(dtype)
    scores[0, 2, 3] = float("nan")
    scores[1, 1, 2] = float("inf")
    scores[2, :, 4] = float("-inf")  # word 4 has no head
    real = torch.arange(6) < torch.tensor([6, 6, 6, 4])[:, None]
    for multiroot, mask in itertools.product((True, False), (None, real)):
        want = _lu_operations(scores, mask, multiroot, 1e7, True)
        got = module.matrix_tree_lu(scores, mask, multiroot, 1e7, True)
        torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=0, equal_nan=True)
        assert got[3].tolist() == want[3].tolist()
        keep = want[3]
        torch.testing.assert_close(got[0][keep], want[0][keep], rtol=1e-12, atol=1e-12)
    for bad in (
        torch.ones(4, 7, dtype=torch.bool),
        torch.ones(4, 5, dtype=torch.bool),
        real.long(),
    ):
        with pytest.raises(RuntimeError, match="bool mask"):
            module.matrix_tree_lu(scores, bad, True, 1e7, True)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("multiroot", [True, False], ids=["multiroot", "oneroot"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_max_arborescence_kernel_equals_the_pytorch_code(
    multiroot: bool, dtype: torch.dtype
) -> None:
    """Chu-Liu-Edmonds per item in C++ finds the PyTorch code's trees (float64: the same
    heads; float32: the same scores), with lengths, -inf arcs (also ones that leave no tree),
    one-word items, heavy cycles (arcs i <-> i+1 far above the rest), 1 and 2 chunks."""
    from structattn.structs import nonprojective

    def score(scores: Tensor, heads: Tensor) -> Tensor:
        return nonprojective._heads_score(scores.double(), heads)

    gen = torch.Generator().manual_seed(7)
    for batch, size in [(1, 2), (5, 4), (9, 7), (20, 12), (6, 30)]:
        scores = (torch.randn(batch, size, size, generator=gen) * 2).to(dtype)
        scores[scores > 2.5] = float("-inf")  # forbidden arcs
        if batch > 2:
            index = torch.arange(1, size - 1)
            scores[1, index, index + 1] = scores[1, index + 1, index] = 20.0  # cycles
            scores[2, :, 1] = float("-inf")  # word 1 has no head: no tree
        lengths = torch.randint(2, size + 1, (batch,), generator=gen)
        lengths[0] = size
        for lens in (None, lengths):
            with kernels_disabled():
                want = nonprojective.chu_liu_edmonds(scores, lens, multiroot)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                got = nonprojective.chu_liu_edmonds(scores, lens, multiroot)
                assert ((got == -1).all(1) == (want == -1).all(1)).all()
                if dtype == torch.float64:
                    assert got.tolist() == want.tolist()
                else:
                    ok = ~(want == -1).all(1)
                    torch.testing.assert_close(
                        score(scores, got)[ok], score(scores, want)[ok], rtol=1e-6, atol=1e-5
                    )
    module = kernels(torch.zeros(1))
    assert module is not None
    rank = torch.zeros(2, 3, 3, dtype=torch.long)
    with pytest.raises(RuntimeError, match="lengths"):
        module.max_arborescence(rank, torch.zeros(2, 3, 3), torch.tensor([2, 4]))
    with pytest.raises(RuntimeError, match="int64"):
        module.max_arborescence(rank.int(), torch.zeros(2, 3, 3), torch.tensor([2, 3]))


def test_slow_build_is_announced(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A build that takes more than a second logs a notice before and a line after where
    logging shows INFO records (a cached load, well under a second, stays silent)."""
    import time
    import types

    import torch.utils.cpp_extension as cpp

    module = types.ModuleType("fake_kernels")

    def slow(*args: object, **kwargs: object) -> types.ModuleType:
        time.sleep(1.3)
        return module

    monkeypatch.setattr(cpp, "load", slow)
    monkeypatch.setattr(_extension, "_state", {})
    monkeypatch.setattr(_extension, "_announced", False)
    monkeypatch.setenv("STRUCTATTN_EXTENSION", "1")
    with caplog.at_level("INFO", logger="structattn"):
        assert kernels(torch.zeros(1, 2, 2)) is module
    messages = [record.getMessage() for record in caplog.records]
    assert any("compiling the C++ kernels" in m for m in messages)
    assert any("C++ kernels ready" in m for m in messages)

    def fast(*args: object, **kwargs: object) -> types.ModuleType:
        return module

    caplog.clear()
    monkeypatch.setattr(cpp, "load", fast)
    monkeypatch.setattr(_extension, "_state", {})
    with caplog.at_level("INFO", logger="structattn"):
        assert kernels(torch.zeros(1, 2, 2)) is module
    assert not caplog.records


def test_first_use_from_several_threads_builds_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads that reach the first use together wait for one build (one warning)."""
    import threading
    import time

    import torch.utils.cpp_extension as cpp

    calls = []

    def slow_failure(*args: object, **kwargs: object) -> None:
        calls.append(1)
        time.sleep(0.3)
        raise OSError("no compiler here")

    monkeypatch.setattr(cpp, "load", slow_failure)
    monkeypatch.setattr(_extension, "_state", {})
    monkeypatch.setenv("STRUCTATTN_EXTENSION", "1")
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [
            threading.Thread(target=lambda: results.append(kernels(torch.zeros(1, 2, 2))))
            for _ in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert results == [None, None, None]
    assert len(calls) == 1
    assert sum("no compiler here" in str(w.message) for w in caught) == 1


# ---- the build: cache key, first-use notice (issue 20.6) ---------------------------------------
def test_build_name_follows_everything_that_changes_a_build(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache key (the module's name, hence its build directory) changes with the sources
    and headers, the flags, the interpreter, torch and the compiler, and is stable
    otherwise (two venvs with the same torch no longer rebuild each other's cache)."""
    import re
    import sys
    from pathlib import Path

    source, header = Path(tmp_path, "_a.cpp"), Path(tmp_path, "_a.h")
    source.write_text("int a;\n")
    header.write_text("#pragma once\n")

    def name(cflags: tuple[str, ...] = ("-O2",), ldflags: tuple[str, ...] = ()) -> str:
        return _extension.build_name([source, header], list(cflags), list(ldflags))

    first = name()
    assert re.fullmatch(r"structattn_kernels_[0-9a-f]{16}", first)  # a valid module name
    assert name() == first
    for path in (source, header):
        text = path.read_text()
        path.write_text(text + "// edited\n")
        assert name() != first
        path.write_text(text)
        assert name() == first
    assert name(cflags=("-O3",)) != first
    assert name(ldflags=("-fopenmp",)) != first
    for target, attribute, value in [
        (sys, "executable", "/another/venv/bin/python"),
        (sys, "version", "3.99.0 (another build)"),
        (torch, "__version__", "0.0.1"),
        (torch, "__file__", "/another/venv/lib/torch/__init__.py"),
    ]:
        with monkeypatch.context() as patch:
            patch.setattr(target, attribute, value)
            assert name() != first, attribute
    with monkeypatch.context() as patch:
        patch.setenv("CXX", "clang++")
        assert name() != first
    assert name() == first
    # the real build hashes every source and header of the kernels
    hashed = {path.name for path in _extension._SOURCES + _extension._HEADERS}
    assert {"_kernels.cpp", "_eisner.cpp", "_matrix_tree.cpp", "_kernels.h"} <= hashed
    assert _extension.build_name() == _extension.build_name()


def test_build_uses_the_build_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import torch.utils.cpp_extension as cpp

    calls: list[dict[str, object]] = []

    def load(**kwargs: object) -> types.ModuleType:
        calls.append(kwargs)
        return types.ModuleType("fake_kernels")

    monkeypatch.setattr(cpp, "load", load)
    monkeypatch.setattr(_extension, "_state", {})
    monkeypatch.setenv("STRUCTATTN_EXTENSION", "1")
    assert kernels(torch.zeros(1, 2, 2)) is not None
    (call,) = calls
    cflags, ldflags = _extension._flags()
    assert call["name"] == _extension.build_name(_extension._SOURCES + _extension._HEADERS)
    assert call["extra_cflags"] == cflags and call["extra_ldflags"] == ldflags
    assert call["sources"] == [str(path) for path in _extension._SOURCES]


def _slow_load(monkeypatch: pytest.MonkeyPatch) -> object:
    """A fake build of 0.3 s, the notice after 0.05 s, and nothing announced yet."""
    import time
    import types

    import torch.utils.cpp_extension as cpp

    module = types.ModuleType("fake_kernels")

    def slow(*args: object, **kwargs: object) -> types.ModuleType:
        time.sleep(0.3)
        return module

    monkeypatch.setattr(cpp, "load", slow)
    monkeypatch.setattr(_extension, "_state", {})
    monkeypatch.setattr(_extension, "_announced", False)
    monkeypatch.setattr(_extension, "_NOTICE_DELAY", 0.05)
    monkeypatch.setenv("STRUCTATTN_EXTENSION", "1")
    return module


def test_first_build_is_announced_once_to_library_users(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without logging set up (a library user), a compiling build prints its notice on
    stderr (not at INFO, which nobody sees), once per process."""
    module = _slow_load(monkeypatch)
    assert kernels(torch.zeros(1, 2, 2)) is module
    err = capsys.readouterr().err
    assert err.count("compiling the C++ kernels") == 1
    assert "TORCH_EXTENSIONS_DIR" in err and err.count("C++ kernels ready") == 1
    monkeypatch.setattr(_extension, "_state", {})  # another build in the same process
    assert kernels(torch.zeros(1, 2, 2)) is module
    assert "compiling" not in capsys.readouterr().err


def test_first_build_notice_is_not_doubled_by_the_cli_logging(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where logging shows structattn's INFO records (the CLI's handler), the notice goes
    there only: one copy on stderr, not two."""
    import logging

    from structattn.cli import _StderrHandler

    module = _slow_load(monkeypatch)
    log = logging.getLogger("structattn")
    handler = _StderrHandler()
    monkeypatch.setattr(log, "handlers", [handler])
    level = log.level
    log.setLevel(logging.INFO)  # (clears the logger's cache of enabled levels)
    try:
        assert kernels(torch.zeros(1, 2, 2)) is module
    finally:
        log.setLevel(level)
    err = capsys.readouterr().err
    assert err.count("compiling the C++ kernels") == 1 and err.count("ready") == 1


@pytest.mark.usefixtures("built_kernels")
@pytest.mark.parametrize("kind", ["projective", "projective-marginals", "non-projective", "chain"])
def test_kernel_outputs_do_not_keep_their_graph_alive(kind: str) -> None:
    """An output the C++ state also held kept the autograd node owning that state alive: a
    reference cycle through C++ that leaked every chart (3 MB per call at B = 64, N = 21) and
    made each call allocate fresh memory. The outputs must die with their graph."""
    import gc
    import weakref

    from structattn import LinearChainCRF, NonProjectiveDependencyCRF

    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(9, 6, 6, generator=gen, requires_grad=True)
    lengths = torch.tensor([6, 5, 4, 6, 3, 2, 6, 5, 4])
    if kind == "projective":
        out = DependencyCRF(scores, lengths).log_partition
    elif kind == "projective-marginals":
        out = DependencyCRF(scores, lengths).marginals
    elif kind == "non-projective":
        out = NonProjectiveDependencyCRF(scores, lengths).marginals
    else:
        out = LinearChainCRF(scores[:, :, :2], torch.randn(2, 2), lengths).marginals
    out.sum().backward()
    ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is None


def test_every_launcher_of_an_environment_shares_one_build() -> None:
    """``python``, ``python3`` and ``python3.X`` of one environment (and the console script,
    whose shebang names one of them) hash to one build (issue 38.1: they built one each)."""
    import subprocess
    import sys
    from pathlib import Path

    folder = Path(sys.executable).parent
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    launchers = [folder / n for n in ("python", "python3", minor) if (folder / n).exists()]
    assert len(launchers) >= 2, launchers
    code = "from structattn.structs._extension import build_name; print(build_name())"
    names = {
        subprocess.run([str(launcher), "-c", code], capture_output=True, text=True, check=True)
        .stdout.strip()
        .splitlines()[-1]
        for launcher in launchers
    }
    assert len(names) == 1, names


def test_a_stale_build_lock_is_removed(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``lock`` left in the build directory by a process killed during a build made every
    later process wait in torch's ``FileBaton.wait`` forever (issue 37.3.1); now the builder
    that holds structattn's OS lock removes it, and torch's lock is taken at once."""
    import types
    from pathlib import Path

    import torch.utils.cpp_extension as cpp
    from torch.utils.file_baton import FileBaton

    root = Path(tmp_path)
    name = _extension.build_name(_extension._SOURCES + _extension._HEADERS)
    (root / name).mkdir(parents=True)
    (root / name / "lock").touch()  # what a killed build leaves
    taken: list[bool] = []

    def load(**kwargs: object) -> types.ModuleType:  # torch's own first step: its baton
        baton = FileBaton(str(root / str(kwargs["name"]) / "lock"))
        taken.append(baton.try_acquire())
        if taken[-1]:
            baton.release()
        return types.ModuleType("fake_kernels")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    monkeypatch.setattr(cpp, "load", load)
    monkeypatch.setattr(_extension, "_state", {})
    monkeypatch.setenv("STRUCTATTN_EXTENSION", "1")
    assert kernels(torch.zeros(1, 2, 2)) is not None
    assert taken == [True]
    assert not (root / name / "lock").exists()


def test_the_build_lock_is_released_when_its_holder_dies(tmp_path: os.PathLike[str]) -> None:
    """The OS lock dies with its holder: a process killed inside the build section does not
    block the next one (kill -9 of a holder, then the lock is taken within seconds)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path\n"
            "from structattn.structs._extension import _build_lock\n"
            f"with _build_lock(Path({str(root)!r}), 'k'):\n"
            "    print('held', flush=True); time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        holder.kill()
        holder.wait(timeout=10)
        start = time.monotonic()
        with _extension._build_lock(root, "k"):
            pass
        assert time.monotonic() - start < 5
    finally:
        holder.kill()


# ---- SIMD targets: one build per target, every clone tested (#42) ----------------------------
def _cpu_flags() -> set[str]:
    from pathlib import Path

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


#: the CPU flags each one-target build needs (x86-64-v4: AVX-512; x86-64-v3: AVX2)
_TARGET_FLAGS = {
    "v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "v3": {"avx2", "fma", "bmi1", "bmi2", "movbe"},
    "default": {"sse2"},
}


def test_kernel_target_switch_picks_the_flags_and_the_build_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """STRUCTATTN_KERNEL_TARGET=v4|v3|default builds for that -march only (no clones), under
    a build name of its own; unset, empty, auto or clones: the usual build; another value is
    a ValueError naming the variable (a failed build: a warning, or an error if required)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("one-target builds are x86-64 only")
    names = {}
    for value, march in [("v4", "x86-64-v4"), ("v3", "x86-64-v3"), ("default", "x86-64")]:
        monkeypatch.setenv("STRUCTATTN_KERNEL_TARGET", value)
        assert _extension.kernel_target() == value
        cflags, _ = _extension._flags()
        assert f"-march={march}" in cflags
        assert f"-DSTRUCTATTN_ONE_TARGET={march}" in cflags
        names[value] = _extension.build_name()
    for value in ("", "auto", "clones", " AUTO "):
        monkeypatch.setenv("STRUCTATTN_KERNEL_TARGET", value)
        assert _extension.kernel_target() is None
        assert not any(flag.startswith("-march") for flag in _extension._flags()[0])
        names["clones"] = _extension.build_name()
    monkeypatch.delenv("STRUCTATTN_KERNEL_TARGET")
    assert _extension.build_name() == names["clones"]
    assert len(set(names.values())) == 4  # four builds, four cache directories
    monkeypatch.setenv("STRUCTATTN_KERNEL_TARGET", "avx2")
    with pytest.raises(ValueError, match="STRUCTATTN_KERNEL_TARGET"):
        _extension.kernel_target()
    monkeypatch.setattr(_extension, "_state", {})
    monkeypatch.setenv("STRUCTATTN_EXTENSION", "require")
    with pytest.raises(RuntimeError, match="STRUCTATTN_KERNEL_TARGET"):
        kernels(torch.zeros(1, 2, 2))


@pytest.mark.usefixtures("built_kernels")
def test_loaded_kernels_run_the_chosen_target() -> None:
    """The kernels report the target their vector loops run: the forced one under
    STRUCTATTN_KERNEL_TARGET, else the clone the loader picks for this CPU (the highest
    level whose flags it has)."""
    module = kernels(torch.zeros(1, 2, 2))
    if not hasattr(module, "simd_target"):
        pytest.skip("these kernels predate simd_target")
    target = _extension.kernel_target()
    if target is not None:
        assert module.simd_build() == "one target"
        assert module.simd_target() == _extension.KERNEL_TARGETS[target]
        return
    if module.simd_build() != "clones":
        pytest.skip("built without clones (not GCC >= 12 on x86-64 Linux)")
    flags = _cpu_flags()
    want = next(t for t in ("v4", "v3", "default") if _TARGET_FLAGS[t] <= flags)
    assert module.simd_target() == _extension.KERNEL_TARGETS[want]
    assert _extension.simd_target() == module.simd_target()


#: the kernel-vs-PyTorch equality suites (run once per target by the next test)
_SUITES = ["tests/test_kernels.py", "tests/test_chain_kernels.py"]


@pytest.mark.parametrize("target", ["v4", "v3", "default"])
def test_equality_suites_under_each_target(target: str) -> None:
    """The kernel-vs-PyTorch suites under each one-target build this CPU can run, each in a
    fresh process (a process loads one build): opt in with STRUCTATTN_TEST_TARGETS=1 (or a
    comma list such as v3,default), as each target's first build takes minutes. By hand:
    ``STRUCTATTN_KERNEL_TARGET=v3 pytest tests/test_kernels.py tests/test_chain_kernels.py``."""
    import subprocess
    import sys
    from pathlib import Path

    wanted = os.environ.get("STRUCTATTN_TEST_TARGETS", "").strip().lower()
    if not wanted or wanted in ("0", "no", "off"):
        pytest.skip("set STRUCTATTN_TEST_TARGETS=1 (or v4,v3,default) to build and test each")
    if wanted not in ("1", "all", "yes") and target not in wanted.split(","):
        pytest.skip(f"{target} is not in STRUCTATTN_TEST_TARGETS={wanted}")
    if os.environ.get("STRUCTATTN_KERNEL_TARGET"):
        pytest.skip("already inside a one-target run")
    if not _TARGET_FLAGS[target] <= _cpu_flags():
        pytest.skip(f"this CPU cannot run the {target} target")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, STRUCTATTN_KERNEL_TARGET=target, STRUCTATTN_EXTENSION="require")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src"), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *_SUITES],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout


# ---- NaN scores: the kernels and the PyTorch code agree item by item (#37.10) -----------------
def _nan_items(x: Tensor) -> list[bool]:
    """Per batch item: whether any entry of ``x`` [B, ...] is NaN."""
    return x.reshape(x.shape[0], -1).isnan().any(1).tolist()


@pytest.mark.usefixtures("built_kernels")
@pytest.mark.parametrize("path", ["fused", "fused-recomputed", "aten"])
@pytest.mark.parametrize("multiroot", [True, False], ids=["multiroot", "oneroot"])
def test_nan_scores_give_nan_for_their_items_as_the_pytorch_code(
    multiroot: bool, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With validate_args=False, a NaN arc score makes log Z, the marginals and both
    gradients NaN for its item only, from the kernels as from the PyTorch code (the fused
    loops gave a finite log Z); NaN in padding or on the diagonal (never read) changes
    nothing; every other item is the same."""
    if path == "aten":
        monkeypatch.setattr(dependency, "_FUSED_SIZE", 0)
    if path.endswith("recomputed"):
        monkeypatch.setattr(dependency, "_CACHE_ELEMENTS", 0)
    scores, lengths = _scores(5, 8, torch.float64, seed=21)
    lengths.copy_(torch.tensor([8, 8, 8, 5, 8]))
    scores[2, 3, 5] = float("nan")  # a real arc of item 2
    scores[3, 6, 2] = scores[3, 1, 7] = float("nan")  # padding of item 3 (5 positions)
    scores[4, 4, 4] = float("nan")  # the diagonal

    def outputs() -> list[Tensor]:
        x = scores.clone().requires_grad_(True)
        crf = DependencyCRF(x, lengths, multiroot=multiroot, validate_args=False)
        marginals = crf.marginals
        (second,) = torch.autograd.grad((marginals * marginals).sum(), x)
        y = scores.clone().requires_grad_(True)
        logz = DependencyCRF(y, lengths, multiroot=multiroot, validate_args=False).log_partition
        (first,) = torch.autograd.grad(logz.sum(), y)
        return [logz.detach(), marginals.detach(), second, first]

    got = outputs()
    with kernels_disabled():
        want = outputs()
    expected = [False, False, True, False, False]
    for a, b in zip(got, want, strict=True):
        assert _nan_items(a) == expected == _nan_items(b)
        keep = ~torch.tensor(expected)
        torch.testing.assert_close(a[keep], b[keep], rtol=1e-10, atol=1e-10)
    assert torch.isnan(got[0][2])


def test_dispatch_by_measurement_follows_the_loaded_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused loops serve trees up to the loaded target's limit in _FUSED_SIZES (here a
    made-up table: x86-64-v3 20 positions, baseline x86-64 none), else up to _FUSED_SIZE
    (x86-64-v4, no kernels loaded yet, or kernels too old to say); larger trees take the
    ATen path. The real table names known targets only, within _FUSED_SIZE."""
    monkeypatch.setattr(dependency, "_FUSED_SIZES", {"x86-64-v3": 20, "x86-64": 0})
    for target, limit in [("x86-64-v4", 96), ("x86-64-v3", 20), ("x86-64", 0), (None, 96)]:
        monkeypatch.setattr(dependency, "loaded_target", lambda target=target: target)
        assert dependency._fused(limit) or limit == 0
        assert not dependency._fused(limit + 1)
    monkeypatch.undo()
    assert set(dependency._FUSED_SIZES) <= set(_extension.KERNEL_TARGETS.values())
    assert all(0 <= v <= dependency._FUSED_SIZE for v in dependency._FUSED_SIZES.values())


def test_the_build_lock_looks_where_torch_builds(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stale-lock check looks in the folder torch builds in: without
    TORCH_EXTENSIONS_DIR, torch's default root plus a py<version>_<accelerator> folder (the
    lock looked in the default root itself and missed a stale lock, #37.3.1)."""
    from pathlib import Path

    from torch.utils.cpp_extension import _get_build_directory

    name = "structattn_kernels_0123456789abcdef"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    root = _extension._build_root(name, lambda: "unused")
    assert root == Path(_get_build_directory(name, False)).parent
    with __import__("contextlib").suppress(OSError):  # the empty folder torch made
        (root / name).rmdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert _extension._build_root(name, lambda: "unused") == Path(tmp_path)


@pytest.mark.usefixtures("built_kernels")
@pytest.mark.parametrize("normalizer", ["projective", "non-projective", "segmentation"])
def test_a_nan_query_gives_nan_for_its_item_on_both_paths(normalizer: str) -> None:
    """#37.10 in a layer: a NaN in one item's query makes that item's context NaN, with the
    kernels as with the PyTorch code (the kernels gave a context of exactly 0 and a finite
    loss), and every other item is the same on both paths."""
    from structattn.attention import StructuredMultiheadAttention

    torch.manual_seed(0)
    layer = StructuredMultiheadAttention(8, 2, normalizer=normalizer, batch_first=True)
    query = torch.randn(3, 5, 8, dtype=torch.float32)
    query[1, 2, 0] = float("nan")
    layer = layer.double()
    query = query.double()
    with_kernels, _ = layer(query, query, query)
    with kernels_disabled():
        without, _ = layer(query, query, query)
    assert _nan_items(with_kernels) == _nan_items(without) == [False, True, False]
    torch.testing.assert_close(with_kernels[[0, 2]], without[[0, 2]])
