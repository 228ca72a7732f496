"""numpyro_dppvi.plots: each client's epsilon over the rounds recomputed from the public ledger and history, and
the plots drawn from it (issue 26)."""

import jax
import numpy as np
import pytest

import numpyro_dppvi as dppvi
from numpyro_dppvi import plots
from numpyro_dppvi.example_models import logistic_regression
from numpyro_dppvi.privacy import Privacy

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def clients():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 3)).astype(np.float32)
    y = (rng.uniform(size=300) < 1 / (1 + np.exp(-x @ np.array([1.0, -1.0, 0.5])))).astype(np.float32)
    # sizes 60, 100, 140: three sampling rates, three epsilons
    return [(x[:60], y[:60]), (x[60:160], y[60:160]), (x[160:], y[160:])]


def private_fit(epsilon=1.0, **options):
    settings = dict(method="dp_optimisation", schedule="synchronous", rounds=4, local_steps=3, batch_size=10,
                    num_samples=2, privacy=Privacy(epsilon=epsilon, delta=1e-5, clip=1.0, public_sizes=[60, 100, 140]),
                    rng_key=jax.random.key(0), track_epsilon=True)
    settings.update(options)
    return dppvi.fit_dppvi(logistic_regression, clients(), **settings)


@pytest.mark.parametrize("options", [
    {},
    {"schedule": "asynchronous"},
    {"client_rate": 0.5},  # client sampling without a client-level unit: some clients sit rounds out
    {"method": "pvi", "privacy_unit": "client", "client_rate": 0.5, "batch_size": 20,
     "privacy": Privacy(epsilon=1.0, delta=1e-5, clip=1.0, sampling="poisson")},
], ids=["synchronous", "asynchronous", "client_sampling", "client_level"])
def test_epsilon_per_round_is_the_ledgers_epsilon_after_each_round(options):
    """The last row is the ledger's epsilon per client, bit for bit; every row's largest value is the epsilon the
    fit recorded after that round (``track_epsilon=True``, computed by the ledger as the rounds ran): the
    reconstruction from the public history charges each round what the fit charged."""
    result = private_fit(**options)
    eps = plots.epsilon_per_round(result)
    assert eps.shape == (result.rounds, 3)
    np.testing.assert_array_equal(eps[-1], result.privacy.epsilon_per_client)
    np.testing.assert_array_equal(eps.max(axis=1), [entry["epsilon"] for entry in result.history])
    assert np.all(np.diff(eps, axis=0) >= 0)


def test_plots_draw_what_the_results_hold():
    low, high = private_fit(1.0, eval_data=clients()[2]), private_fit(4.0, eval_data=clients()[2])
    ax = plots.plot_epsilon(low)
    lines = ax.get_lines()
    assert len(lines) == 4  # three clients and the budget
    np.testing.assert_array_equal(lines[0].get_ydata(), plots.epsilon_per_round(low)[:, 0])
    assert lines[-1].get_ydata()[0] == 1.0
    ax = plots.plot_convergence([low, high], labels=["eps 1", "eps 4"])
    np.testing.assert_array_equal(ax.get_lines()[1].get_ydata(), [e["change"] for e in high.history])
    ax = plots.plot_privacy_utility([high, low], metric="accuracy")
    (line,) = ax.get_lines()
    np.testing.assert_array_equal(line.get_xdata(), [low.privacy.epsilon, high.privacy.epsilon])
    np.testing.assert_array_equal(line.get_ydata(), [low.history[-1]["accuracy"], high.history[-1]["accuracy"]])
    plt.close("all")


def test_what_cannot_be_plotted_says_why():
    public = dppvi.fit_dppvi(logistic_regression, clients(), rounds=3, rng_key=jax.random.key(0))
    with pytest.raises(ValueError, match="non-private"):
        plots.epsilon_per_round(public)
    with pytest.raises(ValueError, match="not private"):
        plots.plot_privacy_utility([public])
    with pytest.raises(ValueError, match="eval_data"):
        plots.plot_privacy_utility([private_fit()])
    plt.close("all")


