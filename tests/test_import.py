"""What ``import structattn`` costs (issue 38.7)."""

from __future__ import annotations

import subprocess
import sys

import torch

from structattn import DependencyCRF


def test_import_does_not_load_dynamo() -> None:
    """``@torch.compiler.disable`` at import pulled in ``torch._dynamo`` (about 2 of the
    2.5 s that ``import structattn`` took beyond torch); it is applied lazily now."""
    code = "import sys, structattn; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_inference_pass_still_runs_eagerly_under_compile() -> None:
    """The lazily disabled inference pass (double backward inside) works under
    ``torch.compile`` and gives the eager result and gradient."""

    def loss(x: torch.Tensor) -> torch.Tensor:
        return DependencyCRF(x).marginals.pow(2).sum()

    x = torch.randn(2, 5, 5, dtype=torch.float64, requires_grad=True)
    y = x.detach().clone().requires_grad_(True)
    compiled = torch.compile(loss)(x)
    eager = loss(y)
    torch.testing.assert_close(compiled, eager)
    compiled.backward()
    eager.backward()
    assert x.grad is not None and y.grad is not None
    torch.testing.assert_close(x.grad, y.grad)
