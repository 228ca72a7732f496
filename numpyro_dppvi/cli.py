"""The ``dppvi`` command.

``dppvi demo``   fits logistic regression on the bundled UCI Adult data with 10 clients (balanced and
                 unbalanced splits) by PVI and the baselines (and the private methods that exist) and
                 prints test accuracy, mean test log-likelihood, communications, epsilon and wall time.
``dppvi run X``  runs ``examples/X.py`` of a source checkout (``main(argv)`` with the remaining
                 arguments); its exit status is the example's. ``dppvi run`` lists the experiments.
``dppvi deploy demo``  starts a Flower SuperLink and two SuperNodes on 127.0.0.1, runs DP-PVI on Adult
                 split between them, prints the posterior and every ledger, and stops them (needs the
                 ``flower`` extra).
``dppvi bench``  runs the speed harnesses in ``benchmarks/`` of a source checkout, prints a table of
                 their key numbers and writes their JSON to ``runs/bench/`` (``--out DIR``), or to the
                 tracked ``benchmarks/results/`` with ``--update-results``.

Scripts whose name starts with ``_`` (``benchmarks/_common.py``) are helpers, never experiments or
benchmarks.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import json
import os
import runpy
import sys
import time
from contextlib import contextmanager
from pathlib import Path

SPLITS = {"balanced": (0.0, 0.0), "unbalanced": (0.7, -3.0)}
#: Each simulated data holder's public upper bound on its rows (``Privacy(public_sizes=...)``): a statement
#: made before the fit, like "at most 4,000 patients", not computed from the data (the splits hold
#: 3,907-3,908 rows per client, and 1,172 / 6,642-6,643).
PUBLIC_SIZES = {"balanced": [4000] * 10, "unbalanced": [1200] * 5 + [6700] * 5}


def logistic_model():
    """The demo's logistic regression (:func:`numpyro_dppvi.example_models.logistic_regression`), imported on use."""
    from .example_models import logistic_regression

    return logistic_regression


