"""structattn: structured attention for PyTorch.

Layers (``structattn.attention`` and ``structattn.nn``) sit on an exact inference core:
:class:`LinearChainCRF`, :class:`DependencyCRF` (projective, Eisner),
:class:`NonProjectiveDependencyCRF` (matrix-tree theorem), :func:`mean_field_marginals`
(fully connected binary CRF) and the PRPN stick-breaking gates; :func:`structured_nll` is
the CRF training loss and :func:`is_projective` / :func:`projectivize` prepare treebanks
(these and the bracketing helpers :func:`split_tree` / :func:`tree_to_brackets` live in
:mod:`structattn.trees`, which needs no dynamic program).
"""

from .attention import (
    MeanFieldAttention,
    MemoryCRFAttention,
    SegmentationAttention,
    SigmoidAttention,
    SoftmaxAttention,
    StructuredMultiheadAttention,
    SyntacticAttention,
)
from .distributions import (
    DependencyCRF,
    LabelledHeads,
    LinearChainCRF,
    NonProjectiveDependencyCRF,
    SecondOrderDependencyCRF,
    SemiMarkovCRF,
    SplitTreeDistribution,
    StructuredDistribution,
    TreeCRF,
    cross_entropy,
    kl_divergence,
    sparsemap,
    structured_nll,
)
from .nn import LSTMN, GatedSelfAttention, LSTMNCell, LSTMNDecoder, ParsingNetwork
from .structs.mean_field import mean_field_free_energy, mean_field_marginals
from .structs.stick_breaking import (
    bradley_terry_distribution,
    expected_gates,
    gated_attention_weights,
    stick_breaking_distribution,
    stick_breaking_gates,
)
from .trees import is_projective, projectivize, split_tree, tree_to_brackets

__all__ = [
    "LSTMN",
    "DependencyCRF",
    "GatedSelfAttention",
    "LSTMNCell",
    "LSTMNDecoder",
    "LabelledHeads",
    "LinearChainCRF",
    "MeanFieldAttention",
    "MemoryCRFAttention",
    "NonProjectiveDependencyCRF",
    "ParsingNetwork",
    "SecondOrderDependencyCRF",
    "SemiMarkovCRF",
    "SegmentationAttention",
    "SigmoidAttention",
    "SoftmaxAttention",
    "SplitTreeDistribution",
    "StructuredDistribution",
    "StructuredMultiheadAttention",
    "SyntacticAttention",
    "TreeCRF",
    "bradley_terry_distribution",
    "cross_entropy",
    "expected_gates",
    "gated_attention_weights",
    "is_projective",
    "kl_divergence",
    "mean_field_free_energy",
    "mean_field_marginals",
    "projectivize",
    "sparsemap",
    "split_tree",
    "stick_breaking_distribution",
    "stick_breaking_gates",
    "structured_nll",
    "tree_to_brackets",
]
__version__ = "0.1.0"
