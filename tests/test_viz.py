"""structattn.viz: every plot writes a valid PNG from real layer outputs; bad inputs raise
ValueError naming the argument; training curves read metrics.jsonl as the training loop
writes it; the spanning-tree algorithm matches brute force; matplotlib stays optional."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from structattn.structs.nonprojective import chu_liu_edmonds
from structattn.structs.spanning_tree import maximum_spanning_tree
from structattn.training import Task, TrainConfig, fit
from structattn.trees import split_tree

# the plots need matplotlib; the spanning tree and the import checks do not
needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason='needs pip install "structattn[viz]"'
)

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
@needs_matplotlib
def test_attention_heatmap_from_segmentation_attention(tmp_path: Path) -> None:
    src, tgt = list("unidentified"), ["un", "identified", "</s>"]
    attn = SegmentationAttention(8)
    weights = attn(torch.randn(1, len(tgt), 8), torch.randn(1, len(src), 8)).weights[0]
    out = viz.attention_heatmap(weights, tgt, src, tmp_path / "sub" / "dir" / "h.png", title="t")
    assert out == tmp_path / "sub" / "dir" / "h.png"  # parent folders are created
    _assert_png(out)


@needs_matplotlib
def test_attention_heatmap_accepts_numpy_and_annotates(tmp_path: Path) -> None:
    weights = np.random.default_rng(0).dirichlet(np.ones(6), size=4)  # [4, 6]
    out = viz.attention_heatmap(weights, None, "a b c d e f".split(), tmp_path / "h", annotate=True)
    assert out.suffix == ""  # no suffix: PNG anyway
    _assert_png(out)


@needs_matplotlib
@pytest.mark.parametrize(
    ("rows", "cols", "name"),
    [(["a", "b"], ["x", "y", "z"], "row_labels"), (["a", "b", "c"], ["x", "y"], "col_labels")],
)
def test_attention_heatmap_rejects_label_mismatch(
    tmp_path: Path, rows: list[str], cols: list[str], name: str
) -> None:
    with pytest.raises(ValueError, match=f"`{name}`"):
        viz.attention_heatmap(torch.rand(3, 3), rows, cols, tmp_path / "h.png")


@needs_matplotlib
def test_attention_heatmap_rejects_bad_weights(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`weights`"):
        viz.attention_heatmap(torch.rand(2, 3, 4), None, None, tmp_path / "h.png")
    with pytest.raises(ValueError, match="`weights`"):
        viz.attention_heatmap(torch.tensor([[0.5, float("nan")]]), None, None, tmp_path / "h.png")


@needs_matplotlib
def test_output_format_from_suffix(tmp_path: Path) -> None:
    out = viz.attention_heatmap(torch.rand(2, 3), None, None, tmp_path / "h.svg")
    assert out.read_text().lstrip().startswith("<?xml")
    with pytest.raises(ValueError, match="`path`"):
        viz.attention_heatmap(torch.rand(2, 3), None, None, tmp_path / "h.notaformat")


# ---- dependency arcs --------------------------------------------------------------------------
@needs_matplotlib
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


@needs_matplotlib
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


@needs_matplotlib
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


@needs_matplotlib
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


@needs_matplotlib
def test_fact_chain_graph_skips_missing_kbest_entries(tmp_path: Path) -> None:
    # MemoryCRFAttention.topk pads missing k-best entries with indices -1 and probability 0
    marginals, edges = torch.full((2, 3), 1 / 3), torch.full((1, 3, 3), 1 / 9)
    top = [([0, 1], 0.2), ([-1, -1], 0.0)]
    _assert_png(viz.fact_chain_graph(marginals, edges, tmp_path / "f.png", top_sequences=top))


@needs_matplotlib
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
@needs_matplotlib
def test_bracketed_tree_from_split_tree(tmp_path: Path) -> None:
    words = "the cat sat on the mat".split()
    distances = torch.rand(len(words))
    _assert_png(viz.bracketed_tree(split_tree(distances, tokens=words), tmp_path / "t1.png"))
    # positions as leaves, words given separately
    tree = split_tree(distances)
    _assert_png(viz.bracketed_tree(tree, tmp_path / "t2.png", tokens=words, title="PRPN"))
    _assert_png(viz.bracketed_tree("alone", tmp_path / "t3.png"))  # a single leaf


@needs_matplotlib
def test_bracketed_tree_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`tree`"):
        viz.bracketed_tree(("a", "b", "c"), tmp_path / "t.png")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`tokens`"):
        viz.bracketed_tree((0, (1, 2)), tmp_path / "t.png", tokens=["a", "b"])


# ---- interaction maps ------------------------------------------------------------------------
@needs_matplotlib
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


@needs_matplotlib
def test_interaction_map_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`J`"):
        viz.interaction_map(torch.rand(3, 4), None, tmp_path / "j.png")
    with pytest.raises(ValueError, match="`labels`"):
        viz.interaction_map(torch.rand(3, 3), ["a", "b"], tmp_path / "j.png")


# ---- the spanning tree (structs.spanning_tree, re-exported by viz) ----------------------------
def _find(parent: list[int], i: int) -> int:
    while parent[i] != i:
        i = parent[i]
    return i


def _brute_force_best(weights: np.ndarray) -> tuple[float, list[list[tuple[int, int]]]]:
    """Largest total weight over every spanning tree of the complete graph, and the trees
    that reach it (within 1e-12)."""
    n = weights.shape[0]
    pairs = list(itertools.combinations(range(n), 2))
    trees = []
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
            trees.append((float(sum(weights[i, j] for i, j in edges)), list(edges)))
    best = max(total for total, _ in trees)
    return best, [edges for total, edges in trees if total >= best - 1e-12]


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


def test_viz_reexports_the_structs_spanning_tree() -> None:
    assert viz.maximum_spanning_tree is maximum_spanning_tree


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("kind", ["abs", "signed", "asymmetric"])
def test_maximum_spanning_tree_matches_brute_force(n: int, kind: str) -> None:
    rng = np.random.default_rng(10 * n + len(kind))
    for _ in range(8):
        W = rng.normal(size=(n, n))
        if kind == "abs":  # |J| of a symmetric J, as interaction_map passes it
            W = np.abs((W + W.T) / 2)
        elif kind == "signed":  # any sign is allowed
            W = (W + W.T) / 2
        edges = maximum_spanning_tree(torch.from_numpy(W))  # "asymmetric": read as (W + W^T)/2
        symmetric = (W + W.T) / 2
        best, optima = _brute_force_best(symmetric)
        assert _is_spanning_tree(edges, n)
        assert edges == sorted(edges) and all(i < j for i, j in edges)
        assert sum(symmetric[i, j] for i, j in edges) == pytest.approx(best, abs=1e-12)
        assert edges in optima  # continuous random weights: the optimum is unique a.s.


@pytest.mark.parametrize("n", [7, 12, 25])
def test_maximum_spanning_tree_matches_chu_liu_edmonds(n: int) -> None:
    # too many trees to enumerate: compare with the maximum arborescence under node 0, which
    # has the same total for symmetric weights (orient the tree away from node 0)
    rng = np.random.default_rng(n)
    for _ in range(3):
        W = np.abs(rng.normal(size=(n, n)))
        W = (W + W.T) / 2
        edges = maximum_spanning_tree(W)
        heads = chu_liu_edmonds(torch.from_numpy(W)[None])[0].tolist()  # [N], -1 at node 0
        assert _is_spanning_tree(edges, n)
        assert sorted((min(h, m), max(h, m)) for m, h in enumerate(heads) if m) == edges


def test_maximum_spanning_tree_hand_example_ties_and_errors() -> None:
    # Kruskal by hand: 0-1 (5), 2-3 (4), then 0-2 (3.5) joins the two pieces; 1-2 (3) and
    # 1-3 (1) would close cycles. Best total 12.5 (a path 1-0-2-3 beats the star at 2).
    W = torch.zeros(4, 4)
    for (i, j), w in {(0, 1): 5.0, (2, 3): 4.0, (0, 2): 3.5, (1, 2): 3.0, (1, 3): 1.0}.items():
        W[i, j] = W[j, i] = w
    assert maximum_spanning_tree(W) == [(0, 1), (0, 2), (2, 3)]
    assert maximum_spanning_tree(W.numpy()) == maximum_spanning_tree(W.tolist())
    assert maximum_spanning_tree([[0.0]]) == []
    assert maximum_spanning_tree(torch.zeros(4, 4)) == [(0, 1), (0, 2), (0, 3)]  # ties: low index
    for bad in (torch.rand(2, 3), torch.rand(2, 2, 2), [], [[0.0, float("inf")], [0.0, 0.0]]):
        with pytest.raises(ValueError, match="`weights`"):
            maximum_spanning_tree(bad)
    not_numbers: Any = [[0, "a"], [1, 0]]
    with pytest.raises(ValueError, match="`weights`"):
        viz.maximum_spanning_tree(not_numbers)


# ---- optional dependency ----------------------------------------------------------------------
def test_import_does_not_load_matplotlib_and_plots_name_the_extra(tmp_path: Path) -> None:
    # a fresh interpreter: importing structattn.viz must not import matplotlib; once
    # matplotlib cannot be imported, the spanning tree still works and every entry point that
    # draws raises the same one-line ImportError naming the extra
    script = textwrap.dedent(
        """
        import sys

        import structattn.viz as viz

        assert "matplotlib" not in sys.modules, "import structattn.viz imported matplotlib"
        sys.modules["matplotlib"] = None  # from here on, `import matplotlib` fails
        assert viz.maximum_spanning_tree([[0, 1], [1, 0]]) == [(0, 1)]
        for call in (
            viz.require_matplotlib,
            lambda: viz.attention_heatmap([[1.0]], None, None, "h.png"),
        ):
            try:
                call()
            except ImportError as err:
                print(err)
            else:
                raise AssertionError("no ImportError")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    message = 'structattn.viz needs matplotlib to draw plots: pip install "structattn[viz]"'
    assert done.stdout.splitlines() == [message, message]
    assert not list(tmp_path.iterdir())  # nothing written


