"""Structured heads in a Hugging Face ``transformers`` BERT / RoBERTa-style model.

:func:`structure_attention` replaces the self-attention module of each layer
(``BertSelfAttention``, ``RobertaSelfAttention`` and the like: ``query``, ``key`` and
``value`` linear maps) by a :class:`StructuredSelfAttention`, a
:class:`~structattn.attention.StructuredMultiheadAttention` whose packed input projection is
the pretrained ``query`` / ``key`` / ``value`` weights; the output projection stays the
model's own (``attention.output.dense``), so with ``"softmax"`` heads the model computes what
it computed before (tested to float rounding). The structure of each head is configurable
(one name for all heads, one per head, or ``{layer index: ...}``;
:data:`structattn.names.STRUCTURES`)::

    from transformers import BertModel
    from structattn.integrations.huggingface import from_pretrained, structure_attention

    model = BertModel.from_pretrained("bert-base-uncased")
    structure_attention(model, ["projective"] * 4 + ["softmax"] * 8)   # in place
    ...  # fine-tune
    model.save_pretrained("out")                    # the heads are in config.json
    model = from_pretrained(BertModel, "out")       # structured again, with its weights

Masks: the model's padding reaches the heads as Hugging Face builds it (a 4-D additive mask
of ``0`` and ``torch.finfo(dtype).min`` for the ``"eager"`` attention implementation, a 4-D
boolean mask, True = attend, for ``"sdpa"``, or none): a mask that is the same for every
query is passed on as a ``key_padding_mask`` (``finfo.min`` meaning padding, not a bias), any
other (a decoder's causal mask) as an ``attn_mask``, which tree heads refuse (a tree is one
structure over the whole sequence). Padding must be at the end (right padding, the
tokenizers' default) for structured heads.

Not supported, each refused with a ``ValueError`` that says so: cross-attention (a decoder's
``crossattention`` modules are left as they are, softmax; a :class:`StructuredSelfAttention`
called with ``encoder_hidden_states`` refuses), a key/value cache (pass ``use_cache=False``),
``head_mask``, relative position embeddings, and ``flex_attention``'s block masks (use
``attn_implementation="eager"`` or ``"sdpa"``; a 2-D ``[B, L]`` mask, 1 = a token, is taken
as padding). ``output_attentions=True`` returns each layer's weights [B, H, L, L] (the
probabilities of the structured heads; with transformers 5's output capturing).

``transformers`` is an optional dependency (``pip install structattn[hf]``): this module
never imports it (it works on the model objects it is given), so importing it needs only
torch. Tested with transformers 5.24; the positional call of transformers 4's
``BertSelfAttention`` is accepted but untested with transformers 4.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..attention import StructuredMultiheadAttention
from ..names import Structure

__all__ = [
    "CONFIG_KEY",
    "StructuredSelfAttention",
    "from_pretrained",
    "structure_attention",
    "structured_model_class",
]

#: the attribute of the model's config (saved in ``config.json``) that holds the heads
CONFIG_KEY = "structattn"


class StructuredSelfAttention(nn.Module):
    """A Hugging Face BERT-style self-attention module with structured heads.

    ``forward(hidden_states [B, L, E], attention_mask=None, ...) -> (context [B, L, E],
    weights [B, H, L, L])``, the call and return of ``BertSelfAttention`` (transformers 5;
    the positional order of transformers 4 is accepted too). ``attention`` is the
    :class:`~structattn.attention.StructuredMultiheadAttention` (batch first; its
    ``out_proj`` is the identity: the model's ``attention.output.dense`` follows). Build it
    with :meth:`from_hf` (or :func:`structure_attention`).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        normalizer: Structure | Sequence[Structure] = "softmax",
        dropout: float = 0.0,
        is_causal: bool = False,
        mean_field_iterations: int = 3,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.attention = StructuredMultiheadAttention(
            hidden_size,
            num_heads,
            dropout=dropout,
            batch_first=True,
            normalizer=normalizer,
            mean_field_iterations=mean_field_iterations,
            device=device,
            dtype=dtype,
        )
        # the model's own output projection (attention.output.dense) follows this module
        self.attention.out_proj = nn.Identity()  # type: ignore[assignment]
        self.is_causal = is_causal
        self.num_attention_heads = num_heads
        self.attention_head_size = hidden_size // num_heads

    @classmethod
    def from_hf(
        cls,
        module: nn.Module,
        normalizer: Structure | Sequence[Structure] = "softmax",
        mean_field_iterations: int = 3,
    ) -> StructuredSelfAttention:
        """Structured heads in place of a BERT-style self-attention ``module``, its
        ``query`` / ``key`` / ``value`` weights and biases copied into the packed input
        projection (structured parameters at their initial values; ``root_value`` and
        ``coupling`` start at 0). ``ValueError`` for a module that is not one."""
        problem = _not_self_attention(module)
        if problem:
            raise ValueError(f"cannot give {type(module).__name__} structured heads: {problem}")
        hf: Any = module  # checked above: query, key, value are nn.Linear maps
        query, key, value = hf.query, hf.key, hf.value
        weight = query.weight
        dropout = getattr(module, "dropout", None)
        new = cls(
            query.in_features,
            int(hf.num_attention_heads),
            normalizer=normalizer,
            dropout=float(dropout.p) if isinstance(dropout, nn.Dropout) else 0.0,
            is_causal=bool(getattr(module, "is_causal", False)),
            mean_field_iterations=mean_field_iterations,
            device=weight.device,
            dtype=weight.dtype,
        )
        new.train(module.training)
        mha = new.attention
        with torch.no_grad():
            mha.in_proj_weight.copy_(torch.cat([query.weight, key.weight, value.weight]))
            assert mha.in_proj_bias is not None
            mha.in_proj_bias.copy_(torch.cat([query.bias, key.bias, value.bias]))
        return new

    @property
    def normalizers(self) -> tuple[str, ...]:
        """The structure of each head."""
        return self.attention.normalizers

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        head_mask: Tensor | None = None,
        encoder_hidden_states: Tensor | None = None,
        encoder_attention_mask: Tensor | None = None,
        past_key_value: Any = None,
        output_attentions: bool = False,
        *,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor]:
        """``hidden_states`` [B, L, E] -> (context [B, L, E] before the output projection,
        weights [B, H, L, L]). ``attention_mask``: Hugging Face's 4-D mask [B, 1 or H, 1 or
        L, L] (additive float, or boolean with True = attend) or None."""
        if encoder_hidden_states is not None or encoder_attention_mask is not None:
            raise ValueError(
                "StructuredSelfAttention is self-attention only: cross-attention "
                "(`encoder_hidden_states`) is not supported; the model's cross-attention "
                "modules keep their softmax heads"
            )
        if cache is not None or past_key_value is not None:
            raise ValueError(
                "structured heads attend over the whole sequence at once and keep no "
                "key/value cache: call the model with use_cache=False"
            )
        if head_mask is not None:
            raise ValueError("`head_mask` is not supported by structured heads")
        batch, length, _ = hidden_states.shape
        key_padding_mask, attn_mask = _hf_masks(attention_mask, batch, length, self.num_heads)
        if self.is_causal and attn_mask is None and length > 1:  # sdpa: no mask when unpadded
            attn_mask = torch.ones(length, length, dtype=torch.bool, device=hidden_states.device)
            attn_mask = attn_mask.triu(1)
        out, weights = self.attention(
            hidden_states,
            hidden_states,
            hidden_states,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            need_weights=True,
            average_attn_weights=False,
        )
        assert weights is not None
        return out, weights

    @property
    def num_heads(self) -> int:
        return self.attention.num_heads


