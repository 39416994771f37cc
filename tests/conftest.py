"""Test configuration: make ``tests/`` importable (for ``oracles``), fix seeds, and skip the
tests whose real data set is missing (``@pytest.mark.data``)."""

from __future__ import annotations

import os
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


# --- tests that need a real data set (#37) ----------------------------------------------------
# ``@pytest.mark.data("ptb", ...)`` names the data sets a test reads: the folders of
# ``../shared/data`` (see its README). Each is looked up through the library's own rule
# (``structattn.io.data_dir``); a missing one skips the test with a reason naming it, or
# fails it where STRUCTATTN_REQUIRE_DATA is set (``.ci/run`` sets it: CI runs every data test).

REQUIRE_DATA = "STRUCTATTN_REQUIRE_DATA"
DATA_SETS = frozenset(
    {"babi", "glove", "nltk_treebank_sample", "ptb", "sick", "small_parallel_enja",
     "snli_devtest", "sst", "ud_english_ewt", "wikitext-2"}
)  # fmt: skip


def require_data() -> bool:
    """Whether a missing data set fails a test instead of skipping it."""
    return os.environ.get(REQUIRE_DATA, "").strip().lower() not in ("", "0", "false", "no")


def missing_data(name: str) -> str | None:
    """``None`` where the data set ``name`` is found, else why not (the places tried)."""
    from structattn.io import data_dir, data_roots

    try:
        data_dir(name, what=f"data set {name!r}")
    except FileNotFoundError:
        tried = ", ".join(str(root.path / name) for root in data_roots())
        return (
            f"data set {name!r} not found (tried {tried}); put it under --data-dir / "
            f"STRUCTATTN_DATA (a folder {name}/ laid out as in ../shared/data)"
        )
    return None


_MISSING_DATA = pytest.StashKey[str]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each ``data`` mark names known data sets (a typo would skip a test for good). A test
    whose data set is missing gets a skip mark (reported at the test's own line), or, under
    STRUCTATTN_REQUIRE_DATA, fails at setup."""
    missing: dict[str, str | None] = {}
    for item in items:
        names: dict[str, None] = {}
        for mark in item.iter_markers(name="data"):
            unknown = [n for n in mark.args if n not in DATA_SETS]
            if not mark.args or unknown or mark.kwargs:
                raise pytest.UsageError(
                    f"{item.nodeid}: @pytest.mark.data takes names of {sorted(DATA_SETS)}, "
                    f"got {mark.args!r} {mark.kwargs or ''}"
                )
            names.update(dict.fromkeys(mark.args))
        for name in names:
            if name not in missing:
                missing[name] = missing_data(name)
        reasons = [r for r in (missing[n] for n in names) if r is not None]
        if not reasons:
            continue
        if require_data():
            item.stash[_MISSING_DATA] = f"{REQUIRE_DATA} is set and " + "; ".join(reasons)
        else:
            item.add_marker(pytest.mark.skip(reason="; ".join(reasons)))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under STRUCTATTN_REQUIRE_DATA, a test whose data set is missing is an error."""
    if _MISSING_DATA in item.stash:
        pytest.fail(item.stash[_MISSING_DATA], pytrace=False)
