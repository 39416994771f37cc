"""structattn.viz: every plot writes a valid PNG from real layer outputs; bad inputs raise
ValueError naming the argument; the spanning-tree helper matches brute force."""

from __future__ import annotations

import importlib
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from structattn import viz
from structattn.attention import (
    MeanFieldAttention,
    MemoryCRFAttention,
    MemoryCRFOutput,
    SegmentationAttention,
    SyntacticAttention,
)
from structattn.structs.stick_breaking import split_tree

pytest.importorskip("matplotlib")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _assert_png(path: Path) -> None:
    """A non-trivial PNG: signature bytes, > 1 KB, and an RGB(A) image matplotlib reads back."""
    from matplotlib.image import imread

    assert path.is_file()
    assert path.stat().st_size > 1024
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    assert image.shape[0] > 50 and image.shape[1] > 50


# ---- attention heatmap ------------------------------------------------------------------------
def test_attention_heatmap_from_segmentation_attention(tmp_path: Path) -> None:
    src, tgt = list("unidentified"), ["un", "identified", "</s>"]
    attn = SegmentationAttention(8)
    weights = attn(torch.randn(1, len(tgt), 8), torch.randn(1, len(src), 8)).weights[0]
    out = viz.attention_heatmap(weights, tgt, src, tmp_path / "sub" / "dir" / "h.png", title="t")
    assert out == tmp_path / "sub" / "dir" / "h.png"  # parent folders are created
    _assert_png(out)


def test_attention_heatmap_accepts_numpy_and_annotates(tmp_path: Path) -> None:
    weights = np.random.default_rng(0).dirichlet(np.ones(6), size=4)  # [4, 6]
    out = viz.attention_heatmap(weights, None, "a b c d e f".split(), tmp_path / "h", annotate=True)
    assert out.suffix == ""  # no suffix: PNG anyway
    _assert_png(out)


@pytest.mark.parametrize(
    ("rows", "cols", "name"),
    [(["a", "b"], ["x", "y", "z"], "row_labels"), (["a", "b", "c"], ["x", "y"], "col_labels")],
)
def test_attention_heatmap_rejects_label_mismatch(
    tmp_path: Path, rows: list[str], cols: list[str], name: str
) -> None:
    with pytest.raises(ValueError, match=f"`{name}`"):
        viz.attention_heatmap(torch.rand(3, 3), rows, cols, tmp_path / "h.png")


