"""Noise-aware posteriors of virtual clients: the released changes' noise, carried in ``q`` (issue 23).

**Where the noise goes.** A virtual-clients round (:class:`~numpyro_dppvi.pvi.update_perturbation.VirtualClients`,
Heikkila et al. 2023, Algorithm 3) releases ``R_m = sum_k clip_C(Delta_k) + xi_m``, ``xi_m ~ N(0, sigma_m^2 C^2 I)``
on every coordinate of a mean-field factor's change, written centred on the public mean ``m`` of the ``q`` it was
made from (:func:`~numpyro_dppvi.pvi.update_perturbation.centre`: ``(Delta eta1 + 2 Delta eta2 m, Delta eta2)``),
and the server moves the client's factor by ``rho`` times the release in natural parameters,
``rho (R_1 - 2 R_2 m, R_2)``. Each virtual factor moves by ``rho clip_C(Delta_k)`` only: it never holds noise, and
its change ``Delta_k = eta(q_k) - eta(q)`` is its own new value less its old one (its cavity is ``q / t_{m,k}``). So
after any number of rounds, exactly,

    t_m = sum_k t_{m,k} + rho sum_r (xi_1^(r) - 2 xi_2^(r) m_r, xi_2^(r)),        xi^(r) ~ N(0, w_r I),  w_r = rho^2 sigma_m^2 C^2    (1)

(the sum over the rounds each client's update was applied in, ``m_r`` the mean of the ``q`` of round ``r``).
Nothing corrects it: a virtual client answers its own factor, not the released one. The weights ``w_r`` and the
centres ``m_r`` are public (the noise stds of the ledger's events, the damping, the participations of the public
history, ``q``); each client carries ``W = sum_r w_r``, ``sum_r w_r m_r`` and ``sum_r w_r m_r^2`` (per coordinate)
in its state (:func:`carried`).

**The posterior** (:func:`noise_aware_posterior`). Write a coordinate of ``q`` as ``(eta1~, Lambda~ = -2 eta2~)``
and the noise-free values ``(eta1, Lambda) = (eta1~ - e_1, Lambda~ + 2 e_2)``: given the releases (a flat prior on
them), and ``theta | eta1, Lambda ~ N(eta1 / Lambda, 1 / Lambda)``. The noise-aware ``q`` keeps ``q``'s mean
``mu~ = eta1~ / Lambda~`` and takes the variance of that mixture to first order in the noise (the delta method on
``mu = eta1 / Lambda``: ``d mu = (e_1 + 2 e_2 mu~) / Lambda~``, and by (1) ``e_1 + 2 e_2 mu~ = sum_r rho (xi_1^(r) +
2 xi_2^(r) (mu~ - m_r))``),

    Var[theta] = 1 / Lambda~ + sum_r w_r (1 + 4 (mu~ - m_r)^2) / Lambda~^2                                      (2)

where uncentred releases (``m_r = 0``) would give ``W (1 + 4 mu~^2) / Lambda~^2``: the centring takes out the part
of the noise a precision's noise puts on the mean through ``eta1 = Lambda mu`` (measured on the coverage study's
logistic regression, where ``mu^2`` is about 1: ``benchmarks/results/coverage.json``). The exact moments of the
mixture are not used: ``eta1 / Lambda`` is a ratio of Gaussians, and its moments are dominated by the tail where the
noise takes ``Lambda`` near zero (measured on the coverage study's logistic regression, epsilon 1, 2,000 rows, the
same 20 fits: with them the mean's RMSE was 0.92 against 0.56 and the mean sd 0.87 against 0.35). ``W = 0`` gives
``q`` back. A checkpoint written before the centres existed (:data:`ADDED_STATE`) resumes with them at zero, which
is exactly (1) and (2) for its earlier releases: the version that wrote it released uncentred changes (``m_r = 0``).

**Full-rank factors** (``family="full_rank"``). A release is centred the same way, ``(Delta eta1 + 2 Delta eta2 m,
Delta eta2)`` with ``Delta eta2`` the ``[D, D]`` matrix, and its noise is iid ``N(0, s^2)`` on ``eta1`` and symmetric
on ``eta2`` (``s^2`` on the diagonal, ``s^2 / 2`` off it: ``Cov(xi2_jl, xi2_kl') = s^2 (d_jk d_ll' + d_jl' d_lk) / 2``,
:func:`~numpyro_dppvi.pvi.update_perturbation.release_change`). The same delta method on ``mu = Lambda^{-1} eta1``
gives ``d mu = Lambda~^{-1} sum_r rho (xi_1 + 2 xi_2 v_r)``, ``v_r = mu~ - m_r``, and ``Cov(2 xi_2 v) = 2 s^2 (|v|^2 I
+ v v^T)``, so

    Cov[theta] = Lambda~^{-1} + Lambda~^{-1} N Lambda~^{-1},     N = sum_r w_r ((1 + 2 v_r^T v_r) I + 2 v_r v_r^T)    (3)

(its diagonal on a diagonal ``eta2`` would be eq. (2)'s ``1 + 4 v_j^2`` only if the off-diagonal noise were absent:
it is not, and it adds ``2 sum_{l != j} v_l^2``). The client carries ``W``, ``sum_r w_r m_r`` and the matrix ``sum_r
w_r m_r m_r^T`` (:func:`carried`), from which ``N`` follows for the final ``mu~``. With a full precision, ``Lambda~^{-1}
e`` is already the linear response of the fixed point to a tilt ``e`` (the Hessian's off-diagonal is in ``q``), which
eq. (2) lacks.

**What it does not model.** The invalid-update rule's floor changes the noise it fires on (counted:
``invalid_updates`` in the history). The virtual factors' answers depend on ``q``, so on earlier noise, through their
cavities: at the fixed point of mean-field PVI a tilt ``e`` of ``q`` moves the mean by ``H^{-1} e``, ``H`` the full
Hessian of the negative log posterior (the linear response of mean-field VB), where (2) takes ``diag(Lambda~)^{-1}
e``; where the posterior's coordinates are correlated the noise moves the mean further than (2) says
(``benchmarks/vc_noise_response.py``), and a mean-field ``q`` does not hold the off-diagonal ``H`` that would say by
how much. An under-converged fit (few rounds, small damping: each virtual factor has moved ``1 - (1 - rho)^R`` of the
way) is modelled as converged.

**Privacy.** ``w_r`` is computed from the noise stds (the plan's, public in the ledger's events), the damping and
which updates were applied (the public history), ``m_r`` from the public ``q`` of the round, and the posterior from
``q`` (public) and those: post-processing of the releases (Dwork & Roth 2014, Prop. 2.1), no privacy cost, and no
unreleased value enters it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import factors
from ..factors import Gaussian

KEY = "release_noise_var"
#: ``sum_r w_r m_r`` and ``sum_r w_r m_r^2`` per coordinate (eq. 1): the centres of the releases, weighted.
CENTRE_KEYS = ("release_noise_centre", "release_noise_centre_sq")
KEYS = (KEY,) + CENTRE_KEYS
#: Client state a checkpoint may lack, filled with zeros on resume (:func:`numpyro_dppvi.pvi.resume.resume`): the
#: versions that carried ``W`` but not the centres released uncentred changes (mean-field before the centring of
#: issue 23, full-rank before eq. 3), so their releases' ``m_r`` are zero and zeros are their sums, exactly.
ADDED_STATE = CENTRE_KEYS


def carried(client_state: dict, damping, applied, centre=None) -> dict:
    """The client state with the noise its factor took from this round's release added (eq. 1): weight ``w =
    rho^2 sigma_m^2 C^2`` when the update was ``applied`` (``noise_std = sigma_m C``, public), and ``w m``, ``w
    m^2`` for the release's ``centre`` ``m`` (None: uncentred; full-rank: ``w m m^T``, eq. 3). A state without the
    keys (a checkpoint written before they existed) is left as it is."""
    if KEY not in client_state:
        return client_state
    added = jnp.where(applied, jnp.square(damping * client_state["noise_std"]), 0.0)
    out = dict(client_state, **{KEY: client_state[KEY] + added})
    if centre is not None and CENTRE_KEYS[0] in client_state:
        out[CENTRE_KEYS[0]] = client_state[CENTRE_KEYS[0]] + added * centre
        full = client_state[CENTRE_KEYS[1]].ndim == centre.ndim + 1
        second = jnp.outer(centre, centre) if full else jnp.square(centre)
        out[CENTRE_KEYS[1]] = client_state[CENTRE_KEYS[1]] + added * second
    return out


def total_variance(client_state: dict) -> jax.Array:
    """``W`` of eq. (1): the clients' carried variances summed (the noises are independent)."""
    return jnp.sum(client_state[KEY])


