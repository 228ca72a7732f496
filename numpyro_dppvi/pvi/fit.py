"""``fit_dppvi``: the one-call form of :class:`~numpyro_dppvi.pvi.driver.DPPVI`.

Builds the driver from the options, fills in the method's defaults (:mod:`.defaults`), and runs (or
resumes, :mod:`.resume`) the fit. The result holds only what may be published.
"""

from __future__ import annotations

import dataclasses

import optax

from ..results import DPPVIResult
from .defaults import DEFAULT_ROUNDS, MAX_ROUNDS, METHOD_DEFAULTS
from .driver import DPPVI
from .fit_settings import FitSettings


def fit_dppvi(model, clients, *, method: str = "pvi", schedule: str | None = None, rounds: int | None = None,
              local_steps: int | None = None, batch_size: int | None = None, num_samples: int = 10,
              optimizer: optax.GradientTransformation | None = None, damping: float | None = None,
              rng_key=None, eval_data=None, callback=None, progress: bool = False,
              server_steps: int = 50, privacy=None, checkpoint=None, resume=None, hmac_key: bytes | None = None,
              track_epsilon: bool = False, settings: FitSettings | None = None, **options) -> DPPVIResult:
    """Fit a NumPyro model to federated ``clients`` with (DP-)PVI; the one-call form of :class:`DPPVI`.

    ``method="dp_optimisation"`` with ``privacy=Privacy(epsilon=..., delta=..., clip=...)`` calibrates
    the noise so that every client's releases over ``rounds`` rounds meet the budget; the result's
    ``privacy`` ledger reports what was spent. ``numpyro_dppvi.fit_dppvi`` also takes ``method="vips"``
    (federated VIPS for conjugate-exponential models, returning a ``VIPSResult``; its options are listed last).

    Args:
      model: a NumPyro model taking the data arrays positionally (``@dppvi.model`` optional); for
        ``method="vips"`` also a :class:`~numpyro_dppvi.vips.ConjugateModel`.
      clients: one tuple of arrays per client, e.g. ``[(x_1, y_1), (x_2, y_2)]``: the model's arguments with the
        observations, the same arrays (trailing shapes, dtypes) in every client
        (:func:`~numpyro_dppvi.validate_clients`).
      method: ``"pvi"`` (the default: non-private local steps), ``"dp_optimisation"`` (DP-SGD in the local
        step), ``"local_averaging"``, ``"virtual_clients"``, ``"parameter_perturbation"`` (privacy by perturbing
        model updates) or ``"vips"`` (see :class:`DPPVI`).
      schedule: ``"sequential"``, ``"synchronous"`` or ``"asynchronous"``. Default sequential for ``"pvi"`` and
        ``"dp_optimisation"``, synchronous otherwise (and always with a trusted aggregator or client-level DP).
      rounds: the number of rounds, to which a private fit's noise is calibrated. None (the default):
        ``method="pvi"`` without privacy runs until ``q`` has converged (checked from round
        :data:`~numpyro_dppvi.pvi.defaults.MIN_ROUNDS`, at most :data:`~numpyro_dppvi.pvi.defaults.MAX_ROUNDS`;
        ``result.rounds`` says how many ran); every other fit runs 10 rounds, but
        private virtual clients 20 when their family is full-rank (their default up to
        :data:`~numpyro_dppvi.pvi.defaults.NEWTON_MAX_DIM` latent dimensions, each client releasing its own
        update: :data:`~numpyro_dppvi.pvi.defaults.VIRTUAL_FULL_RANK_DEFAULTS`).
      local_steps: optimiser steps per client (per shard for update perturbation) per round. Default 20 for
        ``"pvi"`` and for DP optimisation's private Newton steps, 10 otherwise.
      batch_size: rows per local step (None: the client's whole data). Required by ``"dp_optimisation"``: the
        expected Poisson batch, whose sampling rate ``batch_size / n_m`` the accounting amplifies by (see
        :class:`DPPVI`).
      num_samples: Monte Carlo draws of ``q`` per local step, shared across the batch.
      optimizer: the local step: an optax ``GradientTransformation``, ``optim.Newton`` (full-rank and low-rank
        families) or ``optim.PrivateNewton`` (DP optimisation). None: the method's default (:class:`DPPVI`).
      damping: ``rho`` in ``t_m <- t_m + rho (q_new - q)``, in ``(0, 1]``. None: 1, but 0.5 for DP optimisation
        with an optax optimizer and 0.1 for virtual clients (0.25 with full-rank factors).
      rng_key: the fit's key. Leave it out for a private fit: the fit then draws its key from the operating
        system and the noise cannot be recomputed by anyone. A key you pass makes the fit reproducible, and
        the guarantee then rests on that key staying secret (the ledger records which kind of seed was used).
      eval_data: held-out rows, a tuple of the model's arrays with the observations (``(x_test, y_test)``); after
        every round the history records the mean log predictive density of ``q`` on them (``"log_lik"``, and
        ``"accuracy"`` for a Bernoulli likelihood). Default None.
      callback: ``callback(state, entry)``, called after every round with the private :class:`PVIState` and
        the round's public history entry. Default None.
      progress: show a progress bar over the rounds. Default False.
      server_steps: steps of the server's refinement of the prior factor per round (non-Gaussian priors).
      privacy: a :class:`~numpyro_dppvi.privacy.Privacy` (a budget or a noise multiplier, the clip, ...); None
        (the default): not private. Required by ``"dp_optimisation"``.
      checkpoint: a path to which a **private checkpoint** is written after every round (it holds the secret key
        and the clients' private states; never publish it). Default None.
      resume: the path of a private checkpoint to continue, with the same model, clients and settings, up to
        ``rounds`` rounds in total, with its privacy ledger: a resumed fit gives the same result as an
        uninterrupted one and never re-spends or forgets budget. Publish ``result.save(path)``, which holds
        only differentially private outputs. Default None.
      hmac_key: bytes (at least 16) that authenticate the checkpoint written (``checkpoint``) or read
        (``resume``), so that a tampered one is refused. Default None: a checksum only.
      track_epsilon: also record the ledger's epsilon after every round in the history (``"epsilon"``; one
        accountant call per distinct client plan per round). Default False: the epsilon spent is computed on
        demand from ``result.privacy``.
      settings: the fit's settings as one value, :class:`~numpyro_dppvi.FitSettings` (``result.settings`` runs a
        fit again), instead of the settings keywords (method, schedule, rounds, local steps, batch size, samples,
        optimizer, damping, server steps, privacy and the options below); None (the default): the keywords.

    Other Parameters:
      shards: local partitions per client for update perturbation: ``"rows"`` (one record per shard; the
        default of ``"virtual_clients"``), an int, ``f(n_m) -> int``, or a tuple of one int per client.
      invalid: rule for a noisy update with a non-positive precision: ``"reject"`` or ``"floor"``.
      precision_floor: the precision floor of ``invalid="floor"``.
      trusted_aggregator: each participating client adds a share of the noise and only the sum is revealed
        (synchronous, private update-perturbation methods, and ``"vips"``). Default False.
      privacy_unit: ``"example"`` (default) or ``"client"`` (client-level DP: ``method="pvi"``, synchronous).
      client_rate: client-level DP: the probability with which each client takes part in a round. Default 1.
      tail_average: the share of the last local iterates whose mean is the client's answer.
      family: the Gaussian family of ``q`` and of every factor: ``"mean_field"``, ``"full_rank"`` or
        ``"low_rank"`` (with ``rank``); default mean-field, but full-rank for non-private PVI and private virtual
        clients of up to :data:`~numpyro_dppvi.pvi.defaults.NEWTON_MAX_DIM` latent dimensions (:class:`DPPVI`).
      rank: the rank ``r`` of ``family="low_rank"`` (default ``round(sqrt(D))``).
      noise_aware: None (the default): wherever it is available, today private ``method="dp_optimisation"`` with
        a mean-field or full-rank ``q`` of up to :data:`~numpyro_dppvi.pvi.defaults.NEWTON_MAX_DIM` latent
        dimensions and no optimizer given, or ``optimizer=optim.PrivateNewton()``: the local steps follow the
        Newton point of the client's factor as its releases estimate it, and the result's ``q`` accounts for the
        uncertainty the privacy noise leaves in the fit (:mod:`numpyro_dppvi.pvi.noise_aware`; post-processing of
        the releases, no privacy cost; ``result.q_fitted`` is ``q`` as fitted). Private
        ``method="virtual_clients"`` with a mean-field or full-rank ``q``, each client releasing its own update (no
        trusted aggregator, record-level privacy), is noise-aware too: the noise its releases left in ``q``, whose
        variance is known, is integrated out (:mod:`numpyro_dppvi.pvi.release_noise`; the fit itself is the
        same). ``False`` gives the optax local step and ``q`` as fitted; ``True`` insists (an error where it is
        not available). With ``"vips"``: the noise-aware posterior of a private fit of a model that has one
        (linear regression).
      detect_options: ``"vips"`` with a NumPyro model: keyword arguments of
        :func:`~numpyro_dppvi.vips.detect_conjugate`, the public per-record bounds its private release needs
        (``feature_bound``, ``target_bound``, ``count_bound``).

    With ``method="vips"`` the fit takes ``privacy``, ``rounds`` (default 1), ``schedule`` (``"synchronous"``, the
    default, or ``"sequential"``), ``damping`` (default 1), ``rng_key``, ``trusted_aggregator``, ``noise_aware``
    and ``detect_options``, and returns a :class:`~numpyro_dppvi.VIPSResult`.

    Returns:
      a :class:`~numpyro_dppvi.DPPVIResult` holding only what may be published.
    """
    if settings is not None:
        keywords = dict(method=method, schedule=schedule, rounds=rounds, local_steps=local_steps,
                        batch_size=batch_size, num_samples=num_samples, optimizer=optimizer, damping=damping,
                        server_steps=server_steps, privacy=privacy)
        method, schedule, rounds, local_steps, batch_size, num_samples, optimizer, damping, server_steps, privacy, \
            options = _from_settings(settings, keywords, options)
    unknown = set(options) - {"shards", "invalid", "precision_floor", "trusted_aggregator", "privacy_unit",
                              "client_rate", "tail_average", "family", "rank", "noise_aware"}
    if unknown:
        hint = " (a privacy budget goes in privacy=dppvi.Privacy(epsilon=..., delta=...))" if unknown & {
            "epsilon", "delta", "clip", "noise_multiplier"} else ""
        raise TypeError(f"fit_dppvi() got unexpected option(s) {sorted(unknown)}{hint}")
    until_converged = False
    # private virtual clients: the planned rounds follow the family, chosen by the model's dimension (DPPVI)
    auto_rounds = rounds is None and method == "virtual_clients" and privacy is not None
    if rounds is None and not auto_rounds:
        rounds = METHOD_DEFAULTS.get(method, {}).get("rounds", DEFAULT_ROUNDS)
        if rounds is None and privacy is None:  # non-private: until q has converged
            until_converged = True
        elif rounds is None:
            rounds = DEFAULT_ROUNDS
    driver = DPPVI(model, method=method, schedule=schedule, optimizer=optimizer, local_steps=local_steps,
                   batch_size=batch_size, num_samples=num_samples, damping=damping, server_steps=server_steps,
                   privacy=privacy, rounds=None if until_converged else rounds, **options)
    driver.caller = "fit_dppvi"
    driver.auto_rounds = auto_rounds
    rounds = MAX_ROUNDS if until_converged else rounds
    if resume is not None:
        return driver.resume(resume, clients, rounds, hmac_key=hmac_key, rng_key=rng_key, eval_data=eval_data,
                             callback=callback, progress=progress, checkpoint=checkpoint, track_epsilon=track_epsilon,
                             stop_when_converged=until_converged)
    return driver.run(rng_key, clients, rounds, eval_data=eval_data, callback=callback, progress=progress,
                      checkpoint=checkpoint, hmac_key=hmac_key, track_epsilon=track_epsilon,
                      stop_when_converged=until_converged)


def _from_settings(settings: FitSettings, keywords: dict, options: dict) -> tuple:
    """``fit_dppvi``'s settings keywords taken from ``settings``, refusing keywords set beside it."""
    if not isinstance(settings, FitSettings):
        raise TypeError(f"settings must be a dppvi.FitSettings (e.g. result.settings), got {type(settings).__name__}")
    defaults = {field.name: field.default for field in dataclasses.fields(FitSettings)}
    both = sorted(name for name, value in keywords.items() if value is not defaults[name] and value != defaults[name])
    both += sorted(name for name in options if name in defaults)
    if both:
        raise TypeError(f"fit_dppvi takes a fit's settings as settings= or as keywords, not both (got settings= and "
                        f"{both}); change them with settings.replace({both[0]}=...)")
    values = settings.options()
    extra = {name: values.pop(name) for name in list(values) if name not in keywords}
    return (*(values[name] for name in keywords), dict(options, **extra))
