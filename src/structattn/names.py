"""The one vocabulary of structure names, shared by every layer and config (ground floor).

A *structure* is what turns attention scores into weights (:mod:`structattn.attention.
normalizers` has one normaliser per name). Each ``Literal`` below is the type of an argument
or config field; the tuple beside it (``typing.get_args`` of it, in the same order) is what
code validates against and shows in errors. Layers and models take a subset:

* :data:`Structure`: every normaliser (``StructuredMultiheadAttention``'s heads);
* :data:`TreeStructure`: the dependency-tree CRFs (the parser's loss, tree heads);
* :data:`ArcStructure`: what ``SyntacticAttention`` puts over a sentence's arcs (a tree CRF,
  or the softmax baseline);
* :data:`MemoryStructure`: attention of queries over a memory (``Seq2Seq``'s decoder);
* :data:`GateKind`: PRPN's attention-limit gates (stick-breaking, Bradley-Terry);
* :data:`SpanStructure`: the CRFs over spans (``SpanAttention``, span heads): binary
  bracketings (constituency-tree CRF, CKY) and segmentations (semi-Markov CRF);
* :data:`WeightKind`: what a structured attention layer takes of its CRF as weights (the
  ``weights=`` option): the marginals, SparseMAP's sparse marginals, or the MAP structure
  with the marginals' gradient (straight-through).

The papers name their variants differently: :data:`AttentionVariant` (``"none"``,
``"simple"``, ``"structured"``, SAN sec. 4.1 and 4.4) and :data:`VARIANT_STRUCTURES`, the
structure each means for a self-attention encoder. Those user-facing names stay valid
wherever they were (a recipe's ``--attention structured``). :data:`SelfAttentionVariant`
adds ``"constituency"`` (self-attention over the constituents of a tree CRF over spans) for
the encoders that have it (the tree-transduction model).
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "ARC_STRUCTURES",
    "ATTENTION_VARIANTS",
    "GATE_KINDS",
    "MEMORY_STRUCTURES",
    "SELF_ATTENTION_VARIANTS",
    "SPAN_STRUCTURES",
    "STRUCTURES",
    "TREE_STRUCTURES",
    "VARIANT_STRUCTURES",
    "ArcStructure",
    "AttentionVariant",
    "GateKind",
    "MemoryStructure",
    "SelfAttentionVariant",
    "SpanStructure",
    "Structure",
    "TreeStructure",
    "WEIGHT_KINDS",
    "WeightKind",
]

#: every structure over attention weights, one normaliser each
Structure = Literal[
    "softmax",
    "sigmoid",
    "segmentation",
    "projective",
    "non-projective",
    "mean-field",
    "constituency",
    "semi-markov",
]
#: dependency-tree CRFs: projective (Eisner) and non-projective (matrix-tree theorem)
TreeStructure = Literal["projective", "non-projective"]
#: a sentence's arcs: a tree CRF's marginals, or softmax over the heads of each word
ArcStructure = Literal["projective", "non-projective", "softmax"]
#: attention of each query over a memory (no structure across queries)
MemoryStructure = Literal["softmax", "sigmoid", "segmentation", "mean-field"]
#: PRPN's gates: stick-breaking (eq. 7) or Bradley-Terry (Shen et al.'s notes, sec. 5.3)
GateKind = Literal["stick-breaking", "bradley-terry"]
#: CRFs over spans: binary bracketings (TreeCRF) or segmentations (SemiMarkovCRF)
SpanStructure = Literal["constituency", "semi-markov"]
#: a CRF's weights: marginals, SparseMAP marginals, MAP indicators (straight-through)
WeightKind = Literal["marginals", "sparse", "hard-st"]
#: the papers' names of a self-attention encoder's variants (SAN sec. 4.1, 4.4)
AttentionVariant = Literal["none", "simple", "structured"]
#: the papers' variants and self-attention over constituents (a TreeCRF's spans)
SelfAttentionVariant = Literal["none", "simple", "structured", "constituency"]

STRUCTURES: tuple[Structure, ...] = get_args(Structure)
TREE_STRUCTURES: tuple[TreeStructure, ...] = get_args(TreeStructure)
ARC_STRUCTURES: tuple[ArcStructure, ...] = get_args(ArcStructure)
MEMORY_STRUCTURES: tuple[MemoryStructure, ...] = get_args(MemoryStructure)
GATE_KINDS: tuple[GateKind, ...] = get_args(GateKind)
SPAN_STRUCTURES: tuple[SpanStructure, ...] = get_args(SpanStructure)
WEIGHT_KINDS: tuple[WeightKind, ...] = get_args(WeightKind)
ATTENTION_VARIANTS: tuple[AttentionVariant, ...] = get_args(AttentionVariant)
SELF_ATTENTION_VARIANTS: tuple[SelfAttentionVariant, ...] = get_args(SelfAttentionVariant)

#: the structure each variant puts over a sentence's arcs (None: no self-attention)
VARIANT_STRUCTURES: dict[AttentionVariant, ArcStructure | None] = {
    "none": None,
    "simple": "softmax",
    "structured": "projective",
}
