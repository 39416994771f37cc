"""Syntactic attention (Kim et al. 2017, sec. 3.3 and Appendix A.1): self-attention whose
weights are the arc marginals of a dependency-tree CRF over the input."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from .._validation import check_mask, prefix_lengths
from ..distributions.base import StructuredDistribution
from ..names import ARC_STRUCTURES, ArcStructure, WeightKind
from ._common import check_memory, masked_softmax, refuse_scripting
from ._weights import check_weights, structured_weights
from .normalizers import tree_distribution

__all__ = ["BiLSTMArcScorer", "SyntacticAttention", "SyntacticAttentionOutput"]

STRUCTURES = ARC_STRUCTURES  # the values of ``structure``


def reverse_padded(x: Tensor, lengths: Tensor) -> Tensor:
    """Reverse each sequence of x [B, N, D] within its length (padding stays at the end)."""
    n = x.shape[1]
    pos = torch.arange(n, device=x.device).unsqueeze(0)  # [1, N]
    index = torch.where(pos < lengths.unsqueeze(-1), lengths.unsqueeze(-1) - 1 - pos, pos)
    return x.gather(1, index.unsqueeze(-1).expand_as(x))


class BiLSTMArcScorer(nn.Module):
    r"""Arc scores from a bidirectional LSTM (Appendix A.1):

    .. math:: h_i = [\overrightarrow{h}_i; \overleftarrow{h}_i], \qquad
              \theta_{ij} = \tanh\big(s^\top \tanh(W_1 h_i + W_2 h_j + b)\big)

    ``forward(x [B, N, D], lengths [B]) -> theta [B, N, N]`` with theta[b, i, j] the score
    of i being the parent of j. The backward LSTM runs on each sequence reversed within its
    length, so padding never reaches real positions. ``layers`` > 1 stacks BiLSTMs (each
    upper layer reads both directions of the one below; the paper's is 1 layer; a 1-layer
    scorer's parameter names are those of earlier versions).
    """

    def __init__(self, input_dim: int, hidden_dim: int = 50, layers: int = 1) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"`layers` must be >= 1, got {layers}")
        self.forward_lstm = nn.LSTM(input_dim, hidden_dim, batch_first=True)
        self.backward_lstm = nn.LSTM(input_dim, hidden_dim, batch_first=True)
        self.upper = nn.ModuleList(
            nn.ModuleList(nn.LSTM(2 * hidden_dim, hidden_dim, batch_first=True) for _ in range(2))
            for _ in range(layers - 1)
        )  # (forward, backward) LSTMs of layers 2..
        self.w_head = nn.Linear(2 * hidden_dim, hidden_dim, bias=False)  # W1
        self.w_mod = nn.Linear(2 * hidden_dim, hidden_dim, bias=True)  # W2, b
        self.s = nn.Linear(hidden_dim, 1, bias=False)

    @staticmethod
    def _bidirectional(
        forward: nn.Module, backward: nn.Module, x: Tensor, lengths: Tensor
    ) -> Tensor:
        fwd, _ = forward(x)  # [B, N, H]
        bwd, _ = backward(reverse_padded(x, lengths))
        return torch.cat([fwd, reverse_padded(bwd, lengths)], dim=-1)  # [B, N, 2H]

    def states(self, x: Tensor, lengths: Tensor) -> list[Tensor]:
        """The BiLSTM states of every layer, bottom first (each [B, N, 2H])."""
        h = self._bidirectional(self.forward_lstm, self.backward_lstm, x, lengths)  # [B, N, 2H]
        out = [h]
        for pair in self.upper:
            assert isinstance(pair, nn.ModuleList)
            h = self._bidirectional(pair[0], pair[1], h, lengths)
            out.append(h)
        return out

    def arc_scores(self, h: Tensor) -> Tensor:
        """theta [B, N, N] of the top layer's states ``h`` [B, N, 2H]."""
        hidden = self.w_head(h).unsqueeze(2) + self.w_mod(h).unsqueeze(1)  # [B, N(i), N(j), H]
        return torch.tanh(self.s(torch.tanh(hidden)).squeeze(-1))  # [B, N, N]

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        return self.arc_scores(self.states(x, lengths)[-1])


class SyntacticAttentionOutput(NamedTuple):
    """Outputs of :class:`SyntacticAttention` (positions include ROOT at index 0)."""

    parents: Tensor  # [B, N, D] soft parent of each input position
    children: Tensor | None  # [B, N, D] soft children (sum over dependents), if requested
    marginals: Tensor  # [B, N', N'] p(head i -> modifier j), N' = N (+1 if ROOT prepended)
    arc_scores: Tensor  # [B, N', N'] theta_ij


class SyntacticAttention(nn.Module):
    r"""Self-attention over soft parents: c_j = sum_i p(z_ij = 1 | x) x_i.

    p(z_ij = 1 | x) is the marginal probability that i is the parent of j under a CRF over
    dependency trees with arc scores theta_ij from :class:`BiLSTMArcScorer`:

    * ``structure="projective"``: Eisner inside-outside (:class:`DependencyCRF`);
    * ``structure="non-projective"``: matrix-tree theorem (:class:`NonProjectiveDependencyCRF`);
    * ``structure="softmax"``: the paper's "simple" baseline, softmax_i(theta_ij) per column.

    ROOT: with ``prepend_root=True`` (default) a learned ROOT vector is prepended internally;
    inputs are the N words and outputs are per word. With ``prepend_root=False`` the caller
    supplies ROOT as position 0 of the input (e.g. the ``$`` symbol of the paper); position
    0's parent is then the zero vector. ``marginals``/``arc_scores`` always include ROOT at
    index 0, so with a prepended ROOT word j of the input is index j + 1 there.

    Args:
        input_dim: size D of the inputs x.
        hidden_dim: size of each LSTM direction and of the MLP (paper: 50).
        structure: see above.
        prepend_root: see above.
        children: also return soft children d_i = sum_j p(z_ij = 1) x_j.
        multiroot: allow several children of ROOT (trees only).
        validate_args: check that the mask puts padding at the end (one host
            synchronisation per call; default True); False skips it.
        scorer_layers: stacked biLSTM layers of the scorer.
        weights: what ``marginals`` are (trees only): ``"marginals"`` (default, p(z_ij = 1)),
            ``"sparse"`` (SparseMAP's arcs: a mix of few trees) or ``"hard-st"`` (the MAP
            tree's arcs forward, the marginals' gradient backward: straight-through).

    Forward: ``x`` [B, N, D], ``mask`` BoolTensor [B, N] (True = real; padding at the end).

    Example:
        >>> attn = SyntacticAttention(16, hidden_dim=8)
        >>> mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).bool()
        >>> out = attn(torch.randn(2, 5, 16), mask)
        >>> out.parents.shape, out.marginals.shape
        (torch.Size([2, 5, 16]), torch.Size([2, 6, 6]))
    """

    __prepare_scriptable__ = refuse_scripting  # torch.jit.script: one clear error

    def __init__(
        self,
        input_dim: int,
        hidden_dim: int = 50,
        structure: ArcStructure = "projective",
        prepend_root: bool = True,
        children: bool = False,
        multiroot: bool = True,
        scorer_layers: int = 1,
        validate_args: bool = True,
        weights: WeightKind = "marginals",
    ) -> None:
        super().__init__()
        if structure not in STRUCTURES:
            raise ValueError(f"`structure` must be one of {STRUCTURES}, got {structure!r}")
        self.weights_mode = check_weights(weights)  # what the layer takes of its tree CRF
        if structure == "softmax" and weights != "marginals":
            raise ValueError(f"`weights={weights!r}` needs a tree structure, got 'softmax'")
        self.structure: ArcStructure = structure
        self.prepend_root = prepend_root
        self.return_children = children
        self.multiroot = multiroot
        self.input_dim = input_dim
        self.validate_args = validate_args
        self.scorer = BiLSTMArcScorer(input_dim, hidden_dim, scorer_layers)
        self.root = nn.Parameter(torch.zeros(input_dim)) if prepend_root else None

    def _prepare(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """Inputs with ROOT [B, N', D] and their lengths [B]."""
        x = check_memory(x, "x")
        if x.shape[-1] != self.input_dim:
            raise ValueError(
                f"`x` must have {self.input_dim} features (input_dim), got shape {tuple(x.shape)}"
            )
        mask = check_mask("mask", mask, tuple(x.shape[:2]), x.device)
        lengths = prefix_lengths(
            "mask", mask, 1 if self.prepend_root else 2, check=self.validate_args
        )
        if self.root is not None:
            root = self.root.to(x.dtype).expand(x.shape[0], 1, -1)
            x = torch.cat([root, x], dim=1)
            lengths = lengths + 1
        return x, lengths

    def distribution(self, arc_scores: Tensor, lengths: Tensor) -> StructuredDistribution:
        """The tree CRF over ``arc_scores`` [B, N', N'] with ``lengths`` [B] (ROOT included);
        ``ValueError`` for ``structure="softmax"``, which has none."""
        if self.structure == "softmax":
            raise ValueError("`distribution` needs a tree structure, got structure='softmax'")
        return tree_distribution(arc_scores, lengths, self.structure, self.multiroot)

    def _marginals(self, arc_scores: Tensor, lengths: Tensor) -> Tensor:
        if self.structure != "softmax":
            dist = self.distribution(arc_scores, lengths)
            if self.weights_mode == "marginals":
                return dist.marginals  # type: ignore[attr-defined]
            return structured_weights(dist, self.weights_mode)
        n = arc_scores.shape[-1]
        real = torch.arange(n, device=arc_scores.device) < lengths.unsqueeze(-1)  # [B, N']
        allowed = real.unsqueeze(-1) & real.unsqueeze(1)  # heads and modifiers real
        allowed = allowed & ~torch.eye(n, dtype=torch.bool, device=arc_scores.device)
        allowed[:, :, 0] = False  # ROOT has no parent
        return masked_softmax(arc_scores, allowed, dim=1)  # normalise over heads i

    def forward(self, x: Tensor, mask: Tensor | None = None) -> SyntacticAttentionOutput:
        full, lengths = self._prepare(x, mask)
        arc_scores = self.scorer(full, lengths)  # [B, N', N']
        marginals = self._marginals(arc_scores, lengths)
        # padding inert: a NaN / inf input there would leak into every sum through 0 * NaN
        # (the scorer reads each item up to its length only)
        real = torch.arange(full.shape[1], device=full.device) < lengths.unsqueeze(-1)  # [B, N']
        full = full.masked_fill(~real.unsqueeze(-1), 0.0)
        parents = torch.bmm(marginals.transpose(1, 2), full)  # c_j = sum_i p(i -> j) x_i
        children = torch.bmm(marginals, full) if self.return_children else None
        if self.root is not None:  # outputs per input word
            parents = parents[:, 1:]
            children = None if children is None else children[:, 1:]
        return SyntacticAttentionOutput(parents, children, marginals, arc_scores)

    @torch.no_grad()
    def parse(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """MAP heads, LongTensor [B, N'] indexed with ROOT at 0 (-1 at ROOT and padding).

        For ``structure="softmax"`` each word takes its highest-scoring head (not
        necessarily a tree)."""
        full, lengths = self._prepare(x, mask)
        arc_scores = self.scorer(full, lengths)
        if self.structure != "softmax":
            return self.distribution(arc_scores, lengths).argmax
        marginals = self._marginals(arc_scores, lengths)
        heads = marginals.argmax(1)
        return heads.masked_fill(marginals.sum(1) == 0, -1)
