"""Test configuration: make ``tests/`` importable (for ``oracles``) and fix seeds."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _seed_and_one_thread() -> Iterator[None]:
    """Fixed seed; one intra-op thread (tests use tiny tensors, where extra threads only add
    synchronisation cost: about 10x slower on a busy 2-core machine)."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def built_kernels() -> None:
    """Skip the test where the C++ kernels are not built (never under make test, which sets
    STRUCTATTN_EXTENSION=require)."""
    from structattn.structs._extension import kernels

    if kernels(torch.zeros(1, 2, 2)) is None:
        pytest.skip("the C++ kernels are not built on this machine")


@pytest.fixture
def small_chunks(built_kernels: None) -> Iterator[None]:
    """Let the kernels split even tiny batches over the threads (below a work threshold they
    run one chunk), so that the tests' small problems also cover the multi-chunk code."""
    from structattn.structs._extension import kernels

    module = kernels(torch.zeros(1, 2, 2))
    before = module.set_parallel_work(0.0)
    try:
        yield
    finally:
        module.set_parallel_work(before)


@pytest.fixture(params=["kernels", "pytorch"])
def kernel_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test with the C++ kernels (skipped where they are not built), then with the
    PyTorch code."""
    from structattn.structs._extension import kernels_disabled

    if request.param == "pytorch":
        with kernels_disabled():
            yield "pytorch"
        return
    request.getfixturevalue("built_kernels")
    yield "kernels"
