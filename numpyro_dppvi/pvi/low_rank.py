"""Low-rank Gaussian factors (``family="low_rank", rank=r``, issue 22): one public basis for ``q`` and every factor.

Every Gaussian of a fit has the precision ``Lambda = -2 eta2`` with

    eta2 = diag(a) + B X B^T,        B in R^{D x r} orthonormal (shared),  X in Sym_r (signed),

(:class:`~numpyro_dppvi.factors.LowRank`). With one ``B`` shared by ``q``, the prior, the server factor and
every client factor, products, quotients, powers and damping add ``(eta1, a, X)``: exact, so
``q = prior * t_0 * prod_m t_m`` holds to rounding, and ``q`` is exactly diagonal plus rank ``r``. Why the rank
sits on the precision and not on the covariance (NumPyro's ``AutoLowRankMultivariateNormal``): PVI adds
natural parameters, and neither a product nor a quotient keeps a low-rank covariance low-rank; and
covariates correlated alike give a likelihood curvature ``alpha I + beta 1 1^T``, diagonal plus rank one.

**The local step.** A client takes the full-rank Newton steps of :mod:`.full_rank` from ``q`` against its
cavity (formed densely: ``O(D^2)`` memory and ``O(D^3)`` per step, as full-rank, for now), and replaces its new
factor's precision ``T = Lambda_new - Lambda_cavity`` by :func:`diagonal_plus_low_rank`: the diagonal kept
exactly where it is not negative (floored at 0), the rest a positive semi-definite rank-``r`` term in the client's
own directions ``V`` (the answer lives in the basis ``[B, V]``, :func:`answer`); the new ``q``'s mean is the Newton
steps' mean. Every factor is positive semi-definite, and the truncation below keeps it so: ``q`` and every cavity
stay proper (**Properness** below). (The Frobenius projection of
the change onto ``F_B = {diag(x) + B X B^T + E B^T + B E^T}`` was tried first as the local step and rejected: its
cross term ``E B^T + B E^T`` is indefinite, and truncating half of it made ``q`` improper in the first round of
a correlated regression.)

**The server** (:func:`absorb`) collects the answers' bases, ``B+ = orth[B, E_1, ..., E_M]`` (a Householder QR,
whose first ``r`` columns span ``B``), rebases every Gaussian of the state and every change into ``B+``
(exact: each lies in its span), adds the damped changes, and truncates: the eigenvectors ``V_r`` of ``q``'s core in
``B+`` with the ``r`` largest ``|gamma|`` give ``B' = B+ V_r``, and everything is rebased to ``B'``
(:func:`rebase`: projects each Gaussian's core onto ``span B'`` and moves its complement block to the diagonal,
positive semi-definite in, positive semi-definite out). The rebase is linear and applied to every
Gaussian alike, so ``q`` stays the exact product of its factors; what the truncation drops from ``q`` (its
share of ``q``'s core, ``||gamma_dropped|| / ||gamma||``) is reported per round as ``low_rank_truncation``, and each Gaussian's
``eta1`` moves with its precision so that ``q``'s mean is kept (:func:`truncate_tree`). A
truncation that leaves ``q`` improper makes the round invalid, as any invalid update (:class:`FitDiverged`).

**Measured** (``tests/pvi/test_low_rank.py``; covariates correlated 0.95, ``D = 4``, 4 clients, ``r = 1``):
synchronous and sequential rounds give sds 0.996-1.006x the exact ones (mean-field about 0.35x); on an earlier
draw of the data synchronous rounds 0.997-1.008x, sequential ones (the default) 0.93-1.15x (each arrival truncates
the other factors anew); the means are exact (under 1e-3 sd) in both, since the truncation keeps ``q``'s mean (:func:`truncate_tree`). Synchronous rounds need damping of about
``1/M`` here as elsewhere: at damping 1 an AR(1) model's split in time made a cavity improper in round 2.
**Properness** (non-private fits): every client factor is positive semi-definite by construction (its split's
diagonal is floored at 0, :func:`answer`; its core is), the rebase keeps it so, and damping mixes such factors;
so ``q`` and every cavity hold at least the prior's precision and stay proper. The floor is the family's
constraint: where a client's curvature is negative on a coordinate (a likelihood that is not log-concave there),
its factor keeps none of that coordinate's precision instead of removing some. Before it (the diagonal kept
exactly, also by the rebase), NumPyro's Hilbert-space GP example stopped with :class:`FitDiverged` in round 3
and a zero-inflated Poisson regression in round 1-2; with it both fit (``benchmarks/fidelity.py``).

**DP optimisation** moves ``(mu, log s, W)`` with the precision ``S^{-1} (I + W W^T) S^{-1}``
(:func:`~numpyro_dppvi.factors.to_params`; :class:`~.local.DPOptimisation`): ``2 D + D r`` noise coordinates per
step, and the answer's directions ``S^{-1} W`` widen the basis at the server like any client's. UCI Adult, 10
clients, epsilon 1, rank 10: test accuracy 0.8462-0.8465 against mean-field's 0.8463-0.8464.

**Update perturbation** (parameter perturbation, local averaging): a shard releases its change in public
coordinates (:func:`change_coordinates`: the diagonal, the core in ``B`` and the cross term ``E``, ``2 D + r (r + 1)
/ 2 + (D - r) r`` of them, :func:`~numpyro_dppvi.factors.num_coordinates`), clipped jointly and noised
isotropically (:func:`release_coordinates`); the server completes the change outside ``B`` with the client's
public factor (:func:`from_coordinates`, a Nystrom completion). Negligible noise, rank 1: parameter perturbation
reaches the non-private fixed point, local averaging (3 shards) sds 1.015-1.069x and means up to 0.46 sd off.
**A trusted aggregator and client-level DP** release only the sum of the clients' coordinates: the server
completes the sum once, with ``q``'s core, and each client's factor takes its own coordinates and its share of
that completion (:func:`own_change`, linear: the shares add up), the remainder (the noise) the server's noise
factor (:func:`settle_aggregate`). Negligible noise, rank 1: sds 1.003-1.027x, means up to 0.19 sd off (local
averaging 1.03-1.07x, 0.54 sd). Virtual clients do not take this family yet (their per-shard factors would have to be
rebased with every change of basis).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .. import factors
from ..factors import Gaussian, LowRank
from .full_rank import NonPrivateFullRank, ServerFactorStepFullRank


def _diag_of(basis, core):
    """``diag(basis core basis^T)`` (``[..., D]``) without forming it."""
    return jnp.einsum("...ij,...jk,...ik->...i", basis, core, basis)


def rebase(g: Gaussian, basis: jax.Array) -> Gaussian:
    """``g`` (low-rank, possibly stacked on leading axes) in the orthonormal ``basis`` ``B'`` ``[D, k']``:

        X' = B'^T U X U^T B',      a' = a + diag((I - P) U X U^T (I - P)),      P = B' B'^T

    (``U``, ``X``, ``a``: ``g``'s basis, core and diagonal): the core's block in ``span B'`` is kept, its block in
    the complement moves to the diagonal, and the cross blocks ``P U X U^T (I - P) + transpose`` are dropped.
    Exact (``eta2`` unchanged) when ``span U`` lies in ``span B'``. Linear in ``(a, X)`` for given ``U`` and
    ``B'``, and it keeps a semi-definite precision semi-definite (each kept part is), so that a sum of
    positive semi-definite factors stays one. (Keeping the diagonal of ``eta2`` instead, as an earlier version did,
    moved the cross blocks' diagonal onto it, which can be negative: cavities of a zero-inflated Poisson
    regression and of NumPyro's Hilbert-space GP lost their properness in rounds 2-3.)"""
    low = g.eta2
    w = jnp.einsum("di,...dj->...ij", basis, low.basis)  # B'^T U
    core = w @ low.core @ jnp.swapaxes(w, -1, -2)
    core = 0.5 * (core + jnp.swapaxes(core, -1, -2))
    target = jnp.broadcast_to(basis, low.basis.shape[:-2] + basis.shape)
    # the part of U X U^T outside span B' (its complement block (I - P) U X U^T (I - P)) moves to the diagonal
    outside = low.basis - jnp.einsum("di,...ij->...dj", basis, w)  # (I - B' B'^T) U
    diag = low.diag + _diag_of(outside, low.core)
    return Gaussian(g.eta1, LowRank(diag, core, target))


def rebase_tree(tree, basis: jax.Array):
    """Every low-rank Gaussian in ``tree`` rebased to ``basis`` (:func:`rebase`); other leaves unchanged."""
    is_gaussian = lambda x: isinstance(x, Gaussian)
    return jax.tree.map(lambda x: rebase(x, basis) if is_gaussian(x) and factors.is_low_rank(x) else x,
                        tree, is_leaf=is_gaussian)


def _top(values, vectors, rank: int, signed: bool):
    """The ``rank`` eigenpairs kept: the largest (negative ones set to 0), or, ``signed``, the largest ``|lambda|``."""
    if signed:
        order = jnp.argsort(-jnp.abs(values))[:rank]
        return values[order], vectors[:, order]
    return jnp.maximum(values[-rank:], 0.0), vectors[:, -rank:]


def diagonal_plus_low_rank(precision: jax.Array, rank: int, iterations: int = 30, signed: bool = False,
                           floor=None):
    """``(d, S, V)`` with ``precision ~ diag(d) + V diag(S) V^T``, ``V`` ``[D, r]`` orthonormal: alternating
    projections (factor analysis' principal-axis iteration): ``d = max(diag(T - V S V^T), floor)``, then ``V, S``
    the ``r`` largest eigenpairs of ``T - diag(d)`` (``S >= 0``: negative eigenvalues set to 0; ``signed``: the
    ``r`` largest in absolute value, for a change, which may remove precision). The diagonal is exact where it
    stays above ``floor`` (default: none); exact when ``T`` is diagonal plus a rank ``r`` term of that kind, after
    the iteration has converged. ``floor = 0`` makes the result positive semi-definite (factor analysis' Heywood
    constraint): without it a client's diagonal came out at -120 on a zero-inflated Poisson regression
    (``D = 10``, ``r = 3``), compensated by ``V S V^T``, and the fit stopped in round 1."""
    sym = 0.5 * (precision + precision.T)
    floor = -jnp.inf if floor is None else floor

    def step(low, _):
        d = jnp.maximum(jnp.diagonal(sym - low), floor)
        values, vectors = _top(*jnp.linalg.eigh(sym - jnp.diag(d)), rank, signed)
        return (vectors * values) @ vectors.T, None

    low, _ = jax.lax.scan(step, jnp.zeros_like(sym), None, length=iterations)
    d = jnp.maximum(jnp.diagonal(sym - low), floor)
    values, vectors = _top(*jnp.linalg.eigh(low), rank, signed)
    return d, values, vectors


def answer(q: Gaussian, cavity: Gaussian, q_dense_new: Gaussian, rank: int) -> Gaussian:
    """A client's new ``q`` in the family: the cavity times its new factor, whose precision ``T = Lambda_new -
    Lambda_cavity`` (dense) is replaced by :func:`diagonal_plus_low_rank` with ``floor = 0`` (a positive
    semi-definite factor: the diagonal kept where it is not negative, the rest a rank-``r`` positive semi-definite
    term in the client's own directions ``V``), in the basis ``[B, V]`` with the core
    ``blockdiag(X_cavity, -S / 2)``; ``eta1 = Lambda' mu_new`` keeps the Newton steps' mean (``eta1`` kept whole with
    a truncated precision moved the mean by up to a posterior sd). The first ``r`` columns of the basis are ``q``'s ``B``."""
    low = cavity.eta2
    dense_cavity = low.dense()
    target = -2.0 * (q_dense_new.eta2 - dense_cavity)
    d, values, vectors = diagonal_plus_low_rank(target, rank, floor=jnp.zeros_like(low.diag))
    zero = jnp.zeros((low.core.shape[-1], rank), low.core.dtype)
    block = jnp.block([[low.core, zero], [zero.T, jnp.diag(-0.5 * values)]])
    eta2 = LowRank(low.diag - 0.5 * d, block, jnp.concatenate([low.basis, vectors], axis=-1))
    mean, _ = factors.mean_and_precision(q_dense_new)
    return Gaussian(-2.0 * eta2.dense() @ mean, eta2)


def in_basis_of(q: Gaussian, new: Gaussian) -> Gaussian:
    """``q`` (basis ``B``, ``r`` columns) written in ``new``'s wider basis ``[B, E]``: its core padded with zeros
    (exact, since ``new``'s first ``r`` columns are ``B``)."""
    low, k = q.eta2, new.eta2.basis.shape[-1]
    r = low.basis.shape[-1]
    pad = [(0, 0)] * (low.core.ndim - 2) + [(0, k - r), (0, k - r)]
    return Gaussian(q.eta1, LowRank(low.diag, jnp.pad(low.core, pad), new.eta2.basis))


def changes(q: Gaussian, q_new: Gaussian, ok: jax.Array, damping) -> Gaussian:
    """The damped changes ``rho (q_new - q)`` of the clients ``ok`` (``[M]``, stacked answers), zero for the
    others; a failed answer's basis is replaced by ``[B, 0]`` so that it cannot poison :func:`absorb`."""
    start = in_basis_of(q, q_new)
    flag = lambda x: jnp.reshape(ok, ok.shape + (1,) * (x.ndim - ok.ndim))
    low_new, low_q = q_new.eta2, start.eta2
    r = q.eta2.basis.shape[-1]
    basis = jnp.where(flag(low_new.basis), low_new.basis,
                      jnp.concatenate([low_q.basis[..., :r], jnp.zeros_like(low_new.basis[..., r:])], axis=-1))
    basis = jnp.where(jnp.isfinite(basis), basis, 0.0)
    pick = lambda new, old: jnp.where(flag(new), damping * (new - old), 0.0)
    return Gaussian(pick(q_new.eta1, start.eta1),
                    LowRank(pick(low_new.diag, low_q.diag), pick(low_new.core, low_q.core), basis))


def widened_basis(basis: jax.Array, answers: jax.Array) -> jax.Array:
    """``orth[B, E_1, ...]``: ``basis`` ``[D, r]`` and the answers' bases ``[..., D, k]`` (their first ``r``
    columns are ``B``); a Householder QR, whose columns are orthonormal even where the stack is rank-deficient
    and whose first ``r`` span ``B``."""
    return orthonormal_union(basis, _columns(answers[..., basis.shape[-1]:]))


def _columns(stacked: jax.Array) -> jax.Array:
    """The columns of stacked ``[..., D, k]`` matrices side by side, ``[D, (...) k]``."""
    return jnp.moveaxis(stacked, -2, 0).reshape(stacked.shape[-2], -1)


def orthonormal_union(basis: jax.Array, extra: jax.Array) -> jax.Array:
    """``orth[basis, extra]`` by a Householder QR (orthonormal columns even where ``extra`` is rank-deficient; the
    first ``r`` span ``basis``)."""
    return jnp.linalg.qr(jnp.concatenate([basis, extra], axis=1))[0]


def truncated_basis(q: Gaussian, rank: int) -> tuple[jax.Array, jax.Array]:
    """``(B', dropped share)``: the ``rank`` eigenvectors of ``q``'s core with the largest ``|gamma|``, in ``q``'s
    basis, and ``||gamma_dropped|| / ||gamma||`` (0 when nothing is dropped)."""
    low = q.eta2
    gamma, vectors = jnp.linalg.eigh(0.5 * (low.core + low.core.T))
    order = jnp.argsort(-jnp.abs(gamma))
    kept, dropped = order[:rank], order[rank:]
    total = jnp.sqrt(jnp.sum(jnp.square(gamma)))
    share = jnp.sqrt(jnp.sum(jnp.square(gamma[dropped]))) / jnp.maximum(total, jnp.finfo(gamma.dtype).tiny)
    basis = low.basis @ vectors[:, kept]
    return jnp.linalg.qr(basis)[0], share


def truncate_tree(tree, q: Gaussian, rank: int):
    """``(tree rebased to B', dropped share)``: ``B'`` the :func:`truncated_basis` of ``q`` (in ``tree``'s basis).

    The truncation changes precisions; each Gaussian's ``eta1`` moves by ``(Lambda'_g - Lambda_g) mu``, ``mu`` the
    mean of ``q`` before it, so that ``q``'s mean is kept (``eta1'_q = Lambda'_q mu``) and ``q`` stays the sum of
    its factors (the correction is linear in each Gaussian). Keeping ``eta1`` instead moved the mean of a
    sequential fit by up to 0.8 posterior sd (every arrival truncates)."""
    basis, share = truncated_basis(q, rank)
    mean, _ = factors.mean_and_precision(q)

    def move(g):
        if not (isinstance(g, Gaussian) and factors.is_low_rank(g)):
            return g
        new = rebase(g, basis)
        shift = -2.0 * (new.eta2.dense() - g.eta2.dense()) @ mean
        return Gaussian(g.eta1 + shift, new.eta2)

    return jax.tree.map(move, tree, is_leaf=lambda x: isinstance(x, Gaussian)), share


@dataclass(frozen=True)
class NonPrivateLowRank(NonPrivateFullRank):
    """PVI's non-private local step for low-rank factors: :class:`~.full_rank.NonPrivateFullRank`'s Newton steps
    on the dense ``q`` and cavity, the change of ``eta2`` then projected onto ``F_B`` (:func:`answer`). Same
    interface as :class:`~numpyro_dppvi.pvi.local.NonPrivate`; ``rank`` is the family's ``r``."""

    family = "low_rank"
    #: The server requires a proper cavity here (:func:`answer` projects the change against it); measured for the
    #: full-rank step only (:attr:`~.full_rank.NonPrivateFullRank.uses_client_cavity`).
    uses_client_cavity = True
    rank: int = 1

    def update(self, q, cavity, arrays, mask, n, key, client_state):
        dense_q, dense_cavity = factors.to_full_rank(q), factors.to_full_rank(cavity)
        q_new, client_state, metrics = super().update(dense_q, dense_cavity, arrays, mask, n, key, client_state)
        return answer(q, cavity, q_new, self.rank), client_state, metrics


@dataclass(frozen=True)
class ServerFactorStepLowRank(ServerFactorStepFullRank):
    """The server's prior factor ``t_0`` for low-rank ``q``: :class:`~.full_rank.ServerFactorStepFullRank` on the
    dense ``q``, keeping the diagonal of ``t_0``'s precision (exact when the server-held sites are independent
    scalars, as their prior's curvature is then diagonal; otherwise its diagonal) and the dense step's mean
    (``eta1 = Lambda' mu``: a hierarchical prior couples a scale with its coefficients, and keeping ``eta1``
    with the off-diagonal curvature dropped moved a Poisson regression's mean by 1.8 posterior sd). ``q``'s
    basis is kept."""

    def update(self, q: Gaussian, cavity: Gaussian, key) -> Gaussian:
        if not any(self.mask):
            return q
        dense = super().update(factors.to_full_rank(q), factors.to_full_rank(cavity), key)
        t0 = factors.divide(dense, factors.to_full_rank(cavity))
        low = cavity.eta2
        eta2 = LowRank(low.diag + jnp.diagonal(t0.eta2), low.core, low.basis)
        mean, _ = factors.mean_and_precision(dense)
        return Gaussian(-2.0 * eta2.dense() @ mean, eta2)


SQRT2 = 2.0 ** 0.5


def change_coordinates(q: Gaussian, cavity: Gaussian, q_dense_new: Gaussian) -> dict:
    """The change from ``q`` (low-rank, basis ``B``) to a shard's proposal ``q_new`` (dense) in the public
    coordinates a private release has: ``{"eta1", "diag", "core", "cross"}``.

    The client's factor ``t = q / cavity`` has the precision ``diag(p) + B G B^T`` (public: the server holds it).
    The proposal's factor precision ``T = Lambda_new - Lambda_cavity`` is put in the family, ``T ~ diag(d) + L``
    with ``L`` positive semi-definite of rank ``r`` (:func:`diagonal_plus_low_rank`), and the change ``T - t``
    written in ``B``: in ``eta2`` units (``-1/2``), ``diag = -(d - p) / 2``, ``core = X = -(B^T L B - G) / 2``
    (symmetric ``[r, r]``) and ``cross = sqrt(2) E``, ``E = -(I - B B^T) L B / 2`` (``[D, r]``, ``B^T E = 0``:
    ``L``'s action on ``B``, by which the server's basis turns towards ``L``'s range). With ``t``'s core the server
    recovers ``L`` (:func:`from_coordinates`: ``L = (L B) (B^T L B)^+ (L B)^T``, a Nystrom completion from
    ``B^T L B = -2 X + G``, exact for a rank-``r`` ``L`` whose compression is invertible). ``eta1`` is the change
    that keeps ``q_new``'s mean under the completed precision. The plain L2 norm of these leaves,
    ``sqrt(||d eta1||^2 + ||diag||^2 + ||X||_F^2 + ||E B^T + B E^T||_F^2)``, is the norm ``clip_change`` clips and
    :func:`release_coordinates` noises isotropically. Depends only on ``q_new`` and public values (``q`` and
    ``t``)."""
    low, own = q.eta2, factors.divide(q, cavity).eta2
    basis, rank = low.basis, low.basis.shape[-1]
    d, values, vectors = diagonal_plus_low_rank(-2.0 * (q_dense_new.eta2 - cavity.eta2.dense()), rank)
    lifted = (vectors * values) @ vectors.T  # L
    compressed = basis.T @ lifted @ basis
    core = -0.5 * compressed - own.core
    cross = -0.5 * (lifted @ basis - basis @ compressed)
    mean, _ = factors.mean_and_precision(q_dense_new)
    eta1 = (-2.0 * cavity.eta2.dense() + jnp.diag(d) + lifted) @ mean
    return {"eta1": eta1 - q.eta1, "diag": -0.5 * d - own.diag, "core": 0.5 * (core + core.T), "cross": SQRT2 * cross}


#: Eigenvalues of a factor's compressed core below this share of its largest (and below the noise floor) are
#: left out of the Nystrom completion (:func:`from_coordinates`): their inverse would amplify noise.
COMPLETION_CUTOFF = 1e-4


def completion_inverse(core: jax.Array, noise_std=0.0) -> jax.Array:
    """``K^+``: the inverse of the symmetric ``core`` on its eigenvalues whose size exceeds both
    :data:`COMPLETION_CUTOFF` of the largest and three noise sds (``3 noise_std``); 0 on the others (their inverse
    would be noise)."""
    values, vectors = jnp.linalg.eigh(0.5 * (core + core.T))
    strength = jnp.abs(values)
    cutoff = jnp.maximum(COMPLETION_CUTOFF * jnp.max(strength), 3.0 * noise_std)
    inverse = jnp.where(strength > cutoff, 1.0 / jnp.where(strength > cutoff, values, 1.0), 0.0)
    return (vectors * inverse) @ vectors.T


def from_coordinates(q: Gaussian, own: Gaussian, coordinates: dict, scale=1.0, noise_std=0.0) -> Gaussian:
    """``q`` moved by ``scale`` times a (released, summed) change in public coordinates
    (:func:`change_coordinates`) of the factor ``own`` (the client's, public): with ``K = own.core + s X`` (the new
    factor's compressed core, ``-B^T L B / 2``) and ``E`` (``cross / sqrt(2)``), the change is
    ``s (diag + B X B^T + E B^T + B E^T) + s^2 E K^+ E^T``, the last term completing ``L`` outside ``B``
    (:func:`completion_inverse`, knowing the released coordinates' noise std); in the basis ``[B, E]`` with the
    core ``[[X_q + s X, s I], [s I, s^2 K^+]]``. Post-processing of the released coordinates and public values."""
    low = q.eta2
    r = low.basis.shape[-1]
    completion = completion_inverse(own.eta2.core + scale * coordinates["core"], noise_std)
    eye = jnp.eye(r, dtype=low.core.dtype)
    block = jnp.block([[low.core + scale * coordinates["core"], scale * eye],
                       [scale * eye, scale ** 2 * completion]])
    basis = jnp.concatenate([low.basis, coordinates["cross"] / SQRT2], axis=-1)
    return Gaussian(q.eta1 + scale * coordinates["eta1"], LowRank(low.diag + scale * coordinates["diag"], block, basis))


def release_coordinates(key, coordinates: dict, std, basis: jax.Array) -> dict:
    """The Gaussian mechanism of std ``std`` on a change in public coordinates: iid on ``eta1`` and ``diag``,
    :func:`~numpyro_dppvi.privacy.mechanisms.add_frobenius_symmetric_noise` on the symmetric ``core`` (the
    isometric coordinates of its Frobenius norm), and on ``cross`` iid noise projected onto the orthogonal
    complement of ``B``: ``Q_perp Z``, ``Q_perp`` ``[D, D - r]`` the complement's orthonormal basis from a complete QR
    of ``B`` and ``Z`` ``[D - r, r]`` from the library's sampler (``(D - r) r`` coordinates drawn, isotropic in the
    space ``cross`` lives in; ``Q_perp^T`` maps ``cross`` isometrically onto them). The noise
    is isotropic, std ``std``, on ``2 D + r (r + 1) / 2 + (D - r) r`` coordinates whose L2 norm is the norm
    :func:`change_coordinates` defines, so a release whose norm moves by at most ``Delta`` between neighbours has
    noise multiplier ``std / Delta``."""
    from ..privacy.mechanisms import add_frobenius_symmetric_noise, add_gaussian_noise, gaussian_noise_like

    k1, k2, k3, k4 = jax.random.split(key, 4)
    dim, rank = basis.shape
    complement = jnp.linalg.qr(basis, mode="complete")[0][:, rank:]  # [D, D - r]
    cross = coordinates["cross"]
    z = gaussian_noise_like(k4, jnp.zeros((dim - rank, rank), cross.dtype), std)
    return {"eta1": add_gaussian_noise(k1, coordinates["eta1"], std),
            "diag": add_gaussian_noise(k2, coordinates["diag"], std),
            "core": add_frobenius_symmetric_noise(k3, coordinates["core"], std),
            "cross": cross + complement @ z}


def floor_precision(proposal: Gaussian, precision_floor):
    """``(proposal', fired)``: the invalid-update rule ``"floor"`` for a low-rank proposal: when the smallest
    eigenvalue ``lambda_min`` of its precision is below the floor, the precision's diagonal is raised by
    ``floor - lambda_min`` (the smallest multiple of the identity that puts every eigenvalue at or above the
    floor; the family's structure kept, ``eta1`` kept, as the other families' rules)."""
    low = proposal.eta2
    precision = -2.0 * low.dense()
    smallest = jnp.min(jnp.linalg.eigvalsh(0.5 * (precision + precision.T)))
    fired = smallest < precision_floor
    lift = jnp.where(fired, precision_floor - smallest, 0.0)
    return Gaussian(proposal.eta1, low._replace(diag=low.diag - 0.5 * lift)), fired


def own_change(mine: dict, aggregate: dict, inverse: jax.Array, basis: jax.Array, weight) -> Gaussian:
    """What a client's factor takes in a round whose releases were summed (trusted aggregator, client-level DP):
    ``weight`` times its own unnoised coordinates ``mine`` (linear part) and its share of the aggregate's
    completion ``E_A K^+ E_A^T`` (:func:`from_coordinates`, ``K^+`` = ``inverse``), ``(E_m K^+ E_A^T + E_A K^+ E_m^T) / 2``;
    in the basis ``[B, E_m, E_A]``. The shares of the participants add up to the completion of the sum of their
    coordinates, so the server's noise factor takes only the noise and its cross terms (vanishing with it). The
    factor depends on its own rows and public values (the released aggregate) only: no noise share."""
    r = basis.shape[-1]
    eye, zero = jnp.eye(r, dtype=inverse.dtype), jnp.zeros((r, r), inverse.dtype)
    block = jnp.block([[mine["core"], eye, zero], [eye, zero, 0.5 * inverse], [zero, 0.5 * inverse, zero]])
    wide = jnp.concatenate([basis, mine["cross"] / SQRT2, aggregate["cross"] / SQRT2], axis=-1)
    return Gaussian(weight * mine["eta1"], LowRank(weight * mine["diag"], weight * block, wide))


def settle_aggregate(q: Gaussian, new_q: Gaussian, own: Gaussian, factor_states: Gaussian, noise_factor: Gaussian,
                     server_factor: Gaussian, rank: int, private=()):
    """After an aggregate round (trusted aggregator, client-level DP): ``new_q`` (basis ``[B, E_aggregate]``), each
    client's ``own`` change (stacked, bases ``[B, E_m]``) and the state's factors, all in ``q``'s basis ``B``.
    Widens the basis by every answer's columns, adds each own change to its factor and the remainder
    ``new_q - q - sum_m own_m`` (the noise, and the completion's share of it) to the server's noise factor, so that
    ``q = prior * t_0 * prod_m t_m * t_noise`` stays exact, then truncates to ``rank`` keeping ``q``'s mean
    (:func:`truncate_tree`); ``private`` (the clients' private states) is rebased alike. Returns
    ``(q', factors', noise_factor', server_factor', private', dropped share)``."""
    r = q.eta2.basis.shape[-1]
    wide = orthonormal_union(q.eta2.basis, jnp.concatenate([new_q.eta2.basis[:, r:], _columns(own.eta2.basis[..., r:])], 1))
    q_w, new_w, own_w = rebase(q, wide), rebase(new_q, wide), rebase(own, wide)
    factor_w, noise_w, server_w, private_w = rebase_tree((factor_states, noise_factor, server_factor, private), wide)
    remainder = factors.divide(factors.divide(new_w, q_w), factors.product(own_w))
    settled = (new_w, factors.multiply(factor_w, own_w), factors.multiply(noise_w, remainder), server_w, private_w)
    moved, dropped = truncate_tree(settled, new_w, rank)
    return (*moved, dropped)
