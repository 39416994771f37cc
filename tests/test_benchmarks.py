"""Smoke test of the benchmark harness (``benchmarks/run.py --quick``).

Runs in the test venv, where no peer library is installed: every peer must be skipped with
a message, our libraries still timed, and the brute-force correctness check still run. No
timing assertions.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from structattn.data.synthetic import sorting_examples
from structattn.recipes import mfa

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"


def _load_run() -> ModuleType:
    spec = importlib.util.spec_from_file_location("structattn_bench_run", RUN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run = _load_run()
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    argv = ["--quick", "--repeats", "1", "--warmup", "0", "--batch", "2", "--threads", "1"]
    argv += ["--json", str(out)]
    threads = torch.get_num_threads()
    try:
        assert run.main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # main() sets the thread count process-wide
    return json.loads(out.read_text())


def test_quick_rows_have_finite_times(quick_results: dict) -> None:
    rows = quick_results["rows"]
    sections = {r["section"] for r in rows}
    assert {"tree", "chain"} <= sections
    for row in rows:
        assert "ours" in row["times"], row
        for seconds in row["times"].values():
            assert math.isfinite(seconds) and seconds > 0
        for samples in row["samples"].values():
            assert len(samples) == 1
    ops = {(r["section"], r["op"]) for r in rows}
    assert {("tree", "logz_fb"), ("tree", "marg_fb"), ("tree", "argmax")} <= ops
    assert {("chain", "logz_fb"), ("chain", "marg")} <= ops


def test_quick_correctness_checks_ran(quick_results: dict) -> None:
    checks = quick_results["checks"]
    assert quick_results["failures"] == 0
    brute = {(c["section"], c["library"]) for c in checks if c["reference"] == "brute force"}
    assert {("tree", "ours"), ("chain", "ours")} <= brute
    # every timed configuration was checked against the float64 reference first
    checked = {(c["section"], c["library"], c["config"]) for c in checks}
    for row in quick_results["rows"]:
        config = f"N={row['size']}"
        for lib in row["times"]:
            assert any(
                s == row["section"] and lb == lib and c.startswith(config) for s, lb, c in checked
            ), (row, lib)
    for check in checks:
        assert check["ok"], check
        assert check["errors"] and all(math.isfinite(v) for v in check["errors"].values())
    # peers are compared with ours when installed, and skipped with a message otherwise
    for peer, module in (("torch-struct", "torch_struct"), ("supar", "supar")):
        if importlib.util.find_spec(module) is None:
            assert any(peer in m and "skipped" in m for m in quick_results["messages"])
        else:
            assert any(c["library"] == peer and c["reference"] == "float64" for c in checks)


def test_quick_memory_measured(quick_results: dict) -> None:
    memory = [m for m in quick_results["memory"] if m["library"] == "ours"]
    assert any(m["section"] == "tree" and m["op"] == "marg_fb" for m in memory)
    assert all(m["peak_bytes"] > 0 for m in memory)


def _load_script(name: str) -> ModuleType:
    """Import ``benchmarks/<name>`` as a module."""
    spec = importlib.util.spec_from_file_location(
        f"structattn_bench_{name[:-3]}", RUN.parent / name
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_second_order_script_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks/second_order.py`` prints one finite ratio per configuration."""
    module = _load_script("second_order.py")
    threads = torch.get_num_threads()
    try:
        assert module.main(["--repeats", "1", "--batch", "1", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    ratios = [float(line.split("|")[-2]) for line in rows[1:]]
    assert len(ratios) == 10 and all(math.isfinite(r) and r > 0 for r in ratios)


def test_large_trees_script_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks/large_trees.py`` times every operation, both samplers up to the limit."""
    module = _load_script("large_trees.py")
    assert module.main(["--sizes", "12", "--repeats", "1", "--old-sampler-max", "12"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 12 ")]
    assert len(rows) == 9 and any("recomputing sampler" in row for row in rows)
    assert all(math.isfinite(float(row.split("|")[3])) for row in rows)


def test_gpu_check_runs_on_the_cpu(tmp_path: Path) -> None:
    """``benchmarks/gpu_check.py --device cpu --quick`` (what a GPU machine runs in full):
    every distribution within float32 rounding of the float64 reference, every layer
    finite under autocast, the sync counts and the speed table written."""
    module = _load_script("gpu_check.py")
    threads = torch.get_num_threads()
    out = tmp_path / "check.md"
    try:
        assert module.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    text = out.read_text()
    for section in ("## Distributions", "## Layers", "## Host synchronisations", "## Speed"):
        assert section in text
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ")]
    dists = [r for r in rows if r[0].strip().endswith(("CRF", "Distribution"))]
    assert len(dists) >= 6 * 2  # the correctness rows and the sync rows
    for row in dists:
        if len(row) == 4 and row[1].strip() != "-":  # a correctness row
            assert float(row[1]) < 1e-4 and float(row[2]) < 1e-4 and row[3].strip() == "yes"
    assert "| NO |" not in text


def test_chain_labels_script_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks/chain_labels.py --quick`` prints both codes' times and whether the kernel
    serves each size (20 labels, a small buffer: yes; 30 labels: no)."""
    lines = _quick_lines("chain_labels.py", capsys)
    assert len(lines) == 2 and all("batched" in line and "kernel" in line for line in lines)
    assert "C = 20" in lines[0] and ("served: True" in lines[0]) == _kernels_built()
    assert "served: False" in lines[1]


def test_chain_call_parts_script_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks/chain_call_parts.py --quick`` prints one line with every part timed."""
    (line,) = _quick_lines("chain_call_parts.py", capsys)
    for part in ("construct (checks)", "log Z fwd+bwd", "null autograd op"):
        assert part in line
    assert ("per item and step" in line) == _kernels_built()


def _quick_lines(script: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The lines ``benchmarks/<script> --quick`` prints (its thread count undone after)."""
    module = _load_script(script)
    threads = torch.get_num_threads()
    try:
        module.main(["--quick"])
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out.splitlines()


def _kernels_built() -> bool:
    from structattn.structs._extension import kernels

    module = kernels(torch.zeros(1))
    return module is not None and hasattr(module, "chain_hvp")


def test_end_to_end_script_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks/end_to_end.py --quick`` prints two finite structured/simple ratios."""
    module = _load_script("end_to_end.py")
    threads = torch.get_num_threads()
    try:
        assert module.main(["--quick", "--repeats", "1", "--warmup", "0", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = capsys.readouterr().out.splitlines()[2:]
    ratios = [float(line.split()[-1]) for line in rows]
    assert len(ratios) == 2 and all(math.isfinite(r) and r > 0 for r in ratios)


def test_transformer_script_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks/transformer.py --quick`` prints one finite ratio per configuration, and
    the reference row's ratio is 1."""
    module = _load_script("transformer.py")
    threads = torch.get_num_threads()
    try:
        assert module.main(["--quick", "--repeats", "1", "--warmup", "0", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = capsys.readouterr().out.splitlines()[2:]
    ratios = {line.rsplit(None, 2)[0]: float(line.split()[-1]) for line in rows}
    assert len(ratios) == len(module.CONFIGS)
    assert ratios["nn.MultiheadAttention"] == 1.0
    assert all(math.isfinite(r) and r > 0 for r in ratios.values())


def test_mfa_step_script_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks/mfa_step.py --quick`` prints two finite ratios per model (to the softmax
    and to the keyed softmax attention, each 1 for itself)."""
    module = _load_script("mfa_step.py")
    threads = torch.get_num_threads()
    try:
        assert module.main(["--quick", "--repeats", "1", "--warmup", "0", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    ratios = {row[0]: (float(row[2]), float(row[3])) for row in rows}
    assert set(ratios) == set(module.CONFIGS)
    assert ratios["attention"][0] == 1.0 and ratios["attention+keys"][1] == 1.0
    assert all(math.isfinite(r) and r > 0 for pair in ratios.values() for r in pair)


def test_mfa_step_keyed_softmax_reference_gives_the_same_logits() -> None:
    """The stricter reference of ``mfa_step.py`` (W h once per sequence) is the same model."""
    module = _load_script("mfa_step.py")
    data = mfa.collate(sorting_examples(4, range(2, 6), 0, "t"), torch.device("cpu"), 99)
    model = mfa.build_model(mfa.MFAConfig(model="attention", hidden_dim=8, attention_dim=4))
    plain = model(data.source, data.source_mask, data.target_in)
    keyed = module.KeyedSoftmaxAttention(8, 8, "mlp", 4)
    keyed.load_state_dict(model.attention.state_dict())
    model.attention = keyed
    out = model(data.source, data.source_mask, data.target_in)
    torch.testing.assert_close(out, plain, rtol=0, atol=1e-6)


def test_a_wrong_peer_is_a_finding_and_only_ours_fails_the_run(capsys) -> None:
    """#22.3: `make bench` exited 1 because torch-struct and supar disagreed with float64 at
    N = 200, C = 2 while ours passed; only a failed check of ours sets the exit status."""
    run = _load_run()
    results = run.Results(machine={}, settings={})
    ok = {"logz": 1e-7}
    results.checks = [
        run.Check("chain", "N=200 C=2", "ours", "float64", ok, True),
        run.Check("chain", "N=200 C=2", "torch-struct", "float64", {"logz": 1.0}, False),
        run.Check("chain", "N=200 C=2", "supar", "float64", {"logz": 1.0}, False),
    ]
    assert run.exit_status(results) == 0
    assert "2 peer FAIL line(s)" in capsys.readouterr().out
    results.checks.append(run.Check("tree", "tiny", "ours (float64)", "brute force", ok, False))
    assert run.exit_status(results) == 1
    assert results.to_json()["our_failures"] == 1


def _load_bound() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bound", RUN.parent / "bound.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their module (run alone too)
    spec.loader.exec_module(module)
    return module


def test_eisner_element_count_matches_the_recurrences() -> None:
    """The closed form of the bound's work equals the count of (span, split point) pairs the
    four Eisner recurrences visit, enumerated."""
    bound = _load_bound()
    for n in range(1, 12):
        visited = 0
        for i in range(n):
            for j in range(i + 1, n):
                visited += 2 * (j - i)  # incomplete spans, both directions: k in [i, j)
                visited += 2 * (j - i)  # complete spans, both directions: k in (i, j]
        assert bound.eisner_elements(n) == visited


def test_bound_counts_real_lengths_and_steps() -> None:
    bound = _load_bound()
    rates = bound.Rates(log_per_s=1e9, max_per_s=2e9, mad_per_s=1e10, latency_s=1e-7)
    full = bound.row_work("tree", "logz_fb", torch.tensor([40, 40]))
    short = bound.row_work("tree", "logz_fb", torch.tensor([40, 20]))
    assert short.log < full.log and short.steps == full.steps == 2 * 39
    assert bound.bound_seconds(full, rates) == pytest.approx(full.log / 1e9)
    tiny = bound.row_work("chain", "marg_fb", torch.tensor([50]), labels=2)
    assert tiny.log == 4 * 49 * 4 and tiny.steps == 4 * 49
    assert bound.latency_floor_seconds(tiny, rates) == pytest.approx(tiny.steps * 1e-7)
    assert bound.row_work("tree", "argmax", torch.tensor([10])).max > 0


def test_quick_rows_carry_a_bound(quick_results: dict) -> None:
    assert quick_results["rates"]["log_per_s"] > 0
    for row in quick_results["rows"]:
        assert row["bound"] > 0 and row["over_bound"] > 0


def test_quick_rows_time_ours_back_to_back(quick_results: dict) -> None:
    """Every row has ours' warm calls (``--back-to-back``, default 3 per repeat) and their
    ratio to the bound."""
    k = quick_results["settings"]["back_to_back"]
    assert k == 3
    for row in quick_results["rows"]:
        assert len(row["warm"]) == k * quick_results["settings"]["repeats"]
        assert row["ours_warm"] > 0
        assert row["warm_over_bound"] == pytest.approx(row["ours_warm"] / row["bound"])


def test_time_interleaved_back_to_back_calls() -> None:
    """The K back-to-back calls timed per repeat follow K untimed ones, only for the
    callables asked for; the interleaved calls stay one per repeat."""
    run = _load_run()  # puts benchmarks/ on sys.path
    import timing

    calls: list[str] = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    got = timing.time_interleaved(fns, repeats=2, warmup=0, back_to_back={"a": 3})
    assert run is not None and len(got["a"].samples) == len(got["b"].samples) == 2
    assert len(got["a"].warm) == 6 and got["b"].warm == []
    assert calls == ["a", "b"] + ["a"] * 6 + ["b", "a"] + ["a"] * 6


def test_quick_rates_carry_a_null_call(quick_results: dict) -> None:
    """The null autograd round trip is measured and far below a real call of ours."""
    call = quick_results["rates"]["call_s"]
    assert 0 < call < max(r["times"]["ours"] for r in quick_results["rows"])


def test_clone_audit_times_the_lifted_chain_kernel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``benchmarks/clone_audit.py --kernel-everywhere --variable-lengths`` times a 30-label
    chain (beyond every dispatch limit) on the kernel, and the limits come back after."""
    if not _kernels_built():
        pytest.skip("the C++ kernels are not built here: clone_audit.py has nothing to compare")
    from structattn.structs import linear_chain as lc

    module = _load_script("clone_audit.py")
    limits = (lc._ONE_THREAD_LABELS, lc._KERNEL_LABELS, lc._SHARED_LABELS, lc._SHARED_BUFFER)
    out = tmp_path / "audit.json"
    argv = ["--only", "chain", "--sizes", "6", "--labels", "3,30", "--ops", "logz_fb"]
    argv += ["--repeats", "1", "--batch", "4", "--variable-lengths", "--kernel-everywhere"]
    threads = torch.get_num_threads()
    try:
        assert module.main([*argv, "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert (lc._ONE_THREAD_LABELS, lc._KERNEL_LABELS, lc._SHARED_LABELS, lc._SHARED_BUFFER) == (
        limits
    )
    unary, pairwise = torch.zeros(4, 6, 30), torch.zeros(30, 30)
    assert lc._chain_kernels(unary, pairwise, "auto") is None  # 30 labels: PyTorch code
    with module._chain_limits_lifted():
        assert lc._chain_kernels(unary, pairwise, "auto") is not None
    rows = json.loads(out.read_text())
    assert [(r["labels"], r["lengths"]) for r in rows] == [(3, "variable"), (30, "variable")]
    assert all(math.isfinite(r["kernels/pytorch"]) and r["kernels_ms"] > 0 for r in rows)
    assert "variable lengths, chain limits lifted" in capsys.readouterr().out


def test_gauss_jordan_script_times_both_inversions(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks/gauss_jordan.py`` prints both inversions' times for each size."""
    if not _kernels_built():
        pytest.skip("the C++ kernels are not built here: gauss_jordan.py has nothing to time")
    module = _load_script("gauss_jordan.py")
    threads = torch.get_num_threads()
    try:
        argv = ["--sizes", "5,9", "--calls", "1", "--batch", "3", "--threads", "1"]
        assert module.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# kernels' SIMD target") and len(lines) == 3
    assert all("Gauss-Jordan" in line and "LAPACK" in line for line in lines[1:])


def test_steady_sizes_script_times_both_weight_rules(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks/steady_sizes.py`` prints kept and recomputed times for each size and
    leaves the kept-weights budget as it was."""
    from structattn.structs import dependency

    budget = dependency._CACHE_ELEMENTS
    module = _load_script("steady_sizes.py")
    threads = torch.get_num_threads()
    try:
        argv = ["--sizes", "5,7", "--rounds", "1", "--calls", "1", "--batch", "2"]
        assert module.main([*argv, "--threads", "1", "--op", "marg_fb"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert dependency._CACHE_ELEMENTS == budget
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "marg_fb" in lines[0]
    assert all("kept" in line and "recomputed" in line for line in lines[1:])
