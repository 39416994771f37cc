"""Recipe: language modelling with mean-field attention (Liu et al., appendix C.3, Tables 2-3).

Three models of the same size and budget on PTB and WikiText-2 (``corpus``): ``rnn`` (Elman,
tanh), ``lstm`` and ``mfa`` -- an LSTM whose output at every position also reads a context
vector from mean-field CRF attention over its last ``memory_size`` hidden states
(:class:`~structattn.models.mean_field_lm.MeanFieldLanguageModel`, k = ``iterations``).
Everything but the models comes from :mod:`structattn.recipes._lm` (the shared LM code):
windows of ``lm.bptt`` tokens with the state (for MFA also the tape of hidden states)
carried across them, test perplexity over the whole stream with ``<eos>`` counted,
predictions JSONL with per-sentence NLL.

The paper gives no model sizes or optimisation ("a very basic setup"); ours: embeddings and
hidden 200, one layer, dropout 0.2, SGD as the other LM recipes (lr 0.65 x0.85 on plateau,
clip 5, batch 40, bptt 35), ``memory_size`` 35.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import nn

from ..models.language_model import RNNLanguageModel
from ..models.mean_field_lm import MeanFieldLanguageModel
from ..training import TrainConfig
from ._lm import PAPER_LM_TRAIN, RNN_LR, LMEvalOptions, LMRecipeParts, LMSettings, use_rnn_lr
from .base import GridAxis, Preset, Recipe, Reporting, Tools
from .config import replace_path
from .tables import markdown_table

__all__ = ["MODELS", "PAPER_TABLES", "PARTS", "RECIPE", "MFALMConfig", "build_model"]

MODELS = ("rnn", "lstm", "mfa")
CORPORA = ("ptb", "wikitext-2")
NAMES = {"rnn": "RNN", "lstm": "LSTM", "mfa": "MFA"}
#: Tables 2-3: corpus -> model -> (test perplexity, validation perplexity)
PAPER_TABLES: dict[str, dict[str, tuple[float, float]]] = {
    "ptb": {"rnn": (138.48, 144.91), "lstm": (127.66, 136.82), "mfa": (109.76, 118.21)},
    "wikitext-2": {"rnn": (164.69, 178.01), "lstm": (131.32, 146.31), "mfa": (118.31, 121.01)},
}


@dataclass(frozen=True)
class MFALMConfig:
    """Settings of the LM experiment (the paper gives none; see the module docstring)."""

    model: str = "mfa"  # rnn | lstm | mfa
    corpus: str = "ptb"  # ptb | wikitext-2 (sets lm.corpus)
    embed_size: int = 200  # word embeddings
    hidden_size: int = 200  # LSTM / RNN size
    iterations: int = 5  # mfa: mean-field iterations k
    attention_dim: int = 32  # mfa: hidden size of the unary MLP and rank of J
    memory_size: int = 35  # mfa: earlier hidden states each position may attend to
    dropout: float = 0.2  # on the embeddings and on the output layer's input
    rnn_lr: float = RNN_LR  # the rnn model's SGD lr (replaces train.lr for it; 0.65 diverges)
    lm: LMSettings = field(default_factory=LMSettings)  # batches, bptt, evaluation
    train: TrainConfig = field(default_factory=lambda: replace(PAPER_LM_TRAIN, epochs=20))

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"`model` must be one of {MODELS}, got {self.model!r}")
        if self.corpus not in CORPORA:
            raise ValueError(f"`corpus` must be one of {CORPORA}, got {self.corpus!r}")
        if self.lm.corpus != self.corpus:  # one setting: `corpus` is the grid's axis
            object.__setattr__(self, "lm", replace(self.lm, corpus=self.corpus))  # type: ignore[arg-type]
        for name in ("embed_size", "hidden_size", "attention_dim", "memory_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if self.iterations < 0:
            raise ValueError(f"`iterations` must be >= 0, got {self.iterations}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {self.dropout!r}")
        use_rnn_lr(self)  # checks rnn_lr


def build_model(config: MFALMConfig, vocab_size: int) -> nn.Module:
    """The language model of ``config.model`` (seeded by ``config.train.seed``)."""
    torch.manual_seed(config.train.seed)
    if config.model == "mfa":
        return MeanFieldLanguageModel(
            vocab_size,
            config.embed_size,
            config.hidden_size,
            iterations=config.iterations,
            attention_dim=config.attention_dim,
            memory_size=config.memory_size,
            dropout=config.dropout,
        )
    cell: Literal["rnn", "lstm"] = "rnn" if config.model == "rnn" else "lstm"
    return RNNLanguageModel(
        vocab_size, config.embed_size, config.hidden_size, 1, cell, config.dropout
    )


PARTS = LMRecipeParts("mfa-lm", MFALMConfig, build_model)


def _table(results: Mapping[tuple[Any, ...], Mapping[str, Any]]) -> str:
    """Tables 2-3: validation and test perplexity per corpus and model beside the paper's."""
    rows = []
    for cell, summary in results.items():
        corpus, model = str(cell[0]), str(cell[1])
        test = (summary.get("test") or {}).get("perplexity")
        valid = (summary.get("valid") or {}).get("perplexity")
        paper = PAPER_TABLES.get(corpus, {}).get(model)
        rows.append(
            [
                corpus,
                NAMES.get(model, model),
                "-" if valid is None else f"{valid:.1f}",
                "-" if test is None else f"{test:.1f}",
                "-" if paper is None else f"{paper[1]:.2f}",
                "-" if paper is None else f"{paper[0]:.2f}",
            ]
        )
    header = ["Corpus", "Model", "valid ppl (ours)", "test ppl (ours)", "valid (paper)",
              "test (paper)"]  # fmt: skip
    return markdown_table(header, rows)