def _some_run(tmp_path: Path) -> Path:
    return _write_metrics(tmp_path / "run", _records(epochs=2, steps_per_epoch=3))


_DRAWING_CALLS: dict[str, Callable[[Path], Any]] = {
    "attention_heatmap": lambda d: viz.attention_heatmap([[1.0]], None, None, d / "x.png"),
    "attention_panels": lambda d: viz.attention_panels([("a", [[1.0]], ["r"])], None, d / "x"),
    "dependency_arcs": lambda d: viz.dependency_arcs([-1, 0], ["$", "a"], d / "x.png"),
    "fact_chain_graph": lambda d: viz.fact_chain_graph([[1.0]], np.zeros((0, 1, 1)), d / "x"),
    "bracketed_tree": lambda d: viz.bracketed_tree((0, 1), d / "x.png"),
    "interaction_map": lambda d: viz.interaction_map([[0.0]], None, d / "x.png"),
    "depth_curves": lambda d: viz.depth_curves({"a": {1: 50.0}}, d / "x.png"),
    "grouped_bars": lambda d: viz.grouped_bars(["t"], {"a": [1.0]}, d / "x.png"),
    "line_curves": lambda d: viz.line_curves({"a": {1: 1.0}}, d / "x.png", "x", "y"),
    "training_curves": lambda d: viz.training_curves(_some_run(d), d / "x.png"),
    "require_matplotlib": lambda d: viz.require_matplotlib(),
    "mean_field_figures": lambda d: viz.mean_field_figures(
        [[1.0]], ["q"], ["a"], d, "t", title="t", name="n", short_name="s"
    ),
    "translation_figures": lambda d: viz.translation_figures([("a", [[1.0]], ["r"])], None, d),
}


