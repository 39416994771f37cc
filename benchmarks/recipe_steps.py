"""One speed table for every recipe: a training step, structured vs simple (issue 22, item 4).

Usage::

    .venv/bin/python benchmarks/recipe_steps.py [--quick] [--only NAME ...] [--repeats R]
        [--warmup W] [--threads T] [--batches K] [--json OUT]

For each recipe, its structured variant and its simple variant are built through the
recipe's own public functions (config ``RECIPE.presets["cpu"].config``, or ``"quick"`` with
``--quick``; the recipe's data loading, batching, collation, model builder and loss) and one
timed call runs K full training steps of each (forward, loss normalised as the training loop
does, backward, gradient clipping with the config's norm, the config's optimiser step) on
the same K batches: the first K batches of the recipe's first epoch (shuffled, so a sample of
the training lengths), or for the language models K consecutive BPTT windows of the train
stream with the recurrent state (LSTMN tape, PRPN memory) carried from window to window and
from call to call, detached, as in training. Calls are interleaved (``timing.py``); ms/step
is the median call divided by K, ``ratio`` the median over repeats of structured / simple
measured within one repeat (as ``end_to_end.py``). The loss of every variant is checked to
be finite before timing.

Rows (``--only`` takes the names in the first column)::

    tree-transduction  structured (dependency CRF) vs simple (softmax) self-attention
    nmt                segmentation attention vs softmax attention, char source
    nli                syntactic (structured) vs simple intra-attention
    mfa                mean-field attention k = 5 vs softmax (Bahdanau) attention, sorting
    lstmn-lm           LSTMN vs LSTM, 1 layer, same sizes (per token: same windows)
    prpn               PRPN (stick-breaking) vs the recipe's same-size LSTM (per token)
    transformer        StructuredMultiheadAttention (2 projective + 2 softmax heads) vs
                       nn.MultiheadAttention in the classifier of ``transformer.py``
                       (its sizes and its Adam step, no clipping; no recipe)

Targets (issue 22): structured <= 1.5x simple; LSTMN and PRPN <= 2x the LSTM per token (the
two variants of an LM row run the same windows, so the time ratio is the per-token ratio).
A row whose recipe cannot be built is printed as ``n/a: reason``; the exit status is 0.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from timing import time_interleaved
from torch import Tensor, nn

from structattn.models.language_model import detach_state
from structattn.recipes.tables import markdown_table
from structattn.training import TrainConfig, make_optimizer

CPU = torch.device("cpu")

#: (loss sum, examples, tokens, new state) of one batch; ``state`` is None for the recipes
#: that carry nothing from batch to batch (as ``Task.stateful_loss``)
StatefulLoss = Callable[[nn.Module, Any, Any], tuple[Tensor, Any, Any, Any]]


@dataclass
class Comparison:
    """The two timed callables of a row (each runs ``steps`` training steps) and its sizes."""

    structured: Callable[[], object]
    simple: Callable[[], object]
    steps: int  # training steps per call
    sizes: str  # what one step is, for the table's notes


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    name: str  # --only name (the recipe's)
    structured: str  # label of the structured variant
    simple: str  # label of the simple variant
    target: float  # the bound on structured / simple
    build: Callable[[bool, int], Comparison]  # (quick, batches) -> the two callables


# ---- the training step ------------------------------------------------------------------------
def _stateless(
    loss: Callable[[nn.Module, Any], tuple[Tensor, Any, Any]],
) -> StatefulLoss:
    def wrapped(model: nn.Module, batch: Any, state: Any) -> tuple[Tensor, Any, Any, Any]:
        return (*loss(model, batch), None)

    return wrapped


def training_call(
    model: nn.Module, loss: StatefulLoss, batches: Sequence[Any], train: TrainConfig
) -> Callable[[], Tensor]:
    """A callable running one training step per batch of ``batches``, as ``fit`` does: the
    summed loss divided by the examples or tokens (``train.loss_normalizer``), backward,
    ``clip_grad_norm_`` with ``train.max_grad_norm``, a step of ``train``'s optimiser; the
    state returned by ``loss`` is carried (detached) to the next batch and the next call.
    Returns the sum of the steps' summed losses (a 0-dim tensor, for the finiteness check)."""
    model.train()
    optimizer = make_optimizer(model.parameters(), train)
    normalizer = train.loss_normalizer
    carried: dict[str, Any] = {"state": None}

    def call() -> Tensor:
        total = torch.zeros(())
        for batch in batches:
            loss_sum, examples, tokens, state = loss(model, batch, carried["state"])
            carried["state"] = detach_state(state)
            count = {"examples": examples, "tokens": tokens}.get(normalizer, 1)
            optimizer.zero_grad(set_to_none=True)
            (loss_sum / count).backward()
            if train.max_grad_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), train.max_grad_norm)
            optimizer.step()
            total = total + loss_sum.detach()
        return total

    return call


