"""The conjugate-exponential model interface and the ESS-level operations VIPS is built from.

A conjugate-exponential (CE) model (VIPS paper, Park et al. 2020, §2.5.3) has global
parameters ``m`` with a conjugate prior of natural parameters ``nu`` and a complete-data
likelihood ``p(D_n, l_n | m) ∝ exp(n(m)^T s(D_n, l_n))``. Variational Bayes alternates::

    E-step: q(l_n) from the expected natural parameters  n̄ = E_q(m)[n(m)]       (Eq. 18)
            -> expected sufficient statistics (ESS)   s̄_n = E_q(l_n)[s(D_n, l_n)]
    M-step: q(m) with natural parameters  ν̃ = ν + N s̄                          (Eq. 19)

and the data enter the M-step only through the summed ESS. VIPS privatises exactly that
sum (§3): each example's ESS is clipped block by block to a declared L2 bound, the
blocks are rescaled by their bounds and released together with one Gaussian draw.

This module holds the interface (:class:`ConjugateModel`, with defaults in
:class:`ConjugateModelBase`) and the pure functions on ESS pytrees: per-example block
clipping, the clipped minibatch sum, the joint Gaussian release and the step size.
The driver that loops over iterations is :mod:`numpyro_dppvi.vips.fit`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

Params = Any  # pytree of the global variational parameters (natural parameters + hyper)
ESS = dict  # block name -> array (per example, or summed over examples)
#: The most per-example statistics (numbers, all blocks of all records) a batch's sum holds at once: 2^23, 32 MB
#: a copy in float32; larger batches are summed in chunks (:meth:`ConjugateModelBase.clipped_ess_sum`). Measured
#: (Adult, 39,074 records, D = 109, full batch, 10 Polya-Gamma iterations, second calls): one pass 6.6-7.8 s and
#: 4.3 GB resident; in chunks 11.5-12.6 s (the same for 2^21, 2^23 and 2^25) and 0.7 GB. A model whose blocks are
#: rank one (``w_i x_i x_i^T``) could sum them as ``X^T diag(w) X`` in one product instead.
ESS_CHUNK_ELEMENTS = 2**23


@runtime_checkable
class ConjugateModel(Protocol):
    """What :func:`fit_vips` needs from a conjugate-exponential model.

    Attributes:
        block_bounds: block name -> bound on the L2 (Frobenius) norm of ONE example's
            contribution to that ESS block. Clipping enforces it; the sensitivity
            argument of the release rests on it.
        symmetric_blocks: names of blocks whose last two axes are a symmetric matrix
            (noise is drawn on the upper triangle and mirrored, as Analyze Gauss does).
    """

    block_bounds: Mapping[str, float]
    symmetric_blocks: tuple

    def prior_params(self) -> Params: ...

    def init_params(self, rng_key) -> Params: ...

    def expected_natural_params(self, params: Params) -> Any: ...

    def example_ess(self, expected_natural_params: Any, example: tuple) -> ESS: ...

    def clipped_ess_sum(self, expected_natural_params, batch, mask, bounds) -> tuple: ...

    def postprocess_noisy_ess(self, ess_total: ESS) -> ESS: ...

    def m_step(self, params: Params, ess_total: ESS) -> Params: ...

    def refresh(self, params: Params) -> Params: ...

    def validate_data(self, data: tuple) -> tuple: ...

    def sample_posterior(self, params: Params, rng_key, num_samples: int) -> dict: ...


_REQUIRED_METHODS = ("prior_params", "expected_natural_params", "example_ess", "m_step",
                     "clipped_ess_sum", "sample_posterior")


def is_conjugate_model(obj) -> bool:
    """True when ``obj`` implements the :class:`ConjugateModel` methods (checked on its type,
    so that properties such as ``block_bounds`` are not evaluated)."""
    return all(callable(getattr(type(obj), name, None)) for name in _REQUIRED_METHODS)


class ConjugateModelBase:
    """Defaults shared by the models: dense per-example ESS, no hyperparameters.

    Subclasses implement ``prior_params``, ``expected_natural_params``, ``example_ess``,
    ``m_step`` and ``sample_posterior`` and set ``block_bounds`` / ``symmetric_blocks``.
    Every instance remembers its constructor arguments (:meth:`init_config`), so a saved fit can
    rebuild its model from plain JSON, without pickle.
    """

    block_bounds: Mapping[str, float] = {}
    symmetric_blocks: tuple = ()
    #: whether ``example_ess`` reads q's expected natural parameters (latent variables per record: the E-step).
    #: ``False`` (linear regression): :func:`~numpyro_dppvi.vips.fit.fit_vips` blends the released statistics as
    #: they are and projects them onto the valid set once, at the end (:func:`~numpyro_dppvi.vips.fit.deferred_validity`).
    ess_uses_params: bool = True

    def __new__(cls, *args, **kwargs):
        instance = super().__new__(cls)
        instance._init_args = (args, kwargs)
        return instance

    def init_config(self) -> dict:
        """``{"class", "args", "kwargs"}`` in JSON types: how to rebuild this model (:func:`model_from_config`)."""
        args, kwargs = getattr(self, "_init_args", ((), {}))
        return {"class": type(self).__name__, "args": [_to_json(a) for a in args],
                "kwargs": {k: _to_json(v) for k, v in kwargs.items()}}

    def init_params(self, rng_key) -> Params:
        """Start of the stochastic VB iterations: the prior (no data seen)."""
        del rng_key
        return self.prior_params()

    def clipped_ess_sum(self, expected_natural_params, batch, mask, bounds):
        """Sum over the masked batch of the per-example ESS, each block clipped to its bound.

        ``bounds=None`` sums without clipping (non-private fits). Returns
        ``(ess_sum, num_clipped)`` where ``num_clipped`` counts examples of which at least
        one block was scaled down.

        The per-example statistics are held for at most :data:`ESS_CHUNK_ELEMENTS` numbers at a
        time: a large batch is summed in chunks (``lax.scan``), since a full-batch fit of a
        ``D x D`` block holds ``N D^2`` of them (Adult, ``D = 109``: 39,074 records, 1.9 GB a copy in float32).
        Each record is still clipped on its own, so the sum and its sensitivity are the same.
        """
        size = self._example_ess_size(expected_natural_params, batch)
        num = mask.shape[0]
        chunk = max(1, min(num, ESS_CHUNK_ELEMENTS // max(size, 1)))
        if chunk >= num:
            return self._clipped_chunk_sum(expected_natural_params, batch, mask, bounds)
        pad = (-num) % chunk
        # padding repeats the last record with mask 0: a real record (finite, valid), summed with weight 0
        batch = jax.tree_util.tree_map(
            lambda a: jnp.concatenate([a, jnp.repeat(a[-1:], pad, axis=0)]).reshape((-1, chunk) + a.shape[1:]),
            batch)
        mask = jnp.concatenate([mask, jnp.zeros(pad, mask.dtype)]).reshape(-1, chunk)

        def add_chunk(total, chunk_and_mask):
            ess, clipped = self._clipped_chunk_sum(expected_natural_params, *chunk_and_mask, bounds)
            return jax.tree_util.tree_map(jnp.add, total, (ess, clipped)), None

        zero = jax.eval_shape(self._clipped_chunk_sum, expected_natural_params,
                              jax.tree_util.tree_map(lambda a: a[0], batch), mask[0], bounds)
        zero = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), zero)
        total, _ = jax.lax.scan(add_chunk, zero, (batch, mask))
        return total

    def _example_ess_size(self, expected_natural_params, batch) -> int:
        """How many numbers one record's statistics hold (all blocks)."""
        example = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), batch)
        shapes = jax.eval_shape(self.example_ess, expected_natural_params, example)
        return int(sum(np.prod(s.shape, dtype=int) for s in jax.tree_util.tree_leaves(shapes)))

    def _clipped_chunk_sum(self, expected_natural_params, batch, mask, bounds):
        per_example = jax.vmap(self.example_ess, in_axes=(None, 0))(
            expected_natural_params, batch)
        if bounds is None:
            return masked_block_sum(per_example, mask), jnp.zeros((), jnp.int32)
        clipped, was_clipped = clip_example_blocks(per_example, bounds)
        return masked_block_sum(clipped, mask), jnp.sum(was_clipped & mask).astype(jnp.int32)

    def postprocess_noisy_ess(self, ess_total: ESS) -> ESS:
        """Map a noisy ESS sum back into the set of valid sums (identity by default)."""
        return ess_total

    def refresh(self, params: Params) -> Params:
        """Hyperparameter updates after the blending step (identity by default)."""
        return params

    def validate_data(self, data: tuple) -> tuple:
        return data


