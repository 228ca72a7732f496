"""Speed of one jitted DP-SGD local step against the same non-private step, and noise calibration time.

Adult (108 features + bias), logistic regression, 10 balanced clients, 10 MC draws of ``q``. For batch
sizes 100 and 1000, the gradient of one local step of client 0 is timed (second call, median of
``repeats``) for

* ``dp``: ``DPPVI(method="dp_optimisation").rule.private_step`` after ``init``: Poisson batch padded to the
  plan's ``max_batch`` with a mask, per-example gradients (``objectives.per_example_log_lik_grads``: per
  site block, the sums over draws fused), joint clipping as one weighted sum, noise;
* ``non_private``: ``NonPrivate.gradient`` with the same batch size (uniform batch, one batched gradient).

Both in the same run, their calls alternating (``time_interleaved``) so that drift in the machine's
speed hits both alike. Examples per second = batch size / median seconds (the DP step's padded rows are
work it really does, so they are not counted as examples). Target (issue 3): the DP step at least half as
fast as the non-private one. Also: seconds to calibrate sigma for the paper's settings
(``Privacy.resolve`` through the DP optimisation plan, and ``calibrate_noise`` for the update-perturbation
plan of 10 and 200 clients), each timed once from a cold start (no caching across settings).
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import optax  # noqa: E402
from _common import time_interleaved, write  # noqa: E402

import numpyro_dppvi as dppvi  # noqa: E402
from numpyro_dppvi.cli import logistic_model  # noqa: E402
from numpyro_dppvi.privacy import GaussianEvent, Privacy, calibrate_noise  # noqa: E402
from numpyro_dppvi.privacy.calibration import clear_memo  # noqa: E402
from numpyro_dppvi.pvi.local import NonPrivate  # noqa: E402
from numpyro_dppvi.pvi.privacy_plan import dp_sgd_plan  # noqa: E402

TARGET_RATIO = 0.5


def step_speed(model, clients, batch_size: int, repeats: int) -> dict:
    """Examples per second of one DP-SGD gradient and of the non-private gradient at ``batch_size``."""
    privacy = Privacy(epsilon=1.0, delta=1e-5, clip=2.0)
    driver = dppvi.DPPVI(model, method="dp_optimisation", schedule="sequential", optimizer=optax.adam(1e-2),
                         local_steps=20, batch_size=batch_size, num_samples=10, damping=0.5, privacy=privacy,
                         rounds=5)
    state = driver.init(jax.random.key(0), clients)
    rows = tuple(a[0] for a in driver.data)
    mask, n = driver.mask[0], driver.sizes[0]
    client_state = jax.tree.map(lambda a: a[0], state.client_state)
    params = dppvi.factors.to_loc_log_scale(state.q)
    cavity = state.q  # all factors start at zero
    plain = NonPrivate(driver.adapter.log_lik_rows, driver.adapter.dim, driver.optimizer, driver.local_steps,
                       batch_size, driver.num_samples)
    dp_grad = jax.jit(lambda *a: driver.rule.private_step(*a)[0])
    plain_grad = jax.jit(plain.gradient)
    key = jax.random.key(1)
    timed = time_interleaved({"dp": lambda: dp_grad(params, key, rows, mask, n, cavity, client_state),
                              "non_private": lambda: plain_grad(params, key, rows, mask, n, cavity, ())[0]}, repeats)
    dp, non_private = timed["dp"], timed["non_private"]
    dp["examples_per_s"] = batch_size / dp["median_s"]
    non_private["examples_per_s"] = batch_size / non_private["median_s"]
    ratio = dp["examples_per_s"] / non_private["examples_per_s"]
    return {"chunk": int(driver.plan.chunk), "noise_multiplier": float(driver.plan.noise_multipliers[0]),
            "dp": dp, "non_private": non_private, "dp_over_non_private": ratio,
            "meets_target": bool(ratio >= TARGET_RATIO)}


def calibration_times(sizes) -> dict:
    """Seconds to calibrate sigma at epsilon 1 / 0.5, delta 1e-5 for the paper's Adult settings."""
    out = {}
    settings = {
        "dp_optimisation_10_clients_eps1_batch100_5x20_steps": (1.0, 100, 5, 20),
        "dp_optimisation_10_clients_eps1_batch100_20x10_steps": (1.0, 100, 20, 10),
    }
    for name, (epsilon, batch, rounds, steps) in settings.items():
        clear_memo()  # a cold start: nothing solved or evaluated before
        start = time.perf_counter()
        plan = dp_sgd_plan(Privacy(epsilon=epsilon, delta=1e-5, clip=2.0), sizes, batch, steps, rounds, 218)
        out[name] = {"seconds": time.perf_counter() - start, "noise_multiplier": float(plan.noise_multipliers[0])}
    for name, (epsilon, rounds) in {"update_perturbation_eps1_10_rounds": (1.0, 10),
                                    "update_perturbation_eps0.5_20_rounds": (0.5, 20)}.items():
        clear_memo()
        start = time.perf_counter()
        # one Gaussian release per round, sampling rate 1, event noise multiplier relative to 2C
        sigma = calibrate_noise(epsilon, 1e-5, [GaussianEvent(1.0, "none", 1.0, rounds)])
        out[name] = {"seconds": time.perf_counter() - start, "event_noise_multiplier": float(sigma)}
    return out


def main(repeats: int = 41):
    x, y, _, _ = dppvi.datasets.load_adult(split="train_test")
    clients = dppvi.partition((x, y), num_clients=10, seed=0)
    model = logistic_model()
    results = {f"batch_{b}": step_speed(model, clients, b, repeats) for b in (100, 1000)}
    results["calibration"] = calibration_times([len(c[0]) for c in clients])
    write("dp_step", {"setting": "Adult, logistic regression, client 0 of 10 balanced clients (3907 rows), clip 2, "
                                 "epsilon 1, delta 1e-5, Poisson sampling, 10 MC draws; one local-step gradient",
                      "target": f"dp examples/s >= {TARGET_RATIO} x non-private", "repeats": repeats, **results})


if __name__ == "__main__":
    main()
