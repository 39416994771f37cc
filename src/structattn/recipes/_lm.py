"""The shared pieces of every word-level language-modelling recipe (LSTMN, PRPN, MFA, ...).

A LM recipe writes only its model: a config dataclass with two nested fields,
``lm: LMSettings`` (corpus, batches, BPTT, evaluation) and ``train: TrainConfig`` (SGD, lr
decay on plateau, clipping), plus its own model fields, and a *model builder*
``(config, vocab_size) -> nn.Module`` whose module follows the interface of
:mod:`structattn.models.language_model` (``forward(inputs [B, T], state) -> (logits
[B, T, V], state)``, ``initial_state(batch, device)``). :class:`LMRecipeParts` turns these into
the ``train`` / ``score`` / ``evaluate`` functions of a :class:`~structattn.recipes.base.Recipe`::

    PARTS = LMRecipeParts("my-lm", MyLMConfig, build_model)
    RECIPE = Recipe(name="my-lm", ..., train=PARTS.train, score=PARTS.score,
                    evaluate=PARTS.evaluate, tools=Tools(eval_options=LMEvalOptions))

(the default ``select`` of a recipe, the best validation ``metric``, is minus the best
validation perplexity here).

What they do (on :mod:`structattn.data.lm` and the platform's :func:`~structattn.training.fit`):

* **Training**: the train stream is cut into ``lm.batch_size`` contiguous rows
  (:func:`~structattn.data.lm.batchify`) and walked in windows of ``lm.bptt`` tokens
  (:func:`~structattn.data.lm.bptt_windows`), the same windows every epoch. The model's state
  is carried from window to window (``Task.stateful_loss``; the loop detaches it, so gradients
  stop at window boundaries) and restarts at ``initial_state`` every epoch. The loss is the
  window's NLL summed over its time steps and averaged over its rows
  (``train.normalize_by="examples"``, Zaremba et al.'s convention that an SGD lr of 0.65-1
  assumes; ``"tokens"`` divides by bptt more, i.e. a 35x smaller step).
* **Validation** after every epoch: the perplexity of the valid stream in rows of
  ``lm.eval_batch_size`` (:func:`~structattn.data.lm.evaluate_stream`); the selection metric
  is ``-perplexity``, which the ``"plateau"`` schedule uses to decay the lr.
* **Test** (``score`` / ``eval``): perplexity = ``exp(total NLL / tokens)`` over the whole
  stream with every ``<eos>`` counted, in rows of ``lm.test_batch_size`` (1 = every token
  but the first is predicted, as usual for PTB); the predictions JSONL holds a summary line
  ``{"split", "tokens", "nll", "perplexity"}`` (``nll``: mean per token, nats) and, with
  batch size 1, one line per sentence ``{"index", "sentence", "nll", "tokens"}`` (``nll``:
  summed over the sentence's words and its ``<eos>``; :func:`~structattn.data.lm.line_nll`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.lm import (
    LMCorpus,
    LMVocabulary,
    batchify,
    bptt_windows,
    default_lm_data_dir,
    evaluate_stream,
    line_nll,
    load_lm_corpus,
)
from ..training import Task, TrainConfig, fit, load_model_state
from . import runs
from .config import config_from_dict, config_to_dict

__all__ = [
    "perplexity_bars",
    "PAPER_LM_TRAIN",
    "RNN_LR",
    "LMEvalOptions",
    "LMRecipeParts",
    "LMSettings",
    "ModelBuilder",
    "evaluate_lm",
    "lm_stream",
    "load_corpus",
    "train_lm",
    "use_rnn_lr",
]

ModelBuilder = Callable[[Any, int], nn.Module]
"""``(recipe config, vocabulary size) -> language model`` (the interface of
:mod:`structattn.models.language_model`); seed ``torch`` inside for reproducible inits."""

#: the usual PTB optimisation (Cheng et al. 2016, sec. 5.1): SGD 0.65, the lr times 0.85
#: after every epoch whose validation perplexity does not improve by 1% (our reading of
#: "significantly"), gradient norm 5, the loss summed over the window's time steps and
#: averaged over its rows (Zaremba et al. 2014's convention, which lr 0.65 assumes: averaged
#: over tokens instead, one epoch on 200K PTB tokens reached valid ppl 902 instead of 707)
PAPER_LM_TRAIN = TrainConfig(
    epochs=30,
    lr=0.65,
    max_grad_norm=5.0,
    decay_factor=0.85,
    lr_schedule="plateau",
    plateau_threshold=0.01,
    plateau_threshold_mode="rel",
    normalize_by="examples",
    log_every=100,
)


#: SGD lr of the Elman RNN baselines: with the loss summed over the window (above) lr 0.65
#: diverges for them (valid ppl 10,896 after one PTB epoch, mfa-lm sizes). Measured (mfa-lm
#: cpu sizes, 2 epochs on 300K PTB tokens, valid ppl): 0.1 631.6, 0.2 523.9, 0.3 524.0,
#: 0.5 4,337 after its first epoch (diverging); 0.2 is the best and furthest from divergence
RNN_LR = 0.2


def use_rnn_lr(config: Any) -> None:
    """In a recipe config's ``__post_init__``: the ``rnn`` model trains with ``config.rnn_lr``
    instead of ``config.train.lr`` (the LSTMs' rate), so the saved config says what ran;
    ``ValueError`` unless ``rnn_lr`` > 0."""
    if config.rnn_lr <= 0:
        raise ValueError(f"`rnn_lr` must be > 0, got {config.rnn_lr!r}")
    if config.model == "rnn" and config.train.lr != config.rnn_lr:
        object.__setattr__(config, "train", replace(config.train, lr=config.rnn_lr))


@dataclass(frozen=True)
class LMSettings:
    """Data, batching and evaluation of a language-modelling run (defaults: PTB, batch 40)."""

    corpus: Literal["ptb", "wikitext-2"] = "ptb"  # corpus in ../shared/data/<corpus>
    data_dir: str = ""  # directory with the corpus files ("" = ../shared/data/<corpus>)
    batch_size: int = 40  # training rows (contiguous streams) per window
    bptt: int = 35  # tokens per window of truncated backpropagation through time
    eval_batch_size: int = 10  # rows of the valid stream during training (the selection)
    test_batch_size: int = 1  # rows in score / eval (1 scores every token, per sentence)
    train_tokens: int = 0  # use only the first N tokens of train (0 = all; quick runs)
    eval_tokens: int = 0  # use only the first N tokens of valid and test (0 = all)

    def __post_init__(self) -> None:
        if self.corpus not in ("ptb", "wikitext-2"):
            raise ValueError(f"`corpus` must be ptb or wikitext-2, got {self.corpus!r}")
        for name in ("batch_size", "bptt", "eval_batch_size", "test_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        for name in ("train_tokens", "eval_tokens"):
            value = getattr(self, name)
            if value != 0 and value < 2:
                raise ValueError(f"`{name}` must be 0 (all) or >= 2, got {value!r}")


@dataclass(frozen=True)
class LMEvalOptions:
    """``structattn eval <lm recipe>``'s own flags."""

    split: Literal["valid", "test"] = "test"  # the stream to score
    batch_size: int | None = field(default=None, metadata={"help": "default: the run's "
                                   "test_batch_size (1 gives per-sentence lines)"})  # fmt: skip
    data_dir: str | None = field(default=None, metadata={"help": "default: the run's"})


# ---- data -----------------------------------------------------------------------------------
_CORPORA: dict[str, LMCorpus] = {}  # data directory -> corpus (read once per process)


def load_corpus(settings: LMSettings) -> LMCorpus:
    """The corpus of ``settings`` (cached per process; the vocabulary is always built from
    the whole train file, so a cut ``train_tokens`` keeps the published output size)."""
    directory = Path(settings.data_dir) if settings.data_dir else default_lm_data_dir(
        settings.corpus
    )  # fmt: skip
    key = str(directory.resolve())
    if key not in _CORPORA:
        _CORPORA[key] = load_lm_corpus(directory)
    return _CORPORA[key]


def lm_stream(settings: LMSettings, split: str) -> Tensor:
    """The id stream of ``split`` (LongTensor [N]), cut to ``train_tokens`` / ``eval_tokens``."""
    stream = load_corpus(settings).streams[split]
    limit = settings.train_tokens if split == "train" else settings.eval_tokens
    return stream[:limit] if limit else stream


def _initial(model: nn.Module, batch: int, device: torch.device) -> Any:
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    initial = getattr(inner, "initial_state", None)
    if initial is None:
        raise TypeError(f"{type(inner).__name__} has no initial_state(batch, device)")
    return initial(batch, device)


# ---- evaluation -----------------------------------------------------------------------------
def evaluate_lm(
    model: nn.Module,
    stream: Tensor,
    batch_size: int,
    bptt: int,
    vocab: LMVocabulary | None = None,
    split: str = "test",
    predictions: str | Path | None = None,
) -> dict[str, Any]:
    """Perplexity of ``model`` over ``stream`` (LongTensor [N]) in ``batch_size`` rows:
    ``{"split", "tokens", "nll" (mean per token), "perplexity", "seconds"}``.

    With ``predictions`` writes the JSONL of the module docstring (per-sentence lines only
    with ``batch_size=1``; ``vocab`` gives the sentences' words). Puts ``model`` in eval mode.
    """
    device = next(model.parameters()).device
    model.eval()
    data = batchify(stream, batch_size).to(device)  # [B, L]
    keep = predictions is not None and batch_size == 1
    started = time.time()
    result = evaluate_stream(
        lambda inputs, state: model(inputs, state),
        data,
        bptt,
        state=_initial(model, batch_size, device),
        keep_token_nll=keep,
    )
    summary = {
        "split": split,
        "tokens": result.tokens,
        "nll": result.mean_nll,
        "perplexity": result.perplexity,
        "seconds": time.time() - started,
    }
    if predictions is not None:
        records: list[dict[str, Any]] = [
            {k: summary[k] for k in ("split", "tokens", "nll", "perplexity")}
        ]
        if keep:
            assert result.token_nll is not None
            kept = stream[: data.numel()]
            ids = kept.tolist()
            start = 0
            for index, (nll, tokens) in enumerate(line_nll(kept, result.token_nll)):
                end = start + tokens + (1 if index == 0 else 0)  # first line: first token unscored
                words = ids[start:end]
                if words and words[-1] == 0:
                    words = words[:-1]  # the sentence without its <eos>
                sentence = " ".join(vocab.decode(words)) if vocab is not None else None
                records.append({"index": index, "sentence": sentence, "nll": nll, "tokens": tokens})
                start = end
        runs.write_jsonl(predictions, records)
    return summary


# ---- training -------------------------------------------------------------------------------
def train_lm(
    config: Any,
    run_dir: str | Path,
    resume: bool,
    build_model: ModelBuilder,
    recipe: str,
) -> dict[str, Any]:
    """Train the LM ``build_model(config, V)`` into ``run_dir`` with ``fit``; ``config`` is a
    recipe config with ``lm: LMSettings`` and ``train: TrainConfig`` fields. Returns fit's
    summary (``metrics.jsonl`` logs the training tokens per second)."""
    settings: LMSettings = config.lm
    corpus = load_corpus(settings)
    vocab = corpus.vocab
    model = build_model(config, len(vocab))
    data = batchify(lm_stream(settings, "train"), settings.batch_size)  # [B, L]
    valid = batchify(lm_stream(settings, "valid"), settings.eval_batch_size)  # [B', L']
    on_device: dict[str, Tensor] = {}

    def device_data(name: str, tensor: Tensor, where: torch.device) -> Tensor:
        key = f"{name}:{where}"
        if key not in on_device:
            on_device[key] = tensor.to(where)
        return on_device[key]

    # an example is (row, start, length): DDP ranks take rows r::w, the same in every window
    windows = [
        [(row, w.start, w.inputs.shape[1]) for row in range(settings.batch_size)]
        for w in bptt_windows(data, settings.bptt)
    ]

    def collate(
        examples: Sequence[tuple[int, int, int]], where: torch.device
    ) -> tuple[Tensor, Tensor]:
        rows = torch.tensor([e[0] for e in examples], device=where)
        _, start, length = examples[0]
        full = device_data("train", data, where)
        inputs = full[rows, start : start + length]  # [B, T]
        targets = full[rows, start + 1 : start + 1 + length]  # [B, T]
        return inputs, targets

    def stateful_loss(
        m: nn.Module, batch: tuple[Tensor, Tensor], state: Any
    ) -> tuple[Tensor, int, int, Any]:
        inputs, targets = batch
        b, t = inputs.shape
        if state is None:
            state = _initial(m, b, inputs.device)
        logits, state = m(inputs, state)  # [B, T, V]
        loss = F.cross_entropy(
            logits.reshape(b * t, -1).float(), targets.reshape(b * t), reduction="sum"
        )
        return loss, b, b * t, state

    def validate(m: nn.Module) -> dict[str, float]:
        where = next(m.parameters()).device
        result = evaluate_stream(
            lambda inputs, state: m(inputs, state),
            device_data("valid", valid, where),
            settings.bptt,
            state=_initial(m, valid.shape[0], where),
        )
        return {
            "metric": -result.perplexity,
            "perplexity": result.perplexity,
            "nll": result.mean_nll,
        }

    task = Task(
        model=model,
        batches=lambda epoch: windows,
        collate=collate,
        stateful_loss=stateful_loss,
        validate=validate,
        config={"recipe": recipe, **config_to_dict(config)},
        extra={"vocab_size": len(vocab)},
    )
    train_config = config.train if config.train.name else replace(config.train, name=recipe)
    return fit(task, train_config, Path(run_dir), resume=resume)


@dataclass(frozen=True)
class LMRecipeParts:
    """``train`` / ``score`` / ``evaluate`` / ``load`` of a LM recipe from its name, config
    class (with ``lm`` and ``train`` fields) and model builder."""

    recipe: str  # the recipe's name, saved in config.json (checked when loading)
    config_class: type  # the recipe's config dataclass
    build_model: ModelBuilder  # (config, vocab_size) -> language model

    def train(self, config: Any, run_dir: Path, resume: bool = False) -> dict[str, Any]:
        """Train one model into ``run_dir`` (:func:`train_lm`)."""
        return train_lm(config, run_dir, resume, self.build_model, self.recipe)

    def load(self, run_dir: str | Path, device: str = "cpu") -> tuple[nn.Module, Any]:
        """The best model of a run directory (``model.pt``, eval mode) and its config."""
        state = load_model_state(run_dir)
        saved = state["config"]
        if saved.get("recipe") != self.recipe:
            raise ValueError(f"{run_dir} is not a {self.recipe} run ({saved.get('recipe')!r})")
        config: Any = config_from_dict(self.config_class, saved)
        model = self.build_model(config, int(state["extra"]["vocab_size"]))
        model.load_state_dict(state["model"])
        return model.to(device).eval(), config

    def score(self, config: Any, run_dir: Path) -> dict[str, Any]:
        """The run's best validation perplexity and its test scores; writes
        ``test_predictions.jsonl`` in the run directory."""
        model, _ = self.load(run_dir, config.train.device)
        valid = dict(load_model_state(run_dir)["valid"])
        settings: LMSettings = config.lm
        test = evaluate_lm(
            model,
            lm_stream(settings, "test"),
            settings.test_batch_size,
            settings.bptt,
            load_corpus(settings).vocab,
            "test",
            Path(run_dir) / "test_predictions.jsonl",
        )
        return {"valid": valid, "test": test}

    def evaluate(
        self, run_dir: Path, options: LMEvalOptions, device: str, predictions: Path | None
    ) -> str:
        """``structattn eval``: perplexity of a split (predictions JSONL optional)."""
        model, config = self.load(run_dir, device)
        settings: LMSettings = config.lm
        if options.data_dir:
            settings = replace(settings, data_dir=options.data_dir)
        batch = options.batch_size or settings.test_batch_size
        result = evaluate_lm(
            model,
            lm_stream(settings, options.split),
            batch,
            settings.bptt,
            load_corpus(settings).vocab,
            options.split,
            predictions,
        )
        return (
            f"{self.recipe} {options.split}: perplexity {result['perplexity']:.2f} "
            f"({result['tokens']} tokens, batch {batch}, {result['seconds']:.1f} s)"
        )


def perplexity_bars(
    results: Mapping[tuple[Any, ...], Mapping[str, Any]],
    out: Path,
    paper: Mapping[str, float],
    names: Mapping[str, str],
) -> list[Path]:
    """``plots`` of an LM recipe whose grid is its models: test perplexity per model (bars)
    beside the paper's (ticks), ``out/perplexity.png``; [] without matplotlib."""
    from .. import viz

    models = [str(cell[0]) for cell in results]
    ours = {"ours": [(s.get("test") or {}).get("perplexity") for s in results.values()]}
    reference = {"ours": [paper.get(m) for m in models]}
    try:
        return [
            viz.grouped_bars(
                [names.get(m, m) for m in models],
                ours,
                out / "perplexity.png",
                reference=reference,
                title="PTB test perplexity (bars: ours; ticks: paper)",
                ylabel="perplexity",
            )
        ]
    except ImportError as error:
        print(f"no plots: {error}", file=sys.stderr)
        return []
