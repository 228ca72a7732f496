"""``fit_vips``: (private) stochastic variational Bayes for conjugate-exponential models.

Algorithm 2 of the VIPS paper (Park et al. 2020), with one joint Gaussian release per
iteration::

    for t = 0, ..., T-1:
        draw a batch B_t (Poisson with rate q, or S records without replacement)
        E-step:   s_i = E_q(l_i)[s(D_i, l_i)] under the current n̄, for i in B_t
        clip:     s_i,b <- s_i,b min(1, C_b / |s_i,b|)              for every ESS block b
        release:  S̃_b = sum_i s_i,b + C_b sqrt(B) sigma N(0, I)       (one draw for all blocks)
        M-step:   ν̃_t = ν + (N / S) S̃        (S = expected batch size)               (Eq. 19)
        blend:    ν̃ <- (1 - rho_t) ν̃ + rho_t ν̃_t,  rho_t = (tau0 + t)^(-kappa)
        n̄ <- E_q(m)[n(m)]

Sensitivity of the release. After clipping, the rescaled blocks ``s_i,b / C_b`` of one
record form a vector of norm <= ``sqrt(B)`` (``B`` blocks). The released sum, divided
block-wise by ``C_b``, therefore changes by at most ``sqrt(B)`` when one record is added or
removed and by ``2 sqrt(B)`` when one is replaced (every other record's statistics are
computed from the same public ``n̄``, paper Eq. 22). The noise std in rescaled units is
``sigma sqrt(B)`` with ``sigma = Privacy.noise_multiplier`` (std / joint clip norm), so the
release is a subsampled Gaussian mechanism with noise multiplier ``sigma`` (add/remove) or
``sigma / 2`` (substitute) relative to its sensitivity; the ledger records ``T`` of them with
the sampler's rate. Symmetric matrix blocks get noise on the upper triangle (mirrored),
whose norm is at most the Frobenius norm, so the same bound covers them. Everything after
the release (projection to valid statistics, M-step, blending) is post-processing.

``privacy=None`` runs the same iterations without clipping and without noise.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_dppvi.diagnostics import NoiseWarning, user_stacklevel
from numpyro_dppvi.keys import resolve as resolve_key
from numpyro_dppvi.program_cache import jit
from numpyro_dppvi.privacy import Privacy
from numpyro_dppvi.vips.detect import detect_conjugate
from numpyro_dppvi.vips.engine import (
    blend, is_conjugate_model, joint_sensitivity, scale_bounds, scale_ess, step_size)
from numpyro_dppvi.privacy.sizes import public_client_sizes
from numpyro_dppvi.vips.release import noise_coordinates, plan_release, release_ess
from numpyro_dppvi.vips.results import VIPSResult


def _check_data(data) -> tuple:
    if not isinstance(data, (tuple, list)):
        data = (data,)
    for a in data:
        kind = np.asarray(a).dtype.kind
        if kind not in "biuf":
            raise TypeError(f"data arrays must have a numeric dtype (bool, int or float), got dtype "
                            f"{np.asarray(a).dtype}; convert or encode them first (e.g. a.astype(np.float32))")
    arrays = tuple(jnp.asarray(a) for a in data)
    if not arrays:
        raise ValueError("data is empty: pass a tuple of arrays whose leading axis is the individual.")
    n = arrays[0].shape[0] if arrays[0].ndim else 0
    for a in arrays:
        if a.ndim == 0 or a.shape[0] != n:
            raise ValueError("every data array needs the same leading dimension (one row per individual); "
                             f"got shapes {[tuple(x.shape) for x in arrays]}.")
        if jnp.issubdtype(a.dtype, jnp.floating) and not bool(jnp.all(jnp.isfinite(a))):
            raise ValueError("data contain NaN or inf: remove or impute those rows before fitting.")
    if n == 0:
        raise ValueError("data have no rows.")
    return arrays


def _check_schedule(batch_size, iterations, tau0, kappa, n):
    if isinstance(batch_size, bool) or int(batch_size) != batch_size or not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must be an integer in [1, {n}] (the number of rows), got {batch_size}.")
    if isinstance(iterations, bool) or int(iterations) != iterations or iterations < 1:
        raise ValueError(f"fit_vips: steps must be a positive integer, got {iterations}.")
    if not (float(tau0) >= 0 and math.isfinite(float(tau0))):
        raise ValueError(f"tau0 must be >= 0, got {tau0}.")
    if not 0.0 <= float(kappa) <= 1.0:
        raise ValueError(f"kappa must lie in [0, 1] (0.5 < kappa <= 1 for convergence; 0 with a full "
                         f"batch is plain VB), got {kappa}.")
    if float(tau0) == 0.0 and float(kappa) > 0.0:
        raise ValueError("tau0 = 0 with kappa > 0 makes the first step size infinite; use tau0 >= 1.")


def _non_private_batch(n: int, batch_size: int):
    """Fixed-size batches without replacement, drawn afresh each step (all rows if ``S = N``)."""
    if batch_size == n:
        def sample(key):
            del key
            return jnp.arange(n), jnp.ones(n, dtype=bool)
    else:
        def sample(key):
            idx = jax.random.choice(key, n, (batch_size,), replace=False)
            return idx, jnp.ones(batch_size, dtype=bool)
    return sample


def release_noise_variance(rho: np.ndarray, scale: float, noise_std_rescaled: float, bounds: dict) -> dict:
    """The variance, per coordinate of each ESS block, of the release noise left in the final natural parameters
    of :func:`fit_vips`. With ``nu_T = prod_t (1 - rho_t) nu_0 + sum_t w_t target_t``, ``w_t = rho_t prod_{s > t}
    (1 - rho_s)`` (the blending of Algorithm 1), and ``target_t`` holding ``scale (S_t + C_b e_t)`` with ``e_t`` of
    std ``noise_std_rescaled`` independent across steps, the noise in block ``b`` has variance ``(scale C_b
    noise_std_rescaled)^2 sum_t w_t^2``. Public: step sizes, the scale ``1 / rate``, bounds and the noise std."""
    rho = np.asarray(rho, np.float64)
    later = np.concatenate([np.cumprod((1.0 - rho)[::-1])[::-1][1:], [1.0]])  # prod_{s > t} (1 - rho_s)
    total = float(np.sum(np.square(rho * later)))
    return {name: (scale * float(bound) * noise_std_rescaled) ** 2 * total for name, bound in bounds.items()}


def noise_aware_posterior(model, params, variance: dict, caller: str):
    """``(params, draws)``: the model's noise-aware posterior (``model.noise_aware_params``) of ``params``, whose
    statistics carry release noise of per-block ``variance`` (public), and, for a Monte Carlo mixture, its effective
    number of importance draws (a :class:`~numpyro_dppvi.diagnostics.NoiseWarning` below 100: its tails are
    uncertain), else None. Post-processing of the released parameters with public values: no privacy cost."""
    params = model.noise_aware_params(params, variance)
    if "mixture" not in params:
        return params, None
    draws = float(1.0 / np.sum(np.square(np.asarray(params["mixture"]["weights"], np.float64))))
    if draws < 100:
        warnings.warn(f"{caller}: the noise-aware posterior rests on {draws:.0f} effective importance draws "
                      "(of a few thousand): its tails are uncertain. The release noise is large against the "
                      "data: raise epsilon or use more rows.", NoiseWarning, stacklevel=user_stacklevel())
    return params, draws


def deferred_validity(model, blended, private: bool):
    """Final parameters of a model whose statistics do not depend on q (``ess_uses_params = False``: linear
    regression). Every step's target is then ``m_step(prior, (N/S) S~_t)``, affine in the released statistic, and
    (``init_params`` being the prior) the blended parameters after ``T`` steps are ``m_step(prior, E_T)`` with ``E_T
    = sum_t w_t (N/S) S~_t``, ``w_t = rho_t prod_{s > t} (1 - rho_s)``: a linear combination of the releases, whose
    noise is unbiased and of known variance (:func:`release_noise_variance`). Projecting each noisy step onto the
    valid statistics (``postprocess_noisy_ess``, the paper's rule for models whose E-step needs a valid q) would bias
    ``E_T``: at epsilon 1 a batch's noisy second moment is mostly indefinite, and flooring its eigenvalues at zero
    adds a positive bias every step. So ``E_T`` is blended as released and projected once (``postprocess_noisy_ess``
    of ``E_T``: post-processing, no privacy cost). Returns ``(params, projected)``; ``projected`` says whether that
    projection changed ``E_T`` (the noise dominated the data: warned, and recorded in ``info["final_projection"]``);
    ``None`` for a non-private fit."""
    if not private:
        return model.m_step(model.prior_params(), blended), None
    valid = model.postprocess_noisy_ess(blended)
    projected = any(not np.allclose(np.asarray(a), np.asarray(b), rtol=1e-4,  # float32 round-off of the projection
                                    atol=1e-4 * float(np.max(np.abs(np.asarray(a)), initial=1.0)))
                    for a, b in zip(jax.tree_util.tree_leaves(blended), jax.tree_util.tree_leaves(valid)))
    if projected:
        warnings.warn(
            f"fit_vips: the released statistics of {type(model).__name__} were not valid at the end (e.g. a second "
            "moment with a negative eigenvalue): the release noise is as large as the data's signal, and they were "
            "projected onto the valid set (info['final_projection']). The posterior is unreliable: raise epsilon, "
            "use more rows or tighter public bounds.", NoiseWarning, stacklevel=3)
    return model.m_step(model.prior_params(), valid), projected


def fit_vips(model, data, *, privacy=None, batch_size: int | None = None, steps: int | None = None,
             iterations: int | None = None,
             tau0: float = 1.0, kappa: float | None = None, rng_key=None, detect_options: dict | None = None,
             noise_aware: bool | None = None):
    """Fit a conjugate-exponential model by (private) stochastic variational Bayes (VIPS).

    Args:
        model: a :class:`~numpyro_dppvi.vips.engine.ConjugateModel` (e.g.
            :class:`PolyaGammaLogisticRegression`, :class:`LDA`) or a NumPyro model
            (``@dppvi.model``) matching a supported conjugate pattern; the pattern is detected
            (:func:`numpyro_dppvi.vips.detect.detect_conjugate`) and a site that breaks
            conjugacy is named in the error.
        data: tuple of arrays, leading axis = individual (for a NumPyro model: its positional
            arguments, observations included, as ``model(*data)`` is called).
        privacy: :class:`numpyro_dppvi.Privacy` or ``None`` (no clipping, no noise). With a
            privacy config, ``clip`` multiplies every ESS block bound of the model (the
            paper's ``a`` for LDA), ``noise_multiplier`` is noise std / joint clip norm, and
            if only ``epsilon`` is given the noise is calibrated for ``steps`` releases
            at the sampler's rate. ``sampling`` chooses Poisson or fixed-size batches without
            replacement (the paper's setting, substitution relation).
        batch_size: expected batch size ``S`` (Poisson rate ``S/N``); default all rows.
        steps: number of VB steps ``T`` (default 100).
        iterations: the earlier name of ``steps``, still accepted (giving both with different values
            raises).
        tau0: the delay of the step size ``rho_t = (tau0 + t)^(-kappa)``, ``t = 0..T-1``. Default 1.
        kappa: the decay of that step size; ``kappa = 0`` with a full batch is batch VB. Default 0.7 (the
            paper's), and 1 for a model whose statistics do not depend on q (``ess_uses_params = False``: linear
            regression): with ``tau0 = 1`` every step then weighs ``1/T``, the running mean, which of all
            blendings of equally noisy releases leaves the least noise (``sum_t w_t^2 = 1/T``: 0.010 for 100
            steps against 0.022 at 0.7).
        rng_key: ``jax.random`` key (batches, noise, random initialisation). Leave it out for a
            private fit: the key is then drawn from the operating system and never saved; a key you
            pass must stay secret for the guarantee to hold (the ledger records which was used).
        detect_options: for a NumPyro model, the public per-record bounds passed to
            :func:`~numpyro_dppvi.vips.detect.detect_conjugate` (``feature_bound``,
            ``target_bound``, ``count_bound``); needed for a private fit of the Normal,
            logistic and Poisson patterns.
        noise_aware: None (default): for a private fit of a model that defines ``noise_aware_params`` (today
            :class:`BayesianLinearRegression`), ``params`` account for the noise the releases left in the fit
            (:func:`release_noise_variance`, the model's ``noise_aware_params``; post-processing of the released
            parameters with the public noise std and step sizes, no privacy cost), and ``params_fitted`` holds
            them as fitted. ``False``: ``params`` as fitted. ``True`` raises where it is not available.

    Returns:
        :class:`~numpyro_dppvi.vips.results.VIPSResult`.
    """
    numpyro_model, site_map, observed = None, None, None
    if noise_aware not in (None, True, False):
        raise TypeError(f"fit_vips: noise_aware must be None, True or False, got {noise_aware!r}")
    if not is_conjugate_model(model):
        if not callable(model):
            raise TypeError("model must be a ConjugateModel or a NumPyro model function.")
        detection = detect_conjugate(model, *_check_data(data), **(detect_options or {}))
        numpyro_model, site_map, observed = model, detection.site_map, detection.observed_site
        model, data = detection.model, detection.data
    data = model.validate_data(_check_data(data))
    n = int(data[0].shape[0])
    # the size every published setting is derived from: a declared public bound, else n (privacy.sizes)
    size = int(public_client_sizes(privacy, [n], "fit_vips")[0]) if isinstance(privacy, Privacy) else n
    batch_size = size if batch_size is None else batch_size
    if steps is not None and iterations is not None and steps != iterations:
        raise ValueError(f"fit_vips: give steps (or its earlier name iterations), not both: {steps} vs {iterations}")
    iterations = steps if steps is not None else (iterations if iterations is not None else 100)
    deferred = not getattr(model, "ess_uses_params", True)
    kappa = (1.0 if deferred else 0.7) if kappa is None else kappa
    _check_schedule(batch_size, iterations, tau0, kappa, size)
    iterations = int(iterations)
    key_data, seed = resolve_key(rng_key)
    key_init, key_steps = jax.random.split(jax.random.wrap_key_data(key_data))

    release = None
    if privacy is not None:
        if not isinstance(privacy, Privacy):
            raise TypeError("fit_vips: privacy must be a numpyro_dppvi.Privacy(...) or None.")
        bounds = scale_bounds(model.block_bounds, privacy.clip)
        shapes = jax.eval_shape(lambda: model.clipped_ess_sum(
            model.expected_natural_params(model.prior_params()), tuple(a[:1] for a in data), jnp.ones(1, bool),
            bounds)[0])
        release = plan_release(privacy, model.block_bounds, n=n, batch_size=int(batch_size), size=size,
                               iterations=iterations,
                               dimension=noise_coordinates(shapes, tuple(model.symmetric_blocks)))
        sampler, bounds = release.sampler, release.bounds
    else:
        sampler, bounds = _non_private_batch(n, int(batch_size)), None
    scale = size / float(batch_size)  # 1 / rate: the sum over the batch estimates the sum over the rows
    symmetric = tuple(model.symmetric_blocks)
    # statistics that do not depend on q are blended as released and projected once, at the end (deferred_validity)
    prior_enp = model.expected_natural_params(model.prior_params()) if deferred else None

    def one_step(arrays, carry, inputs):
        t, key = inputs
        key_batch, key_noise = jax.random.split(key)
        idx, mask = sampler(key_batch)
        batch = tuple(a[idx] for a in arrays)
        enp = prior_enp if deferred else model.expected_natural_params(carry)
        ess, _ = model.clipped_ess_sum(enp, batch, mask, bounds)  # the clip count is private: dropped
        if release is not None:
            ess = release_ess(ess, bounds, release.noise_std_rescaled, key_noise, symmetric)
            if not deferred:
                ess = model.postprocess_noisy_ess(ess)
        rho = step_size(t.astype(jnp.result_type(float)), tau0, kappa)
        if deferred:  # the carry is the blended statistic sum_t w_t (N / S) S~_t
            return blend(carry, scale_ess(ess, scale), rho), {"rho": rho}
        target = model.m_step(carry, scale_ess(ess, scale))
        new_params = model.refresh(blend(carry, target, rho))
        return new_params, {"rho": rho}  # the realised batch size would reveal the Poisson sample

    @jit
    def run(carry, keys, arrays):  # data are arguments, not constants folded into the program
        steps = (jnp.arange(iterations), keys)
        return jax.lax.scan(lambda c, inputs: one_step(arrays, c, inputs), carry, steps)

    keys = jax.random.split(key_steps, iterations)
    projected = None
    if deferred:
        zero = jax.tree_util.tree_map(jnp.zeros_like, jax.eval_shape(
            lambda: model.clipped_ess_sum(prior_enp, tuple(a[:1] for a in data), jnp.ones(1, bool), bounds)[0]))
        blended, trace = run(zero, keys, data)
        params, projected = deferred_validity(model, blended, release is not None)
    else:
        params, trace = run(model.init_params(key_init), keys, data)
    history = [{"step": t + 1, "rho": float(rho)} for t, rho in enumerate(np.asarray(trace["rho"]))]

    available = release is not None and hasattr(model, "noise_aware_params")
    if noise_aware and not available:
        raise ValueError(f"fit_vips: noise_aware=True needs a private fit of a model with noise_aware_params "
                         f"(BayesianLinearRegression); this is a {'private' if release is not None else 'non-private'} "
                         f"fit of a {type(model).__name__}: leave noise_aware out")
    fitted, variance = None, None
    if release is not None:
        variance = release_noise_variance(np.asarray(trace["rho"]), scale, release.noise_std_rescaled, release.bounds)
    draws = None
    if available and noise_aware is not False:
        fitted = params
        params, draws = noise_aware_posterior(model, params, variance, "fit_vips")

    ledger = None
    if release is not None:
        ledger = release.record(seed=seed)
    return VIPSResult(model=model, params=params, history=history, privacy=ledger, params_fitted=fitted,
                      noise_multiplier=None if release is None else release.noise_multiplier,
                      numpyro_model=numpyro_model, site_map=site_map,
                      info={"num_data": size, "batch_size": int(batch_size), "iterations": iterations,
                            "noise_aware": fitted is not None, "release_noise_variance": variance,
                            **({} if projected is None else {"final_projection": projected}),
                            **({} if draws is None else {"noise_aware_effective_draws": draws}),
                            "tau0": float(tau0), "kappa": float(kappa),
                            "joint_clip": None if bounds is None else joint_sensitivity(bounds),
                            **({"observed": observed} if observed else {})})
