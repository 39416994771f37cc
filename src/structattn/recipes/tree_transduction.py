"""Recipe: tree transduction, prefix -> infix (Kim et al. 2017, sec. 4.1 and Appendix A.2).

Config (paper values as defaults) -> build -> train -> evaluate, plus reproduce and demo.
Metric: the average proportion of correct target tokens before the first error, per depth.
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data._files import atomic_write_text
from ..data.tree_transduction import Pair, Vocabulary, generate_splits, read_splits
from ..models import StructuredSeq2Seq
from ..training import Task, TrainConfig, fit, load_model_state

__all__ = [
    "PAPER_TABLE",
    "TreeTransductionConfig",
    "build_model",
    "evaluate",
    "load_trained",
    "reproduce",
    "train",
    "visualize",
]

#: Table 1 of the paper: depth -> (No Atten, Simple, Structured), % correct before first error
PAPER_TABLE: dict[int, tuple[float, float, float]] = {
    2: (7.6, 87.4, 99.2),
    3: (4.1, 49.6, 87.0),
    4: (2.8, 23.3, 64.5),
    5: (2.1, 15.0, 30.8),
    6: (1.5, 8.5, 18.2),
}
VARIANTS = ("none", "simple", "structured")


@dataclass(frozen=True)
class TreeTransductionConfig:
    """Settings of the tree-transduction experiment (defaults: the paper's, Appendix A.2)."""

    attention: str = "structured"  # encoder self-attention: none | simple | structured
    dim: int = 50  # l: embedding and LSTM size
    parser_hidden: int = 50  # size of each direction of the parsing biLSTM
    batch_size: int = 20  # sentences per batch
    epochs: int = 13  # training epochs
    lr: float = 1.0  # SGD learning rate
    decay_start: int = 9  # halve the lr after every epoch from this one on ...
    decay_on_plateau: bool = True  # ... or from when validation perplexity stops improving
    init_range: float = 0.1  # parameters ~ U[-init_range, init_range]
    max_grad_norm: float = 1.0  # gradient norm clipping
    beam_size: int = 5  # beam search at test time
    seed: int = 0  # model initialisation, batch order, dropout
    data_dir: str = ""  # directory with train/valid/test.tsv ("" = generate with data_seed)
    data_seed: int = 0  # seed of the generated data set
    train_size: int = 0  # use a seeded subset of this many training pairs (0 = all)
    valid_size: int = 0  # likewise for validation (0 = all)
    device: str = "cpu"  # cpu | cuda
    log_every: int = 50  # steps between metric lines
    checkpoint_every: int = 0  # also checkpoint every this many steps (0 = per epoch only)
    progress: bool = True  # progress bars


class Batch(NamedTuple):
    source: Tensor  # [B, N] ids, position 0 = '$'
    source_mask: Tensor  # [B, N]
    target_in: Tensor  # [B, T] '<s>' + target
    target_out: Tensor  # [B, T] target + '</s>' (0 = padding)


# ---- data ---------------------------------------------------------------------------------
def load_data(config: TreeTransductionConfig) -> dict[str, list[Pair]]:
    """Train/valid/test pairs from ``data_dir`` or generated from ``data_seed``."""
    if config.data_dir:
        splits = read_splits(config.data_dir)
    else:
        splits = generate_splits(seed=config.data_seed)
    rng = random.Random(config.seed)
    for name, size in (("train", config.train_size), ("valid", config.valid_size)):
        if size and size < len(splits[name]):
            splits[name] = rng.sample(splits[name], size)
    return splits


def collate(pairs: Sequence[Pair], vocab: Vocabulary, device: torch.device) -> Batch:
    """Pad a list of pairs into a :class:`Batch` (the root symbol is prepended here)."""
    sources = [vocab.encode(["$", *p.source]) for p in pairs]
    targets = [vocab.encode(list(p.target)) for p in pairs]
    n = max(map(len, sources))
    t = max(map(len, targets)) + 1
    source = torch.zeros(len(pairs), n, dtype=torch.long)
    target_in = torch.zeros(len(pairs), t, dtype=torch.long)
    target_out = torch.zeros(len(pairs), t, dtype=torch.long)
    for i, (s, y) in enumerate(zip(sources, targets, strict=True)):
        source[i, : len(s)] = torch.tensor(s)
        target_in[i, : len(y) + 1] = torch.tensor([vocab.bos_id, *y])
        target_out[i, : len(y) + 1] = torch.tensor([*y, vocab.eos_id])
    source = source.to(device)
    return Batch(source, source != vocab.pad_id, target_in.to(device), target_out.to(device))


def batches_for_epoch(
    pairs: Sequence[Pair], batch_size: int, seed: int, epoch: int
) -> list[list[Pair]]:
    """Length-bucketed batches in a random order fixed by (seed, epoch)."""
    rng = random.Random(seed * 100_003 + epoch)
    order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i].source), rng.random()))
    batches = [
        [pairs[i] for i in order[s : s + batch_size]] for s in range(0, len(order), batch_size)
    ]
    rng.shuffle(batches)
    return batches


