"""Decomposable attention for natural language inference (Parikh et al. 2016) with optional
intra-sentence (syntactic) attention, as in Kim et al. 2017, sec. 4.4 and Appendix A.5.

Premise words x_1..x_n and hypothesis words y_1..y_m are fixed pretrained embeddings followed
by a trained linear layer. Each sentence's words are optionally concatenated with a context
c_j (``intra``):

* ``none``: no context, x^_j = x_j;
* ``simple``: c_j = sum_i softmax_i(theta_ij) x_i (Parikh et al.'s intra-sentence attention);
* ``structured``: c_j = sum_i p(z_ij = 1 | x) x_i, the soft parent of j under a projective
  dependency-tree CRF over theta (:class:`~structattn.attention.SyntacticAttention`);
* ``hard-parent``: c_j = x_head(j), heads given by a pipeline parser (ROOT: a learned vector).

Then: attend, e_ij = f(x^_i)^T f(y^_j), beta_i = sum_j softmax_j(e_ij) y^_j,
alpha_j = sum_i softmax_i(e_ij) x^_i; compare, v1_i = g([x^_i; beta_i]), v2_j = g([y^_j; alpha_j]);
aggregate, logits = V h([sum_i v1_i; sum_j v2_j]) + b. f, g, h: 2-layer ReLU MLPs with dropout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import SyntacticAttention, masked_softmax
from ..data.batching import pad_sequences
from ..data.classification import word_vocabulary
from ..data.embeddings import embedding_table
from ..data.nli import EncodedPairs
from ..names import VARIANT_STRUCTURES, AttentionVariant

__all__ = [
    "INTRA_ATTENTION",
    "DecomposableAttention",
    "IntraAttention",
    "NLIOutput",
    "forward_batch",
    "induced_heads",
    "mlp",
    "predict_pairs",
    "sentence_tree",
]

#: intra-sentence attention: the papers' variants (structattn.names) or a pipeline parse
IntraAttention = Literal[AttentionVariant, "hard-parent"]
INTRA_ATTENTION: tuple[IntraAttention, ...] = get_args(IntraAttention)


def mlp(input_dim: int, hidden_dim: int, dropout: float, layers: int = 2) -> nn.Sequential:
    """``layers`` x (dropout, linear, ReLU), as in Parikh et al.'s F, G and H."""
    modules: list[nn.Module] = []
    for k in range(layers):
        modules += [
            nn.Dropout(dropout),
            nn.Linear(input_dim if k == 0 else hidden_dim, hidden_dim),
            nn.ReLU(),
        ]
    return nn.Sequential(*modules)


class NLIOutput(NamedTuple):
    """Outputs of :class:`DecomposableAttention`."""

    logits: Tensor  # [B, C] class scores
    alignment: Tensor  # [B, N, M] e_ij (padding at -inf-free zeros)
    premise_marginals: Tensor | None  # [B, N+1, N+1] intra weights (ROOT at 0), if any
    hypothesis_marginals: Tensor | None  # [B, M+1, M+1]


