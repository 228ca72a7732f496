"""The NumPyro model adapter.

``@dppvi.model`` marks an ordinary NumPyro model whose data are passed positionally as arrays with
the individual on the leading axis. :class:`ModelAdapter` traces it once and classifies its sites:

* global latent sites (outside the privacy plate) are inferred; they live on the unconstrained
  space ``u = T^{-1}(theta)`` with ``T = biject_to(site.support)``, flattened in trace order into
  one vector of static layout;
* observed sites inside the privacy plate form the likelihood;
* latent sites inside the privacy plate and discrete latent sites are rejected with a clear error.

The per-example log-likelihood ``log p(x_i | theta)`` is the model run on a batch of one row with
the latent values substituted, summing the log-probabilities of observed sites only (no Jacobian),
``vmap``-ed over rows.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.distributions.transforms import biject_to

from .program_cache import jit, to_device
from .factors import Gaussian

_MARK = "_dppvi_privacy_plate"


def model(fn: Callable | None = None, *, privacy_plate: str | None = None):
    """Mark a NumPyro model for ``numpyro_dppvi``.

    Usable as ``@dppvi.model`` or ``@dppvi.model(privacy_plate="data")``. The model is returned
    unchanged apart from the recorded plate name.

    Args:
      fn: the model function; left out, ``model(privacy_plate=...)`` returns the decorator.
      privacy_plate: the name of the plate whose rows are the protected individuals. None (the default):
        the plate whose size follows the number of rows passed in (an error when none or several do).
    """

    def mark(f):
        if not callable(f):
            raise TypeError("@dppvi.model decorates a NumPyro model function")
        setattr(f, _MARK, privacy_plate)
        if not hasattr(f, "_dppvi_marked"):
            setattr(f, "_dppvi_marked", True)
        return f

    return mark(fn) if fn is not None else mark


@dataclass(frozen=True)
class Site:
    """Static layout of one global latent site."""

    name: str
    shape: tuple  # constrained shape
    unconstrained_shape: tuple
    offset: int
    size: int
    transform: Any
    gaussian_prior: bool  # exact N(loc, scale) prior on a real support


def _frames(site) -> list[str]:
    return [f.name for f in site["cond_indep_stack"]]


def _is_constant_normal(fn) -> bool:
    base = fn
    while isinstance(base, (dist.Independent, dist.ExpandedDistribution)):
        base = base.base_dist
    return type(base) is dist.Normal


def _normal_loc_scale(fn, shape) -> tuple[np.ndarray, np.ndarray]:
    """The Normal's loc and scale broadcast to ``shape``, on the host (in JAX's default dtype)."""
    base = fn
    while isinstance(base, (dist.Independent, dist.ExpandedDistribution)):
        base = base.base_dist
    host = lambda v: np.broadcast_to(np.asarray(jnp.asarray(v)), shape)  # a transfer, not a program
    return host(base.loc), host(base.scale)


def _as_arrays(data: Sequence) -> tuple:
    if isinstance(data, (np.ndarray, jax.Array)):
        data = (data,)
    if not isinstance(data, (tuple, list)) or len(data) == 0:
        raise TypeError("data must be a tuple of arrays, e.g. (x, y), with the individual on axis 0")
    arrays = tuple(to_device(a) for a in data)
    if any(a.ndim == 0 for a in arrays):
        raise ValueError("every data array needs a leading axis over individuals; got a scalar")
    n = {int(a.shape[0]) for a in arrays}
    if len(n) != 1:
        raise ValueError(
            f"data arrays disagree on their leading (individual) dimension: {[a.shape for a in arrays]}; "
            "pass arrays with one row per individual in each"
        )
    return arrays


#: Site entries a compiled trace keeps: the static ones, and the arrays ``fn`` and ``value``.
_STATIC_SITE_FIELDS = ("name", "type", "is_observed", "args", "cond_indep_stack")


def reference_values(seed: int) -> Callable:
    """A ``substitute_fn`` (``numpyro.handlers.substitute``) that gives every continuous latent site a value
    drawn on the host: ``T(z)``, ``z ~ N(0, I)`` of the site's unconstrained shape from NumPy's generator seeded
    by ``seed`` and the site's name, ``T = biject_to(support)``. A trace needs values only for their shapes and
    to find priors whose parameters depend on other latents (two traces of different seeds give them different
    parameters, as two prior draws would); values from the host leave the traced program without a random-number
    generator, the larger part of compiling it in a new process (Adult's logistic regression: 0.2 s against
    0.85 s). Observed and discrete sites, and supports without a bijection, are left to the model (sampled under
    the ``seed`` handler)."""
    def value(msg):
        if msg["type"] != "sample" or msg.get("is_observed") or msg["fn"].support.is_discrete:
            return None
        try:
            transform = biject_to(msg["fn"].support)
        except NotImplementedError:
            return None
        shape = transform.inverse_shape(msg["fn"].shape(msg["kwargs"].get("sample_shape", ())))
        rng = np.random.default_rng([seed, zlib.crc32(msg["name"].encode())])
        return transform(jnp.asarray(rng.normal(size=shape)))
    return value


def _trace(model_fn: Callable, arrays: Sequence, seed: int) -> dict:
    """The model's trace on ``arrays``, its latent sites at :func:`reference_values` of ``seed``."""
    substituted = handlers.substitute(model_fn, substitute_fn=reference_values(seed))
    return handlers.trace(handlers.seed(substituted, seed)).get_trace(*arrays)