def _first(batches: Sequence[Any], count: int) -> list[Any]:
    if len(batches) < count:
        raise ValueError(f"the training data has {len(batches)} batches, {count} asked")
    return list(batches[:count])


def _preset(recipe: Any, quick: bool) -> Any:
    return recipe.presets["quick" if quick else "cpu"].config


# ---- the rows ---------------------------------------------------------------------------------
def tree_transduction(quick: bool, count: int) -> Comparison:
    """SAN 4.1: the seq2seq with structured vs simple encoder self-attention."""
    from structattn.data.tree_transduction import Vocabulary
    from structattn.recipes import tree_transduction as recipe

    config = _preset(recipe.RECIPE, quick)
    splits = recipe.load_data(config)
    vocab = Vocabulary.build(splits["train"])
    chosen = _first(
        recipe.batches_for_epoch(splits["train"], config.batch_size, config.train.seed, 1), count
    )
    batches = [recipe.collate(b, vocab, CPU) for b in chosen]
    calls = {}
    for variant in ("structured", "simple"):
        variant_config = replace(config, attention=variant)
        model = recipe.build_model(variant_config, vocab)
        loss = _stateless(recipe.sequence_loss)
        calls[variant] = training_call(model, loss, batches, variant_config.train)
    lengths = [int(b.source_mask.sum(1).max()) for b in batches]
    return Comparison(
        calls["structured"],
        calls["simple"],
        count,
        f"l = {config.dim}, batch {config.batch_size}, longest source per batch "
        f"{min(lengths)}-{max(lengths)} tokens, {config.train.optimizer.upper()}",
    )


def nmt(quick: bool, count: int) -> Comparison:
    """SAN 4.2: the encoder-decoder with segmentation vs softmax attention (char source)."""
    from structattn.recipes import nmt as recipe

    config = replace(_preset(recipe.RECIPE, quick), source="char")
    splits, _ = recipe.load_data(config)
    vocabs = recipe.build_vocabularies(config, splits["train"])
    chosen = _first(
        recipe.batches_for_epoch(splits["train"], config.batch_size, config.train.seed, 1), count
    )
    batches = [recipe.collate(b, vocabs, config.source, CPU) for b in chosen]
    calls = {}
    for variant in ("structured", "simple"):
        variant_config = replace(config, attention=variant)
        model = recipe.build_model(variant_config, vocabs)
        loss = _stateless(recipe.sequence_loss)
        calls[variant] = training_call(model, loss, batches, variant_config.train)
    sources = [int(b.source_mask.sum(1).max()) for b in batches]
    targets = [b.target_out.shape[1] for b in batches]
    return Comparison(
        calls["structured"],
        calls["simple"],
        count,
        f"{config.layers} x {config.hidden_dim} LSTMs, batch {config.batch_size}, longest "
        f"source per batch {min(sources)}-{max(sources)} chars, target "
        f"{min(targets)}-{max(targets)} tokens",
    )