def _not_self_attention(module: nn.Module) -> str:
    """Why ``module`` is not a BERT-style self-attention module ('' if it is one)."""
    parts = [getattr(module, name, None) for name in ("query", "key", "value")]
    if not all(isinstance(p, nn.Linear) for p in parts):
        return "it has no `query`, `key` and `value` nn.Linear maps"
    if not isinstance(getattr(module, "num_attention_heads", None), int):
        return "it has no `num_attention_heads`"
    query, key, value = parts
    assert isinstance(query, nn.Linear) and isinstance(key, nn.Linear)
    assert isinstance(value, nn.Linear)
    sizes = {query.in_features, query.out_features, key.in_features, key.out_features}
    sizes |= {value.in_features, value.out_features}
    if len(sizes) != 1:
        return "its query, key and value maps are not all hidden_size x hidden_size"
    if query.bias is None or key.bias is None or value.bias is None:
        return "its query, key and value maps have no bias"
    position = getattr(module, "position_embedding_type", "absolute")
    if position != "absolute":
        return f"relative position embeddings ({position!r}) are not supported"
    return ""


def _hf_masks(mask: object, batch: int, length: int, heads: int) -> tuple[Any, Any]:
    """Hugging Face's attention mask -> (key_padding_mask [B, L] or None, attn_mask
    [B * H, L, L] or None) in PyTorch's convention (boolean True = not allowed; float added,
    ``finfo.min`` meaning not allowed). One host synchronisation (are all rows the same?)."""
    if mask is None:
        return None, None
    if not isinstance(mask, Tensor):
        raise ValueError(
            f"attention masks of type {type(mask).__name__} are not supported (flex "
            "attention?): load the model with attn_implementation='eager' or 'sdpa'"
        )
    if mask.dim() == 2 and tuple(mask.shape) == (batch, length):  # [B, S], 1 = attend
        return mask == 0, None
    if mask.dim() != 4 or mask.shape[0] != batch or mask.shape[-1] != length:
        raise ValueError(
            f"expected Hugging Face's attention mask [B, 1 or H, 1 or L, L] = [{batch}, ..., "
            f"{length}], got shape {tuple(mask.shape)}"
        )
    if mask.shape[1] not in (1, heads) or mask.shape[2] not in (1, length):
        raise ValueError(f"attention mask of shape {tuple(mask.shape)}: bad head or query size")
    if mask.dtype == torch.bool:
        mask = ~mask  # Hugging Face / SDPA: True = attend; PyTorch's MHA: True = not allowed
    elif not mask.is_floating_point():
        raise ValueError(f"attention mask of dtype {mask.dtype}: expected bool or float")
    first = mask[:, :1, :1, :]  # [B, 1, 1, S]
    if torch.equal(mask, first.expand_as(mask)):  # padding only
        return first.reshape(batch, length), None
    return None, mask.expand(batch, heads, length, length).reshape(batch * heads, length, length)