def compiled_traces(model_fn: Callable, runs: Sequence[tuple[Sequence, int]]) -> list[dict]:
    """The model's traces (sample and plate sites) on each ``(arrays, seed)`` of ``runs``, computed by
    one compiled program.

    The same traces as :func:`_trace` run eagerly (latent sites at :func:`reference_values`), where every operation is a small program of its own (dozens, each compiled, or read
    from the persistent cache in a new process: about 0.5 s for a logistic regression). Here the
    model runs under one ``jit``: static entries (names, plates and their sizes, observed flags)
    are recorded while tracing, and each sample site's distribution (a pytree) and value are the
    program's outputs, concrete arrays as in the eager trace. Raises whatever tracing raises (e.g.
    Python control flow on data values); the caller then traces eagerly.
    """
    static: list[dict] = [{} for _ in runs]

    def model_traces(all_arrays):
        outputs = []
        for record, arrays, (_, seed) in zip(static, all_arrays, runs):
            tr = _trace(model_fn, arrays, seed)
            kept = {k: v for k, v in tr.items() if v["type"] in ("sample", "plate")}
            record.update({k: {f: v.get(f) for f in _STATIC_SITE_FIELDS} for k, v in kept.items()})
            outputs.append({k: (v["fn"], v["value"]) for k, v in kept.items() if v["type"] == "sample"})
        return outputs

    concrete = jit(model_traces)([tuple(arrays) for arrays, _ in runs])
    traces = []
    for record, arrays_out in zip(static, concrete):
        trace = {name: dict(site) for name, site in record.items()}
        for name, (fn, value) in arrays_out.items():
            trace[name]["fn"], trace[name]["value"] = fn, value
        traces.append(trace)
    return traces


def programs_persist() -> bool:
    """Whether compiled programs outlive the process (JAX's persistent compilation cache is on,
    e.g. by :func:`numpyro_dppvi.enable_compilation_cache`).

    Then the model is traced by :func:`compiled_traces`: a new process compiles (or reads from disk) one
    program instead of compiling dozens of one-operation programs (0.12 s instead of 0.5-0.6 s for the
    Adult logistic regression, new processes with an empty cache). Without a persistent cache the eager
    trace is cheaper after the first model: its small programs are shared by every model of the process
    (0.004 s for a second model, against about 0.1 s to compile a new traces program).
    """
    return bool(jax.config.jax_compilation_cache_dir)


