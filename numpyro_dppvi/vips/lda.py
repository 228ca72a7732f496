"""Latent Dirichlet allocation for VIPS (paper §4, Algorithm 3).

Model: topics ``beta_k ~ Dirichlet(eta 1_V)``; per document ``theta_d ~ Dirichlet(alpha 1_K)``,
``z_dn ~ Categorical(theta_d)``, ``w_dn ~ Categorical(beta_{z_dn})``. The global variational
posterior is ``q(beta_k) = Dirichlet(lambda_k)``; the expected natural parameters are
``E[log beta_kv] = psi(lambda_kv) - psi(sum_v lambda_kv)``.

E-step for document ``d`` (behind the privacy wall, Eq. 26 and the ``gamma`` update)::

    phi_dnk ∝ exp(E[log theta_dk] + E[log beta_{k, w_dn}]),   gamma_d = alpha + sum_n phi_dn

Document ``d``'s ESS is the ``K x V`` matrix ``s^d_kv = sum_n phi_dnk [w_dn = v]``; the M-step
is ``lambda = eta + (D/S) sum_d s^d``.

Sensitivity (Eq. 28 with the paper's clipping, Eq. 29): ``sum_k phi_dnk = 1`` and each token
is one word, so ``|s^d|_F <= sum_{k,v} s^d_kv = N_d``. With documents of (at most) ``N``
tokens the bound is ``N`` (``doc_length``); ``Privacy.clip = a`` clips every document's
contribution to ``a N`` (the paper uses ``a = 0.1``). Negative noisy statistics are set to
zero after the release (post-processing).

Documents are given as padded distinct-term lists ``(word_ids [D, U], counts [D, U])`` with
count 0 in padding (``numpyro_dppvi.datasets.load_nyt().padded()``); within a document the
ids are distinct, so the norm of the sparse contribution is the norm of the dense one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import digamma

from numpyro_dppvi.vips.engine import ConjugateModelBase


def expected_log_dirichlet(concentration):
    """``E[log p]`` under ``Dirichlet(concentration)`` along the last axis."""
    return digamma(concentration) - digamma(jnp.sum(concentration, axis=-1, keepdims=True))


class LDA(ConjugateModelBase):
    """LDA with ``K`` topics over a vocabulary of ``V`` words (see the module docstring).

    Args:
        num_topics: ``K``, the number of topics (at least 2).
        vocab_size: ``V``, the number of words in the vocabulary (at least 2).
        alpha: the symmetric Dirichlet hyperparameter of the documents' topic proportions ``theta_d``, positive
            (default ``1/K``, as the paper).
        eta: the symmetric Dirichlet hyperparameter of the topics ``beta_k``, positive (default ``1/K``, as the
            paper).
        doc_length: ``N``, the (maximum) number of tokens per document, used for the
            per-document bound ``N`` (use :func:`fixed_length_documents` to resample every
            document to ``N`` tokens, as the paper does).
        inner_iterations: fixed number of E-step iterations per document.
        init_scale: topics start at ``lambda ~ Gamma(100, 100) * init_scale`` (data-independent).
    """

    symmetric_blocks = ()

    def __init__(self, num_topics: int, vocab_size: int, doc_length: int, alpha=None, eta=None,
                 inner_iterations: int = 50, init_scale: float = 1.0):
        if num_topics < 2 or vocab_size < 2:
            raise ValueError("LDA needs num_topics >= 2 and vocab_size >= 2.")
        if doc_length < 1:
            raise ValueError("doc_length must be a positive number of tokens.")
        self.num_topics, self.vocab_size = int(num_topics), int(vocab_size)
        self.doc_length = float(doc_length)
        self.alpha = 1.0 / num_topics if alpha is None else float(alpha)
        self.eta = 1.0 / num_topics if eta is None else float(eta)
        if self.alpha <= 0 or self.eta <= 0:
            raise ValueError("alpha and eta must be positive.")
        self.inner_iterations = int(inner_iterations)
        self.init_scale = float(init_scale)
        self.block_bounds = {"topic_word": self.doc_length}

    def prior_params(self):
        return {"lam": jnp.full((self.num_topics, self.vocab_size), self.eta)}

    def init_params(self, rng_key):
        shape = (self.num_topics, self.vocab_size)
        return {"lam": self.init_scale * jax.random.gamma(rng_key, 100.0, shape) / 100.0}

    def expected_natural_params(self, params):
        return {"log_beta": expected_log_dirichlet(params["lam"])}

    def document_estep(self, log_beta, word_ids, counts):
        """``(c_j phi_jk [U, K], gamma [K])`` for one document after the inner iterations."""
        log_beta_words = log_beta[:, word_ids].T  # [U, K]
        counts = counts.astype(log_beta.dtype)

        def body(_, gamma):
            log_phi = expected_log_dirichlet(gamma)[None, :] + log_beta_words
            phi = jax.nn.softmax(log_phi, axis=-1)
            return self.alpha + counts @ phi

        gamma0 = jnp.full((self.num_topics,), self.alpha + jnp.sum(counts) / self.num_topics)
        gamma = jax.lax.fori_loop(0, self.inner_iterations, body, gamma0)
        phi = jax.nn.softmax(expected_log_dirichlet(gamma)[None, :] + log_beta_words, axis=-1)
        return counts[:, None] * phi, gamma

    def example_ess(self, expected_natural_params, example):
        """Dense ``K x V`` statistic of one document (for checks; the fit uses the sparse sum)."""
        word_ids, counts = example
        contrib, _ = self.document_estep(expected_natural_params["log_beta"], word_ids, counts)
        dense = jnp.zeros((self.num_topics, self.vocab_size), contrib.dtype)
        return {"topic_word": dense.at[:, word_ids].add(contrib.T)}

    def clipped_ess_sum(self, expected_natural_params, batch, mask, bounds):
        word_ids, counts = batch
        contrib, _ = jax.vmap(self.document_estep, in_axes=(None, 0, 0))(
            expected_natural_params["log_beta"], word_ids, counts)  # [S, U, K]
        num_clipped = jnp.zeros((), jnp.int32)
        if bounds is not None:  # a document with a non-finite statistic contributes nothing (engine docstring)
            bound = bounds["topic_word"]
            finite = jnp.all(jnp.isfinite(contrib), axis=(1, 2))
            contrib = jnp.where(finite[:, None, None], contrib, 0.0)
            norms = jnp.sqrt(jnp.sum(contrib**2, axis=(1, 2)))
            contrib = contrib * jnp.minimum(1.0, bound / jnp.maximum(norms, 1e-30))[:, None, None]
            num_clipped = jnp.sum((norms > bound * (1.0 + 1e-6)) & mask)
        contrib = contrib * mask[:, None, None].astype(contrib.dtype)
        total = jnp.zeros((self.num_topics, self.vocab_size), contrib.dtype)
        total = total.at[:, word_ids.reshape(-1)].add(contrib.reshape(-1, self.num_topics).T)
        return {"topic_word": total}, num_clipped

    def postprocess_noisy_ess(self, ess_total):
        return {"topic_word": jnp.maximum(ess_total["topic_word"], 0.0)}

    def m_step(self, params, ess_total):
        return {"lam": self.eta + ess_total["topic_word"]}

    def validate_data(self, data):
        if not isinstance(data, (tuple, list)) or len(data) != 2:
            raise ValueError("LDA data must be (word_ids [D, U], counts [D, U]); see datasets.load_nyt().padded().")
        word_ids, counts = (jnp.asarray(a) for a in data)
        if word_ids.shape != counts.shape or word_ids.ndim != 2:
            raise ValueError(f"word_ids and counts must both have shape [D, U], got {word_ids.shape}, {counts.shape}.")
        ids_np = np.asarray(word_ids)
        if ids_np.min() < 0 or ids_np.max() >= self.vocab_size:
            raise ValueError(f"word ids must lie in [0, {self.vocab_size}).")
        counts_np = np.asarray(counts)
        if counts_np.min() < 0:
            raise ValueError("word counts must be non-negative.")
        # the clipping norm is computed on the sparse rows: a word may appear once per document
        marked = np.where(counts_np > 0, ids_np, -1 - np.arange(ids_np.shape[1])[None, :])
        ordered = np.sort(marked, axis=1)
        if np.any(ordered[:, 1:] == ordered[:, :-1]):
            raise ValueError("a document lists the same word id twice; merge its counts "
                             "(one entry per distinct word, as datasets.load_nyt().padded() gives).")
        return word_ids.astype(jnp.int32), counts.astype(jnp.result_type(float))

    def topics(self, params):
        """Posterior mean topics ``E[beta_k] = lambda_k / sum_v lambda_kv``: ``[K, V]``."""
        lam = params["lam"]
        return lam / jnp.sum(lam, axis=-1, keepdims=True)

    def sample_posterior(self, params, rng_key, num_samples):
        draws = jax.random.dirichlet(rng_key, params["lam"], (num_samples,) + params["lam"].shape[:-1])
        return {"beta": draws}

    def document_topic_proportions(self, params, word_ids, counts):
        """``E[theta_d]`` for documents (the E-step with the fitted topics): ``[D, K]``."""
        log_beta = self.expected_natural_params(params)["log_beta"]
        _, gamma = jax.vmap(self.document_estep, in_axes=(None, 0, 0))(
            log_beta, jnp.asarray(word_ids), jnp.asarray(counts))
        return gamma / jnp.sum(gamma, axis=-1, keepdims=True)

    def completion_perplexity(self, params, observed, held_out):
        """Per-word perplexity of held-out tokens given the observed part of each document.

        ``theta_d`` is inferred from ``observed = (word_ids, counts)``; the held-out tokens
        (same ``word_ids`` layout, other counts) are scored with
        ``p(w) = sum_k E[theta_dk] E[beta_kw]``: ``exp(-sum c log p(w) / sum c)``.
        """
        theta = self.document_topic_proportions(params, *observed)
        beta = self.topics(params)
        word_ids, counts = (jnp.asarray(a) for a in held_out)
        probs = jnp.einsum("dk,kdu->du", theta, beta[:, word_ids])
        counts = counts.astype(probs.dtype)
        log_lik = jnp.sum(counts * jnp.log(jnp.maximum(probs, 1e-30)))
        return float(jnp.exp(-log_lik / jnp.sum(counts)))

    def top_words(self, params, vocabulary, num_words: int = 10):
        """For every topic, its ``num_words`` most probable words with their probabilities."""
        beta = np.asarray(self.topics(params))
        order = np.argsort(-beta, axis=1)[:, :num_words]
        return [[(vocabulary[v], float(beta[k, v])) for v in order[k]] for k in range(beta.shape[0])]


def fixed_length_documents(word_ids, counts, length: int, rng: np.random.Generator):
    """Resample every document to exactly ``length`` tokens, with replacement (paper §4.2).

    Each document's new counts are ``Multinomial(length, counts / sum(counts))`` over its own
    distinct terms (documents with no tokens stay empty). Depends on one document only, so it
    is a per-record preprocessing step that does not change the privacy analysis.
    """
    counts = np.asarray(counts, dtype=float)
    totals = counts.sum(axis=1, keepdims=True)
    probs = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    out = np.zeros_like(counts)
    for d in np.flatnonzero(totals[:, 0] > 0):  # one multinomial draw per document (preprocessing)
        out[d] = rng.multinomial(length, probs[d])
    return np.asarray(word_ids), out


def split_documents(word_ids, counts, rng: np.random.Generator, observed_fraction: float = 0.5):
    """Split every document's tokens at random into an observed and a held-out part
    (each token independently observed with probability ``observed_fraction``)."""
    counts = np.asarray(counts).astype(np.int64)
    observed = rng.binomial(counts, observed_fraction)
    return (np.asarray(word_ids), observed.astype(float)), (np.asarray(word_ids), (counts - observed).astype(float))


def unigram_perplexity(train_counts_by_word, held_out):
    """Per-word perplexity of held-out tokens under the training unigram frequencies
    (the paper's non-private baseline); add-one smoothing keeps unseen words finite."""
    freq = np.asarray(train_counts_by_word, dtype=float) + 1.0
    freq = freq / freq.sum()
    word_ids, counts = (np.asarray(a) for a in held_out)
    counts = counts.astype(float)
    return float(np.exp(-np.sum(counts * np.log(freq[word_ids])) / counts.sum()))
