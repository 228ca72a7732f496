"""VIPS Bayesian logistic regression on UCI Adult (VIPS paper §6.4, Figure 6).

Compares, at the same (epsilon, delta = 1e-5) budget:
  * non-private Polya-Gamma VB (``privacy=None``),
  * VIPS: private PG-VB releasing clipped, noised expected sufficient statistics,
  * DP-SGD VI: mean-field Gaussian VI with DP-SGD on the pooled data (the paper's DPVI
    baseline), through ``fit_global_vi(..., privacy=...)`` when available, else
    ``fit_dppvi(method="dp_optimisation")`` with one client holding all rows (the same thing).

Reports test AUC and accuracy against epsilon. Small by default (one seed, epsilon = 1);
``--full`` runs epsilon in {0.5, 1, 2, 4} with 5 seeds; ``--paper-regime`` adds Figure 6's own setting
(rate 0.004, 100 steps, delta 1e-3, epsilon 0.8 / 0.05 / 0.025 and no noise, 3 seeds).

    NUMPYRO_DPPVI_DATA=<data home> python examples/vips_logistic_adult.py [--full] [--paper-regime]
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax

import numpyro_dppvi as dppvi
from numpyro_dppvi.privacy import Privacy
from numpyro_dppvi.vips import PolyaGammaLogisticRegression, fit_vips

FEATURE_BOUND = 4.0  # public bound on |x| (with the intercept column); larger rows are projected


def auc(score, y) -> float:
    """Area under the ROC curve by the rank-sum (Mann-Whitney) formula; ties get average ranks."""
    score, y = np.asarray(score, dtype=float), np.asarray(y)
    order = np.argsort(score, kind="mergesort")
    ranks = np.empty(len(score))
    sorted_scores = score[order]
    # average ranks over ties
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    pos = y == 1
    n1, n0 = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def load():
    x, y, x_test, y_test = dppvi.datasets.load_adult(split="train_test")
    add_bias = lambda a: np.column_stack([a, np.ones(len(a))]).astype(np.float32)  # noqa: E731
    return add_bias(x), y.astype(np.float32), add_bias(x_test), y_test.astype(np.float32)


def fit_vips_logistic(x, y, epsilon, seed, batch_size=None, iterations=10, kappa=1.0, delta=1e-5):
    """PG-VB for ``iterations`` steps, full batch when ``batch_size=None``; ``epsilon=None`` is non-private.
    ``kappa = 1, tau0 = 1``: the natural parameters are the running mean of the (noisy or minibatch)
    targets; non-private full-batch fits take each target whole (``kappa = 0``: exact VB iterations)."""
    exact = epsilon is None and batch_size is None
    model = PolyaGammaLogisticRegression(x.shape[1], hyperprior=(1.0, 1.0), feature_bound=FEATURE_BOUND)
    privacy = None if epsilon is None else Privacy(epsilon=epsilon, delta=delta)
    result = fit_vips(model, (x, y), privacy=privacy, batch_size=batch_size, iterations=iterations,
                      tau0=1.0, kappa=0.0 if exact else kappa, rng_key=jax.random.key(seed))
    return result


@dppvi.model
def logistic(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def fit_dpsgd_vi(x, y, epsilon, seed, steps=400, batch_size=400, clip=1.0, learning_rate=1e-2, delta=1e-5):
    """DP-SGD mean-field VI on the pooled data at the same budget (``epsilon=None``: no noise)."""
    privacy = None if epsilon is None else Privacy(epsilon=epsilon, delta=delta, clip=clip)
    key = jax.random.key(seed)
    if "privacy" in inspect.signature(dppvi.fit_global_vi).parameters:
        result = dppvi.fit_global_vi(logistic, [(x, y)], steps=steps, steps_per_round=steps // 4,
                                     batch_size=batch_size, optimizer=optax.adam(learning_rate),
                                     privacy=privacy, rng_key=key)
    else:
        result = dppvi.fit_dppvi(logistic, [(x, y)], method="dp_optimisation", schedule="sequential",
                                 rounds=4, local_steps=steps // 4, batch_size=batch_size,
                                 optimizer=optax.adam(learning_rate), damping=1.0, privacy=privacy,
                                 rng_key=key)
    return result


def vips_scores(result, x):
    return np.asarray(result.model.predict_proba(result.params, x))


def dpsgd_scores(result, x):
    w = result.posterior["w"]["loc"]
    return np.asarray(jax.nn.sigmoid(jnp.asarray(x) @ jnp.asarray(w)))


PAPER_RATE, PAPER_STEPS, PAPER_DELTA = 0.004, 100, 1e-3
PAPER_EPSILONS = (None, 0.8, 0.05, 0.025)  # Figure 6 caption: sigma 0 / 1 / 6 / 12


def paper_regime(x, y, x_test, y_test, seeds=range(3)):
    """Figure 6's setting: batches at rate 0.004, 100 steps, delta 1e-3, the caption's budgets;
    both methods calibrated to the same epsilon by our accountant."""
    batch = int(round(PAPER_RATE * len(x)))
    rows = []
    for epsilon in PAPER_EPSILONS:
        for seed in seeds if epsilon is not None else range(1):
            vips = fit_vips_logistic(x, y, epsilon, seed, batch_size=batch, iterations=PAPER_STEPS,
                                     delta=PAPER_DELTA)
            baseline = fit_dpsgd_vi(x, y, epsilon, seed, steps=PAPER_STEPS, batch_size=batch, delta=PAPER_DELTA)
            for method, result, scores in (("VIPS", vips, vips_scores(vips, x_test)),
                                           ("DP-SGD VI", baseline, dpsgd_scores(baseline, x_test))):
                spent = None if epsilon is None else float(result.privacy.epsilon)
                rows.append({"method": method, "regime": "paper", "epsilon": spent, "target_epsilon": epsilon,
                             "seed": seed, **evaluate(scores, y_test)})
                print(rows[-1], flush=True)
    return rows


def evaluate(scores, y):
    return {"auc": auc(scores, y), "accuracy": float(np.mean((scores > 0.5) == (y > 0.5)))}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="full", action="store_false", default=False,
                      help="small size (the default), a minute or two on 2 CPU cores: epsilon 1, 1 seed")
    size.add_argument("--full", dest="full", action="store_true", default=False,
                      help="paper size: epsilon in {0.5, 1, 2, 4}, 5 seeds")
    parser.add_argument("--no-dpsgd", action="store_true", help="skip the DP-SGD VI baseline")
    parser.add_argument("--paper-regime", action="store_true",
                        help="also run Figure 6's setting (rate 0.004, 100 steps, delta 1e-3, 3 seeds)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    epsilons = [0.5, 1.0, 2.0, 4.0] if args.full else [1.0]
    seeds = range(5) if args.full else range(1)
    x, y, x_test, y_test = load()
    rows = []
    start = time.perf_counter()
    result = fit_vips_logistic(x, y, None, 0, iterations=20)
    rows.append({"method": "non-private PG-VB", "epsilon": None, "seed": 0,
                 **evaluate(vips_scores(result, x_test), y_test)})
    print(rows[-1], flush=True)
    for epsilon in epsilons:
        for seed in seeds:
            result = fit_vips_logistic(x, y, epsilon, seed)
            rows.append({"method": "VIPS", "epsilon": result.epsilon, "target_epsilon": epsilon, "seed": seed,
                         "noise_multiplier": result.noise_multiplier,
                         **evaluate(vips_scores(result, x_test), y_test)})
            print(rows[-1], flush=True)
            if not args.no_dpsgd:
                baseline = fit_dpsgd_vi(x, y, epsilon, seed)
                rows.append({"method": "DP-SGD VI", "epsilon": float(baseline.privacy.epsilon),
                             "target_epsilon": epsilon, "seed": seed,
                             **evaluate(dpsgd_scores(baseline, x_test), y_test)})
                print(rows[-1], flush=True)
    if args.paper_regime:
        rows += paper_regime(x, y, x_test, y_test)
    print(f"total {time.perf_counter() - start:.0f} s")
    summary = {}
    for row in rows:
        key = (row["method"] + (" (paper regime)" if row.get("regime") == "paper" else ""), row.get("target_epsilon"))
        summary.setdefault(key, []).append((row["auc"], row["accuracy"]))
    print(f"{'method':20s} {'epsilon':>8s} {'AUC':>14s} {'accuracy':>14s}")
    for (method, eps), values in summary.items():
        values = np.array(values)
        print(f"{method:20s} {str(eps):>8s} {values[:, 0].mean():8.4f}±{values[:, 0].std():.4f} "
              f"{values[:, 1].mean():8.4f}±{values[:, 1].std():.4f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return rows


if __name__ == "__main__":
    main()
