"""A drop-in replacement for ``torch.nn.MultiheadAttention`` with structured heads."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributions import DependencyCRF, LinearChainCRF
from ..distributions.dependency import TreeCRFBase
from ..structs.mean_field import mean_field_marginals
from ._common import masked_softmax, prefix_lengths

__all__ = ["NORMALIZERS", "StructuredMultiheadAttention"]

NORMALIZERS = ("softmax", "sigmoid", "segmentation", "projective", "non-projective", "mean-field")
_STRUCTURED = ("segmentation", "projective", "non-projective")


class StructuredMultiheadAttention(nn.Module):
    r"""``nn.MultiheadAttention`` whose heads normalise scores with a structured distribution.

    Same constructor arguments, parameters (``in_proj_weight``, ``in_proj_bias``,
    ``out_proj``; or ``q/k/v_proj_weight`` when ``kdim``/``vdim`` differ) and call signature
    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False) -> (output, weights)``, so a state dict of
    ``nn.MultiheadAttention`` loads into it. Masks follow PyTorch's conventions: a boolean
    ``key_padding_mask``/``attn_mask`` is True where attention is NOT allowed (float masks
    are added to the scores).

    With scores S = (Q W_q)(K W_k)^T / sqrt(d) per head, each head's weights are:

    * ``"softmax"``: softmax over keys (identical to ``nn.MultiheadAttention``);
    * ``"sigmoid"``: sigmoid(S) (independent Bernoulli selection);
    * ``"segmentation"``: p(z_i = 1) of a 2-state chain over the keys with unary S[q, i]
      and a learned 2x2 transition matrix per head;
    * ``"projective"`` / ``"non-projective"``: self-attention (L = S) over soft parents: the
      weight of key h for query m is p(h is the head of m) under a dependency CRF with arc
      scores S[m, h] and a learned ROOT key per head; the ROOT's share multiplies a learned
      ROOT value (zero at init), so tree rows sum to 1 - p(m attaches to ROOT);
    * ``"mean-field"``: k mean-field iterations with unary S and J = beta_h K K^T / sqrt(d)
      (beta_h learned, 0 at init: starts as sigmoid attention).

    ``normalizer`` is one name for all heads or a sequence of ``num_heads`` names.
    Structured heads need padding at the end of the keys and do not support ``attn_mask`` /
    ``is_causal`` (a chain or tree over a masked subset is not defined); ``add_bias_kv`` and
    ``add_zero_attn`` are not supported.

    Example:
        >>> mha = StructuredMultiheadAttention(16, 4, batch_first=True,
        ...                                    normalizer=["softmax", "projective"] * 2)
        >>> x = torch.randn(2, 5, 16)
        >>> out, weights = mha(x, x, x)
        >>> out.shape, weights.shape
        (torch.Size([2, 5, 16]), torch.Size([2, 5, 5]))
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        normalizer: str | Sequence[str] = "softmax",
        mean_field_iterations: int = 3,
    ) -> None:
        super().__init__()
        if add_bias_kv or add_zero_attn:
            raise ValueError("`add_bias_kv` and `add_zero_attn` are not supported")
        if embed_dim % num_heads:
            raise ValueError(f"`embed_dim` {embed_dim} must be divisible by `num_heads`")
        names = [normalizer] * num_heads if isinstance(normalizer, str) else list(normalizer)
        if len(names) != num_heads or any(n not in NORMALIZERS for n in names):
            raise ValueError(
                f"`normalizer` must be one of {NORMALIZERS} or a list of {num_heads} of them, "
                f"got {normalizer!r}"
            )
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.normalizers = names
        self.mean_field_iterations = mean_field_iterations
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        # structured-head parameters (one slot per head; unused slots are harmless)
        self.transitions = nn.Parameter(torch.zeros(num_heads, 2, 2, **factory))
        self.root_key = nn.Parameter(torch.zeros(num_heads, self.head_dim, **factory))
        self.root_value = nn.Parameter(torch.zeros(num_heads, self.head_dim, **factory))
        self.coupling = nn.Parameter(torch.zeros(num_heads, **factory))
        self._reset_parameters()

    @classmethod
    def from_torch(
        cls, mha: nn.MultiheadAttention, normalizer: str | Sequence[str] = "softmax", **kwargs
    ) -> StructuredMultiheadAttention:
        """Build from an existing ``nn.MultiheadAttention``, copying its weights."""
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("`add_bias_kv` and `add_zero_attn` are not supported")
        ref = mha.out_proj.weight
        new = cls(
            mha.embed_dim,
            mha.num_heads,
            dropout=mha.dropout,
            bias=mha.in_proj_bias is not None,
            kdim=mha.kdim,
            vdim=mha.vdim,
            batch_first=mha.batch_first,
            device=ref.device,
            dtype=ref.dtype,
            normalizer=normalizer,
            **kwargs,
        )
        new.load_state_dict(mha.state_dict(), strict=False)
        return new

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        nn.init.normal_(self.root_key, std=self.head_dim**-0.5)

    # ---- projections ------------------------------------------------------------------------
    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        e = self.embed_dim
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.split(e)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.split(e)
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def _heads(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)  # [B,H,L,d]

    # ---- normalisers ------------------------------------------------------------------------
    def _tree(
        self, scores: Tensor, q: Tensor, heads: Tensor, lengths: Tensor, kind: str
    ) -> tuple[Tensor, Tensor]:
        """scores [B, h, L, L] for the heads ``heads`` -> (weights [B, h, L, L], root [B,h,L])."""
        batch, nh, length, _ = scores.shape
        root = torch.einsum("bhld,hd->bhl", q, self.root_key[heads]) / math.sqrt(self.head_dim)
        arcs = scores.new_zeros(batch, nh, length + 1, length + 1)
        arcs[:, :, 0, 1:] = root  # ROOT -> m
        arcs[:, :, 1:, 1:] = scores.transpose(-1, -2)  # arcs[h, m] = S[m, h]
        flat = arcs.reshape(batch * nh, length + 1, length + 1)
        tree_lengths = (lengths + 1).repeat_interleave(nh)
        dist: TreeCRFBase
        if kind == "projective":
            dist = DependencyCRF(flat, tree_lengths, validate_args=False)
        else:
            from ..distributions.nonprojective import NonProjectiveDependencyCRF

            dist = NonProjectiveDependencyCRF(flat, tree_lengths, validate_args=False)
        marginals = dist.marginals.reshape(batch, nh, length + 1, length + 1)
        return marginals[:, :, 1:, 1:].transpose(-1, -2), marginals[:, :, 0, 1:]

    def _segmentation(self, scores: Tensor, heads: Tensor, lengths: Tensor) -> Tensor:
        batch, nh, queries, keys = scores.shape
        on = scores.reshape(-1, keys)  # [B*h*L, S]
        unary = torch.stack([torch.zeros_like(on), on], dim=-1)  # [B*h*L, S, 2]
        pairwise = self.transitions[heads].to(on.dtype)  # [h, 2, 2]
        pairwise = pairwise.view(1, nh, 1, 1, 2, 2).expand(batch, nh, queries, keys - 1, 2, 2)
        chain_lengths = lengths.repeat_interleave(nh * queries)
        crf = LinearChainCRF(
            unary, pairwise.reshape(-1, keys - 1, 2, 2), chain_lengths, validate_args=False
        )
        return crf.marginals[..., 1].reshape(batch, nh, queries, keys)

    def _mean_field(self, scores: Tensor, k: Tensor, heads: Tensor, allowed: Tensor) -> Tensor:
        batch, nh, queries, keys = scores.shape
        beta = self.coupling[heads].view(1, nh, 1, 1)
        coupling = beta * torch.einsum("bhid,bhjd->bhij", k, k) / math.sqrt(self.head_dim)
        eye = torch.eye(keys, dtype=torch.bool, device=scores.device)
        coupling = coupling.masked_fill(eye, 0.0).unsqueeze(2).expand(-1, -1, queries, -1, -1)
        mask = allowed.expand(batch, nh, queries, keys).reshape(-1, keys)
        spins = mean_field_marginals(
            scores.reshape(-1, keys),
            coupling.reshape(-1, keys, keys),
            self.mean_field_iterations,
            mask,
        )
        return spins.reshape(batch, nh, queries, keys)

    # ---- forward ----------------------------------------------------------------------------
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        batch, length, _ = query.shape
        source = key.shape[1]
        q, k, v = (self._heads(x) for x in self._project(query, key, value))  # [B, H, *, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # [B,H,L,S]

        allowed = torch.ones(batch, 1, 1, source, dtype=torch.bool, device=scores.device)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (batch, source):
                raise ValueError(f"`key_padding_mask` must have shape ({batch}, {source})")
            if key_padding_mask.dtype == torch.bool:
                allowed = ~key_padding_mask.view(batch, 1, 1, source)
            else:
                scores = scores + key_padding_mask.view(batch, 1, 1, source).to(scores.dtype)
        if is_causal and attn_mask is None:
            attn_mask = torch.ones(length, source, dtype=torch.bool, device=scores.device)
            attn_mask = attn_mask.triu(1)
        structured = any(n in _STRUCTURED for n in self.normalizers)
        if attn_mask is not None:
            if structured:
                raise ValueError("`attn_mask`/`is_causal` are not supported by structured heads")
            mask = (
                attn_mask.view(-1, self.num_heads, length, source)
                if attn_mask.dim() == 3
                else attn_mask
            )
            if mask.dtype == torch.bool:
                allowed = allowed & ~mask
            else:
                scores = scores + mask.to(scores.dtype)
        lengths = None
        if structured:
            lengths = prefix_lengths(allowed.view(batch, source), minimum=1)

        weights = torch.zeros_like(scores)
        root_share = None
        for name in dict.fromkeys(self.normalizers):  # one batched call per normaliser kind
            heads = torch.tensor(
                [i for i, n in enumerate(self.normalizers) if n == name], device=scores.device
            )
            s = scores.index_select(1, heads)
            if name == "softmax":
                w = masked_softmax(s, allowed)
            elif name == "sigmoid":
                w = torch.sigmoid(s).masked_fill(~allowed, 0.0)
            elif name == "segmentation":
                assert lengths is not None
                w = self._segmentation(s, heads, lengths)
            elif name == "mean-field":
                w = self._mean_field(s, k.index_select(1, heads), heads, allowed)
            else:
                if length != source:
                    raise ValueError(f"'{name}' heads need self-attention (L == S)")
                assert lengths is not None
                w, root = self._tree(s, q.index_select(1, heads), heads, lengths, name)
                share = torch.zeros(batch, self.num_heads, length, device=scores.device)
                root_share = (root_share if root_share is not None else share).index_copy(
                    1, heads, root.to(share.dtype)
                )
            weights = weights.index_copy(1, heads, w)
        if self.training and self.dropout > 0:
            weights = F.dropout(weights, p=self.dropout)
        out = torch.matmul(weights, v)  # [B, H, L, d]
        if root_share is not None:
            out = out + root_share.to(out.dtype).unsqueeze(-1) * self.root_value.view(
                1, self.num_heads, 1, self.head_dim
            )
        out = self.out_proj(out.transpose(1, 2).reshape(batch, length, self.embed_dim))
        if not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        return out, weights.mean(1) if average_attn_weights else weights