# --------------------------------------------------------------------------- ESS algebra

def block_norms(per_example_ess: ESS) -> ESS:
    """L2 (Frobenius) norm of each block of each example: arrays of shape ``[batch]``."""
    return {name: jnp.sqrt(jnp.sum(jnp.reshape(block, (block.shape[0], -1)) ** 2, axis=1))
            for name, block in per_example_ess.items()}


def clip_example_blocks(per_example_ess: ESS, bounds: Mapping[str, float]):
    """Scale each example's block ``b`` to norm at most ``bounds[b]``: ``s <- s min(1, C_b/|s|)``.

    After this, one example changes the sum of block ``b`` by at most ``C_b`` in L2
    (add/remove relation) whatever the data and the current ``q``. An example with a non-finite
    entry in any block contributes zero (within the bound; it can never make the release
    non-finite). Returns the clipped ESS and a ``[batch]`` bool marking examples of which some
    block was scaled down (a private diagnostic: never released).
    """
    finite = None
    for block in per_example_ess.values():
        ok = jnp.all(jnp.isfinite(jnp.reshape(block, (block.shape[0], -1))), axis=1)
        finite = ok if finite is None else finite & ok
    per_example_ess = {name: jnp.where(finite.reshape((-1,) + (1,) * (block.ndim - 1)), block, 0.0)
                       for name, block in per_example_ess.items()}
    norms = block_norms(per_example_ess)
    clipped, any_clipped = {}, None
    for name, block in per_example_ess.items():
        bound = bounds[name]
        factor = jnp.minimum(1.0, bound / jnp.maximum(norms[name], 1e-30))
        clipped[name] = block * factor.reshape((-1,) + (1,) * (block.ndim - 1)).astype(block.dtype)
        flag = norms[name] > bound * (1.0 + 1e-6)
        any_clipped = flag if any_clipped is None else any_clipped | flag
    return clipped, any_clipped


