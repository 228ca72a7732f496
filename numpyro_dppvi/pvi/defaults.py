"""The methods of (DP-)PVI, their defaults, and the names a fit's options accept.

:data:`METHOD_DEFAULTS` holds the settings each method runs with when they are left out (measured on the
papers' problems and the models of ``benchmarks/fidelity.py``; the reasons are beside each value).
"""

from __future__ import annotations

import difflib

import optax

from .. import diagnostics
from ..optim import cvi, natural_gradient

METHODS = ("pvi", "dp_optimisation", "local_averaging", "virtual_clients", "parameter_perturbation")
UPDATE_METHODS = ("local_averaging", "virtual_clients", "parameter_perturbation")
PRIVACY_UNITS = ("example", "client")
CHECKPOINT_FORMAT = "numpyro_dppvi.DPPVICheckpoint/1"
#: The optimiser of private local steps when none is given: one object, so that fits with the default
#: share compiled programs.
DEFAULT_OPTIMIZER = optax.adam(1e-2)
#: The local optimiser of non-private PVI (and of non-private global VI and BCM): conjugate-computation
#: steps for the precisions, Adam in posterior-sd units for the means (:func:`~numpyro_dppvi.optim.cvi`).
LOCAL_OPTIMIZER = cvi()
#: Non-private rounds when ``rounds`` is None: until ``q`` has converged (``diagnostics.convergence``,
#: checked from :data:`MIN_ROUNDS` on), at most :data:`MAX_ROUNDS`.
MIN_ROUNDS, MAX_ROUNDS = 2 * diagnostics.WINDOW, 100
#: Per-method defaults (the settings that work on the papers' problems and on the models of
#: ``benchmarks/fidelity.py``).
#: Non-private PVI (issue 21, measured against NUTS on 13 models and on Adult): the sequential schedule;
#: 20 local steps of :data:`LOCAL_OPTIMIZER` on antithetic draws, the client's answer the mean of the
#: last half of its iterates; rounds until converged. Measured: within max(0.5, AutoNormal + 0.25) NUTS
#: sd of NUTS on every model; the former defaults (10 steps of ``adam(1e-2)``, last iterate, 20 rounds)
#: left conjugate models 0.3-0.6 sd from the exact optimum and Adult's unbalanced split moving 5-13 sd a
#: round. Mean-field PVI on strongly correlated posteriors needs many rounds (NumPyro's zero-inflated
#: Poisson example: 40-65), which a fixed number of rounds cannot promise.
#: Virtual clients, one record each: natural-gradient local steps (Adam turns a sum of thousands of
#: one-record changes into a sum of signs), damping 0.1 and a precision floor of 1, the precision of a
#: standard-normal prior (noisy one-record changes often make a precision non-positive; flooring keeps
#: the update, rejecting would waste the round). On Adult at epsilon 1 these reach 0.844 accuracy
#: (rounds 5 or 10; docs/guide.md §3). DP optimisation: the sequential schedule. The update-perturbation
#: methods keep synchronous rounds (their defaults were tuned there; a trusted aggregator and
#: client-level DP need them).
METHOD_DEFAULTS = {
    "pvi": dict(schedule="sequential", rounds=None, optimizer=LOCAL_OPTIMIZER, local_steps=20, tail_average=0.5),
    # with an optax optimizer (models above NEWTON_MAX_DIM, noise_aware=False, or one passed): damping 0.5 (at 1,
    # 10 of 10 fits of a 5-covariate logistic regression raised FitDiverged within 40 rounds; at 0.5 none) and
    # the last iterate; with optim.PrivateNewton: PRIVATE_NEWTON_DEFAULTS
    "dp_optimisation": dict(schedule="sequential", damping=0.5, tail_average=0.0),
    "virtual_clients": dict(optimizer=natural_gradient(0.5), damping=0.1, invalid="floor", precision_floor=1.0),
    "local_averaging": dict(invalid="floor", precision_floor=1.0),
}
DEFAULT_LOCAL_STEPS = 10
#: DP optimisation without an optimizer takes optim.PrivateNewton steps and the noise-aware answer (issue 23) for
#: models of up to this many latent dimensions. Its curvature estimate (Stein's lemma from a few antithetic draws a
#: step) has noise growing with the dimension: measured on Adult (110 coordinates, 10 clients, 5 rounds of 20
#: steps), 0.81 test accuracy with almost no DP noise and 0.76-0.80 at epsilon 1, where the optax default reaches
#: 0.84-0.85; on the coverage study's 6 coordinates it is what makes the intervals cover.
NEWTON_MAX_DIM = 32
#: DP optimisation with optim.PrivateNewton (issue 23): damping 1, since each client's answer is the Newton point
#: of its factor estimated from its releases, averaged over its last half of the rounds (pvi.noise_aware), and
#: damping would mix in the older, noisier estimates a second time; tail_average 0.5 for the iterate the answer
#: starts from. Above :data:`NEWTON_MAX_DIM` the optax default (:data:`DEFAULT_OPTIMIZER`) with the method's
#: defaults, ``q`` as fitted. 20 local steps a round: the estimates (h_t, B_t) depend on the probe ``q_t`` they are
#: made at (for a non-Gaussian likelihood), and with 10 steps the early ones are made far from where the update
#: ends, a deviation the steps' scatter does not see. Measured (coverage study's logistic regression, 10,000 rows,
#: epsilon 1, 20 keys of one data set): the squared error of the private mean about the non-private one is 1.56x the
#: variance the noise-aware posterior adds with 10 steps (up to 2.4x for the largest weights; 1.02x for a Gaussian
#: likelihood), 0.98x with 20 steps, whose RMS error is also smaller (0.060 against 0.079); with 20 rounds of 10 steps
#: instead, 1.44x.
PRIVATE_NEWTON_DEFAULTS = dict(damping=1.0, tail_average=0.5, local_steps=20)
#: Virtual clients with full-rank factors (issue 23): the family when ``family`` is left out, for models of up to
#: :data:`NEWTON_MAX_DIM` latent dimensions whose clients each release their own update (no trusted aggregator) and
#: a noise-aware posterior (``noise_aware`` not False); with them 20 rounds at damping 0.25 and the clip of
#: :func:`virtual_clip` unless given. A full precision holds the curvature whose lack made mean-field virtual clients'
#: intervals miss (``pvi.release_noise``, eq. 3), and 20 rounds at 0.25 let the factors arrive
#: (``benchmarks/vc_damping.py``). Measured on ``benchmarks/coverage.py`` (docs/guide.md, section 4).
VIRTUAL_FULL_RANK_DEFAULTS = dict(rounds=20, damping=0.25)
#: :func:`virtual_clip`'s largest clip: ``rho C R = 2.5`` of travel at the defaults above, what the coverage study's
#: one-record factors need where the noise is small (clip 0.35, travel 1.75: epsilon 8 / 10,000 rows covered .50 /
#: .17 on 8 data sets; clip 0.5: .87 / .52 on 50). A model with larger one-record factors needs more: pass ``clip``.
VIRTUAL_CLIP_MAX = 0.5
#: :func:`virtual_clip`'s bound on the release's noise per record, ``sigma C / N``: where the noise per record is
#: large a factor that has not arrived costs less than the noise a longer travel brings (epsilon 1 / 2,000 rows:
#: clip 0.5 covered .81 / .45 with RMSE .339, clip 0.35 .86 / .46 with .263, clip 0.25 .86 / .46 with .228, 50 data
#: sets each). The four cells of the coverage study are in the bar for any value in [0.0084, 0.029] (0.0084: clip
#: 0.5 at epsilon 1 / 10,000 rows; 0.029: clip 0.35 at epsilon 1 / 2,000 rows); 0.02 is the clip 0.25 measured.
VIRTUAL_NOISE_PER_RECORD = 0.02