def test_every_public_function_is_covered_by_the_import_error_test() -> None:
    assert set(viz.__all__) == {*_DRAWING_CALLS, "maximum_spanning_tree"}
    assert all(callable(getattr(viz, name)) for name in viz.__all__)


@pytest.mark.parametrize("name", sorted(_DRAWING_CALLS))
def test_every_plot_without_matplotlib_names_the_extra(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(
        ImportError, match=r'^structattn\.viz needs matplotlib .*"structattn\[viz\]"$'
    ):
        _DRAWING_CALLS[name](tmp_path)
    assert not list(tmp_path.glob("x*"))


@needs_matplotlib
def test_require_matplotlib_rejects_an_old_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib

    viz.require_matplotlib()  # the installed one is recent enough
    monkeypatch.setattr(matplotlib, "__version__", "3.4.3")
    with pytest.raises(ImportError, match=r'>= 3\.5 .*found 3\.4\.3: pip install -U "structattn'):
        viz.require_matplotlib()


@needs_matplotlib
def test_plots_leave_no_pyplot_figure_open(tmp_path: Path) -> None:
    import matplotlib
    import matplotlib.pyplot as plt

    backend, before = matplotlib.get_backend(), plt.get_fignums()
    viz.attention_heatmap(torch.rand(2, 2), None, None, tmp_path / "h.png")
    viz.bracketed_tree((0, 1), tmp_path / "t.png")
    assert plt.get_fignums() == before
    assert matplotlib.get_backend() == backend  # the caller's backend is untouched


def test_bar_axis_fits_values_above_100() -> None:
    """Percentages keep the 0-100 axis; perplexities (and ticks above the bars) fit."""
    from structattn.viz.results import bar_axis_top

    assert bar_axis_top([[50.0, None], [99.0]], "%") == 100.0
    assert bar_axis_top([[311.0, 170.4], [129.0]], "perplexity") == pytest.approx(342.1)
    assert bar_axis_top([[12.0], [14.6]], "BLEU") == pytest.approx(16.06)
    assert bar_axis_top([[None]], "%") == 100.0
    assert bar_axis_top([[97.9], [30.0]], "Ans %") == 100.0  # the recipes' labels


@needs_matplotlib
def test_grouped_bars(tmp_path: Path) -> None:
    ours = {"A": [10.0, None, 30.0], "B": [5.0, 50.0, 95.0]}
    paper = {"A": [12.0, 40.0, None], "B": [None, 45.0, 99.0]}
    path = viz.grouped_bars(["t1", "t2", "t3"], ours, tmp_path / "bars.png", reference=paper)
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="'B' has 2 values for 3 groups"):
        viz.grouped_bars(["t1", "t2", "t3"], {"A": [1, 2, 3], "B": [1, 2]}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="at least one model"):
        viz.grouped_bars(["t1"], {}, tmp_path / "x.png")