_CPU = replace_path(
    MFALMConfig(),
    {"lm.train_tokens": 1_000_000, "lm.test_batch_size": 10, "train.epochs": 3,
     "train.log_every": 100},
)  # fmt: skip
_QUICK = replace_path(
    MFALMConfig(),
    {"embed_size": 8, "hidden_size": 8, "attention_dim": 4, "memory_size": 6,
     "iterations": 2, "lm.batch_size": 4, "lm.bptt": 10, "lm.eval_batch_size": 2,
     "lm.train_tokens": 400, "lm.eval_tokens": 120, "train.epochs": 1,
     "train.progress": False, "train.log_every": 10},
)  # fmt: skip

RECIPE = Recipe(
    name="mfa-lm",
    summary="Liu et al. C.3, Tables 2-3: PTB / WikiText-2 language modelling, RNN / LSTM / "
    "LSTM with mean-field attention",
    config=MFALMConfig,
    presets={
        "paper": Preset(MFALMConfig(), "whole corpora, emb/hidden 200, SGD, 20 epochs"),
        "cpu": Preset(
            _CPU,
            "the first 1M training tokens (all of PTB, 48% of WikiText-2), 3 "
            "epochs, test in 10 rows",
        ),
        "quick": Preset(_QUICK, "seconds: 400 training tokens, tiny models (smoke tests)"),
    },
    grid=(GridAxis("corpora", "corpus", CORPORA), GridAxis("models", "model", MODELS)),
    train=PARTS.train,
    score=PARTS.score,
    evaluate=PARTS.evaluate,
    cell_dir=lambda config: f"{config.corpus}/{config.model}",
    resumable=frozenset({"lm.test_batch_size"}),
    report=Reporting(
        table=_table,
        paper={
            "source": "Liu et al., Tables 2-3 (test and validation perplexity)",
            **{
                c: {m: {"perplexity": v[0], "valid": v[1]} for m, v in t.items()}
                for c, t in PAPER_TABLES.items()
            },
        },
    ),
    tools=Tools(eval_options=LMEvalOptions),
)
