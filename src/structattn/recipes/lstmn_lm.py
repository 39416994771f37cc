"""Recipe: language modelling on the Penn Treebank with LSTMNs (Cheng et al. 2016, sec. 5.1,
Table 1 and Figure 4).

The seven neural models of the paper's table: ``rnn`` (Elman, tanh), ``lstm``, ``lstmn`` (1
layer), ``lstm-3`` (3-layer stacked LSTM), ``glstm-3`` (gated-feedback LSTM, Chung et al.
2015), ``dlstm-3`` (depth-gated LSTM, Yao et al. 2015) and ``lstmn-3`` (3-layer LSTMN), KN5
not implemented; embeddings 150, hidden 300, SGD 0.65 times 0.85 when validation does not
improve, gradient norm 5, batch 40.
Everything but the model comes from :mod:`structattn.recipes._lm` (the shared LM code):
windows of ``bptt`` tokens with the state carried across them, the test perplexity over the
whole test stream with ``<eos>`` counted, predictions JSONL with per-sentence NLL.

**The tape across windows.** An LSTMN's tapes are its state: every layer carries its last
``memory_span`` slots (hidden, memory and attention keys) from one BPTT window to the next,
detached, so attention reaches back ``memory_span`` tokens (across window and sentence
boundaries) while gradients stop at the window boundary; a step attends to at most the last
``memory_span`` tokens. The paper grows the memory "until an upper bound of the memory span
is reached" without giving the bound; ours is the ``memory_span`` field (default 35 = bptt).

``viz`` draws Figure 4: the intra-attention of validation sentences, each read on its own
(one heatmap per sentence, row t = attention of word t over the words before it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ..models.language_model import LSTMNLanguageModel, RNNLanguageModel
from ..training import TrainConfig
from ._lm import (
    PAPER_LM_TRAIN,
    RNN_LR,
    LMEvalOptions,
    LMRecipeParts,
    LMSettings,
    load_corpus,
    perplexity_bars,
    use_rnn_lr,
)
from .base import GridAxis, Preset, Recipe, Reporting, Tools
from .config import replace_path
from .tables import markdown_table

__all__ = [
    "MODELS",
    "PAPER_TABLE1",
    "PARTS",
    "RECIPE",
    "LSTMNLMConfig",
    "build_model",
    "visualize",
]

MODELS = ("rnn", "lstm", "lstmn", "lstm-3", "glstm-3", "dlstm-3", "lstmn-3")
NAMES = {
    "rnn": "RNN",
    "lstm": "LSTM",
    "lstmn": "LSTMN",
    "lstm-3": "sLSTM (3 layers)",
    "glstm-3": "gLSTM (3 layers)",
    "dlstm-3": "dLSTM (3 layers)",
    "lstmn-3": "LSTMN (3 layers)",
}
#: Table 1 of Cheng et al. (2016), test perplexity (also KN5 141)
PAPER_TABLE1: dict[str, float] = {
    "rnn": 129.0,
    "lstm": 115.0,
    "lstmn": 108.0,
    "lstm-3": 115.0,
    "glstm-3": 107.0,
    "dlstm-3": 109.0,
    "lstmn-3": 102.0,
}
#: the recurrent cell of each model of RNNLanguageModel
CELLS: dict[str, Literal["rnn", "lstm", "gf-lstm", "dg-lstm"]] = {
    "rnn": "rnn",
    "lstm": "lstm",
    "lstm-3": "lstm",
    "glstm-3": "gf-lstm",
    "dlstm-3": "dg-lstm",
}


@dataclass(frozen=True)
class LSTMNLMConfig:
    """Settings of the PTB language-modelling experiment (defaults: the paper's, sec. 5.1)."""

    model: Literal["rnn", "lstm", "lstmn", "lstm-3", "glstm-3", "dlstm-3", "lstmn-3"] = "lstmn"
    embed_size: int = 150  # word embedding size
    hidden_size: int = 300  # hidden (and LSTMN memory) size of every layer
    memory_span: int = 35  # LSTMN: tokens each step may attend to (carried across windows)
    dropout: float = 0.0  # on embeddings, between layers and on outputs (paper: none stated)
    skip_connections: bool = False  # LSTMN-3: also feed the embeddings to layers 2 and 3
    tie_weights: bool = False  # share the embedding and output matrices (needs equal sizes)
    rnn_lr: float = RNN_LR  # the rnn model's SGD lr (replaces train.lr for it; 0.65 diverges)
    lm: LMSettings = field(default_factory=LMSettings)  # corpus, batch 40, bptt, evaluation
    train: TrainConfig = field(default_factory=lambda: PAPER_LM_TRAIN)  # SGD 0.65, x0.85, clip 5

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"`model` must be one of {MODELS}, got {self.model!r}")
        for name in ("embed_size", "hidden_size", "memory_span"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {self.dropout!r}")
        use_rnn_lr(self)  # checks rnn_lr

    @property
    def layers(self) -> int:
        """1, or 3 for the ``-3`` models."""
        return 3 if self.model.endswith("-3") else 1


def build_model(config: LSTMNLMConfig, vocab_size: int) -> nn.Module:
    """The language model of ``config.model`` (seeded by ``config.train.seed``)."""
    torch.manual_seed(config.train.seed)
    if config.model.startswith("lstmn"):
        return LSTMNLanguageModel(
            vocab_size,
            config.embed_size,
            config.hidden_size,
            num_layers=config.layers,
            memory_span=config.memory_span,
            dropout=config.dropout,
            skip_connections=config.skip_connections,
            tie_weights=config.tie_weights,
        )
    return RNNLanguageModel(
        vocab_size,
        config.embed_size,
        config.hidden_size,
        num_layers=config.layers,
        cell=CELLS[config.model],
        dropout=config.dropout,
        tie_weights=config.tie_weights,
    )


PARTS = LMRecipeParts("lstmn-lm", LSTMNLMConfig, build_model)


# ---- the table ------------------------------------------------------------------------------
def _table(results: Mapping[tuple[Any, ...], Mapping[str, Any]]) -> str:
    """Test and validation perplexity per model beside the paper's test perplexity."""
    rows = []
    for cell, summary in results.items():
        model = str(cell[0])
        test = summary.get("test") or {}
        valid = summary.get("valid") or {}
        ppl = test.get("perplexity")
        vppl = valid.get("perplexity")
        rows.append(
            [
                NAMES.get(model, model),
                "-" if vppl is None else f"{vppl:.1f}",
                "-" if ppl is None else f"{ppl:.1f}",
                f"{PAPER_TABLE1[model]:.0f}" if model in PAPER_TABLE1 else "-",
            ]
        )
    return markdown_table(
        ["Model", "valid ppl (ours)", "test ppl (ours)", "test ppl (paper)"], rows
    )


def _plots(results: Mapping[tuple[Any, ...], Mapping[str, Any]], out: Path) -> list[Path]:
    return perplexity_bars(results, out, PAPER_TABLE1, NAMES)


# ---- Figure 4 -------------------------------------------------------------------------------
@dataclass(frozen=True)
class VizOptions:
    """``structattn viz lstmn-lm``'s own flags (Figure 4)."""

    sentences: tuple[int, ...] = (0, 1, 2)  # validation sentence numbers (0-based, file order)
    layer: int = 0  # which layer's attention (0 = bottom; -1 = top)
    max_words: int = 30  # skip the words after this many (readable heatmaps)


def visualize(
    checkpoint: str | Path,
    sentences: tuple[int, ...] = (0, 1, 2),
    out: str | Path | None = None,
    layer: int = 0,
    max_words: int = 30,
) -> list[Path]:
    """Figure 4: the intra-attention of validation sentences, each read from a fresh state
    (row t: the attention of word t over words 0..t-1); one heatmap per sentence."""
    from .. import viz

    model, config = PARTS.load(checkpoint)
    if not isinstance(model, LSTMNLanguageModel):
        raise ValueError(
            f"Figure 4 shows an LSTMN's intra-attention; this run is a {config.model} model "
            "(use an lstmn or lstmn-3 run)"
        )
    corpus = load_corpus(config.lm)
    lines = corpus.lines["valid"]
    out_dir = Path(out) if out else Path(checkpoint)
    written = []
    for index in sentences:
        if not 0 <= index < len(lines):
            raise ValueError(f"sentence {index} outside 0..{len(lines) - 1} of valid")
        words = lines[index][:max_words] or ["<eos>"]
        ids = torch.tensor([corpus.vocab.encode(words)])  # [1, T]
        with torch.no_grad():
            _, _, stack = model.read(ids)
        layers = stack.layer_attention.shape[1]
        if not -layers <= layer < layers:
            raise ValueError(f"`layer` must be in {-layers}..{layers - 1}, got {layer}")
        weights = stack.layer_attention[0, layer]  # [T, T]
        written.append(
            viz.attention_heatmap(
                weights,
                words,
                words,
                out_dir / f"figure4_valid_{index}.png",
                title=f"{NAMES[config.model]} intra-attention, layer {layer % layers + 1}, "
                f"valid sentence {index}",
            )
        )
    return written


def _viz(checkpoint: Path, options: VizOptions, out: Path | None) -> list[Path]:
    return visualize(checkpoint, options.sentences, out, options.layer, options.max_words)


# ---- presets and the record -------------------------------------------------------------------
#: the paper's models on the whole PTB, 2 epochs each (a scaled table; not timed whole here)
_CPU = replace_path(LSTMNLMConfig(), {"train.epochs": 2, "train.log_every": 200})
_QUICK = replace_path(
    LSTMNLMConfig(),
    {"embed_size": 8, "hidden_size": 8, "memory_span": 6, "lm.batch_size": 4, "lm.bptt": 10,
     "lm.eval_batch_size": 2, "lm.train_tokens": 400, "lm.eval_tokens": 120,
     "train.epochs": 1, "train.progress": False, "train.log_every": 10},
)  # fmt: skip

RECIPE = Recipe(
    name="lstmn-lm",
    summary="LSTMN 5.1, Table 1 / Figure 4: PTB language modelling, RNN / LSTM / LSTMN",
    config=LSTMNLMConfig,
    presets={
        "paper": Preset(LSTMNLMConfig(), "sec. 5.1: emb 150, hidden 300, SGD 0.65, 30 epochs"),
        "cpu": Preset(_CPU, "the paper's models on the whole PTB, 2 epochs each"),
        "quick": Preset(_QUICK, "seconds: 400 training tokens, tiny model (smoke tests)"),
    },
    grid=(GridAxis("variants", "model", MODELS),),
    train=PARTS.train,
    score=PARTS.score,
    evaluate=PARTS.evaluate,
    resumable=frozenset({"lm.test_batch_size"}),
    report=Reporting(
        table=_table,
        paper={
            "source": "Cheng et al. 2016, Table 1 (PTB test perplexity)",
            **{m: {"perplexity": v} for m, v in PAPER_TABLE1.items()},
            "others": {"KN5": 141.0},
        },
        plots=_plots,
    ),
    tools=Tools(eval_options=LMEvalOptions, viz=_viz, viz_options=VizOptions),
)
