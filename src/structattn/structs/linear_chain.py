"""Linear-chain dynamic programs: forward algorithm in any semiring, forward-backward by hand,
k-best Viterbi, scoring.

Shapes: ``unary`` [B, N, C] node log-potentials, ``pairwise`` [B, N-1, C, C] with
``pairwise[b, i, a, c]`` the log-potential of (z_i = a, z_{i+1} = c) (:func:`chain_log_partition`
and :func:`chain_marginals` also take one [C, C] matrix shared by every step), ``lengths`` [B]
(or None). Positions ``>= lengths[b]`` are ignored. Time O(N C^2), sequential over N.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, overload

import torch
from torch import Tensor

from .._precision import full_precision
from .._validation import last_index, length_mask, refuse_differentiated_backward
from ..semirings import LogSemiring, Semiring
from ._extension import kernels as compiled_kernels
from ._library import chain_ops, tracing
from ._ops import (
    Stash,
    batch_dot,
    differentiated,
    is_transformed,
    outer_jvp,
    reads_host,
    refuse_jit_trace,
    vmap_by_folding,
)

__all__ = [
    "chain_argmax",
    "chain_inside",
    "chain_inside_scan",
    "chain_kbest",
    "chain_log_partition",
    "chain_marginals",
    "chain_score",
]


def _use_scan(n: int, c: int) -> bool:
    """The parallel scan does O(N C^3) work in O(log N) steps, the forward algorithm O(N C^2)
    in N steps; on CPU the scan was faster for C <= 3 from N of about 20 and for C = 4 from
    N of about 50, and slower from C = 6 on (the timings: benchmarks/README.md, "Figures
    behind the thresholds in structs/")."""
    return (c <= 3 and n >= 16) or (c == 4 and n >= 48)


@full_precision
def chain_inside(
    unary: Tensor,
    pairwise: Tensor,
    lengths: Tensor | None,
    semiring: type[Semiring],
    method: str = "auto",
) -> Tensor:
    """⊕ over label sequences of the sequence score, shape [B].

    ``method``: ``"sequential"`` (forward algorithm), ``"scan"`` (log-depth parallel scan of
    the step matrices) or ``"auto"`` (the scan for few labels and long chains).
    """
    n, c = unary.shape[1], unary.shape[2]
    if method == "auto":
        method = "scan" if _use_scan(n, c) else "sequential"
    if method == "scan":
        return chain_inside_scan(unary, pairwise, lengths, semiring)
    if method != "sequential":
        raise ValueError(f"`method` must be 'auto', 'sequential' or 'scan', got {method!r}")
    steps_u = unary.unbind(1)  # N x [B, C]
    steps_p = pairwise.unbind(1)  # (N-1) x [B, C, C]
    alpha = steps_u[0]  # [B, C]
    for i in range(1, n):
        # alpha'[b, c] = ⊕_a alpha[b, a] + pairwise[b, i-1, a, c]  (+ unary[b, i, c])
        new = semiring.sum(alpha.unsqueeze(-1) + steps_p[i - 1], dim=1) + steps_u[i]
        alpha = new if lengths is None else torch.where((lengths > i).unsqueeze(-1), new, alpha)
    return semiring.sum(alpha, dim=-1)


@full_precision
def chain_inside_scan(
    unary: Tensor, pairwise: Tensor, lengths: Tensor | None, semiring: type[Semiring]
) -> Tensor:
    """The same quantity as the forward algorithm, by a log-depth tree of semiring matrix
    products of the step matrices M_i[a, c] = pairwise[i-1, a, c] + unary[i, c]; padded steps
    are semiring identities. Exact in every semiring (the sampling semiring's backward draws
    the middle state of each product given its ends, i.e. exact recursive bisection)."""
    batch, n, c = unary.shape
    if n == 1:
        return semiring.sum(unary[:, 0], dim=-1)
    eye = torch.full((c, c), float("-inf"), dtype=unary.dtype, device=unary.device)
    eye.fill_diagonal_(0.0)  # the identity of (⊕, +) matrix products
    steps = pairwise + unary[:, 1:].unsqueeze(-2)  # [B, N-1, C, C]
    if lengths is not None:
        active = torch.arange(1, n, device=unary.device) < lengths.unsqueeze(-1)  # [B, N-1]
        steps = torch.where(active[..., None, None], steps, eye)
    while steps.shape[1] > 1:
        if steps.shape[1] % 2:
            steps = torch.cat([steps, eye.expand(batch, 1, c, c)], dim=1)
        left, right = steps[:, 0::2], steps[:, 1::2]  # [B, M/2, C, C]
        # (left ⊗ right)[a, c] = ⊕_b left[a, b] + right[b, c]
        steps = semiring.sum(left.unsqueeze(-1) + right.unsqueeze(-3), dim=-2)
    end = semiring.sum(unary[:, 0].unsqueeze(-1) + steps[:, 0], dim=1)  # [B, C]
    return semiring.sum(end, dim=-1)


def _stable_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest entries of ``x`` along its last dimension and their indices, ties in
    index order (``Tensor.topk`` leaves the order of ties unspecified)."""
    if k == 1:  # ``max`` returns the first maximal index
        best, index = x.max(dim=-1, keepdim=True)
        return best, index
    best, index = x.sort(dim=-1, descending=True, stable=True)
    return best[..., :k], index[..., :k]


@full_precision
def chain_kbest(
    unary: Tensor, pairwise: Tensor, lengths: Tensor | None, k: int
) -> tuple[Tensor, Tensor]:
    """Exact k-best Viterbi. Returns (scores [k, B], labels LongTensor [k, B, N]).

    Scores are sorted in decreasing order; when fewer than k label sequences have a finite
    score, the missing ones have score ``-inf`` and labels ``-1``. Padding labels are ``-1``.

    Ties are broken the same way for every k (every selection is a stable sort: among
    equal scores, the lower previous label, then the lower rank), so rank 0 is the same
    sequence for every k: the Viterbi path with ties broken towards the lower label, from
    the last position backwards.
    """
    batch, n, c = unary.shape
    device = unary.device
    # alpha[b, s, r]: score of the r-th best prefix ending in state s
    alpha = unary.new_full((batch, c, k), float("-inf"))
    alpha[:, :, 0] = unary[:, 0]
    identity = torch.arange(c * k, device=device).view(1, c, k).expand(batch, c, k)
    backpointers = []
    for i in range(1, n):
        # cand[b, s', s, r] = alpha[b, s', r] + pairwise[b, i-1, s', s]
        cand = alpha.unsqueeze(2) + pairwise[:, i - 1].unsqueeze(-1)  # [B, C, C, k]
        cand = cand.permute(0, 2, 1, 3).reshape(batch, c, c * k)  # [B, C(s), C(s')*k]
        best, index = _stable_topk(cand, k)  # [B, C, k]; index = s' * k + r
        new = best + unary[:, i].unsqueeze(-1)
        if lengths is not None:
            active = (lengths > i).view(batch, 1, 1)
            new = torch.where(active, new, alpha)
            index = torch.where(active, index, identity)  # padding: stay in place
        alpha = new
        backpointers.append(index)
    scores, last = _stable_topk(alpha.reshape(batch, c * k), k)  # [B, k]
    labels = unary.new_empty((batch, k, n), dtype=torch.long)
    pointer = last  # [B, k], flat index s * k + r
    for i in range(n - 1, -1, -1):
        labels[:, :, i] = pointer // k
        if i > 0:
            pointer = backpointers[i - 1].reshape(batch, c * k).gather(1, pointer)
    if lengths is not None:
        pad = torch.arange(n, device=device) >= lengths.unsqueeze(-1)  # [B, N]
        labels = labels.masked_fill(pad.unsqueeze(1), -1)
    labels = labels.masked_fill(torch.isneginf(scores).unsqueeze(-1), -1)
    return scores.transpose(0, 1), labels.transpose(0, 1)


def _viterbi_op(unary: Tensor, pairwise: Tensor) -> Any:
    """``torch.ops.structattn_viterbi.viterbi`` (``_viterbi.cpp``) where it serves these
    potentials (CPU, float32 or float64, one dtype and device, plain tensors: no
    ``torch.func`` wrapper, fake or meta tensor), else None (the PyTorch code)."""
    if pairwise.dtype != unary.dtype or pairwise.device != unary.device:
        return None
    if is_transformed(unary) or is_transformed(pairwise) or compiled_kernels(unary) is None:
        return None
    try:  # registered by _viterbi.cpp when the kernels load (absent from an older build)
        return torch.ops.structattn_viterbi.viterbi
    except (AttributeError, RuntimeError):
        return None


@full_precision
def chain_argmax(
    unary: Tensor, pairwise: Tensor, lengths: Tensor | None
) -> tuple[Tensor, Tensor] | None:
    """(score of the best label sequence [B] in the potentials' dtype, its labels LongTensor
    [B, N]: -1 at padding, and everywhere for an item with no valid sequence) straight from
    the C++ Viterbi kernel (``_viterbi.cpp``): the max-plus forward pass and the backtrack in
    one loop per item, no autograd node, no k-best bookkeeping. The same sequence (ties: the
    lower label at every max, from the last position backwards) and the same score, bit for
    bit, as :func:`chain_kbest` with k = 1, whose operations it runs in the same order.
    ``pairwise`` [C, C] (shared) or [B, N-1, C, C], read as given (strided views included);
    the unary potentials at padding are ignored. Not differentiable (detached): the
    gradient of the best score is the labels' indicators (:func:`chain_score` of them).
    ``None`` where the kernel does not apply (not built, not CPU float32/64, ``torch.func``
    transforms, ``torch.compile`` tracing, meta tensors): use :func:`chain_kbest`."""
    op = _viterbi_op(unary, pairwise)
    if op is None:
        return None
    batch, n, _ = unary.shape
    last = last_index(lengths, batch, n, unary.device)
    score, labels = op(unary.detach(), pairwise.detach(), last)
    return score, labels


def chain_score(unary: Tensor, pairwise: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Score of given label sequences, shape [B]. ``labels`` [B, N] with valid labels where
    ``mask`` [B, N] is True (other entries are ignored)."""
    safe = labels.masked_fill(~mask, 0)
    node = unary.gather(2, safe.unsqueeze(-1)).squeeze(-1)  # [B, N]
    node = node.masked_fill(~mask, 0.0).sum(-1)
    if unary.shape[1] == 1:
        return node
    c = unary.shape[2]
    flat = (safe[:, :-1] * c + safe[:, 1:]).unsqueeze(-1)  # [B, N-1, 1]
    edge = pairwise.flatten(2).gather(2, flat).squeeze(-1)  # [B, N-1]
    edge_mask = mask[:, 1:]
    edge = edge.masked_fill(~edge_mask, 0.0).sum(-1)
    return node + edge


# ---- forward-backward by hand ---------------------------------------------------------------
#
# Both forward passes below produce one scaled form. For an item of length L: per step i
# (positions i -> i+1) a matrix K_i [C, C]; per position scaled forward values â_i [C],
# weights V_i [C] and an end vector e_i [C] (ω at L-1, 0 elsewhere: β̂ is 0 at padding), with
#
#   β̂_i(a) = Σ_c K_i(a, c) V_{i+1}(c) β̂_{i+1}(c) + e_i(a)          (backward sweep)
#   p(z_i = a) = â_i(a) β̂_i(a),    p(z_i = a, z_{i+1} = c) = â_i(a) K_i(a, c) V_{i+1}(c) β̂_{i+1}(c).
#
# * scaled pass (Rabiner's scaling; used when exact, see `_scaled_steps`):
#   K = exp(pairwise - m), m the largest transition; U_i = exp(unary_i - max_c unary_i);
#   â_{i+1} = (â_i K_i) ⊙ U_{i+1} / n_{i+1} with n_{i+1} = Σ_c of the numerator every k-th
#   position and 1 elsewhere; V_i = U_i / n_i; ω = 1 / Σ_c â_{L-1}(c);
#   log Z = Σ_{i<L} (log n_i + max_c unary_i) + (L - 1) m - log ω.
# * log-space pass (any potentials, -inf included): alpha by the forward algorithm,
#   K_i(a, c) = p(z_i = a | z_{i+1} = c) = exp(alpha_i(a) + pairwise_i(a, c) - pre_{i+1}(c)) with
#   pre_{i+1} = alpha_{i+1} - unary_{i+1} (alpha shifted to max 0 at each position); â = 1,
#   V = 1, ω = p(z_{L-1}).
#
# V is either kept apart (K shared by every step: one [C, C] matrix product per step) or
# folded into per-step matrices K_i diag(V_{i+1}) [B, N-1, C, C] (few labels: one batched
# product per step). After the forward pass every sweep is a linear recurrence (one small
# matrix product per step, no logsumexp, no autograd graph), and so is the Hessian-vector
# product (`_hvp`).

#: up to this many labels, V is folded into per-step matrices
_FOLD_LABELS = 4


class _Pass(NamedTuple):
    """The forward pass of one batch in the scaled form above."""

    scaled: Tensor  # â [B, N, C]
    trans: Tensor  # K [C, C] (shared), or K_i diag(V_{i+1}) [B, N-1, C, C] (V folded in)
    weight: Tensor | None  # V [B, N, C] with a shared K; None when folded
    end: Tensor  # e [B, N, C] or [B, N, 1]
    logz: Tensor  # [B]
    beta: Tensor | None  # β̂ [B, N, C] when the pass computed it on the way, else None


def _scaled_steps(pairwise: Tensor, top: Tensor) -> tuple[int, bool]:
    """(k, any position without a label) for the scaled pass: it may take k steps between
    normalisations (k = 0: it is not exact). ``top`` [B, N, 1]: each position's largest
    unary. Reads two values on the host (CPU only: :func:`._ops.reads_host`).

    With R the spread of the transitions (max - min; +inf if any is -inf), K >= e^-R, so one
    step shrinks Σ_c â by at most e^-R and grows it by at most C; a label whose U_i
    underflows, or whose â_i falls below tiny times Σ_c â_i, has a relative weight below
    tiny e^{kR} and (the backward factors of two labels differ by at most e^R) a marginal
    below tiny e^{(k+1)R} C. Both stay negligible, and nothing overflows, when
    (k + 1)(R + log C) <= 0.6 log(1 / tiny); the pass is used when R <= 0.3 log(1 / tiny) - log C.
    """
    if pairwise.dtype not in (torch.float32, torch.float64):
        return 0, False
    c, n = pairwise.shape[-1], top.shape[1]
    spread = pairwise.max() - pairwise.min() if pairwise.numel() else pairwise.new_zeros(())
    lowest = top.min() if top.numel() else top.new_zeros(())
    spread_f, lowest_f = torch.stack([spread, lowest]).tolist()  # +inf if any -inf transition
    empty = lowest_f == float("-inf")
    budget = -math.log(torch.finfo(pairwise.dtype).tiny)  # 87 in float32, 708 in float64
    if not spread_f <= 0.3 * budget - math.log(c):  # NaN (every transition -inf): log space
        return 0, empty
    rate = spread_f + math.log(c)
    if rate <= 0.0:
        return max(n, 1), empty
    return max(1, min(n, int(0.6 * budget / rate) - 1)), empty


def _recur(mats: Tensor, adds: Tensor, every: int = 0) -> tuple[Tensor, list[Tensor]]:
    """x_0 = adds_0, x_{j+1} = x_j mats_j + adds_{j+1}: mats [B, S, C, C], adds [B, S+1, C]
    -> x [B, S+1, C], one batched product per step. With ``every`` > 0 (for the forward pass:
    adds 0 after x_0), x is also divided by its sum n_i at positions i = k, 2k, .. (k =
    ``every``); returns those n_i [B, 1, 1] too."""
    steps = mats.unbind(1)  # [B, C, C] each
    terms = adds.unsqueeze(2).unbind(1)  # [B, 1, C] each
    x = terms[0]
    outs, norms = [x], []
    for j, step in enumerate(steps):
        x = torch.baddbmm(terms[j + 1], x, step)
        if every and (j + 1) % every == 0:
            norms.append(x.sum(-1, keepdim=True))
            x = x / norms[-1]
        outs.append(x)
    return torch.cat(outs, 1), norms


def _two_way(
    mats: Tensor, on: Tensor | None, back: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    """Two linear recurrences over per-step matrices A_i = mats[:, i] [B, N-1, C, C], run in
    one loop (the backward one reversed and stacked on the batch):
      on:   x_0 = on_0,            x_{i+1} = x_i A_i + on_{i+1}
      back: y_{N-1} = back_{N-1},  y_i = A_i y_{i+1} + back_i
    ``on``, ``back``: [B, N, C] or None (not run)."""
    batch = mats.shape[0]
    parts, adds = [], []
    if on is not None:
        parts.append(mats)
        adds.append(on)
    if back is not None:
        parts.append(mats.transpose(-1, -2).flip(1))  # A_{N-2-j}^T
        adds.append(back.flip(1))
    out, _ = _recur(torch.cat(parts), torch.cat(adds))
    x = out[:batch] if on is not None else None
    y = out[-batch:].flip(1) if back is not None else None
    return x, y


def _scaled_pass(
    unary: Tensor, top: Tensor, pairwise: Tensor, last: Tensor, every: int, any_empty: bool
) -> _Pass:
    batch, n, c = unary.shape
    positions = torch.arange(n, device=unary.device)
    real = positions < (last + 1).unsqueeze(-1)  # [B, N]
    is_end = positions == last.unsqueeze(-1)  # [B, N]
    dead = None
    if any_empty:  # positions where every label is -inf
        empty = torch.isneginf(top)  # [B, N, 1]
        dead = (empty.squeeze(-1) & real).any(-1)  # [B]: no valid structure
        top = top.masked_fill(empty, 0.0)
        # U = 1 there, so that nothing divides by 0; their items are zeroed below
        unary = unary.masked_fill(empty, 0.0)
        is_end = is_end & ~dead.unsqueeze(-1)  # ω = 0: every marginal 0
    u = torch.exp(unary - top)  # U [B, N, C], max 1 per position
    shift = pairwise.max() if pairwise.numel() else pairwise.new_zeros(())
    trans = torch.exp(pairwise - shift)  # K, entries in [e^-R, 1]
    logz = (top.squeeze(-1) * real).sum(-1) + last * shift  # [B], without the Σ log n_i
    end = is_end.unsqueeze(-1).to(unary.dtype)  # [B, N, 1]
    fold = trans.dim() == 4 or c <= _FOLD_LABELS
    if fold:
        mats = trans * u[:, 1:, None, :]  # K_i diag(U_{i+1}) [B, N-1, C, C]
        start = u * (positions == 0).view(1, n, 1).to(u.dtype)  # U_0 at position 0, else 0
        if every >= n:
            # no normalisation (n_i = 1, V = U): the forward pass and the backward sweep
            # (with ω = 1, rescaled after) run in one loop
            scaled, beta_unit = _two_way(mats, start, end.expand(batch, n, c))
            assert scaled is not None and beta_unit is not None
            omega, logz = _close(scaled, end, logz, dead)
            return _Pass(scaled, mats, None, end * omega, logz, beta_unit * omega)
        # â_i = â_{i-1} K_{i-1} diag(U_i) (/ n_i)
        scaled, norms = _recur(mats, start, every)
    else:
        u_steps = u.unbind(1)
        x = u_steps[0]  # [B, C]
        outs, norms = [x], []
        for i in range(1, n):
            x = (x @ trans).mul_(u_steps[i])  # â_i = (â_{i-1} K) ⊙ U_i
            if i % every == 0:
                norms.append(x.sum(-1, keepdim=True))  # [B, 1]
                x = x / norms[-1]
            outs.append(x)
        scaled = torch.stack(outs, 1)  # [B, N, C]
    norm_all = u.new_ones(batch, n, 1)  # n_i: Σ of the numerator at i = k, 2k, .., else 1
    if norms:
        norm_all[:, every : every * len(norms) + 1 : every] = torch.stack(norms, 1).view(
            batch, len(norms), 1
        )
    logz = logz + (norm_all.log().squeeze(-1) * real).sum(-1)
    omega, logz = _close(scaled, end, logz, dead)
    if fold:  # K_i diag(V_{i+1}) = K_i diag(U_{i+1}) / n_{i+1}
        return _Pass(scaled, mats / norm_all[:, 1:, None], None, end * omega, logz, None)
    return _Pass(scaled, trans, u / norm_all, end * omega, logz, None)


def _close(scaled: Tensor, end: Tensor, logz: Tensor, dead: Tensor | None) -> tuple[Tensor, Tensor]:
    """(ω = 1 / Σ_c â_{L-1}(c) [B, 1, 1], log Z [B]) from the scaled forward values, the end
    indicator [B, N, 1] (0 for dead items) and log Z without log Σ_c â_{L-1}."""
    final = (scaled * end).flatten(1).sum(-1)  # Σ_c â_{L-1}(c) [B]
    if dead is not None:
        final = final + dead  # 1 instead of 0: no division by 0
    logz = logz + final.log()
    if dead is not None:
        logz = logz.masked_fill(dead, float("-inf"))
    return (1.0 / final).view(-1, 1, 1), logz


def _log_pass(unary: Tensor, pairwise: Tensor, last: Tensor) -> _Pass:
    batch, n, c = unary.shape
    positions = torch.arange(n, device=unary.device)
    real = positions < (last + 1).unsqueeze(-1)  # [B, N]
    transposed = pairwise.transpose(-1, -2)  # pairwise_i^T, indexed [.., c, a]
    steps_t = [transposed] * (n - 1) if pairwise.dim() == 2 else list(transposed.unbind(1))
    lowest = torch.finfo(unary.dtype).min  # a finite shift for an all -inf alpha
    u_steps = unary.unbind(1)
    # alpha is kept shifted to max 0 (alpha_i - m_i): the exponents of K below then carry
    # no rounding error of |log Z| size
    shift = u_steps[0].amax(-1, keepdim=True).clamp_min(lowest)  # m_0 [B, 1]
    alpha = u_steps[0] - shift
    alphas, pres, shifts = [alpha], [], [shift]
    for i in range(1, n):
        # pre_i(c) = log Σ_a exp(alpha_{i-1}(a) + pairwise_{i-1}(a, c)),  alpha_i = pre_i + unary_i
        pre = torch.logsumexp(alpha.unsqueeze(-2) + steps_t[i - 1], dim=-1)  # [B, C]
        alpha = pre + u_steps[i]
        shift = alpha.amax(-1, keepdim=True).clamp_min(lowest)
        alpha = alpha - shift
        alphas.append(alpha)
        pres.append(pre)
        shifts.append(shift)
    alpha_all = torch.stack(alphas, 1)  # [B, N, C]
    final = alpha_all.gather(1, last.view(batch, 1, 1).expand(batch, 1, c)).squeeze(1)  # [B, C]
    local = torch.logsumexp(final, dim=-1)  # [B]
    safe = local.masked_fill(torch.isneginf(local), 0.0).unsqueeze(-1)
    omega = torch.exp(final - safe)  # ω = p(z_{L-1}) [B, C]; 0 if no valid structure
    logz = local + (torch.cat(shifts, 1) * real).sum(-1)  # log Z = Σ_{i<L} m_i + local
    if n > 1:
        pre_all = torch.stack(pres, 1)  # [B, N-1, C]
        pre_all = pre_all.masked_fill(torch.isneginf(pre_all), 0.0)  # -inf there: K = 0
        trans = torch.exp(alpha_all[:, :-1, :, None] + pairwise - pre_all[:, :, None, :])
    else:
        trans = unary.new_zeros(batch, 0, c, c)
    end = (positions == last.unsqueeze(-1)).unsqueeze(-1) * omega.unsqueeze(1)  # [B, N, C]
    return _Pass(torch.ones_like(unary), trans, None, end, logz, None)


def _forward_pass(unary: Tensor, pairwise: Tensor, lengths: Tensor | None, method: str) -> _Pass:
    """The forward pass without autograd; ``method`` is 'auto', 'scaled' or 'log'."""
    if method not in ("auto", "scaled", "log"):
        raise ValueError(f"`method` must be 'auto', 'scaled' or 'log', got {method!r}")
    last = last_index(lengths, unary.shape[0], unary.shape[1], unary.device)
    with torch.no_grad():
        unary, pairwise = unary.detach(), pairwise.detach()
        if method == "scaled" or (method == "auto" and reads_host(pairwise)):
            top = unary.amax(-1, keepdim=True)  # [B, N, 1]
            every, any_empty = _scaled_steps(pairwise, top)
            if every:
                return _scaled_pass(unary, top, pairwise, last, every, any_empty)
            if method == "scaled":
                raise ValueError("the scaled pass is not exact for these transitions")
        return _log_pass(unary, pairwise, last)


def _after(fw: _Pass, x: Tensor) -> Tensor:
    """V_{i+1} ⊙ x_{i+1} for the N-1 steps: x [B, N, C] -> [B, N-1, C]."""
    return x[:, 1:] if fw.weight is None else fw.weight[:, 1:] * x[:, 1:]


def _sweeps(
    fw: _Pass, on: Tensor | None, back: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    """The linear recurrences of the scaled form, [B, N, C] each (None if not asked):
    on:   x_0 = on_0,            x_{i+1} = V_{i+1} ⊙ (x_i K_i) + on_{i+1}
    back: y_{N-1} = back_{N-1},  y_i = K_i (V_{i+1} ⊙ y_{i+1}) + back_i"""
    if fw.weight is None:  # V folded into per-step matrices: both in one loop
        return _two_way(fw.trans, on, back)
    trans, weights = fw.trans, fw.weight.unbind(1)
    n = fw.scaled.shape[1]
    x = y = None
    if on is not None:
        adds = on.unbind(1)
        x = adds[0]
        outs = [x]
        for i in range(1, n):
            x = torch.addcmul(adds[i], weights[i], x @ trans)
            outs.append(x)
        x = torch.stack(outs, 1)
    if back is not None:
        trans_t, adds = trans.t(), back.unbind(1)
        y = adds[-1]
        outs = [y]
        for i in range(n - 2, -1, -1):
            y = torch.addmm(adds[i], weights[i + 1] * y, trans_t)
            outs.append(y)
        y = torch.stack(outs[::-1], 1)
    return x, y


def _beta(fw: _Pass) -> Tensor:
    """β̂ [B, N, C] (0 at padding)."""
    if fw.beta is not None:
        return fw.beta
    _, beta = _sweeps(fw, None, fw.end.expand_as(fw.scaled))
    assert beta is not None
    return beta


def _times_all(fw: _Pass, x: Tensor) -> Tensor:
    """K_i x_i for every step at once: x [B, N-1, C] -> [B, N-1, C] (x already carries V)."""
    if fw.trans.dim() == 2:
        return x @ fw.trans.t()
    return (fw.trans @ x.unsqueeze(-1)).squeeze(-1)


def _edge_marginals(fw: _Pass, beta: Tensor) -> Tensor:
    """p(z_i = a, z_{i+1} = c) = â_i(a) K_i(a, c) V_{i+1}(c) β̂_{i+1}(c): [B, N-1, C, C]."""
    return fw.scaled[:, :-1, :, None] * fw.trans * _after(fw, beta)[:, :, None, :]


def _pairwise_grad(fw: _Pass, beta: Tensor, seed: Tensor, shared: bool) -> Tensor:
    """Σ_b seed_b p_b(z_i = a, z_{i+1} = c): summed over items and steps into [C, C] if
    ``shared``, else [B, N-1, C, C]."""
    if fw.weight is None:
        edge = _edge_marginals(fw, beta) * seed.view(-1, 1, 1, 1)
        return edge.sum((0, 1)) if shared else edge
    c = fw.trans.shape[-1]
    after = _after(fw, beta).reshape(-1, c)  # [B(N-1), C]
    before = (fw.scaled[:, :-1] * seed.view(-1, 1, 1)).reshape(-1, c)  # [B(N-1), C]
    return fw.trans * (before.t() @ after)


def _hvp(
    fw: _Pass, beta: Tensor, g_node: Tensor | None, g_edge: Tensor | None, shared: bool
) -> tuple[Tensor, Tensor]:
    """Hessian of log Z times the direction (g_node [B, N, C], g_edge [B, N-1, C, C]), i.e. the
    derivative of the marginals along it, by forward-mode tangents of both passes:

      dot A = Σ_i <p(z_i), g_i> + Σ_i <p(z_i, z_{i+1}), g_edge_i>      (tangent of log Z)
      q_i = â_i ⊙ dot alpha_i:  q_0 = â_0 ⊙ g_0,
            q_{i+1} = V_{i+1} ⊙ (q_i K_i + Σ_a â_i(a) K_i(a, ·) g_edge_i(a, ·)) + â_{i+1} ⊙ g_{i+1}
      r_i = p(z_i) dot beta_i / â_i:  r_i = K_i (V_{i+1} ⊙ r_{i+1}) + κ_i,
            κ_i(a) = Σ_c K_i(a, c) V_{i+1}(c) β̂_{i+1}(c) (g_{i+1}(c) + g_edge_i(a, c))
      d p(z_i)          = β̂_i ⊙ q_i + â_i ⊙ r_i - p(z_i) dot A
      d p(z_i, z_{i+1}) = K_i ⊙ (q_i ⊗ X_{i+1} + â_i ⊗ Y_{i+1}) + p(z_i, z_{i+1}) ⊙ g_edge_i,
            X = V ⊙ β̂,  Y = V ⊙ r + X ⊙ (g - dot A)

    Returns (unary part [B, N, C], pairwise part: [C, C] if ``shared``, else [B, N-1, C, C]).
    """
    scaled, trans = fw.scaled, fw.trans
    node = scaled * beta  # [B, N, C]
    g = torch.zeros_like(node) if g_node is None else g_node
    after = _after(fw, beta)  # X [B, N-1, C]
    dot = (node * g).flatten(1).sum(-1)  # [B]
    edge = None
    add_q = scaled * g  # [B, N, C]
    kappa = _times_all(fw, after * g[:, 1:])  # [B, N-1, C]
    if g_edge is not None:
        edge = _edge_marginals(fw, beta)
        dot = dot + (edge * g_edge).flatten(1).sum(-1)
        k_edge = trans * g_edge  # [B, N-1, C, C]
        into = (scaled[:, :-1, :, None] * k_edge).sum(-2)  # [B, N-1, C]
        if fw.weight is not None:
            into = fw.weight[:, 1:] * into
        add_q = add_q + torch.cat([torch.zeros_like(add_q[:, :1]), into], 1)
        kappa = kappa + (k_edge * after[:, :, None, :]).sum(-1)
    kappa = torch.cat([kappa, torch.zeros_like(add_q[:, :1])], 1)  # [B, N, C]
    q, r = _sweeps(fw, add_q, kappa)
    assert q is not None and r is not None
    dot3 = dot.view(-1, 1, 1)
    d_unary = beta * q + scaled * r - node * dot3
    y = _after(fw, r) + after * (g[:, 1:] - dot3)  # [B, N-1, C]
    if fw.weight is not None and edge is None:  # shared K: [C, C] directly
        c = trans.shape[-1]
        left = torch.cat([q[:, :-1], scaled[:, :-1]], 1).reshape(-1, c)  # [2B(N-1), C]
        right = torch.cat([after, y], 1).reshape(-1, c)
        return d_unary, trans * (left.t() @ right)
    d_pair = q[:, :-1, :, None] * after[:, :, None, :] + scaled[:, :-1, :, None] * y[:, :, None, :]
    d_pair = trans * d_pair
    if edge is not None and g_edge is not None:
        d_pair = d_pair + edge * g_edge
    return d_unary, d_pair.sum((0, 1)) if shared else d_pair


def _per_step(pairwise: Tensor, batch: int, n: int) -> Tensor:
    """Transitions as [B, N-1, C, C] (a view when shared)."""
    c = pairwise.shape[-1]
    return pairwise.expand(batch, n - 1, c, c) if pairwise.dim() == 2 else pairwise


def _hvp_by_autograd(
    unary: Tensor,
    pairwise: Tensor,
    lengths: Tensor | None,
    g_node: Tensor | None,
    g_edge: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """The same Hessian-vector product by autograd through :func:`chain_inside`, itself
    differentiable (third order and beyond)."""
    with torch.enable_grad():
        u = unary if unary.requires_grad else unary.detach().requires_grad_()
        p = pairwise if pairwise.requires_grad else pairwise.detach().requires_grad_()
        steps = _per_step(p, u.shape[0], u.shape[1])
        # chain_inside stops each item at its length: the unary at padding (left as is where
        # the kernels served the first passes) reaches neither log Z nor its derivatives
        logz = chain_inside(u, steps, lengths, LogSemiring)
        node, edge = torch.autograd.grad(logz.sum(), (u, steps), create_graph=True)
        pairs = [(node, g_node), (edge, g_edge)]
        outs = [o for o, g in pairs if g is not None]
        grads = [g for _, g in pairs if g is not None]
        d_unary, d_pair = torch.autograd.grad(
            outs, (u, p), grads, create_graph=True, allow_unused=True, materialize_grads=True
        )
    return d_unary, d_pair


#: the C++ kernels (``_chain.cpp``: one loop per chain, the log-space pass in double
#: precision) serve chains with up to this many labels (``method="auto"``, CPU, float32 and
#: float64); more labels run the batched code above (O(C^2) exps per step in the kernel,
#: which loses to the batched code from about C = 25). The timings: benchmarks/README.md,
#: "Figures behind the thresholds in structs/".
_KERNEL_LABELS = 16
#: ... and, for one [C, C] matrix shared by every step (exponentiated once: C multiply-adds
#: per label and step), up to _SHARED_LABELS labels while the kernel's [B, N-1, C, C] double
#: buffer holds at most _SHARED_BUFFER elements (8 MiB). With two threads, B = 32 and
#: N = 20-50 the kernel takes 0.42-0.93x the batched code's time up to 22 labels on every
#: SIMD clone (one row of 80: 1.09), and with 24-26 labels up to 1.05-1.13x for full lengths
#: at N = 40-50 (``benchmarks/clone_audit.py --only chain --kernel-everywhere --threads 2``;
#: benchmarks/README.md, "Chain kernels by thread count").
_SHARED_LABELS = 22
_SHARED_BUFFER = 1 << 20
#: With ONE torch thread the kernel runs the batch's items one after the other, while the
#: batched code's [B, C, C] steps vectorise over the batch: there the kernel serves up to
#: this many labels (``benchmarks/clone_audit.py --only chain --threads 1``, B = 32, v4
#: clone, a quiet machine: kernels / PyTorch 0.39-0.60 at C = 8-10, 0.59-0.81 at C = 12,
#: 0.66-1.12 at C = 14, 0.92-1.32 at C = 16 and 1.0-2.4 at C = 20-25 for N = 20-200; with 2
#: threads 0.32-0.45 at C = 10, 0.42-0.60 at C = 16, 0.48-0.85 at C = 20 on every clone;
#: benchmarks/README.md, "Chain kernels by thread count").
_ONE_THREAD_LABELS = 12


def _chain_kernels(unary: Tensor, pairwise: Tensor, method: str) -> Any:
    """The compiled module if it serves this call, else None (the PyTorch code)."""
    batch, n, labels = unary.shape
    if labels > _ONE_THREAD_LABELS and torch.get_num_threads() == 1:
        return None
    if labels > _KERNEL_LABELS and (
        pairwise.dim() != 2
        or labels > _SHARED_LABELS
        or batch * max(n - 1, 0) * labels * labels > _SHARED_BUFFER
    ):
        return None
    if method != "auto" or pairwise.dtype != unary.dtype or is_transformed(unary):
        return None  # (the kernels take plain tensors: no torch.func wrapper, fake or meta)
    module = compiled_kernels(unary)
    if module is None or not hasattr(module, "chain_hvp") or pairwise.device != unary.device:
        return None
    return module


def _kernel_pass(
    module: Any, unary: Tensor, pairwise: Tensor, lengths: Tensor | None, edges: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(log Z [B], p(z_i) [B, N, C], edge marginals, K [B, N-1, C, C] float64, last [B]) from
    the kernel's forward-backward; the edge marginals by ``edges``: 0 none (empty), 1
    [B, N-1, C, C], 2 summed over each item's positions [B, C, C]."""
    batch, n, _ = unary.shape
    last = last_index(lengths, batch, n, unary.device)
    steps = _per_step(pairwise.detach(), batch, n)  # [B, N-1, C, C], a view when shared
    logz, node, edge, trans = module.chain_forward_backward(unary.detach(), steps, last, edges)
    return logz, node, edge, trans, last


class _ChainLogPartition(torch.autograd.Function):
    """log Z [B] (forward: the forward pass, no autograd graph; backward: the backward sweep
    by hand, the marginals times the incoming gradient). When the backward is differentiated
    again (``create_graph``), the marginals come from :class:`_ChainMarginals`, whose
    backward is a Hessian-vector product by hand. With few labels on CPU both passes run in
    the C++ kernels when they are built (:func:`_chain_kernels`). ``pair_grad``: the
    gradient of ``pairwise`` is wanted (the kernels then keep the edge marginals)."""

    @staticmethod
    def forward(
        unary: Tensor,
        pairwise: Tensor,
        lengths: Tensor | None,
        method: str,
        pair_grad: bool,
        stash: Stash,
    ) -> Tensor:
        kernels = _chain_kernels(unary, pairwise, method)
        if kernels is not None:
            # a shared matrix's gradient needs only each item's edge marginals summed
            edges = (2 if pairwise.dim() == 2 else 1) if pair_grad else 0
            logz, node, edge, _, _ = _kernel_pass(kernels, unary, pairwise, lengths, edges)
            stash.value = kernels, (node, edge)
            return logz
        fw = _forward_pass(unary, pairwise, lengths, method)
        stash.value = None, tuple(fw)
        return fw.logz

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        unary, pairwise, lengths, method, _, stash = inputs
        # an empty stash: the forward ran through the vmap rule (vmap outside grad); the
        # backward then recomputes what it needs
        ctx.kernels, saved = stash.value if stash.value is not None else (None, ())
        ctx.lengths = lengths
        ctx.method = method
        ctx.save_for_backward(unary, pairwise, *saved)
        ctx.save_for_forward(unary, pairwise, *saved)  # for jvp (torch.func.hessian)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        _, _, _, method, pair_grad, _ = args
        return _fold_chain(
            lambda u, p, n: _ChainLogPartition.apply(u, p, n, method, pair_grad, Stash()),
            info,
            in_dims,
            args,
        )

    @staticmethod
    def jvp(ctx: Any, t_unary: Tensor | None, t_pair: Tensor | None, *_: Any) -> Tensor:
        # d log Z = <p(z_i), dot unary> + <p(z_i, z_i+1), dot pairwise>, the marginals by
        # the Function on the scores: enclosing levels differentiate it (_ops.outer_jvp)
        def body(
            unary: Tensor,
            pairwise: Tensor,
            lengths: Tensor | None,
            t_unary: Tensor | None,
            t_pair: Tensor | None,
        ) -> Tensor:
            node, edge = _ChainMarginals.apply(unary, pairwise, lengths, True, ctx.method, Stash())
            return batch_dot((node, t_unary), (edge, t_pair))

        unary, pairwise = ctx.saved_tensors[:2]
        return outer_jvp(body, unary, pairwise, ctx.lengths, t_unary, t_pair)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        unary, pairwise, *saved = ctx.saved_tensors
        shared = pairwise.dim() == 2
        nones = (None, None, None, None)
        if torch.is_grad_enabled():
            node, edge = _ChainMarginals.apply(
                unary, pairwise, ctx.lengths, True, ctx.method, Stash()
            )
            d_pair = edge * grad.view(-1, 1, 1, 1)
            if shared:
                d_pair = d_pair.sum((0, 1))
            return node * grad.view(-1, 1, 1), d_pair, *nones
        if ctx.kernels is not None:
            node, edge = saved
            d_unary = node * grad.view(-1, 1, 1) if ctx.needs_input_grad[0] else None
            d_pair = None
            if ctx.needs_input_grad[1]:
                if shared:  # edge: [B, C, C], each item's sum over its positions
                    d_pair = (grad @ edge.flatten(1)).view_as(pairwise)
                else:
                    d_pair = edge * grad.view(-1, 1, 1, 1)
            return d_unary, d_pair, *nones
        fw = _Pass(*saved)
        beta = _beta(fw)
        d_unary = fw.scaled * beta * grad.view(-1, 1, 1) if ctx.needs_input_grad[0] else None
        d_pair = _pairwise_grad(fw, beta, grad, shared) if ctx.needs_input_grad[1] else None
        return d_unary, d_pair, *nones


def _fold_chain(
    apply: Callable[[Tensor, Tensor, Tensor | None], Any],
    info: Any,
    in_dims: tuple[int | None, ...],
    args: tuple[Any, ...],
) -> tuple[Any, Any]:
    """The vmap rule of the chain Functions (``args`` start with unary, pairwise, lengths):
    ``apply(unary, pairwise, lengths)`` once on the mapped dimension folded into the batch
    (:func:`vmap_by_folding`), a vmapped shared matrix made per-step first."""
    unary, pairwise, lengths = args[:3]
    in_dims, pairwise = _per_step_if_vmapped(unary, pairwise, in_dims)
    return vmap_by_folding(
        apply, info, in_dims[:3], (unary, pairwise, lengths), (True, pairwise.dim() > 2, True)
    )


def _per_step_if_vmapped(
    unary: Tensor, pairwise: Tensor, in_dims: tuple[int | None, ...]
) -> tuple[tuple[int | None, ...], Tensor]:
    """For a vmap rule: a vmapped shared matrix (physically [V, C, C] in some order) becomes
    per-step matrices [V, B, N-1, C, C] (vmapped dimension 0), which fold into the batch."""
    if in_dims[1] is None or pairwise.dim() != 3:
        return in_dims, pairwise
    shape = list(unary.shape)  # the logical [B, N, C] once the vmapped dimension is dropped
    if in_dims[0] is not None:
        del shape[in_dims[0]]
    stacked = pairwise.movedim(in_dims[1], 0)  # [V, C, C]
    size, c = stacked.shape[0], stacked.shape[-1]
    per_step = stacked[:, None, None].expand(size, shape[0], shape[1] - 1, c, c)
    return (in_dims[0], 0, *in_dims[2:]), per_step


class _ChainMarginals(torch.autograd.Function):
    """Node marginals [B, N, C] (and edge marginals [B, N-1, C, C] if ``edges``) by the
    forward pass and the backward sweep; backward: the Hessian-vector product by hand
    (:func:`_hvp`, or ``chain_hvp`` of the C++ kernels). Differentiating that once more falls
    back to autograd through :func:`chain_inside` (any order; not under ``torch.func``, whose
    transforms that fallback cannot see: there derivatives go up to the second order)."""

    @staticmethod
    def forward(
        unary: Tensor,
        pairwise: Tensor,
        lengths: Tensor | None,
        edges: bool,
        method: str,
        stash: Stash,
    ) -> Tensor | tuple[Tensor, Tensor]:
        kernels = _chain_kernels(unary, pairwise, method)
        if kernels is not None:
            _, node, edge, trans, last = _kernel_pass(kernels, unary, pairwise, lengths, int(edges))
            stash.value = kernels, (trans, node, last)
            return (node, edge) if edges else node
        fw = _forward_pass(unary, pairwise, lengths, method)
        beta = _beta(fw)
        fw = fw._replace(beta=beta)
        stash.value = None, tuple(fw)
        node = fw.scaled * beta
        if edges:
            return node, _edge_marginals(fw, beta)
        return node

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        unary, pairwise, lengths, edges, method, stash = inputs
        ctx.set_materialize_grads(False)
        ctx.lengths = lengths
        ctx.method = method
        ctx.edges_out = edges
        # an empty stash: the forward ran through the vmap rule (vmap outside grad); the
        # backward then recomputes what it needs
        ctx.kernels, saved = stash.value if stash.value is not None else (None, ())
        ctx.save_for_backward(unary, pairwise, *saved)
        ctx.save_for_forward(unary, pairwise, *saved)  # for jvp (torch.func.hessian)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        edges, method = args[3:5]
        return _fold_chain(
            lambda u, p, n: _ChainMarginals.apply(u, p, n, edges, method, Stash()),
            info,
            in_dims,
            args,
        )

    @staticmethod
    def jvp(ctx: Any, t_unary: Tensor | None, t_pair: Tensor | None, *_: Any) -> Any:
        # the marginals' directional derivative is the Hessian of log Z times the direction;
        # differentiated again by an enclosing level (_ops.outer_jvp): by torch.func through
        # the differentiable inside pass, from the scores
        def body(
            unary: Tensor,
            pairwise: Tensor,
            lengths: Tensor | None,
            t_unary: Tensor | None,
            t_pair: Tensor | None,
            saved: list[Tensor],
        ) -> Any:
            if differentiated(unary, pairwise):
                return _hvp_by_func(unary, pairwise, lengths, t_unary, t_pair, ctx.edges_out)
            if t_pair is not None and pairwise.dim() == 2:
                t_pair = _per_step(t_pair, unary.shape[0], unary.shape[1])
            d_unary, d_pair = _hvp_of(
                ctx, unary, pairwise, lengths, saved, t_unary, t_pair, False, False
            )
            return (d_unary, d_pair) if ctx.edges_out else d_unary

        unary, pairwise, *saved = ctx.saved_tensors
        return outer_jvp(body, unary, pairwise, ctx.lengths, t_unary, t_pair, saved)

    @staticmethod
    def backward(
        ctx: Any, g_node: Tensor | None, g_edge: Tensor | None = None
    ) -> tuple[Tensor | None, ...]:
        unary, pairwise, *saved = ctx.saved_tensors
        nones = (None, None, None, None)
        if g_node is None and g_edge is None:
            return None, None, *nones
        shared = pairwise.dim() == 2
        d_unary, d_pair = _hvp_of(ctx, unary, pairwise, ctx.lengths, saved, g_node, g_edge, shared)
        return (
            d_unary if ctx.needs_input_grad[0] else None,
            d_pair if ctx.needs_input_grad[1] else None,
            *nones,
        )


def _hvp_of(
    ctx: Any,
    unary: Tensor,
    pairwise: Tensor,
    lengths: Tensor | None,
    saved: list[Tensor],
    g_node: Tensor | None,
    g_edge: Tensor | None,
    shared: bool,
    by_autograd: bool = True,
) -> tuple[Tensor, Tensor]:
    """The Hessian-vector product of :class:`_ChainMarginals` from its saved state (by
    autograd through the inside pass when grad mode is on outside ``torch.func`` and
    ``by_autograd``); ``lengths``: the Function's (a jvp body passes them unwrapped from
    its torch.func level)."""
    if by_autograd and torch.is_grad_enabled() and not is_transformed(unary):
        return _hvp_by_autograd(unary, pairwise, lengths, g_node, g_edge)
    refuse_differentiated_backward("LinearChainCRF marginals", unary, pairwise)
    if ctx.kernels is not None and not is_transformed(g_node) and not is_transformed(g_edge):
        # (plain directions only: the kernels take no torch.func wrapper)
        trans, node, last = saved
        return ctx.kernels.chain_hvp(trans, node, last, g_node, g_edge, shared)
    if ctx.kernels is not None or not saved:  # a wrapped direction, or no stash: recompute
        fw = _forward_pass(unary.detach(), pairwise.detach(), lengths, ctx.method)
        fw = fw._replace(beta=_beta(fw))
    else:
        fw = _Pass(*saved)
    assert fw.beta is not None
    return _hvp(fw, fw.beta, g_node, g_edge, shared)


def _hvp_by_func(
    unary: Tensor,
    pairwise: Tensor,
    lengths: Tensor | None,
    t_unary: Tensor | None,
    t_pair: Tensor | None,
    edges: bool,
) -> Any:
    """The jvp of the marginals (node, and edge if ``edges``) by ``torch.func`` through
    :func:`chain_inside`: differentiable operations of the scores, for a jvp that is
    differentiated again (any order; slower than the hand-written Hessian-vector product)."""
    batch, n = unary.shape[:2]

    def marginals(u: Tensor, p: Tensor) -> Any:
        steps = _per_step(p, batch, n) if p.dim() == 2 else p
        node, edge = torch.func.grad(
            lambda a, b: chain_inside(
                *_zero_padding(a, b, lengths, False), lengths, LogSemiring
            ).sum(),
            argnums=(0, 1),
        )(u, steps)
        return (node, edge) if edges else node

    dot_u = torch.zeros_like(unary) if t_unary is None else t_unary
    dot_p = torch.zeros_like(pairwise) if t_pair is None else t_pair
    return torch.func.jvp(marginals, (unary, pairwise), (dot_u, dot_p))[1]


@full_precision
def chain_log_partition(
    unary: Tensor, pairwise: Tensor, lengths: Tensor | None, method: str = "auto"
) -> Tensor:
    """log Z [B], differentiable to any order (first order by a hand-written backward sweep).

    ``pairwise`` [C, C] (shared) or [B, N-1, C, C]; ``unary`` at padding is ignored (any
    value; its gradient is 0). ``method``: ``"scaled"`` (probability space with per-position
    normalisation; exact only for finite transitions of moderate spread), ``"log"`` (log
    space, any potentials) or ``"auto"`` (scaled when exact)."""
    refuse_jit_trace("A linear-chain CRF")
    if tracing():  # torch.compile, torch.export: one custom operator (._library)
        return torch.ops.structattn.chain_log_partition(unary, pairwise, lengths, method)
    kernels = _chain_kernels(unary, pairwise, method) is not None
    unary, pairwise = _zero_padding(unary, pairwise, lengths, kernels)
    pair_grad = pairwise.requires_grad and torch.is_grad_enabled()
    return _ChainLogPartition.apply(unary, pairwise, lengths, method, pair_grad, Stash())


def _zero_padding(
    unary: Tensor, pairwise: Tensor, lengths: Tensor | None, kernels: bool
) -> tuple[Tensor, Tensor]:
    """``unary`` with 0 at padding, and per-step ``pairwise`` with 0 at the steps beyond each
    item's last position, for the PyTorch code of the first passes (it computes every
    position and selects: NaN or +inf there would leak into its outputs and gradients, where
    the kernels ignore them, #37.10); as is when the C++ kernels serve the call
    (``kernels``: they stop at each item's length; one masking op fewer forward and backward,
    timed in benchmarks/README.md, "Ours warm against the bound; chains without padding
    masks")."""
    if lengths is None or kernels:
        return unary, pairwise
    mask = length_mask(lengths, unary.shape[0], unary.shape[1], unary.device)
    unary = unary.masked_fill(~mask.unsqueeze(-1), 0.0)
    if pairwise.dim() == 4 and pairwise.shape[1] > 0:  # step i is used when i + 1 is real
        pairwise = pairwise.masked_fill(~mask[:, 1:, None, None], 0.0)
    return unary, pairwise


@overload
def chain_marginals(
    unary: Tensor,
    pairwise: Tensor,
    lengths: Tensor | None,
    edges: Literal[True],
    method: str = ...,
) -> tuple[Tensor, Tensor]: ...
@overload
def chain_marginals(
    unary: Tensor,
    pairwise: Tensor,
    lengths: Tensor | None,
    edges: Literal[False] = ...,
    method: str = ...,
) -> tuple[Tensor, None]: ...
@overload
def chain_marginals(
    unary: Tensor, pairwise: Tensor, lengths: Tensor | None, edges: bool, method: str = ...
) -> tuple[Tensor, Tensor | None]: ...
@full_precision
def chain_marginals(
    unary: Tensor,
    pairwise: Tensor,
    lengths: Tensor | None,
    edges: bool = False,
    method: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """(p(z_i = c) [B, N, C], p(z_i = a, z_{i+1} = c) [B, N-1, C, C] or None) by
    forward-backward, 0 at padding and for items with no valid structure. Differentiable to
    any order; the first backward (a loss on the marginals) is a hand-written
    Hessian-vector product, not a double backward. Arguments as :func:`chain_log_partition`."""
    refuse_jit_trace("A linear-chain CRF (segmentation attention)")
    if tracing():  # torch.compile, torch.export: one custom operator (._library)
        node, edge = torch.ops.structattn.chain_marginals(unary, pairwise, lengths, edges, method)
        return node, (edge if edges else None)
    kernels = _chain_kernels(unary, pairwise, method) is not None
    unary, pairwise = _zero_padding(unary, pairwise, lengths, kernels)
    out = _ChainMarginals.apply(unary, pairwise, lengths, edges, method, Stash())
    if edges:
        return out[0], out[1]
    return out, None


# the custom operators torch.compile and torch.export trace (._library)
chain_ops(chain_log_partition, chain_marginals)
