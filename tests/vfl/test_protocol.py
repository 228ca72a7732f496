"""The SFVI protocol: message decomposition, message discipline and bookkeeping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from numpyro_dppvi.vfl import VFLClient, fit_vfl
from numpyro_dppvi.vfl.guides import DiagonalGaussian
from numpyro_dppvi.vfl.parties import ServerParty, make_client_party
from numpyro_dppvi.vfl.protocol import Channel, joint_elbo_estimate, make_step
from numpyro_dppvi.vfl.sites import trace_layout, tree_size

from .vfl_problems import gaussian_likelihood, linear_submodel, logistic_likelihood, make_split


def _parties(clients, y, likelihood, formulation, guide, rho=0.7):
    n = clients[0].num_rows
    key = jax.random.key(0)
    layout = trace_layout(likelihood, (jnp.zeros(n), jnp.asarray(y)), key, what="likelihood")
    server = ServerParty(likelihood, layout, DiagonalGaussian(layout, 0.1), jnp.asarray(y), n)
    parties = [
        make_client_party(c, position=j, formulation=formulation, guide=guide, rho=rho, y=y,
                          likelihood=likelihood, server_layout=layout, num_clients=len(clients),
                          rng_key=key, hidden=8, init_scale=0.1, stl=True)
        for j, c in enumerate(clients)
    ]
    return parties, server


@pytest.mark.parametrize("formulation", ["augmented", "power"])
@pytest.mark.parametrize("guide", ["mean_field", "amortised"])
def test_message_gradients_equal_joint_gradient(gaussian_data, formulation, guide):
    """The gradients the parties assemble from messages (eq. 11-13, 15-17) equal the gradient of
    the same ELBO estimate computed centrally, for the same random draws (exact identity; the
    tolerance is float32 round-off)."""
    x, y = gaussian_data
    clients = make_split(x, [1, 3])
    parties, server = _parties(clients, y, gaussian_likelihood, formulation, guide)
    lr = 1e-3
    init, step, draws = make_step(parties, server, optax.sgd(lr), formulation=formulation,
                                  num_samples=2, batch_size=40, num_rows=x.shape[0])
    run = jax.jit(lambda s, k: step(s, k, Channel()))
    state = init(jax.random.key(1))
    # move away from the initialisation first
    for k in jax.random.split(jax.random.key(2), 3):
        state, _ = run(state, k)
    key = jax.random.key(3)
    new_state, elbo = run(state, key)
    params = {"clients": state["clients"], "server": state["server"]}
    value, grads = jax.jit(jax.value_and_grad(
        lambda p: joint_elbo_estimate(parties, server, p, key, formulation=formulation, draws=draws)
    ))(params)
    np.testing.assert_allclose(elbo, value, rtol=1e-5)
    # plain SGD moves every parameter by lr * gradient; float32 round-off of the difference of
    # O(1) parameters is ~1e-7, i.e. ~1e-4 in gradient units
    moved = jax.tree_util.tree_map(
        lambda a, b: (a - b) / lr,
        {"clients": new_state["clients"], "server": new_state["server"]}, params,
    )
    for got, want in zip(jax.tree_util.tree_leaves(moved), jax.tree_util.tree_leaves(grads)):
        scale = float(jnp.max(jnp.abs(want))) + 1.0
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-3 * scale)


def _guarded_split(x, y, sizes):
    """Clients whose sub-model checks at run time that every row it receives is one of its
    own rows (so another client's columns, or ``y``, would raise)."""
    edges = np.cumsum([0, *sizes])
    seen = []

    def guarded(own):
        own_rows = {tuple(r) for r in np.asarray(own, np.float32).round(5)}

        def check(value):
            value = np.asarray(value)
            if value.ndim != 2 or value.shape[1] != own.shape[1]:
                raise AssertionError(f"sub-model received an array of shape {value.shape}")
            for r in value.round(5):
                if tuple(r) not in own_rows:
                    raise AssertionError("sub-model received a row that is not its own")
            seen.append(value.shape)

        def submodel(xj):
            jax.debug.callback(check, xj)
            return linear_submodel(xj)

        return submodel

    return [VFLClient(f"c{j}", x[:, a:b], guarded(x[:, a:b]))
            for j, (a, b) in enumerate(zip(edges[:-1], edges[1:]))], seen


@pytest.mark.parametrize("guide", ["mean_field", "amortised"])
def test_clients_only_see_their_own_columns(logistic_data, guide):
    x, y = logistic_data
    clients, seen = _guarded_split(x, y, [1, 3])
    result = fit_vfl(clients, y, logistic_likelihood, formulation="augmented", guide=guide,
                     rho=1.0, steps=5, batch_size=30, rng_key=jax.random.key(0))
    jax.effects_barrier()
    # the sub-model ran on the client's full columns at set-up and on 30-row batches in the fit
    assert any(s[0] == 30 for s in seen)
    # with y private to the server, no message to a client carries y or other clients' data:
    # Algorithm 1 with mini-batches, per iteration and client: row index, z_j, dL_0/dz_j
    h = result.communication
    to_clients = [m for m in h["messages_per_iteration"] if m["receiver"] != "server"]
    assert {m["kind"] for m in to_clients} == {"row_index", "dL0/dz"}
    assert h["num_messages"] == 3 * 2 * 5
    assert all(m["size"] == 30 for m in h["messages_per_iteration"])
    assert h["num_scalars"] == 5 * 6 * 30


def test_guard_catches_foreign_columns(logistic_data):
    """The guard itself fails when a client is handed another client's columns."""
    x, y = logistic_data
    clients, _ = _guarded_split(x, y, [2, 2])
    swapped = [VFLClient("c0", clients[1].x, clients[0].submodel), clients[1]]
    with pytest.raises(Exception, match="not its own"):
        fit_vfl(swapped, y, logistic_likelihood, steps=2, rng_key=jax.random.key(0))
        jax.effects_barrier()


def test_power_message_counts_and_sizes(logistic_data):
    """Algorithm 2 per iteration and client: row index, z_j, (z_all, gamma) broadcast,
    (dz_others, dgamma) reply, summed gradient."""
    formulation, per_iteration = "power", 3 + 3 + 2 * 3 + 2 * 3 + 3
    x, y = logistic_data
    clients = make_split(x, [1, 2, 1])
    steps, batch, samples = 4, 25, 2
    result = fit_vfl(clients, y, logistic_likelihood, formulation=formulation, rho=1.0,
                     steps=steps, batch_size=batch, num_samples=samples, rng_key=jax.random.key(0))
    h = result.communication
    assert h["num_messages"] == per_iteration * steps
    sizes = {(m["sender"], m["receiver"], m["kind"]): m["size"]
             for m in h["messages_per_iteration"]}
    assert sizes[("c1", "server", "z")] == samples * batch
    assert sizes[("server", "c1", "row_index")] == batch
    assert sizes[("server", "c0", "z_all")] == samples * 3 * batch
    assert sizes[("c2", "server", "dL0j/dz_others")] == samples * 2 * batch
    assert sizes[("c0", "server", "dL0j/dgamma")] == samples * 1  # the intercept b
    assert sizes[("server", "c1", "sum_k dL0k/dz_j")] == samples * batch
    assert h["num_scalars"] == steps * sum(m["size"] for m in h["messages_per_iteration"])
    assert len(result.elbo) == steps and np.all(np.isfinite(result.elbo))


def test_amortized_parameter_count_does_not_grow_with_rows():
    rng = np.random.default_rng(0)
    counts = {}
    for n in (500, 5000):
        x = rng.normal(size=(n, 4)).astype(np.float32)
        y = (rng.uniform(size=n) < 0.5).astype(np.float32)
        for guide in ("amortised", "mean_field"):
            parties, server = _parties(make_split(x, [2, 2]), y, logistic_likelihood,
                                       "augmented", guide)
            counts[guide, n] = sum(tree_size(p.init(jax.random.key(0))) for p in parties)
    assert counts["amortised", 500] == counts["amortised", 5000]
    assert counts["mean_field", 5000] - counts["mean_field", 500] == 2 * 2 * 4500


def test_bad_inputs_raise_clear_errors(logistic_data):
    x, y = logistic_data
    clients = make_split(x, [2, 2])
    with pytest.raises(ValueError, match="formulation"):
        fit_vfl(clients, y, logistic_likelihood, formulation="vertical")
    with pytest.raises(ValueError, match="guide"):
        fit_vfl(clients, y, logistic_likelihood, guide="full_rank")
    with pytest.raises(ValueError, match="rho"):
        fit_vfl(clients, y, logistic_likelihood, rho=0.0)
    with pytest.raises(ValueError, match="batch_size"):
        fit_vfl(clients, y, logistic_likelihood, batch_size=10_000)
    with pytest.raises(ValueError, match="same rows"):
        fit_vfl([clients[0], VFLClient("c9", x[:10], linear_submodel)], y, logistic_likelihood)
    with pytest.raises(ValueError, match="leading axis"):
        fit_vfl(clients, y[:5], logistic_likelihood)
    with pytest.raises(ValueError, match="NaN"):
        VFLClient("bad", np.full((3, 2), np.nan), linear_submodel)
    with pytest.raises(ValueError, match="unique"):
        fit_vfl([clients[0], clients[0]], y, logistic_likelihood)
    with pytest.raises(ValueError, match="shape"):
        fit_vfl([VFLClient("c0", x, lambda xx: linear_submodel(xx)[:, None])], y,
                logistic_likelihood, steps=1)
    with pytest.raises(ValueError, match="deterministic"):
        fit_vfl(clients, y, logistic_likelihood, formulation="split", steps=1)
