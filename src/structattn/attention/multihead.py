"""A drop-in replacement for ``torch.nn.MultiheadAttention`` with structured heads."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._validation import prefix_lengths, split_attention_mask
from ..names import Structure, TreeStructure, WeightKind
from ._common import refuse_scripting
from ._spans import span_self_attention_weights
from ._weights import check_weights
from .normalizers import (
    NORMALIZERS,
    mean_field_weights,
    segmentation_weights,
    self_attention_tree_weights,
    sigmoid_weights,
    softmax_weights,
)

__all__ = ["NORMALIZERS", "StructuredMultiheadAttention"]

#: the parameters of structured heads (none of them exists when every head is softmax)
_STRUCTURED_PARAMETERS = ("transitions", "root_key", "root_value", "coupling")


class StructuredMultiheadAttention(nn.Module):
    r"""``nn.MultiheadAttention`` whose heads normalise scores with a structured distribution.

    Same constructor arguments and call signature ``forward(query, key, value,
    key_padding_mask=None, need_weights=True, attn_mask=None, average_attn_weights=True,
    is_causal=False) -> (output, weights)``, batched ``[B, L, E]`` (``[L, B, E]`` without
    ``batch_first``), unbatched ``[L, E]`` or nested (batch first) inputs. With only softmax
    heads the parameters are exactly those of ``nn.MultiheadAttention`` (``in_proj_weight``,
    ``in_proj_bias``, ``out_proj``; or ``q/k/v_proj_weight`` when ``kdim``/``vdim``
    differ), so state dicts load both ways. Structured heads add their own parameters
    (below); loading an ``nn.MultiheadAttention`` state dict sets those to their initial
    values and warns.

    Masks follow PyTorch's conventions: a boolean ``key_padding_mask``/``attn_mask`` is True
    where attention is NOT allowed; a float mask is added to the scores, ``-inf`` meaning not
    allowed, so a float mask and the equivalent boolean mask give the same result for every
    head. ``attn_mask`` is ``[L, S]`` or ``[B * num_heads, L, S]``. A float mask value at or
    below ``torch.finfo(dtype).min / 2`` also means not allowed (padding), not a bias, for
    every head (``dtype``: the narrower of the mask's and the scores' dtypes): Hugging Face
    models mark padding with ``finfo.min``, which a tree or segmentation head would otherwise
    take as a very negative score of a key still in its structure (softmax heads give the same
    weights either way, except in a row with no key allowed: 0 here, uniform in
    ``nn.MultiheadAttention``).

    With scores S = (Q W_q)(K W_k)^T / sqrt(d) per head, each head's weights are
    (:mod:`structattn.attention.normalizers`):

    * ``"softmax"``: softmax over keys (identical to ``nn.MultiheadAttention``);
    * ``"sigmoid"``: sigmoid(S) (independent Bernoulli selection);
    * ``"segmentation"``: p(z_i = 1) of a 2-state chain over each query's allowed keys with
      unary S[q, i] and a learned 2x2 ``transitions`` matrix per head;
    * ``"projective"`` / ``"non-projective"``: self-attention (L = S) over soft parents: the
      weight of key h for query m is p(h is the head of m) under a dependency CRF with arc
      scores S[m, h] and a learned ``root_key`` per head; the ROOT's share multiplies a
      learned ``root_value`` (zero at init), so tree rows sum to 1 - p(m attaches to ROOT);
    * ``"mean-field"``: k mean-field iterations with unary S and J = beta_h K K^T / sqrt(d)
      (``coupling`` beta_h learned, 0 at init: starts as sigmoid attention);
    * ``"constituency"`` / ``"semi-markov"``: self-attention (L = S) over spans. The span
      [i, j] (i <= j) scores S[i, j] (its first position as the query, its last as the
      key); a constituency-tree CRF (binary bracketings, CKY) or a semi-Markov CRF
      (segmentations into segments of at most ``max_segment_width`` positions) over the
      keys gives span marginals mu_ij, and the weight of key k for query q is the
      expected, normalised membership of k in q's constituents / segment:
      w_qk = sum_{[i, j] contains q and k} mu_ij / (j - i + 1), divided by
      sum_{[i, j] contains q} mu_ij (:func:`~structattn.attention.spans.span_membership`).
      Each of q's spans spreads a unit uniformly over its members; for a segmentation
      (one segment contains q) w_qk = E[1[k in seg(q)] / |seg(q)|] exactly, for a tree it
      is the ratio of the expected spread to the expected number of q's constituents (the
      chain from the word q to the sentence). Rows sum to 1; no parameters of their own.

    ``normalizer`` is one name for all heads or a sequence of ``num_heads`` names.
    ``weights`` chooses what the CRF heads (segmentation, tree and span heads) take of their
    CRF: ``"marginals"`` (default, the above), ``"sparse"`` (SparseMAP's sparse marginals,
    a mix of few structures) or ``"hard-st"`` (the MAP structure forward, the marginals'
    gradient backward: straight-through); softmax, sigmoid and mean-field heads ignore it.
    Segmentation and tree heads need padding at the end of the keys. Segmentation heads
    take an ``attn_mask`` whose allowed keys come first in every row (e.g. a causal mask:
    one chain over each query's prefix); tree heads take no ``attn_mask``/``is_causal``
    (a tree is one structure over all positions: masked keys would still change the
    weights). ``add_bias_kv`` and ``add_zero_attn`` are not supported.

    ``validate_args`` (default True) checks the values of the masks: no NaN or +inf in a
    float mask, allowed keys first where segmentation and tree heads need them (one host
    synchronisation per call). ``validate_args=False`` skips those checks (shapes and dtypes
    are still checked): no value is read on the host in a forward or backward pass (no
    device synchronisation on CUDA; what ``torch.compile`` and ``torch.export`` trace
    whole anyway). The distributions the heads build never check again: their inputs come
    from the masks.

    In PyTorch's Transformer layers, softmax-only layers keep the fused inference kernel
    (fast path, nested tensors); with any other head the layers call :meth:`forward`, since
    ``_qkv_same_embed_dim`` (the attribute they read to choose the kernel) is then False.

    Example:
        >>> mha = StructuredMultiheadAttention(16, 4, batch_first=True,
        ...                                    normalizer=["softmax", "projective"] * 2)
        >>> x = torch.randn(2, 5, 16)
        >>> out, weights = mha(x, x, x)
        >>> out.shape, weights.shape
        (torch.Size([2, 5, 16]), torch.Size([2, 5, 5]))
    """

    __prepare_scriptable__ = refuse_scripting  # torch.jit.script: one clear error

    transitions: nn.Parameter | None  # [segmentation heads, 2, 2]
    root_key: nn.Parameter | None  # [tree heads, d]
    root_value: nn.Parameter | None  # [tree heads, d]
    coupling: nn.Parameter | None  # [mean-field heads]

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
        normalizer: Structure | Sequence[Structure] = "softmax",
        mean_field_iterations: int = 3,
        max_segment_width: int | None = None,
        validate_args: bool = True,
        weights: WeightKind = "marginals",
    ) -> None:
        super().__init__()
        self.weights_mode = check_weights(weights)  # what CRF heads take of their CRF
        if add_bias_kv or add_zero_attn:
            raise ValueError("`add_bias_kv` and `add_zero_attn` are not supported")
        if embed_dim % num_heads:
            raise ValueError(f"`embed_dim` {embed_dim} must be divisible by `num_heads`")
        names = [normalizer] * num_heads if isinstance(normalizer, str) else list(normalizer)
        if len(names) != num_heads or any(n not in NORMALIZERS for n in names):
            raise ValueError(
                f"`normalizer` must be one of {tuple(NORMALIZERS)} or a list of {num_heads} "
                f"of them, got {normalizer!r}"
            )
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._packed_projections = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.normalizers = tuple(names)
        self.mean_field_iterations = mean_field_iterations
        self.validate_args = validate_args  # the masks' values (one host sync per call)
        if max_segment_width is not None and (
            not isinstance(max_segment_width, int)
            or isinstance(max_segment_width, bool)
            or max_segment_width < 1
        ):
            raise ValueError(
                f"`max_segment_width` must be a positive int or None, got {max_segment_width!r}"
            )
        self.max_segment_width = max_segment_width  # semi-markov heads (None: any length)
        # the heads of each normaliser (one batched call per kind), and each head's slot in
        # the parameters of its kind
        self._groups = {k: [i for i, n in enumerate(names) if n == k] for k in dict.fromkeys(names)}
        users = {
            p: [i for i, n in enumerate(names) if p in NORMALIZERS[n].parameters]
            for p in _STRUCTURED_PARAMETERS
        }
        self._users = users
        self._slots = {
            k: [users[NORMALIZERS[k].parameters[0]].index(i) for i in heads]
            for k, heads in self._groups.items()
            if NORMALIZERS[k].parameters
        }
        # (first, count) of a group or of its slots whose indices are consecutive: a view
        # (narrow) instead of a gather (index_select / advanced indexing and their backward)
        self._head_ranges = {k: _as_range(heads) for k, heads in self._groups.items()}
        self._slot_ranges = {k: _as_range(slots) for k, slots in self._slots.items()}
        if self._packed_projections:
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
        # structured-head parameters: one slot per head that uses them, none otherwise
        shapes = {
            "transitions": (2, 2),
            "root_key": (self.head_dim,),
            "root_value": (self.head_dim,),
            "coupling": (),
        }
        for name, shape in shapes.items():
            if users[name]:
                value = torch.empty(len(users[name]), *shape, **factory)
                self.register_parameter(name, nn.Parameter(value))
            else:
                self.register_parameter(name, None)
        self._reset_parameters()

    @classmethod
    def from_torch(
        cls,
        mha: nn.MultiheadAttention,
        normalizer: Structure | Sequence[Structure] = "softmax",
        **kwargs,
    ) -> StructuredMultiheadAttention:
        """Build from an existing ``nn.MultiheadAttention``, copying its weights (structured
        parameters start at their initial values)."""
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
        state = mha.state_dict()
        for name in _STRUCTURED_PARAMETERS:
            p = getattr(new, name)
            if p is not None:
                state[name] = p.detach()
        new.load_state_dict(state)
        return new

    def _initial_value(self, name: str) -> Tensor:
        """A freshly initialised value of the structured parameter ``name``."""
        p = getattr(self, name)
        value = torch.zeros_like(p, requires_grad=False)
        if name == "root_key":
            nn.init.normal_(value, std=self.head_dim**-0.5)
        return value

    def _reset_parameters(self) -> None:
        if self._packed_projections:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        with torch.no_grad():
            for name in _STRUCTURED_PARAMETERS:
                p = getattr(self, name)
                if p is not None:
                    p.copy_(self._initial_value(name))

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # (PyTorch's load_state_dict hands each module its own copy of the dict.) Up to
        # 0.1.0 every structured parameter had one slot per head, [num_heads, ...]: keep the
        # slots of the heads that use it
        for name in _STRUCTURED_PARAMETERS:
            own, saved = getattr(self, name), state_dict.get(prefix + name)
            if (
                own is not None
                and isinstance(saved, Tensor)
                and saved.dim() == own.dim()
                and saved.shape[0] == self.num_heads != own.shape[0]
            ):
                state_dict[prefix + name] = saved[self._users[name]]
        # an nn.MultiheadAttention state dict (or one of softmax-only heads) has projections
        # but no structured parameters: initialise those and say so
        has_projections = any(
            prefix + name in state_dict for name in ("in_proj_weight", "q_proj_weight")
        )
        absent = [
            name
            for name in _STRUCTURED_PARAMETERS
            if getattr(self, name) is not None and prefix + name not in state_dict
        ]
        if has_projections and absent:
            for name in absent:
                state_dict[prefix + name] = self._initial_value(name)
            warnings.warn(
                f"StructuredMultiheadAttention ({prefix or 'top level'}): the state dict has "
                f"no {', '.join(absent)} (an nn.MultiheadAttention state dict?); they were "
                "set to their initial values",
                UserWarning,
                stacklevel=3,
            )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    # ---- what PyTorch's Transformer layers read -----------------------------------------------
    @property
    def _qkv_same_embed_dim(self) -> bool:
        """True when PyTorch's Transformer layers may run this module through their fused
        softmax kernel (``in_proj_weight`` packed and every head softmax). They read this
        attribute (like ``nn.MultiheadAttention``'s) before their fast path and the encoder's
        nested-tensor path; any other head makes it False, so that they call :meth:`forward`."""
        return self._packed_projections and set(self.normalizers) == {"softmax"}

    def merge_masks(
        self, attn_mask: Tensor | None, key_padding_mask: Tensor | None, query: Tensor
    ) -> tuple[Tensor | None, int | None]:
        """``nn.MultiheadAttention.merge_masks``, for PyTorch's fused encoder-layer kernel."""
        if not self._qkv_same_embed_dim:  # the fused kernel would compute softmax heads
            raise RuntimeError("the fused softmax kernel cannot run structured heads")
        return nn.MultiheadAttention.merge_masks(
            self,  # type: ignore[arg-type]  # reads only num_heads
            attn_mask,
            key_padding_mask,
            query,
        )

    # ---- projections ------------------------------------------------------------------------
    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        e = self.embed_dim
        if self._packed_projections:
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
        """As ``nn.MultiheadAttention.forward``: (output like ``query``, weights [B, L, S]
        averaged over heads or [B, H, L, S]; without B for unbatched input; None unless
        ``need_weights``)."""
        if query.is_nested or key.is_nested or value.is_nested:
            return self._forward_nested(
                query,
                key,
                value,
                key_padding_mask,
                need_weights,
                attn_mask,
                average_attn_weights,
                is_causal,
            )
        rank = query.dim()
        if rank not in (2, 3) or key.dim() != rank or value.dim() != rank:
            raise ValueError(
                "`query`, `key` and `value` must all be batched (3-D) or all unbatched (2-D), "
                f"got shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        unbatched = rank == 2
        if unbatched:  # [L, E] -> [1, L, E]; attn_mask [L, S] or [H, L, S] is then valid
            query, key, value = (x.unsqueeze(0) for x in (query, key, value))
            if key_padding_mask is not None:
                if key_padding_mask.dim() != 1:
                    raise ValueError(
                        "`key_padding_mask` must have shape (S,) for unbatched input, got "
                        f"{tuple(key_padding_mask.shape)}"
                    )
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        out, weights = self._attend(query, key, value, key_padding_mask, attn_mask, is_causal)
        if unbatched:
            out = out[0]
        elif not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        weights = weights.mean(1) if average_attn_weights else weights  # [B, (H,) L, S]
        return out, weights[0] if unbatched else weights

    def _forward_nested(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        need_weights: bool,
        attn_mask: Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Nested (batch-first) inputs, as PyTorch's encoder passes them to its layers in
        inference: padded, attended with the padding mask, and nested again."""
        if not (query.is_nested and key.is_nested and value.is_nested):
            raise ValueError("`query`, `key` and `value` must be all nested or none")
        if key_padding_mask is not None or attn_mask is not None or is_causal:
            raise ValueError(
                "nested inputs carry their own padding: pass no `key_padding_mask`, "
                "`attn_mask` or `is_causal`"
            )
        if not self.batch_first:
            raise ValueError("nested inputs need `batch_first=True`")
        lengths = [t.shape[0] for t in query.unbind()]
        key_lengths = torch.tensor([t.shape[0] for t in key.unbind()], device=key.device)
        q, k, v = (x.to_padded_tensor(0.0) for x in (query, key, value))  # [B, L|S, E]
        padding = torch.arange(k.shape[1], device=k.device) >= key_lengths.unsqueeze(-1)
        out, weights = self.forward(
            q, k, v, padding, need_weights, average_attn_weights=average_attn_weights
        )
        pieces = [out[i, :n] for i, n in enumerate(lengths)]
        return torch.nested.as_nested_tensor(pieces, layout=query.layout), weights

    def _masks(
        self,
        scores: Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        is_causal: bool,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(scores plus any float mask, allowed BoolTensor broadcastable to the scores
        [B, H, L, S] or None = all, key lengths [B] for ordered heads or None)."""
        batch, heads, length, source = scores.shape
        device = scores.device
        ordered = any(NORMALIZERS[k].ordered for k in self._groups)
        allowed = key_lengths = None
        if key_padding_mask is not None:
            keep, bias = split_attention_mask(
                "key_padding_mask",
                _min_as_padding(key_padding_mask, scores.dtype),
                ((batch, source),),
                scores.dtype,
                self.validate_args,
            )
            keep = keep.to(device)
            if bias is not None:
                scores = scores + bias.to(device).view(batch, 1, 1, source)
            if ordered:
                key_lengths = prefix_lengths(
                    "key_padding_mask", keep, check=self.validate_args
                )  # [B]
            allowed = keep.view(batch, 1, 1, source)
        if is_causal and attn_mask is None:
            attn_mask = torch.ones(length, source, dtype=torch.bool, device=device).triu(1)
        if attn_mask is not None:
            joint = [k for k in self._groups if NORMALIZERS[k].joint]
            if joint:
                raise ValueError(
                    f"'{joint[0]}' heads do not take `attn_mask`/`is_causal`: a tree is one "
                    "structure over all positions, so masked keys would still change every "
                    "query's weights; pass padding as `key_padding_mask`"
                )
            keep, bias = split_attention_mask(
                "attn_mask",
                _min_as_padding(attn_mask, scores.dtype),
                ((length, source), (batch * heads, length, source)),
                scores.dtype,
                self.validate_args,
            )
            shape = (1, 1, length, source) if keep.dim() == 2 else (batch, heads, length, source)
            keep = keep.to(device).view(shape)
            if bias is not None:
                scores = scores + bias.to(device).view(shape)
            if ordered and self.validate_args:  # every row's allowed keys first (e.g. causal)
                prefix_lengths("attn_mask", keep)
            allowed = keep if allowed is None else allowed & keep
        return scores, allowed, key_lengths

    def _attend(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        is_causal: bool,
    ) -> tuple[Tensor, Tensor]:
        """Batch-first attention: (output [B, L, E], weights [B, H, L, S])."""
        batch, length, _ = query.shape
        if key.shape[:2] != value.shape[:2] or key.shape[0] != batch:
            raise ValueError(
                "`key` and `value` must have the batch of `query` and one length, got shapes "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        source = key.shape[1]
        q, k, v = (self._heads(x) for x in self._project(query, key, value))  # [B, H, *, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # [B,H,L,S]
        scores, allowed, key_lengths = self._masks(scores, key_padding_mask, attn_mask, is_causal)

        # (head indices, a range (first, count) or None = all, weights)
        parts: list[tuple[Tensor | tuple[int, int] | None, Tensor]] = []
        root_terms: list[tuple[Tensor | tuple[int, int] | None, Tensor]] = []  # ROOT values
        for kind, heads in self._groups.items():  # one batched call per normaliser kind
            index: Tensor | tuple[int, int] | None = None
            s, qh, kh, mask = scores, q, k, allowed
            span = self._head_ranges[kind]
            if len(heads) < self.num_heads and span is not None:
                index = span
                s, qh, kh = (x.narrow(1, *span) for x in (scores, q, k))
                if mask is not None and mask.shape[1] > 1:
                    mask = mask.narrow(1, *span)
            elif len(heads) < self.num_heads:
                index = torch.tensor(heads, device=scores.device)
                s, qh, kh = (x.index_select(1, index) for x in (scores, q, k))
                if mask is not None and mask.shape[1] > 1:
                    mask = mask.index_select(1, index)
            nh = len(heads)
            slots = self._slots.get(kind)
            slot_span = self._slot_ranges.get(kind)
            if kind == "softmax":
                w = s.softmax(-1) if mask is None else softmax_weights(s, mask)
            elif kind == "sigmoid":
                w = torch.sigmoid(s) if mask is None else sigmoid_weights(s, mask)
            elif kind == "segmentation":
                assert self.transitions is not None and slots is not None
                lengths = (
                    torch.full(s.shape[:-1], source, device=s.device)
                    if mask is None
                    else mask.expand(s.shape).sum(-1)
                )  # [B, h, L]: each query's chain
                transitions = _take(self.transitions, slots, slot_span).view(1, nh, 1, 2, 2)
                w = segmentation_weights(s, lengths, transitions, self.weights_mode)
            elif kind == "mean-field":
                assert self.coupling is not None and slots is not None
                beta = _take(self.coupling, slots, slot_span).view(1, nh, 1, 1)
                coupling = beta * torch.matmul(kh, kh.transpose(-1, -2)) / math.sqrt(self.head_dim)
                eye = torch.eye(source, dtype=torch.bool, device=s.device)
                coupling = coupling.masked_fill(eye, 0.0).unsqueeze(2)  # [B, h, 1, S, S]
                keep = mask if mask is not None else torch.ones_like(s, dtype=torch.bool)
                iterations = self.mean_field_iterations
                w = mean_field_weights(s, coupling, keep, iterations, self.validate_args)
            elif kind in ("constituency", "semi-markov"):  # self-attention over spans
                if length != source:
                    raise ValueError(f"'{kind}' heads need self-attention (L == S)")
                lengths = (
                    torch.full((batch,), source, device=s.device)
                    if key_lengths is None
                    else key_lengths
                )
                w = span_self_attention_weights(
                    s,
                    lengths.view(batch, 1).expand(-1, nh),
                    kind,
                    self.max_segment_width,
                    self.weights_mode,
                )
            else:  # projective, non-projective: self-attention over soft parents
                assert self.root_key is not None and self.root_value is not None
                assert slots is not None
                if length != source:
                    raise ValueError(f"'{kind}' heads need self-attention (L == S)")
                root_key = _take(self.root_key, slots, slot_span)  # [h, d]
                root = torch.matmul(qh, root_key.unsqueeze(-1)).squeeze(-1)  # [B, h, L]
                lengths = (
                    torch.full((batch,), source, device=s.device)
                    if key_lengths is None
                    else key_lengths
                )
                tree: TreeStructure = "projective" if kind == "projective" else "non-projective"
                w, share = self_attention_tree_weights(
                    s,
                    root / math.sqrt(self.head_dim),
                    lengths.view(batch, 1).expand(-1, nh),
                    tree,
                    self.weights_mode,
                )
                value_root = _take(self.root_value, slots, slot_span).view(1, nh, 1, -1)
                root_terms.append((index, share.unsqueeze(-1) * value_root))  # [B, h, L, d]
            parts.append((index, w))
        if len(parts) == 1:
            weights = parts[0][1]
        elif all(isinstance(index, tuple) for index, _ in parts):  # ranges tiling the heads
            ordered = sorted(parts, key=lambda part: part[0])  # type: ignore[arg-type,return-value]
            weights = torch.cat([w.to(scores.dtype) for _, w in ordered], 1)
        else:
            weights = scores.new_zeros(batch, self.num_heads, length, source)
            for index, w in parts:
                assert index is not None
                if isinstance(index, tuple):
                    index = torch.arange(index[0], index[0] + index[1], device=scores.device)
                weights = weights.index_copy(1, index, w.to(weights.dtype))
        if self.training and self.dropout > 0:
            weights = F.dropout(weights, p=self.dropout)
        out = torch.matmul(weights, v)  # [B, H, L, d]
        for index, term in root_terms:
            term = term.to(out.dtype)
            if isinstance(index, tuple):
                index = torch.arange(index[0], index[0] + index[1], device=out.device)
            out = out + term if index is None else out.index_add(1, index, term)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, length, self.embed_dim))
        return out, weights


def _min_as_padding(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A float ``mask`` with its values at or below ``finfo.min / 2`` (of the narrower of its
    dtype and ``dtype``, the scores') set to ``-inf``: padding, as Hugging Face marks it.
    Other masks (boolean, or not a tensor: the caller's check names them) as they are."""
    if not isinstance(mask, Tensor) or not mask.is_floating_point():
        return mask
    floor = max(torch.finfo(mask.dtype).min, torch.finfo(dtype).min) / 2
    return mask.masked_fill(mask <= floor, float("-inf"))


def _as_range(indices: Sequence[int]) -> tuple[int, int] | None:
    """(first, count) if ``indices`` are consecutive and ascending, else None."""
    if indices and list(indices) == list(range(indices[0], indices[0] + len(indices))):
        return indices[0], len(indices)
    return None


def _take(parameter: Tensor, slots: Sequence[int], span: tuple[int, int] | None) -> Tensor:
    """``parameter[slots]``: a view when the slots are consecutive."""
    return parameter.narrow(0, *span) if span is not None else parameter[list(slots)]
