"""Pure dynamic programs over log-potentials (no parameters, no nn.Modules)."""

from ._extension import build_kernels

__all__ = ["build_kernels"]
