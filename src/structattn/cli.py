"""``structattn <command>``: one entry point with subcommands."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from .recipes.base import GridAxis, Recipe, RecipeConfig

__all__ = ["main"]

C = TypeVar("C", bound="RecipeConfig")  # a recipe's config dataclass


def _fmt_row(label: str, values: Sequence[float], width: int = 6) -> str:
    return f"{label:>8} " + " ".join(f"{v:{width}.2f}" for v in values)


def tour(seed: int = 0) -> str:
    """A worked example of the inference core; returns the text it prints."""
    from . import DependencyCRF, LinearChainCRF, mean_field_marginals

    torch.manual_seed(seed)
    out: list[str] = []
    words = ["$", "the", "cat", "sat", "on", "mats"]

    out.append("== Segmentation attention: a 2-state linear-chain CRF over 5 positions ==")
    scores = torch.tensor([[2.0, 1.5, -1.0, 0.5, 2.5]])  # theta_i(1) = relevance of position i
    unary = torch.stack([torch.zeros_like(scores), scores], dim=-1)  # [1, 5, 2]
    sticky = torch.tensor([[1.0, -1.0], [-1.0, 1.0]])  # neighbours prefer the same state
    for name, pairwise in (("b = 0", torch.zeros(2, 2)), ("sticky b", sticky)):
        chain = LinearChainCRF(unary, pairwise)
        out.append(_fmt_row(name, chain.marginals[0, :, 1].tolist()) + "   p(z_i = 1)")
    out.append(_fmt_row("sigmoid", torch.sigmoid(scores[0]).tolist()) + "   (equals b = 0)")
    chain = LinearChainCRF(unary, sticky)
    out.append(f"Viterbi segmentation: {chain.argmax[0].tolist()}  entropy {chain.entropy[0]:.3f}")
    best, labels = chain.topk(3)
    for rank in range(3):
        prob = (best[rank, 0] - chain.log_partition[0]).exp()
        out.append(f"  #{rank + 1} {labels[rank, 0].tolist()}  p = {prob:.3f}")

    out.append("")
    out.append("== Syntactic attention: projective dependency CRF (Eisner), ROOT = '$' ==")
    n = len(words)
    arc = torch.randn(1, n, n)
    gold = [-1, 2, 3, 0, 3, 4]  # the -> cat -> sat <- ROOT; sat -> on -> mats
    for m, h in enumerate(gold):
        if h >= 0:
            arc[0, h, m] += 4.0
    tree = DependencyCRF(arc)
    marg = tree.marginals[0]
    out.append("p(head -> modifier); rows = heads, columns = modifiers")
    out.append(" " * 9 + " ".join(f"{w:>6}" for w in words))
    for h in range(n):
        out.append(_fmt_row(words[h], marg[h].tolist()))
    heads = tree.argmax[0].tolist()
    arcs = ", ".join(f"{words[h]} -> {words[m]}" for m, h in enumerate(heads) if h >= 0)
    out.append(f"MAP tree: {arcs}")
    out.append(
        f"log Z = {tree.log_partition[0]:.3f}, max score = {tree.max_score[0]:.3f}, "
        f"entropy = {tree.entropy[0]:.3f} nats, p(MAP) = "
        f"{tree.log_prob(tree.argmax)[0].exp():.3f}"
    )

    out.append("")
    out.append("== Mean-field CRF attention: 6 binary spins, k = 0..3 iterations ==")
    phi = torch.tensor([[1.0, 0.5, -0.5, 1.0, 0.0, -1.0]])
    coupling = torch.zeros(1, 6, 6)
    coupling[0, 0, 3] = coupling[0, 3, 0] = -3.0  # inputs 0 and 3 inhibit each other
    for k in range(4):
        spins = mean_field_marginals(phi, coupling, k)
        out.append(_fmt_row(f"k = {k}", spins[0].tolist()))
    text = "\n".join(out)
    print(text)
    return text


# ---- the parser, generated from the recipe registry -------------------------------------------
EXTRA = 'pip install "structattn[recipes]"'


def _preset_config(recipe: Recipe[C], args: argparse.Namespace) -> C:
    """The config of ``--preset`` (default: the paper's) with the command line's flags."""
    from .recipes.config import config_from_args

    base = recipe.presets[args.preset].config if args.preset else recipe.config()
    return config_from_args(recipe.config, args, base)


def _run_flags(p: argparse.ArgumentParser, recipe: Recipe[C], out_help: str) -> None:
    p.add_argument(
        "--preset",
        choices=sorted(recipe.presets),
        default=None,
        help="start from this preset (default: the paper's settings); flags override it",
    )
    p.add_argument("--out", default=None, help=out_help)
    rules = p.add_mutually_exclusive_group()
    rules.add_argument(
        "--resume", action="store_true", help="keep finished runs, continue unfinished ones"
    )
    rules.add_argument(
        "--force", action="store_true", help="delete existing runs in --out and train them again"
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="runs trained in parallel processes (default: the preset's, else 1)",
    )


def _build_parser() -> argparse.ArgumentParser:
    from . import recipes
    from .recipes.config import add_config_arguments

    parser = argparse.ArgumentParser(
        prog="structattn",
        description="Structured attention for PyTorch: demos, paper recipes, benchmarks.",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="generate data, train small simple and structured models")
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--quick", action="store_true", help="a tiny run (seconds) for smoke tests")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    rules = p.add_mutually_exclusive_group()
    rules.add_argument("--resume", action="store_true", help="keep a finished demo in --out")
    rules.add_argument("--force", action="store_true", help="retrain a demo already in --out")

    p = sub.add_parser("tour", help="print a worked example of the inference core")
    p.add_argument("--seed", type=int, default=0, help="random seed")

    sub.add_parser("list", help="the recipes, their variants, presets and data sets")

    p = sub.add_parser(
        "download",
        help="fetch a data set by name (checksums verified; licence printed)",
        description="Download a data set into --data-dir or the user cache (the data-directory "
        "rule finds it there), from its upstream or a mirror; `--list` shows them.",
    )
    p.add_argument("name", nargs="?", metavar="NAME", help="the data set (see --list)")
    p.add_argument("--list", action="store_true", help="the data sets and whether each is present")
    p.add_argument(
        "--data-dir",
        default=None,
        help="root to download into, laid out like ../shared/data (default: $STRUCTATTN_DATA "
        "when set, else the user cache ~/.cache/structattn/data)",
    )
    p.add_argument(
        "--from",
        dest="source",
        default=None,
        metavar="SOURCE",
        help="a mirror instead of the upstream: a folder laid out like ../shared/data, or a "
        "folder or URL holding the upstream archives by file name",
    )
    p.add_argument("--force", action="store_true", help="download again files already present")

    commands = {
        "data": "write a generated data set",
        "train": "train one model (or a recipe's N seeded runs)",
        "eval": "evaluate a trained model; predictions JSONL",
        "reproduce": "train all variants; our table beside the paper's",
        "viz": "plot attention and structures of trained models",
        "parse": "parse plain sentences (one per line, tokens split by spaces) with a model",
    }
    per_command = {
        name: sub.add_parser(name, help=text).add_subparsers(
            dest="recipe", required=True, metavar="RECIPE"
        )
        for name, text in commands.items()
    }
    for name in recipes.names():
        recipe = recipes.get(name)
        tools = recipe.tools
        if tools.data is not None:
            p = per_command["data"].add_parser(name, help=recipe.summary)
            add_config_arguments(p, tools.data_options, title="data options")

        p = per_command["train"].add_parser(name, help=recipe.summary)
        layout = "<out>/run_NN" if recipe.multi_run else "<out>"
        _run_flags(p, recipe, f"output directory (default runs/{name}/<cell>; runs in {layout})")
        add_config_arguments(p, recipe.config)

        p = per_command["eval"].add_parser(name, help=recipe.summary)
        p.add_argument(
            "--checkpoint",
            required=True,
            help="a run directory, its model.pt, or a train output dir (best run)",
        )
        p.add_argument("--predictions", default=None, help="write one JSON object per example")
        p.add_argument("--device", default="cpu")
        add_config_arguments(p, tools.eval_options, title="eval options")

        p = per_command["reproduce"].add_parser(name, help=recipe.summary)
        _run_flags(p, recipe, f"output directory (default runs/{name})")
        for axis in recipe.grid:
            default = ",".join(map(str, axis.values))
            p.add_argument(
                f"--{axis.flag}",
                default=default,
                help=f"comma-separated {axis.field} values (default {default})",
            )
        if recipe.report.reproduce_also:
            also = ", ".join(recipe.report.reproduce_also)
            p.add_argument(
                "--skip-also",
                action="store_true",
                help=f"only this recipe's table (default: also {also}, into <out>/<name>, "
                "with the same --preset, --resume/--force and --jobs)",
            )
        add_config_arguments(p, recipe.config, skip={a.field for a in recipe.grid})

        if tools.parse is not None:
            p = per_command["parse"].add_parser(name, help=recipe.summary)
            p.add_argument("--checkpoint", required=True, help="a run directory or its model.pt")
            p.add_argument(
                "--input", default="-", help="sentences, one per line (default -: stdin)"
            )
            p.add_argument("--output", default=None, help="write here (default: stdout)")
            p.add_argument("--device", default="cpu")
            add_config_arguments(p, tools.parse_options, title="parse options")

        if tools.viz is None:
            continue
        p = per_command["viz"].add_parser(name, help=recipe.summary)
        p.add_argument(
            "--checkpoint",
            required=True,
            help="a run directory, a train output dir, or a reproduce dir",
        )
        p.add_argument("--out", default=None, help="output file or directory (default: beside it)")
        add_config_arguments(p, tools.viz_options, title="viz options")
    return parser


def _options(cls: type, args: argparse.Namespace) -> Any:
    from .recipes.config import config_from_args

    return config_from_args(cls, args)


def _grid_values(config: RecipeConfig, axis: GridAxis, text: str) -> list[Any]:
    """``--<axis> a,b``: values converted to the config field's type and checked by it."""
    from dataclasses import replace

    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"--{axis.flag} is empty")
    kind = type(getattr(config, axis.field))
    try:
        values = [kind(t) for t in items]
    except ValueError:
        message = f"--{axis.flag} must be comma-separated {axis.field} values: {text!r}"
        raise ValueError(message) from None
    for value in values:
        replace(config, **{axis.field: value})  # the config's own checks
    return values


