"""Training-step time of the NMT recipe's model: simple vs sigmoid vs structured attention.

One SGD step (forward, backward, clip, update) of ``nmt.build_model`` on real training batches
of small_parallel_enja (``--source char|word``), the variants interleaved round by round and
the median per variant reported with its ratio to simple attention (SAN reports about 5x for
structured attention). Run from the repository root::

    python benchmarks/nmt_step.py --source char --hidden 128 --batch 64 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from structattn.recipes import nmt
from structattn.recipes.config import replace_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="char", choices=nmt.SOURCES)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=10, help="batches per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = replace_path(
        nmt.CPU_CONFIG,
        {"source": args.source, "embedding_dim": args.hidden, "hidden_dim": args.hidden,
         "batch_size": args.batch},
    )  # fmt: skip
    splits, _ = nmt.load_data(base)
    vocabs = nmt.build_vocabularies(base, splits["train"])
    chunks = nmt.batches_for_epoch(splits["train"], args.batch, 0, 1)[: args.batches]
    batches = [nmt.collate(c, vocabs, args.source, torch.device("cpu")) for c in chunks]
    tokens = sum(int((b.target_out != 0).sum()) for b in batches)
    models, optimizers = {}, {}
    for variant in nmt.VARIANTS:
        models[variant] = nmt.build_model(replace_path(base, {"attention": variant}), vocabs)
        optimizers[variant] = torch.optim.SGD(models[variant].parameters(), lr=1.0)
    times: dict[str, list[float]] = {v: [] for v in nmt.VARIANTS}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for variant in nmt.VARIANTS:
            model, optimizer = models[variant], optimizers[variant]
            started = time.perf_counter()
            for batch in batches:
                loss, examples, _ = nmt.sequence_loss(model, batch)
                optimizer.zero_grad()
                (loss / examples).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
            if round_:
                times[variant].append(time.perf_counter() - started)
    simple = statistics.median(times["simple"])
    print(
        f"{args.source}, hidden {args.hidden}, batch {args.batch}, {args.batches} batches "
        f"({tokens} target tokens), {args.threads} thread(s), median of {args.rounds} rounds"
    )
    for variant in nmt.VARIANTS:
        median = statistics.median(times[variant])
        print(f"{variant:>10}: {1000 * median / args.batches:7.1f} ms/step  "
              f"{tokens / median:8.0f} tokens/s  {median / simple:.2f}x simple")  # fmt: skip


if __name__ == "__main__":
    main()
