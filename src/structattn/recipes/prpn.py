"""Recipe: PRPN (Shen et al., ICLR 2018) -- language modelling on PTB (Table 1) and
unsupervised constituency parsing on WSJ10 (Table 2), stick-breaking vs Bradley-Terry gates.

Models (the ``model`` field, one table cell each):

* ``prpn-sb``: the full PRPN (:class:`~structattn.models.prpn_lm.PRPNLanguageModel`) with
  stick-breaking gates (eq. 7, hardtanh with temperature ``tau``),
* ``prpn-bt``: the same with Bradley-Terry gates (notes, section 5.3),
* ``prpn-none``: the ablation without parsing network (every gate 1),
* ``lstm``: an LSTM LM of the same embedding / hidden sizes and layers, tied, same dropout
  on the output and the same training budget
  (:class:`~structattn.models.language_model.RNNLanguageModel`).

Everything LM comes from :mod:`structattn.recipes._lm` (the shared LM code: windows of
``bptt`` tokens, the state carried across them, test perplexity over the whole test stream
with ``<eos>`` counted). ``score`` adds, for the models with a parsing network, the WSJ10
parse (``task parse``): the gold trees of NLTK's WSJ sample (sections 00-01; the full WSJ is
not public, so every UF1 here is on 531 sentences, not the usual 7,422), preprocessed as
:mod:`structattn.data.treebank` says (``parse_convention``: ``"standard"``, the default, keeps
each distinct sentence of 2 to 10 words once, 531 sentences; ``"prpn"`` keeps PRPN's 555,
with the 13 one-word sentences and 11 repeats); each sentence is read after an ``<eos>``
from an empty state, its distances d_1..d_n give a binary tree by greedy SPLIT
(:func:`~structattn.trees.split_tree`), scored by unlabelled bracket F1
(:func:`~structattn.metrics.bracket_f1`): sentence-level mean and corpus-level, with and
without the whole-sentence span. The baselines (left / right branching, balanced, random =
mean of 5 seeds, binary upper bound) are computed on exactly the same sentences. Note: these
sentences are inside ``ptb.train.txt`` (as for the paper's WSJ10 evaluation), and the
Mikolov PTB text is already free of punctuation, lower-cased with numbers as ``N``: the
parsing model is the LM trained on it (PRPN's separate ``main_UP`` data differs: full WSJ
with its own 10k vocabulary).

``structattn eval prpn RUN --task parse --predictions P.jsonl`` writes one line per WSJ10
sentence (``index, file, tree_index, words, gold_spans, predicted_spans, predicted_tree``)
and prints the UF1s; ``--task parse --sentences FILE`` (``-`` = stdin) parses plain
sentences, one per line, to bracketed trees (the words normalised as the gold trees'; strip
punctuation first, the model never saw any); ``viz`` draws induced trees (gold brackets in
the title) and the distances as bars.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ..data.treebank import SentenceConvention, TreebankSentence, load_treebank, normalise_word
from ..io import read_sentences
from ..models.language_model import RNNLanguageModel
from ..models.prpn_lm import GateChoice, Objective, PRPNConfig, PRPNLanguageModel
from ..training import TrainConfig
from ..trees import tree_spans, tree_to_brackets
from . import runs
from ._lm import LMEvalOptions, LMRecipeParts, LMSettings, load_corpus, perplexity_bars
from ._prpn_trees import (
    DECODES,
    UF1,
    Decode,
    decode_scores,
    decode_trees,
    parse_baselines,
    parse_sentences,
    sentence_distances,
    split_bracket_marginals,
    tree_from_nodes,
    uf1_scores,
)
from .base import GridAxis, Preset, Recipe, Reporting, Tools
from .config import replace_path
from .tables import markdown_table

__all__ = ["DECODES", "MODELS", "PAPER_TABLE1", "PAPER_TABLE2", "PARTS", "RECIPE"]
__all__ += ["PRPNRecipeConfig", "build_model", "decode_trees", "parse_baselines"]
__all__ += ["parse_sentences", "split_bracket_marginals", "tree_from_nodes"]

MODELS = ("prpn-sb", "prpn-bt", "prpn-none", "lstm")
NAMES = {
    "prpn-sb": "PRPN, stick-breaking",
    "prpn-bt": "PRPN, Bradley-Terry",
    "prpn-none": "PRPN without parsing network (gates 1)",
    "lstm": "LSTM (same size)",
}
GATE: dict[str, GateChoice] = {
    "prpn-sb": "stick-breaking",
    "prpn-bt": "bradley-terry",
    "prpn-none": "none",
}
#: Table 1 of the notes (PTB test perplexity); the paper has no Bradley-Terry or ablation row
PAPER_TABLE1: dict[str, float] = {"prpn-sb": 61.98}
#: Table 2 of the notes (WSJ10 UF1, full WSJ10) and the full-WSJ sentence F1 of PRPN
PAPER_TABLE2: dict[str, float] = {
    "LBRANCH": 28.7,
    "RANDOM": 34.7,
    "RBRANCH": 61.7,
    "PRPN": 66.4,
    "UPPER BOUND": 88.1,
    "PRPN full WSJ sentence F1": 38.1,
}

#: PRPN's published LM optimisation (main_LM.py of yikangshen/PRPN): Adam 0.003 with
#: betas (0, 0.999), eps 1e-9, weight decay 1e-6, gradient norm 1, lr x0.5 when validation
#: does not improve for 2 epochs, 100 epochs
PRPN_TRAIN = TrainConfig(
    epochs=100,
    lr=0.003,
    optimizer="adam",
    betas=(0.0, 0.999),
    eps=1e-9,
    weight_decay=1e-6,
    max_grad_norm=1.0,
    decay_factor=0.5,
    lr_schedule="plateau",
    plateau_patience=2,
    normalize_by="tokens",
    log_every=100,
)


@dataclass(frozen=True)
class PRPNRecipeConfig:
    """Settings of the PRPN experiments (defaults: PRPN's published LM configuration,
    ``main_LM.py`` of yikangshen/PRPN: ``--tied --hard``, emb 800, hidden 1200, 2 layers)."""

    model: Literal["prpn-sb", "prpn-bt", "prpn-none", "lstm"] = "prpn-sb"  # the variant
    embed_size: int = 800  # word embeddings (= prediction layer, tied softmax)
    hidden_size: int = 1200  # reader LSTMN / LSTM layers and the parser's conv channels
    layers: int = 2  # reader (or LSTM) layers
    num_slots: int = 15  # memory window K of the attention (PRPN's nslots)
    lookback: int = 5  # tokens the parsing convolution sees (nlookback)
    tau: float = 0.1  # stick-breaking temperature (resolution)
    dropout: float = 0.7  # first reader input and output dropout (the LSTM: output, embeddings)
    input_dropout: float = 0.5  # parser / query / predict / upper reader inputs (idropout)
    recurrent_dropout: float = 0.5  # variational dropout on the attended state (rdropout)
    init_range: float = 0.01  # embeddings ~ U(-r, r) (PRPN: 0.01)
    # soft: PRPN's expected gates (eq. 6); marginal: the latent-variable LM of eq. 1, the
    # Predict network's attention limit summed out exactly (prpn-sb / prpn-bt only)
    objective: Objective = "soft"
    parse_max_words: int = 10  # WSJ10: parse the gold sentences with at most this many words
    parse_data_dir: str = ""  # folder of .mrg files ("" = the shared NLTK WSJ sample)
    # which gold sentences: "standard" (2..n words, each distinct sentence once: 531 WSJ10
    # sentences of the sample) or "prpn" (PRPN's 1..n words, repeats kept: 555)
    parse_convention: SentenceConvention = "standard"
    lm: LMSettings = field(
        default_factory=lambda: LMSettings(batch_size=64, eval_batch_size=10)
    )  # PTB, batch 64, bptt 35
    train: TrainConfig = field(default_factory=lambda: PRPN_TRAIN)  # Adam 0.003, clip 1

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"`model` must be one of {MODELS}, got {self.model!r}")
        for name in ("embed_size", "hidden_size", "layers", "num_slots", "lookback"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        if self.objective == "marginal" and self.model not in ("prpn-sb", "prpn-bt"):
            raise ValueError(f"`objective` 'marginal' needs prpn-sb or prpn-bt, not {self.model}")


def build_model(config: PRPNRecipeConfig, vocab_size: int) -> nn.Module:
    """The language model of ``config.model`` (seeded by ``config.train.seed``)."""
    torch.manual_seed(config.train.seed)
    if config.model == "lstm":
        return RNNLanguageModel(
            vocab_size,
            config.embed_size,
            config.hidden_size,
            num_layers=config.layers,
            cell="lstm",
            dropout=config.input_dropout,
            tie_weights=config.embed_size == config.hidden_size,
        )
    return PRPNLanguageModel(
        PRPNConfig(
            vocab_size=vocab_size,
            embed_dim=config.embed_size,
            hidden_dim=config.hidden_size,
            num_layers=config.layers,
            num_slots=config.num_slots,
            lookback=config.lookback,
            gate=GATE[config.model],
            tau=config.tau,
            dropout=config.dropout,
            input_dropout=config.input_dropout,
            recurrent_dropout=config.recurrent_dropout,
            tie_weights=True,
            init_range=config.init_range,
            objective=config.objective,
        )
    )


PARTS = LMRecipeParts("prpn", PRPNRecipeConfig, build_model)


# ---- parsing ----------------------------------------------------------------------------------
_TREEBANKS: dict[tuple[str, int, str], list[TreebankSentence]] = {}


def wsj_sentences(config: PRPNRecipeConfig) -> list[TreebankSentence]:
    """The gold sentences of the parse evaluation (cached per process)."""
    key = (config.parse_data_dir, config.parse_max_words, config.parse_convention)
    if key not in _TREEBANKS:
        _TREEBANKS[key] = load_treebank(
            config.parse_data_dir or None, config.parse_max_words, config.parse_convention
        )
    return _TREEBANKS[key]


def parse_evaluation(
    model: nn.Module,
    config: PRPNRecipeConfig,
    predictions: Path | None = None,
    decode: Decode = "greedy",
) -> dict[str, Any] | None:
    """UF1 of the model's trees (``decode``) on WSJ10 (None for models without parsing
    network)."""
    if not isinstance(model, PRPNLanguageModel) or model.parser is None:
        return None
    sentences = wsj_sentences(config)
    vocab = load_corpus(config.lm).vocab
    parsed = parse_sentences(model, [s.words for s in sentences], vocab.encode, decode=decode)
    spans = [tree_spans(tree, include_root=True) for _, tree in parsed]
    if predictions is not None:
        runs.write_jsonl(
            predictions,
            (
                {
                    "index": i,
                    "file": s.file,
                    "tree_index": s.tree_index,
                    "words": list(s.words),
                    "gold_spans": sorted(s.spans),
                    "predicted_spans": sorted(p),
                    "predicted_tree": tree_to_brackets(_relabel(tree, list(s.words))),
                    "distances": d,
                }
                for i, (s, p, (d, tree)) in enumerate(zip(sentences, spans, parsed, strict=True))
            ),
        )
    return uf1_scores(spans, sentences)


def decode_report(
    model: nn.Module, config: PRPNRecipeConfig, samples: int = 20
) -> dict[str, Any] | None:
    """UF1s of greedy SPLIT, of the most likely tree (``map``), their expectation under the
    split-tree distribution (``expected``) and their spread over ``samples`` sampled draws
    (``sample_*``), on the gold sentences of ``config`` (None without a parsing network)."""
    if not isinstance(model, PRPNLanguageModel) or model.parser is None:
        return None
    sentences = wsj_sentences(config)
    vocab = load_corpus(config.lm).vocab
    distances = sentence_distances(model, [s.words for s in sentences], vocab.encode)
    return decode_scores(distances, sentences, samples)


def _relabel(tree: Any, words: Sequence[str]) -> Any:
    if isinstance(tree, tuple):
        return (_relabel(tree[0], words), _relabel(tree[1], words))
    return words[int(tree)]


# ---- train / score / eval ---------------------------------------------------------------------
def score(config: PRPNRecipeConfig, run_dir: Path) -> dict[str, Any]:
    """Test perplexity (shared LM code) and, with a parsing network, the WSJ10 parse: greedy
    SPLIT (``wsj10_uf1_*``), the most likely tree, the expected UF1 and sampled trees
    (``wsj10_map_*``, ``wsj10_expected_*``, ``wsj10_sample_*``)."""
    result = PARTS.score(config, run_dir)
    model, _ = PARTS.load(run_dir, config.train.device)
    parse = parse_evaluation(model, config, Path(run_dir) / "parse_predictions.jsonl")
    if parse is not None:
        result["test"] = {**result["test"], **{f"wsj10_{k}": v for k, v in parse.items()}}
        result["test"]["objective"] = config.objective
        report = decode_report(model, config) or {}
        result["test"].update(
            {f"wsj10_{k}": v for k, v in report.items() if not k.startswith("greedy_")}
        )
    return result


@dataclass(frozen=True)
class PRPNEvalOptions(LMEvalOptions):
    """``structattn eval prpn``'s own flags."""

    task: Literal["lm", "parse"] = "lm"  # perplexity of a split, or the WSJ10 parse
    max_words: int | None = field(
        default=None,
        metadata={"help": "--task parse: longest gold sentence kept (default: the run's "
                  "parse_max_words, 10 = WSJ10; 1000 = every tree of the sample)"},
    )  # fmt: skip
    sentences: str | None = field(
        default=None,
        metadata={"help": "--task parse: parse these plain sentences instead (a file, one per "
                  "line, or - for stdin)"},
    )  # fmt: skip
    decode: Literal["greedy", "map", "sample", "all"] = field(
        default="greedy",
        metadata={"help": "--task parse: greedy SPLIT, the most likely tree (map) or a sample "
                  "of the split-tree distribution (eq. 8); all = the three, the expected UF1 "
                  "and the spread over 20 sampled draws; default: greedy"},
    )  # fmt: skip
    convention: SentenceConvention | None = field(
        default=None,
        metadata={"help": "--task parse: gold sentences kept (default: the run's "
                  "parse_convention; standard = 2+ words, distinct; prpn = PRPN's)"},
    )  # fmt: skip


