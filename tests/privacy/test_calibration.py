import time

import pytest

from numpyro_dppvi.privacy import GaussianEvent, calibrate_noise, plan_epsilon


def _check_smallest(target, delta, plan, neighbouring, backend):
    start = time.perf_counter()
    sigma = calibrate_noise(target, delta, plan, neighbouring, backend)
    elapsed = time.perf_counter() - start
    assert plan_epsilon(plan, sigma, delta, neighbouring, backend) <= target
    # smallest within the 1e-3 tolerance, so 1% less noise must overspend
    assert plan_epsilon(plan, 0.99 * sigma, delta, neighbouring, backend) > target
    return sigma, elapsed


@pytest.mark.parametrize("target,q,steps", [(1.0, 0.01, 1000), (0.5, 0.1, 100)])
def test_pld_poisson_calibration_is_safe_and_smallest(target, q, steps):
    plan = [GaussianEvent(1.0, "poisson", q, steps)]
    _, elapsed = _check_smallest(target, 1e-5, plan, "add_remove", "pld")
    print(f"calibration eps={target} q={q} T={steps}: {elapsed:.2f} s")


@pytest.mark.parametrize("backend,sampling,neighbouring", [
    pytest.param("rdp", "without_replacement", "substitute", marks=pytest.mark.slow),
    ("autodp", "poisson", "add_remove"),
    ("pld", "poisson", "substitute"),
])
def test_other_backends_and_relations(backend, sampling, neighbouring):
    plan = [GaussianEvent(1.0, sampling, 0.02, 500)]
    _check_smallest(1.0, 1e-5, plan, neighbouring, backend)


def test_callable_multi_client_plan_meets_the_budget_for_every_client():
    rates = (0.01, 0.04, 0.02)

    def plan(sigma):
        return [[GaussianEvent(sigma, "poisson", q, 200), GaussianEvent(4 * sigma)] for q in rates]

    sigma, _ = _check_smallest(1.0, 1e-5, plan, "add_remove", "pld")
    for q in rates:
        alone = plan_epsilon(lambda s: [GaussianEvent(s, "poisson", q, 200),
                                        GaussianEvent(4 * s)], sigma, 1e-5, "add_remove", "pld")
        assert alone <= 1.0


def test_template_noise_multiplier_is_ignored():
    a = calibrate_noise(1.0, 1e-5, [GaussianEvent(0.3, "poisson", 0.05, 100)], backend="rdp")
    b = calibrate_noise(1.0, 1e-5, [GaussianEvent(7.0, "poisson", 0.05, 100)], backend="rdp")
    assert a == b


@pytest.mark.parametrize("epsilon,delta,match", [
    (0.0, 1e-5, "epsilon"), (-1.0, 1e-5, "epsilon"), (float("inf"), 1e-5, "epsilon"),
    (1.0, 0.0, "delta"), (1.0, 1.0, "delta"),
])
def test_bad_budget(epsilon, delta, match):
    with pytest.raises(ValueError, match=match):
        calibrate_noise(epsilon, delta, [GaussianEvent(1.0, "poisson", 0.01, 10)])


def test_impossible_and_meaningless_budgets():
    with pytest.raises(ValueError, match="above"):
        calibrate_noise(1e-4, 1e-5, [GaussianEvent(1.0, "none", 1.0, 10**6)], backend="rdp")
    with pytest.raises(ValueError, match="no meaningful protection"):
        calibrate_noise(1e4, 0.5, [GaussianEvent(1.0, "none", 1.0, 1)], backend="rdp")
    with pytest.raises(ValueError, match="no releases"):
        calibrate_noise(1.0, 1e-5, [])
    with pytest.raises(ValueError, match="rdp"):
        calibrate_noise(1.0, 1e-5, [GaussianEvent(1.0, "without_replacement", 0.1)],
                        "substitute", "pld")
    with pytest.raises(TypeError, match="plan"):
        calibrate_noise(1.0, 1e-5, [1.0])