def _record_weights(module: StructuredSelfAttention) -> None:
    """Let ``output_attentions=True`` collect ``module``'s weights: transformers 5 collects
    them by a forward hook on the classes a model names (``BertSelfAttention``), which this
    one is not. Nothing happens where that machinery is not loaded (other versions)."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    install = getattr(capturing, "install_output_capuring_hook", None)  # (sic)
    install = install or getattr(capturing, "install_output_capturing_hook", None)
    if callable(install):
        install(module, "attentions", 1)


def _self_attention_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) of each self-attention module of ``model``, in order:
    the BERT-style ones (``query`` / ``key`` / ``value``, a class name ending in
    ``SelfAttention``) and those already structured; none inside a ``crossattention``
    (transformers 4 gave cross-attention ``BertSelfAttention`` modules too)."""
    found = []
    for path, parent in model.named_modules():
        if "crossattention" in path.split("."):
            continue
        for name, child in parent.named_children():
            if name == "crossattention":
                continue
            structured = isinstance(child, StructuredSelfAttention)
            if structured or (
                type(child).__name__.endswith("SelfAttention")
                and hasattr(child, "query")
                and hasattr(child, "key")
            ):
                found.append((parent, name, child))
    return found


def _heads_of(normalizer: object, heads: int, layer: int) -> Structure | Sequence[Structure]:
    """The heads of layer ``layer``: one name, a list of ``heads`` names, or (a dict
    ``{layer: spec}``) that layer's entry (``softmax`` for a layer it leaves out)."""
    if isinstance(normalizer, dict):
        spec: Any = normalizer.get(layer, "softmax")
        return spec
    return normalizer  # type: ignore[return-value]