def evaluate(run_dir: Path, options: PRPNEvalOptions, device: str, predictions: Path | None) -> str:
    """``structattn eval prpn``: perplexity (``--task lm``) or WSJ10 UF1 (``--task parse``)."""
    if options.task == "lm":
        return PARTS.evaluate(run_dir, options, device, predictions)
    model, config = PARTS.load(run_dir, device)
    decode: Decode = "greedy" if options.decode == "all" else options.decode
    if options.sentences is not None:
        return "\n".join(parse_text(model, config, options.sentences, decode))
    if options.max_words is not None:
        config = replace(config, parse_max_words=options.max_words)
    if options.convention is not None:
        config = replace(config, parse_convention=options.convention)
    result = parse_evaluation(model, config, predictions, decode)
    if result is None:
        raise ValueError(f"{run_dir}: a {config.model} model has no parsing network to parse with")
    baseline = parse_baselines(wsj_sentences(config), seeds=1)["RBRANCH"]
    head = (
        f"prpn sentences of <= {config.parse_max_words} words "
        f"({result['sentences']} of the NLTK WSJ sample, {config.parse_convention} "
        "convention)"
    )
    if options.decode == "all":
        report = decode_report(model, config)
        assert report is not None
        rows = [
            [name, *(_fmt(report[f"{key}_{k}"]) for k in UF1)]
            for name, key in (("greedy SPLIT", "greedy"), ("most likely tree", "map"),
                              ("expected (split-tree distribution)", "expected"))
        ]  # fmt: skip
        rows.append(
            ["20 sampled draws: mean +- std",
             *(f"{report[f'sample_{k}_mean']:.1f} +- {report[f'sample_{k}_std']:.1f}"
               for k in UF1)]
        )  # fmt: skip
        rows.append(["right-branching", *(_fmt(baseline[k]) for k in UF1)])
        header = ["trees", "UF1 sent.", "UF1 corpus", "UF1 sent. +root", "UF1 corpus +root"]
        return f"{head}\n\n{markdown_table(header, rows)}"
    return (
        f"{head}: {decode} UF1 "
        f"sentence-level {result['uf1_sentence']:.1f} / corpus-level {result['uf1_corpus']:.1f}"
        f" without the sentence span, {result['uf1_sentence_root']:.1f} / "
        f"{result['uf1_corpus_root']:.1f} with it (right-branching: "
        f"{baseline['uf1_sentence']:.1f} / {baseline['uf1_corpus']:.1f} and "
        f"{baseline['uf1_sentence_root']:.1f} / {baseline['uf1_corpus_root']:.1f})"
    )