def nli(quick: bool, count: int) -> Comparison:
    """SAN 4.4: decomposable attention with syntactic vs simple intra-attention (SICK)."""
    import torch.nn.functional as F

    from structattn.data.classification import NLI_LABELS, LabelVocabulary
    from structattn.data.nli import EncodedPairs
    from structattn.models.nli import forward_batch
    from structattn.recipes import nli as recipe

    config = _preset(recipe.RECIPE, quick)
    splits, words, table = recipe.prepare(config)  # data, vocabulary, fixed GloVe table
    train_set = EncodedPairs(splits["train"], words, LabelVocabulary(NLI_LABELS))
    # the recipe's batches are drawn from buckets of similar premise lengths: the same here
    order = list(range(len(train_set)))
    random.Random(config.train.seed).shuffle(order)
    size = config.batch_size
    if len(order) < count * size:
        raise ValueError(f"the training data has {len(order)} pairs, {count * size} asked")
    picked = sorted(order[: count * size], key=lambda i: len(train_set.premise[i]))
    batches = [train_set.batch(picked[k : k + size], CPU) for k in range(0, count * size, size)]

    def loss(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int, int]:
        logits = forward_batch(model, batch).logits  # [B, 3]
        n = int(batch["labels"].shape[0])
        return F.cross_entropy(logits, batch["labels"], reduction="sum"), n, n

    calls = {}
    for variant in ("structured", "simple"):
        variant_config = replace(config, attention=variant)
        model = recipe.build_model(variant_config, table.weight)
        calls[variant] = training_call(model, _stateless(loss), batches, variant_config.train)
    lengths = [int(b["premise_mask"].sum(1).max()) for b in batches]
    return Comparison(
        calls["structured"],
        calls["simple"],
        count,
        f"{config.dataset}, hidden {config.hidden_dim}, parser {config.parser_dim}, batch "
        f"{size}, longest premise per batch {min(lengths)}-{max(lengths)} words",
    )


def mfa(quick: bool, count: int) -> Comparison:
    """Liu et al. 3.2: sorting seq2seq with mean-field attention (k = 5) vs softmax."""
    from structattn.recipes import mfa as recipe

    config = replace(_preset(recipe.RECIPE, quick), task="sorting")
    splits = recipe.load_data(config)
    chosen = _first(
        recipe.batches_for_epoch(splits["train"], config.batch_size, config.train.seed, 1), count
    )
    batches = [recipe.collate(b, CPU, config.max_value) for b in chosen]
    calls = {}
    for name, variant_config in (
        ("structured", replace(config, model="mfa", iterations=5)),
        ("simple", replace(config, model="attention")),
    ):
        model = recipe.build_model(variant_config)
        loss = _stateless(recipe.batch_loss)
        calls[name] = training_call(model, loss, batches, variant_config.train)
    lengths = [b.source.shape[1] for b in batches]
    return Comparison(
        calls["structured"],
        calls["simple"],
        count,
        f"hidden {config.hidden_dim}, attention {config.attention_dim}, batch "
        f"{config.batch_size}, longest input per batch {min(lengths)}-{max(lengths)}",
    )


def _lm_loss(
    model: nn.Module, batch: tuple[Tensor, Tensor], state: Any
) -> tuple[Tensor, int, int, Any]:
    """The summed next-word NLL of a window (as ``recipes._lm``'s training loss)."""
    import torch.nn.functional as F

    inputs, targets = batch
    b, t = inputs.shape
    if state is None:
        state = model.initial_state(b, inputs.device)  # type: ignore[operator]
    logits, state = model(inputs, state)  # [B, T, V]
    loss = F.cross_entropy(
        logits.reshape(b * t, -1).float(), targets.reshape(b * t), reduction="sum"
    )
    return loss, b, b * t, state