# ---- model --------------------------------------------------------------------------------
def build_model(config: TreeTransductionConfig, vocab: Vocabulary) -> StructuredSeq2Seq:
    """The paper's model for ``config.attention``, initialised U[-init_range, init_range]."""
    torch.manual_seed(config.seed)
    model = StructuredSeq2Seq(
        len(vocab), config.dim, config.attention, config.parser_hidden, padding_idx=vocab.pad_id
    )
    for p in model.parameters():
        nn.init.uniform_(p, -config.init_range, config.init_range)
    return model


def sequence_loss(model: nn.Module, batch: Batch) -> tuple[Tensor, int, int]:
    """Summed token NLL, number of sentences, number of target tokens."""
    logits = model(batch.source, batch.source_mask, batch.target_in)
    loss = F.cross_entropy(
        logits.flatten(0, 1), batch.target_out.flatten(), ignore_index=0, reduction="sum"
    )
    return loss, batch.source.shape[0], int((batch.target_out != 0).sum())


def perplexity(
    model: nn.Module, pairs: Sequence[Pair], vocab: Vocabulary, device: torch.device
) -> float:
    """Teacher-forced per-token perplexity."""
    total, tokens = 0.0, 0
    for chunk in _chunks(pairs, 100):
        loss, _, n = sequence_loss(model, collate(chunk, vocab, device))
        total, tokens = total + float(loss), tokens + n
    return math.exp(total / max(tokens, 1))


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


# ---- metric -------------------------------------------------------------------------------
def correct_before_first_error(prediction: Sequence[str], target: Sequence[str]) -> float:
    """Proportion of target tokens predicted correctly before the first error (in [0, 1])."""
    if not target:
        return 1.0 if not prediction else 0.0
    correct = 0
    for p, t in zip(prediction, target, strict=False):
        if p != t:
            break
        correct += 1
    return correct / len(target)


def decode(
    model: StructuredSeq2Seq,
    pairs: Sequence[Pair],
    vocab: Vocabulary,
    device: torch.device,
    beam_size: int,
    batch_size: int = 50,
) -> list[tuple[list[str], float]]:
    """Beam-search predictions (tokens, log-probability) for every pair, in order."""
    model.eval()
    out: list[tuple[list[str], float]] = []
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i].source))
    results: dict[int, tuple[list[str], float]] = {}
    for chunk in _chunks(order, batch_size):
        batch = collate([pairs[i] for i in chunk], vocab, device)
        max_length = 2 * batch.source.shape[1] + 10
        beam = model.beam_search(
            batch.source, batch.source_mask, vocab.bos_id, vocab.eos_id, beam_size, max_length
        )
        for i, tokens, score in zip(chunk, beam.tokens, beam.scores.tolist(), strict=True):
            results[i] = (vocab.decode(tokens), score)
    out = [results[i] for i in range(len(pairs))]
    return out


