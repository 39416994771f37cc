"""``structattn <command>``: one entry point with subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

__all__ = ["main"]


def _fmt_row(label: str, values: Sequence[float], width: int = 6) -> str:
    return f"{label:>8} " + " ".join(f"{v:{width}.2f}" for v in values)


def demo(seed: int = 0) -> str:
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


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="structattn", description="Structured attention for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="show a worked example of structured attention")
    p_demo.add_argument("--seed", type=int, default=0, help="random seed")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``structattn`` command."""
    args = _build_parser().parse_args(argv)
    if args.command == "demo":
        demo(seed=args.seed)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
