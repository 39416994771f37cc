"""What the ``parser`` recipe and the recipes that read its runs (``nli``: the pipeline
heads of ``hard-parent``, the pretrained layer of ``pretrained``) share: the parser's config
and the loading of a trained parser run. A family helper of the recipes (like ``_lm.py``),
so that no recipe imports another."""

from __future__ import annotations

import json
import os
import statistics
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..data.classification import WordVocabulary
from ..models.parser import ArcParser, WordFeatures, build_arc_parser
from ..names import TreeStructure
from ..training import TrainConfig, load_model_state
from .config import config_from_dict

__all__ = [
    "LOSSES",
    "PAPER_TRAIN",
    "ParserConfig",
    "epoch_seconds",
    "load_parser_run",
    "load_pretrained_layer",
]

LOSSES = ("non-projective", "projective")

#: Kim et al. 2017, sec. 4.4: the parsing layer pretrained for one epoch with Adam 0.01
PAPER_TRAIN = TrainConfig(epochs=1, lr=0.01, optimizer="adam", max_grad_norm=5.0, log_every=100)


@dataclass(frozen=True)
class ParserConfig:
    """Settings of the parser (defaults: those of the NLI model's parsing layer)."""

    loss: TreeStructure = "non-projective"  # the CRF of the loss
    decoder: Literal["eisner", "cle"] = "eisner"  # MAP trees: projective or not
    hidden_dim: int = 300  # projected word vectors (the NLI model's hidden_dim)
    parser_dim: int = 50  # BiLSTM (per direction) and MLP size of the arc scorer
    parser_layers: int = 1  # BiLSTM layers of the arc scorer (the NLI layer's: 1)
    embeddings: str = ""  # GloVe-format vectors ("": ../shared/data/glove/glove.6B.50d.10k.txt)
    normalize: bool = True  # unit-normalise the pretrained vectors
    unknown_buckets: int = 100  # words without a vector: one of this many N(0, 1) vectors
    arc_scale: float = 1.0  # the loss's CRF sees arc_scale * theta (theta is tanh-bounded to
    # [-1, 1], so 1 keeps the trees flat; MAP trees do not depend on it; a pretrained NLI
    # layer uses theta unscaled)
    word_min_count: int = 0  # >0: a trained vector (size hidden_dim, added to the projected
    # fixed vector) for each lower-cased training word seen at least this often, <unk> for rest
    word_dropout: float = 0.0  # training: a word's trained vector is <unk>'s with this chance
    char_dim: int = 0  # >0: a character CNN (chars of this size, width 3, hidden_dim filters,
    # max-pooled) added to each word's vector
    max_chars: int = 20  # the character CNN reads at most the first this many characters
    upos: bool = False  # add a trained vector of the gold UPOS tag (needs tagged input; the
    # NLI sentences have none)
    upos_aux: float = 0.0  # >0: weight of an auxiliary UPOS tagging loss on the scorer's
    # first BiLSTM layer (training only: the parser still reads words alone)
    dropout: float = 0.0  # dropout on the word vectors entering the BiLSTM (training only)
    batch_size: int = 32  # sentences per batch
    max_train: int = 0  # use only the first this many training sentences (0: all)
    max_eval: int = 0  # score only the first this many dev / test sentences (0: all)
    data_dir: str = ""  # folder of en_ewt-ud-{train,dev,test}.conllu ("": shared data)
    train: TrainConfig = field(default_factory=lambda: PAPER_TRAIN)  # optimisation

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"`loss` must be one of {LOSSES}, got {self.loss!r}")
        if self.decoder not in ("eisner", "cle"):
            raise ValueError(f"`decoder` must be eisner or cle, got {self.decoder!r}")
        for name in ("hidden_dim", "parser_dim", "parser_layers", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if not self.arc_scale > 0:
            raise ValueError(f"`arc_scale` must be positive, got {self.arc_scale}")
        for name in ("max_train", "max_eval", "unknown_buckets", "word_min_count", "char_dim"):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}")
        if self.max_chars < 1:
            raise ValueError(f"`max_chars` must be >= 1, got {self.max_chars}")
        if not self.upos_aux >= 0:
            raise ValueError(f"`upos_aux` must be >= 0, got {self.upos_aux}")
        for name in ("dropout", "word_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"`{name}` must be in [0, 1), got {getattr(self, name)}")


def load_parser_run(
    checkpoint: str | os.PathLike[str], device: str = "cpu"
) -> tuple[ArcParser, WordVocabulary, ParserConfig]:
    """The best parser of a run directory (or its ``model.pt``), its vocabulary and config."""
    path = Path(checkpoint)
    if path.suffix == ".pt":
        path = path.parent
    elif not (path / "model.pt").exists():
        raise FileNotFoundError(f"no trained model (model.pt) in {path}")
    state = load_model_state(path)
    if state["config"].get("recipe") != "parser":
        raise ValueError(f"{path} is not a parser run (recipe {state['config'].get('recipe')!r})")
    config = config_from_dict(ParserConfig, state["config"])
    words = WordVocabulary.from_dict(state["extra"]["vocab"])
    features = WordFeatures.from_dict(state["extra"].get("features"))
    model = build_arc_parser(config, state["model"]["embed.weight"], features)
    model.load_state_dict(state["model"])
    return model.to(device).eval(), words, config


def load_pretrained_layer(
    run: str | os.PathLike[str],
    hidden_dim: int,
    parser_dim: int,
    parser_layers: int,
    embeddings: str,
    normalize: bool,
    unknown_buckets: int,
) -> ArcParser:
    """The parser of ``run`` whose projection, ROOT vector and arc scorer start an NLI
    syntactic layer of these sizes and embedding settings; errors when they differ. The
    parser's own inputs (trained word vectors, character CNN, UPOS vectors) have no
    counterpart in the NLI layer: a warning says so (its scorer will read the projected
    fixed vectors alone, which such a parser was not trained on)."""
    parser, _, config = load_parser_run(run)
    extra = [
        flag
        for flag, used in (
            ("--word-min-count", config.word_min_count > 0),
            ("--char-dim", config.char_dim > 0),
            ("--upos", config.upos),
        )
        if used
    ]
    if extra:
        warnings.warn(
            f"the parser run {run} also reads inputs the NLI layer does not have "
            f"({', '.join(extra)}); its scorer will see the fixed word vectors alone. "
            "Train one without them for --pretrained-parser.",
            stacklevel=3,
        )
    mismatch = [
        name
        for name, ours, theirs in (
            ("hidden_dim", hidden_dim, config.hidden_dim),
            ("parser_dim", parser_dim, config.parser_dim),
            ("parser_layers", parser_layers, config.parser_layers),
            ("embeddings", embeddings, config.embeddings),
            ("normalize_embeddings", normalize, config.normalize),
            ("unknown_buckets", unknown_buckets, config.unknown_buckets),
        )
        if ours != theirs
    ]
    if mismatch:
        raise ValueError(f"the parser run {run} differs in {mismatch}")
    return parser


def epoch_seconds(run_dir: Path) -> float | None:
    """Median seconds per epoch (training + validation) of a run: the growth of fit's clock
    between epochs in ``metrics.jsonl`` (a resumed run restarts the clock: that step is
    skipped); ``None`` without one."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    times = [float(r["time"]) for r in records if r.get("kind") == "epoch"]
    steps = [b - a for a, b in zip([0.0, *times], times, strict=False) if b > a]
    return statistics.median(steps) if steps else None