def virtual_clip(noise_multiplier: float, shards) -> float:
    """The clip of full-rank virtual clients' releases when ``Privacy.clip`` is left out:

        C = min(VIRTUAL_CLIP_MAX, VIRTUAL_NOISE_PER_RECORD * mean(N_m) / sigma)

    with ``sigma`` the calibrated noise multiplier (noise std / clip; it does not depend on the clip) and ``N_m`` the
    planned shards of client ``m`` (one record each by default). Both are public (the ledger's events, the fit's
    settings), so ``C`` is a public constant fixed before anything is released: every sensitivity argument of
    :mod:`.update_perturbation` holds as for a given clip. At epsilon 1 with 200 rows a client, 20 rounds (sigma
    16.7): 0.24; at epsilon 8, or with 1,000 rows a client: 0.5."""
    shards = [float(n) for n in shards]
    if not shards or not all(n > 0 for n in shards) or not noise_multiplier > 0:
        raise ValueError(f"virtual_clip needs a positive noise multiplier and shard counts, got {noise_multiplier} "
                         f"and {shards[:10]}")
    return float(min(VIRTUAL_CLIP_MAX, VIRTUAL_NOISE_PER_RECORD * sum(shards) / len(shards) / noise_multiplier))


DEFAULT_ROUNDS = 10


def did_you_mean(name, choices) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices`` to a misspelt ``name`` (``dp_optimization``,
    ``synchronus``), else ``""``."""
    close = difflib.get_close_matches(str(name), choices, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def default_schedule(method: str, trusted_aggregator: bool = False, privacy_unit: str = "example") -> str:
    """The schedule used when none is given: synchronous where the mechanism needs it (a trusted
    aggregator, client-level DP), else the method's default (:data:`METHOD_DEFAULTS`)."""
    if trusted_aggregator or privacy_unit == "client":
        return "synchronous"
    return METHOD_DEFAULTS.get(method, {}).get("schedule", "synchronous")


def shards_of_batch(batch_size: int, n: int) -> int:
    """``ceil(n_m / batch_size)`` shards (the DP-PVI paper's ``K = ceil(1 / q)``)."""
    return max(-(-n // batch_size), 1)