def _lm(recipe: Any, structured: str, simple: str, quick: bool, count: int) -> Comparison:
    """Two models of a LM recipe (its ``build_model``) on the same BPTT windows."""
    from structattn.data.lm import batchify, bptt_windows
    from structattn.recipes._lm import lm_stream, load_corpus

    config = _preset(recipe.RECIPE, quick)
    settings = config.lm
    vocab_size = len(load_corpus(settings).vocab)
    data = batchify(lm_stream(settings, "train"), settings.batch_size)  # [B, L]
    windows = [w for w in bptt_windows(data, settings.bptt) if w.inputs.shape[1] == settings.bptt]
    batches = [(w.inputs, w.targets) for w in _first(windows, count)]
    calls = {}
    for name, model_name in (("structured", structured), ("simple", simple)):
        variant_config = replace(config, model=model_name)
        model = recipe.build_model(variant_config, vocab_size)
        calls[name] = training_call(model, _lm_loss, batches, variant_config.train)
    return Comparison(
        calls["structured"],
        calls["simple"],
        count,
        f"V {vocab_size}, emb {config.embed_size}, hidden {config.hidden_size}, "
        f"{getattr(config, 'layers', 1)} layer(s), {settings.batch_size} x {settings.bptt} "
        f"tokens per step, {config.train.optimizer.upper()}",
    )


def lstmn_lm(quick: bool, count: int) -> Comparison:
    """Cheng et al. 5.1: LSTMN vs LSTM language model (PTB), one layer each."""
    from structattn.recipes import lstmn_lm as recipe

    return _lm(recipe, "lstmn", "lstm", quick, count)


def prpn(quick: bool, count: int) -> Comparison:
    """Shen et al.: PRPN (stick-breaking) vs the recipe's LSTM of the same size (PTB)."""
    from structattn.recipes import prpn as recipe

    return _lm(recipe, "prpn-sb", "lstm", quick, count)


#: the configurations of ``transformer.py`` compared here
TRANSFORMER_STRUCTURED = "SMHA 2 projective"
TRANSFORMER_SIMPLE = "nn.MultiheadAttention"


def transformer(quick: bool, count: int) -> Comparison:
    """``transformer.py``'s classifier: StructuredMultiheadAttention vs nn.MultiheadAttention
    (its sizes; one call = one step of its own, so ``count`` is not used)."""
    import transformer as bench  # benchmarks/transformer.py

    # transformer.py's measure() sizes (it has no preset to import)
    sizes = (
        dict(batch=4, length=6, dim=16, heads=4, layers=1)
        if quick
        else dict(batch=32, length=20, dim=64, heads=4, layers=2)
    )
    fns = bench.training_steps(**sizes)
    return Comparison(
        fns[TRANSFORMER_STRUCTURED],
        fns[TRANSFORMER_SIMPLE],
        1,
        f"{sizes['layers']} layer(s), d = {sizes['dim']}, {sizes['heads']} heads, "
        f"B = {sizes['batch']}, L = {sizes['length']}, Adam, no clipping",
    )


ROWS: tuple[Row, ...] = (
    Row("tree-transduction", "structured self-attention", "simple self-attention", 1.5,
        tree_transduction),
    Row("nmt", "segmentation attention (char)", "softmax attention (char)", 1.5, nmt),
    Row("nli", "syntactic intra-attention", "simple intra-attention", 1.5, nli),
    Row("mfa", "MFA k = 5 (sorting)", "softmax attention (sorting)", 1.5, mfa),
    Row("lstmn-lm", "LSTMN (per token)", "LSTM (per token)", 2.0, lstmn_lm),
    Row("prpn", "PRPN stick-breaking (per token)", "LSTM same size (per token)", 2.0, prpn),
    Row("transformer", "StructuredMultiheadAttention, 2 projective heads",
        "nn.MultiheadAttention", 1.5, transformer),
)  # fmt: skip