class Posterior:
    """A stand-in result whose posterior of ``w`` is N(mean, sd^2) (any object with ``sample`` is plotted)."""

    def __init__(self, mean, sd):
        self.mean, self.sd = np.asarray(mean), sd

    def sample(self, num_samples, rng_key=None):
        noise = jax.random.normal(rng_key, (num_samples,) + self.mean.shape)
        return {"w": self.mean + self.sd * np.asarray(noise)}


def test_interval_coverage_is_the_level_for_calibrated_posteriors_and_falls_for_narrow_ones():
    """Truths drawn from N(mean, 1) for 300 posteriors N(mean, 1) of 3 coordinates: the central intervals cover
    their level (se over fits ~ sqrt(a (1 - a) / 3 / 300) <= 0.017; 0.06 allowed, and the reported se agrees with
    it within a factor of 2); posteriors with half the sd cover 2 Phi(z_a / 2) - 1 (0.589 at 90%), which the
    check must tell apart."""
    from scipy import stats

    rng = np.random.default_rng(0)
    means = rng.normal(size=(300, 3))
    truths = [{"w": m + rng.normal(size=3)} for m in means]
    levels = np.array([0.5, 0.9])
    key = jax.random.key(1)
    coverage, se = plots.interval_coverage([Posterior(m, 1.0) for m in means], truths, levels, 4000, key)
    np.testing.assert_allclose(coverage, levels, atol=0.06)
    expected_se = np.sqrt(levels * (1 - levels) / 900)
    assert np.all((se > expected_se / 2) & (se < expected_se * 2)), se
    narrow, _ = plots.interval_coverage([Posterior(m, 0.5) for m in means], truths, levels, 4000, key)
    np.testing.assert_allclose(narrow, 2 * stats.norm.cdf(stats.norm.ppf((1 + levels) / 2) / 2) - 1, atol=0.06)
    ax = plots.plot_calibration([Posterior(m, 1.0) for m in means[:20]], truths[:20], levels, rng_key=key)
    line = ax.get_lines()[1]
    np.testing.assert_allclose(line.get_ydata(), plots.interval_coverage(
        [Posterior(m, 1.0) for m in means[:20]], truths[:20], levels, rng_key=key)[0])
    with pytest.raises(ValueError, match="one truth per result"):
        plots.interval_coverage([Posterior(means[0], 1.0)], truths[:2])
    with pytest.raises(ValueError, match="no site 'b'"):
        plots.interval_coverage([Posterior(means[0], 1.0)], [{"b": 0.0}], rng_key=key)
    plt.close("all")


def test_plot_calibration_reads_a_private_fit():
    """A real result: the sites of the model and the number of levels drawn."""
    result = private_fit(4.0)
    ax = plots.plot_calibration([result], [{"w": np.array([1.0, -1.0, 0.5])}], levels=[0.5, 0.9],
                                rng_key=jax.random.key(0))
    assert len(ax.get_lines()[1].get_ydata()) == 2
    plt.close("all")


def test_clients_whose_epsilon_curves_coincide_share_one_line(monkeypatch):
    """Five equal clients draw one visible line: one legend entry, "clients 0-4", not five."""
    curves = np.repeat(np.array([[0.5], [0.8], [1.0]]), 5, axis=1)
    curves[:, 3] += 0.1  # client 3 differs
    monkeypatch.setattr(plots, "epsilon_per_round", lambda result: curves)

    class Fake:
        config = {"privacy": {"epsilon": 1.0}}
        privacy = type("Ledger", (), {"delta": 1e-5})()

    ax = plots.plot_epsilon(Fake())
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["clients 0, 1, 2, 4", "client 3", "budget 1"]
    assert plots._clients_label([0, 1, 2, 3, 4]) == "clients 0-4"
    plt.close("all")
