"""Time of one PVI round on Adult with 10 clients (logistic regression, batch 100, 10 local steps).

Measures (second call, median of 5): a synchronous round (clients ``vmap``-ed over padded data), a
sequential round (``lax.scan`` over clients), and the same synchronous work done by calling the
jitted single-client update once per client from Python; reports the speedup of ``vmap`` over that
loop, both measured in this run.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from _common import time_call, write  # noqa: E402

import numpyro_dppvi as dppvi  # noqa: E402
from numpyro_dppvi import factors  # noqa: E402
from numpyro_dppvi.cli import logistic_model  # noqa: E402


def main(repeats: int = 5):
    x, y, _, _ = dppvi.datasets.load_adult(split="train_test")
    clients = dppvi.partition((x, y), num_clients=10, seed=0)
    model = logistic_model()
    results = {}
    for schedule in ("synchronous", "sequential"):
        driver = dppvi.DPPVI(model, schedule=schedule, optimizer=optax.adam(1e-2), local_steps=10, batch_size=100,
                             num_samples=10, damping=0.5)
        state = driver.init(jax.random.key(0), clients)
        order = driver._order(state, driver.sizes)
        results[f"{schedule}_round"] = time_call(
            lambda: driver._round(state, driver.data, driver.mask, driver.sizes, order)[0].q, repeats)

    driver = dppvi.DPPVI(model, schedule="synchronous", optimizer=optax.adam(1e-2), local_steps=10, batch_size=100,
                         num_samples=10, damping=0.5)
    state = driver.init(jax.random.key(0), clients)
    update = jax.jit(driver.rule.update)
    cavity = factors.divide(state.q, jax.tree.map(lambda a: a[0], state.factors))

    def loop():
        out = []
        for m in range(driver.num_clients):
            rows = tuple(a[m] for a in driver.data)
            out.append(update(state.q, cavity, rows, driver.mask[m], driver.sizes[m], jax.random.key(m), ())[0].eta1)
        return jnp.stack(out)

    results["synchronous_python_loop_over_clients"] = time_call(loop, repeats)
    results["speedup_vmap_over_loop"] = (results["synchronous_python_loop_over_clients"]["median_s"]
                                         / results["synchronous_round"]["median_s"])
    write("pvi_rounds", {"setting": "Adult, 10 clients, logistic regression, batch 100, 10 local steps, 10 MC draws",
                         "repeats": repeats, **results})


if __name__ == "__main__":
    main()
