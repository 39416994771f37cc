"""Attention layers (nn.Modules): a scorer makes potentials, a normaliser turns them into weights.

Every layer is batch first, takes a boolean ``mask`` (True = real position) and returns a
NamedTuple with the context vector(s) and the attention weights or marginals.
"""

from ._common import masked_softmax
from .basic import AttentionOutput, SegmentationAttention, SigmoidAttention, SoftmaxAttention
from .mean_field import MeanFieldAttention, MeanFieldAttentionOutput, MeanFieldKeys
from .memory_crf import MemoryCRFAttention, MemoryCRFOutput
from .multihead import StructuredMultiheadAttention
from .scorers import BilinearScorer, DotScorer, MLPScorer, Scorer, make_scorer
from .spans import (
    SemiMarkovSegmentationAttention,
    SpanAttention,
    SpanAttentionOutput,
    SpanScorer,
    SpanSelfAttention,
    SpanSelfAttentionOutput,
)
from .syntactic import BiLSTMArcScorer, SyntacticAttention, SyntacticAttentionOutput
from .variational import VariationalAttention, VariationalAttentionOutput

__all__ = [
    "AttentionOutput",
    "BiLSTMArcScorer",
    "BilinearScorer",
    "DotScorer",
    "MLPScorer",
    "MeanFieldAttention",
    "MeanFieldAttentionOutput",
    "MeanFieldKeys",
    "MemoryCRFAttention",
    "MemoryCRFOutput",
    "Scorer",
    "SegmentationAttention",
    "SemiMarkovSegmentationAttention",
    "SigmoidAttention",
    "SoftmaxAttention",
    "SpanAttention",
    "SpanAttentionOutput",
    "SpanScorer",
    "SpanSelfAttention",
    "SpanSelfAttentionOutput",
    "StructuredMultiheadAttention",
    "SyntacticAttention",
    "SyntacticAttentionOutput",
    "VariationalAttention",
    "VariationalAttentionOutput",
    "make_scorer",
    "masked_softmax",
]