def _jobs(recipe: Recipe[C], args: argparse.Namespace) -> int:
    if args.jobs is not None:
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        return int(args.jobs)
    return recipe.presets[args.preset].jobs if args.preset else 1


def _cmd_train(recipe: Recipe[C], args: argparse.Namespace) -> None:
    from .recipes import runs

    config = _preset_config(recipe, args)
    _notices(config)
    out = args.out or os.path.join("runs", recipe.name, recipe.cell(config))
    summary = runs.train_cell(recipe, config, out, args.resume, args.force, _jobs(recipe, args))
    if summary is not None:  # rank 0 under torchrun
        shown = {k: v for k, v in summary.items() if k not in ("config", "run_scores")}
        print(json.dumps({"out": out, **shown}, indent=2, default=str))


def _cmd_eval(recipe: Recipe[C], args: argparse.Namespace) -> None:
    from pathlib import Path

    from .recipes import runs

    run_dir = runs.resolve_run(recipe, args.checkpoint)
    predictions = Path(args.predictions) if args.predictions else None
    options = _options(recipe.tools.eval_options, args)
    print(recipe.evaluate(run_dir, options, args.device, predictions))
    if predictions:
        print(f"predictions written to {predictions}")


def _cmd_reproduce(recipe: Recipe[C], args: argparse.Namespace) -> None:
    from .recipes import runs

    config = _preset_config(recipe, args)
    _notices(config)
    grid = {a.field: _grid_values(config, a, getattr(args, a.flag)) for a in recipe.grid}
    out = args.out or os.path.join("runs", recipe.name)
    runs.reproduce(recipe, config, out, grid, args.resume, args.force, _jobs(recipe, args))
    if getattr(args, "skip_also", True):
        return
    from . import recipes

    for name in recipe.report.reproduce_also:  # the paper's other tables, each on its own grid
        other = recipes.get(name)
        base = other.presets[args.preset].config if args.preset else other.config()
        print(f"\n== {name}: {other.summary} ==")
        values = {a.field: list(a.values) for a in other.grid}
        jobs = _jobs(other, args)
        runs.reproduce(other, base, os.path.join(out, name), values, args.resume, args.force, jobs)