def parse_text(
    model: nn.Module, config: PRPNRecipeConfig, source: str, decode: Decode = "greedy"
) -> list[str]:
    """Bracketed trees (``decode``) of plain sentences (whitespace-tokenised, one per line;
    ``-`` = stdin), words normalised as the gold trees' (lower-case, digits -> N)."""
    return parse_tokens(model, config, read_sentences(source), decode)


def parse_tokens(
    model: nn.Module,
    config: PRPNRecipeConfig,
    lines: Sequence[Sequence[str]],
    decode: Decode = "greedy",
) -> list[str]:
    """Bracketed trees (``decode``; the original words at the leaves) of tokenised sentences,
    the words normalised as the gold trees' (lower-case, digits -> N) for the model."""
    if not isinstance(model, PRPNLanguageModel) or model.parser is None:
        raise ValueError("this model has no parsing network to parse with")
    for i, line in enumerate(lines):
        if not line:
            raise ValueError(f"sentence {i} has no words")
    vocab = load_corpus(config.lm).vocab
    words = [[normalise_word(w) for w in line] for line in lines]
    parsed = parse_sentences(model, words, vocab.encode, decode=decode)
    return [
        tree_to_brackets(_relabel(tree, line))
        for line, (_, tree) in zip(lines, parsed, strict=True)
    ]


