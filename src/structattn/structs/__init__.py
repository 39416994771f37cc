"""Pure dynamic programs over log-potentials (no parameters, no nn.Modules).

The optional C++ kernels (CPU, float32 / float64) are built on first use; from outside this
package: :func:`build_kernels` (build now or raise), :func:`kernels` (the compiled module if
it applies to a tensor and can be built, else None: the PyTorch code runs) and
:func:`kernels_disabled` (a block that runs the PyTorch code).
"""

from ._extension import build_kernels, kernels, kernels_disabled

__all__ = ["build_kernels", "kernels", "kernels_disabled"]