# ---- measuring and printing -------------------------------------------------------------------
def measure(row: Row, quick: bool, count: int, repeats: int, warmup: int) -> dict[str, Any]:
    """The row's result: ms per step of each variant, the median within-repeat ratio
    structured / simple, the target and whether it is met; or ``error`` (n/a)."""
    result: dict[str, Any] = {
        "recipe": row.name,
        "structured": row.structured,
        "simple": row.simple,
        "target": row.target,
    }
    try:
        comparison = row.build(quick, count)
        for name, call in (("structured", comparison.structured), ("simple", comparison.simple)):
            value = call()  # one untimed call: the loss must be finite
            if isinstance(value, Tensor) and not bool(torch.isfinite(value).all()):
                raise FloatingPointError(f"the {name} variant's loss is {float(value)}")
        fns = {"structured": comparison.structured, "simple": comparison.simple}
        timings = time_interleaved(fns, repeats, warmup)
    except Exception as error:  # a row the API does not allow: printed, not fatal
        result["error"] = f"{type(error).__name__}: {error}"
        return result
    structured, simple = timings["structured"].samples, timings["simple"].samples
    ratio = statistics.median(s / r for s, r in zip(structured, simple, strict=True))
    result.update(
        structured_ms=1000 * timings["structured"].median / comparison.steps,
        simple_ms=1000 * timings["simple"].median / comparison.steps,
        ratio=ratio,
        met=ratio <= row.target,
        steps=comparison.steps,
        sizes=comparison.sizes,
        samples={k: t.samples for k, t in timings.items()},
    )
    return result


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """The Markdown table: one line per row, ``n/a: reason`` for a row that failed."""
    header = ["Recipe", "Structured", "Simple", "Structured ms/step", "Simple ms/step",
              "Ratio", "Target", "Met"]  # fmt: skip
    lines = []
    for r in results:
        target = f"<= {r['target']:g}x"
        if "error" in r:
            lines.append([r["recipe"], r["structured"], r["simple"], "n/a", "n/a", "n/a",
                          target, f"n/a: {r['error']}"])  # fmt: skip
            continue
        lines.append(
            [r["recipe"], r["structured"], r["simple"], f"{r['structured_ms']:.1f}",
             f"{r['simple_ms']:.1f}", f"{r['ratio']:.2f}", target, "yes" if r["met"] else "no"]
        )  # fmt: skip
    return markdown_table(header, lines)


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    names = [row.name for row in ROWS]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the recipes' quick presets")
    parser.add_argument("--only", action="append", choices=names, help="a row (repeatable)")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--batches", type=int, help="training steps per timed call (default 8; --quick: 2)"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.batches is None:
        args.batches = 2 if args.quick else 8
    if args.repeats < 1 or args.warmup < 0 or args.batches < 1:
        parser.error("need --repeats >= 1, --warmup >= 0, --batches >= 1")
    torch.set_num_threads(args.threads)
    rows = [row for row in ROWS if not args.only or row.name in args.only]
    commit = _commit()
    print(
        f"commit {commit or '?'}, threads {args.threads}, repeats {args.repeats}, "
        f"{args.batches} steps per call, {'quick' if args.quick else 'cpu'} presets; "
        "ratio = median over repeats of structured / simple",
        flush=True,
    )
    results = []
    for row in rows:
        result = measure(row, args.quick, args.batches, args.repeats, args.warmup)
        results.append(result)
        status = result.get("error") or f"ratio {result['ratio']:.2f}"
        print(f"  {row.name}: {status}", file=sys.stderr, flush=True)
    print()
    print(format_table(results))
    print()
    for r in results:
        if "sizes" in r:
            print(f"- {r['recipe']}: {r['sizes']}")
    if args.json is not None:
        payload = {
            "commit": commit,
            "threads": args.threads,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "batches": args.batches,
            "quick": args.quick,
            "rows": results,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
