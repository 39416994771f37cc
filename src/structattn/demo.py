"""The main job, ``structattn demo``: the ``demo`` preset of the tree-transduction recipe.

``reproduce`` of the simple and structured variants (trained in parallel processes when 2+
cores are free, scored on the 1,000-pair test set with beam search) through the shared
runner, then the per-depth table beside the paper's, a verdict, ``results.json``, plots and
both checkpoints in the output directory.

Layer: a command beside :mod:`structattn.cli`, above the recipes (it composes the
``tree-transduction`` recipe, which is why it is not a recipe itself: recipes never import
each other).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from .recipes import runs
from .recipes.config import config_to_dict, replace_path
from .recipes.tree_transduction import (
    DEMO_CONFIG,
    PAPER_TABLE,
    QUICK_CONFIG,
    RECIPE,
    SAMPLE_SOURCE,
    VARIANTS,
    depth_plot,
    format_table,
    visualize,
)
from .structs import kernels as compiled_kernels

__all__ = ["DEMO_CONFIG", "DEMO_VARIANTS", "QUICK_CONFIG", "run_demo"]

DEMO_VARIANTS = ("simple", "structured")


def run_demo(
    out_dir: str | Path = "runs/demo",
    quick: bool = False,
    seed: int = 0,
    resume: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """Run the demo (``quick``: the ``quick`` preset, seconds); returns what it writes to
    ``results.json``. An existing demo directory is an error unless ``resume`` (finished
    models are kept, the table is printed again) or ``force`` (retrained)."""
    out = Path(out_dir)
    config = replace_path(QUICK_CONFIG if quick else DEMO_CONFIG, {"train.seed": seed})
    workers = 2 if runs.available_cores() >= 2 else 1
    print(
        f"structattn demo: tree transduction (prefix -> infix), {config.train.epochs} epoch(s) "
        f"of the paper's model, simple vs structured attention, {workers} process(es) -> {out}",
        file=sys.stderr,
        flush=True,
    )
    started = time.time()
    # build the C++ kernels here, once: the CLI shows the notice of a first build, and the
    # worker processes load the cached module instead of compiling it silently
    compiled_kernels(torch.zeros(1, 2, 2))
    # the torch threads (--threads, or torch's default: the cores) are split between workers
    payload = runs.reproduce(
        RECIPE,
        config,
        out,
        {"attention": list(DEMO_VARIANTS)},
        resume=resume,
        force=force,
        jobs=workers,
        quiet=True,
    )
    results = {key[0]: summary for key, summary in payload.pop("results").items()}
    per_depth = {v: results[v]["per_depth"] for v in DEMO_VARIANTS}
    print()
    print("% of target tokens correct before the first error (test set, beam search):")
    print(format_table(per_depth))
    deeper = [d for d in per_depth["structured"] if d >= 3]
    wins = [d for d in deeper if per_depth["structured"][d] > per_depth["simple"][d]]
    verdict = (
        "structured attention beats simple attention at every depth >= 3, as in the paper"
        if wins == deeper
        else f"structured attention beats simple attention at depths {wins} of {deeper}"
    )
    print(verdict)
    title = "Tree transduction: ours (demo) vs paper"
    plots = [
        depth_plot(per_depth, out / "accuracy_by_depth.png", title),
        *visualize(out, SAMPLE_SOURCE, out),
    ]
    summary: dict[str, Any] = {
        **payload,
        "task": "tree-transduction",
        "metric": "% target tokens correct before the first error",
        "per_depth": {v: {str(d): a for d, a in per_depth[v].items()} for v in DEMO_VARIANTS},
        "counts": {str(d): n for d, n in results["structured"]["counts"].items()},
        "paper": {
            v: {str(d): PAPER_TABLE[d][VARIANTS.index(v)] for d in PAPER_TABLE}
            for v in DEMO_VARIANTS
        },
        "verdict": verdict,
        "seconds": {
            "total": time.time() - started,
            **{f"{v}_train": results[v]["seconds"] for v in DEMO_VARIANTS},
        },
        "config": config_to_dict(config),
        "checkpoints": {v: str(out / v) for v in DEMO_VARIANTS},
        "plots": [str(p) for p in plots],
    }
    runs.write_json(out / "results.json", summary)
    print(
        f"wrote {out / 'results.json'}, checkpoints in {out / 'simple'} and {out / 'structured'},"
    )
    print("plots: " + ", ".join(str(p) for p in plots))
    print(f"total time {summary['seconds']['total'] / 60:.1f} min")
    return summary