def evaluate(
    model: StructuredSeq2Seq,
    pairs: Sequence[Pair],
    vocab: Vocabulary,
    device: torch.device | str = "cpu",
    beam_size: int = 5,
    predictions: str | Path | None = None,
) -> dict[str, Any]:
    """Per-depth % of target tokens correct before the first error (beam search)."""
    device = torch.device(device)
    decoded = decode(model, pairs, vocab, device, beam_size)
    per_depth: dict[int, list[float]] = defaultdict(list)
    records = []
    for pair, (prediction, score) in zip(pairs, decoded, strict=True):
        accuracy = correct_before_first_error(prediction, pair.target)
        per_depth[pair.depth].append(accuracy)
        records.append(
            {
                "source": " ".join(pair.source),
                "target": " ".join(pair.target),
                "prediction": " ".join(prediction),
                "score": score,
                "depth": pair.depth,
                "correct_before_first_error": accuracy,
            }
        )
    if predictions is not None:
        atomic_write_text(predictions, "".join(json.dumps(r) + "\n" for r in records))
    table = {d: 100.0 * sum(v) / len(v) for d, v in sorted(per_depth.items())}
    counts = {d: len(v) for d, v in sorted(per_depth.items())}
    overall = 100.0 * sum(sum(v) for v in per_depth.values()) / max(len(pairs), 1)
    return {"per_depth": table, "counts": counts, "overall": overall}


# ---- train / load -------------------------------------------------------------------------
def train(
    config: TreeTransductionConfig,
    run_dir: str | Path,
    resume: bool = False,
    splits: dict[str, list[Pair]] | None = None,
) -> dict[str, Any]:
    """Train one variant; writes the run directory; returns the training summary."""
    if config.attention not in VARIANTS:
        raise ValueError(f"`attention` must be one of {VARIANTS}, got {config.attention!r}")
    run_dir = Path(run_dir)
    if resume:
        saved = load_model_state(run_dir, "checkpoint.pt")
        vocab = Vocabulary.from_dict(saved["extra"]["vocab"])
    splits = splits or load_data(config)
    if not resume:
        vocab = Vocabulary.build(splits["train"])  # unseen test tokens map to <unk>
    device = torch.device(config.device)
    model = build_model(config, vocab)
    valid = splits["valid"]

    def validate(m: nn.Module) -> dict[str, float]:
        ppl = perplexity(m, valid, vocab, device)
        return {"metric": -ppl, "perplexity": ppl}

    task = Task(
        model=model,
        batches=lambda epoch: batches_for_epoch(
            splits["train"], config.batch_size, config.seed, epoch
        ),
        collate=lambda pairs, dev: collate(pairs, vocab, dev),
        loss=sequence_loss,
        validate=validate,
        config={"recipe": "tree-transduction", **asdict(config)},
        extra={"vocab": vocab.to_dict()},
    )
    train_config = TrainConfig(
        epochs=config.epochs,
        lr=config.lr,
        max_grad_norm=config.max_grad_norm,
        decay_start=config.decay_start,
        decay_on_plateau=config.decay_on_plateau,
        seed=config.seed,
        log_every=config.log_every,
        checkpoint_every=config.checkpoint_every or None,
        device=config.device,
        progress=config.progress,
        name=config.attention,
    )
    return fit(task, train_config, run_dir, resume=resume)


def load_trained(
    run_dir: str | Path, device: str = "cpu"
) -> tuple[StructuredSeq2Seq, Vocabulary, TreeTransductionConfig]:
    """The best model of a run directory (``model.pt``), its vocabulary and config."""
    state = load_model_state(run_dir)
    fields = {
        k: v for k, v in state["config"].items() if k in TreeTransductionConfig.__dataclass_fields__
    }
    config = TreeTransductionConfig(**fields)
    vocab = Vocabulary.from_dict(state["extra"]["vocab"])
    model = build_model(config, vocab)
    model.load_state_dict(state["model"])
    return model.to(device).eval(), vocab, config


