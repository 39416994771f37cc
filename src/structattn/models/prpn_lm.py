r"""The Parsing-Reading-Predict Network language model (Shen et al., ICLR 2018).

Three networks share one embedding table (tied with the softmax):

* **Parsing network** (:class:`~structattn.nn.prpn.ParsingNetwork`): a causal convolution over
  the last L token embeddings gives every token a syntactic distance d_t > 0 and a predicted
  distance of the *next* token d'_t (a second head on the same features). Against the
  distances of the K previous tokens they give the expected attention-limit gates (notes,
  eq. 5) of the current step, E[g_i(l_t)] = prod_{j=i+1}^{t-1} alpha(d_t, d_j), and of the next
  step, prod_{j=i+1}^{t} alpha(d'_t, d_j), with the ``stick-breaking`` (eq. 7, hardtanh with
  temperature tau) or ``bradley-terry`` (section 5.3) alpha of
  :mod:`structattn.structs.stick_breaking`; ``gate="none"`` removes the parsing network (every
  gate 1), the ablation of the notes' remark.
* **Reading network** (:class:`PRPNReader`): a stack of LSTMN layers. At step t layer l
  attends over its own last K hidden states with a dot product whose query is a linear map
  of [x_t; h_{t-1}], renormalised by the gates (eq. 6); the attended (h~, c~) replace the
  LSTM's previous state: (h_t, c_t) = LSTMCell(x_t, (h~ * recurrent-dropout mask, c~)).
* **Predict network**: attention over the top layer's last K hidden states with the gates of
  the next step, then tanh(W [h_t; m~_t]) -> dropout -> tied softmax.

**Objectives** (``objective``). ``soft`` (PRPN's, the default): every attention uses the
expected gates E[g] (eq. 6), so the model has no latent variable. ``marginal``: the
latent-variable language model of the notes' eq. 1 with the Predict network's attention
limit l as the latent, summed out exactly:

.. math:: p(x_{t+1} \mid x_{\le t}) = \sum_l p(l \mid x_{\le t})\,
          \mathrm{softmax}(W \tanh(U [h_t; \textstyle\sum_i s_i(l) m_i]))_{x_{t+1}},
          \qquad s_i(l) = \frac{1(l \le i)\, \tilde s_i}{\sum_j 1(l \le j)\, \tilde s_j}

with p(l | x_<=t) the stick-breaking process of the gate model (Bradley-Terry: section 5.3,
the exact distribution the notes call "actually well-defined"; stick-breaking eq. 4 works the
same way) over the keys up to the current token. With the K-slot memory l has K + 1
distinguishable outcomes (read slots s..K-1 for s = 0..K-1, every l at or before the oldest
slot giving s = 0; or read nothing when l is the current token), so the sum is a
log-sum-exp over K + 1 hard-gated readings, each through the Predict network and its own
softmax, all outcomes batched (chunks of steps bound the [B, T, K + 1, V] memory). The
factorisation: **only the Predict network's limit is latent**; the reading network keeps
the expected gates of its own steps, a deterministic function of x_<=t. Hard gates inside the
recurrent reading network would make every later state depend on every earlier l_t, so the
exact marginal would be a sum over prod_t (t + 1) joint assignments; with the reader
deterministic, the l of different steps are independent given x and the joint sum
factorises into one (K + 1)-term sum per step. The perplexity is then the exact perplexity
of a well-defined generative model (``logits`` are the log-probabilities themselves, so
``cross_entropy`` of them is exact). Cost: the Predict network and the softmax run K + 1
times per token.

The memory is a sliding window of the K = ``num_slots`` previous steps (PRPN's ``nslots``),
carried across truncated-BPTT windows in :class:`PRPNState` together with the last L - 1
embeddings (the convolution's left context) and the K previous distances; a fresh state has
no memory (slots invalid), so the first step of a stream is a plain LSTM step.

Implements the language-model interface of the recipes: ``forward(inputs [B, T], state) ->
(logits [B, T, V], new_state)`` and ``initial_state(batch, device)``. The loop is over time
steps only (never over the batch); the gates and the Predict network are computed for all
steps of a window at once. Cost per window: O(B T (K H + H^2 N_layers + E V)).

Differences from the published code (yikangshen/PRPN), all stated in docs/results/prpn.md:
the distances are softplus (not ReLU) outputs and the convolution has no BatchNorm, the
prediction layer has no BatchNorm and no residual blocks, the recurrent dropout mask is
sampled per sequence (not one for the whole batch).

Example:
    >>> model = PRPNLanguageModel(PRPNConfig(vocab_size=20, embed_dim=8, hidden_dim=12))
    >>> logits, state = model(torch.randint(20, (2, 7)), model.initial_state(2, "cpu"))
    >>> logits.shape
    torch.Size([2, 7, 20])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from ..names import GateKind
from ..nn.prpn import ParsingNetwork
from ..structs.stick_breaking import (
    bradley_terry_gates,
    expected_gates,
    stick_breaking_distribution,
    stick_breaking_gates,
)

__all__ = [
    "GATES",
    "OBJECTIVES",
    "PRPNConfig",
    "PRPNLanguageModel",
    "PRPNOutput",
    "PRPNReader",
    "PRPNState",
]

GateChoice = Literal[GateKind, "none"]
GATES: tuple[GateChoice, ...] = get_args(GateChoice)
"""Gate choices: the two attention-limit models of the notes and the ablation (all gates 1)."""

Objective = Literal["soft", "marginal"]
OBJECTIVES: tuple[Objective, ...] = get_args(Objective)
"""``soft``: PRPN's expected gates (eq. 6); ``marginal``: the latent-variable LM (eq. 1),
the predict network's attention limit summed out exactly (module docstring)."""