def masked_block_sum(per_example_ess: ESS, mask) -> ESS:
    """``sum_i mask_i s_i`` for every block (padding rows of a Poisson batch drop out)."""
    return {name: jnp.tensordot(mask.astype(block.dtype), block, axes=(0, 0))
            for name, block in per_example_ess.items()}


def scale_bounds(bounds: Mapping[str, float], factor: float) -> dict:
    """Multiply every block bound by ``factor`` (``Privacy.clip``, the paper's ``a``)."""
    return {name: float(bound) * float(factor) for name, bound in bounds.items()}


def joint_sensitivity(bounds: Mapping[str, float]) -> float:
    """L2 sensitivity of the sum after each block is divided by its bound: ``sqrt(B)``.

    One example's rescaled block ``s_b / C_b`` has norm <= 1, so the concatenation of the
    ``B`` rescaled blocks has norm <= ``sqrt(B)`` (paper §7, Eq. 72). Under add/remove
    this is the sensitivity of the rescaled sum; under substitution it doubles.
    """
    return math.sqrt(len(bounds))


def step_size(t, tau0: float, kappa: float):
    """Robbins-Monro step ``rho_t = (tau0 + t)^(-kappa)`` (paper §2.5.4, Algorithm 1)."""
    return (tau0 + t) ** (-kappa)


def blend(old: Params, target: Params, rho) -> Params:
    """``nu <- (1 - rho) nu_old + rho nu_target`` on every leaf (Algorithm 1, M-step)."""
    return jax.tree_util.tree_map(lambda a, b: (1.0 - rho) * a + rho * b, old, target)


def scale_ess(ess: ESS, factor) -> ESS:
    """Every block of the ESS pytree ``ess`` multiplied by ``factor`` (e.g. ``N / S``, from a batch sum
    to an estimate of the sum over all rows)."""
    return {name: factor * block for name, block in ess.items()}


def _to_json(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return {"__tuple__": [_to_json(v) for v in value]} if isinstance(value, tuple) else [_to_json(v) for v in value]
    if isinstance(value, Mapping):
        return {"__dict__": {str(k): _to_json(v) for k, v in value.items()}}
    array = np.asarray(value)
    if array.dtype.kind in "biuf":
        return {"__array__": array.tolist(), "dtype": array.dtype.str}
    raise TypeError(f"cannot save a model constructor argument of type {type(value).__name__}")


def _from_json(value):
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(_from_json(v) for v in value["__tuple__"])
        if "__dict__" in value:
            return {k: _from_json(v) for k, v in value["__dict__"].items()}
        if "__array__" in value:
            return np.asarray(value["__array__"], dtype=np.dtype(value["dtype"]))
    return value


def model_from_config(config: dict, registry: Mapping[str, type]):
    """Rebuild a model saved by :meth:`ConjugateModelBase.init_config`; only classes in ``registry``
    (the package's own models) can be named, so a saved file never chooses arbitrary code."""
    cls = registry.get(config.get("class"))
    if cls is None:
        raise ValueError(f"a saved VIPS fit names the model class {config.get('class')!r}, which is not one of "
                         f"{sorted(registry)}; pass the model to load(path, model)")
    return cls(*[_from_json(a) for a in config["args"]], **{k: _from_json(v) for k, v in config["kwargs"].items()})