@dataclass(frozen=True)
class ParseOptions:
    """``structattn parse prpn``'s own flags."""

    decode: Decode = "greedy"  # greedy SPLIT, the most likely tree (map) or a sample (eq. 8)


def _parse(
    run_dir: Path, sentences: Sequence[Sequence[str]], device: str, options: ParseOptions
) -> list[str]:
    """``structattn parse prpn``: one bracketed tree per sentence."""
    model, config = PARTS.load(run_dir, device)
    return parse_tokens(model, config, sentences, options.decode)


# ---- tables -----------------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, int | float) and not isinstance(value, bool) else "-"


def _name(model: str, test: Mapping[str, Any]) -> str:
    objective = test.get("objective", "soft")
    return NAMES.get(model, model) + (f" ({objective} objective)" if objective != "soft" else "")


def _table(results: Mapping[tuple[Any, ...], Mapping[str, Any]]) -> str:
    """Table 1 (perplexity) and Table 2 (WSJ10 UF1 with the baselines) beside the paper's."""
    rows1 = []
    for cell, summary in results.items():
        model = str(cell[0])
        test, valid = summary.get("test") or {}, summary.get("valid") or {}
        rows1.append(
            [
                _name(model, test),
                _fmt(valid.get("perplexity")),
                _fmt(test.get("perplexity")),
                _fmt(PAPER_TABLE1.get(model)),
            ]
        )
    table1 = markdown_table(
        ["Model (Table 1, PTB)", "valid ppl", "test ppl", "test ppl (paper)"], rows1
    )
    header = [
        "Model (Table 2, WSJ10)",
        "UF1 sent.",
        "UF1 corpus",
        "UF1 sent. +root",
        "UF1 corpus +root",
        "paper",
    ]
    rows2 = []
    try:
        baselines = parse_baselines(wsj_sentences(PRPNRecipeConfig()))
    except (ImportError, FileNotFoundError) as error:
        print(f"no parse baselines: {error}", file=sys.stderr)
        baselines = {}
    for name, scores in baselines.items():
        rows2.append(
            [
                name,
                *(_fmt(scores[k]) for k in ("uf1_sentence", "uf1_corpus")),
                *(_fmt(scores[k]) for k in ("uf1_sentence_root", "uf1_corpus_root")),
                _fmt(PAPER_TABLE2.get(name)),
            ]
        )
    for cell, summary in results.items():
        test = summary.get("test") or {}
        if "wsj10_uf1_sentence" not in test:
            continue
        model = str(cell[0])
        paper = _fmt(PAPER_TABLE2["PRPN"]) if model == "prpn-sb" else "-"
        rows2.append([_name(model, test), *(_fmt(test[f"wsj10_{k}"]) for k in UF1), paper])
        if "wsj10_map_uf1_sentence" in test:  # the most likely tree of eq. 8 (#40)
            name = f"{_name(model, test)}, most likely tree"
            rows2.append([name, *(_fmt(test[f"wsj10_map_{k}"]) for k in UF1), "-"])
    sentences = next(
        (int(s["test"]["wsj10_sentences"]) for s in results.values()
         if "wsj10_sentences" in (s.get("test") or {})),
        len(wsj_sentences(PRPNRecipeConfig())) if baselines else 0,
    )  # fmt: skip
    note = (
        f"WSJ10 here: {sentences} sentences of NLTK's WSJ sample (sections 00-01; baselines "
        f"on the {PRPNRecipeConfig().parse_convention!r} convention's "
        f"{len(wsj_sentences(PRPNRecipeConfig())) if baselines else 0}), not the "
        "full WSJ10 (7,422); these sentences are inside ptb.train.txt. UF1 in %, single words "
        "excluded; '+root' counts the whole-sentence span."
    )
    return f"{table1}\n\n{markdown_table(header, rows2)}\n\n{note}"