def demo_methods(rounds: int | None, epsilon: float = 1.0, delta: float = 1e-5, public_sizes=None):
    """``name -> callable(model, clients, eval_data, rng_key) -> result`` for the demo table;
    ``public_sizes``: the clients' declared bounds (:data:`PUBLIC_SIZES`).

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
    private = Privacy(epsilon=epsilon, delta=delta, clip=2.0, public_sizes=public_sizes)
    methods = {
        # non-private PVI with the family its ConvergenceWarning recommends for Adult's 109 latents: mean-field
        # q (the default above NEWTON_MAX_DIM) crosses the ridges of the one-hot design slowly and was still
        # drifting after 100 rounds (sequential, and synchronous at damping 0.2; 20-200 local steps tried).
        # Full-rank Newton steps, rounds until converged: 5 steps a round converge on both splits (20 and 24
        # rounds, 30-45 s; 10 fixed rounds left the unbalanced split jumping 2.4 sd, 20 local steps a round cost
        # 4x). Synchronous full-rank rounds (damping 0.2-1, 10-20 rounds) were still moving: the private rows
        # below show the synchronous schedule
        "PVI (full-rank)": lambda m, c, e, k: pvi.fit_dppvi(
            m, c, family="full_rank", rounds=rounds, local_steps=5, rng_key=k, eval_data=e, progress=True),
        # the library's optimiser; batches of 1000 so that the averaged half of a round's steps sweeps the
        # data (batches of 100 left q jumping 1.5-2.8 sd a round)
        "global VI": lambda m, c, e, k: pvi.fit_global_vi(
            m, c, steps=2000, steps_per_round=100, batch_size=1000, rng_key=k, eval_data=e, progress=True),
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
            m, c, method="local_averaging", privacy=Privacy(
                epsilon=epsilon, delta=delta, clip=1.0, public_sizes=public_sizes),
            schedule="synchronous", trusted_aggregator=True, rounds=2, local_steps=20, optimizer=adam,
            damping=0.5, shards=lambda n: max(n // 10, 1), invalid="floor", precision_floor=1.0, rng_key=k,
            eval_data=e, progress=True),
        "DP virtual clients (TA)": lambda m, c, e, k: pvi.fit_dppvi(
            m, c, method="virtual_clients", privacy=Privacy(
                epsilon=epsilon, delta=delta, clip=1.0, public_sizes=public_sizes),
            schedule="synchronous", trusted_aggregator=True, rounds=5, local_steps=10,
            optimizer=natural_gradient(0.5), damping=0.1, shards="rows", invalid="floor",
            precision_floor=10.0, rng_key=k, eval_data=e, progress=True),
    }
    return methods


def demo(args) -> int:
    """``dppvi demo``: fit UCI Adult, split over 10 clients, with every method of :func:`demo_methods` and
    print a table of accuracy, log-likelihood, communications, epsilon, convergence and time.

    Args:
        args: the parsed ``demo`` arguments: ``splits`` (names in :data:`SPLITS`), ``rounds`` (None: the
            non-private PVI fit runs until converged), ``epsilon`` (the private methods' budget, delta 1e-5) and ``seed`` (None:
            every fit draws its key from the OS).

    Returns:
        0: a fit that fails is reported in its row and the notes, not as an error of the command.
    """
    import warnings

    import jax

    from . import datasets
    from .data import partition
    from .diagnostics import FIT_WARNINGS

    x, y, x_test, y_test = datasets.load_adult(split="train_test")
    model = logistic_model()
    rows, notes = [], []
    print(f"UCI Adult: {x.shape[0]} training rows, {x_test.shape[0]} test rows, {x.shape[1]} features; "
          f"10 clients; logistic regression with N(0, 1) priors; private methods at epsilon={args.epsilon}, "
          "delta=1e-5 (add/remove neighbours, Poisson sampling, declared public bounds on the client sizes)\n")
    total = len(args.splits) * len(demo_methods(args.rounds, args.epsilon))
    for split in args.splits:
        rho, kappa = SPLITS[split]
        methods = demo_methods(args.rounds, args.epsilon, public_sizes=PUBLIC_SIZES[split])
        clients = partition((x, y), num_clients=10, rho=rho, kappa=kappa, labels=y, seed=0)
        for name, fit in methods.items():
            # the progress bars below are the library's (labelled "<method>/<schedule>" only): say whose they are
            print(demo_header(len(rows) + 1, total, split, name), flush=True)
            start = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:  # reported in the table and its notes
                for category in FIT_WARNINGS:
                    warnings.simplefilter("always", category)
                try:
                    # no seed: every fit draws its key from the OS (the private fits' guarantee needs a secret key)
                    result = fit(model, clients, (x_test, y_test),
                                 None if args.seed is None else jax.random.key(args.seed))
                except (FloatingPointError, ValueError) as exc:  # an invalid posterior: reported, not hidden
                    result = None
                    notes.append(f"{split} / {name}: failed: {exc}")
            for w in caught:
                if issubclass(w.category, FIT_WARNINGS):
                    notes.append(f"{split} / {name}: {w.category.__name__}: {w.message}")
                else:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            rows.append((split, name, result, time.perf_counter() - start))
    header = (f"{'split':<11} {'method':<26} {'accuracy':>8} {'log-lik':>8} {'comms':>7} {'epsilon':>8} "
              f"{'converged':>9} {'seconds':>8}")
    print("\n" + header + "\n" + "-" * len(header))
    for split, name, result, sec in rows:
        print(demo_row(split, name, result, sec))
    unjudged = [f"{split} / {name}" for split, name, result, _ in rows
                if result is not None and (result.convergence or {}).get("converged") is None]
    if unjudged:  # say why, rather than leave a bare '?'
        notes.append(f"converged '?' ({', '.join(unjudged)}): one-round committees (BCM) and fits of fewer than 3 "
                     "rounds have no round-to-round trajectory to judge convergence from")
    if notes:
        print("\nNotes (convergence is judged in posterior-sd units, see docs/guide.md section 6):")
        for note in notes:
            print(f"- {note}")
    return 0  # a fit that failed is a result of the demo (its row and note say why), not an error of the command


def demo_row(split: str, name: str, result, seconds: float) -> str:
    """One line of the demo table (``failed`` when the fit raised; see the notes)."""
    if result is None:
        return f"{split:<11} {name:<26} {'failed':>8} {'':>8} {'':>7} {'':>8} {'':>9} {seconds:>8.1f}"
    last = result.history[-1]
    eps = f"{result.privacy.epsilon:.3f}" if result.is_private else "-"
    converged = {True: "yes", False: "no", None: "?"}[(result.convergence or {}).get("converged")]
    return (f"{split:<11} {name:<26} {last['accuracy']:>8.4f} {last['log_lik']:>8.4f} "
            f"{last['communications']:>7d} {eps:>8} {converged:>9} {seconds:>8.1f}")


def demo_header(index: int, total: int, split: str, method: str) -> str:
    """The line printed before fit ``index`` of ``total`` of the demo, naming its split and method."""
    rho, kappa = SPLITS[split]
    return f"[{index}/{total}] {split} split (rho {rho:g}, kappa {kappa:g}): {method}"


# --------------------------------------------------------------------------- scripts of a checkout

BENCH_OUT_ENV = "NUMPYRO_DPPVI_BENCH_OUT"  # read by benchmarks/_common.py: where the JSON results go


def checkout_root() -> Path | None:
    """The source checkout holding this package (with ``examples/`` and ``benchmarks/``), else ``None``."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "examples").is_dir() and (root / "benchmarks").is_dir() else None


