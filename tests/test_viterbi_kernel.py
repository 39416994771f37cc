"""The C++ Viterbi kernel (structs/_viterbi.cpp, ``torch.ops.structattn_viterbi.viterbi``)
against the PyTorch path it replaces (``chain_kbest`` with k = 1: the same sequence and, bit
for bit, the same score), against brute force, and through ``LinearChainCRF.argmax`` and
``max_score`` (whose gradient is the indicators of the best sequence) (#38.10)."""

from __future__ import annotations

import itertools

import oracles
import pytest
import torch
from torch import Tensor

from structattn import LinearChainCRF
from structattn.structs._extension import kernels, kernels_disabled
from structattn.structs.linear_chain import chain_argmax, chain_kbest

INF = float("inf")


@pytest.fixture
def viterbi_kernel() -> None:
    """Skip where the kernels are not built or do not hold the Viterbi kernel."""
    if kernels(torch.zeros(1, 2, 2)) is None:
        pytest.skip("the C++ kernels are not built on this machine")
    try:
        torch.ops.structattn_viterbi.viterbi  # noqa: B018
    except (AttributeError, RuntimeError):
        pytest.skip("the C++ kernels were built without the Viterbi kernel")


pytestmark = pytest.mark.usefixtures("viterbi_kernel")


def _draw(
    batch: int,
    n: int,
    c: int,
    shared: bool,
    dtype: torch.dtype,
    seed: int = 0,
    integers: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Potentials (standard normal, or integers in -2..2: many ties) and lengths in 1..N (one
    item at N)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (c, c) if shared else (batch, max(n - 1, 0), c, c)
    if integers:
        unary = torch.randint(-2, 3, (batch, n, c), generator=gen).to(dtype)
        pairwise = torch.randint(-2, 3, shape, generator=gen).to(dtype)
    else:
        unary = torch.randn(batch, n, c, generator=gen, dtype=dtype)
        pairwise = torch.randn(shape, generator=gen, dtype=dtype)
    lengths = torch.randint(1, n + 1, (batch,), generator=gen)
    lengths[0] = n
    return unary, pairwise, lengths


def _reference(unary: Tensor, pairwise: Tensor, lengths: Tensor | None) -> tuple[Tensor, Tensor]:
    """The PyTorch path: chain_kbest with k = 1 (unary 0 at padding, transitions per step),
    as LinearChainCRF runs it without the kernel."""
    batch, n, c = unary.shape
    if lengths is not None:
        real = torch.arange(n) < lengths.unsqueeze(-1)
        unary = unary.masked_fill(~real.unsqueeze(-1), 0.0)
    pairwise = pairwise.expand(batch, max(n - 1, 0), c, c)
    scores, labels = chain_kbest(unary, pairwise, lengths, 1)
    return scores[0], labels[0]


def _kernel(unary: Tensor, pairwise: Tensor, lengths: Tensor | None) -> tuple[Tensor, Tensor]:
    best = chain_argmax(unary, pairwise, lengths)
    assert best is not None
    return best


def _assert_same(got: tuple[Tensor, Tensor], want: tuple[Tensor, Tensor]) -> None:
    """Equal labels, and scores equal bit for bit (-inf and NaN in the same places)."""
    assert got[1].dtype == torch.long
    assert torch.equal(got[1], want[1])
    assert got[0].dtype == want[0].dtype
    torch.testing.assert_close(got[0], want[0], rtol=0.0, atol=0.0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("integers", [False, True], ids=["random", "tied"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.usefixtures("small_chunks")
def test_kernel_equals_the_pytorch_path(dtype: torch.dtype, integers: bool, threads: int) -> None:
    """Labels and scores, shared and per-step transitions, C = 1..5, 8, 10, 16, 17, 33, 50
    (every remainder of the vector loop), N = 1, 2, 7, variable lengths (length 1 included),
    B = 1 and 6, the batch in one chunk and in two."""
    torch.set_num_threads(threads)
    sizes = itertools.product((1, 2, 3, 4, 5, 8, 10, 16, 17, 33, 50), (1, 2, 7), (1, 6))
    for seed, (c, n, batch) in enumerate(sizes):
        for shared in (True, False):
            unary, pairwise, lengths = _draw(batch, n, c, shared, dtype, seed, integers)
            for lens in (None, lengths):
                _assert_same(_kernel(unary, pairwise, lens), _reference(unary, pairwise, lens))


def test_ties_go_to_the_lower_label_as_in_topk() -> None:
    """Integer potentials (many tied sequences): the kernel's sequence is topk(k)'s first
    for every k (#41), and with all potentials equal it is all label 0."""
    for seed in range(20):
        unary, pairwise, lengths = _draw(4, 6, 3, seed % 2 == 0, torch.float64, seed, True)
        crf = LinearChainCRF(unary, pairwise, lengths)
        labels = crf.argmax
        assert torch.equal(labels, _kernel(unary, pairwise, lengths)[1])
        for k in (1, 2, 5):
            assert torch.equal(crf.topk(k)[1][0], labels)
    score, labels = _kernel(torch.zeros(2, 5, 4), torch.zeros(4, 4), torch.tensor([5, 3]))
    assert torch.equal(labels, torch.tensor([[0, 0, 0, 0, 0], [0, 0, 0, -1, -1]]))
    assert torch.equal(score, torch.zeros(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_neg_inf_potentials(dtype: torch.dtype) -> None:
    """Forbidden labels and transitions (-inf), items with no valid sequence (score -inf,
    labels -1 everywhere), a label forbidden at every position, all transitions forbidden:
    the same as the PyTorch path."""
    for seed in range(30):
        gen = torch.Generator().manual_seed(seed)
        shared = seed % 2 == 0
        unary, pairwise, lengths = _draw(5, 6, 4, shared, dtype, seed)
        unary = unary.masked_fill(torch.rand(unary.shape, generator=gen) < 0.4, -INF)
        pairwise = pairwise.masked_fill(torch.rand(pairwise.shape, generator=gen) < 0.4, -INF)
        for lens in (None, lengths):
            _assert_same(_kernel(unary, pairwise, lens), _reference(unary, pairwise, lens))
    unary = torch.zeros(3, 4, 2, dtype=dtype)
    unary[0, 2] = -INF  # no label at position 2: no sequence for item 0
    unary[1, 3] = -INF  # the same beyond item 1's length: ignored
    pairwise = torch.tensor([[-INF, 0.0], [0.0, -INF]], dtype=dtype)  # labels alternate
    lengths = torch.tensor([4, 3, 1])
    score, labels = _kernel(unary, pairwise, lengths)
    assert torch.equal(score, torch.tensor([-INF, 0.0, 0.0], dtype=dtype))
    assert torch.equal(labels, torch.tensor([[-1] * 4, [0, 1, 0, -1], [0, -1, -1, -1]]))
    _assert_same((score, labels), _reference(unary, pairwise, lengths))
    blocked = torch.full((2, 2), -INF, dtype=dtype)  # no transition at all
    _assert_same(_kernel(unary, blocked, lengths), _reference(unary, blocked, lengths))


def test_nan_as_torch_max() -> None:
    """NaN (only without validation): the first NaN wins every max, as in torch.max, so the
    kernel still follows the PyTorch path."""
    for seed in range(10):
        gen = torch.Generator().manual_seed(seed)
        unary, pairwise, lengths = _draw(4, 5, 3, seed % 2 == 0, torch.float64, seed)
        unary = unary.masked_fill(torch.rand(unary.shape, generator=gen) < 0.1, float("nan"))
        for lens in (None, lengths):
            _assert_same(_kernel(unary, pairwise, lens), _reference(unary, pairwise, lens))


def test_brute_force() -> None:
    """float64, N <= 4, C <= 3, variable lengths: the score is the best of all label
    sequences, and the labels are a sequence with that score."""
    for seed, (n, c) in enumerate(itertools.product((1, 2, 3, 4), (1, 2, 3))):
        unary, pairwise, lengths = _draw(3, n, c, False, torch.float64, seed)
        score, labels = _kernel(unary, pairwise, lengths)
        for b in range(3):
            length = int(lengths[b])
            scores = [
                oracles.chain_score(unary[b], pairwise[b], z) for z in oracles.chains(length, c)
            ]
            best = torch.stack(scores).max()
            torch.testing.assert_close(score[b], best, rtol=1e-12, atol=1e-12)
            z = tuple(int(x) for x in labels[b, :length])
            torch.testing.assert_close(oracles.chain_score(unary[b], pairwise[b], z), best)
            assert (labels[b, length:] == -1).all()


def test_views_and_sizes() -> None:
    """Strided transitions (a transposed shared matrix, an expanded per-step view, a slice),
    a non-contiguous unary, B = 1, N = 1, C = 1, an empty batch."""
    unary, pairwise, lengths = _draw(3, 5, 4, True, torch.float32, 3)
    transposed = pairwise.t()
    _assert_same(
        _kernel(unary, transposed, lengths), _reference(unary, transposed.contiguous(), lengths)
    )
    expanded = pairwise.expand(3, 4, 4, 4)
    _assert_same(_kernel(unary, expanded, lengths), _reference(unary, pairwise, lengths))
    per_step = torch.randn(3, 4, 6, 6)[:, :, 1:5, 1:5]
    _assert_same(_kernel(unary, per_step, lengths), _reference(unary, per_step, lengths))
    wide = torch.randn(3, 5, 8)[:, :, ::2]
    _assert_same(_kernel(wide, pairwise, lengths), _reference(wide, pairwise, lengths))
    one = torch.randn(1, 1, 1)
    score, labels = _kernel(one, torch.randn(1, 1), None)
    assert torch.equal(labels, torch.zeros(1, 1, dtype=torch.long))
    assert torch.equal(score, one.view(1))
    score, labels = _kernel(torch.randn(0, 3, 2), torch.randn(2, 2), None)
    assert score.shape == (0,) and labels.shape == (0, 3)


def test_not_served() -> None:
    """The PyTorch path runs where the kernel does not apply: kernels disabled, float16,
    mixed dtypes, meta tensors."""
    unary, pairwise, _ = _draw(2, 4, 3, True, torch.float32)
    with kernels_disabled():
        assert chain_argmax(unary, pairwise, None) is None
    assert chain_argmax(unary.half(), pairwise.half(), None) is None
    assert chain_argmax(unary, pairwise.double(), None) is None
    assert chain_argmax(unary.to("meta"), pairwise.to("meta"), None) is None


def test_bad_lengths_are_an_error() -> None:
    op = torch.ops.structattn_viterbi.viterbi
    with pytest.raises(RuntimeError, match="lengths"):
        op(torch.zeros(2, 3, 2), torch.zeros(2, 2), torch.tensor([2, 3]))


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-step"])
def test_distribution_argmax_and_max_score(shared: bool) -> None:
    """LinearChainCRF.argmax and max_score (start and end transitions folded in) are the
    same with the kernel and with the PyTorch path; without gradients max_score is the
    kernel's score."""
    unary, pairwise, lengths = _draw(6, 7, 5, shared, torch.float32, 11)
    start, end = torch.randn(5), torch.randn(6, 5)

    def crf() -> LinearChainCRF:
        return LinearChainCRF(
            unary, pairwise, lengths, start_transitions=start, end_transitions=end
        )

    served = crf()
    assert served._kernel_viterbi is not None
    with kernels_disabled():
        plain = crf()
        want_labels, want_score = plain.argmax, plain.max_score
    assert torch.equal(served.argmax, want_labels)
    torch.testing.assert_close(served.max_score, want_score)
    assert served.max_score is served._kernel_viterbi[0]


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-step"])
def test_max_score_gradient_is_the_map_indicators(shared: bool) -> None:
    """d max_score / d unary = one-hot of argmax at real positions; d / d pairwise = the
    best sequence's transitions (summed over positions for a shared matrix); 0 for an item
    with no valid sequence. The same with the kernel and with the PyTorch path."""
    unary, pairwise, lengths = _draw(5, 6, 4, shared, torch.float64, 5)
    unary[3, 1] = -INF  # item 3: no valid sequence
    grads = []
    for disabled in (False, True):
        u = unary.clone().requires_grad_()
        p = pairwise.clone().requires_grad_()
        with kernels_disabled() if disabled else torch.enable_grad():
            crf = LinearChainCRF(u, p, lengths)
            seed = torch.arange(1.0, 6.0, dtype=torch.float64)
            best = crf.max_score
            assert (crf._kernel_viterbi is None) == disabled
            finite = torch.where(torch.isfinite(best), best, torch.zeros_like(best))
            (finite * seed).sum().backward()
            labels = crf.argmax
        grads.append((u.grad, p.grad, best.detach(), labels))
    (g_unary, g_pair, best, labels), ref = grads
    for a, b in zip(grads[0], ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.isneginf(best[3]) and (labels[3] == -1).all()
    want_unary = torch.zeros_like(unary)
    want_pair = torch.zeros(5, 5, 4, 4, dtype=torch.float64)
    for b in range(5):
        length = int(lengths[b])
        if b == 3:
            continue
        for i in range(length):
            want_unary[b, i, labels[b, i]] = b + 1.0
        for i in range(length - 1):
            want_pair[b, i, labels[b, i], labels[b, i + 1]] = b + 1.0
    torch.testing.assert_close(g_unary, want_unary)
    torch.testing.assert_close(g_pair, want_pair.sum((0, 1)) if shared else want_pair)
