"""``structattn <command>``: one entry point with subcommands."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["main"]


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


def _commands(sub: Any, name: str, help_text: str) -> Any:
    """``structattn <name> <recipe> ...``: one sub-parser per recipe (each has its own flags)."""
    parser = sub.add_parser(name, help=help_text)
    return parser.add_subparsers(dest="recipe", required=True, metavar="RECIPE")


def _build_parser() -> argparse.ArgumentParser:
    from .data.babi import PAPER_TASKS
    from .recipes._config import add_config_arguments
    from .recipes.babi import BabiConfig
    from .recipes.tree_transduction import TreeTransductionConfig

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

    p = sub.add_parser("tour", help="print a worked example of the inference core")
    p.add_argument("--seed", type=int, default=0, help="random seed")

    recipes = _commands(sub, "data", "write a generated data set")
    p = recipes.add_parser("tree-transduction", help="prefix -> infix formulas (SAN 4.1)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="data seed")

    recipes = _commands(sub, "train", "train one model")
    p = recipes.add_parser("tree-transduction", help="SAN 4.1: none / simple / structured")
    p.add_argument("--out", default=None, help="run directory (default runs/<recipe>/<variant>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    add_config_arguments(p, TreeTransductionConfig)
    p = recipes.add_parser("babi", help="SAN 4.3: memn2n / unary-crf / binary-crf, N runs")
    p.add_argument("--out", default=None, help="output dir (default runs/babi/task_NN/<model>)")
    p.add_argument("--resume", action="store_true", help="keep finished runs, resume the rest")
    p.add_argument("--jobs", type=int, default=1, help="runs trained in parallel processes")
    add_config_arguments(p, BabiConfig)

    recipes = _commands(sub, "eval", "evaluate a trained model on a data file")
    p = recipes.add_parser("tree-transduction", help="per-depth table; predictions JSONL")
    p.add_argument("--checkpoint", required=True, help="run directory (or its model.pt)")
    p.add_argument("--data", required=True, help="file of source<TAB>target lines")
    p.add_argument("--predictions", default=None, help="write one JSON object per example")
    p.add_argument("--beam-size", type=int, default=None, help="default: the run's")
    p.add_argument("--device", default="cpu")
    p = recipes.add_parser("babi", help="Ans %% and Fact %%; predictions JSONL")
    p.add_argument(
        "--checkpoint", required=True, help="a train output dir (its best run) or one run dir"
    )
    p.add_argument("--split", default="test", choices=["train", "valid", "test"])
    p.add_argument("--predictions", default=None, help="write one JSON object per question")
    p.add_argument("--data-dir", default=None, help="default: the run's")
    p.add_argument("--device", default="cpu")

    recipes = _commands(sub, "reproduce", "train all variants; our table beside the paper's")
    p = recipes.add_parser("tree-transduction", help="Table 1 of SAN")
    p.add_argument("--out", default=None, help="output directory (default runs/<recipe>)")
    p.add_argument("--resume", action="store_true", help="continue unfinished runs in --out")
    p.add_argument("--variants", default="none,simple,structured", help="comma-separated")
    add_config_arguments(p, TreeTransductionConfig, skip={"attention"})
    p = recipes.add_parser("babi", help="Table 4 of SAN: 12 tasks x 3 models")
    p.add_argument("--out", default="runs/babi", help="output directory (default runs/babi)")
    p.add_argument("--resume", action="store_true", help="keep finished runs, resume the rest")
    p.add_argument("--tasks", default=",".join(map(str, PAPER_TASKS)), help="comma-separated")
    p.add_argument("--models", default="memn2n,binary-crf,unary-crf", help="comma-separated")
    p.add_argument("--jobs", type=int, default=1, help="runs trained in parallel processes")
    add_config_arguments(p, BabiConfig, skip={"task", "model"})

    recipes = _commands(sub, "viz", "plot attention and structures of trained models")
    p = recipes.add_parser("tree-transduction", help="Figure 3: heatmaps and the MAP parse")
    p.add_argument(
        "--checkpoint", required=True, help="a run dir, or a dir with simple/ structured/"
    )
    p.add_argument("--source", required=True, help='a source expression, e.g. "( + 1 2 )"')
    p.add_argument("--out", default=None, help="output directory (default: the checkpoint dir)")
    p = recipes.add_parser("babi", help="Figure 5: fact-sequence marginals of a CRF model")
    p.add_argument("--checkpoint", required=True, help="a train output dir or one run dir")
    p.add_argument(
        "--question", type=int, required=True, help="question number in --split (0-based)"
    )
    p.add_argument("--split", default="test", choices=["train", "valid", "test"])
    p.add_argument("--data-dir", default=None, help="default: the run's")
    p.add_argument("--out", default=None, help="PNG file or directory (default: the checkpoint)")
    return parser


def _cmd_train(args: argparse.Namespace) -> None:
    from .recipes._config import config_from_args

    if args.recipe == "babi":
        from .recipes import babi

        bconfig = config_from_args(babi.BabiConfig, args)
        out = args.out or babi.default_out(bconfig)
        summary = babi.train(bconfig, out, resume=args.resume, jobs=args.jobs)
        shown = {k: v for k, v in summary.items() if k not in ("config", "run_scores")}
        print(json.dumps({"out": out, **shown}, indent=2))
        return
    from .recipes.tree_transduction import TreeTransductionConfig, train

    config = config_from_args(TreeTransductionConfig, args)
    out = args.out or f"runs/tree-transduction/{config.attention}"
    summary = train(config, out, resume=args.resume)
    if int(os.environ.get("RANK", "0")) == 0:  # one summary under torchrun
        print(json.dumps({"run_dir": out, **summary}, indent=2, default=str))


def _cmd_eval(args: argparse.Namespace) -> None:
    if args.recipe == "babi":
        from dataclasses import replace

        from .recipes import babi

        qa_model, qa_vocab, bconfig = babi.load_trained(args.checkpoint, args.device)
        if args.data_dir:
            bconfig = replace(bconfig, data_dir=args.data_dir)
        splits, _ = babi.load_data(bconfig)
        qa = babi.evaluate(
            qa_model, splits[args.split], qa_vocab, args.device, predictions=args.predictions
        )
        fact = "-" if qa["fact"] is None else f"{qa['fact']:.1f}"
        print(
            f"task {bconfig.task} {bconfig.model} ({args.split}, {qa['questions']} "
            f"questions): Ans {qa['ans']:.1f}%  Fact {fact}%"
        )
        if args.predictions:
            print(f"predictions written to {args.predictions}")
        return
    from .data.tree_transduction import read_pairs
    from .recipes.tree_transduction import evaluate, format_table, load_trained

    model, vocab, config = load_trained(args.checkpoint, args.device)
    pairs = read_pairs(args.data)
    beam = args.beam_size or config.beam_size
    scores = evaluate(model, pairs, vocab, args.device, beam, args.predictions)
    print(format_table({config.attention: scores["per_depth"]}))
    counts = ", ".join(f"depth {d}: {n}" for d, n in scores["counts"].items())
    print(f"overall {scores['overall']:.1f}% ({counts}; beam {beam})")
    if args.predictions:
        print(f"predictions written to {args.predictions}")


def _split_list(text: str, name: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"`{name}` is empty")
    return items


def _cmd_reproduce(args: argparse.Namespace) -> None:
    from .recipes._config import config_from_args

    if args.recipe == "babi":
        from .recipes import babi

        try:
            tasks = [int(t) for t in _split_list(args.tasks, "--tasks")]
        except ValueError as error:
            raise ValueError(f"--tasks must be comma-separated task numbers: {error}") from None
        models = _split_list(args.models, "--models")
        bconfig = config_from_args(babi.BabiConfig, args)
        babi.reproduce(bconfig, args.out, tasks, models, resume=args.resume, jobs=args.jobs)
        return
    from .recipes.tree_transduction import TreeTransductionConfig, reproduce

    config = config_from_args(TreeTransductionConfig, args)
    variants = _split_list(args.variants, "--variants")
    reproduce(config, args.out or "runs/tree-transduction", variants, resume=args.resume)


def _cmd_viz(args: argparse.Namespace) -> None:
    if args.recipe == "babi":
        from .recipes.babi import visualize as babi_visualize

        print(babi_visualize(args.checkpoint, args.question, args.out, args.split, args.data_dir))
        return
    from .recipes.tree_transduction import visualize

    for path in visualize(args.checkpoint, args.source, args.out):
        print(path)


def _cmd_data(args: argparse.Namespace) -> None:
    from .data.tree_transduction import main_data

    main_data(args.out, seed=args.seed)


def _cmd_demo(args: argparse.Namespace) -> None:
    from .recipes.demo import run_demo

    run_demo(args.out, quick=args.quick, seed=args.seed)


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
    commands = {
        "demo": _cmd_demo,
        "data": _cmd_data,
        "train": _cmd_train,
        "eval": _cmd_eval,
        "reproduce": _cmd_reproduce,
        "viz": _cmd_viz,
    }
    try:
        if args.command == "tour":
            tour(seed=args.seed)
        else:
            commands[args.command](args)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as error:
        from .training import CheckpointError

        if isinstance(error, RuntimeError) and not isinstance(error, CheckpointError):
            raise
        print(f"structattn: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