class DecomposableAttention(nn.Module):
    """Decomposable attention over fixed embeddings, see the module docstring.

    Args:
        embeddings: FloatTensor[V, E], the fixed table (row 0 = padding).
        hidden_dim: size of the projected inputs and of every MLP (paper: 300).
        classes: number of labels.
        intra: ``none``, ``simple``, ``structured`` or ``hard-parent``.
        parser_dim: size of each LSTM direction and of the MLP of the arc scorer.
        dropout: dropout of the MLPs (paper: 0.2).
        children: ``structured`` only: also concatenate the soft children.
        parser_layers: BiLSTM layers of the arc scorer (paper: 1).

    ``forward(premise [B, N], premise_mask [B, N], hypothesis [B, M], hypothesis_mask [B, M],
    premise_heads=None, hypothesis_heads=None)``; heads (``hard-parent`` only) are LongTensor
    [B, N] with 0 = ROOT and word j's head as its 1-based position (any value at padding).
    """

    def __init__(
        self,
        embeddings: Tensor,
        hidden_dim: int = 300,
        classes: int = 3,
        intra: IntraAttention = "none",
        parser_dim: int = 50,
        dropout: float = 0.2,
        children: bool = False,
        parser_layers: int = 1,
    ) -> None:
        super().__init__()
        if intra not in INTRA_ATTENTION:
            raise ValueError(f"`intra` must be one of {INTRA_ATTENTION}, got {intra!r}")
        if children and intra != "structured":
            raise ValueError("`children` needs intra='structured'")
        self.intra = intra
        self.embed = nn.Embedding.from_pretrained(embeddings.float(), freeze=True, padding_idx=0)
        self.project = nn.Linear(embeddings.shape[1], hidden_dim)
        self.syntactic: SyntacticAttention | None = None
        self.root: nn.Parameter | None = None
        width = hidden_dim
        structure = None if intra == "hard-parent" else VARIANT_STRUCTURES[intra]
        if structure is not None:  # simple, structured
            self.syntactic = SyntacticAttention(
                hidden_dim,
                parser_dim,
                structure=structure,
                children=children,
                scorer_layers=parser_layers,
            )
            width = (3 if children else 2) * hidden_dim
        elif intra == "hard-parent":
            self.root = nn.Parameter(torch.zeros(hidden_dim))
            width = 2 * hidden_dim
        self.attend = mlp(width, hidden_dim, dropout)  # F
        self.compare = mlp(2 * width, hidden_dim, dropout)  # G
        self.aggregate = mlp(2 * hidden_dim, hidden_dim, dropout)  # H
        self.classify = nn.Linear(hidden_dim, classes)

    def init_normal(self, std: float) -> None:
        """Every trained parameter from N(0, std^2) (the paper: std 0.01); the fixed
        embeddings are kept."""
        for name, p in self.named_parameters():
            if p.requires_grad and not name.startswith("embed."):
                nn.init.normal_(p, 0.0, std)

    def represent(
        self, tokens: Tensor, mask: Tensor, heads: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """x^ [B, N, width] of one sentence's ids [B, N] and the intra weights [B, N+1, N+1]
        (``None`` for ``none`` and ``hard-parent``)."""
        x = self.project(self.embed(tokens))  # [B, N, H]
        if self.syntactic is not None:
            out = self.syntactic(x, mask)
            parts = [x, out.parents] + ([] if out.children is None else [out.children])
            return torch.cat(parts, dim=-1), out.marginals
        if self.intra == "hard-parent":
            if heads is None:
                raise ValueError("intra='hard-parent' needs the heads of every sentence")
            assert self.root is not None
            full = torch.cat([self.root.expand(x.shape[0], 1, -1), x], dim=1)  # [B, N+1, H]
            index = heads.clamp(0, x.shape[1]).masked_fill(~mask, 0)  # [B, N]
            parents = full.gather(1, index.unsqueeze(-1).expand_as(x))  # [B, N, H]
            return torch.cat([x, parents], dim=-1), None
        return x, None

    def forward(
        self,
        premise: Tensor,
        premise_mask: Tensor,
        hypothesis: Tensor,
        hypothesis_mask: Tensor,
        premise_heads: Tensor | None = None,
        hypothesis_heads: Tensor | None = None,
    ) -> NLIOutput:
        x, px = self.represent(premise, premise_mask, premise_heads)  # [B, N, W]
        y, py = self.represent(hypothesis, hypothesis_mask, hypothesis_heads)  # [B, M, W]
        e = torch.bmm(self.attend(x), self.attend(y).transpose(1, 2))  # [B, N, M]
        pair = premise_mask.unsqueeze(2) & hypothesis_mask.unsqueeze(1)  # [B, N, M]
        beta = torch.bmm(masked_softmax(e, pair, dim=2), y)  # [B, N, W] y aligned to x_i
        alpha = torch.bmm(masked_softmax(e, pair, dim=1).transpose(1, 2), x)  # [B, M, W]
        v1 = self.compare(torch.cat([x, beta], dim=-1)) * premise_mask.unsqueeze(-1)
        v2 = self.compare(torch.cat([y, alpha], dim=-1)) * hypothesis_mask.unsqueeze(-1)
        pooled = torch.cat([v1.sum(1), v2.sum(1)], dim=-1)  # [B, 2H]
        logits = self.classify(self.aggregate(pooled))  # [B, C]
        return NLIOutput(logits, e.masked_fill(~pair, 0.0), px, py)


def forward_batch(model: nn.Module, batch: Mapping[str, Tensor]) -> Any:
    """The model's output (``.logits`` [B, 3]) on one
    :meth:`~structattn.data.nli.EncodedPairs.batch`."""
    return model(
        batch["premise"],
        batch["premise_mask"],
        batch["hypothesis"],
        batch["hypothesis_mask"],
        batch.get("premise_heads"),
        batch.get("hypothesis_heads"),
    )


def predict_pairs(
    model: nn.Module, encoded: EncodedPairs, device: torch.device, batch_size: int = 256
) -> tuple[list[int], float]:
    """(predicted label id of each pair, summed NLL of the gold labels) in batches of pairs
    sorted by premise length (``model`` is put in eval mode)."""
    model.eval()
    order = sorted(range(len(encoded)), key=lambda i: len(encoded.premise[i]))
    predicted = [0] * len(encoded)
    total = 0.0
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        batch = encoded.batch(chunk, device)
        logits = forward_batch(model, batch).logits  # [B, 3]
        total += float(F.cross_entropy(logits, batch["labels"], reduction="sum"))
        for i, p in zip(chunk, logits.argmax(-1).tolist(), strict=True):
            predicted[i] = p
    return predicted, total


@torch.no_grad()
def induced_heads(
    model: DecomposableAttention,
    sentences: Sequence[Sequence[str]],
    embeddings: str,
    normalize: bool,
    unknown_buckets: int,
    batch_size: int = 128,
) -> list[list[int]]:
    """The Viterbi trees (heads, 0 = ROOT) of the model's syntactic attention layer on any
    tokenised sentences; their words get vectors by the given embedding settings (those the
    model was trained with: :func:`~structattn.data.embeddings.embedding_table`)."""
    if model.syntactic is None:
        raise ValueError("the model has no syntactic attention layer")
    words = word_vocabulary(sentences)
    table = embedding_table(words, embeddings, normalize, unknown_buckets).weight.to(
        model.project.weight.device
    )
    embed = nn.Embedding.from_pretrained(table, freeze=True, padding_idx=0)
    model.eval()
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
    out: list[list[int]] = [[] for _ in sentences]
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        ids = pad_sequences([words.encode(sentences[i]) for i in chunk], device=table.device)
        mask = ids != 0  # [B, N]
        heads = model.syntactic.parse(model.project(embed(ids)), mask)  # [B, N+1]
        for b, i in enumerate(chunk):
            out[i] = heads[b, 1 : 1 + len(sentences[i])].tolist()
    return out


@torch.no_grad()
def sentence_tree(model: DecomposableAttention, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The syntactic layer's Viterbi heads [B, N+1] (-1 at ROOT) and arc marginals
    [B, N+1, N+1] of word ids [B, N] (``mask`` [B, N], True at words)."""
    if model.syntactic is None:
        raise ValueError("the model has no syntactic attention layer")
    x = model.project(model.embed(ids))  # [B, N, H]
    return model.syntactic.parse(x, mask), model.syntactic(x, mask).marginals
