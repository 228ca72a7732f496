"""One-hidden-layer sigmoid belief network for VIPS (paper §7, Algorithm 6, Appendix 4-5).

Model for a binary vector ``y_n`` of ``J`` visible units with ``K`` binary hidden units::

    z_nk ~ Bernoulli(sigmoid(b_k)),     y_nj ~ Bernoulli(sigmoid(w_j^T z_n + c_j))

with Gaussian priors ``w~_j = (w_j, c_j) ~ N(0, diag(1/prior_precision_w, 1/prior_precision_c))``
and ``b_k ~ N(0, 1/prior_precision_b)`` (the paper's three-parameter-beta shrinkage prior on
``W`` is replaced by this Gaussian prior; everything else follows Algorithm 6).

Polya-Gamma augmentation (Eq. 63-65) makes both layers Gaussian in the weights given
``omega_nj ~ PG(1, .)`` and ``xi_k ~ PG(1, .)``. Write ``z~ = (z, 1)``. The E-step, for one
image, alternates::

    omega_nj = E_PG(sqrt(E[(w~_j^T z~_n)^2]))                                   (Eq. 67)
    q(z_nk) = Bernoulli(sigmoid(d_nk)), updated for k = 1..K in turn, with      (Eq. 69-71)
    d_nk = E[b_k] + sum_j (y_nj - 1/2) E[w_jk]
           - 1/2 sum_j omega_nj (E[w_jk^2] + 2 sum_{l != k} E[w_jk w~_jl] E[z~_nl])

and returns the ESS blocks (sums over ``n`` are the released quantities)::

    z_count = (E[z_n] - 1/2, 1)             |.| <= sqrt(K/4 + 1)
    yz      = (y_n - 1/2) E[z~_n]^T          |.|_F <= (sqrt(J)/2) sqrt(K+1)
    wzz     = omega_nj E[z~_n z~_n^T] (J matrices, symmetric)
                                           |.|_F <= (sqrt(J)/4) (K+1)

using ``|y_nj - 1/2| = 1/2``, ``0 <= E[z] <= 1`` and ``omega <= 1/4`` (Appendix 4, Eq. 79-84, for
our grouping of the weights with the bias ``c_j``). The count in ``z_count`` lets the M-step
use ``N`` without treating it as public.

M-step (Appendix 5): ``Lambda_j = prior + sum wzz_j``, ``Lambda_j mu_j = sum yz_j``;
``Lambda_b = prior_b + N E[xi]`` with ``E[xi_k] = E_PG(sqrt(E[b_k^2]))`` from the current
``q(b)`` and ``Lambda_b mu_b = sum (E[z] - 1/2)``. The paper releases the blocks jointly with
noise ``sqrt(B) sigma`` after rescaling by their bounds (Eq. 72), which is exactly what
:func:`numpyro_dppvi.fit_vips` does for every model.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_dppvi.vips.engine import ConjugateModelBase
from numpyro_dppvi.vips.polya_gamma import PG_MEAN_MAX, polya_gamma_mean
from numpyro_dppvi.privacy.mechanisms import project_psd


def _augmented_second_moment(z_mean):
    """``E[z~ z~^T]`` for independent Bernoulli ``z`` and ``z~ = (z, 1)``: off-diagonal
    ``E[z_k] E[z_l]``, diagonal ``E[z_k]`` (``z^2 = z``)."""
    z_aug = jnp.concatenate([z_mean, jnp.ones((1,), z_mean.dtype)])
    outer = jnp.outer(z_aug, z_aug)
    return outer + jnp.diag(z_aug - z_aug**2), z_aug


class SigmoidBeliefNet(ConjugateModelBase):
    """One-hidden-layer SBN (see the module docstring). Data: ``(y [N, J],)`` in ``{0, 1}``.

    Args:
        num_visible: ``J``, the number of visible (binary) units: the length of ``y_n``.
        num_hidden: ``K``, the number of binary hidden units.
        prior_precision_w: the Gaussian prior precision of the weights ``w_j``, positive. Default 1.
        prior_precision_c: the Gaussian prior precision of the visible biases ``c_j``, positive. Default 1.
        prior_precision_b: the Gaussian prior precision of the hidden biases ``b_k``, positive. Default 1.
        inner_iterations: alternations of the ``omega`` and ``z`` updates in the E-step.
        init_scale: std of the random (data-independent) initial weight means, and of the
            initial ``q(w)``.
    """

    symmetric_blocks = ("wzz",)

    def __init__(self, num_visible: int, num_hidden: int, prior_precision_w=1.0, prior_precision_c=1.0,
                 prior_precision_b=1.0, inner_iterations: int = 5, init_scale: float = 0.1):
        if num_visible < 1 or num_hidden < 1:
            raise ValueError("num_visible and num_hidden must be positive.")
        self.num_visible, self.num_hidden = int(num_visible), int(num_hidden)
        for name, value in (("prior_precision_w", prior_precision_w), ("prior_precision_c", prior_precision_c),
                            ("prior_precision_b", prior_precision_b)):
            if not float(value) > 0:
                raise ValueError(f"{name} must be positive, got {value}.")
        self.prior_precision_w = float(prior_precision_w)
        self.prior_precision_c = float(prior_precision_c)
        self.prior_precision_b = float(prior_precision_b)
        self.inner_iterations = int(inner_iterations)
        self.init_scale = float(init_scale)
        j, k = self.num_visible, self.num_hidden
        self.block_bounds = {"z_count": math.sqrt(k / 4.0 + 1.0),
                             "yz": 0.5 * math.sqrt(j) * math.sqrt(k + 1.0),
                             "wzz": PG_MEAN_MAX * math.sqrt(j) * (k + 1.0)}

    # ------------------------------------------------------------------ parameters
    def _prior_weight_precision(self):
        diag = jnp.concatenate([jnp.full((self.num_hidden,), self.prior_precision_w),
                                jnp.full((1,), self.prior_precision_c)])
        return jnp.broadcast_to(jnp.diag(diag), (self.num_visible,) + (self.num_hidden + 1,) * 2)

    def prior_params(self):
        j, k = self.num_visible, self.num_hidden
        return {"w_eta": jnp.zeros((j, k + 1)), "w_prec": self._prior_weight_precision(),
                "b_eta": jnp.zeros((k,)), "b_prec": jnp.full((k,), self.prior_precision_b)}

    def init_params(self, rng_key):
        """Random weight means of std ``init_scale`` with variance ``init_scale^2`` (not the prior's):
        starting from the broad prior, ``sum_j omega_j Var[w_jk]`` would switch every hidden unit
        off in the first E-step and it would never recover."""
        params = self.prior_params()
        mean = self.init_scale * jax.random.normal(rng_key, params["w_eta"].shape)
        eye = jnp.eye(self.num_hidden + 1)
        w_prec = jnp.broadcast_to(eye / self.init_scale**2, params["w_prec"].shape)
        return {**params, "w_prec": w_prec, "w_eta": jnp.einsum("jab,jb->ja", w_prec, mean)}

    @staticmethod
    def _weight_moments(params):
        chol = jnp.linalg.cholesky(params["w_prec"])
        eye = jnp.eye(params["w_prec"].shape[-1], dtype=params["w_prec"].dtype)
        cov = jax.vmap(lambda c: jax.scipy.linalg.cho_solve((c, True), eye))(chol)
        mean = jnp.einsum("jab,jb->ja", cov, params["w_eta"])
        return mean, cov

    def expected_natural_params(self, params):
        mean, cov = self._weight_moments(params)
        b_mean = params["b_eta"] / params["b_prec"]
        return {"w_mean": mean, "w_second": cov + jnp.einsum("ja,jb->jab", mean, mean),
                "b_mean": b_mean, "b_second": 1.0 / params["b_prec"] + b_mean**2}

    # ------------------------------------------------------------------ E-step
    def hidden_posterior(self, enp, y):
        """``(E[z] [K], omega [J])`` for one binary image ``y`` after the inner iterations."""
        k = self.num_hidden
        w_mean, w_second = enp["w_mean"], enp["w_second"]
        drive = enp["b_mean"] + (y - 0.5) @ w_mean[:, :k]  # the terms of d_k free of z

        def sweep(_, z_mean):
            ezz, _ = _augmented_second_moment(z_mean)
            psi2 = jnp.einsum("jab,ab->j", w_second, ezz)
            omega = polya_gamma_mean(jnp.sqrt(jnp.maximum(psi2, 0.0)))
            weighted = jnp.einsum("j,jab->ab", omega, w_second)  # sum_j omega_j E[w~_j w~_j^T]

            def update_unit(i, z):
                z_aug = jnp.concatenate([z, jnp.ones((1,), z.dtype)])
                cross = weighted[i] @ z_aug - weighted[i, i] * z_aug[i]
                d = drive[i] - 0.5 * (weighted[i, i] + 2.0 * cross)
                return z.at[i].set(jax.nn.sigmoid(d))

            return jax.lax.fori_loop(0, k, update_unit, z_mean)

        z0 = jax.nn.sigmoid(enp["b_mean"]).astype(w_mean.dtype)
        z_mean = jax.lax.fori_loop(0, self.inner_iterations, sweep, z0)
        ezz, _ = _augmented_second_moment(z_mean)
        omega = polya_gamma_mean(jnp.sqrt(jnp.maximum(jnp.einsum("jab,ab->j", w_second, ezz), 0.0)))
        return z_mean, omega

    def example_ess(self, expected_natural_params, example):
        (y,) = example
        z_mean, omega = self.hidden_posterior(expected_natural_params, y)
        ezz, z_aug = _augmented_second_moment(z_mean)
        return {"z_count": jnp.concatenate([z_mean - 0.5, jnp.ones((1,), z_mean.dtype)]),
                "yz": jnp.outer(y - 0.5, z_aug),
                "wzz": omega[:, None, None] * ezz[None]}

    # ------------------------------------------------------------------ M-step
    def m_step(self, params, ess_total):
        k = self.num_hidden
        xi = polya_gamma_mean(jnp.sqrt(1.0 / params["b_prec"] + (params["b_eta"] / params["b_prec"]) ** 2))
        count = ess_total["z_count"][k]
        return {"w_eta": ess_total["yz"], "w_prec": self._prior_weight_precision() + ess_total["wzz"],
                "b_eta": ess_total["z_count"][:k], "b_prec": self.prior_precision_b + count * xi}

    def postprocess_noisy_ess(self, ess_total):
        k = self.num_hidden
        count = jnp.maximum(ess_total["z_count"][k], 0.0)
        return {"z_count": ess_total["z_count"].at[k].set(count), "yz": ess_total["yz"],
                "wzz": project_psd(ess_total["wzz"], 0.0)}

    def validate_data(self, data):
        y = data[0] if isinstance(data, (tuple, list)) and len(data) == 1 else None
        if y is None:
            raise ValueError("SigmoidBeliefNet data must be a 1-tuple (y [N, J],) of binary images.")
        y = jnp.asarray(y)
        if y.ndim != 2 or y.shape[1] != self.num_visible:
            raise ValueError(f"y must have shape [N, {self.num_visible}], got {y.shape}.")
        if not np.all(np.isin(np.asarray(y), (0, 1))):
            raise ValueError("SigmoidBeliefNet data must be binary (0/1); binarise the images first.")
        return (y.astype(jnp.result_type(float)),)

    # ------------------------------------------------------------------ outputs
    def sample_posterior(self, params, rng_key, num_samples):
        key_w, key_b = jax.random.split(rng_key)
        mean, cov = self._weight_moments(params)
        chol = jnp.linalg.cholesky(cov)
        z = jax.random.normal(key_w, (num_samples,) + mean.shape, mean.dtype)
        w = mean + jnp.einsum("jab,sjb->sja", chol, z)
        b_mean = params["b_eta"] / params["b_prec"]
        b = b_mean + jax.random.normal(key_b, (num_samples, self.num_hidden)) / jnp.sqrt(params["b_prec"])
        return {"W": w[..., :self.num_hidden], "c": w[..., self.num_hidden], "b": b}

    def reconstruct(self, params, y):
        """``P(y_j = 1)`` reconstructed from each image's own hidden posterior: ``[N, J]``
        (``sigmoid(E[w~_j]^T E[z~_n])``)."""
        enp = self.expected_natural_params(params)
        y = jnp.asarray(y, dtype=enp["w_mean"].dtype)
        z_mean, _ = jax.vmap(self.hidden_posterior, in_axes=(None, 0))(enp, y)
        z_aug = jnp.concatenate([z_mean, jnp.ones((z_mean.shape[0], 1), z_mean.dtype)], axis=1)
        return jax.nn.sigmoid(z_aug @ enp["w_mean"].T)

    def pixel_accuracy(self, params, y):
        """Fraction of pixels whose thresholded reconstruction equals the image (paper §7.1)."""
        probs = self.reconstruct(params, y)
        return float(jnp.mean((probs > 0.5) == (jnp.asarray(y) > 0.5)))