@dataclass
class PRPNConfig:
    """Sizes and regularisation of :class:`PRPNLanguageModel` (defaults: a small model)."""

    vocab_size: int  # V, output classes (and rows of the tied embedding)
    embed_dim: int = 200  # E, word embeddings and the prediction layer (tied softmax)
    hidden_dim: int = 400  # H, LSTMN layers and the parsing convolution's channels
    num_layers: int = 2  # LSTMN layers in the reading network
    num_slots: int = 15  # K, memory window (PRPN's nslots)
    lookback: int = 5  # L, tokens the parsing convolution sees (PRPN's nlookback = 5)
    gate: GateChoice = "stick-breaking"  # attention-limit model, or "none" (ablation)
    tau: float = 0.1  # stick-breaking temperature (PRPN's resolution)
    dropout: float = 0.7  # on the first reader input and before the softmax
    input_dropout: float = 0.5  # inside parser / reader (other layers) / predictor
    recurrent_dropout: float = 0.5  # variational dropout on the attended hidden state h~
    tie_weights: bool = True  # share the embedding with the output layer
    init_range: float = 0.01  # embedding (and untied output) weights ~ U(-r, r) (PRPN: 0.01)
    objective: Objective = "soft"  # soft: E[g] (eq. 6); marginal: exact sum over l (eq. 1)
    chunk_size: int = 1 << 22  # marginal: ~elements of the [rows, K + 1, V] scores per chunk


class PRPNState(NamedTuple):
    """Recurrent state between windows (B batch, K slots, H hidden, N layers)."""

    context: Tensor  #: [B, L - 1, E] embeddings of the last L - 1 tokens (conv context)
    context_valid: Tensor  #: [B, L - 1] bool, True where context is a real token
    distances: Tensor  #: [B, K] distances d of the K previous tokens (oldest first)
    hidden: Tensor  #: [N, B, K, H] hidden tapes of the reader layers (oldest slot first)
    cells: Tensor  #: [N, B, K, H] memory (cell) tapes of the reader layers
    valid: Tensor  #: [B, K] bool, True where a slot holds a real step

    def detach(self) -> PRPNState:
        """The same state cut from the autograd graph (between BPTT windows)."""
        return PRPNState(*(x.detach() for x in self))


class PRPNOutput(NamedTuple):
    """Everything :meth:`PRPNLanguageModel.run` computes for a window of T steps."""

    logits: Tensor  #: [B, T, V] next-token scores
    state: PRPNState  #: state after the window
    distances: Tensor  #: [B, T] d_t (0 when gate = "none")
    gates: Tensor  #: [B, T, K] E[g_i(l_t)] over the K memory slots (oldest first)
    next_gates: Tensor  #: [B, T, K] gates of the Predict network
    attention: Tensor  #: [B, T, K] gated attention of the bottom reader layer
    hidden: Tensor  #: [B, T, H] top reader states h_t (the Predict network's queries)
    next_distances: Tensor  #: [B, T] d'_t, the predicted distance of the next token
    limit: Tensor | None  #: [B, T, K + 1] p(reading slots s..K-1) (marginal objective only)


