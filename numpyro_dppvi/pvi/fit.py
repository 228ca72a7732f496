"""``fit_dppvi``: the one-call form of :class:`~numpyro_dppvi.pvi.driver.DPPVI`.

Builds the driver from the options, fills in the method's defaults (:mod:`.defaults`), and runs (or
resumes, :mod:`.resume`) the fit. The result holds only what may be published.
"""

from __future__ import annotations

import optax

from ..results import DPPVIResult
from .defaults import DEFAULT_ROUNDS, MAX_ROUNDS, METHOD_DEFAULTS
from .driver import DPPVI


def fit_dppvi(model, clients, *, method: str = "pvi", schedule: str | None = None, rounds: int | None = None,
              local_steps: int | None = None, batch_size: int | None = None, num_samples: int = 10,
              optimizer: optax.GradientTransformation | None = None, damping: float | None = None,
              rng_key=None, eval_data=None, callback=None, progress: bool = False,
              server_steps: int = 50, privacy=None, checkpoint=None, resume=None, hmac_key: bytes | None = None,
              track_epsilon: bool = False, **options) -> DPPVIResult:
    """Fit a NumPyro model to federated ``clients`` with (DP-)PVI; the one-call form of :class:`DPPVI`.

    ``method="dp_optimisation"`` with ``privacy=Privacy(epsilon=..., delta=..., clip=...)`` calibrates
    the noise so that every client's releases over ``rounds`` rounds meet the budget; the result's
    ``privacy`` ledger reports what was spent. ``options`` are the remaining :class:`DPPVI` arguments
    (``shards``, ``invalid``, ``precision_floor``, ``trusted_aggregator``, ``privacy_unit``, ``client_rate``,
    ``tail_average``, ``family``, ``rank``, ``noise_aware``).

    ``noise_aware`` (None: wherever it is available, today private ``method="dp_optimisation"`` with a mean-field
    or full-rank ``q`` of up to :data:`~numpyro_dppvi.pvi.defaults.NEWTON_MAX_DIM` latent dimensions and no
    optimizer given, or ``optimizer=optim.PrivateNewton()``): the local steps follow the Newton point of the
    client's factor as its releases estimate it, and the result's ``q`` accounts for the uncertainty the privacy
    noise leaves in the fit (:mod:`numpyro_dppvi.pvi.noise_aware`; post-processing of the releases, no privacy
    cost; ``result.q_fitted`` is ``q`` as fitted). ``False`` gives the optax local step and ``q`` as fitted.
    Private ``method="virtual_clients"`` with a mean-field or full-rank ``q``, each client releasing its own update
    (no trusted aggregator, record-level privacy), is noise-aware too: the noise its releases left in ``q``, whose
    variance is known, is integrated out (:mod:`numpyro_dppvi.pvi.release_noise`; the fit itself is the same).

    Defaults (:data:`METHOD_DEFAULTS`): ``schedule`` sequential for ``"pvi"`` and ``"dp_optimisation"``,
    synchronous otherwise; ``rounds=None``: non-private fits run until ``q`` has converged (checked
    from round :data:`MIN_ROUNDS`, at most :data:`MAX_ROUNDS`; ``result.rounds`` says how many ran),
    private ones 10 rounds (their noise is calibrated to the planned rounds), but private virtual clients with
    full-rank factors 20 (:data:`~numpyro_dppvi.pvi.defaults.VIRTUAL_FULL_RANK_DEFAULTS`: their default up to
    :data:`~numpyro_dppvi.pvi.defaults.NEWTON_MAX_DIM` latent dimensions, each client releasing its own update).

    ``rng_key``: leave it out for a private fit. The fit then draws its key from the operating system
    and the noise cannot be recomputed by anyone. A key you pass makes the fit reproducible, and the
    guarantee then rests on that key staying secret (the ledger records which kind of seed was used).

    ``checkpoint=path`` writes a **private checkpoint** after every round (it holds the secret key and
    the clients' private states; never publish it); ``resume=path`` continues it, with the same model,
    clients and settings, up to ``rounds`` rounds in total, with its privacy ledger: a resumed fit
    gives the same result as an uninterrupted one and never re-spends or forgets budget. Publish
    ``result.save(path)``, which holds only differentially private outputs. ``hmac_key`` (bytes)
    authenticates the checkpoint so that a tampered one is refused.

    ``numpyro_dppvi.fit_dppvi`` also takes ``method="vips"`` (federated VIPS, :mod:`numpyro_dppvi.fit`).
    """
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