# ---- tables -------------------------------------------------------------------------------
def format_table(results: dict[str, dict[int, float]], with_paper: bool = True) -> str:
    """Per-depth table of our numbers (and the paper's Table 1 beside them)."""
    variants = [v for v in VARIANTS if v in results]
    names = {"none": "No Atten", "simple": "Simple", "structured": "Structured"}
    header = ["Depth", *(f"{names[v]} (ours)" for v in variants)]
    if with_paper:
        header += [f"{names[v]} (paper)" for v in variants]
    depths = sorted({d for r in results.values() for d in r})
    rows = []
    for d in depths:
        row = [str(d)] + [f"{results[v].get(d, float('nan')):.1f}" for v in variants]
        if with_paper:
            row += [
                f"{PAPER_TABLE[d][VARIANTS.index(v)]:.1f}" if d in PAPER_TABLE else "-"
                for v in variants
            ]
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def reproduce(
    config: TreeTransductionConfig,
    out_dir: str | Path,
    variants: Sequence[str] = VARIANTS,
    resume: bool = False,
) -> dict[str, Any]:
    """Train every variant on the same data, evaluate on the test set, write results.json."""
    out_dir = Path(out_dir)
    splits = load_data(config)
    results: dict[str, dict[int, float]] = {}
    summary: dict[str, Any] = {"config": asdict(config), "variants": {}}
    for variant in variants:
        run_dir = out_dir / variant
        variant_config = replace(config, attention=variant)
        print(f"== training {variant} -> {run_dir}", file=sys.stderr)
        resume_run = resume and (run_dir / "checkpoint.pt").exists()
        info = train(variant_config, run_dir, resume=resume_run, splits=splits)
        model, vocab, _ = load_trained(run_dir, config.device)
        scores = evaluate(
            model,
            splits["test"],
            vocab,
            config.device,
            config.beam_size,
            run_dir / "test_predictions.jsonl",
        )
        results[variant] = scores["per_depth"]
        summary["variants"][variant] = {**scores, "train": info}
    atomic_write_text(out_dir / "results.json", json.dumps(summary, indent=2, default=str) + "\n")
    print(format_table(results))
    return summary


# ---- plots ----------------------------------------------------------------------------------
def _runs_in(checkpoint: str | Path) -> list[Path]:
    """The run directories under ``checkpoint``: itself, or its none/simple/structured runs."""
    root = Path(checkpoint)
    if (root / "model.pt").exists() or root.suffix == ".pt":
        return [root]
    runs = [root / v for v in VARIANTS if (root / v / "model.pt").exists()]
    if not runs:
        raise FileNotFoundError(f"no trained model (model.pt) in {root} or its variant folders")
    return runs


def visualize(checkpoint: str | Path, source: str, out_dir: str | Path | None = None) -> list[Path]:
    """Figure 3 of the paper for one source: each model's self-attention over parents (rows =
    words, columns = candidate parents, each row sums to one) and the structured model's
    MAP dependency parse with its arc marginals. Returns the files written."""
    from .. import viz
    from ..data.tree_transduction import source_depth

    tokens = source.split()
    if not tokens:
        raise ValueError("`source` is empty")
    root = Path(checkpoint)
    out = Path(out_dir) if out_dir else (root if root.is_dir() else root.parent)
    written: list[Path] = []
    for run in _runs_in(checkpoint):
        model, vocab, config = load_trained(run)
        if model.self_attention is None:
            continue
        pair = Pair(tuple(tokens), (), source_depth(tokens))
        batch = collate([pair], vocab, torch.device("cpu"))
        unknown = [t for t in tokens if t not in vocab]
        if unknown:
            raise ValueError(f"`source` has tokens the model never saw: {unknown}")
        with torch.no_grad():
            _, parse = model.encode(batch.source, batch.source_mask)
            assert parse is not None
            marginals = parse.marginals[0]  # [N, N] p(i -> j), '$' at 0
            labels = ["$", *tokens]
            written.append(
                viz.attention_heatmap(
                    marginals.T[1:],
                    labels[1:],
                    labels,
                    out / f"{config.attention}_attention.png",
                    title=f"{config.attention}: p(parent | word)",
                    vmax=1.0,
                )
            )
            if config.attention == "structured":
                heads = model.self_attention.parse(
                    model.source_embedding(batch.source), batch.source_mask
                )
                written.append(
                    viz.dependency_arcs(
                        heads[0],
                        labels,
                        out / "structured_parse.png",
                        marginals=marginals,
                        title="structured: MAP parse (Eisner) and arc marginals",
                    )
                )
    if not written:
        raise ValueError(f"no model with self-attention (simple/structured) under {checkpoint}")
    return written
