"""PRPN's exact latent-variable objective (#40): brute-force enumeration of the attention
limits, gradients, windows, batching, and the soft objective left unchanged."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.nn import functional as F

from structattn.models.prpn_lm import PRPNConfig, PRPNLanguageModel

V, K = 11, 3


def _model(gate: str = "bradley-terry", **kwargs: object) -> PRPNLanguageModel:
    torch.manual_seed(0)
    config = dict(
        vocab_size=V, embed_dim=6, hidden_dim=5, num_slots=K, lookback=3, gate=gate,
        objective="marginal", tau=0.5, init_range=0.5,
    )  # fmt: skip
    config.update(kwargs)
    return PRPNLanguageModel(PRPNConfig(**config)).double().eval()  # type: ignore[arg-type]


def _limit_probabilities(d: list[float], query: float, gate: str, tau: float) -> list[float]:
    """p(l = k), k = 0..t, for keys d[0..t] and the query distance (eq. 4, by hand)."""

    def alpha(dk: float) -> float:
        if gate == "bradley-terry":
            return query / (query + dk)
        return min(max(1 + (query - dk) / tau, 0.0), 1.0)

    t = len(d) - 1
    probs = []
    for k in range(t + 1):
        stay = math.prod(alpha(d[j]) for j in range(k + 1, t + 1))
        probs.append(stay if k == 0 else (1 - alpha(d[k])) * stay)
    return probs


def _conditional(model: PRPNLanguageModel, top: torch.Tensor, t: int, limit: int) -> torch.Tensor:
    """log p(. | l = limit) [V] at step t, with hard gates 1(limit <= i) over the K newest
    memories (positions max(0, t - K) .. t - 1) -- a direct transcription of eq. 3."""
    h = top[t]
    positions = [i for i in range(max(0, t - K), t) if limit <= i]
    if positions:
        memory = top[positions]  # [n, H]
        q = model.predict_query(h)
        weights = torch.softmax(memory @ q / math.sqrt(h.shape[-1]), dim=0)
        read = weights @ memory
    else:
        read = torch.zeros_like(h)
    features = model.predict(torch.cat([h, read]))
    return torch.log_softmax(model.decoder(features), dim=-1)


@pytest.mark.parametrize("gate", ["bradley-terry", "stick-breaking"])
def test_log_likelihood_equals_the_sum_over_every_assignment(gate: str) -> None:
    """log p(x) of a short stream = log of the explicit sum over every (l_0, ..., l_{T-2})."""
    model = _model(gate)
    inputs = torch.tensor([[3, 7, 1, 9, 4, 2]])
    out = model.run(inputs)
    steps = inputs.shape[1] - 1
    ours = out.logits[0, torch.arange(steps), inputs[0, 1:]].sum()
    top = out.hidden[0]
    d, dn = out.distances[0].tolist(), out.next_distances[0].tolist()
    priors = [_limit_probabilities(d[: t + 1], dn[t], gate, 0.5) for t in range(steps)]
    conds = [
        [_conditional(model, top, t, k)[inputs[0, t + 1]] for k in range(t + 1)]
        for t in range(steps)
    ]
    terms = []
    for assignment in itertools.product(*(range(t + 1) for t in range(steps))):  # 5! of them
        prior = math.prod(priors[t][k] for t, k in enumerate(assignment))
        if prior > 0:
            terms.append(math.log(prior) + sum(conds[t][k] for t, k in enumerate(assignment)))
    brute = torch.logsumexp(torch.stack([torch.as_tensor(x) for x in terms]), 0)
    torch.testing.assert_close(ours, brute.to(ours), rtol=1e-10, atol=1e-10)


def test_outputs_are_normalised_log_probabilities_and_limits_sum_to_one() -> None:
    model = _model()
    out = model.run(torch.randint(V, (2, 7)))
    total = out.logits.logsumexp(-1)
    torch.testing.assert_close(total, torch.zeros_like(total))
    assert out.limit is not None and (out.limit >= 0).all()
    torch.testing.assert_close(out.limit.sum(-1), torch.ones(2, 7, dtype=torch.float64))
    assert (out.limit[:, 0, -1] == 1).all()  # fresh stream, first step: nothing to read
    # cross_entropy of the log-probabilities is their exact negative log-likelihood
    targets = torch.randint(V, (2 * 7,))
    flat = out.logits.reshape(-1, V)
    torch.testing.assert_close(
        F.cross_entropy(flat, targets, reduction="none"), -flat[torch.arange(14), targets]
    )


def test_windows_batches_and_chunks_agree() -> None:
    """The carried state, batching (a stream alone = in a batch) and the chunking of steps
    (1 step per chunk) give the log-probabilities of one pass."""
    model = _model()
    inputs = torch.randint(V, (3, 9))
    whole = model.run(inputs).logits
    first = model.run(inputs[:, :4])
    second = model.run(inputs[:, 4:], first.state).logits
    torch.testing.assert_close(torch.cat([first.logits, second], 1), whole)
    alone = model.run(inputs[1:2]).logits
    torch.testing.assert_close(alone, whole[1:2])
    model.config.chunk_size = 1
    torch.testing.assert_close(model.run(inputs).logits, whole)


def test_gradcheck_and_zero_probability_outcomes() -> None:
    model = _model(chunk_size=2 * (K + 1) * V)  # 2 (batch, step) rows per chunk
    torch.manual_seed(1)
    b, t, h = 2, 3, 5
    top = torch.randn(b, t, h, dtype=torch.float64, requires_grad=True)
    memory = torch.randn(b, t, K, h, dtype=torch.float64, requires_grad=True)
    scores = torch.randn(b, t, K, dtype=torch.float64, requires_grad=True)
    valid = torch.ones(b, t, K, dtype=torch.bool)
    valid[0, 0, :2] = False
    limit = torch.rand(b, t, K + 1, dtype=torch.float64) + 0.1
    limit = (limit / limit.sum(-1, keepdim=True)).requires_grad_()

    def f(top, memory, scores, limit):  # type: ignore[no-untyped-def]
        return model._marginal_log_probs(top, memory, scores, valid, limit)

    torch.autograd.gradcheck(f, (top, memory, scores, limit))
    # outcomes of probability 0 (closed slots, stick-breaking saturation) stay finite
    zero = limit.detach().clone()
    zero[..., :2] = 0.0
    zero = (zero / zero.sum(-1, keepdim=True)).requires_grad_()
    out = f(top, memory, scores, zero)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(zero.grad).all()  # type: ignore[arg-type]
    assert torch.isfinite(memory.grad).all()  # type: ignore[arg-type]


def test_training_step_and_validation() -> None:
    model = _model().float().train()
    logits, state = model(torch.randint(V, (2, 6)))
    logits2, _ = model(torch.randint(V, (2, 4)), tuple(x.detach() for x in state))
    loss = F.cross_entropy(logits.reshape(-1, V), torch.randint(V, (12,)))
    (loss + logits2.logsumexp(-1).sum()).backward()
    assert torch.isfinite(loss)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.parser is not None and model.parser.conv.weight.grad is not None
    with pytest.raises(ValueError, match="objective"):
        PRPNLanguageModel(PRPNConfig(vocab_size=5, objective="exact"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a gate"):
        PRPNLanguageModel(PRPNConfig(vocab_size=5, gate="none", objective="marginal"))


def test_soft_objective_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default is soft, and the soft path runs none of the marginal code."""
    assert PRPNConfig(vocab_size=5).objective == "soft"
    import structattn.models.prpn_lm as module

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("marginal code ran in the soft model")

    monkeypatch.setattr(module, "_limit_distribution", boom)
    monkeypatch.setattr(module, "stick_breaking_distribution", boom)
    monkeypatch.setattr(PRPNLanguageModel, "_marginal_log_probs", boom)
    soft = _model(objective="soft")
    out = soft.run(torch.randint(V, (2, 5)))
    assert out.limit is None and out.logits.shape == (2, 5, V)