def _plots(results: Mapping[tuple[Any, ...], Mapping[str, Any]], out: Path) -> list[Path]:
    return perplexity_bars(results, out, PAPER_TABLE1, NAMES)


# ---- viz --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VizOptions:
    """``structattn viz prpn``'s own flags."""

    sentences: tuple[int, ...] = (0, 1, 2, 3)  # WSJ10 sentence numbers (0-based, file order)


def visualize(
    checkpoint: str | Path, sentences: tuple[int, ...] = (0, 1, 2, 3), out: str | Path | None = None
) -> list[Path]:
    """Induced trees (gold brackets in the title) and the distances as bars of WSJ10 sentences."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .. import viz

    model, config = PARTS.load(checkpoint)
    if not isinstance(model, PRPNLanguageModel) or model.parser is None:
        raise ValueError(f"a {config.model} run has no parsing network: use prpn-sb or prpn-bt")
    gold = wsj_sentences(config)
    vocab = load_corpus(config.lm).vocab
    out_dir = Path(out) if out else Path(checkpoint)
    written = []
    for index in sentences:
        if not 0 <= index < len(gold):
            raise ValueError(f"sentence {index} outside 0..{len(gold) - 1} of WSJ10")
        sentence = gold[index]
        ((d, tree),) = parse_sentences(model, [sentence.words], vocab.encode)
        words = list(sentence.words)
        written.append(
            viz.bracketed_tree(
                tree,
                out_dir / f"parse_{index}.png",
                tokens=words,
                title=f"{config.model} on WSJ10 #{index}; gold: {sentence.tree}",
            )
        )
        fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(words)), 2.4))
        ax.bar(range(len(words)), d, color="#4c72b0")
        ax.set_xticks(range(len(words)), words, rotation=45, ha="right")
        ax.set_ylabel("distance d")
        ax.set_title(f"syntactic distances, WSJ10 #{index}")
        fig.tight_layout()
        path = out_dir / f"distances_{index}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def _viz(checkpoint: Path, options: VizOptions, out: Path | None) -> list[Path]:
    return visualize(checkpoint, options.sentences, out)


# ---- presets and the record -------------------------------------------------------------------
#: a small PRPN on the whole PTB: emb = hidden 200, 1 layer, batch 64, 2 epochs (about 15 min
#: per PRPN epoch on one busy core); the same budget for every model
_CPU = replace_path(
    PRPNRecipeConfig(),
    {"embed_size": 200, "hidden_size": 200, "layers": 1, "dropout": 0.3, "input_dropout": 0.2,
     "recurrent_dropout": 0.1, "init_range": 0.1, "lm.test_batch_size": 10,
     "train.epochs": 2, "train.log_every": 200},
)  # fmt: skip
_QUICK = replace_path(
    PRPNRecipeConfig(),
    {"embed_size": 8, "hidden_size": 8, "layers": 1, "num_slots": 4, "lookback": 3,
     "init_range": 0.1, "lm.batch_size": 4, "lm.bptt": 10, "lm.eval_batch_size": 2,
     "lm.test_batch_size": 4, "lm.train_tokens": 400, "lm.eval_tokens": 120,
     "train.epochs": 1, "train.progress": False, "train.log_every": 10},
)  # fmt: skip

RECIPE = Recipe(
    name="prpn",
    summary="PRPN (Shen et al. 2018): PTB perplexity and WSJ10 unsupervised parsing UF1",
    config=PRPNRecipeConfig,
    presets={
        "paper": Preset(
            PRPNRecipeConfig(), "main_LM.py: emb 800, hidden 1200, 2 layers, Adam, 100 epochs"
        ),
        "cpu": Preset(_CPU, "emb = hidden 200, 1 layer, whole PTB, 2 epochs per model"),
        "quick": Preset(_QUICK, "seconds: 400 training tokens, tiny model (smoke tests)"),
    },
    grid=(GridAxis("variants", "model", MODELS),),
    train=PARTS.train,
    score=score,
    evaluate=evaluate,
    resumable=frozenset({"lm.test_batch_size"}),
    needs={"viz": ("matplotlib", "nltk"), "train": ("nltk",), "reproduce": ("nltk",)},
    report=Reporting(
        table=_table,
        paper={
            "source": "PRPN notes (Shen et al. 2018): Table 1 PTB test ppl, Table 2 WSJ10 UF1",
            **{m: {"perplexity": v} for m, v in PAPER_TABLE1.items()},
            "wsj10": PAPER_TABLE2,
        },
        plots=_plots,
    ),
    tools=Tools(
        eval_options=PRPNEvalOptions,
        viz=_viz,
        viz_options=VizOptions,
        parse=_parse,
        parse_options=ParseOptions,
    ),
)
