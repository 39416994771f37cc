"""Natural language inference data shared by the NLI recipes (``nli``, ``lstmn-nli``): the
SICK / SNLI splits, pairs encoded as padded id batches, and the predictions JSONL.

Data sets: ``sick`` (SICK TRAIN / TRIAL / TEST as train / valid / test) and ``snli-small``
(SNLI 1.0 dev as training data with ``valid_fraction`` held out for validation, SNLI test).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..io import atomic_write_text, check_splits, shared_data_dir
from .classification import (
    NLI_LABELS,
    ClassificationExample,
    LabelVocabulary,
    WordVocabulary,
    read_sick,
    read_snli,
    split_holdout,
)

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = [
    "NLI_DATASETS",
    "EncodedPairs",
    "load_nli_splits",
    "nli_vocabulary",
    "pair_sentences",
    "write_nli_predictions",
]

NLI_DATASETS = ("sick", "snli-small")


def load_nli_splits(
    dataset: Literal["sick", "snli-small"],
    data_dir: str | os.PathLike[str] = "",
    max_train: int = 0,
    valid_fraction: float = 0.1,
) -> dict[str, list[ClassificationExample]]:
    """``{"train", "valid", "test"}`` pairs of ``dataset`` from ``data_dir`` ("": the shared
    data folder), the training pairs cut to the first ``max_train`` (0: all)."""
    if dataset == "sick":
        folder = Path(data_dir) if data_dir else shared_data_dir("sick", what="SICK")
        splits = read_sick(folder / "SICK.txt")
    else:
        folder = (
            Path(data_dir) if data_dir else shared_data_dir("snli_devtest", what="SNLI dev/test")
        )
        train, valid = split_holdout(read_snli(folder, "dev"), valid_fraction)
        splits = {"train": train, "valid": valid, "test": read_snli(folder, "test")}
    if max_train:
        splits["train"] = splits["train"][:max_train]
    check_splits(splits, f"{dataset} in {folder}")
    return splits


def pair_sentences(examples: Sequence[ClassificationExample]) -> list[tuple[str, ...]]:
    """Premise, hypothesis, premise, ... of ``examples`` (tokenised)."""
    return [s for ex in examples for s in (ex.tokens, ex.pair or ())]


def nli_vocabulary(splits: Mapping[str, Sequence[ClassificationExample]]) -> WordVocabulary:
    """Every word of every split: the embeddings are fixed functions of the word (a GloVe
    vector or a hashed Gaussian), so a test word adds no trained parameter."""
    return WordVocabulary.build([ex for split in splits.values() for ex in split])


class EncodedPairs:
    """A split as id lists (and pipeline heads), collated into padded batches.

    ``batch(indices, device)`` gives ``premise`` / ``hypothesis`` LongTensor [B, L],
    their ``*_mask`` BoolTensor [B, L], ``*_heads`` [B, L] when heads are given, and
    ``labels`` [B]."""

    def __init__(
        self,
        examples: Sequence[ClassificationExample],
        words: WordVocabulary,
        labels: LabelVocabulary,
        heads: Mapping[tuple[str, ...], list[int]] | None = None,
    ) -> None:
        self.examples = examples
        self.premise = [words.encode(ex.tokens) for ex in examples]
        self.hypothesis = [words.encode(ex.pair or ()) for ex in examples]
        self.labels = [labels.encode(ex.label) for ex in examples]
        self.heads = heads

    def __len__(self) -> int:
        return len(self.examples)

    def batch(self, indices: Sequence[int], device: torch.device) -> dict[str, Tensor]:
        import torch

        from .batching import pad_sequences

        out: dict[str, Tensor] = {}
        for key, rows, sents in (
            ("premise", self.premise, [self.examples[i].tokens for i in indices]),
            ("hypothesis", self.hypothesis, [self.examples[i].pair or () for i in indices]),
        ):
            chosen = [rows[i] for i in indices]
            width = max(len(r) for r in chosen)
            lengths = torch.tensor([len(r) for r in chosen])
            out[key] = pad_sequences(chosen, width=width, device=device)  # [B, L]
            out[f"{key}_mask"] = (torch.arange(width) < lengths[:, None]).to(device)  # [B, L]
            if self.heads is not None:
                heads = [self.heads[tuple(s)] for s in sents]
                out[f"{key}_heads"] = pad_sequences(heads, width=width, device=device)  # [B, L]
        out["labels"] = torch.tensor([self.labels[i] for i in indices], device=device)
        return out


def write_nli_predictions(
    path: str | os.PathLike[str],
    examples: Sequence[ClassificationExample],
    predicted: Sequence[int],
) -> Path:
    """The NLI predictions JSONL (atomically): one line per pair, ``{index, premise,
    hypothesis, gold, predicted}`` with labels as names (``predicted``: ids of
    :data:`~structattn.data.classification.NLI_LABELS`)."""
    rows = (
        {
            "index": ex.index,
            "premise": " ".join(ex.tokens),
            "hypothesis": " ".join(ex.pair or ()),
            "gold": ex.label,
            "predicted": NLI_LABELS[p],
        }
        for ex, p in zip(examples, predicted, strict=True)
    )
    return atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
