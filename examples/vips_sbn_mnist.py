"""VIPS sigmoid belief network on binarised MNIST (VIPS paper §7.1, Figure 8).

One hidden layer of ``K`` binary units, trained for one pass over the training images by
stochastic variational Bayes with the seven (here three, see ``vips.sbn``) statistic blocks
released jointly with noise ``sigma`` (the paper fixes ``sigma = 1`` and varies the batch size
``S``, which sets epsilon). Reports the pixel reconstruction accuracy on test images (the
fraction of pixels whose thresholded reconstruction equals the image) against epsilon, with
the non-private fit and the mean-image predictor as references.

Small by default (a smoke test); ``--full`` uses all 60,000 training images, ``K = 50`` and
``S`` in {400, 800, 1600, 3200} at ``sigma = 1``, ``delta = 1e-4`` as the paper.

    NUMPYRO_DPPVI_DATA=<data home> python examples/vips_sbn_mnist.py [--full]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

import numpyro_dppvi as dppvi
from numpyro_dppvi.privacy import Privacy
from numpyro_dppvi.vips import SigmoidBeliefNet, fit_vips


def run(num_hidden, num_train, num_test, batch_sizes, noise_multiplier, clip, epochs, inner_iterations, seed,
        include_non_private=True, verbose=True):
    x, _ = dppvi.datasets.load_mnist("train", binarize=True)
    x_test, _ = dppvi.datasets.load_mnist("test", binarize=True)
    rng = np.random.default_rng(seed)
    x = x[rng.permutation(len(x))[:num_train]]
    x_test = x_test[rng.permutation(len(x_test))[:num_test]]
    mean_image = x.mean(axis=0) > 0.5
    rows = [{"method": "mean image", "pixel_accuracy": float(np.mean(mean_image[None] == (x_test > 0.5)))}]
    if verbose:
        print(rows[-1], flush=True)
    settings = [(None, batch_sizes[0])] if include_non_private else []
    settings += [(noise_multiplier, s) for s in batch_sizes]
    for sigma, batch_size in settings:
        iterations = max(1, int(round(epochs * num_train / batch_size)))
        model = SigmoidBeliefNet(x.shape[1], num_hidden, inner_iterations=inner_iterations)
        privacy = None if sigma is None else Privacy(noise_multiplier=sigma, delta=1e-4, clip=clip)
        start = time.perf_counter()
        result = fit_vips(model, (x,), privacy=privacy, batch_size=batch_size, iterations=iterations,
                          tau0=1.0, kappa=0.7, rng_key=jax.random.key(seed))
        row = {"method": "SBN" if sigma is None else "VIPS SBN", "batch_size": batch_size, "iterations": iterations,
               "epsilon": result.epsilon, "noise_multiplier": sigma,
               "pixel_accuracy": model.pixel_accuracy(result.params, x_test),
               "seconds": round(time.perf_counter() - start, 1)}
        rows.append(row)
        if verbose:
            print(row, flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="full", action="store_false", default=False,
                      help="small size (the default), a minute or two on 2 CPU cores: "
                           "400 training images, K = 4, S = 200")
    size.add_argument("--full", dest="full", action="store_true", default=False,
                      help="paper size: 60,000 images, K = 50, S in {400, 800, 1600, 3200}")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--train", type=int, default=None, help="number of training images")
    parser.add_argument("--batch-size", type=int, nargs="*", default=None)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--clip", type=float, default=1.0, help="multiplier of the worst-case block bounds")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    if args.full:
        defaults = dict(hidden=50, train=60000, batch_size=[400, 800, 1600, 3200], num_test=1000, inner=5)
    else:
        defaults = dict(hidden=4, train=400, batch_size=[200], num_test=100, inner=2)
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else defaults[name]  # noqa: E731
    rows = run(pick("hidden"), pick("train"), defaults["num_test"], pick("batch_size"), args.noise_multiplier,
               args.clip, args.epochs, defaults["inner"], 0)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return rows


if __name__ == "__main__":
    main()
