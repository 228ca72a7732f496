"""The ``dppvi`` command.

``dppvi demo``   fits logistic regression on the bundled UCI Adult data with 10 clients (balanced and
                 unbalanced splits) by PVI and the baselines (and the private methods that exist) and
                 prints test accuracy, mean test log-likelihood, communications, epsilon and wall time.
``dppvi bench``  runs the speed harnesses in ``benchmarks/`` of a source checkout.
``dppvi run X``  runs ``examples/X.py`` of a source checkout with the remaining arguments.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path

SPLITS = {"balanced": (0.0, 0.0), "unbalanced": (0.7, -3.0)}


def logistic_model():
    import numpyro
    import numpyro.distributions as dist

    from .model import model

    @model
    def logistic(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=x @ w + b), obs=y)

    return logistic


def demo_methods(rounds: int, epsilon: float = 1.0, delta: float = 1e-5):
    """``name -> callable(model, clients, eval_data, rng_key) -> result`` for the demo table.

    Private methods run at ``(epsilon, delta)`` with add/remove neighbours and Poisson sampling; DP-PVI
    uses the settings tuned on Adult (sequential, 5 rounds of 20 DP-SGD steps, clip 2, damping 0.5);
    the update-perturbation methods use a trusted aggregator with the settings of
    ``examples/adult_dppvi.py`` (virtual clients: one row each, natural-gradient local steps).
    """
    import optax

    from . import pvi
    from .optim import natural_gradient
    from .privacy import Privacy

    adam = optax.adam(1e-2)
    private = Privacy(epsilon=epsilon, delta=delta, clip=2.0)
    methods = {
        "PVI (sequential)": lambda m, c, e, k: pvi.fit_dppvi(
            m, c, schedule="sequential", rounds=rounds, local_steps=50, batch_size=100, optimizer=adam,
            damping=1.0, rng_key=k, eval_data=e, progress=True),
        "PVI (synchronous)": lambda m, c, e, k: pvi.fit_dppvi(
            m, c, schedule="synchronous", rounds=rounds, local_steps=50, batch_size=100, optimizer=adam,
            damping=0.2, rng_key=k, eval_data=e, progress=True),
        "global VI": lambda m, c, e, k: pvi.fit_global_vi(
            m, c, steps=500, steps_per_round=100, batch_size=100, optimizer=adam, rng_key=k, eval_data=e,
            progress=True),
        "BCM (same prior)": lambda m, c, e, k: pvi.fit_bcm(
            m, c, prior="same", local_steps=500, optimizer=adam, rng_key=k, eval_data=e),
        "BCM (split prior)": lambda m, c, e, k: pvi.fit_bcm(
            m, c, prior="split", local_steps=500, optimizer=adam, rng_key=k, eval_data=e),
        "DP-PVI (DP optimisation)": lambda m, c, e, k: pvi.fit_dppvi(
            m, c, method="dp_optimisation", privacy=private, schedule="sequential", rounds=5, local_steps=20,
            batch_size=100, optimizer=adam, damping=0.5, rng_key=k, eval_data=e, progress=True),
        "DP global VI (trusted)": lambda m, c, e, k: pvi.fit_global_vi(
            m, c, steps=500, steps_per_round=100, batch_size=100, optimizer=adam, rng_key=k, eval_data=e,
            privacy=private, progress=True),
        "DP BCM (same prior)": lambda m, c, e, k: pvi.fit_bcm(
            m, c, prior="same", local_steps=100, optimizer=adam, rng_key=k, eval_data=e, privacy=private),
        "DP local averaging (TA)": lambda m, c, e, k: pvi.fit_dppvi(
            m, c, method="local_averaging", privacy=Privacy(epsilon=epsilon, delta=delta, clip=1.0),
            schedule="synchronous", trusted_aggregator=True, rounds=2, local_steps=20, optimizer=adam,
            damping=0.5, shards=lambda n: max(n // 10, 1), invalid="floor", precision_floor=1.0, rng_key=k,
            eval_data=e, progress=True),
        "DP virtual clients (TA)": lambda m, c, e, k: pvi.fit_dppvi(
            m, c, method="virtual_clients", privacy=Privacy(epsilon=epsilon, delta=delta, clip=1.0),
            schedule="synchronous", trusted_aggregator=True, rounds=5, local_steps=10,
            optimizer=natural_gradient(0.5), damping=0.1, shards=lambda n: n, invalid="floor",
            precision_floor=10.0, rng_key=k, eval_data=e, progress=True),
    }
    return methods


def demo(args) -> int:
    import jax

    from . import datasets
    from .data import partition

    x, y, x_test, y_test = datasets.load_adult(split="train_test")
    model = logistic_model()
    rows = []
    print(f"UCI Adult: {x.shape[0]} training rows, {x_test.shape[0]} test rows, {x.shape[1]} features; "
          f"10 clients; logistic regression with N(0, 1) priors; private methods at epsilon={args.epsilon}, "
          "delta=1e-5 (add/remove neighbours, Poisson sampling)\n")
    for split in args.splits:
        rho, kappa = SPLITS[split]
        clients = partition((x, y), num_clients=10, rho=rho, kappa=kappa, labels=y, seed=0)
        for name, fit in demo_methods(args.rounds, args.epsilon).items():
            start = time.perf_counter()
            result = fit(model, clients, (x_test, y_test), jax.random.key(args.seed))
            seconds = time.perf_counter() - start
            last = result.history[-1]
            eps = "-" if result.privacy is None else f"{result.privacy.epsilon:.3f}"
            rows.append((split, name, last["accuracy"], last["log_lik"], last["communications"], eps, seconds))
    header = f"{'split':<11} {'method':<26} {'accuracy':>8} {'log-lik':>8} {'comms':>7} {'epsilon':>8} {'seconds':>8}"
    print("\n" + header + "\n" + "-" * len(header))
    for split, name, acc, ll, comms, eps, sec in rows:
        print(f"{split:<11} {name:<26} {acc:>8.4f} {ll:>8.4f} {comms:>7d} {eps:>8} {sec:>8.1f}")
    return 0


def _checkout_root() -> Path:
    root = Path(__file__).resolve().parent.parent
    if not (root / "examples").is_dir():
        raise SystemExit("this command needs a source checkout of numpyro_dppvi (examples/ and benchmarks/)")
    return root


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dppvi", description="Differentially private federated Bayesian inference")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="logistic regression on Adult with 10 clients, all methods")
    p_demo.add_argument("--rounds", type=int, default=10)
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.add_argument("--epsilon", type=float, default=1.0, help="budget of the private methods (delta 1e-5)")
    p_demo.add_argument("--splits", nargs="+", default=list(SPLITS), choices=list(SPLITS))
    p_bench = sub.add_parser("bench", help="run the speed harnesses (benchmarks/*.py), JSON in benchmarks/results/")
    p_bench.add_argument("names", nargs="*", help="benchmark names (default: all)")
    p_run = sub.add_parser("run", help="run examples/<experiment>.py with the remaining arguments")
    p_run.add_argument("experiment")
    p_run.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args)
    root = _checkout_root()
    if args.command == "bench":
        scripts = sorted((root / "benchmarks").glob("*.py"))
        for script in scripts:
            if not args.names or script.stem in args.names:
                print(f"== {script.stem}")
                sys.argv = [str(script)]
                runpy.run_path(str(script), run_name="__main__")
        return 0
    script = root / "examples" / f"{args.experiment}.py"
    if not script.exists():
        available = sorted(p.stem for p in (root / "examples").glob("*.py"))
        raise SystemExit(f"no example {args.experiment!r}; available: {available}")
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
