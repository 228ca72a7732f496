"""What ``optim.cvi``'s precision-growth cap (``max_precision_growth=10``) changes in non-private PVI's defaults.

A cap that never binds changes nothing, bit for bit; so for every model of ``benchmarks/fidelity.py``
(``tests/pvi/numpyro_models.MODELS``, 3 keys) and every class of the calibration zoo (its ``--datasets``
simulated data sets, 3 keys each, ``tests/calibration_zoo_models.py``), ``fit_dppvi(model, clients)`` runs with
the default (capped) and with ``optimizer=optim.cvi(max_precision_growth=inf)`` (the former default), and a
row reports: how many fits raised under each, how many gave a different ``q``, and for those the worst gap of a
posterior mean to NUTS (500 + 500) in NUTS sds under each (zoo: of the first ``--nuts`` data sets that differ),
with the rounds run.

Run from a checkout: ``python benchmarks/cvi_growth.py`` (``--zoo-datasets 20``, ``--skip-fidelity``); JSON
in ``benchmarks/results/cvi_growth.json``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import numpyro_dppvi as dppvi  # noqa: E402
from benchmarks._common import write  # noqa: E402
from numpyro_dppvi import optim  # noqa: E402
from numpyro_dppvi.simulation_calibration import observation_names, prior_draw, simulate_client  # noqa: E402
from tests import calibration_zoo_models as Z  # noqa: E402
from tests.pvi import numpyro_models as M  # noqa: E402

UNCAPPED = optim.cvi(max_precision_growth=float("inf"))


def fit(model, clients, key, optimizer=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            extra = {} if optimizer is None else {"optimizer": optimizer}
            return dppvi.fit_dppvi(model, clients, rng_key=jax.random.key(key), **extra), None
        except Exception as error:  # noqa: BLE001 - the row records what raised
            return None, f"{type(error).__name__}: {str(error)[:120]}"


def compare(model, clients, keys: int, nuts: bool = True) -> dict:
    """Capped against uncapped fits of one data set over ``keys`` keys (NUTS gaps of the fits that differ when
    ``nuts``)."""
    row = {"raised": [0, 0], "differ": 0, "gaps": []}
    reference = None
    for key in range(keys):
        capped, e1 = fit(model, clients, key)
        uncapped, e2 = fit(model, clients, key, UNCAPPED)
        row["raised"][0] += e1 is not None
        row["raised"][1] += e2 is not None
        same = capped is not None and uncapped is not None and np.array_equal(M.flat_loc(capped), M.flat_loc(uncapped)) \
            and np.array_equal(M.flat_sd(capped), M.flat_sd(uncapped))
        if same:
            continue
        row["differ"] += 1
        if not nuts:
            row["gaps"].append({"key": key, "rounds": [None if r is None else r.rounds for r in (capped, uncapped)],
                                "errors": [e1, e2]})
            continue
        if reference is None:
            reference = M.nuts_moments(model, Z.pooled(clients) if isinstance(clients, list) else clients)
        gap = lambda r: None if r is None else round(M.gap(M.flat_loc(r), reference), 3)
        row["gaps"].append({"key": key, "capped": gap(capped), "uncapped": gap(uncapped),
                            "rounds": [None if r is None else r.rounds for r in (capped, uncapped)],
                            "errors": [e1, e2]})
    return row


def zoo_datasets(name: str, count: int, seed: int = 0) -> list:
    zoo = Z.ZOO[name]
    covariates = Z.client_covariates(name, 2000, 5)
    observed = set(observation_names(zoo.model, covariates[0]))
    out = []
    for k in range(count):
        key = jax.random.key(1000 * seed + k)
        truth = {s: v for s, v in prior_draw(zoo.model, covariates[0], jax.random.fold_in(key, 0)).items()
                 if s not in observed}
        out.append([simulate_client(zoo.model, c, truth, jax.random.fold_in(key, i + 1)) if zoo.simulate is None
                    else zoo.simulate(jax.random.fold_in(key, i + 1), truth, c) for i, c in enumerate(covariates)])
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=3)
    parser.add_argument("--zoo-datasets", type=int, default=20)
    parser.add_argument("--nuts", type=int, default=5, help="zoo data sets with NUTS gaps a class")
    parser.add_argument("--skip-fidelity", action="store_true")
    parser.add_argument("--models", nargs="*", default=None, help="zoo classes (default: all)")
    args = parser.parse_args(argv)
    payload = {"keys": args.keys, "fidelity": {}, "zoo": {}}
    if not args.skip_fidelity:
        for name, case in M.MODELS.items():
            payload["fidelity"][name] = row = compare(case.model, case.clients(), args.keys)
            print(name, row, flush=True)
    for name in args.models or list(Z.ZOO):
        rows = []
        for clients in zoo_datasets(name, args.zoo_datasets):  # NUTS for the first --nuts data sets that differ
            nuts = sum(bool(r["differ"]) for r in rows) < args.nuts
            rows.append(compare(Z.ZOO[name].model, clients, args.keys, nuts))
        payload["zoo"][name] = summary = {
            "datasets": len(rows), "fits": len(rows) * args.keys,
            "raised": [sum(r["raised"][i] for r in rows) for i in (0, 1)],
            "differ": sum(r["differ"] for r in rows),
            "gaps": [dict(g, dataset=i) for i, r in enumerate(rows) for g in r["gaps"]]}
        print(name, {k: v for k, v in summary.items() if k != "gaps"},
              "worst gaps capped/uncapped", max((g.get("capped") or 0 for g in summary["gaps"]), default=None),
              max((g.get("uncapped") or 0 for g in summary["gaps"]), default=None), flush=True)
    print(write("cvi_growth", payload))


if __name__ == "__main__":
    main()