def require_checkout(command: str) -> Path:
    """:func:`checkout_root`, or exit naming ``dppvi <command>`` when the package is installed without one."""
    root = checkout_root()
    if root is None:
        raise SystemExit(f"dppvi {command}: needs a source checkout of numpyro_dppvi (its examples/ and "
                         "benchmarks/ folders); clone the repository and install it with `pip install -e .`")
    return root


def find_scripts(directory: Path) -> dict[str, Path]:
    """``{name: path}`` of the scripts ``directory/*.py`` by name, helpers (names starting with ``_``) left out."""
    if not directory.is_dir():
        return {}
    return {path.stem: path for path in sorted(directory.glob("*.py")) if not path.stem.startswith("_")}


def script_summary(path: Path) -> str:
    """First line of the module docstring of the script at ``path`` (read, not imported: no JAX start-up)."""
    try:
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except (OSError, SyntaxError, UnicodeDecodeError):
        docstring = None
    return docstring.strip().splitlines()[0] if docstring and docstring.strip() else "(no description)"


def format_scripts(scripts: dict[str, Path]) -> str:
    """One line per script: its name and :func:`script_summary`, aligned."""
    if not scripts:
        return "  (none found: this needs a source checkout of numpyro_dppvi)"
    width = max(len(name) for name in scripts)
    return "\n".join(f"  {name:<{width}}  {script_summary(path)}" for name, path in scripts.items())


def unknown_name_message(command: str, kind: str, names, scripts: dict[str, Path]) -> str:
    """Error text for ``dppvi <command>`` given unknown ``names``: the closest match and every valid name."""
    names = list(names)
    message = f"dppvi {command}: no {kind} named {', '.join(repr(n) for n in names)}"
    close = difflib.get_close_matches(names[0], list(scripts), n=1)
    if close:
        message += f" (did you mean {close[0]!r}?)"
    return f"{message}; available {kind}s:\n{format_scripts(scripts)}"