def _window(matrix: Tensor, offset: int, slots: int) -> Tensor:
    """Rows ``offset + t`` of ``matrix`` [B, R, C] restricted to columns t .. t + K - 1.

    Returns [B, T, K] with T = R - offset: for every step its K memory slots, oldest first.
    """
    batch, rows, _ = matrix.shape
    steps = rows - offset
    index = torch.arange(steps, device=matrix.device).unsqueeze(-1) + torch.arange(
        slots, device=matrix.device
    )  # [T, K]
    return torch.gather(matrix[:, offset:], 2, index.expand(batch, steps, slots))


def _limit_distribution(alpha: Tensor, valid: Tensor, next_gates: Tensor) -> Tensor:
    """p(the Predict network reads slots s..K-1) [B, T, K + 1] of the next-step limit l.

    ``alpha`` [B, N + 1, N + 1] and ``valid`` [B, N + 1] are the extended next-step arrays of
    :meth:`PRPNLanguageModel.run` (query row K + 1 + t, keys up to the current token K + t),
    ``next_gates`` [B, T, K] the windowed CDF. Outcome s = 0 lumps every l at or before the
    oldest slot (P(l <= oldest) = E[g_0]: all K slots open), s = 1..K-1 is l at slot s, s = K
    is l at the current token (no slot open: the reading is empty). Each entry is a product
    of alphas (no differences of CDFs), so it is >= 0 exactly; rows sum to 1.
    """
    slots = next_gates.shape[-1]
    point = _window(stick_breaking_distribution(alpha, valid), slots + 1, slots + 1)
    return torch.cat([next_gates[..., :1], point[..., 1:]], dim=-1)  # [B, T, K + 1]


