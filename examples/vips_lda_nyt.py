"""VIPS latent Dirichlet allocation on the NYT bag of words (VIPS paper §4.3, Figure 2, Table 3).

Trains LDA by stochastic variational Bayes with privately released expected sufficient
statistics (per-document clipping to ``a N`` with ``a = Privacy.clip``, noise, negative noisy
counts set to zero) and reports, against epsilon:
  * held-out per-word perplexity by document completion (half of each test document's tokens
    infer its topic proportions, the other half is scored),
  * the unigram-frequency baseline (non-private, from the training counts),
  * the top words of a few topics.

Small by default (runs in seconds, used as a smoke test); ``--full`` uses every document
(7,647 for training after 800 test documents), 20 topics, 100 iterations of 1,000 documents
(about 13 epochs, Poisson sampling) and epsilon in {1, 2, 4, 8}.

    NUMPYRO_DPPVI_DATA=<data home> python examples/vips_lda_nyt.py [--full]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

import numpyro_dppvi as dppvi
from numpyro_dppvi.privacy import Privacy
from numpyro_dppvi.vips import LDA, fit_vips
from numpyro_dppvi.vips.lda import fixed_length_documents, split_documents, unigram_perplexity


def prepare(num_documents, num_test, doc_length, seed):
    """Shuffle, split train/test, resample training documents to ``doc_length`` tokens and split
    each test document into observed and held-out tokens."""
    corpus = dppvi.datasets.load_nyt()
    word_ids, counts, _ = corpus.padded()
    rng = np.random.default_rng(seed)
    order = rng.permutation(corpus.num_documents)
    if num_documents is not None:
        order = order[: num_documents + num_test]
    test, train = order[:num_test], order[num_test:]
    train_ids, train_counts = fixed_length_documents(word_ids[train], counts[train], doc_length, rng)
    observed, held_out = split_documents(word_ids[test], counts[test], rng)
    unigram = np.bincount(word_ids[train].ravel(), weights=counts[train].ravel(),
                          minlength=len(corpus.vocabulary))
    return (train_ids, train_counts), observed, held_out, unigram, corpus.vocabulary


def clipped_fraction(model, result, train, clip):
    """Fraction of training documents whose statistic the clip scales down at the final topics: a
    diagnostic of the clip bound computed here on the raw data (not a private release: keep it local)."""
    import jax.numpy as jnp

    data = model.validate_data(train)
    _, clipped = model.clipped_ess_sum(model.expected_natural_params(result.params), data,
                                       jnp.ones(data[0].shape[0], bool), {"topic_word": clip * model.doc_length})
    return float(clipped) / data[0].shape[0]


def run(epsilons, num_topics, num_documents, num_test, doc_length, batch_size, iterations, clip, seed,
        inner_iterations, show_topics=3, verbose=True):
    train, observed, held_out, unigram, vocabulary = prepare(num_documents, num_test, doc_length, seed)
    rows = [{"method": "unigram", "epsilon": None, "perplexity": unigram_perplexity(unigram, held_out)}]
    if verbose:
        print(rows[-1], flush=True)
    for epsilon in [None] + list(epsilons):
        model = LDA(num_topics, len(vocabulary), doc_length=doc_length, inner_iterations=inner_iterations)
        privacy = None if epsilon is None else Privacy(epsilon=epsilon, delta=1e-5, clip=clip)
        start = time.perf_counter()
        result = fit_vips(model, train, privacy=privacy, batch_size=batch_size, iterations=iterations,
                          tau0=1.0, kappa=0.7, rng_key=jax.random.key(seed))
        row = {"method": "LDA" if epsilon is None else "VIPS LDA", "epsilon": result.epsilon,
               "noise_multiplier": result.noise_multiplier,
               "perplexity": model.completion_perplexity(result.params, observed, held_out),
               "clipped_fraction": clipped_fraction(model, result, train, clip),
               "seconds": round(time.perf_counter() - start, 1)}
        rows.append(row)
        if verbose:
            print(row, flush=True)
            for k, words in enumerate(model.top_words(result.params, vocabulary, 8)[:show_topics]):
                print(f"  topic {k}: " + " ".join(f"{w}({p:.3f})" for w, p in words))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="full", action="store_false", default=False,
                      help="small size (the default), a minute or two on 2 CPU cores: "
                           "300 documents, 4 topics, epsilon 2")
    size.add_argument("--full", dest="full", action="store_true", default=False,
                      help="paper size: all documents, 20 topics, epsilon in {1, 2, 4, 8}")
    parser.add_argument("--topics", type=int, default=None)
    parser.add_argument("--documents", type=int, default=None, help="number of training documents")
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--epsilon", type=float, nargs="*", default=None)
    parser.add_argument("--clip", type=float, default=0.1, help="the paper's a: documents clipped to a*N")
    parser.add_argument("--doc-length", type=int, default=200, help="tokens per training document (N)")
    parser.add_argument("--inner-iterations", type=int, default=None)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    if args.full:
        defaults = dict(topics=20, documents=None, iterations=100, batch_size=1000, epsilon=[1, 2, 4, 8],
                        inner_iterations=30, num_test=800)
    else:
        defaults = dict(topics=4, documents=300, iterations=4, batch_size=75, epsilon=[2.0],
                        inner_iterations=5, num_test=60)
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else defaults[name]  # noqa: E731
    rows = run(pick("epsilon"), pick("topics"), pick("documents"), defaults["num_test"], args.doc_length,
               pick("batch_size"), pick("iterations"), args.clip, 0, pick("inner_iterations"))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return rows


if __name__ == "__main__":
    main()