def test_attention_heatmap_rejects_bad_weights(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`weights`"):
        viz.attention_heatmap(torch.rand(2, 3, 4), None, None, tmp_path / "h.png")
    with pytest.raises(ValueError, match="`weights`"):
        viz.attention_heatmap(torch.tensor([[0.5, float("nan")]]), None, None, tmp_path / "h.png")


def test_output_format_from_suffix(tmp_path: Path) -> None:
    out = viz.attention_heatmap(torch.rand(2, 3), None, None, tmp_path / "h.svg")
    assert out.read_text().lstrip().startswith("<?xml")
    with pytest.raises(ValueError, match="`path`"):
        viz.attention_heatmap(torch.rand(2, 3), None, None, tmp_path / "h.notaformat")


# ---- dependency arcs --------------------------------------------------------------------------
def test_dependency_arcs_from_syntactic_attention_with_padding(tmp_path: Path) -> None:
    words = "The men are fighting".split()
    attn = SyntacticAttention(8, hidden_dim=4)  # ROOT prepended: outputs have N + 1 positions
    mask = torch.tensor([[True] * 4 + [False] * 2])  # two padding positions
    x = torch.randn(1, 6, 8)
    heads = attn.parse(x, mask)[0]  # [7]: -1 at ROOT and at the two padding positions
    marginals = attn(x, mask).marginals[0]  # [7, 7]
    assert heads.tolist()[0] == -1 and heads.tolist()[-2:] == [-1, -1]
    tokens = ["<root>", *words]
    out = viz.dependency_arcs(heads, tokens, tmp_path / "arcs.png", marginals=marginals)
    _assert_png(out)
    # tokens and marginals may also cover the padding positions
    padded = [*tokens, "<pad>", "<pad>"]
    _assert_png(viz.dependency_arcs(heads, padded, tmp_path / "arcs2.png", marginals[:5, :5]))
    _assert_png(viz.dependency_arcs(heads.tolist(), padded, tmp_path / "plain.png", title="MAP"))


@pytest.mark.parametrize(
    ("heads", "message"),
    [
        ([-1, 0, 5, 1], "out of range"),  # head 5 with 3 words
        ([-1, 0, -2, 1], "out of range"),
        ([-1, 0, 2, 1], "own head"),
        ([0, -1, 0, 1], "heads\\[0\\]"),
        ([-1, 0, -1, 1], "padding"),  # -1 before the last word
        ([-1, -1, -1], "no word"),
        ([-1.0, 0.0], "integers"),
    ],
)
def test_dependency_arcs_rejects_bad_heads(
    tmp_path: Path, heads: list[float], message: str
) -> None:
    tokens = ["$", "a", "b", "c"][: len(heads)]
    with pytest.raises(ValueError, match=message) as info:
        viz.dependency_arcs(heads, tokens, tmp_path / "arcs.png")
    assert "`heads" in str(info.value)


def test_dependency_arcs_rejects_bad_tokens_and_marginals(tmp_path: Path) -> None:
    heads = [-1, 0, 1, -1]  # two words and one padding position
    with pytest.raises(ValueError, match="`tokens`"):
        viz.dependency_arcs(heads, ["$", "a"], tmp_path / "arcs.png")
    with pytest.raises(ValueError, match="`marginals`"):
        viz.dependency_arcs(heads, ["$", "a", "b"], tmp_path / "arcs.png", torch.rand(2, 2))


# ---- fact chains (memory CRF) -----------------------------------------------------------------
def _memory_crf_example() -> tuple[MemoryCRFAttention, MemoryCRFOutput, dict[str, torch.Tensor]]:
    attn = MemoryCRFAttention(8, steps=3)
    query, keys = torch.randn(1, 8), torch.randn(1, 7, 8)
    mask = torch.tensor([[True] * 5 + [False] * 2])  # 5 facts, 2 padding
    return attn, attn(query, keys, keys, mask), {"query": query, "keys": keys, "mask": mask}


def test_fact_chain_graph_from_memory_crf(tmp_path: Path) -> None:
    attn, out, inputs = _memory_crf_example()
    probs, sequences = attn.topk(inputs["query"], inputs["keys"], 3, inputs["mask"])
    top = list(zip(sequences[:, 0].tolist(), probs[:, 0].tolist(), strict=True))
    facts = [f"fact number {i}" for i in range(5)] + ["<pad>", "<pad>"]
    path = viz.fact_chain_graph(
        out.marginals[0],
        out.edge_marginals[0],
        tmp_path / "facts.png",
        fact_labels=facts,
        top_sequences=top,
        question="Where is Mary?",
        answer="garden",
        title="memory CRF",
    )
    _assert_png(path)
    bare = viz.fact_chain_graph(out.marginals[0], out.edge_marginals[0], tmp_path / "bare.png")
    _assert_png(bare)


def test_fact_chain_graph_skips_missing_kbest_entries(tmp_path: Path) -> None:
    # MemoryCRFAttention.topk pads missing k-best entries with indices -1 and probability 0
    marginals, edges = torch.full((2, 3), 1 / 3), torch.full((1, 3, 3), 1 / 9)
    top = [([0, 1], 0.2), ([-1, -1], 0.0)]
    _assert_png(viz.fact_chain_graph(marginals, edges, tmp_path / "f.png", top_sequences=top))


def test_fact_chain_graph_rejects_inconsistent_inputs(tmp_path: Path) -> None:
    _, out, _ = _memory_crf_example()
    node, edge = out.marginals[0], out.edge_marginals[0]  # [3, 7], [2, 7, 7]
    path = tmp_path / "f.png"
    with pytest.raises(ValueError, match="`edge_marginals`"):
        viz.fact_chain_graph(node, edge[:1], path)
    with pytest.raises(ValueError, match="`fact_labels`"):
        viz.fact_chain_graph(node, edge, path, fact_labels=["a", "b"])
    with pytest.raises(ValueError, match="`top_sequences\\[0\\]`"):
        viz.fact_chain_graph(node, edge, path, top_sequences=[([0, 1], 0.5)])  # K = 3
    with pytest.raises(ValueError, match="`top_sequences\\[1\\]`"):
        viz.fact_chain_graph(node, edge, path, top_sequences=[([0, 1, 2], 0.5), ([0, 9, 1], 0.1)])
    with pytest.raises(ValueError, match="`marginals`"):
        viz.fact_chain_graph(node + 2, edge, path)


# ---- bracketed trees --------------------------------------------------------------------------
def test_bracketed_tree_from_split_tree(tmp_path: Path) -> None:
    words = "the cat sat on the mat".split()
    distances = torch.rand(len(words))
    _assert_png(viz.bracketed_tree(split_tree(distances, tokens=words), tmp_path / "t1.png"))
    # positions as leaves, words given separately
    tree = split_tree(distances)
    _assert_png(viz.bracketed_tree(tree, tmp_path / "t2.png", tokens=words, title="PRPN"))
    _assert_png(viz.bracketed_tree("alone", tmp_path / "t3.png"))  # a single leaf


def test_bracketed_tree_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`tree`"):
        viz.bracketed_tree(("a", "b", "c"), tmp_path / "t.png")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`tokens`"):
        viz.bracketed_tree((0, (1, 2)), tmp_path / "t.png", tokens=["a", "b"])


# ---- interaction maps and spanning trees ------------------------------------------------------
def test_interaction_map_from_mean_field_attention(tmp_path: Path) -> None:
    attn = MeanFieldAttention(8, hidden_dim=8)
    out = attn(torch.randn(1, 5, 8), torch.randn(1, 5, 8))
    J = out.interactions[0, 4]  # [5, 5], the last output step
    labels = ["2", "9", "11", "1", "17"]
    _assert_png(viz.interaction_map(J, labels, tmp_path / "j.png", title="sorting"))
    _assert_png(viz.interaction_map(J, None, tmp_path / "j2.png", spanning_tree=False))
    _assert_png(viz.interaction_map(torch.zeros(1, 1), ["x"], tmp_path / "j3.png"))  # N = 1
    repeated = ["the", "cat", "the", "dog", "the"]  # nodes named apart by position
    _assert_png(viz.interaction_map(J.detach().numpy(), repeated, tmp_path / "j4.png"))


def test_interaction_map_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`J`"):
        viz.interaction_map(torch.rand(3, 4), None, tmp_path / "j.png")
    with pytest.raises(ValueError, match="`labels`"):
        viz.interaction_map(torch.rand(3, 3), ["a", "b"], tmp_path / "j.png")


def _find(parent: list[int], i: int) -> int:
    while parent[i] != i:
        i = parent[i]
    return i


def _brute_force_best_total(weights: np.ndarray) -> float:
    """Largest total weight over every spanning tree of the complete graph."""
    n = weights.shape[0]
    pairs = list(itertools.combinations(range(n), 2))
    best = -np.inf
    for edges in itertools.combinations(pairs, n - 1):
        parent = list(range(n))
        acyclic = True
        for i, j in edges:
            ri, rj = _find(parent, i), _find(parent, j)
            if ri == rj:
                acyclic = False
                break
            parent[ri] = rj
        if acyclic:  # n - 1 edges without a cycle: a spanning tree
            best = max(best, sum(weights[i, j] for i, j in edges))
    return float(best)


def _is_spanning_tree(edges: list[tuple[int, int]], n: int) -> bool:
    seen, frontier = {0}, [0]
    while frontier:
        node = frontier.pop()
        for i, j in edges:
            for a, b in ((i, j), (j, i)):
                if a == node and b not in seen:
                    seen.add(b)
                    frontier.append(b)
    return len(edges) == n - 1 and seen == set(range(n))


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_maximum_spanning_tree_matches_brute_force(n: int) -> None:
    rng = np.random.default_rng(n)
    for _ in range(10):
        J = rng.normal(size=(n, n))
        J = (J + J.T) / 2
        weights = np.abs(J)
        edges = viz.maximum_spanning_tree(weights)
        assert _is_spanning_tree(edges, n)
        assert all(i < j for i, j in edges)
        total = sum(weights[i, j] for i, j in edges)
        assert total == pytest.approx(_brute_force_best_total(weights))


def test_maximum_spanning_tree_hand_example() -> None:
    # Kruskal by hand: 0-1 (5), 2-3 (4), then 0-2 (3.5) joins the two pieces; 1-2 (3) and
    # 1-3 (1) would close cycles. Best total 12.5 (a path 1-0-2-3 beats the star at 2).
    W = torch.zeros(4, 4)
    for (i, j), w in {(0, 1): 5.0, (2, 3): 4.0, (0, 2): 3.5, (1, 2): 3.0, (1, 3): 1.0}.items():
        W[i, j] = W[j, i] = w
    assert viz.maximum_spanning_tree(W) == [(0, 1), (0, 2), (2, 3)]
    assert viz.maximum_spanning_tree([[0.0]]) == []
    with pytest.raises(ValueError, match="`weights`"):
        viz.maximum_spanning_tree(torch.rand(2, 3))


# ---- optional dependency ----------------------------------------------------------------------
def test_viz_imports_without_matplotlib_and_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    try:
        module = importlib.reload(viz)  # the module itself must not need matplotlib
        assert module.maximum_spanning_tree([[0, 1], [1, 0]]) == [(0, 1)]
        with pytest.raises(ImportError, match="pip install matplotlib"):
            module.attention_heatmap(torch.rand(2, 2), None, None, tmp_path / "h.png")
    finally:
        monkeypatch.undo()
        importlib.reload(viz)


def test_plots_leave_no_pyplot_figure_open(tmp_path: Path) -> None:
    import matplotlib
    import matplotlib.pyplot as plt

    backend, before = matplotlib.get_backend(), plt.get_fignums()
    viz.attention_heatmap(torch.rand(2, 2), None, None, tmp_path / "h.png")
    viz.bracketed_tree((0, 1), tmp_path / "t.png")
    assert plt.get_fignums() == before
    assert matplotlib.get_backend() == backend  # the caller's backend is untouched


def test_grouped_bars(tmp_path: Path) -> None:
    ours = {"A": [10.0, None, 30.0], "B": [5.0, 50.0, 95.0]}
    paper = {"A": [12.0, 40.0, None], "B": [None, 45.0, 99.0]}
    path = viz.grouped_bars(["t1", "t2", "t3"], ours, tmp_path / "bars.png", reference=paper)
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="'B' has 2 values for 3 groups"):
        viz.grouped_bars(["t1", "t2", "t3"], {"A": [1, 2, 3], "B": [1, 2]}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="at least one model"):
        viz.grouped_bars(["t1"], {}, tmp_path / "x.png")
