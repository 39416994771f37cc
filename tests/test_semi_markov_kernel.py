"""The C++ semi-Markov kernels (structs/_semi_markov.cpp, ``torch.ops.structattn_semi_markov``)
against the PyTorch path they replace on CPU (structs/semi_markov.py): log Z, the segment and
transition marginals, the gradient of log Z and the Hessian-vector product (the backward of the
marginals), in float64 and float32, with variable lengths (length 1, K > n), -inf segments and
transitions, an item with no segmentation, |score| = 1e4, shared [C, C] and per-item
[B, C, C] transitions; gradcheck and gradgradcheck through the kernels; torch.func's wrappers
(which take the PyTorch sweeps over the kernel's forward pass); the batch split in chunks
(#39). The PyTorch path itself is checked against brute force in tests/test_span_structures.py.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor

from structattn import SemiMarkovCRF
from structattn.structs._extension import kernels, kernels_disabled
from structattn.structs.semi_markov import (
    _forward_pass,
    _hvp,
    _kernel_ops,
    _outside,
    semi_markov_log_partition,
    semi_markov_marginals,
)

INF = float("inf")


@pytest.fixture
def semi_markov_kernel() -> None:
    """Skip where the kernels are not built or do not hold the semi-Markov kernels."""
    if kernels(torch.zeros(1, 2, 2)) is None:
        pytest.skip("the C++ kernels are not built (STRUCTATTN_EXTENSION=0 or no compiler)")
    if _kernel_ops(torch.zeros(1, 1, 1, 1)) is None:
        pytest.skip("the C++ kernels were built without the semi-Markov kernels")


pytestmark = pytest.mark.usefixtures("semi_markov_kernel")

#: (B, N, K, C): K > N, N = 1, C = 1, K = 1
SHAPES = [(5, 9, 3, 2), (4, 6, 8, 3), (3, 1, 1, 1), (4, 7, 2, 4), (3, 5, 5, 1), (2, 8, 1, 3)]


def _draw(
    shape: tuple[int, int, int, int], shared: bool, dtype: torch.dtype, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Standard normal scores with -inf segments and transitions, an item with no
    segmentation (item 2, if any), lengths in 1..N with one item at N and one at 1."""
    batch, size, width, labels = shape
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(shape, generator=gen, dtype=dtype)
    scores = scores.masked_fill(torch.rand(shape, generator=gen) < 0.15, -INF)
    trans_shape = (labels, labels) if shared else (batch, labels, labels)
    transitions = torch.randn(trans_shape, generator=gen, dtype=dtype)
    if labels > 1:
        transitions[..., 0, 1] = -INF
    lengths = torch.randint(1, size + 1, (batch,), generator=gen)
    lengths[0], lengths[1] = size, 1
    if batch > 2:
        scores[2] = -INF  # no segmentation
    return scores, transitions, lengths


def _results(
    scores: Tensor, transitions: Tensor, lengths: Tensor | None, seed: int = 1
) -> tuple[Tensor, ...]:
    """log Z, marginals (segments, transitions), d log Z, and the HVP: the gradient of a
    weighted sum of the marginals with respect to the scores and the transitions."""
    x = scores.clone().requires_grad_()
    t = transitions.clone().requires_grad_()
    dist = SemiMarkovCRF(x, t, lengths)
    gen = torch.Generator().manual_seed(seed)
    w_seg = torch.randn(scores.shape, generator=gen, dtype=scores.dtype)
    w_trans = torch.randn(dist.transition_marginals.shape, generator=gen, dtype=scores.dtype)
    logz = dist.log_partition
    g_seg, g_trans = torch.autograd.grad(logz.sum(), (x, t))
    loss = (dist.marginals * w_seg).sum() + (dist.transition_marginals * w_trans).sum()
    h_seg, h_trans = torch.autograd.grad(loss, (x, t))
    return logz, dist.marginals, dist.transition_marginals, g_seg, g_trans, h_seg, h_trans


