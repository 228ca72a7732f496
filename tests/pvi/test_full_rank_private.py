"""Private full-rank fits (issue 22): update perturbation, the trusted aggregator and client-level DP
release a change of a full precision matrix.

The release is ``clip_C(Delta) + noise`` with the joint norm ``sqrt(||Delta eta1||^2 + ||Delta eta2||_F^2)``
and symmetric noise calibrated to it (:func:`~numpyro_dppvi.pvi.update_perturbation.release_change`).
The yardstick is the exact posterior of a conjugate linear regression with covariates correlated 0.95
(where mean-field under-states the sds four-fold): with negligible noise every private full-rank method
must reach it (its Newton steps are exact for a Gaussian likelihood). The sensitivity of the releases is
checked on random neighbours in ``tests/pvi/test_sensitivity.py``, their audits in
``tests/privacy/test_audit_families.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import numpyro_dppvi as dppvi
from numpyro_dppvi import factors, objectives
from numpyro_dppvi.optim import Newton
from numpyro_dppvi.factors import Gaussian
from numpyro_dppvi.pvi.update_perturbation import apply_invalid_rule, release_change

from .numpyro_models import correlated_data, linear, linear_exact, split
from .test_full_rank import gaussian_kl, q_moments

# Noise std sigma C = 1e-3 in natural parameters whose precisions are ~10^2-10^3: the noise moves the
# result by ~1e-5 in KL; the clip (1e3) is never reached. RDP: the PLD grid of sigma = 1e-6 would not fit.
NEGLIGIBLE = dppvi.Privacy(noise_multiplier=1e-6, clip=1e3, accountant="rdp")

SETTINGS = {
    "parameter_perturbation": dict(method="parameter_perturbation"),
    "local_averaging": dict(method="local_averaging", shards=3),
    "virtual_clients": dict(method="virtual_clients", shards=3, damping=0.5),
    "trusted_aggregator": dict(method="local_averaging", shards=3, trusted_aggregator=True),
    "client_level": dict(method="pvi", privacy_unit="client"),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_private_full_rank_reaches_the_exact_posterior_when_the_noise_is_negligible(name):
    """KL(q || exact) < 1e-3 (mean and full covariance) after 12 rounds: the non-private full-rank step
    reaches ~1e-6 on this model (``test_full_rank.py``); 1e-3 leaves room for virtual clients' damping
    (0.5^12 of the first error left) and is 300 times below mean-field's KL on the same data."""
    data = correlated_data()
    exact_mean, exact_cov = linear_exact(data)
    result = dppvi.fit_dppvi(linear, split(data), family="full_rank", rounds=12, privacy=NEGLIGIBLE,
                             rng_key=jax.random.key(0), **SETTINGS[name])
    mean, cov = q_moments(result)
    assert gaussian_kl(mean, cov, exact_mean, exact_cov) < 1e-3
    eta2 = np.asarray(result.q.eta2)
    np.testing.assert_array_equal(eta2, eta2.T)  # the released changes are exactly symmetric
    assert result.family == "full_rank"


@pytest.mark.filterwarnings("ignore::numpyro_dppvi.diagnostics.NoiseWarning")  # 25 rows a client at epsilon 8
def test_the_ledger_charges_as_many_noise_coordinates_as_a_release_has():
    """The noise a full-rank release adds (``release_change`` on a zero change, 20000 draws) lives in exactly as
    many independent coordinates as each event of the fit's ledger charges, each ``N(0, std^2)`` in the
    coordinates ``(eta1, eta2_ii, sqrt(2) eta2_ij)``: the rank of its covariance over every entry of ``eta1`` and
    ``eta2`` (mirrored ones included) is the event's ``dimension``, so no entry carries noise the ledger does
    not charge. A fit with real noise (epsilon 8) keeps ``q``'s precision exactly symmetric. 20000 draws: the
    se of a variance is ``var sqrt(2 / n)`` (5 se allowed)."""
    data = correlated_data()
    fit = dppvi.DPPVI(linear, method="local_averaging", shards=2, family="full_rank", rounds=3,
                      privacy=dppvi.Privacy(epsilon=8.0, delta=1e-5, clip=5.0))
    result = fit.run(None, split(data), 3)
    np.testing.assert_array_equal(np.asarray(result.q.eta2), np.asarray(result.q.eta2).T)
    charged = {event.dimension for event in result.privacy.events(0)}
    dim, std, n = data[0].shape[1], 0.7, 20000
    zero = factors.zeros(dim, family="full_rank")
    draw = jax.jit(jax.vmap(lambda k: release_change(k, zero, std)))  # one program, not op by op
    noise = draw(jax.random.split(jax.random.key(1), n))
    flat = np.concatenate([np.asarray(noise.eta1, np.float64), np.asarray(noise.eta2, np.float64).reshape(n, -1)], 1)
    eigenvalues = np.linalg.eigvalsh(np.cov(flat.T))
    assert charged == {int(np.sum(eigenvalues > 1e-3 * std ** 2))}
    rows, cols = np.triu_indices(dim, 1)
    coordinates = np.concatenate([flat[:, :dim], np.asarray(noise.eta2)[:, range(dim), range(dim)],
                                  np.sqrt(2) * np.asarray(noise.eta2, np.float64)[:, rows, cols]], 1)
    assert coordinates.shape[1] in charged
    assert np.all(np.abs(coordinates.var(0) - std ** 2) < 5 * std ** 2 * np.sqrt(2 / n))


