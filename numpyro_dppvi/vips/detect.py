"""Conjugacy detection: map a NumPyro model onto a VIPS :class:`ConjugateModel`.

The model is traced once (``handlers.trace(handlers.seed(model))``) with the data. Sites are
split into global latent sites (outside the privacy plate) and one observed site inside the
privacy plate (the plate named by ``@dppvi.model(privacy_plate=...)``, else the plate whose
size is the number of rows). Supported patterns:

=========================================  ==================================================
latent prior(s)                            observed site
=========================================  ==================================================
Normal (any number of sites)               ``Normal(loc, scale)``: ``loc`` affine in the
                                           latents, ``scale`` known (not a latent)
Normal (any number of sites)               ``Bernoulli(logits=...)``: logits linear in the
                                           latents (no constant offset)
one scalar ``Beta``                        ``Bernoulli(probs=p)`` / ``Binomial(n, probs=p)``
one ``Dirichlet``                          ``Categorical(probs=p)``
one scalar ``Gamma``                       ``Poisson(rate=lam)``
=========================================  ==================================================

Linearity is checked numerically: the design matrix is the Jacobian of ``loc`` (or the
logits) with respect to the flattened latents, and the map must reproduce the model at a
second, random point of the latent space. For the Normal pattern each row is divided by its
known scale and the offset is subtracted (``x_i / s_i``, ``(y_i - c_i) / s_i``, unit noise),
which is the exact same likelihood. Anything else raises a ``ValueError`` that names the site
and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import handlers
from numpyro.distributions.distribution import ExpandedDistribution, Independent, MaskedDistribution

from numpyro_dppvi.vips.conjugate_pairs import BetaBernoulli, DirichletCategorical, GammaPoisson
from numpyro_dppvi.vips.linear import BayesianLinearRegression
from numpyro_dppvi.vips.logistic import PolyaGammaLogisticRegression

_PRIVACY_PLATE_MARK = "_dppvi_privacy_plate"
_SUPPORTED = ("Normal prior(s) + Normal likelihood with known scale and a mean linear in them; "
              "Normal prior(s) + Bernoulli(logits linear in them); Beta + Bernoulli/Binomial; "
              "Dirichlet + Categorical; Gamma + Poisson")


@dataclass
class Detection:
    """Result of :func:`detect_conjugate`.

    Attributes:
        pattern: ``"normal_linear"``, ``"logistic"``, ``"beta_bernoulli"`` (also Binomial),
            ``"dirichlet_categorical"`` or ``"gamma_poisson"``.
        model: the :class:`ConjugateModel` to fit.
        data: the data in that model's layout (e.g. ``(design, targets)``).
        site_map: maps the conjugate model's posterior draws to ``{latent site: draws}``.
        latent_sites: global latent site names, in layout order.
        observed_site: name of the likelihood site.
    """

    pattern: str
    model: object
    data: tuple
    site_map: Callable
    latent_sites: tuple
    observed_site: str


@dataclass(frozen=True)
class SiteLayout:
    """Maps a conjugate model's posterior draws to the NumPyro sites (picklable, no closures).

    ``source`` is the key of the conjugate model's draws: ``"w"`` holds the flattened latents
    of the Gaussian patterns (split by ``shapes``); otherwise the one site takes ``source``.
    """

    names: tuple
    shapes: tuple
    source: str

    def __call__(self, samples: dict) -> dict:
        values = np.asarray(samples[self.source])
        if self.source != "w":
            return {self.names[0]: values}
        out, start = {}, 0
        for name, shape in zip(self.names, self.shapes):
            size = int(np.prod(shape))
            out[name] = values[..., start:start + size].reshape(values.shape[:-1] + tuple(shape))
            start += size
        return out


def _base(fn):
    while isinstance(fn, (Independent, ExpandedDistribution, MaskedDistribution)):
        fn = fn.base_dist
    return fn


def _family(fn) -> str:
    return type(_base(fn)).__name__


def _in_plate(site, plate_name) -> bool:
    return any(frame.name == plate_name for frame in site["cond_indep_stack"])


def _privacy_plate(model, trace, n: int) -> str:
    requested = getattr(model, _PRIVACY_PLATE_MARK, None)
    plates = {name: site for name, site in trace.items() if site["type"] == "plate"}
    if requested is not None:
        if requested not in plates:
            raise ValueError(f"privacy plate {requested!r} was requested but the model has plates "
                             f"{sorted(plates)}.")
        return requested
    matching = [name for name, site in plates.items() if site["args"][0] == n]
    if len(matching) != 1:
        raise ValueError(
            f"cannot tell which plate holds the individuals: plates of size {n} (the number of rows) "
            f"are {matching}; mark it with @dppvi.model(privacy_plate=...).")
    return matching[0]


def _trace(model, data, substitutions=None, seed=0):
    seeded = handlers.seed(model, rng_seed=seed)
    if substitutions:
        seeded = handlers.substitute(seeded, data=substitutions)
    return handlers.trace(seeded).get_trace(*data)


def detect_conjugate(model, *data, feature_bound=None, target_bound=None, count_bound=None) -> Detection:
    """Trace ``model(*data)`` and return the matching conjugate model (see module docstring).

    ``feature_bound`` / ``target_bound`` (Normal and logistic patterns) and ``count_bound``
    (Gamma-Poisson) are the public per-record bounds the private release needs; they are
    passed to the model class and may stay ``None`` for a non-private fit.

    Args:
      model: a NumPyro model (``@dppvi.model`` optional) with one observed site inside the privacy plate
        and global, continuous latent sites.
      *data: the model's positional arguments, observations included, as ``model(*data)`` is called.
      feature_bound: the public bound on ``|x_i|`` (Normal and logistic patterns). Default None.
      target_bound: the public bound on ``|y_i|`` (Normal patterns). Default None.
      count_bound: the public bound to which counts are truncated (Gamma-Poisson). Default None.

    Returns:
      a :class:`~numpyro_dppvi.vips.Detection`: the conjugate model, the data in its layout, and how its
      parameters map to the model's sites.
    """
    if not data:
        raise ValueError("pass the model's data (its positional arguments, observations included).")
    n = int(np.shape(data[0])[0])
    try:
        trace = _trace(model, data)
    except Exception as err:  # noqa: BLE001 - re-raised with context
        raise ValueError(f"could not run the model on the data to inspect it: {err}") from err
    plate = _privacy_plate(model, trace, n)

    latent, observed = [], []
    for name, site in trace.items():
        if site["type"] != "sample":
            continue
        inside = _in_plate(site, plate)
        if site["is_observed"]:
            if not inside:
                raise ValueError(f"site {name!r} is observed outside the privacy plate {plate!r}; "
                                 "observations must have one row per individual inside it.")
            observed.append(name)
        else:
            if inside:
                raise ValueError(
                    f"site {name!r} is a latent variable inside the privacy plate {plate!r} (a local "
                    "latent); fit_vips detection handles global parameters only. Write the model as a "
                    "ConjugateModel (e.g. vips.LDA, vips.SigmoidBeliefNet) instead.")
            if site["fn"].support.is_discrete:
                raise ValueError(f"site {name!r} is a discrete latent variable; no conjugate VB update "
                                 "is implemented for it.")
            latent.append(name)
    if len(observed) != 1:
        raise ValueError(f"fit_vips detection needs exactly one observed site inside the privacy plate, "
                         f"found {observed}.")
    if not latent:
        raise ValueError("the model has no latent site to infer.")
    obs = observed[0]
    obs_site = trace[obs]
    obs_family = _family(obs_site["fn"])
    bounds = dict(feature_bound=feature_bound, target_bound=target_bound, count_bound=count_bound)

    if obs_family == "Normal":
        return _detect_gaussian(model, data, trace, latent, obs, n, "normal_linear", bounds)
    if obs_family == "BernoulliLogits":
        return _detect_gaussian(model, data, trace, latent, obs, n, "logistic", bounds)
    if obs_family in ("BernoulliProbs", "BinomialProbs"):
        return _detect_single(model, data, trace, latent, obs, "Beta", "probs", bounds)
    if obs_family == "CategoricalProbs":
        return _detect_single(model, data, trace, latent, obs, "Dirichlet", "probs", bounds)
    if obs_family == "Poisson":
        return _detect_single(model, data, trace, latent, obs, "Gamma", "rate", bounds)
    if obs_family in ("BinomialLogits", "CategoricalLogits"):
        raise ValueError(f"site {obs!r}: {obs_family} is not conjugate; for a Beta/Dirichlet prior pass "
                         "probs=p, for a linear predictor use Bernoulli(logits=...).")
    raise ValueError(f"site {obs!r}: likelihood {obs_family} has no supported conjugate pattern "
                     f"(supported: {_SUPPORTED}).")


# --------------------------------------------------------------------------- Gaussian priors

def _detect_gaussian(model, data, trace, latent, obs, n, pattern, bounds):
    like = "Normal" if pattern == "normal_linear" else "Bernoulli(logits)"
    shapes, means, precisions = [], [], []
    for name in latent:
        prior = _base(trace[name]["fn"])
        if type(prior).__name__ != "Normal":
            raise ValueError(f"site {name!r}: prior {type(prior).__name__} is not conjugate to the {like} "
                             f"likelihood of site {obs!r} (it needs Normal priors on the parameters of its "
                             "linear predictor; a scale or other parameter must be a known constant).")
        shape = tuple(np.shape(trace[name]["value"]))
        shapes.append(shape)
        means.append(np.broadcast_to(np.asarray(prior.loc, dtype=float), shape).ravel())
        precisions.append(np.broadcast_to(1.0 / np.asarray(prior.scale, dtype=float) ** 2, shape).ravel())
    sizes = [int(np.prod(s)) for s in shapes]
    offsets = np.cumsum([0] + sizes)
    dim = int(offsets[-1])

    def unflatten(theta):
        return {name: jnp.reshape(theta[..., offsets[i]:offsets[i + 1]], theta.shape[:-1] + shapes[i])
                for i, name in enumerate(latent)}

    def obs_base(theta):
        return _base(_trace(model, data, unflatten(theta))[obs]["fn"])

    def predictor(theta):
        fn = obs_base(theta)
        value = fn.loc if pattern == "normal_linear" else fn.logits
        return jnp.broadcast_to(value, jnp.shape(trace[obs]["value"]))

    obs_value = np.asarray(trace[obs]["value"])
    if obs_value.shape != (n,):
        raise ValueError(f"site {obs!r} has shape {obs_value.shape}; detection needs one scalar observation "
                         f"per individual (shape ({n},)).")
    # Two points of the latent space: the traced prior draw and a second prior draw.
    alt_trace = _trace(model, data, seed=1)
    theta_a = jnp.concatenate([jnp.ravel(jnp.asarray(trace[k]["value"], dtype=float)) for k in latent])
    theta_b = jnp.concatenate([jnp.ravel(jnp.asarray(alt_trace[k]["value"], dtype=float)) for k in latent])
    try:
        # Full-precision matmuls (no TF32 / bf16 passes on accelerators), so that the rounding error of the
        # predictor is bounded by the float eps of its dtype, as `_offset_tolerance` assumes.
        with jax.default_matmul_precision("highest"):
            design_raw = jax.jacfwd(predictor)(theta_a)
            at_a_raw = predictor(theta_a)
            at_b = np.asarray(predictor(theta_b), dtype=float)
        design, at_a = np.asarray(design_raw, dtype=float), np.asarray(at_a_raw, dtype=float)
    except Exception as err:  # noqa: BLE001 - re-raised with the site named
        raise ValueError(f"site {obs!r}: could not differentiate the {like} parameters with respect to the "
                         f"latent sites {latent}: {err}") from err
    offset = at_a - design @ np.asarray(theta_a, dtype=float)
    linear_b = offset + design @ np.asarray(theta_b, dtype=float)
    if not np.allclose(at_b, linear_b, rtol=1e-3, atol=1e-3 * (1.0 + np.abs(at_b).max())):
        what = "mean" if pattern == "normal_linear" else "logits"
        raise ValueError(f"site {obs!r}: the {like} {what} is not linear in the latent sites {latent} "
                         "(e.g. a product of latents or a nonlinear link); no conjugate update exists.")
    prior_mean, prior_precision = np.concatenate(means), np.concatenate(precisions)

    if pattern == "normal_linear":
        scale_a = np.broadcast_to(np.asarray(obs_base(theta_a).scale, dtype=float), (n,))
        scale_b = np.broadcast_to(np.asarray(obs_base(theta_b).scale, dtype=float), (n,))
        if not np.allclose(scale_a, scale_b):
            raise ValueError(f"site {obs!r}: the Normal scale depends on a latent site; VIPS needs a known "
                             "scale (use vips.NormalGammaLinearRegression for an unknown noise precision).")
        features = design / scale_a[:, None]
        targets = (obs_value - offset) / scale_a
        conj = BayesianLinearRegression(dim, noise_scale=1.0, prior_mean=prior_mean,
                                        prior_precision=prior_precision,
                                        feature_bound=bounds["feature_bound"], target_bound=bounds["target_bound"])
    else:
        tolerance = _offset_tolerance(design, np.asarray(theta_a, dtype=float), jnp.result_type(at_a_raw))
        if np.any(np.abs(offset) > tolerance):
            raise ValueError(f"site {obs!r}: the logits have a constant part not multiplied by a latent site "
                             "(an offset); put it behind a Normal latent (e.g. an intercept) instead.")
        features, targets = design, obs_value
        conj = PolyaGammaLogisticRegression(dim, prior_mean=prior_mean, prior_precision=prior_precision,
                                            feature_bound=bounds["feature_bound"])

    site_map = SiteLayout(tuple(latent), tuple(shapes), "w")
    dtype = jnp.result_type(float)
    return Detection(pattern, conj, (jnp.asarray(features, dtype), jnp.asarray(targets, dtype)), site_map,
                     tuple(latent), obs)


def _offset_tolerance(design, theta, dtype) -> np.ndarray:
    """Per-row bound on the rounding error of a linear predictor ``design @ theta`` computed in ``dtype``.

    Without an offset, ``predictor(theta) - design @ theta`` is only the rounding error of the
    model's own arithmetic (e.g. ``x @ w`` in float32), which grows with the number and size of the
    terms summed. A fixed ``atol`` cannot tell the two apart: on UCI Adult (108 features, float32)
    rounding alone reaches ~6e-6 and a design of 200 features of scale up to 1e2 reaches ~2e-4.
    For a sum of ``d`` products, in any order, ``|fl(x . w) - x . w| <= gamma_d sum_j |x_j| |w_j|``
    with ``gamma_d ~ d eps / 2`` (Higham, Accuracy and Stability of Numerical Algorithms, §3.1).
    We allow twice that, ``d eps sum_j |x_ij| |w_j|`` row by row, for the rounding of the Jacobian
    and of a few more operations in the model. It is a worst case: the errors measured are about
    ``eps sum_j |x_ij| |w_j|``. A real offset is still caught when it exceeds the bound: ~1e-4 for
    a typical Adult row, ~1e-7 for logits of magnitude 1 over a few features, ~1e-13 in float64.
    """
    num_terms = max(design.shape[-1], 1)
    magnitude = np.abs(design) @ np.abs(theta)
    return num_terms * float(jnp.finfo(dtype).eps) * magnitude


# --------------------------------------------------------------------------- one conjugate site

_LIKELIHOOD_OF = {"Beta": "Bernoulli/Binomial", "Dirichlet": "Categorical", "Gamma": "Poisson"}


def _detect_single(model, data, trace, latent, obs, prior_family, parameter, bounds):
    like = type(_base(trace[obs]["fn"])).__name__
    if len(latent) != 1:
        raise ValueError(f"site {obs!r}: a {like} likelihood is conjugate to one {prior_family} site, "
                         f"but the model has latent sites {latent}.")
    name = latent[0]
    prior = _base(trace[name]["fn"])
    if type(prior).__name__ != prior_family:
        raise ValueError(f"site {name!r}: prior {type(prior).__name__} is not conjugate to the {like} "
                         f"likelihood of site {obs!r}, which needs a {prior_family} prior.")
    value = np.asarray(trace[name]["value"])
    if prior_family != "Dirichlet" and value.shape != ():
        raise ValueError(f"site {name!r} has shape {value.shape}; detection supports one scalar "
                         f"{prior_family} parameter shared by all individuals.")
    obs_value = np.asarray(trace[obs]["value"])
    n = obs_value.shape[0]
    if obs_value.shape != (n,):
        raise ValueError(f"site {obs!r} has shape {obs_value.shape}; detection needs one observation per "
                         f"individual (shape ({n},)).")

    # The likelihood parameter must be the latent value itself, for every individual.
    alt_trace = _trace(model, data, seed=1)
    for candidate in (value, np.asarray(alt_trace[name]["value"])):
        fn = _base(_trace(model, data, {name: jnp.asarray(candidate)})[obs]["fn"])
        got = np.asarray(getattr(fn, parameter))
        try:
            want = np.broadcast_to(candidate, got.shape)
        except ValueError:
            want = None
        if want is None or not np.allclose(got, want, rtol=1e-5):
            raise ValueError(f"site {obs!r}: the {like} {parameter} must be the {prior_family} site {name!r} "
                             "itself (no transformation or per-individual factor) for a conjugate update.")

    if prior_family == "Beta":
        total = np.asarray(getattr(_base(trace[obs]["fn"]), "total_count", 1))
        if total.size > 1 and not np.all(total == total.flat[0]):
            raise ValueError(f"site {obs!r}: Binomial total_count must be one constant for all individuals.")
        conj = BetaBernoulli(float(prior.concentration1), float(prior.concentration0),
                             total_count=int(np.ravel(total)[0]))
        key = "p"
    elif prior_family == "Dirichlet":
        conj = DirichletCategorical(np.asarray(prior.concentration, dtype=float))
        key = "p"
    else:
        options = {} if bounds["count_bound"] is None else {"count_bound": bounds["count_bound"]}
        conj = GammaPoisson(float(prior.concentration), float(prior.rate), **options)
        key = "lam"

    site_map = SiteLayout((name,), (tuple(value.shape),), key)
    return Detection(f"{prior_family.lower()}_{_LIKELIHOOD_OF[prior_family].split('/')[0].lower()}", conj,
                     (jnp.asarray(obs_value),), site_map, (name,), obs)