@needs_matplotlib
def test_depth_curves(tmp_path: Path) -> None:
    ours = {"softmax": {1: 90.0, 2: 70.0, 3: 40.0}, "tree": {1: 95.0, 2: 85.0, 3: 60.0}}
    paper = {"tree": {1: 99.0, 2: 90.0}}
    _assert_png(viz.depth_curves(ours, tmp_path / "depth.png", reference=paper, title="T1"))
    with pytest.raises(ValueError, match="at least one model"):
        viz.depth_curves({}, tmp_path / "x.png")


# ---- training curves from metrics.jsonl -------------------------------------------------------
def _records(
    epochs: int, steps_per_epoch: int, lr: float = 1.0, valid: bool = True
) -> list[dict[str, Any]]:
    """Records as structattn.training.fit logs them (log_every = 1, lr halved every epoch)."""
    records: list[dict[str, Any]] = []
    step = 0
    for epoch in range(1, epochs + 1):
        for _ in range(steps_per_epoch):
            step += 1
            records.append(
                {"kind": "train", "epoch": epoch, "step": step, "loss": 3.0 / step, "lr": lr}
                | {"tokens_per_s": 1000.0}
            )
        epoch_record = {"kind": "epoch", "epoch": epoch, "step": step, "train_loss": 2.0 / epoch}
        epoch_record |= {"lr": lr, "time": 0.5 * epoch}
        if valid:
            epoch_record |= {"valid_metric": 50.0 + epoch, "valid_accuracy": 0.5 + epoch / 10}
        records.append(epoch_record)
        lr /= 2
    return records