class _MixtureLogProbs(torch.autograd.Function):
    r"""log sum_s exp(prior_s + log softmax(F_s W^T + b)) [B, T, V], written by hand.

    ``features`` [B, T, S, E], ``weight`` [V, E], ``bias`` [V], ``log_prior`` [B, T, S]
    (-inf where p(s) = 0; every row has a finite entry), ``chunk`` ~elements of the
    [rows, S, V] scores made at a time. The marginal objective's softmax is K + 1 times the
    soft model's, so its passes over the scores are most of the cost: autograd (log_softmax,
    the prior's sum, logsumexp over s, each recomputed under a checkpoint) made about twenty
    of them. Here the forward pass is one matmul, one log-sum-exp over V and one over s; the
    backward pass recomputes the matmul and, with r_sv = p(s | v) = exp(prior_s + log p_s(v)
    - out_v) and p_s = softmax(F_s W^T + b),

    .. math:: \frac{\partial L}{\partial \mathrm{prior}_s} = \sum_v g_v r_{sv}, \qquad
              \frac{\partial L}{\partial z_{sv}} = g_v r_{sv}
              - p_s(v) \frac{\partial L}{\partial \mathrm{prior}_s}

    for the scores z = F W^T + b, then the two matmuls of the linear layer. First
    derivatives only (the objective is trained by gradient descent; double backward raises).
    """

    @staticmethod
    def forward(
        ctx: Any, features: Tensor, weight: Tensor, bias: Tensor, log_prior: Tensor, chunk: int
    ) -> Tensor:
        batch, steps, outcomes, dim = features.shape
        vocab = weight.shape[0]
        flat = features.reshape(-1, outcomes, dim)  # [R, S, E]
        prior = log_prior.reshape(-1, outcomes)  # [R, S]
        rows = max(1, chunk // max(1, outcomes * vocab))
        out = features.new_empty(flat.shape[0], vocab)
        lse = features.new_empty(flat.shape[0], outcomes)
        for start in range(0, flat.shape[0], rows):
            part = flat[start : start + rows]
            z = torch.addmm(bias, part.reshape(-1, dim), weight.t()).view(-1, outcomes, vocab)
            norm = torch.logsumexp(z, dim=-1)  # [r, S]
            lse[start : start + rows] = norm
            z += (prior[start : start + rows] - norm).unsqueeze(-1)  # log prior_s p_s(v)
            out[start : start + rows] = torch.logsumexp(z, dim=1)
        ctx.save_for_backward(features, weight, bias, log_prior, lse, out)
        ctx.chunk = chunk
        return out.view(batch, steps, vocab)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        features, weight, bias, log_prior, lse, out = ctx.saved_tensors
        outcomes, dim = features.shape[-2:]
        vocab = weight.shape[0]
        flat = features.reshape(-1, outcomes, dim)
        prior = log_prior.reshape(-1, outcomes)
        g = grad.reshape(-1, vocab)
        rows = max(1, ctx.chunk // max(1, outcomes * vocab))
        grad_features = torch.empty_like(flat)
        grad_prior = torch.empty_like(prior)
        grad_weight = torch.zeros_like(weight)
        grad_bias = torch.zeros_like(bias)
        for start in range(0, flat.shape[0], rows):
            stop = start + rows
            part = flat[start:stop].reshape(-1, dim)
            z = torch.addmm(bias, part, weight.t()).view(-1, outcomes, vocab)
            z -= lse[start:stop].unsqueeze(-1)  # log p_s(v)
            r = z + prior[start:stop].unsqueeze(-1)
            r -= out[start:stop].unsqueeze(1)
            r.exp_().mul_(g[start:stop].unsqueeze(1))  # g_v p(s | v)
            d_prior = r.sum(-1)  # [r, S]
            grad_prior[start:stop] = d_prior
            dz = r.sub_(z.exp_().mul_(d_prior.unsqueeze(-1))).view(-1, vocab)  # [r S, V]
            grad_features[start:stop] = (dz @ weight).view(-1, outcomes, dim)
            grad_weight.addmm_(dz.t(), part)
            grad_bias += dz.sum(0)
        return (
            grad_features.view_as(features),
            grad_weight,
            grad_bias,
            grad_prior.view_as(log_prior),
            None,
        )


class PRPNReader(nn.Module):
    r"""One layer of PRPN's Reading network: an LSTMN step with gated dot-product attention.

    .. math:: q_t = W [x_t; h_{t-1}], \quad
              \tilde s_i = \mathrm{softmax}_{i \in \text{slots}}(q_t^\top h_i / \sqrt H), \quad
              s_i = \frac{g_i \tilde s_i}{\sum_j g_j \tilde s_j}, \quad
              (h_t, c_t) = \mathrm{LSTMCell}(x_t, (\textstyle\sum_i s_i h_i, \sum_i s_i c_i))

    (the step form of :func:`~structattn.structs.stick_breaking.gated_attention_weights`; a
    step whose gated mass is 0 reads the zero state).

    The input parts of the query and of the LSTM gates are computed for every step at once
    (:meth:`project_inputs`, one large matmul per layer instead of one per step);
    :meth:`step` adds the recurrent parts (the same maths as ``nn.LSTMCell``, gate order i,
    f, g, o, whose parameters it uses).

    Shapes: :meth:`project_inputs` x [..., D] -> ([..., 4H], [..., H]); :meth:`step` those
    at one step [B, ...], tapes [B, K, H], gates [B, K] (0 at invalid slots), valid [B, K]
    bool, recurrent mask [B, H] -> h_t, c_t [B, H], attention [B, K].
    """

    def __init__(self, input_size: int, hidden_size: int, dropout: float, query_dropout: float):
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.input_dropout = nn.Dropout(dropout)
        self.query = nn.Sequential(
            nn.Dropout(query_dropout),
            nn.Linear(input_size + hidden_size, hidden_size),
            nn.Dropout(query_dropout),
        )
        self.cell = nn.LSTMCell(input_size, hidden_size)

    def project_inputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(W_ih dropout(x) + b [..., 4H], W_qx dropout_q(x) + b_q [..., H]) for x [..., D]."""
        linear = self.query[1]
        assert isinstance(linear, nn.Linear)
        cell = self.cell
        gates_x = F.linear(self.input_dropout(x), cell.weight_ih, cell.bias_ih + cell.bias_hh)
        query_x = F.linear(self.query[0](x), linear.weight[:, : self.input_size], linear.bias)
        return gates_x, query_x

    def step(
        self,
        projected: tuple[Tensor, Tensor],
        hidden: Tensor,
        cells: Tensor,
        gates: Tensor,
        valid: Tensor,
        recurrent_mask: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One step: (h_t [B, H], c_t [B, H], attention [B, K])."""
        gates_x, query_x = projected  # [B, 4H], [B, H]
        linear = self.query[1]
        assert isinstance(linear, nn.Linear)
        previous = self.query[0](hidden[:, -1])  # [B, H], h_{t-1} (dropout of the query input)
        query = self.query[2](query_x + F.linear(previous, linear.weight[:, self.input_size :]))
        scores = torch.bmm(hidden, query.unsqueeze(-1)).squeeze(-1)  # [B, K]
        scores = scores / math.sqrt(self.hidden_size)
        scores = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
        gated = torch.softmax(scores, dim=-1) * gates  # [B, K], g_i s~_i (0 at invalid slots)
        total = gated.sum(-1, keepdim=True)  # [B, 1]
        positive = total >= torch.finfo(total.dtype).tiny
        weights = torch.where(positive, gated / torch.where(positive, total, 1.0), 0.0)
        read_h = torch.bmm(weights.unsqueeze(1), hidden).squeeze(1)  # [B, H]
        read_c = torch.bmm(weights.unsqueeze(1), cells).squeeze(1)  # [B, H]
        z = gates_x + F.linear(read_h * recurrent_mask, self.cell.weight_hh)  # [B, 4H]
        in_gate, forget, candidate, out_gate = z.chunk(4, dim=-1)
        c = torch.sigmoid(forget) * read_c + torch.sigmoid(in_gate) * torch.tanh(candidate)
        h = torch.sigmoid(out_gate) * torch.tanh(c)
        return h, c, weights


class PRPNLanguageModel(nn.Module):
    """PRPN: parsing network + reading network (gated LSTMN) + predict network, tied softmax.

    See the module docstring for the equations. ``forward(inputs [B, T] LongTensor,
    state | None) -> (logits [B, T, V], new_state)``; :meth:`run` also returns the distances,
    gates and attention; :meth:`distances` parses sentences [B, T] with a mask.
    """

    def __init__(self, config: PRPNConfig) -> None:
        super().__init__()
        c = config
        for name in ("vocab_size", "embed_dim", "hidden_dim", "num_layers", "num_slots"):
            value = getattr(c, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PRPNConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(c.lookback, int) or c.lookback < 1:
            raise ValueError(f"PRPNConfig.lookback must be a positive int, got {c.lookback!r}")
        if c.gate not in GATES:
            raise ValueError(f"PRPNConfig.gate must be one of {GATES}, got {c.gate!r}")
        for name in ("dropout", "input_dropout", "recurrent_dropout"):
            value = getattr(c, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"PRPNConfig.{name} must lie in [0, 1), got {value!r}")
        if not c.tau > 0:
            raise ValueError(f"PRPNConfig.tau must be > 0, got {c.tau!r}")
        if c.objective not in OBJECTIVES:
            raise ValueError(
                f"PRPNConfig.objective must be one of {OBJECTIVES}, got {c.objective!r}"
            )
        if c.objective == "marginal" and c.gate == "none":
            raise ValueError("PRPNConfig.objective='marginal' needs a gate model (gate='none')")
        if not isinstance(c.chunk_size, int) or c.chunk_size < 1:
            raise ValueError(f"PRPNConfig.chunk_size must be a positive int, got {c.chunk_size!r}")
        self.config = c
        self.embedding = nn.Embedding(c.vocab_size, c.embed_dim)
        self.parser: ParsingNetwork | None = None
        self.next_distance: nn.Linear | None = None
        if c.gate != "none":
            gate: GateKind = "bradley-terry" if c.gate == "bradley-terry" else "stick-breaking"
            self.parser = ParsingNetwork(
                c.embed_dim, c.hidden_dim, c.lookback, c.input_dropout, gate, c.tau
            )
            self.next_distance = nn.Linear(c.hidden_dim, 1)  # d'_t, the next token's distance
        self.readers = nn.ModuleList(
            PRPNReader(
                c.embed_dim if i == 0 else c.hidden_dim,
                c.hidden_dim,
                c.dropout if i == 0 else c.input_dropout,
                c.input_dropout,
            )
            for i in range(c.num_layers)
        )
        self.recurrent_dropout = c.recurrent_dropout
        self.predict_query = nn.Sequential(
            nn.Dropout(c.input_dropout),
            nn.Linear(c.hidden_dim, c.hidden_dim),
            nn.Dropout(c.input_dropout),
        )
        self.predict = nn.Sequential(
            nn.Dropout(c.input_dropout), nn.Linear(2 * c.hidden_dim, c.embed_dim), nn.Tanh()
        )
        self.output_dropout = nn.Dropout(c.dropout)
        self.decoder = nn.Linear(c.embed_dim, c.vocab_size)
        if c.tie_weights:
            self.decoder.weight = self.embedding.weight
        nn.init.uniform_(self.embedding.weight, -c.init_range, c.init_range)
        if not c.tie_weights:
            nn.init.uniform_(self.decoder.weight, -c.init_range, c.init_range)
        nn.init.zeros_(self.decoder.bias)

    # ---- state ---------------------------------------------------------------------------
    def initial_state(self, batch: int, device: torch.device | str) -> tuple[Tensor, ...]:
        """An empty memory for ``batch`` streams (no valid slot, no context), a plain tuple."""
        return tuple(self.empty_state(batch, device))

    def empty_state(self, batch: int, device: torch.device | str) -> PRPNState:
        """:meth:`initial_state` as a :class:`PRPNState`."""
        c = self.config
        dtype = self.embedding.weight.dtype
        tape = torch.zeros(c.num_layers, batch, c.num_slots, c.hidden_dim, device=device)
        return PRPNState(
            context=torch.zeros(batch, c.lookback - 1, c.embed_dim, device=device, dtype=dtype),
            context_valid=torch.zeros(batch, c.lookback - 1, dtype=torch.bool, device=device),
            distances=torch.zeros(batch, c.num_slots, device=device, dtype=dtype),
            hidden=tape.to(dtype),
            cells=tape.clone().to(dtype),
            valid=torch.zeros(batch, c.num_slots, dtype=torch.bool, device=device),
        )

    # ---- parsing network -----------------------------------------------------------------
    def _parse(
        self, x: Tensor, context: Tensor, context_valid: Tensor, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(d, d') [B, T] for embeddings x [B, T, E] after the conv context [B, L-1, E]."""
        assert self.parser is not None and self.next_distance is not None
        batch, steps, _ = x.shape
        real = torch.ones(batch, steps, dtype=torch.bool, device=x.device) if mask is None else mask
        full = torch.cat([context, x], dim=1)  # [B, L - 1 + T, E]
        full_mask = torch.cat([context_valid, real], dim=1)  # [B, L - 1 + T]
        h = self.parser.features(full, full_mask)[:, context.shape[1] :]  # [B, T, Hp]
        d = self.parser.distances_from_features(h, real)  # [B, T]
        d_next = self.parser.distances_from_features(h, real, proj=self.next_distance)
        return d, d_next

    def _alpha(self, d: Tensor, mask: Tensor, query: Tensor | None = None) -> Tensor:
        """Continue-probabilities alpha [B, N, N] of the chosen gate model."""
        if self.config.gate == "bradley-terry":
            return bradley_terry_gates(d, mask, query_distances=query)
        return stick_breaking_gates(d, self.config.tau, mask, query_distances=query)

    def distances(self, inputs: Tensor, mask: Tensor | None = None) -> Tensor:
        """Syntactic distances d [B, T] of sentences ``inputs`` [B, T] (0 at padding).

        A sentence is read from an empty state (no left context), as PRPN parses.
        """
        if self.parser is None:
            raise ValueError("a PRPN without parsing network (gate='none') has no distances")
        x = self.embedding(inputs)  # [B, T, E]
        empty = self.empty_state(inputs.shape[0], inputs.device)
        return self._parse(x, empty.context, empty.context_valid, mask)[0]

    # ---- forward -------------------------------------------------------------------------
    def run(self, inputs: Tensor, state: PRPNState | None = None) -> PRPNOutput:
        """Logits, new state, distances, gates and attention for ``inputs`` [B, T]."""
        if not isinstance(inputs, Tensor) or inputs.dim() != 2 or inputs.dtype != torch.long:
            raise ValueError("`inputs` must be a LongTensor [B, T]")
        c = self.config
        batch, steps = inputs.shape
        if state is None:
            state = self.empty_state(batch, inputs.device)
        slots = c.num_slots
        x = self.embedding(inputs)  # [B, T, E]
        ones = torch.ones(batch, steps, dtype=torch.bool, device=inputs.device)
        valid_all = torch.cat([state.valid, ones], dim=1)  # [B, K + T]
        window_valid = valid_all.unfold(1, slots, 1)[:, :steps]  # [B, T, K], slots t..t+K-1
        limit: Tensor | None = None
        if self.parser is None:
            d = d_next = torch.zeros(batch, steps, dtype=x.dtype, device=x.device)
            gates = next_gates = window_valid.to(x.dtype)
        else:
            d, d_next = self._parse(x, state.context, state.context_valid)
            d_all = torch.cat([state.distances, d], dim=1)  # [B, N = K + T]
            gates = _window(expected_gates(self._alpha(d_all, valid_all), valid_all), slots, slots)
            # next-step gates: an extra query row N + 1 per step, query row r = K + t + 1
            # holds d'_t against keys j <= K + t (prod_{j=i+1}^{t} alpha(d'_t, d_j))
            pad = torch.ones(batch, 1, dtype=x.dtype, device=x.device)
            d_ext = torch.cat([d_all, pad], dim=1)  # [B, N + 1]
            q_ext = torch.cat([torch.ones_like(state.distances), pad, d_next], dim=1)
            valid_ext = torch.cat([valid_all, ones[:, :1]], dim=1)  # [B, N + 1]
            alpha_next = self._alpha(d_ext, valid_ext, q_ext)  # [B, N + 1, N + 1]
            eg_next = expected_gates(alpha_next, valid_ext)
            next_gates = _window(eg_next[:, :, :-1], slots + 1, slots)  # [B, T, K]
            if c.objective == "marginal":
                limit = _limit_distribution(alpha_next, valid_ext, next_gates)

        masks = [
            F.dropout(
                x.new_ones(batch, c.hidden_dim), self.recurrent_dropout, self.training
            )  # [B, H], one variational mask per sequence and layer
            for _ in self.readers
        ]
        hidden = list(state.hidden.unbind(0))  # N x [B, K, H]
        cells = list(state.cells.unbind(0))
        readers: list[PRPNReader] = list(self.readers)  # type: ignore[arg-type]
        top_outputs, bottom_attention = [], []
        bottom = readers[0].project_inputs(x)  # ([B, T, 4H], [B, T, H]), all steps at once
        for t in range(steps):
            layer_input = x[:, t]
            for i, reader in enumerate(readers):
                projected = (
                    (bottom[0][:, t], bottom[1][:, t])
                    if i == 0
                    else reader.project_inputs(layer_input)
                )
                h, cell, weights = reader.step(
                    projected, hidden[i], cells[i], gates[:, t], window_valid[:, t], masks[i]
                )
                hidden[i] = torch.cat([hidden[i][:, 1:], h.unsqueeze(1)], dim=1)
                cells[i] = torch.cat([cells[i][:, 1:], cell.unsqueeze(1)], dim=1)
                if i == 0:
                    bottom_attention.append(weights)
                layer_input = h
            top_outputs.append(layer_input)
        top = torch.stack(top_outputs, dim=1)  # [B, T, H]
        valid = torch.cat([state.valid, ones], dim=1)[:, steps:]  # [B, K]

        # Predict network: attention over the top tape's K slots before each step
        tape = torch.cat([state.hidden[-1], top], dim=1)  # [B, K + T, H]
        memory = tape.unfold(1, slots, 1)[:, :steps].transpose(-1, -2)  # [B, T, K, H]
        query = self.predict_query(top)  # [B, T, H]
        scores = (memory @ query.unsqueeze(-1)).squeeze(-1) / math.sqrt(c.hidden_dim)  # [B,T,K]
        if limit is not None:
            logits = self._marginal_log_probs(top, memory, scores, window_valid, limit)
        else:
            scores = scores.masked_fill(~window_valid, torch.finfo(scores.dtype).min)
            gated = torch.softmax(scores, dim=-1) * next_gates  # [B, T, K]
            total = gated.sum(-1, keepdim=True)
            positive = total >= torch.finfo(total.dtype).tiny
            weights = torch.where(positive, gated / torch.where(positive, total, 1.0), 0.0)
            read = (weights.unsqueeze(-2) @ memory).squeeze(-2)  # [B, T, H]
            features = self.predict(torch.cat([top, read], dim=-1))  # [B, T, E]
            logits = self.decoder(self.output_dropout(features))  # [B, T, V]

        keep = c.lookback - 1
        new_state = PRPNState(
            context=torch.cat([state.context, x], dim=1)[:, -keep:] if keep else state.context,
            context_valid=torch.cat([state.context_valid, ones], dim=1)[:, -keep:]
            if keep
            else state.context_valid,
            distances=torch.cat([state.distances, d], dim=1)[:, steps:],
            hidden=torch.stack(hidden),
            cells=torch.stack(cells),
            valid=valid,
        )
        return PRPNOutput(
            logits=logits,
            state=new_state,
            distances=d,
            gates=gates,
            next_gates=next_gates,
            attention=torch.stack(bottom_attention, dim=1),
            hidden=top,
            next_distances=d_next,
            limit=limit,
        )

    # ---- the exact latent-variable Predict network (objective="marginal") ----------------
    def _marginal_log_probs(
        self, top: Tensor, memory: Tensor, scores: Tensor, valid: Tensor, limit: Tensor
    ) -> Tensor:
        """log p(x_{t+1} = v | x_<=t) [B, T, V] = log sum_s p(s) p(v | reading s), exactly.

        top [B, T, H], memory [B, T, K, H], scores [B, T, K] (raw attention scores), valid
        [B, T, K], limit [B, T, K + 1] = p(s) (:func:`_limit_distribution`). Reading s < K
        is the raw attention renormalised over the slots s..K-1 (hard gates 1(l <= i)),
        reading K is empty (0). All K + 1 readings go through the Predict network at once and
        the tied softmax in :class:`_MixtureLogProbs` (the [B, T, K + 1, V] scores made chunk by
        chunk and recomputed in the backward pass, to bound the memory).
        """
        slots = memory.shape[-2]
        index = torch.arange(slots, device=memory.device)
        allowed = (index >= index.unsqueeze(-1)) & valid.unsqueeze(-2)  # [B, T, K (s), K (i)]
        hard = scores.unsqueeze(-2).masked_fill(~allowed, torch.finfo(scores.dtype).min)
        weights = torch.softmax(hard, dim=-1) * allowed.to(scores.dtype)  # [B, T, K, K]
        reads = weights @ memory  # [B, T, K, H]
        reads = torch.cat([reads, torch.zeros_like(reads[..., :1, :])], dim=-2)  # [B,T,K+1,H]
        positive = limit > 0
        log_prior = torch.log(torch.where(positive, limit, 1.0)).masked_fill(
            ~positive, float("-inf")
        )  # [B, T, K + 1], -inf (and no gradient) where p(s) = 0
        queries = top.unsqueeze(-2).expand_as(reads)  # [B, T, K + 1, H]
        features = self.predict(torch.cat([queries, reads], dim=-1))  # [B, T, K + 1, E]
        features = self.output_dropout(features)
        return _MixtureLogProbs.apply(
            features, self.decoder.weight, self.decoder.bias, log_prior, self.config.chunk_size
        )

    def forward(
        self, inputs: Tensor, state: tuple[Tensor, ...] | None = None
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """(logits [B, T, V], new state) for ``inputs`` [B, T] (LM interface).

        The state is a plain tuple with the fields of :class:`PRPNState` (the training loop
        checkpoints it; batch in dimension 1 of ``hidden`` / ``cells``, 0 elsewhere).
        """
        out = self.run(inputs, None if state is None else PRPNState(*state))
        return out.logits, tuple(out.state)