def structure_attention(
    model: nn.Module,
    normalizer: Structure | Sequence[Structure] | dict[int, Structure | Sequence[Structure]],
    *,
    mean_field_iterations: int = 3,
) -> nn.Module:
    """Give the self-attention of ``model`` (a Hugging Face BERT / RoBERTa-style model, or
    any module holding such layers) structured heads, in place; returns ``model``.

    ``normalizer``: one structure for every head of every layer, a list of one per head
    (``num_attention_heads`` names) for every layer, or a dict ``{layer index: one name or
    a list}`` (layers it leaves out get ``"softmax"`` heads, which compute what the original
    layer did). The pretrained query / key / value weights are kept (see
    :meth:`StructuredSelfAttention.from_hf`); a layer that is already structured gets the new
    heads with its own projection weights. The settings are recorded in
    ``model.config.structattn`` (saved by ``save_pretrained``; :func:`from_pretrained` reads
    them back). ``ValueError`` if ``model`` has no such layer, for a bad layer index, and for
    a bad structure name or number of names (naming the layer).
    """
    found = _self_attention_modules(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no BERT-style self-attention module (a "
            "...SelfAttention with `query`, `key` and `value` nn.Linear maps) to replace"
        )
    if isinstance(normalizer, dict):  # keys: layer indices (strings in a saved config.json)
        keys = {k: int(k) if isinstance(k, str) and k.isdigit() else k for k in normalizer}
        normalizer = {keys[k]: v for k, v in normalizer.items()}
        bad = [k for k in normalizer if not (isinstance(k, int) and 0 <= k < len(found))]
        if bad:
            raise ValueError(
                f"`normalizer` names layer(s) {bad}; the model has layers 0..{len(found) - 1}"
            )
    replaced = []
    for layer, (parent, name, module) in enumerate(found):
        heads = _heads_of(normalizer, len(found), layer)
        if isinstance(module, StructuredSelfAttention):  # back to the projections it holds
            module = _HFLike(module)
        try:
            replaced.append(
                (
                    parent,
                    name,
                    StructuredSelfAttention.from_hf(module, heads, mean_field_iterations),
                )
            )
        except ValueError as error:
            raise ValueError(f"layer {layer}: {error}") from None
    for parent, name, new in replaced:
        setattr(parent, name, new)
        _record_weights(new)
    config = getattr(model, "config", None)
    if config is not None:
        spec: Any = normalizer
        if isinstance(normalizer, dict):
            spec = {str(k): v if isinstance(v, str) else list(v) for k, v in normalizer.items()}
        elif not isinstance(normalizer, str):
            spec = list(normalizer)
        setattr(
            config,
            CONFIG_KEY,
            {"normalizer": spec, "mean_field_iterations": mean_field_iterations},
        )
    return model


class _HFLike(nn.Module):
    """The query / key / value maps of a :class:`StructuredSelfAttention` under BERT's names
    (copies of its packed weights), to give it other heads."""

    def __init__(self, module: StructuredSelfAttention) -> None:
        super().__init__()
        mha = module.attention
        size = mha.embed_dim
        assert mha.in_proj_bias is not None
        weights = mha.in_proj_weight.detach().split(size)
        biases = mha.in_proj_bias.detach().split(size)
        for name, w, b in zip(("query", "key", "value"), weights, biases, strict=True):
            linear = nn.Linear(size, size, device=w.device, dtype=w.dtype)
            with torch.no_grad():
                linear.weight.copy_(w)
                linear.bias.copy_(b)
            setattr(self, name, linear)
        self.num_attention_heads = mha.num_heads
        self.dropout = nn.Dropout(mha.dropout)
        self.is_causal = module.is_causal
        self.train(module.training)


_CLASSES: dict[type, type] = {}


def structured_model_class(model_class: type) -> type:
    """A subclass of the Hugging Face model class ``model_class`` (``BertModel``,
    ``RobertaForMaskedLM``, ...) whose constructor gives the model the structured heads its
    config records (``config.structattn``, written by :func:`structure_attention`), so that
    its ``from_pretrained`` loads a saved structured model with every weight (Hugging Face's
    own loading: sharded files, ``dtype``, ``device_map``). One class per ``model_class``,
    named ``Structured<name>``."""
    if model_class not in _CLASSES:

        def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
            base: Any = model_class
            base.__init__(self, config, *args, **kwargs)
            settings = getattr(config, CONFIG_KEY, None)
            if not isinstance(settings, dict) or "normalizer" not in settings:
                raise ValueError(
                    f"the config has no `{CONFIG_KEY}` settings: not a model saved after "
                    "structure_attention (load it with the plain class, then call "
                    "structure_attention)"
                )
            structure_attention(self, **settings)

        name = f"Structured{model_class.__name__}"
        _CLASSES[model_class] = type(
            name,
            (model_class,),
            {"__init__": __init__, "__module__": __name__, "__qualname__": name},
        )
    return _CLASSES[model_class]


def from_pretrained(model_class: type, path: str, *args: Any, **kwargs: Any) -> Any:
    """Load a model saved (``save_pretrained``) after :func:`structure_attention`:
    ``structured_model_class(model_class).from_pretrained(path, *args, **kwargs)``, the
    structured heads rebuilt from ``config.structattn`` and every weight loaded. The model
    is an instance of ``model_class``.

    A plain ``model_class.from_pretrained`` of such a folder would not know the heads: it
    would warn of missing query / key / value weights and initialise them at random."""
    structured: Any = structured_model_class(model_class)
    return structured.from_pretrained(path, *args, **kwargs)
