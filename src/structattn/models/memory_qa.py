"""Question answering over memory facts: MemN2N and SAN's CRF models (Kim et al. 2017, A.4)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import MemoryCRFAttention, masked_softmax
from ..attention.memory_crf import EdgeUnary, QueryMode
from ..data.babi import BabiBatch, BabiExample, BabiVocabulary, EncodedQuestions
from ..distributions import LinearChainCRF

__all__ = [
    "CRF_LINEAR_STARTS",
    "MEMORY_MODELS",
    "TYINGS",
    "CrfLinearStart",
    "MemoryModel",
    "MemoryQA",
    "MemoryQAOutput",
    "TemporalInit",
    "Tying",
    "fact_chains",
    "fact_nll",
    "forward_batch",
    "position_encoding",
    "predict_answers",
]

#: the models: MemN2N (softmax over the facts at each hop) and SAN's K-step fact CRFs
MemoryModel = Literal["memn2n", "unary-crf", "binary-crf"]
MEMORY_MODELS: tuple[MemoryModel, ...] = get_args(MemoryModel)
#: what linear start does to the CRF models (MemoryQA's ``crf_linear_start``)
CrfLinearStart = Literal["log-softmax", "unary", "scores"]
CRF_LINEAR_STARTS: tuple[CrfLinearStart, ...] = get_args(CrfLinearStart)
#: how the embedding tables are shared (MemoryQA's ``tying``)
Tying = Literal["adjacent", "separate"]
TYINGS: tuple[Tying, ...] = get_args(Tying)
TemporalInit = Literal["normal", "zero"]  # the temporal vectors: N(0, init_std) or zero
TEMPORAL_INITS: tuple[TemporalInit, ...] = get_args(TemporalInit)


def position_encoding(lengths: Tensor, size: int, dim: int) -> Tensor:
    """Weights l_kj = (1 - j/J) - (k/d)(1 - 2j/J) of Sukhbaatar et al. (2015), section 4.1.

    ``lengths`` [...] sentence lengths J; returns [..., size, dim] (0 beyond each length).
    """
    j = torch.arange(1, size + 1, device=lengths.device, dtype=torch.float32)  # [L]
    k = torch.arange(1, dim + 1, device=lengths.device, dtype=torch.float32)  # [d]
    big_j = lengths.clamp_min(1).unsqueeze(-1).float()  # [..., 1]
    ratio = (j / big_j).unsqueeze(-1)  # [..., L, 1]
    weights = (1 - ratio) - (k / dim) * (1 - 2 * ratio)  # [..., L, d]
    real = (j <= big_j).unsqueeze(-1)  # [..., L, 1]
    return weights * real


@dataclass(frozen=True)
class MemoryQAOutput:
    """Outputs of :class:`MemoryQA`."""

    logits: Tensor  # [B, V] answer scores
    attention: Tensor  # [B, K, M] p(z_k = i): per-hop softmax (MemN2N) or CRF marginals
    distribution: LinearChainCRF | None  # the fact-sequence CRF (CRF models; None for MemN2N)

    @cached_property
    def facts(self) -> Tensor:
        """[B, K] predicted fact per hop: the per-hop argmax (MemN2N) or the MAP sequence of
        the CRF (Viterbi; computed on first access, so training steps do not pay for it)."""
        if self.distribution is None:
            return self.attention.argmax(-1)
        return self.distribution.argmax


class MemoryQA(nn.Module):
    r"""End-to-end memory network with K hops, in three flavours (``model``):

    * ``"memn2n"``: p(z_k = i) = softmax_i((x_i^k)^T q_k), c_k = sum_i p o_i^k,
      q_{k+1} = q_k + c_k, answer softmax(W (q_K + c_K));
    * ``"unary-crf"``: a K-step linear-chain CRF over the facts with
      theta_k(i) = (x_i^k)^T q_k and q_{k+1} = Q q_k (:class:`MemoryCRFAttention`), a single
      context c = sum_k sum_i p(z_k = i) o_i^k, answer softmax(W (q_K + c));
    * ``"binary-crf"``: adds theta_{k,k+1}(i, j) = (x_i^k)^T x_j^{k+1} and forbids the same
      fact at consecutive steps.

    Sentences are bags of words with position encoding plus temporal encoding (a learned
    vector per recency slot); adjacent weight tying: hop k reads keys with embedding E_k and
    values with E_{k+1}, the question is embedded with E_1 and the answer matrix W is E_{K+1}
    (as in MemN2N). ``linear_start`` removes MemN2N's softmax; for the CRF models
    ``normalize_potentials`` log-softmaxes the unary potentials (the paper does so after
    linear start), and during ``linear_start`` ``crf_linear_start`` says what changes:
    ``"log-softmax"`` (the paper's text) nothing else — which leaves the CRF's distribution
    unchanged, since a per-step log-softmax adds one constant to every chain's score;
    ``"unary"``: the binary model's fact-to-fact potentials are left out (a unary CRF with
    the no-repeat constraint); ``"scores"``: MemN2N's linear start transplanted, the context
    is ``sum_k sum_i theta_k(i) o_i^k`` with the raw unary scores instead of the marginals.
    The switches are saved in the ``state_dict`` (module extra state), so a checkpoint
    restores the mode it was trained in.

    Options of MemN2N's own code (defaults: the paper's text): ``init_std`` of every
    embedding (0.1; harvardnlp's MemN2N uses 1/sqrt(10)), ``random_noise`` (the rate of
    empty memories inserted in training, MemN2N: 0.1; see :meth:`_recency`) and
    ``pe_width`` (J of the position encoding for memory sentences and questions: None = each
    sentence's own length, as the paper's formula reads; a pair of fixed widths = the padded
    widths both public codes use). ``crf_query`` (CRF models): ``"linear"`` q_{k+1} = Q q_k
    (the paper's text), ``"memory"`` q_{k+1} = sum_i theta_k(i) o_i^k (the SAN authors'
    released unary model: the next query depends on the facts), ``"hop"`` q_{k+1} = q_k +
    sum_i softmax(theta_k)(i) o_i^k (MemN2N's hop: its attention scores become the CRF's
    unary potentials) or ``"both"`` q_{k+1} = Q q_k + sum_i theta_k(i) o_i^k; ``crf_edge_unary``
    (binary CRF, K > 2): ``"once"`` or ``"per-edge"`` (the paper's edge potentials summed:
    the inner steps' theta_k count twice); ``tying``: ``"adjacent"`` (MemN2N's, above) or
    ``"separate"`` (the SAN authors' released CRF code: the values o_i^k come from their own
    tables V_k with their own temporal vectors and the answer matrix W is a separate
    parameter; the keys and the question keep E_1..E_K); ``temporal_encoding=False`` leaves
    the temporal vectors out (memory is then a bag of sentences; MemN2N's ``enable_time``);
    ``temporal_init="zero"`` starts them at zero instead of N(0, ``init_std``).

    Forward: ``memory`` [B, M, L] word ids (0 = padding; oldest sentence first),
    ``sentence_lengths`` [B, M], ``memory_lengths`` [B], ``question`` [B, Q],
    ``question_lengths`` [B].
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int = 20,
        hops: int = 3,
        memory_size: int = 25,
        model: MemoryModel = "memn2n",
        init_std: float = 0.1,
        random_noise: float = 0.0,
        pe_width: tuple[int, int] | None = None,
        crf_linear_start: CrfLinearStart = "log-softmax",
        crf_query: QueryMode = "linear",
        crf_edge_unary: EdgeUnary = "once",
        tying: Tying = "adjacent",
        temporal_encoding: bool = True,
        temporal_init: TemporalInit = "normal",
    ) -> None:
        super().__init__()
        if model not in MEMORY_MODELS:
            raise ValueError(f"`model` must be one of {MEMORY_MODELS}, got {model!r}")
        if crf_linear_start not in CRF_LINEAR_STARTS:
            raise ValueError(
                f"`crf_linear_start` must be one of {CRF_LINEAR_STARTS}, got {crf_linear_start!r}"
            )
        self.crf_linear_start = crf_linear_start
        if tying not in TYINGS:
            raise ValueError(f"`tying` must be one of {TYINGS}, got {tying!r}")
        self.tying = tying
        if hops < 1:
            raise ValueError(f"`hops` must be >= 1, got {hops}")
        if init_std <= 0:
            raise ValueError(f"`init_std` must be > 0, got {init_std}")
        if not 0 <= random_noise < 1:
            raise ValueError(f"`random_noise` must be in [0, 1), got {random_noise}")
        if temporal_init not in TEMPORAL_INITS:
            raise ValueError(
                f"`temporal_init` must be one of {TEMPORAL_INITS}, got {temporal_init!r}"
            )
        if pe_width is not None and min(pe_width) < 1:
            raise ValueError(f"`pe_width` must be two positive widths or None, got {pe_width}")
        self.model = model
        self.temporal_encoding = bool(temporal_encoding)
        self.random_noise = random_noise
        self.pe_width = pe_width
        self.hops = hops
        self.embed_dim = embed_dim
        self.memory_size = memory_size
        keys = hops + 1 if tying == "adjacent" else hops  # E_{K+1} is W or V_K when tied
        self.embeddings = nn.ModuleList(
            nn.Embedding(vocab_size, embed_dim, padding_idx=0) for _ in range(keys)
        )
        self.temporal = nn.Parameter(torch.empty(keys, memory_size, embed_dim))
        # tying "separate": value tables V_1..V_K (own temporal vectors) and answer matrix W
        self.value_embeddings: nn.ModuleList | None = None
        self.value_temporal: nn.Parameter | None = None
        self.answer: nn.Linear | None = None
        if tying == "separate":
            self.value_embeddings = nn.ModuleList(
                nn.Embedding(vocab_size, embed_dim, padding_idx=0) for _ in range(hops)
            )
            self.value_temporal = nn.Parameter(torch.empty(hops, memory_size, embed_dim))
            self.answer = nn.Linear(embed_dim, vocab_size, bias=False)
        self.linear_start = False
        self.crf = (
            None
            if model == "memn2n"
            else MemoryCRFAttention(
                embed_dim,
                hops,
                binary=model == "binary-crf",
                query_mode=crf_query,
                edge_unary=crf_edge_unary,
            )
        )
        tables = [self._embedding(k) for k in range(keys)]
        if self.value_embeddings is not None:
            tables += [self._table(self.value_embeddings, k) for k in range(hops)]
        for table in tables:
            nn.init.normal_(table.weight, std=init_std)
            with torch.no_grad():
                table.weight[0].zero_()
        for extra in (self.temporal, self.value_temporal, self.answer):
            if extra is not None:
                nn.init.normal_(extra if isinstance(extra, Tensor) else extra.weight, std=init_std)
        if temporal_init == "zero":  # learnt from zero: the content path comes first
            with torch.no_grad():
                for temporal in (self.temporal, self.value_temporal):
                    if temporal is not None:
                        temporal.zero_()

    def _embedding(self, k: int) -> nn.Embedding:
        """E_{k+1} (0-based k): the embedding matrix of hop k's keys and hop k-1's values."""
        return self._table(self.embeddings, k)

    @staticmethod
    def _table(tables: nn.ModuleList, k: int) -> nn.Embedding:
        embedding = tables[k]
        assert isinstance(embedding, nn.Embedding)
        return embedding

    def get_extra_state(self) -> dict[str, Any]:
        return {
            "linear_start": bool(self.linear_start),
            "normalize_potentials": self.normalize_potentials,
        }

    def set_extra_state(self, state: Any) -> None:
        self.linear_start = bool(state["linear_start"])
        self.normalize_potentials = bool(state["normalize_potentials"])

    @property
    def normalize_potentials(self) -> bool:
        return self.crf is not None and self.crf.normalize_potentials

    @normalize_potentials.setter
    def normalize_potentials(self, value: bool) -> None:
        if self.crf is not None:
            self.crf.normalize_potentials = value

    def _embed(
        self,
        index: int,
        words: Tensor,
        lengths: Tensor,
        width: int | None,
        tables: nn.ModuleList | None = None,
    ) -> Tensor:
        """Position-encoded bag of words: [..., L] ids -> [..., d]; J = each sentence's
        length, or the fixed ``width`` (MemN2N's code: the data set's padded width); table
        ``index`` of ``tables`` (default: the key tables E)."""
        vectors = self._table(self.embeddings if tables is None else tables, index)(words)
        if width is not None:
            if words.shape[-1] > width:
                raise ValueError(f"a sentence has {words.shape[-1]} words; `pe_width` is {width}")
            lengths = torch.full_like(lengths, width)
        weights = position_encoding(lengths, words.shape[-1], self.embed_dim).to(vectors.dtype)
        return (vectors * weights).sum(-2)

    def _memory(
        self,
        tables: nn.ModuleList,
        temporal: Tensor,
        memory: Tensor,
        sentence_lengths: Tensor,
        recency: Tensor,
        width: int | None,
        mask: Tensor,
    ) -> Tensor:
        """[T, B, M, d]: every memory sentence embedded by each of the T ``tables`` plus its
        ``temporal`` vector at ``recency`` [B, M] (unless ``temporal_encoding`` is off); zero
        at padded slots (``mask`` [B, M])."""
        embedded = torch.stack(
            [
                self._embed(k, memory, sentence_lengths, width, tables)
                + (temporal[k][recency] if self.temporal_encoding else 0.0)
                for k in range(len(tables))
            ]
        )
        return embedded * mask.unsqueeze(-1)

    def _recency(self, memory_lengths: Tensor, slots: int) -> Tensor:
        """[B, M] temporal slot of each sentence (0 = most recent). With ``random_noise`` r
        in training, MemN2N's random noise: each story gets u ~ U{0..ceil(r n)} empty
        memories at random places between its n sentences (the recency of a sentence grows
        by the empty ones after it), so the temporal vectors cannot memorise positions."""
        arange = torch.arange(slots, device=memory_lengths.device)
        recency = memory_lengths.unsqueeze(-1) - 1 - arange  # [B, M]
        if self.training and self.random_noise > 0:
            n = memory_lengths.unsqueeze(-1)  # [B, 1]
            most = torch.ceil(self.random_noise * n.float()).long()  # [B, 1]
            blanks = (torch.rand(n.shape, device=n.device) * (most + 1).float()).long()
            # u blanks at uniform places among n + u slots: a blank's position is a random
            # gap between sentences (0 = after the most recent sentence)
            gaps = (torch.rand(n.shape[0], slots, device=n.device) * (n + 1).float()).long()
            real = arange < blanks  # [B, M]: the first u draws are used
            # each sentence's recency grows by the blanks at gaps <= its recency
            after = (gaps.unsqueeze(1) <= recency.unsqueeze(-1)) & real.unsqueeze(1)
            recency = recency + after.sum(-1)  # [B, M]
        return recency.clamp(0, self.memory_size - 1)

    def forward(
        self,
        memory: Tensor,
        sentence_lengths: Tensor,
        memory_lengths: Tensor,
        question: Tensor,
        question_lengths: Tensor,
    ) -> MemoryQAOutput:
        batch, slots, _ = memory.shape
        if slots > self.memory_size:
            raise ValueError(f"`memory` has {slots} sentences; the model holds {self.memory_size}")
        mask = torch.arange(slots, device=memory.device) < memory_lengths.unsqueeze(-1)  # [B, M]
        recency = self._recency(memory_lengths, slots)  # [B, M] temporal slots
        width, qwidth = self.pe_width or (None, None)
        # E_k of every sentence: [K+1, B, M, d] (K with separate tying)
        embedded = self._memory(
            self.embeddings, self.temporal, memory, sentence_lengths, recency, width, mask
        )
        if self.value_embeddings is not None:  # own value tables: o_i^k from V_k
            assert self.value_temporal is not None and self.answer is not None
            values_k = self._memory(
                self.value_embeddings,
                self.value_temporal,
                memory,
                sentence_lengths,
                recency,
                width,
                mask,
            )
            answer_matrix = self.answer.weight  # W, untied
        else:
            values_k = embedded[1:]  # o_i^k = E_{k+1} (adjacent tying)
            answer_matrix = self._embedding(self.hops).weight  # W^T = E_{K+1}
        q = self._embed(0, question, question_lengths, qwidth)  # [B, d]
        if self.crf is None:
            weights = []
            for k in range(self.hops):
                scores = torch.einsum("bmd,bd->bm", embedded[k], q)
                shown = masked_softmax(scores, mask)  # the reported attention: real slots
                # linear start reads with the raw scores (no softmax); its argmax over the
                # real slots is the softmax's, never a padded slot
                p = scores.masked_fill(~mask, 0.0) if self.linear_start else shown
                weights.append(shown)
                q = q + torch.einsum("bm,bmd->bd", p, values_k[k])
            attention = torch.stack(weights, dim=1)  # [B, K, M]
            return MemoryQAOutput(q @ answer_matrix.T, attention, None)
        keys = embedded[: self.hops].transpose(0, 1)  # [B, K, M, d]
        values = values_k.transpose(0, 1)
        linear = self.crf_linear_start if self.linear_start else "off"
        out = self.crf(q, keys, values, mask, pairwise=linear != "unary")
        context = out.context
        if linear == "scores":  # MemN2N's linear start: raw scores instead of marginals
            scores = out.unary.masked_fill(~mask.unsqueeze(1), 0.0)  # [B, K, M]
            context = torch.einsum("bkm,bkmd->bd", scores, values)
        logits = (out.queries[:, -1] + context) @ answer_matrix.T
        return MemoryQAOutput(logits, out.marginals, out.distribution)