def test_the_floor_rule_raises_the_precision_spectrum_and_is_counted():
    """``invalid="floor"`` on a full-rank proposal: eigenvalues of the precision below the floor are raised
    to it, the others and ``eta1`` kept; a proposal with none below is returned unchanged."""
    rng = np.random.default_rng(0)
    basis, _ = np.linalg.qr(rng.normal(size=(3, 3)))
    q = Gaussian(jnp.zeros(3), -0.5 * jnp.eye(3))
    bad = (basis * np.array([-2.0, 0.5, 4.0])) @ basis.T
    proposal = Gaussian(jnp.ones(3), jnp.asarray(-0.5 * bad, jnp.float32))
    floored, fired = apply_invalid_rule(q, proposal, 1.0, "floor", 1.0)
    assert bool(fired)
    np.testing.assert_allclose(np.sort(np.linalg.eigvalsh(-2.0 * np.asarray(floored.eta2))), [1.0, 1.0, 4.0],
                               atol=1e-5)
    np.testing.assert_array_equal(floored.eta1, proposal.eta1)
    good = Gaussian(jnp.ones(3), jnp.asarray(-0.5 * (basis * np.array([1.5, 2.0, 4.0])) @ basis.T, jnp.float32))
    kept, fired = apply_invalid_rule(q, good, 1.0, "floor", 1.0)
    assert not bool(fired)
    np.testing.assert_array_equal(kept.eta2, good.eta2)
    rejected, fired = apply_invalid_rule(q, proposal, 1.0, "reject", 1.0)
    assert bool(fired) and np.array_equal(rejected.eta2, q.eta2)


def test_dp_optimisation_refuses_newton_steps_with_the_fix():
    with pytest.raises(ValueError, match="optax optimizer"):
        dppvi.fit_dppvi(linear, split(correlated_data()), family="full_rank", method="dp_optimisation",
                        batch_size=10, privacy=dppvi.Privacy(epsilon=1.0, delta=1e-5), rounds=2, optimizer=Newton())