@contextmanager
def _script_context(argv0: str, argv, environ: dict | None = None):
    """Set ``sys.argv`` (and environment variables) for a script run; restore them afterwards."""
    saved_argv, saved_env = sys.argv, {key: os.environ.get(key) for key in (environ or {})}
    sys.argv = [argv0, *argv]
    os.environ.update(environ or {})
    try:
        yield
    finally:
        sys.argv = saved_argv
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main_status(result) -> int:
    """Exit status of a script's ``main(...)`` result: an int is the status; ``None`` or anything else
    (e.g. the rows or output folder an example returns) is success, 0."""
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def system_exit_status(code) -> int:
    """Exit status of ``SystemExit(code)``, as Python gives it: ``None`` 0, an int itself, a message 1
    (printed to stderr, as Python would)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# --------------------------------------------------------------------------- dppvi run

def run_experiment(name: str, script: Path, argv) -> int:
    """Import the example ``script`` and call its ``main(argv)``; its exit status (:func:`main_status`).

    A ``SystemExit`` raised by the example (argparse errors, ``--help``, "N fit(s) failed") gives its status.
    """
    spec = importlib.util.spec_from_file_location(f"dppvi_example_{name}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    with _script_context(f"dppvi run {name}", argv):
        try:
            spec.loader.exec_module(module)
            if not callable(getattr(module, "main", None)):
                raise SystemExit(f"dppvi run: examples/{script.name} has no main(argv) function")
            return main_status(module.main(list(argv)))
        except SystemExit as stop:
            return system_exit_status(stop.code)
        finally:
            sys.modules.pop(spec.name, None)


def run(args) -> int:
    """``dppvi run EXPERIMENT [ARGS]``: run a script of the checkout's ``examples/`` folder.

    Args:
        args: the parsed ``run`` arguments: ``experiment`` (a script name; None lists the experiments)
            and ``rest`` (the arguments passed on to the script's ``main(argv)``).

    Returns:
        The script's exit status (:func:`run_experiment`), 0 after listing, 2 for an unknown name.
        Exits with a message when the package is installed without a source checkout.
    """
    root = require_checkout("run")
    examples = find_scripts(root / "examples")
    if args.experiment is None:
        print(f"usage: dppvi run EXPERIMENT [--quick | --full] [options]\n\nexperiments:\n{format_scripts(examples)}")
        return 0
    if args.experiment not in examples:
        print(unknown_name_message("run", "experiment", [args.experiment], examples), file=sys.stderr)
        return 2
    return run_experiment(args.experiment, examples[args.experiment], args.rest)


# --------------------------------------------------------------------------- dppvi bench

def bench_output_dir(root: Path, out: Path | None = None, update_results: bool = False) -> Path:
    """Where ``dppvi bench`` writes its JSON: the tracked ``benchmarks/results/`` only with
    ``--update-results``; else ``--out``, else ``runs/bench/`` of the checkout (ignored by git)."""
    if update_results:
        return root / "benchmarks" / "results"
    if out is not None:
        return Path(out)
    return root / "runs" / "bench"


def run_benchmark(script: Path, out_dir: Path) -> int:
    """Run the benchmark ``script`` as ``__main__`` with its JSON going to ``out_dir``; its exit status."""
    with _script_context(str(script), [], {BENCH_OUT_ENV: str(out_dir)}):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as stop:
            return system_exit_status(stop.code)
    return 0


def _numbers(payload, prefix=()):
    """``(path, value)`` of the numbers and flags in a benchmark's JSON, lists (all timings) left out."""
    if isinstance(payload, dict):
        for key, value in payload.items():
            yield from _numbers(value, (*prefix, str(key)))
    elif isinstance(payload, (bool, int, float)):
        yield " / ".join(prefix), payload


def format_value(value) -> str:
    """A number of a benchmark's JSON for the table: flags as yes/no, large numbers with thousands separators
    (``189,500``), others to 4 significant digits."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) or abs(value) >= 1e4:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def bench_table(payload: dict) -> str:
    """A readable table of a benchmark's JSON: its setting and target, then one row per number
    (machine description and the lists of every timing left out; they stay in the JSON)."""
    lines = [f"{key}: {payload[key]}" for key in ("setting", "target") if isinstance(payload.get(key), str)]
    numbers = list(_numbers({k: v for k, v in payload.items() if k not in ("machine", "benchmark")}))
    width = max([len(path) for path, _ in numbers] + [len("quantity")])
    lines += [f"{'quantity':<{width}}  {'value':>12}", "-" * (width + 14)]
    lines += [f"{path:<{width}}  {format_value(value):>12}" for path, value in numbers]
    return "\n".join(lines)


def bench(args) -> int:
    """``dppvi bench [NAME ...]``: run the checkout's benchmarks and print each one's results table.

    Args:
        args: the parsed ``bench`` arguments: ``names`` (benchmarks to run; empty: all), ``out`` and
            ``update_results`` (where the JSON results go, :func:`bench_output_dir`).

    Returns:
        0 when every benchmark ran and wrote its results; the failing benchmark's exit status, 1 when
        one wrote no results, 2 for an unknown name.
    """
    root = require_checkout("bench")
    benchmarks = find_scripts(root / "benchmarks")
    unknown = [name for name in args.names if name not in benchmarks]
    if unknown:
        print(unknown_name_message("bench", "benchmark", unknown, benchmarks), file=sys.stderr)
        return 2
    out_dir = bench_output_dir(root, args.out, args.update_results)
    for name in args.names or list(benchmarks):
        print(f"== {name}: {script_summary(benchmarks[name])}", flush=True)
        result = out_dir / f"{name}.json"
        previous = result.stat().st_mtime_ns if result.exists() else None
        status = run_benchmark(benchmarks[name], out_dir)
        if status:
            print(f"dppvi bench: benchmark {name!r} failed (exit status {status})", file=sys.stderr)
            return status
        if not result.exists() or result.stat().st_mtime_ns == previous:
            print(f"dppvi bench: benchmark {name!r} wrote no results to {result}", file=sys.stderr)
            return 1
        print(bench_table(json.loads(result.read_text())))
        print(f"(JSON: {result})\n")
    return 0


# --------------------------------------------------------------------------- dppvi deploy

FLOWER_MISSING = ("dppvi deploy needs Flower: install the extra with `pip install numpyro_dppvi[flower]` "
                  "(or `pip install -e \".[flower]\"` in a checkout)")


def deploy(args) -> int:
    """``dppvi deploy demo``: the Flower deployment on this machine (imported only when asked for)."""
    try:
        import flwr  # noqa: F401
    except ImportError:
        print(FLOWER_MISSING, file=sys.stderr)
        return 2
    from .flower.demo import run_demo

    return run_demo(rounds=args.rounds, epsilon=args.epsilon, timeout=args.timeout, keep=args.keep)


# --------------------------------------------------------------------------- the parser

def build_parser(root: Path | None) -> argparse.ArgumentParser:
    """The ``dppvi`` parser; the help of ``run`` and ``bench`` lists the scripts of the checkout ``root``."""
    examples = find_scripts(root / "examples") if root else {}
    benchmarks = find_scripts(root / "benchmarks") if root else {}
    parser = argparse.ArgumentParser(
        prog="dppvi", description="Differentially private federated Bayesian inference (numpyro_dppvi).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_demo = sub.add_parser(
        "demo", help="fit logistic regression on UCI Adult with 10 clients by every method; print a table",
        description="Logistic regression on the bundled UCI Adult data, 10 clients, balanced and unbalanced "
                    "splits: PVI, DP-PVI and the baselines; prints accuracy, log-likelihood, epsilon, time.")
    p_demo.add_argument("--rounds", type=int, default=None,
                        help="rounds of the non-private PVI fit (default: until converged, at most 100)")
    p_demo.add_argument("--seed", type=int, default=None,
                        help="a fixed key for reproducible numbers (the private fits then rest on it staying secret); "
                             "default: a fresh secret key from the operating system for every fit")
    p_demo.add_argument("--epsilon", type=float, default=1.0, help="budget of the private methods (delta 1e-5)")
    p_demo.add_argument("--splits", nargs="+", default=list(SPLITS), choices=list(SPLITS))
    p_run = sub.add_parser(
        "run", help="run an experiment of examples/ (the papers' experiments; `dppvi run` lists them)",
        description="Run examples/EXPERIMENT.py of the source checkout with the remaining arguments.\n"
                    "Every experiment takes --quick (the default: small, a few minutes at most on two CPU\n"
                    "cores) or --full (the paper's size); `dppvi run EXPERIMENT --help` lists its\n"
                    "other options. The exit status is non-zero when the experiment fails.",
        epilog=f"experiments:\n{format_scripts(examples)}", formatter_class=argparse.RawDescriptionHelpFormatter)
    p_run.add_argument("experiment", nargs="?", metavar="EXPERIMENT", help="name of the experiment (see below)")
    p_run.add_argument("rest", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments, e.g. --full")
    p_bench = sub.add_parser(
        "bench", help="run the speed benchmarks of benchmarks/; print their numbers, JSON in runs/bench/",
        description="Run the speed harnesses of benchmarks/ (default: all), print a table of their key\n"
                    "numbers and write their JSON to runs/bench/ of the checkout (not tracked by git).",
        epilog=f"benchmarks:\n{format_scripts(benchmarks)}", formatter_class=argparse.RawDescriptionHelpFormatter)
    p_bench.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all)")
    where = p_bench.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=None, help="folder for the JSON results (default: runs/bench/)")
    where.add_argument("--update-results", action="store_true",
                       help="write to the tracked benchmarks/results/ instead (to commit new reference numbers)")
    p_deploy = sub.add_parser(
        "deploy", help="DP-PVI across machines on Flower (`dppvi deploy demo`: two SuperNodes on this machine)",
        description="Deployment on Flower (docs/deploy.md). `demo` starts a SuperLink and two SuperNodes on\n"
                    "127.0.0.1, runs DP-PVI on UCI Adult split between them, prints the posterior summary and\n"
                    "each client's ledger, and stops every process it started. Needs the flower extra.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    deploy_sub = p_deploy.add_subparsers(dest="deploy_command", required=True, metavar="ACTION")
    p_demo_deploy = deploy_sub.add_parser("demo", help="two SuperNodes on this machine, three rounds on Adult")
    p_demo_deploy.add_argument("--rounds", type=int, default=3, help="synchronous rounds (default 3)")
    p_demo_deploy.add_argument("--epsilon", type=float, default=1.0, help="each hospital's budget (delta 1e-5)")
    p_demo_deploy.add_argument("--timeout", type=float, default=600.0, help="seconds the fit may take (default 600)")
    p_demo_deploy.add_argument("--keep", action="store_true", help="keep the work folder (data, states, logs)")
    return parser


def main(argv=None) -> int:
    """The ``dppvi`` command: parse ``argv`` and run ``demo``, ``run``, ``deploy`` or ``bench``.

    Turns on JAX's persistent compilation cache unless ``NUMPYRO_DPPVI_NO_COMPILATION_CACHE`` is set
    to something other than ``0``.

    Args:
        argv: the arguments after ``dppvi`` (None: ``sys.argv[1:]``).

    Returns:
        The command's exit status.
    """
    args = build_parser(checkout_root()).parse_args(argv)
    if os.environ.get("NUMPYRO_DPPVI_NO_COMPILATION_CACHE", "").strip() in ("", "0"):
        from .persistent_cache import enable_compilation_cache  # on by default for the command line

        try:
            enable_compilation_cache()
        except PermissionError as exc:  # run without it, and say why
            print(f"note: {exc} Running without the persistent compilation cache.", file=sys.stderr)
    if args.command == "demo":
        return demo(args)
    if args.command == "run":
        return run(args)
    if args.command == "deploy":
        return deploy(args)
    return bench(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
