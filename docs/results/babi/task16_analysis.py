"""Task-16 analyses of docs/results/babi.md ("What the failing runs compute").

    python docs/results/babi/task16_analysis.py majority
    python docs/results/babi/task16_analysis.py steps runs/babi_std316/task_16/binary-crf

``majority``: test and train accuracy of "answer the most frequent colour among the story's
colour facts" (ties split evenly). ``steps RUN...``: for every run directory (or a ``train``
output holding ``run_*``), the share of test questions with a 3-fact gold chain whose MAP
chain has the gold fact at step 1, 2 and 3.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from structattn.models.memory_qa import predict_answers
from structattn.recipes import babi

COLOURS = {"white", "green", "gray", "yellow"}


def majority() -> None:
    splits, _ = babi.load_data(babi.BabiConfig(task=16))
    for split in ("train", "test"):
        score = 0.0
        for ex in splits[split]:
            counts = Counter(s[-1] for s in ex.memory if s[-1] in COLOURS).most_common()
            best = [c for c, n in counts if n == counts[0][1]] if counts else []
            score += (ex.answer in best) / max(len(best), 1)
        print(f"{split}: majority colour {100 * score / len(splits[split]):.1f}%")


def steps(paths: list[str]) -> None:
    for path in paths:
        runs = sorted(Path(path).glob("run_*")) or [Path(path)]
        for run in runs:
            model, vocab, config = babi.load_trained(run / "model.pt")
            test = babi.load_data(config)[0]["test"]
            _, facts, _ = predict_answers(model, test, vocab)
            right, total = [0, 0, 0], 0
            for ex, chain in zip(test, facts, strict=True):
                if len(ex.support) != 3 or None in ex.support:
                    continue
                total += 1
                for k in range(3):
                    right[k] += chain[k] == ex.support[k]
            shares = " ".join(f"{100 * r / max(total, 1):.0f}" for r in right)
            print(f"{run}: steps 1 2 3 right (%): {shares}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["majority"]:
        majority()
    elif sys.argv[1:2] == ["steps"] and len(sys.argv) > 2:
        steps(sys.argv[2:])
    else:
        sys.exit(__doc__)
