"""structattn: structured attention for PyTorch."""

from .distributions import DependencyCRF, LinearChainCRF, StructuredDistribution

__all__ = ["DependencyCRF", "LinearChainCRF", "StructuredDistribution"]
__version__ = "0.1.0"