def mean_noise_variance(mean: jax.Array, client_state: dict) -> jax.Array:
    """``sum_r w_r (1 + 4 (mu - m_r)^2)`` per coordinate (eq. 2's numerator), from the carried sums over every
    client: ``W (1 + 4 mu^2) - 8 mu sum_r w_r m_r + 4 sum_r w_r m_r^2``."""
    weight = total_variance(client_state)
    first = jnp.sum(client_state[CENTRE_KEYS[0]], axis=0) if CENTRE_KEYS[0] in client_state else 0.0
    second = jnp.sum(client_state[CENTRE_KEYS[1]], axis=0) if CENTRE_KEYS[1] in client_state else 0.0
    return weight * (1.0 + 4.0 * jnp.square(mean)) - 8.0 * mean * first + 4.0 * second


def mean_noise_covariance(mean: jax.Array, client_state: dict) -> jax.Array:
    """``N`` of eq. (3) (``[D, D]``), from the carried sums over every client: with ``a = sum_r w_r m_r`` and ``B =
    sum_r w_r m_r m_r^T``, ``sum_r w_r |v_r|^2 = W |mu|^2 - 2 mu.a + tr B`` and ``sum_r w_r v_r v_r^T = W mu mu^T -
    mu a^T - a mu^T + B``."""
    weight = total_variance(client_state)
    dim = mean.shape[-1]
    first = jnp.sum(client_state[CENTRE_KEYS[0]], axis=0) if CENTRE_KEYS[0] in client_state else jnp.zeros(dim)
    second = jnp.sum(client_state[CENTRE_KEYS[1]], axis=0) if CENTRE_KEYS[1] in client_state \
        else jnp.zeros((dim, dim))
    spread = weight * jnp.dot(mean, mean) - 2.0 * jnp.dot(mean, first) + jnp.trace(second)
    outer = weight * jnp.outer(mean, mean) - jnp.outer(mean, first) - jnp.outer(first, mean) + second
    return (weight + 2.0 * spread) * jnp.eye(dim) + 2.0 * outer