def _write_metrics(run_dir: Path, records: list[dict[str, Any]], tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(record) + "\n" for record in records) + tail
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


class _Drawn:
    """What the figures that training_curves saved show: per figure, {panel's y label:
    (lines drawn, y scale)}, {panel's y label: x label} and the runs' legend labels."""

    def __init__(self) -> None:
        self.panels: list[dict[str, tuple[int, str]]] = []
        self.xlabels: list[dict[str, str]] = []
        self.runs: list[list[str]] = []


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> _Drawn:
    from structattn.viz import results

    seen = _Drawn()
    save = results._save

    def spy(fig: Any, out: Path, fmt: str) -> Path:
        panels = [ax for ax in fig.axes if ax.get_ylabel()]  # the legend row has no y label
        seen.panels.append(
            {ax.get_ylabel(): (len(ax.get_lines()), ax.get_yscale()) for ax in panels}
        )
        seen.xlabels.append({ax.get_ylabel(): ax.get_xlabel() for ax in panels})
        legends = [ax.get_legend() for ax in fig.axes if not ax.get_ylabel()]
        seen.runs.append([text.get_text() for text in legends[0].get_texts()])
        return save(fig, out, fmt)

    monkeypatch.setattr(results, "_save", spy)
    return seen


@needs_matplotlib
def test_training_curves_overlay_runs(tmp_path: Path, drawn: _Drawn) -> None:
    a = _write_metrics(tmp_path / "a" / "seed0", _records(epochs=3, steps_per_epoch=4))
    b = _write_metrics(tmp_path / "b" / "seed0", _records(epochs=2, steps_per_epoch=5, lr=0.1))
    c = _write_metrics(tmp_path / "c", _records(epochs=2, steps_per_epoch=2, valid=False))
    out = viz.training_curves([a, b, c / "metrics.jsonl"], tmp_path / "out" / "curves.png")
    assert out == tmp_path / "out" / "curves.png"
    _assert_png(out)
    # per run: logged steps + epoch means on the loss panel; lr halved 3x: log scale; the
    # validation panels have lines for a and b only (c did not validate)
    assert drawn.panels[-1] == {
        "train loss": (6, "linear"),
        "learning rate": (3, "log"),
        "validation metric": (2, "linear"),
        "validation accuracy": (2, "linear"),
    }
    # labelled by directory name, by the path as given where two names coincide
    assert drawn.runs[-1] == [str(a), str(b), "c"]
    # labels, a chosen metric (with or without the prefix), another format
    svg = viz.training_curves(
        {"lr 1": a, "lr 0.1": b}, tmp_path / "c.svg", metrics=["valid_accuracy"], title="t"
    )
    assert svg.read_text().lstrip().startswith("<?xml")
    assert list(drawn.panels[-1]) == ["train loss", "learning rate", "validation accuracy"]
    assert drawn.runs[-1] == ["lr 1", "lr 0.1"]
    viz.training_curves(str(a), tmp_path / "one.png", metrics=["metric"])  # a single run
    assert drawn.panels[-1]["validation metric"] == (1, "linear")
    assert drawn.runs[-1] == ["seed0"]


@needs_matplotlib
def test_training_curves_skip_missing_keys(tmp_path: Path, drawn: _Drawn) -> None:
    records: list[dict[str, Any]] = [
        {"kind": "train", "epoch": 1, "step": 1, "loss": 2.0},  # no lr
        {"kind": "train", "epoch": 1, "loss": 1.9, "lr": 0.5},  # no step
        {"kind": "train", "epoch": 1, "step": 3, "loss": None, "lr": "0.5"},  # not numbers
        {"kind": "epoch", "epoch": 1, "step": 3, "valid_metric": 40.0},  # no train_loss, lr
        {"kind": "epoch", "step": 6, "train_loss": 1.0, "valid_metric": 41.0},  # no epoch
        {"kind": "epoch", "epoch": 3, "step": 9, "valid_metric": True, "valid_f1": 0.5},
        {"kind": "epoch", "epoch": 4, "step": 12, "valid_f1": float("inf")},  # a gap
        {"kind": "epoch", "epoch": 5, "step": 15, "valid_f1": float("nan")},  # a gap
    ]
    run = _write_metrics(tmp_path / "partial", records)
    assert "Infinity" in (run / "metrics.jsonl").read_text()  # as json.dumps writes it
    _assert_png(viz.training_curves(run, tmp_path / "p.png"))
    assert drawn.panels[-1] == {
        "train loss": (2, "linear"),  # steps 1 (loss), 6 (train_loss)
        "validation metric": (1, "linear"),  # epoch 1 only: True is not a number
        "validation f1": (1, "linear"),
    }  # no lr anywhere: no lr panel
    only_lr = _write_metrics(tmp_path / "lr", [{"step": 1, "lr": 0.1}, {"step": 2, "lr": 0.1}])
    viz.training_curves(only_lr, tmp_path / "lr.png")
    assert drawn.panels[-1] == {"learning rate": (1, "linear")}


