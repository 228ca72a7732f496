"""Gaussian factors in natural parameters: mean-field and full-rank.

A factor over the flat unconstrained vector ``u`` (length ``D``) is the unnormalised density

    t(u) = exp(eta1 . u + eta2 . u**2)                 (family "mean_field": eta2 is [D]),
    t(u) = exp(eta1 . u + u^T eta2 u)                  (family "full_rank": eta2 is [D, D], symmetric),

so for a proper Gaussian ``N(mu, s**2)``: ``eta1 = mu / s**2`` and ``eta2 = -1 / (2 s**2)``, and for
``N(mu, Lambda^{-1})``: ``eta1 = Lambda mu``, ``eta2 = -Lambda / 2`` (Heikkila et al. 2023, §3.1;
Ashman et al. 2022, eq. 3). Products, quotients, powers and damping add, subtract and scale natural
parameters, exactly, in both families (the same functions serve both). A PVI site factor ``t_m`` may
be improper (``eta2 >= 0`` somewhere; a precision that is not positive definite); the posterior and
every cavity must be proper (checked by :func:`is_proper`).

The family is in the shapes: ``eta2`` has one axis more than ``eta1`` for a full-rank factor
(:func:`is_full_rank`). Everything here is a pure function of :class:`Gaussian` pytrees; leaves may
carry leading batch axes (e.g. ``[M, D]`` and ``[M, D, D]`` for stacked client factors).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .privacy.noise import _x64


FAMILIES = ("mean_field", "full_rank", "low_rank")


class LowRank(NamedTuple):
    """The ``eta2`` of a low-rank factor (``family="low_rank"``): ``diag(diag) + basis core basis^T``.

    ``basis`` ``[D, k]`` has orthonormal columns in every stored state (the public basis ``B`` that ``q`` and
    every factor share, :mod:`numpyro_dppvi.pvi.low_rank`); ``core`` ``[k, k]`` is symmetric and signed (a site
    factor may remove precision). A client's answer may carry a wider, not orthonormal basis ``[B, E]``
    (:func:`~numpyro_dppvi.pvi.low_rank.from_coordinates`) until the server rebases it (:func:`rebase`). Sums, differences and multiples
    act on ``(diag, core)`` and keep the left operand's basis: both operands must share it (the server
    rebases every Gaussian of a state into one basis before adding), which is what makes products, quotients
    and damping exact in this family."""

    diag: jax.Array
    core: jax.Array
    basis: jax.Array

    def __add__(self, other):
        return LowRank(self.diag + other.diag, self.core + other.core, self.basis)

    def __sub__(self, other):
        return LowRank(self.diag - other.diag, self.core - other.core, self.basis)

    def __mul__(self, c):
        return LowRank(self.diag * c, self.core * c, self.basis)

    __rmul__ = __mul__

    def __neg__(self):
        return LowRank(-self.diag, -self.core, self.basis)

    def dense(self) -> jax.Array:
        """``diag(diag) + basis core basis^T`` as a ``[..., D, D]`` matrix."""
        eye = jnp.eye(self.diag.shape[-1], dtype=self.diag.dtype)
        return self.diag[..., :, None] * eye + self.basis @ self.core @ jnp.swapaxes(self.basis, -1, -2)


class Gaussian(NamedTuple):
    """Natural parameters of a (possibly improper) Gaussian factor: diagonal (``eta2`` shaped like
    ``eta1``), full-rank (``eta2`` with one more axis) or low-rank (``eta2`` a :class:`LowRank`)."""

    eta1: jax.Array
    eta2: Any


def is_low_rank(g: Gaussian) -> bool:
    """Whether ``g`` is a low-rank factor (static: read from the type of ``eta2``)."""
    return isinstance(g.eta2, LowRank)


def is_full_rank(g: Gaussian) -> bool:
    """Whether ``g`` is a full-rank factor (static: read from the shapes)."""
    return not is_low_rank(g) and jnp.ndim(g.eta2) == jnp.ndim(g.eta1) + 1


def family_of(g: Gaussian) -> str:
    """The family of the Gaussian factor ``g``: ``"low_rank"``, ``"full_rank"`` or ``"mean_field"``."""
    return "low_rank" if is_low_rank(g) else "full_rank" if is_full_rank(g) else "mean_field"


def rank_of(g: Gaussian) -> int:
    """The rank ``r`` of a low-rank ``g`` (its basis' columns); 0 for the other families."""
    return int(g.eta2.basis.shape[-1]) if is_low_rank(g) else 0


def num_coordinates(dim: int, family: str, rank: int = 0) -> int:
    """Free coordinates of one factor of ``family`` over ``dim`` latents: ``2 D`` mean-field (``eta1``, ``eta2``);
    ``D + D (D + 1) / 2 = D (D + 3) / 2`` full-rank (``eta1`` and the upper triangle of the symmetric ``eta2``),
    as many as the parameters a gradient optimiser moves (:func:`to_params`). The noise coordinates of one
    private release of a factor change or of a DP-SGD gradient (the ``dimension`` of its ledger event).
    Low-rank of rank ``r`` (``eta1``, the diagonal, the symmetric ``r x r`` core in the public basis ``B`` and
    the ``(D - r) r`` coordinates of a change's cross term ``E B^T + B E^T``, ``B^T E = 0``, that turns ``B``):
    ``2 D + r (r + 1) / 2 + (D - r) r``; ``D (D + 3) / 2`` at ``r = D``."""
    if family == "low_rank":
        return 2 * dim + rank * (rank + 1) // 2 + (dim - rank) * rank
    return dim * (dim + 3) // 2 if family == "full_rank" else 2 * dim


def num_parameters(dim: int, family: str, rank: int = 0) -> int:
    """Coordinates of the parameters a gradient optimiser moves (:func:`to_params`; DP-SGD's gradient and its
    noise): as :func:`num_coordinates` for mean-field and full-rank; low-rank ``(loc, log_scale, factor)``:
    ``2 D + D r``."""
    return 2 * dim + dim * rank if family == "low_rank" else num_coordinates(dim, family)


def resolved_rank(dim: int, rank: int | None = None) -> int:
    """The rank of a low-rank fit over ``dim`` latents: ``rank``, or ``round(sqrt(D))`` when it is not given, at most
    ``D``."""
    return min(rank or max(1, round(dim ** 0.5)), dim)


def check_family(family: str, caller: str) -> str:
    """``family`` when it is one of :data:`FAMILIES`, else a ValueError naming ``caller`` and the
    families (with what each is for)."""
    if family not in FAMILIES:
        raise ValueError(f"{caller}: unknown family {family!r}; choose one of {FAMILIES} (mean_field: independent "
                         "Gaussian coordinates; full_rank: a full precision matrix, for correlated posteriors; "
                         "low_rank: a diagonal plus rank-r precision, for many correlated latents)")
    return family


def initial_basis(dim: int, rank: int, dtype=jnp.float32) -> jax.Array:
    """The public basis a low-rank fit starts from: ``[D, r]`` orthonormal columns, a QR of a Gaussian
    matrix drawn from a seed that depends on ``(D, r)`` only (no data, no secret: it is released with the
    fit's settings). ``r = D``: the identity (the full-rank family)."""
    if rank >= dim:
        return jnp.eye(dim, dtype=dtype)
    draws = np.random.default_rng([dim, rank, 0x10A4]).normal(size=(dim, rank))
    return jnp.asarray(np.linalg.qr(draws)[0], dtype)


def zeros(dim: int, dtype=jnp.float32, family: str = "mean_field", basis=None) -> Gaussian:
    """The flat factor ``t(u) = 1`` (how every client factor starts); ``low_rank`` in ``basis``."""
    if family == "low_rank":
        k = basis.shape[-1]
        return Gaussian(jnp.zeros(dim, dtype), LowRank(jnp.zeros(dim, dtype), jnp.zeros((k, k), dtype),
                                                       jnp.asarray(basis, dtype)))
    shape = (dim, dim) if family == "full_rank" else (dim,)
    return Gaussian(jnp.zeros(dim, dtype), jnp.zeros(shape, dtype))


def to_full_rank(g: Gaussian) -> Gaussian:
    """A mean-field factor as a full-rank one (``eta2`` on the diagonal), a low-rank one with its ``eta2``
    formed densely; a full-rank one unchanged."""
    if is_low_rank(g):
        return Gaussian(g.eta1, g.eta2.dense())
    if is_full_rank(g):
        return g
    eye = jnp.eye(g.eta2.shape[-1], dtype=g.eta2.dtype)
    return Gaussian(g.eta1, g.eta2[..., :, None] * eye)


def as_family(g: Gaussian, family: str, basis=None) -> Gaussian:
    """``g`` (mean-field or full-rank) in ``family``: the embeddings of mean-field into full-rank and into
    low-rank (a zero core in ``basis``) exist; nothing is projected."""
    if family == "full_rank":
        return to_full_rank(g)
    if is_full_rank(g) or is_low_rank(g):
        raise ValueError(f"a {family_of(g)} factor has no exact {family} form")
    if family == "low_rank":
        k = basis.shape[-1]
        core = jnp.zeros(g.eta2.shape[:-1] + (k, k), g.eta2.dtype)
        return Gaussian(g.eta1, LowRank(g.eta2, core, jnp.broadcast_to(jnp.asarray(basis, g.eta2.dtype),
                                                                           g.eta2.shape[:-1] + basis.shape)))
    return g


def mean_and_precision(g: Gaussian) -> tuple[jax.Array, jax.Array]:
    """Full-rank ``g``: ``(mu, Lambda) = (Lambda^{-1} eta1, -2 eta2)`` (NaN means when ``Lambda`` is singular);
    low-rank ``g`` formed densely."""
    g = to_full_rank(g) if is_low_rank(g) else g
    precision = -2.0 * g.eta2
    return jnp.linalg.solve(precision, g.eta1[..., None])[..., 0], precision


def _full_rank_proper(g: Gaussian) -> jax.Array:
    mean, precision = mean_and_precision(g)
    chol = jnp.linalg.cholesky(0.5 * (precision + jnp.swapaxes(precision, -1, -2)))
    return (jnp.all(jnp.isfinite(chol)) & jnp.all(jnp.isfinite(g.eta1)) & jnp.all(jnp.isfinite(g.eta2))
            & jnp.all(jnp.isfinite(mean)))


def finite_coordinates(g: Gaussian) -> jax.Array:
    """``[..., D]`` bool: finite natural parameters and mean on each coordinate (full-rank: the
    coordinate's row of ``eta2``, and its mean; low-rank: formed densely)."""
    g = to_full_rank(g) if is_low_rank(g) else g
    if is_full_rank(g):
        mean, _ = mean_and_precision(g)
        return jnp.isfinite(g.eta1) & jnp.all(jnp.isfinite(g.eta2), axis=-1) & jnp.isfinite(mean)
    return jnp.isfinite(g.eta1) & jnp.isfinite(g.eta2) & jnp.isfinite(g.eta1 / g.eta2)


def precision_draws(mean: jax.Array, chol: jax.Array, eps: jax.Array) -> jax.Array:
    """``u_s = mean + L^{-T} eps_s``: draws of ``N(mean, Lambda^{-1})`` given ``L``, the Cholesky factor of
    ``Lambda = L L^T``, and standard-normal ``eps`` (``[S, D]``)."""
    return mean + jax.scipy.linalg.solve_triangular(chol, eps.T, lower=True, trans="T").T


def draws(g: Gaussian, eps: jax.Array) -> jax.Array:
    """Draws of a proper ``g`` from standard-normal ``eps`` (``[S, D]``): ``mu + s eps`` (mean-field),
    ``mu + L^{-T} eps`` with ``Lambda = L L^T`` (full-rank; low-rank formed densely)."""
    g = to_full_rank(g) if is_low_rank(g) else g
    if is_full_rank(g):
        mean, precision = mean_and_precision(g)
        return precision_draws(mean, jnp.linalg.cholesky(precision), eps)
    loc, scale_ = to_loc_scale(g)
    return loc + scale_ * eps


def from_loc_scale(loc, scale) -> Gaussian:
    """``eta1 = loc / scale**2``, ``eta2 = -1 / (2 scale**2)``."""
    precision = 1.0 / jnp.square(scale)
    return Gaussian(loc * precision, -0.5 * precision)


def to_loc_scale(g: Gaussian) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`from_loc_scale`; only meaningful where ``eta2 < 0``. For a full-rank factor:
    the means and the **marginal** sds ``sqrt(diag Lambda^{-1})`` (low-rank: the same)."""
    g = to_full_rank(g) if is_low_rank(g) else g
    if is_full_rank(g):
        mean, precision = mean_and_precision(g)
        return mean, jnp.sqrt(jnp.diagonal(jnp.linalg.inv(precision), axis1=-2, axis2=-1))
    precision = -2.0 * g.eta2
    return g.eta1 / precision, jnp.sqrt(1.0 / precision)


def from_loc_log_scale(params: dict) -> Gaussian:
    """From the optimiser's parametrisation ``{"loc", "log_scale"}``."""
    return from_loc_scale(params["loc"], jnp.exp(params["log_scale"]))


def to_loc_log_scale(g: Gaussian) -> dict:
    """``{"loc", "log_scale"}`` of ``g``: its means and the logs of its (marginal) sds, as
    :func:`to_loc_scale` gives them."""
    loc, scale = to_loc_scale(g)
    return {"loc": loc, "log_scale": jnp.log(scale)}


def scale_tril(params: dict) -> jax.Array:
    """The lower-triangular ``L`` (covariance ``L L^T``) of the full-rank parametrisation
    ``{"loc", "log_diag", "offdiag"}``: ``L_ii = exp(log_diag_i)``, the ``D (D - 1) / 2`` entries below the
    diagonal ``offdiag`` (row-major, ``numpy.tril_indices(D, -1)``)."""
    dim = params["loc"].shape[-1]
    rows, cols = jnp.tril_indices(dim, -1)
    lower = jnp.zeros(params["loc"].shape[:-1] + (dim, dim), params["loc"].dtype).at[..., rows, cols].set(
        params["offdiag"])
    return lower + jnp.exp(params["log_diag"])[..., None] * jnp.eye(dim, dtype=params["loc"].dtype)


def low_rank_draw_map(params: dict, eps: jax.Array) -> jax.Array:
    """Draws ``u_s = mu + s z_s`` of the low-rank parametrisation ``{"loc", "log_scale", "factor"}`` (precision
    ``Lambda = S^{-1} (I + W W^T) S^{-1}``, ``S = diag(exp(log_scale))``, ``W = factor`` ``[D, r]``) from
    standard-normal ``eps`` ``[S, D + r]``: ``c = eps_1 + W eps_2 ~ N(0, I + W W^T)``, ``z = (I + W W^T)^{-1} c =
    c - W (I + W^T W)^{-1} W^T c ~ N(0, (I + W W^T)^{-1})`` (Woodbury; ``O(D r^2)``, no ``D x D`` matrix, and a
    non-zero gradient in ``W`` at ``W = 0``)."""
    w = params["factor"]
    dim, rank = w.shape
    c = eps[:, :dim] + eps[:, dim:] @ w.T
    inner = jnp.eye(rank, dtype=w.dtype) + w.T @ w
    z = c - jnp.linalg.solve(inner, (c @ w).T).T @ w.T
    return params["loc"] + jnp.exp(params["log_scale"]) * z


def low_rank_covariance(params: dict) -> jax.Array:
    """``Sigma = S (I + W W^T)^{-1} S`` of the low-rank parametrisation, ``[D, D]``."""
    w, s = params["factor"], jnp.exp(params["log_scale"])
    inner = jnp.eye(w.shape[1], dtype=w.dtype) + w.T @ w
    middle = jnp.eye(w.shape[0], dtype=w.dtype) - w @ jnp.linalg.solve(inner, w.T)
    return s[:, None] * middle * s[None, :]


def low_rank_entropy(params: dict) -> jax.Array:
    """``H[q] = D log(2 pi e) / 2 + sum_i log s_i - log det(I + W^T W) / 2`` of the low-rank parametrisation."""
    w = params["factor"]
    dim, rank = w.shape
    inner = jnp.eye(rank, dtype=w.dtype) + w.T @ w
    return 0.5 * dim * jnp.log(2 * jnp.pi * jnp.e) + jnp.sum(params["log_scale"]) - 0.5 * jnp.linalg.slogdet(inner)[1]


def to_params(g: Gaussian) -> dict:
    """The parameters a gradient optimiser moves: ``{"loc", "log_scale"}`` (mean-field) or, full-rank, the
    mean and the Cholesky factor ``L`` of the covariance, ``{"loc", "log_diag", "offdiag"}``
    (:func:`scale_tril`): ``2 D`` and ``D (D + 3) / 2`` coordinates, unconstrained."""
    if is_low_rank(g):
        return _low_rank_to_params(g)
    if not is_full_rank(g):
        return to_loc_log_scale(g)
    dtype = g.eta1.dtype
    dim = g.eta1.shape[-1]
    with _x64():  # no explicit inverse, and float64: a precision of condition 1e7 round-trips to ~1e-9
        precision = -2.0 * g.eta2.astype(jnp.float64)
        precision = 0.5 * (precision + jnp.swapaxes(precision, -1, -2))
        mean = jnp.linalg.solve(precision, g.eta1.astype(jnp.float64)[..., None])[..., 0]
        # Sigma = Lambda^{-1} = L L^T with L lower: with J the reversal, J Lambda J = R R^T (R lower) gives
        # Lambda^{-1} = (J R^{-T} J)(J R^{-T} J)^T, and J R^{-T} J is lower-triangular
        flip = lambda m: jnp.flip(m, axis=(-2, -1))
        r = jnp.linalg.cholesky(flip(precision))
        r_inv = jax.scipy.linalg.solve_triangular(r, jnp.eye(dim, dtype=jnp.float64), lower=True)
        lower = flip(jnp.swapaxes(r_inv, -1, -2))
        rows, cols = jnp.tril_indices(dim, -1)
        params = {"loc": mean, "log_diag": jnp.log(jnp.diagonal(lower, axis1=-2, axis2=-1)),
                  "offdiag": lower[..., rows, cols]}
        return {k: v.astype(dtype) for k, v in params.items()}


def _low_rank_to_params(g: Gaussian) -> dict:
    """Low-rank ``g`` (precision ``diag(p) + B C B^T``) as ``{"loc", "log_scale", "factor"}``: ``S^{-2} = diag(p)``,
    ``W = S B C^{1/2}``, exact when ``p > 0`` and ``C >= 0`` (the case of every ``q`` of a low-rank fit: its core is
    a sum of positive semi-definite client terms). ``C``'s negative eigenvalues (rounding) count as 0; a ``p <= 0``
    gives NaN parameters, which the server drops as a failed update."""
    low = g.eta2
    mean, _ = mean_and_precision(g)
    diag = -2.0 * low.diag
    values, vectors = jnp.linalg.eigh(-low.core - jnp.swapaxes(low.core, -1, -2))  # C = -2 core, symmetrised
    root = vectors * jnp.sqrt(jnp.maximum(values, 0.0))
    scale = jnp.where(diag > 0, 1.0 / jnp.sqrt(jnp.where(diag > 0, diag, 1.0)), jnp.nan)
    return {"loc": mean, "log_scale": jnp.log(scale), "factor": scale[..., :, None] * (low.basis @ root)}


def prepend_basis(g: Gaussian, basis: jax.Array) -> Gaussian:
    """Low-rank ``g`` (basis ``U``, core ``X``) written in the basis ``[basis, U]`` with the core
    ``blockdiag(0, X)``: the same Gaussian, in a basis whose first columns are ``basis`` (how a client's answer
    is handed to the server, :func:`numpyro_dppvi.pvi.low_rank.changes`)."""
    low, r = g.eta2, basis.shape[-1]
    k = low.core.shape[-1]
    core = jnp.zeros((r + k, r + k), low.core.dtype).at[r:, r:].set(low.core)
    return Gaussian(g.eta1, LowRank(low.diag, core, jnp.concatenate([basis, low.basis], axis=-1)))


def from_params(params: dict) -> Gaussian:
    """Inverse of :func:`to_params` (the family read from the keys): full-rank ``Lambda = L^{-T} L^{-1}``,
    ``eta1 = Lambda loc``, ``eta2 = -Lambda / 2``."""
    if "factor" in params:  # low-rank: diag(s^-2) + U U^T, U = S^{-1} W (not orthonormal), core -I / 2
        scale = jnp.exp(params["log_scale"])
        u = params["factor"] / scale[..., :, None]
        rank = u.shape[-1]
        eta2 = LowRank(-0.5 / jnp.square(scale), -0.5 * jnp.eye(rank, dtype=u.dtype), u)
        return Gaussian(-2.0 * eta2.dense() @ params["loc"], eta2)
    if "offdiag" not in params:
        return from_loc_log_scale(params)
    lower = scale_tril(params)
    dim = lower.shape[-1]
    inverse = jax.scipy.linalg.solve_triangular(lower, jnp.eye(dim, dtype=lower.dtype), lower=True)
    precision = inverse.T @ inverse
    precision = 0.5 * (precision + precision.T)
    return Gaussian(precision @ params["loc"], -0.5 * precision)


def multiply(a: Gaussian, b: Gaussian) -> Gaussian:
    """Product of factors: natural parameters add."""
    return Gaussian(a.eta1 + b.eta1, a.eta2 + b.eta2)


def divide(a: Gaussian, b: Gaussian) -> Gaussian:
    """Quotient ``a / b`` (e.g. the cavity ``q / t_m``): natural parameters subtract."""
    return Gaussian(a.eta1 - b.eta1, a.eta2 - b.eta2)


def scale(a: Gaussian, c) -> Gaussian:
    """The power ``a**c``: natural parameters times ``c``."""
    return Gaussian(a.eta1 * c, a.eta2 * c)


def damp(old: Gaussian, new: Gaussian, rho) -> Gaussian:
    """Damped update ``old + rho (new - old)`` (Heikkila et al. 2023, Algorithm 1)."""
    return Gaussian(old.eta1 + rho * (new.eta1 - old.eta1), old.eta2 + rho * (new.eta2 - old.eta2))


def product(factors: Gaussian, axis: int = 0) -> Gaussian:
    """Product over a stacked axis of factors (sum of natural parameters; low-rank: in their shared basis)."""
    if is_low_rank(factors):
        low = factors.eta2
        return Gaussian(jnp.sum(factors.eta1, axis=axis),
                        LowRank(jnp.sum(low.diag, axis=axis), jnp.sum(low.core, axis=axis), jnp.take(low.basis, 0, axis)))
    return Gaussian(jnp.sum(factors.eta1, axis=axis), jnp.sum(factors.eta2, axis=axis))


def is_proper(g: Gaussian) -> jax.Array:
    """True when every coordinate has ``eta2 < 0``, all parameters are finite and so are the means
    ``-eta1 / (2 eta2)`` (finite natural parameters can overflow the mean: ``-4e36 / 0.1`` in float32).
    Full-rank: the precision ``-2 eta2`` positive definite (a finite Cholesky factor), all parameters and
    the mean finite (low-rank: the same of its dense form)."""
    if is_full_rank(g) or is_low_rank(g):
        return _full_rank_proper(to_full_rank(g))
    return (jnp.all(g.eta2 < 0) & jnp.all(jnp.isfinite(g.eta1)) & jnp.all(jnp.isfinite(g.eta2))
            & jnp.all(jnp.isfinite(g.eta1 / g.eta2)))


def check_proper(g: Gaussian, what: str, advice: str = "use more damping (a smaller `damping`) or fewer "
                                                          "local steps so updates stay valid") -> None:
    """Host-side check raising a ``ValueError`` that says which object is invalid, why, and ``advice``
    (in the options of the function the user called)."""
    g = to_full_rank(g) if is_low_rank(g) else g
    eta1, eta2 = np.asarray(g.eta1), np.asarray(g.eta2)
    if eta2.ndim == eta1.ndim + 1:
        if not (np.all(np.isfinite(eta1)) and np.all(np.isfinite(eta2))):
            raise ValueError(f"{what} has non-finite natural parameters: {advice}.")
        smallest = float(np.min(np.linalg.eigvalsh(-(eta2 + np.swapaxes(eta2, -1, -2)))))
        if not smallest > 0 or not bool(_full_rank_proper(g)):
            raise ValueError(f"{what} is not a proper Gaussian: its precision matrix is not positive definite "
                             f"(smallest eigenvalue {smallest:.3g}): {advice}.")
        return
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        finite = np.all(np.isfinite(eta1)) and np.all(np.isfinite(eta2)) and np.all(np.isfinite(eta1 / eta2))
    if not finite:
        raise ValueError(f"{what} has non-finite natural parameters or means: {advice}.")
    bad = np.flatnonzero(np.reshape(eta2 >= 0, -1))
    if bad.size:
        raise ValueError(
            f"{what} is not a proper Gaussian: eta2 >= 0 (non-positive precision) at "
            f"{bad.size} coordinate(s), first index {int(bad[0])}: {advice}."
        )


def expected_log_factor(loc, scale_, g: Gaussian) -> jax.Array:
    """``E_{N(loc, scale**2)}[log t(u)] = eta1 . loc + eta2 . (loc**2 + scale**2)`` summed over coordinates.

    ``t`` may be improper or flat (all zeros): this is the data-free part of the local objective,
    which equals ``-KL(q || t) - H[q]`` up to ``t``'s log normaliser when ``t`` is proper.
    """
    return jnp.sum(g.eta1 * loc + g.eta2 * (jnp.square(loc) + jnp.square(scale_)))


def expected_log_factor_full(mean, covariance, g: Gaussian) -> jax.Array:
    """``E_{N(mean, covariance)}[log t(u)] = eta1 . mean + tr(eta2 (covariance + mean mean^T))`` for a
    full-rank ``t`` (possibly improper or flat)."""
    return g.eta1 @ mean + jnp.sum(g.eta2 * (covariance + jnp.outer(mean, mean)))


def entropy(scale_) -> jax.Array:
    """Entropy of a diagonal Gaussian: ``sum_d (0.5 log(2 pi e) + log s_d)``."""
    return jnp.sum(0.5 * jnp.log(2 * jnp.pi * jnp.e) + jnp.log(scale_))


def kl(q: Gaussian, p: Gaussian) -> jax.Array:
    """Analytic ``KL(q || p)`` of proper diagonal Gaussians, summed over coordinates:

    ``sum_d log(s_p/s_q) + (s_q^2 + (mu_q - mu_p)^2) / (2 s_p^2) - 1/2``;
    full-rank (either one): ``(tr(Lambda_q^{-1} Lambda_p) + d^T Lambda_p d - D + log|Lambda_q| - log|Lambda_p|) / 2``
    with ``d = mu_p - mu_q``.
    """
    if is_full_rank(q) or is_full_rank(p) or is_low_rank(q) or is_low_rank(p):
        (mq, lq), (mp, lp) = mean_and_precision(to_full_rank(q)), mean_and_precision(to_full_rank(p))
        diff = mp - mq
        dim = mq.shape[-1]
        return 0.5 * (jnp.trace(jnp.linalg.solve(lq, lp)) + diff @ lp @ diff - dim
                      + jnp.linalg.slogdet(lq)[1] - jnp.linalg.slogdet(lp)[1])
    mq, sq = to_loc_scale(q)
    mp, sp = to_loc_scale(p)
    return jnp.sum(jnp.log(sp / sq) + (jnp.square(sq) + jnp.square(mq - mp)) / (2 * jnp.square(sp)) - 0.5)