def test_a_full_rank_dp_sgd_step_without_noise_is_the_gradient_of_the_local_objective():
    """DP optimisation with a full-rank ``q`` moves ``(loc, log diag L, L below the diagonal)``: with every row
    in the batch (rate 1), a clip no gradient reaches and zero noise, the private step's gradient is the
    gradient of ``-L_m / n_m`` (``objectives.local_elbo``) by autodiff, to float32 rounding (the gradients are
    read from the pair release: aligned gradients); its noise has the pair release's ``2 P D`` coordinates."""
    data = correlated_data()
    clients = split(data)
    fit = dppvi.DPPVI(linear, method="dp_optimisation", family="full_rank", batch_size=5, rounds=1, num_samples=4,
                      privacy=dppvi.Privacy(noise_multiplier=1.0, clip=1e6, adaptive_clip=None))
    state = fit.init(jax.random.key(0), clients)
    dim = data[0].shape[1]
    assert fit.plan.dimension == objectives.pair_release_dimension(dim, fit.num_samples)
    q = factors.Gaussian(jnp.asarray(np.arange(dim) * 0.1, jnp.float32),
                         jnp.asarray(-0.5 * (4.0 * np.eye(dim) + 0.5), jnp.float32))
    params = factors.to_params(q)
    np.testing.assert_allclose(factors.from_params(params).eta2, q.eta2, rtol=1e-5, atol=1e-5)
    cavity = factors.Gaussian(jnp.zeros(dim), -0.5 * jnp.eye(dim))
    arrays, mask, n = tuple(a[0] for a in fit.data), fit.mask[0], fit.sizes[0]
    cs = dict(jax.tree.map(lambda a: a[0], state.client_state), rate=jnp.float32(1.0), noise_std=jnp.float32(0.0))
    key = jax.random.key(3)
    grads, _, _ = fit.rule.private_step(params, key, arrays, mask, n, cavity, cs)
    eps = objectives.standard_draws(jax.random.split(key, 4)[1], fit.num_samples, dim, fit.rule.antithetic)
    expected = jax.grad(lambda p: -objectives.local_elbo(fit.adapter.log_lik_rows, p, eps, arrays, mask, n, cavity))(
        params)
    for name in ("loc", "log_diag", "offdiag"):
        np.testing.assert_allclose(grads[name], expected[name], rtol=2e-4, atol=2e-4)


def test_private_global_vi_with_full_rank_q_recovers_the_correlated_posterior():
    """DP-SGD on the pooled data (noise multiplier 1e-3: the mechanism runs, its noise is negligible) with a
    full-rank ``q``: sds 0.8-1.25 of the exact posterior's and the mean within 0.25 sd, where mean-field's sds
    are at most 0.42 of them (the conditional sds; ``test_full_rank.py``). Adam at a constant step on
    minibatch gradients (50 of 100 rows) ends in a stationary spread around the optimum: over seeds 0-2 the
    sd ratios were 0.89-1.17 and the mean error at most 0.11 sd, so the bounds leave about 2x that spread."""
    data = correlated_data()
    exact_mean, exact_cov = linear_exact(data)
    result = dppvi.fit_global_vi(linear, split(data), family="full_rank", steps=4000, optimizer=optax.adam(5e-3),
                                 batch_size=50, rng_key=jax.random.key(0),
                                 privacy=dppvi.Privacy(noise_multiplier=1e-3, clip=1e3, accountant="rdp"))
    mean, cov = q_moments(result)
    exact_sd = np.sqrt(np.diag(exact_cov))
    ratios = np.sqrt(np.diag(cov)) / exact_sd
    assert np.all((ratios > 0.8) & (ratios < 1.25)), ratios
    assert np.max(np.abs(mean - exact_mean) / exact_sd) < 0.25
    assert result.family == "full_rank" and result.privacy.epsilon > 0


@pytest.mark.filterwarnings("ignore::numpyro_dppvi.diagnostics.NoiseWarning")
@pytest.mark.parametrize("method", ["virtual_clients", "dp_optimisation"])
def test_a_private_full_rank_fit_resumes_with_its_ledger(tmp_path, method):
    """Checkpoint after 2 rounds and resume to 4: the same ``q`` (every entry of the precision matrix) and the
    same ledger as 4 uninterrupted rounds; the virtual factors ``[shards, D, D]`` are in the private state."""
    clients = split(correlated_data())
    settings = dict(method=method, family="full_rank", privacy=dppvi.Privacy(epsilon=4.0, delta=1e-5, clip=2.0))
    settings.update(dict(shards=3) if method == "virtual_clients" else dict(batch_size=10))
    whole = dppvi.DPPVI(linear, rounds=4, **settings).run(jax.random.key(5), clients, 4)
    path = tmp_path / "fit.ckpt"
    dppvi.DPPVI(linear, rounds=4, **settings).run(jax.random.key(5), clients, 2, checkpoint=path)  # planned 4, stopped
    resumed = dppvi.DPPVI(linear, rounds=4, **settings).resume(path, clients, 4)
    np.testing.assert_array_equal(np.asarray(resumed.q.eta2), np.asarray(whole.q.eta2))
    np.testing.assert_array_equal(np.asarray(resumed.q.eta1), np.asarray(whole.q.eta1))
    assert resumed.privacy == whole.privacy and resumed.family == "full_rank"