class ModelAdapter:
    """Traces a ``@dppvi.model`` once on example data and exposes the pieces PVI needs.

    Any number of rows ``>= 1`` traces the model (rows are repeated up to three: only shapes matter).

    Args:
      model_fn: the NumPyro model, taking the data arrays positionally (``@dppvi.model`` optional; it names
        the privacy plate when the model has several plates that follow the number of rows).
      example_data: a tuple of the model's data arrays, one row per leading index (one client's data, or
        zeros of the same shapes and dtypes).

    Attributes:
      sites: the layout of the global latent sites on the flat unconstrained vector ``u``.
      dim: the length of ``u``.
      plate: the name of the privacy plate.
      observed: the names of the observed sites.
      prior: natural parameters of the exact Gaussian part of the prior; zero on coordinates of
        non-Gaussian priors.
      server_mask: the coordinates on which the server-held prior factor ``t_0`` acts: those of non-Gaussian
        priors and those of exact-Normal sites that are parents of non-Gaussian ones.
    """

    def __init__(self, model_fn: Callable, example_data: Sequence):
        if not callable(model_fn):
            raise TypeError("model must be a NumPyro model function")
        self.model = model_fn
        arrays = _as_arrays(example_data)
        n = int(arrays[0].shape[0])
        if n < 1:
            raise ValueError("need at least one row of example data to trace the model, got 0")
        self.num_data_args = len(arrays)
        requested = getattr(model_fn, _MARK, None)
        # Two traces, on 2 and on 3 rows, find the plate that follows the number of rows. With fewer
        # than 3 rows in total the rows are repeated: only the shapes matter to the structure.
        # rows gathered on the host (no device program), handed to the model as jax arrays as NumPyro does
        rows = lambda k: [to_device(np.take(np.asarray(a), np.arange(k) % n, axis=0)) for a in arrays]
        tr2, tr3 = self._traces([(rows(2), 0), (rows(3), 1)])
        self.plate = self._find_privacy_plate(tr2, tr3, requested)
        self.example_row = tuple(np.asarray(a)[:1].copy() for a in arrays)  # host copies, canonical dtypes
        self._classify(tr2, tr3)

    @classmethod
    def for_shapes(cls, model_fn: Callable, row_shapes, dtypes) -> "ModelAdapter":
        """An adapter traced on zeros shaped like the data (``row_shapes`` without the leading axis):
        for a saved result, which stores no data rows."""
        example = tuple(np.zeros((3, *shape), dtype) for shape, dtype in zip(row_shapes, dtypes))
        return cls(model_fn, example)

    # -- tracing -------------------------------------------------------------------------------
    def _traces(self, runs):
        """Traces on each ``(arrays, seed)``: compiled (:func:`compiled_traces`) when programs outlive
        the process (:func:`programs_persist`), else eagerly."""
        if programs_persist():
            try:
                return compiled_traces(self.model, runs)
            except Exception:  # noqa: BLE001 - e.g. Python control flow on data values: trace eagerly
                pass
        try:
            return [_trace(self.model, arrays, seed) for arrays, seed in runs]
        except Exception as exc:  # the user's model failed: say where
            raise ValueError(f"running the model on example data failed: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _find_privacy_plate(tr2, tr3, requested):
        plates2 = {k: v["args"][0] for k, v in tr2.items() if v["type"] == "plate"}
        plates3 = {k: v["args"][0] for k, v in tr3.items() if v["type"] == "plate"}
        if requested is not None:
            if requested not in plates2:
                raise ValueError(f"privacy plate {requested!r} not found in the model; its plates: {sorted(plates2)}")
            return requested
        tracking = [k for k in plates2 if plates2[k] == 2 and plates3.get(k) == 3]
        if not tracking:
            raise ValueError(
                "no privacy plate found: wrap the likelihood in `with numpyro.plate(name, x.shape[0])` "
                "whose size is the number of rows (one row = one protected individual)"
            )
        if len(tracking) > 1:
            raise ValueError(
                f"several plates follow the number of rows: {tracking}; name the privacy plate with "
                "@dppvi.model(privacy_plate=...)"
            )
        return tracking[0]

    def _classify(self, tr2, tr3):
        sites, observed, offset = [], [], 0
        prior_eta1, prior_eta2, server = [], [], []
        self.bernoulli_observed = True
        for name, site in tr2.items():
            if site["type"] != "sample":
                continue
            in_plate = self.plate in _frames(site)
            if site["is_observed"]:
                if not in_plate:
                    raise ValueError(
                        f"observed site {name!r} is outside the privacy plate {self.plate!r}; every "
                        "observation must belong to one individual (put it inside the plate)"
                    )
                observed.append(name)
                base = site["fn"]
                while isinstance(base, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
                    base = base.base_dist
                if not isinstance(base, (dist.BernoulliLogits, dist.BernoulliProbs)):
                    self.bernoulli_observed = False
                continue
            if in_plate:
                raise ValueError(
                    f"latent site {name!r} is inside the privacy plate {self.plate!r}: per-individual "
                    "latent variables are not supported by fit_dppvi; use fit_vips (conjugate models) "
                    "or fit_vfl, or integrate the variable out of the likelihood"
                )
            fn = site["fn"]
            if fn.support.is_discrete:
                raise ValueError(
                    f"latent site {name!r} is discrete; PVI infers continuous latents only: "
                    "marginalise it out or make it observed"
                )
            value = site["value"]
            shape = tuple(jnp.shape(value))
            transform = biject_to(fn.support)
            ushape = tuple(transform.inverse_shape(shape))
            size = int(np.prod(ushape, dtype=int))
            other = tr3[name]["fn"]
            gaussian = (
                _is_constant_normal(fn)
                and _is_constant_normal(other)
                and all(np.allclose(a, b) for a, b in zip(_normal_loc_scale(fn, shape), _normal_loc_scale(other, shape)))
            )
            # the prior's natural parameters on the host: a handful of numbers, no device programs
            if gaussian:
                loc, sc = _normal_loc_scale(fn, shape)
                prec = sc.dtype.type(1.0) / np.square(sc)
                prior_eta1.append(np.reshape(loc * prec, -1))
                prior_eta2.append(np.reshape(prec.dtype.type(-0.5) * prec, -1))
                server.append(np.zeros(size, bool))
            else:
                prior_eta1.append(np.zeros(size, np.float32))
                prior_eta2.append(np.zeros(size, np.float32))
                server.append(np.ones(size, bool))
            sites.append(Site(name, shape, ushape, offset, size, transform, bool(gaussian)))
            offset += size
        if not observed:
            raise ValueError(
                "the model has no observed site: pass the data to `numpyro.sample(..., obs=...)` "
                "inside the privacy plate"
            )
        if not sites:
            raise ValueError("the model has no latent site to infer")
        self.sites = tuple(sites)
        self.observed = tuple(observed)
        self.dim = offset
        self.prior = Gaussian(to_device(np.concatenate(prior_eta1), np.float32),
                              to_device(np.concatenate(prior_eta2), np.float32))
        server_mask = np.concatenate(server)
        self.has_server_factor = bool(np.any(server_mask))
        if self.has_server_factor:
            server_mask = server_mask | self._server_density_support()
        self.server_mask = to_device(server_mask)

    def _server_density_support(self) -> np.ndarray:
        """Coordinates on which :meth:`server_log_density` depends, ``[D]`` bool.

        Beyond the non-Gaussian sites themselves, a site with an exact Normal prior can be the parent
        of one (``mu ~ Normal(0, 5)``, ``a ~ Normal(mu, sigma)``): ``log p(a | mu)`` then carries
        information about ``mu`` that only the server factor can hold, so ``mu``'s coordinates join
        the server's mask (its Normal prior stays exact in :attr:`prior`; ``t_0`` adds the rest).
        Found from the gradient at three fixed random points: an exactly zero partial derivative at
        all of them means no dependence (a non-finite one counts as dependence).
        """
        rng = np.random.default_rng(0)
        grad = jit(jax.grad(self.server_log_density))
        support = np.zeros(self.dim, bool)
        for _ in range(3):
            g = np.asarray(grad(jnp.asarray(0.5 * rng.normal(size=self.dim), jnp.float32)))
            support |= ~(g == 0.0)
        return support

    # -- layout --------------------------------------------------------------------------------
    @property
    def site_sizes(self) -> tuple[int, ...]:
        """Sizes of the sites' blocks of the flat unconstrained vector, in layout order."""
        return tuple(s.size for s in self.sites)

    def sites_of(self, coordinates) -> list[str]:
        """Names of the sites holding any of ``coordinates`` (a ``[D]`` bool mask or indices), in layout order."""
        coordinates = np.asarray(coordinates)
        index = np.flatnonzero(coordinates) if coordinates.dtype == bool else coordinates.astype(int)
        return [s.name for s in self.sites if np.any((index >= s.offset) & (index < s.offset + s.size))]

    def unflatten(self, u: jax.Array) -> dict:
        """Flat unconstrained vector -> dict of unconstrained site arrays."""
        return {s.name: jnp.reshape(u[s.offset : s.offset + s.size], s.unconstrained_shape) for s in self.sites}

    def constrain(self, u: jax.Array) -> dict:
        """Flat unconstrained vector ``u`` -> dict of constrained values ``T(u)`` per site."""
        parts = self.unflatten(u)
        return {s.name: s.transform(parts[s.name]) for s in self.sites}

    def unconstrain(self, values: dict) -> jax.Array:
        return jnp.concatenate([jnp.reshape(s.transform.inv(values[s.name]), -1) for s in self.sites])

    def log_abs_det_jacobian(self, u: jax.Array) -> jax.Array:
        parts = self.unflatten(u)
        total = 0.0
        for s in self.sites:
            x = s.transform(parts[s.name])
            total = total + jnp.sum(s.transform.log_abs_det_jacobian(parts[s.name], x))
        return total

    # -- densities -----------------------------------------------------------------------------
    def _run(self, values: dict, arrays):
        # seed outside substitute: a substituted site has its value when seed sees it, so no key is split for it
        return handlers.trace(handlers.seed(handlers.substitute(self.model, data=values), 0)).get_trace(*arrays)

    def log_lik_row(self, u: jax.Array, row: tuple) -> jax.Array:
        """``log p(x_i | theta = T(u))`` for one row (arrays without the leading axis)."""
        return self.log_lik_row_blocks([u[s.offset : s.offset + s.size] for s in self.sites], row)

    def log_lik_row_blocks(self, blocks, row: tuple) -> jax.Array:
        """:meth:`log_lik_row` of ``u`` given as its list of site blocks (``site_sizes``)."""
        values = {s.name: s.transform(jnp.reshape(b, s.unconstrained_shape)) for s, b in zip(self.sites, blocks)}
        tr = self._run(values, tuple(jnp.expand_dims(a, 0) for a in row))
        return sum(jnp.sum(tr[name]["fn"].log_prob(tr[name]["value"])) for name in self.observed)

    def log_lik_rows(self, u: jax.Array, arrays: tuple) -> jax.Array:
        """Per-example log-likelihood, ``[n]``, by ``vmap`` over rows."""
        return jax.vmap(self.log_lik_row, in_axes=(None, 0))(u, tuple(arrays))

    def server_log_density(self, u: jax.Array) -> jax.Array:
        """``log p(T(u)) + log|J(u)|`` of the sites whose prior the server factor ``t_0`` holds."""
        if not self.has_server_factor:
            return jnp.zeros(())
        parts = self.unflatten(u)
        values = {s.name: s.transform(parts[s.name]) for s in self.sites}
        tr = self._run(values, tuple(jnp.asarray(a) for a in self.example_row))  # jax arrays, as NumPyro passes
        total = 0.0
        for s in self.sites:
            if s.gaussian_prior:
                continue
            total = total + jnp.sum(tr[s.name]["fn"].log_prob(values[s.name]))
            total = total + jnp.sum(s.transform.log_abs_det_jacobian(parts[s.name], values[s.name]))
        return total

    def validate_data(self, arrays: Sequence, what: str = "data", finite: bool = True) -> tuple:
        arrays = _as_arrays(arrays)
        if len(arrays) != self.num_data_args:
            raise ValueError(
                f"{what} has {len(arrays)} array(s) but the model was traced with {self.num_data_args}"
            )
        for a, ref in zip(arrays, self.example_row):
            if a.shape[1:] != ref.shape[1:]:
                raise ValueError(f"{what}: row shape {a.shape[1:]} differs from the model's {ref.shape[1:]}")
            if finite and jnp.issubdtype(a.dtype, jnp.inexact) and not np.all(np.isfinite(np.asarray(a))):
                raise ValueError(f"{what} contains NaN or inf: remove or impute those rows first")
        return arrays