def _assert_same(got: tuple[Tensor, ...], want: tuple[Tensor, ...], dtype: torch.dtype) -> None:
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-9}
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype == dtype, i
        assert g.shape == w.shape, i
        torch.testing.assert_close(g.detach(), w.detach(), **tol, msg=lambda m, i=i: f"{i}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-item"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_the_pytorch_path(
    shape: tuple[int, int, int, int], shared: bool, dtype: torch.dtype
) -> None:
    scores, transitions, lengths = _draw(shape, shared, dtype)
    got = _results(scores, transitions, lengths)
    with kernels_disabled():
        want = _results(scores, transitions, lengths)
    _assert_same(got, want, dtype)
    if shape[0] > 2:  # the item with no segmentation: -inf and zero derivatives
        assert got[0][2] == -INF
        assert all(x[2].eq(0).all() for x in got[1:3]) and got[3][2].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernel_matches_at_large_scores(dtype: torch.dtype) -> None:
    """|score| = 1e4 (float32): both paths run in float64 on CPU, near one-hot marginals."""
    scores, transitions, lengths = _draw((4, 10, 4, 3), False, dtype, seed=3)
    scores, transitions = scores * 1e4, transitions * 1e4
    got = _results(scores, transitions, lengths)
    with kernels_disabled():
        want = _results(scores, transitions, lengths)
    _assert_same(got, want, dtype)
    assert all(torch.isfinite(x[[0, 1, 3]]).all() for x in got)


def test_kernel_matches_at_plus_inf_without_validation() -> None:
    """A +inf score (refused by validation) gives log Z = +inf on both paths (NaN where a
    path through it meets a -inf score: +inf - inf)."""
    gen = torch.Generator().manual_seed(10)
    scores = torch.randn(2, 5, 2, 2, generator=gen, dtype=torch.float64)
    scores[0, 1, 0, 1] = INF
    transitions = torch.randn(2, 2, generator=gen, dtype=torch.float64)
    for trans in (transitions, transitions.masked_fill(torch.eye(2, dtype=torch.bool), -INF)):
        got = SemiMarkovCRF(scores, trans, validate_args=False).log_partition
        with kernels_disabled():
            want = SemiMarkovCRF(scores, trans, validate_args=False).log_partition
        torch.testing.assert_close(got, want, equal_nan=True)
    assert (
        got[0].isnan()
        and SemiMarkovCRF(scores, transitions, validate_args=False).log_partition[0] == INF
    )


def test_kernel_matches_without_lengths() -> None:
    scores, transitions, _ = _draw((3, 6, 3, 2), True, torch.float64, seed=4)
    scores[2] = torch.randn(6, 3, 2, dtype=torch.float64)
    got = _results(scores, transitions, None)
    with kernels_disabled():
        want = _results(scores, transitions, None)
    _assert_same(got, want, torch.float64)


def test_an_empty_batch_takes_the_pytorch_path() -> None:
    scores, transitions, lengths = _draw((2, 4, 2, 2), False, torch.float64)
    empty = _forward_pass(scores[:0], transitions[:0], lengths[:0] - 1)
    assert not empty.kernel and empty.logz.shape == (0,)
    dist = SemiMarkovCRF(scores[:0], transitions[:1].expand(0, 2, 2))
    assert dist.log_partition.shape == (0,) and dist.marginals.shape == (0, 4, 2, 2)


def test_the_kernels_run_and_share_the_layout_of_the_pytorch_pass() -> None:
    """The kernel's forward pass gives the PyTorch pass's local probabilities (0 past each
    item's length) and the PyTorch sweeps on it give the kernel's marginals and HVP."""
    scores, transitions, lengths = _draw((5, 9, 3, 2), False, torch.float64, seed=5)
    last = lengths - 1
    probs = _forward_pass(scores, transitions, last)
    assert probs.kernel
    with kernels_disabled():
        ref = _forward_pass(scores, transitions, last)
    assert not ref.kernel
    torch.testing.assert_close(probs.logz, ref.logz)
    torch.testing.assert_close(probs.root, ref.root)
    inside = torch.arange(9) < lengths.unsqueeze(-1)  # [B, N]: positions t < n
    torch.testing.assert_close(probs.seg, ref.seg * inside[..., None, None])
    torch.testing.assert_close(probs.trans, ref.trans * inside[:, 1:, None, None])
    out = _outside(probs)
    python = _outside(probs._replace(kernel=False))
    for a, b in zip(out, python, strict=True):
        torch.testing.assert_close(a, b)
    gen = torch.Generator().manual_seed(6)
    d_seg = torch.randn(scores.shape, generator=gen, dtype=torch.float64)
    d_trans = torch.randn(transitions.shape, generator=gen, dtype=torch.float64)
    got = _hvp(probs, out, d_seg, d_trans)
    want = _hvp(probs._replace(kernel=False), python, d_seg, d_trans)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_gradcheck_and_gradgradcheck_through_the_kernels() -> None:
    scores, transitions, lengths = _draw((3, 5, 3, 2), False, torch.float64, seed=7)
    scores = scores.masked_fill(torch.isinf(scores), -3.0).requires_grad_()  # finite differences
    transitions = transitions.masked_fill(torch.isinf(transitions), -3.0).requires_grad_()
    assert _forward_pass(scores.detach(), transitions.detach(), lengths - 1).kernel

    def logz(s: Tensor, t: Tensor) -> Tensor:
        return semi_markov_log_partition(s, t, lengths)

    def marginals(s: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        return semi_markov_marginals(s, t, lengths)

    assert torch.autograd.gradcheck(logz, (scores, transitions))
    assert torch.autograd.gradgradcheck(logz, (scores, transitions))
    assert torch.autograd.gradcheck(marginals, (scores, transitions))


def test_torch_func_over_the_kernels() -> None:
    """jacrev of the marginals (a vmapped direction: the PyTorch HVP sweeps over the kernel's
    forward pass) and vmap of log Z give what the PyTorch path gives."""
    scores, transitions, lengths = _draw((3, 4, 2, 2), False, torch.float64, seed=8)

    def first(s: Tensor) -> Tensor:
        return semi_markov_marginals(s, transitions, lengths)[0]

    def logz(s: Tensor) -> Tensor:
        return semi_markov_log_partition(s.unsqueeze(0), transitions[:1], lengths[:1])[0]

    got = (torch.func.jacrev(first)(scores), torch.func.vmap(logz)(scores))
    with kernels_disabled():
        want = (torch.func.jacrev(first)(scores), torch.func.vmap(logz)(scores))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.fixture
def chunks(semi_markov_kernel: None) -> Iterator[None]:
    """Every batch split into one chunk per thread (two threads)."""
    module = kernels(torch.zeros(1, 2, 2))
    assert module is not None
    threads = torch.get_num_threads()
    before = module.set_parallel_work(0.0)
    torch.set_num_threads(2)
    try:
        yield
    finally:
        module.set_parallel_work(before)
        torch.set_num_threads(threads)


@pytest.mark.usefixtures("chunks")
def test_the_batch_split_in_chunks_gives_the_same_results() -> None:
    scores, transitions, lengths = _draw((7, 8, 3, 3), True, torch.float64, seed=9)
    got = _results(scores, transitions, lengths)
    with kernels_disabled():
        want = _results(scores, transitions, lengths)
    _assert_same(got, want, torch.float64)


def test_the_benchmark_script_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/semi_kernel.py (one round of one call per row): a table row per op."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "semi_kernel.py"
    spec = importlib.util.spec_from_file_location("structattn_bench_semi_kernel", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--rounds", "1", "--repeats", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 2 * len(module.SIZES)  # the header, a row per op and size
    assert all(row.endswith("x |") for row in rows[1:])
