"""LDA and the sigmoid belief net on synthetic data with a known answer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_dppvi.vips import LDA, SigmoidBeliefNet, fit_vips
from numpyro_dppvi.vips.lda import fixed_length_documents, split_documents, unigram_perplexity


def _synthetic_corpus(num_docs=400, length=60, seed=0):
    """3 topics over 30 words, each topic on its own block of 10 words."""
    rng = np.random.default_rng(seed)
    beta = np.kron(np.eye(3), np.ones(10) / 10)
    theta = rng.dirichlet(0.3 * np.ones(3), size=num_docs)
    dense = rng.multinomial(length, theta @ beta)
    width = int((dense > 0).sum(1).max())
    ids = np.zeros((num_docs, width), np.int32)
    counts = np.zeros((num_docs, width))
    order = np.argsort(dense == 0, axis=1, kind="stable")[:, :width]  # nonzero columns first
    ids[:] = order
    counts[:] = np.take_along_axis(dense, order, axis=1)
    return ids, counts, dense


def test_lda_recovers_block_topics_and_beats_unigram():
    ids, counts, dense = _synthetic_corpus()
    model = LDA(3, 30, doc_length=60, inner_iterations=10)
    result = fit_vips(model, (ids, counts), batch_size=100, iterations=30, kappa=0.7, rng_key=jax.random.key(0))
    mass = np.asarray(model.topics(result.params)).reshape(3, 3, 10).sum(-1)  # topic x block
    # every topic puts > 90% of its mass on one block, and the three blocks are distinct
    assert np.all(mass.max(axis=1) > 0.9)
    assert sorted(mass.argmax(axis=1)) == [0, 1, 2]
    observed, held_out = split_documents(ids, counts, np.random.default_rng(1))
    lda = model.completion_perplexity(result.params, observed, held_out)
    unigram = unigram_perplexity(dense.sum(0), held_out)
    # ideal: about 10 words per document topic mix vs 30 for the unigram model
    assert lda < 0.7 * unigram


def test_fixed_length_documents_keep_words_and_length():
    ids, counts, _ = _synthetic_corpus(num_docs=20)
    new_ids, new_counts = fixed_length_documents(ids, counts, 25, np.random.default_rng(0))
    assert np.all(new_counts.sum(1) == 25)
    assert np.all(new_counts[counts == 0] == 0)  # only the document's own words
    np.testing.assert_array_equal(new_ids, ids)


def test_private_lda_clips_documents_and_zeroes_negative_counts():
    ids, counts, _ = _synthetic_corpus(num_docs=100)
    from numpyro_dppvi.privacy import Privacy

    model = LDA(3, 30, doc_length=60, inner_iterations=3)
    result = fit_vips(model, (ids, counts), privacy=Privacy(noise_multiplier=1.0, clip=0.1), batch_size=50,
                      iterations=3, rng_key=jax.random.key(0))
    # a N = 6 and every document's statistic has norm >= 60 / sqrt(30) ~ 11 (at most 30 cells): all clipped
    enp = model.expected_natural_params(result.params)
    _, num_clipped = model.clipped_ess_sum(enp, model.validate_data((ids, counts)), jnp.ones(100, bool),
                                           {"topic_word": 0.1 * model.doc_length})
    assert int(num_clipped) == 100
    # noise of std sigma a N (D/S) = 12 per entry would make many entries negative; they are set to 0,
    # so lambda = blend of (random init ~ 1) and (eta + non-negative) stays >= eta
    assert bool(jnp.all(result.params["lam"] >= model.eta - 1e-6))
    observed, held_out = split_documents(ids, counts, np.random.default_rng(0))
    assert np.isfinite(model.completion_perplexity(result.params, observed, held_out))


def test_sbn_learns_two_prototypes():
    """Images are noisy copies (5% flips) of two complementary prototypes; one hidden unit
    suffices, and the reconstruction from the fitted net must be far better than the mean image
    (which is ~50% right on every pixel)."""
    rng = np.random.default_rng(0)
    proto = (rng.random(16) < 0.5).astype(float)
    which = rng.random(300) < 0.5
    images = np.where(which[:, None], proto, 1 - proto)
    images = np.abs(images - (rng.random(images.shape) < 0.05))
    model = SigmoidBeliefNet(16, 2, inner_iterations=3, init_scale=0.5)
    result = fit_vips(model, (images,), batch_size=100, iterations=20, kappa=0.7, rng_key=jax.random.key(0))
    assert model.pixel_accuracy(result.params, images) > 0.9
    samples = result.posterior_samples(7)
    assert samples["W"].shape == (7, 16, 2) and samples["c"].shape == (7, 16) and samples["b"].shape == (7, 2)


def test_lda_rejects_repeated_words_in_a_document():
    model = LDA(2, 5, doc_length=4)
    with pytest.raises(ValueError, match="same word id twice"):
        model.validate_data((np.array([[1, 1, 0]]), np.array([[2.0, 1.0, 0.0]])))
    model.validate_data((np.array([[1, 0, 0]]), np.array([[2.0, 0.0, 0.0]])))  # padding may repeat id 0
