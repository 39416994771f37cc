"""Mean-field inference: Algorithm 1, masking, and the variational free energy vs brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from structattn import mean_field_free_energy, mean_field_marginals
from structattn.structs.mean_field import mean_field_updates


def _symmetric(b: int, n: int, scale: float = 1.0) -> torch.Tensor:
    j = torch.randn(b, n, n, dtype=torch.float64) * scale
    j = 0.5 * (j + j.transpose(1, 2))
    return j - torch.diag_embed(j.diagonal(dim1=1, dim2=2))  # zero diagonal


def _log_partition(phi: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Brute force over {0,1}^N of exp(phi.s + 1/2 s'Js), one item."""
    n = phi.shape[0]
    states = torch.tensor(list(itertools.product([0.0, 1.0], repeat=n)), dtype=phi.dtype)
    scores = states @ phi + 0.5 * torch.einsum("si,ij,sj->s", states, j, states)
    return scores.logsumexp(0)


def test_algorithm_1_explicitly() -> None:
    phi = torch.randn(2, 5, dtype=torch.float64)
    j = torch.randn(2, 5, 5, dtype=torch.float64)
    chi = phi.clone()
    for _ in range(3):  # chi_i <- sum_j J_ij sigmoid(chi_j) + phi_i
        s = torch.sigmoid(chi)
        chi = torch.stack(
            [torch.stack([(j[b, i] * s[b]).sum() for i in range(5)]) for b in range(2)]
        )
        chi = chi + phi
    torch.testing.assert_close(mean_field_marginals(phi, j, 3), torch.sigmoid(chi))
    traj = mean_field_marginals(phi, j, 3, return_trajectory=True)
    assert traj.shape == (4, 2, 5)
    torch.testing.assert_close(traj[0], torch.sigmoid(phi))
    torch.testing.assert_close(traj[-1], torch.sigmoid(chi))


def test_zero_interactions_give_sigmoid() -> None:
    phi = torch.randn(3, 6)
    for k in (0, 1, 5):
        torch.testing.assert_close(
            mean_field_marginals(phi, torch.zeros(3, 6, 6), k), phi.sigmoid()
        )


def test_masked_positions_have_zero_spin_and_no_influence() -> None:
    phi = torch.randn(2, 6, dtype=torch.float64)
    j = torch.randn(2, 6, 6, dtype=torch.float64)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    out = mean_field_marginals(phi, j, 4, mask)
    assert (out[1, 4:] == 0).all()
    phi2, j2 = phi.clone(), j.clone()
    phi2[1, 4:] = 100.0
    j2[1, 4:, :] = 50.0
    j2[1, :, 4:] = -50.0
    torch.testing.assert_close(mean_field_marginals(phi2, j2, 4, mask), out)
    alone = mean_field_marginals(phi[1:, :4], j[1:, :4, :4], 4)
    torch.testing.assert_close(out[1, :4], alone[0])


def test_free_energy_is_kl_minus_log_partition() -> None:
    n = 6
    phi = torch.randn(2, n, dtype=torch.float64)
    j = _symmetric(2, n)
    states = torch.tensor(list(itertools.product([0.0, 1.0], repeat=n)), dtype=torch.float64)
    for q in (torch.rand(2, n, dtype=torch.float64), mean_field_marginals(phi, j, 10)):
        free = mean_field_free_energy(phi, j, q)
        for b in range(2):
            logz = _log_partition(phi[b], j[b])
            log_q = (states * q[b].log() + (1 - states) * (1 - q[b]).log()).sum(-1)
            log_p = states @ phi[b] + 0.5 * torch.einsum("si,ij,sj->s", states, j[b], states) - logz
            kl = (log_q.exp() * (log_q - log_p)).sum()
            torch.testing.assert_close(free[b], kl - logz)
            assert free[b] >= -logz - 1e-9  # Gibbs variational bound


def test_weak_coupling_converges_to_fixed_point_and_lowers_free_energy() -> None:
    phi = torch.randn(4, 7, dtype=torch.float64)
    j = _symmetric(4, 7, scale=0.2)
    traj = mean_field_marginals(phi, j, 60, return_trajectory=True)
    q = traj[-1]
    torch.testing.assert_close(q, torch.sigmoid(phi + (j @ q.unsqueeze(-1)).squeeze(-1)))
    energies = torch.stack([mean_field_free_energy(phi, j, t) for t in traj])
    assert (energies[-1] <= energies[0] + 1e-12).all()


def test_gradcheck() -> None:
    phi = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    j = torch.randn(2, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: mean_field_marginals(a, b, 3), (phi, j))
    assert torch.autograd.gradgradcheck(lambda a, b: mean_field_marginals(a, b, 3), (phi, j))


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="unary"):
        mean_field_marginals(torch.randn(2, 3, 1), torch.randn(2, 3, 3), 1)
    with pytest.raises(ValueError, match="pairwise"):
        mean_field_marginals(torch.randn(2, 3), torch.randn(2, 3, 4), 1)
    with pytest.raises(ValueError, match="iterations"):
        mean_field_marginals(torch.randn(2, 3), torch.randn(2, 3, 3), -1)
    with pytest.raises(ValueError, match="mask"):
        mean_field_marginals(torch.randn(2, 3), torch.randn(2, 3, 3), 1, mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="pairwise"):
        mean_field_marginals(torch.randn(2, 3), torch.full((2, 3, 3), float("nan")), 1)


def _reference_updates(phi: torch.Tensor, j: torch.Tensor, k: int) -> torch.Tensor:
    """Algorithm 1 by autograd-recorded operations (any leading dimensions)."""
    s = torch.sigmoid(phi)
    for _ in range(k):
        s = torch.sigmoid(phi + (j @ s.unsqueeze(-1)).squeeze(-1))
    return s


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_fused_updates_match_autograd_in_value_and_gradient(k: int) -> None:
    # one autograd node with a hand-written backward (#19): the same numbers as autograd
    # through the k updates, for leading dimensions [B, Q] and either input alone
    phi = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    j = (2 * torch.randn(2, 3, 6, 6, dtype=torch.float64)).requires_grad_()
    seed = torch.randn(2, 3, 6, dtype=torch.float64)
    out, ref = mean_field_updates(phi, j, k), _reference_updates(phi, j, k)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    got = torch.autograd.grad((out * seed).sum(), (phi, j), allow_unused=True)
    want = torch.autograd.grad((ref * seed).sum(), (phi, j), allow_unused=True)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12)
    if k:
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-12)
    else:  # J is not used
        assert got[1] is None or (got[1] == 0).all()
    if k:  # J alone
        (only_j,) = torch.autograd.grad((mean_field_updates(phi.detach(), j, k) * seed).sum(), j)
        torch.testing.assert_close(only_j, want[1], rtol=0, atol=1e-12)
    if k == 2:  # the hand-written backward, and autograd through it when differentiated again
        assert torch.autograd.gradcheck(lambda a, b: mean_field_updates(a, b, k), (phi, j))
        assert torch.autograd.gradgradcheck(lambda a, b: mean_field_updates(a, b, k), (phi, j))