def noise_aware_posterior(q: Gaussian, client_state: dict) -> Gaussian:
    """Eq. (2): ``q``'s mean with every coordinate's variance widened by the noise its releases left in it; for a
    full-rank ``q``, eq. (3): its covariance widened by ``Lambda~^{-1} N Lambda~^{-1}``."""
    if factors.is_full_rank(q):
        mean, precision = factors.mean_and_precision(q)
        covariance = jnp.linalg.inv(precision)
        covariance = covariance + covariance @ mean_noise_covariance(mean, client_state) @ covariance
        widened = jnp.linalg.inv(0.5 * (covariance + covariance.T))
        widened = 0.5 * (widened + widened.T)
        return Gaussian(widened @ mean, -0.5 * widened)
    precision = -2.0 * q.eta2
    mean = q.eta1 / precision
    widened = 1.0 / precision + mean_noise_variance(mean, client_state) / jnp.square(precision)
    return factors.from_loc_scale(mean, jnp.sqrt(widened))


def posterior(q: Gaussian, client_state: dict) -> Gaussian:
    """:func:`noise_aware_posterior`, jitted once per shape."""
    from ..program_cache import cached, jit

    program = cached(("release-noise-posterior",), lambda: jit(noise_aware_posterior))
    return program(q, {k: client_state[k] for k in KEYS if k in client_state})


def widening(q: Gaussian, client_state: dict) -> jax.Array:
    """Per coordinate, the noise-aware posterior's sd over ``q``'s (``[D]``): ``r`` where the released noise
    carries ``1 - 1/r^2`` of the variance (for the :class:`~numpyro_dppvi.diagnostics.NoiseWarning`)."""
    aware = posterior(q, client_state)
    return factors.to_loc_scale(aware)[1] / factors.to_loc_scale(q)[1]
