"""One vocabulary of structure names (structattn.names) behind every layer's and config's."""

from __future__ import annotations

from typing import get_args, get_type_hints

import pytest
import torch

from structattn import names
from structattn.attention import SyntacticAttention, syntactic
from structattn.attention.normalizers import NORMALIZERS
from structattn.models import nli, prpn_lm, seq2seq
from structattn.models.seq2seq import Seq2SeqConfig, StructuredSeq2Seq
from structattn.nn import ParsingNetwork
from structattn.recipes.parser import LOSSES, ParserConfig
from structattn.recipes.tree_transduction import VARIANTS, TreeTransductionConfig


def test_tuples_are_the_literals_and_subsets_of_the_structures() -> None:
    assert names.STRUCTURES == (
        "softmax",
        "sigmoid",
        "segmentation",
        "projective",
        "non-projective",
        "mean-field",
        "constituency",
        "semi-markov",
    )
    assert tuple(NORMALIZERS) == names.STRUCTURES  # one normaliser per name, in order
    for subset in (
        names.TREE_STRUCTURES,
        names.ARC_STRUCTURES,
        names.MEMORY_STRUCTURES,
        names.SPAN_STRUCTURES,
    ):
        assert set(subset) <= set(names.STRUCTURES)
    assert names.TREE_STRUCTURES == get_args(names.TreeStructure)
    assert tuple(names.VARIANT_STRUCTURES) == names.ATTENTION_VARIANTS
    assert set(names.VARIANT_STRUCTURES.values()) - {None} <= set(names.ARC_STRUCTURES)


def test_layers_and_models_take_their_names_from_the_vocabulary() -> None:
    assert syntactic.STRUCTURES == names.ARC_STRUCTURES
    assert seq2seq.ATTENTIONS == names.MEMORY_STRUCTURES
    assert seq2seq.SELF_ATTENTION == {
        "none": None,
        "simple": "softmax",
        "structured": "projective",
        "constituency": "constituency",
    }
    assert names.SELF_ATTENTION_VARIANTS == (*names.ATTENTION_VARIANTS, "constituency")
    assert nli.INTRA_ATTENTION == ("none", "simple", "structured", "hard-parent")
    assert prpn_lm.GATES == (*names.GATE_KINDS, "none")
    assert VARIANTS == names.SELF_ATTENTION_VARIANTS
    assert set(LOSSES) == set(names.TREE_STRUCTURES)
    assert get_type_hints(ParserConfig)["loss"] == names.TreeStructure
    assert get_type_hints(TreeTransductionConfig)["attention"] == names.SelfAttentionVariant
    assert get_type_hints(Seq2SeqConfig)["attention"] == names.MemoryStructure


def test_the_same_strings_are_accepted_and_refused() -> None:
    for structure in names.ARC_STRUCTURES:
        SyntacticAttention(4, 3, structure=structure)
    with pytest.raises(ValueError, match="`structure` must be one of"):
        SyntacticAttention(4, 3, structure="structured")  # type: ignore[arg-type]
    for variant in names.SELF_ATTENTION_VARIANTS:  # the papers' names stay valid
        StructuredSeq2Seq(10, 4, encoder=variant, parser_hidden=3)
    with pytest.raises(ValueError, match="`attention` must be one of"):
        Seq2SeqConfig(10, attention="projective")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`gate` must be"):
        ParsingNetwork(4, 4, gate="none")  # type: ignore[arg-type]
    attention = SyntacticAttention(4, 3, structure="softmax")
    with pytest.raises(ValueError, match="tree structure"):
        attention.distribution(torch.zeros(1, 3, 3), torch.tensor([3]))