def forward_batch(model: nn.Module, batch: BabiBatch) -> Any:
    """The model's :class:`MemoryQAOutput` on one padded batch of questions."""
    return model(
        batch.memory,
        batch.sentence_lengths,
        batch.memory_lengths,
        batch.question,
        batch.question_lengths,
    )


def fact_nll(out: MemoryQAOutput, support: Tensor) -> Tensor:
    """Summed -log p(gold fact sequence) of the questions whose gold sequence (``support``
    [B, S], memory indices, -1 padding, -2 outside the memory) has exactly K facts, all in
    memory (strong supervision): the CRF's log-probability of the chain, or MemN2N's sum of
    per-hop log attention. A gold chain the CRF forbids (the same fact twice in a row under
    no-repeat) is left out, so the loss stays finite."""
    steps = out.attention.shape[1]
    if support.shape[1] < steps:
        return out.logits.new_zeros(())
    gold = support[:, :steps]  # [B, K]
    usable = (gold >= 0).all(1) & (support[:, steps:] == -1).all(1)  # [B]
    if out.distribution is None:  # MemN2N: per-hop softmax
        probs = out.attention.gather(-1, gold.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        return -(probs.clamp_min(1e-30).log().sum(1) * usable).sum()
    distribution = out.distribution
    log_prob = distribution.log_prob(gold.clamp_min(0))  # unusable rows: masked out below
    usable = usable & torch.isfinite(log_prob)
    return -torch.where(usable, log_prob, torch.zeros_like(log_prob)).sum()


@torch.no_grad()
def predict_answers(
    model: MemoryQA,
    examples: Sequence[BabiExample],
    vocab: BabiVocabulary,
    device: torch.device | str = "cpu",
    batch_size: int = 200,
    encoded: EncodedQuestions | None = None,
) -> tuple[list[str], list[list[int]], float]:
    """(predicted answers, predicted fact sequences as 0-based memory indices, mean NLL);
    ``encoded``: ``examples`` already encoded (training validates every epoch)."""
    device = torch.device(device)
    model.eval()
    if encoded is None:
        encoded = EncodedQuestions(examples, vocab)
    answers: list[str] = []
    facts: list[list[int]] = []
    total = 0.0
    for start in range(0, len(examples), batch_size):
        batch = encoded.batch(range(start, min(start + batch_size, len(examples))), device)
        out = forward_batch(model, batch)
        total += float(F.cross_entropy(out.logits, batch.answer, reduction="sum"))
        answers += [vocab.tokens[i] for i in out.logits.argmax(-1).tolist()]
        facts += out.facts.tolist()
    return answers, facts, total / max(len(examples), 1)


@torch.no_grad()
def fact_chains(
    model: MemoryQA, example: BabiExample, vocab: BabiVocabulary, k: int = 3
) -> tuple[Tensor, Tensor, list[tuple[list[int], float]], str]:
    """A CRF model's reading of one question (Figure 5 of Kim et al. 2017): the fact
    marginals [K, N] per step, the edge marginals p(z_k, z_{k+1}) [K-1, N, N] over the N
    facts in memory, the ``k`` most probable fact sequences with their probabilities, and
    the predicted answer."""
    if model.crf is None:
        raise ValueError("a MemN2N has no fact-sequence CRF (use a unary-crf or binary-crf model)")
    batch = EncodedQuestions([example], vocab).batch([0], torch.device("cpu"))
    result = forward_batch(model, batch)
    crf = result.distribution
    assert crf is not None
    n = len(example.memory)
    scores, sequences = crf.topk(k)
    probs = (scores - crf.log_partition).exp()[:, 0].tolist()
    top = [(seq, p) for seq, p in zip(sequences[:, 0].tolist(), probs, strict=True)]
    predicted = vocab.tokens[int(result.logits.argmax(-1))]
    return result.attention[0, :, :n], crf.edge_marginals[0, :, :n, :n], top, predicted