def test_mixture_function_matches_autograd_and_gradchecks() -> None:
    """The hand-written softmax mixture (`_MixtureLogProbs`) equals autograd through
    log_softmax + logsumexp in value and in every gradient (features, tied weight, bias,
    log prior with a -inf outcome), for any chunking; gradcheck in float64; no double
    backward (it says so)."""
    from structattn.models.prpn_lm import _MixtureLogProbs

    torch.manual_seed(3)
    b, t, s, e, v = 2, 3, 4, 5, 7
    f = torch.randn(b, t, s, e, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, e, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, dtype=torch.float64, requires_grad=True)
    prior = torch.log_softmax(torch.randn(b, t, s, dtype=torch.float64), -1)
    prior[0, 1, 2] = float("-inf")
    prior.requires_grad_()
    ref = torch.logsumexp(torch.log_softmax(f @ w.t() + bias, -1) + prior.unsqueeze(-1), -2)
    g = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, (f, w, bias, prior), g)
    for chunk in (1, s * v * 2 + 1, 1 << 20):
        out = _MixtureLogProbs.apply(f, w, bias, prior, chunk)
        torch.testing.assert_close(out, ref)
        for got, want in zip(
            torch.autograd.grad(out, (f, w, bias, prior), g), expected, strict=True
        ):
            torch.testing.assert_close(got, want)
    finite = prior.detach().clamp_min(-30.0).requires_grad_()
    torch.autograd.gradcheck(lambda *x: _MixtureLogProbs.apply(*x, s * v), (f, w, bias, finite))
    out = _MixtureLogProbs.apply(f, w, bias, prior, 1 << 20)
    (first,) = torch.autograd.grad(out.sum(), f, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        first.sum().backward()
