"""Bad inputs give one ``ValueError`` naming the argument or the file, on every code path
(issue 37.3.11: these raised raw torch errors or were accepted)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from structattn.attention import MemoryCRFAttention, SyntacticAttention
from structattn.data.babi import read_babi
from structattn.structs._extension import kernels_disabled
from structattn.structs.mean_field import mean_field_marginals


def test_mean_field_mixed_dtypes_and_no_positions() -> None:
    with pytest.raises(ValueError, match="`pairwise` must have the dtype of `unary`"):
        mean_field_marginals(torch.randn(2, 4), torch.randn(2, 4, 4, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="`unary` must have at least one position"):
        mean_field_marginals(torch.randn(2, 0), torch.randn(2, 0, 0), 2)


def test_syntactic_attention_wrong_feature_size() -> None:
    with pytest.raises(ValueError, match=r"`x` must have 8 features \(input_dim\)"):
        SyntacticAttention(8)(torch.randn(2, 5, 6))


@pytest.mark.parametrize("kernels", [True, False])
def test_memory_crf_attention_without_facts(kernels: bool) -> None:
    layer = MemoryCRFAttention(8, 3)
    query, empty = torch.randn(2, 8), torch.randn(2, 0, 8)
    with pytest.raises(ValueError, match="`keys` must hold at least one memory fact"):
        if kernels:
            layer(query, empty, empty)
        else:
            with kernels_disabled():
                layer(query, empty, empty)


def test_a_nul_byte_in_a_babi_file(tmp_path: Path) -> None:
    path = tmp_path / "qa1_single-supporting-fact_train.txt"
    path.write_bytes(b"1 Mary moved to the bathroom.\n2 John went\x00 to the hallway.\n")
    with pytest.raises(ValueError, match=rf"^{path}:2: a NUL byte"):
        read_babi(path)


def test_an_empty_split_is_refused(tmp_path: Path) -> None:
    """An empty valid.tsv made tree transduction report a validation perplexity of 1.0
    (issue 37.3.9)."""
    from structattn.data.tree_transduction import read_splits

    for name in ("train", "valid", "test"):
        (tmp_path / f"{name}.tsv").write_text("( + 1 2 )\t1 + 2\n")
    assert len(read_splits(tmp_path)["valid"]) == 1
    (tmp_path / "valid.tsv").write_text("")
    with pytest.raises(ValueError, match=r"valid\.tsv: empty file"):
        read_splits(tmp_path)


@pytest.mark.parametrize("structure", ["projective", "non-projective", "softmax"])
@pytest.mark.parametrize("junk", [float("nan"), float("inf"), 1e30])
def test_syntactic_attention_padding_is_inert(structure: str, junk: float) -> None:
    """NaN / inf at padded positions reached real ones through ``0 * NaN`` in the parent
    sum (issue 37.3.10): the padded item now equals the item alone."""
    torch.manual_seed(0)
    layer = SyntacticAttention(8, structure=structure, children=True).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    x[1, 3:] = junk
    out = layer(x, mask)
    alone = layer(x[1:, :3])
    torch.testing.assert_close(out.parents[1, :3], alone.parents[0])
    assert out.children is not None and alone.children is not None
    torch.testing.assert_close(out.children[1, :3], alone.children[0])
    torch.testing.assert_close(out.marginals[1, :4, :4], alone.marginals[0])


def test_split_tree_brackets_and_spans_of_a_very_long_sentence() -> None:
    """A 1,000-word sentence with rising distances is a 1,000-deep tree: ``parse prpn`` hit a
    RecursionError in ``split_tree`` (issue 37.3.11); the tree walks use explicit stacks."""
    from structattn.trees import split_tree, tree_spans, tree_to_brackets

    n = 3000
    for attach in ("right", "left"):
        tree = split_tree(list(range(n)), attach=attach)  # [0, 1, ..., n-1]: a chain
        spans = tree_spans(tree, include_leaves=True, include_root=True)
        assert len(spans) == 2 * n - 1 and (0, n) in spans
        brackets = tree_to_brackets(tree)
        assert brackets.count("(") == n - 1 and brackets.split()[-1].rstrip(")") == str(n - 1)


def _reference_split(values: list[float], lo: int, hi: int, attach: str):  # type: ignore[no-untyped-def]
    """The recursive SPLIT of the notes (the definition the iterative one must equal)."""
    if lo >= hi:
        return None
    if hi - lo == 1:
        return lo
    i = max(range(lo, hi), key=lambda k: (values[k], -k))
    left, right = (
        _reference_split(values, lo, i, attach),
        _reference_split(values, i + 1, hi, attach),
    )

    def join(a, b):  # type: ignore[no-untyped-def]
        return b if a is None else a if b is None else (a, b)

    return join(left, join(i, right)) if attach == "right" else join(join(left, i), right)


def test_iterative_tree_walks_equal_the_recursive_definitions() -> None:
    import random

    from structattn.trees import split_tree, tree_spans, tree_to_brackets

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 12)
        values = [float(rng.randint(0, 4)) for _ in range(n)]  # ties too
        for attach in ("right", "left"):
            tree = split_tree(values, attach=attach)
            assert tree == _reference_split(values, 0, n, attach)
            text = str(tree).replace(",", "").replace("'", "")
            assert tree_to_brackets(tree) == text
            spans = tree_spans(tree, include_leaves=True, include_root=True)
            assert len(spans) == 2 * n - 1