def _cmd_viz(recipe: Recipe[C], args: argparse.Namespace) -> None:
    from pathlib import Path

    tools = recipe.tools
    assert tools.viz is not None
    options = _options(tools.viz_options, args)
    for path in tools.viz(Path(args.checkpoint), options, Path(args.out) if args.out else None):
        print(path)


def _cmd_parse(recipe: Recipe[C], args: argparse.Namespace) -> None:
    from .io import atomic_write_text, read_sentences
    from .recipes import runs

    parse = recipe.tools.parse
    assert parse is not None
    sentences = read_sentences(args.input)
    run_dir = runs.resolve_run(recipe, args.checkpoint)
    options = _options(recipe.tools.parse_options, args)
    parsed = "".join(f"{out}\n" for out in parse(run_dir, sentences, args.device, options))
    if args.output:
        atomic_write_text(args.output, parsed)
        print(f"{len(sentences)} sentences parsed into {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(parsed)


def _cmd_data(recipe: Recipe[C], args: argparse.Namespace) -> None:
    tools = recipe.tools
    assert tools.data is not None
    tools.data(_options(tools.data_options, args))


def _cmd_demo(args: argparse.Namespace) -> None:
    from .demo import run_demo

    run_demo(args.out, quick=args.quick, seed=args.seed, resume=args.resume, force=args.force)


def _data_present(folder: str, files: Sequence[str], explicit: str | None = None) -> bool:
    """Every file of a data set is in its folder, found by the data-directory rule (or in
    ``<explicit>/<folder>``)."""
    from pathlib import Path

    from .io import data_dir

    try:
        found = Path(explicit, folder) if explicit else data_dir(folder, what=folder)
    except FileNotFoundError:
        return False
    return all((found / name).is_file() for name in files)


def _recipe_data(name: str) -> str:
    """``structattn list``'s data line of a recipe: the data sets it needs (then those it can
    use with a flag), each present or missing."""
    from .data.download import manifest

    needed: list[str] = []
    optional: list[str] = []
    for ds in manifest().values():
        if name not in ds.recipes and name not in ds.optional_for:
            continue
        if _data_present(ds.folder, [kept.path for kept in ds.files]):
            state = "present"
        else:
            state = f"missing: structattn download {ds.name}" if name in ds.recipes else "missing"
        (needed if name in ds.recipes else optional).append(f"{ds.name} ({state})")
    text = ", ".join(needed) if needed else "none (generated)"
    return text + (f"; optional: {', '.join(optional)}" if optional else "")


def _cmd_download(args: argparse.Namespace) -> int:
    from .data import download

    if args.list:
        explicit = args.data_dir

        def present(ds: download.DataSet) -> bool:
            return _data_present(ds.folder, [kept.path for kept in ds.files], explicit)

        print(download.format_list(present))
        return 0
    if not args.name:
        print("structattn: error: download needs a data set NAME (or --list)", file=sys.stderr)
        return 2
    try:
        download.download(args.name, args.data_dir, args.source, args.force)
    except download.DownloadError as error:
        print(f"structattn: error: {error}", file=sys.stderr)
        return 1
    return 0


def _cmd_list() -> None:
    from . import recipes

    for name in recipes.names():
        recipe = recipes.get(name)
        print(f"{name}: {recipe.summary}")
        variant = recipe.variant  # the grid's last axis
        values = ", ".join(map(str, variant.values))
        print(f"  variants (--{variant.field.replace('_', '-')}): {values}")
        grid = " x ".join(f"--{a.flag}" for a in recipe.grid)
        print(f"  reproduce grid: {grid}")
        print("  presets (--preset):")
        for preset, info in recipe.presets.items():
            print(f"    {preset:<8} {info.description}")
        print(f"  data sets: {_recipe_data(name)}")


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # sys.modules[module] is None: blocked
        return False


def _notices(config: RecipeConfig) -> None:
    """One line per optional package whose absence only changes what the user sees (progress
    bars; the C++ kernels warn on their own): the command runs."""
    if config.train.progress and not _installed("tqdm"):
        print(f"structattn: no progress bars without tqdm ({EXTRA})", file=sys.stderr)


def _missing(command: str, recipe: Recipe[C] | None) -> str | None:
    """The one-line error when ``command`` needs a package that is not installed."""
    needs: tuple[str, ...] = ("matplotlib",) if command == "demo" else ()
    if recipe is not None:
        needs = tuple(recipe.needs.get(command, ()))
    for module in needs:
        if not _installed(module):
            where = f"{command} {recipe.name}" if recipe is not None else command
            return f"`structattn {where}` needs {module}, which is not installed: {EXTRA}"
    return None


class _StderrHandler(logging.Handler):
    """Prints a record's message to the current ``sys.stderr`` (looked up at each record, so
    a replaced stream, as under pytest, is never written to after it was closed)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(record.getMessage(), file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``structattn`` command."""
    args = _build_parser().parse_args(argv)
    log = logging.getLogger("structattn")
    if not log.handlers:  # one-off notices (e.g. compiling the C++ kernels) go to stderr
        log.addHandler(_StderrHandler())
        log.setLevel(logging.INFO)
    if args.threads is not None:
        if args.threads < 1:
            print("structattn: error: --threads must be >= 1", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    recipe = None
    if getattr(args, "recipe", None) is not None:
        from . import recipes

        recipe = recipes.get(args.recipe)
    missing = _missing(args.command, recipe)
    if missing is not None:  # before any work starts
        print(f"structattn: error: {missing}", file=sys.stderr)
        return 2
    commands = {
        "data": _cmd_data,
        "train": _cmd_train,
        "eval": _cmd_eval,
        "reproduce": _cmd_reproduce,
        "viz": _cmd_viz,
        "parse": _cmd_parse,
    }
    try:
        if args.command == "tour":
            tour(seed=args.seed)
        elif args.command == "list":
            _cmd_list()
        elif args.command == "download":
            return _cmd_download(args)
        elif args.command == "demo":
            _cmd_demo(args)
        else:
            assert recipe is not None  # every other command has a recipe argument
            commands[args.command](recipe, args)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as error:
        from .training import CheckpointError

        if isinstance(error, RuntimeError) and not isinstance(error, CheckpointError):
            raise
        print(f"structattn: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
