"""Every distribution and layer under ``torch.autocast("cpu", torch.bfloat16)`` (issue 38.6):
forward and backward run (mean-field heads raised a dtype error in their backward), and the
distributions compute in float32 (the same values as float32 inputs outside autocast)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from structattn import DependencyCRF, LinearChainCRF, NonProjectiveDependencyCRF
from structattn.attention import (
    MeanFieldAttention,
    MemoryCRFAttention,
    SegmentationAttention,
    SoftmaxAttention,
    StructuredMultiheadAttention,
    SyntacticAttention,
)
from structattn.structs.mean_field import mean_field_marginals

D = 8


def _autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


LAYERS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "segmentation": lambda q, m: SegmentationAttention(D)(q, m).context,
    "softmax": lambda q, m: SoftmaxAttention(D)(q, m).context,
    "mean-field": lambda q, m: MeanFieldAttention(D)(q, m).context,
    "syntactic-projective": lambda q, m: SyntacticAttention(D)(m).parents,
    "syntactic-non-projective": lambda q, m: (
        SyntacticAttention(D, structure="non-projective")(m).parents
    ),
    "memory-crf": lambda q, m: MemoryCRFAttention(D, 3)(q[:, 0], m, m).context,
}
for _norm in ("projective", "non-projective", "segmentation", "mean-field", "softmax"):
    LAYERS[f"multihead-{_norm}"] = lambda q, m, norm=_norm: StructuredMultiheadAttention(
        D, 2, batch_first=True, normalizer=norm
    )(m, m, m)[0]


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layers_train_under_bf16_autocast(name: str) -> None:
    torch.manual_seed(0)
    query = torch.randn(2, 3, D, requires_grad=True)
    memory = torch.randn(2, 5, D, requires_grad=True)
    with _autocast():
        out = LAYERS[name](query, memory)
    out.float().sum().backward()
    assert torch.isfinite(out.float()).all()
    assert memory.grad is not None and torch.isfinite(memory.grad).all()


def _distributions(x: Tensor) -> dict[str, Callable[[], Tensor]]:
    """Marginals of each distribution from potentials made of ``x`` [2, 5, 5]."""
    return {
        "chain": lambda: LinearChainCRF(x[:, :, :3], x[0, :3, :3].float()).marginals,
        "projective": lambda: DependencyCRF(x).marginals,
        "non-projective": lambda: NonProjectiveDependencyCRF(x).marginals,
        "mean-field": lambda: mean_field_marginals(x[:, 0], x, 3),
    }


@pytest.mark.parametrize("name", ["chain", "projective", "non-projective", "mean-field"])
def test_distributions_compute_in_float32_under_autocast(name: str) -> None:
    torch.manual_seed(0)
    scores = torch.randn(2, 5, 5).bfloat16().float().requires_grad_(True)
    with _autocast():
        half = scores @ torch.eye(5)  # a bfloat16 product, as a layer would give
        assert half.dtype == torch.bfloat16
        marginals = _distributions(half)[name]()
    assert marginals.dtype == torch.float32
    reference = _distributions(scores.detach().bfloat16().float())[name]()
    torch.testing.assert_close(marginals, reference, rtol=1e-5, atol=1e-6)
    marginals.pow(2).sum().backward()
    assert scores.grad is not None and torch.isfinite(scores.grad).all()