@needs_matplotlib
def test_training_curves_clear_errors(tmp_path: Path) -> None:
    out = tmp_path / "x.png"
    good = _write_metrics(tmp_path / "good", _records(epochs=1, steps_per_epoch=2))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty[/\\]metrics\.jsonl is empty"):
        viz.training_curves([good, tmp_path / "empty"], out)
    (tmp_path / "empty" / "metrics.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match="is empty"):
        viz.training_curves(tmp_path / "empty", out)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        viz.training_curves(tmp_path / "nowhere", out)
    with pytest.raises(ValueError, match="at least one run"):
        viz.training_curves([], out)
    bad = _write_metrics(tmp_path / "bad", _records(1, 2)[:1], tail='{"step": 2,\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"bad[/\\]metrics\.jsonl, line 2: not valid JSON"):
        viz.training_curves(bad, out)
    _write_metrics(tmp_path / "bad", [], tail="[1, 2]\n")
    with pytest.raises(ValueError, match="line 1: expected a JSON object, got list"):
        viz.training_curves(bad, out)
    _write_metrics(tmp_path / "bad", [{"kind": "epoch", "epoch": 1, "time": 3.0}])
    with pytest.raises(ValueError, match="no loss, learning rate or validation metric.*time"):
        viz.training_curves(bad, out)
    with pytest.raises(ValueError, match="`metrics`: no run logged valid_bleu; found valid_m"):
        viz.training_curves(good, out, metrics=["bleu"])
    with pytest.raises(ValueError, match="`metrics` must be a sequence"):
        viz.training_curves(good, out, metrics="metric")
    assert not out.exists()


@needs_matplotlib
def test_training_curves_skip_a_last_line_cut_short(tmp_path: Path, drawn: _Drawn) -> None:
    # a run that crashed (or is still writing) leaves its last line incomplete
    run = _write_metrics(tmp_path / "run", _records(1, 3), tail='{"kind": "train", "st')
    _assert_png(viz.training_curves(run, tmp_path / "c.png"))
    assert drawn.panels[-1]["train loss"] == (2, "linear")


@needs_matplotlib
def test_training_curves_validation_every_n_steps(tmp_path: Path, drawn: _Drawn) -> None:
    # with TrainConfig.eval_every the loop logs "eval" records between the epochs (and the
    # epoch record repeats the validation at the epoch's last step): validation by step
    evals = [
        {"kind": "eval", "epoch": 1 + (step - 1) // 4, "step": step, "valid_metric": step}
        for step in (2, 4, 6, 8)
    ]
    records = _records(epochs=2, steps_per_epoch=4) + evals  # the order of lines is free
    stepped = _write_metrics(tmp_path / "stepped", records)
    plain = _write_metrics(tmp_path / "plain", _records(epochs=2, steps_per_epoch=4))
    viz.training_curves([stepped, plain], tmp_path / "v.png", metrics=["metric"])
    assert drawn.panels[-1]["validation metric"] == (2, "linear")
    assert drawn.xlabels[-1]["validation metric"] == "step"
    viz.training_curves(plain, tmp_path / "e.png")
    assert drawn.xlabels[-1]["validation metric"] == "epoch"


@needs_matplotlib
def test_training_curves_of_runs_written_by_fit(tmp_path: Path, drawn: _Drawn) -> None:
    # the format as the training loop writes it, on a two-parameter toy task
    def run(name: str, lr: float, eval_every: int | None = None) -> Path:
        torch.manual_seed(0)
        model = torch.nn.Linear(1, 1)
        data = [(float(x), 2.0 * x + 1.0) for x in range(8)]

        def loss(m: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int, int]:
            return ((m(batch[:, :1]).squeeze(1) - batch[:, 1]) ** 2).sum(), len(batch), 0

        task = Task(
            model=model,
            batches=lambda epoch: [data[:4], data[4:]],
            collate=lambda examples, device: torch.tensor(examples, device=device),
            loss=loss,
            validate=lambda m: {"metric": -abs(float(model.bias) - 1.0)},
        )
        config = TrainConfig(
            epochs=3,
            lr=lr,
            decay_every=1,
            log_every=1,
            eval_every=eval_every,
            progress=False,
            epoch_lines=False,
        )
        fit(task, config, tmp_path / name)
        return tmp_path / name

    runs = {"lr 0.01": run("a", 0.01), "lr 0.001": run("b", 0.001)}
    _assert_png(viz.training_curves(runs, tmp_path / "fit.png"))
    assert drawn.panels[-1] == {
        "train loss": (4, "linear"),
        "learning rate": (2, "log"),  # 0.01 down to 0.001 / 4: log scale
        "validation metric": (2, "linear"),
    }
    assert drawn.xlabels[-1]["validation metric"] == "epoch"
    viz.training_curves([run("c", 0.01, eval_every=1)], tmp_path / "steps.png")
    assert drawn.xlabels[-1]["validation metric"] == "step"


def test_line_curves_writes_a_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    series = {"lstm": {n: float(n) for n in range(1, 60)}, "mfa": {1: 2.0, 2: 1.0}}
    path = viz.line_curves(series, tmp_path / "c.png", "length", "MSE", "t", log_y=True)
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="at least one"):
        viz.line_curves({}, tmp_path / "d.png", "x", "y")


@needs_matplotlib
def test_mean_field_and_translation_figures_write_every_file(tmp_path: Path) -> None:
    q, n, k = 2, 4, 3
    iterates = torch.rand(k + 1, q, n)  # [k + 1, Q, N]
    written = viz.mean_field_figures(
        iterates[-1], ["y1", "</s>"], list("abcd"), tmp_path, "sorting_mfa3",
        title="MFA_3: attention", name="MFA_3", short_name="mfa3", iterates=iterates,
        couplings=torch.randn(q, n, n), free_energy=torch.randn(k + 1, q),
    )  # fmt: skip
    names = ["attention", "attention_iteration1", "interactions_step1", "interactions_step2"]
    expected = [tmp_path / f"sorting_mfa3_{name}.png" for name in [*names, "free_energy"]]
    assert written == expected
    assert all(p.read_bytes().startswith(PNG_SIGNATURE) for p in written)
    alone = viz.mean_field_figures([[0.5, 0.5]], ["q"], ["a", "b"], tmp_path / "soft", "s",
                                   title="t", name="n", short_name="s")  # fmt: skip
    assert alone == [tmp_path / "soft" / "s_attention.png"]
    with pytest.raises(ValueError, match="couplings"):
        viz.mean_field_figures([[1.0]], ["q"], ["a"], tmp_path, "x", title="t", name="n",
                               short_name="s", couplings=[[1.0]])  # fmt: skip

    panels = [("simple", torch.rand(3, 5), ["a", "b", "</s>"])]
    z = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]).float()
    files = viz.translation_figures(panels, list("01234"), tmp_path / "nmt", (z, ["a", "b", "c"]))
    assert files == [tmp_path / "nmt" / "figure4.png", tmp_path / "nmt" / "segmentation.png"]
    assert all(p.read_bytes().startswith(PNG_SIGNATURE) for p in files)
    assert viz.translation_figures(panels, None, tmp_path / "one") == [
        tmp_path / "one" / "figure4.png"
    ]
