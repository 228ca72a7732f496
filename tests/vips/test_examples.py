"""Examples at their small default size (smoke), and the Adult logistic-regression targets.

Tests that need the data home skip when it is absent (set NUMPYRO_DPPVI_DATA)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from numpyro_dppvi import datasets

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _require(relpath):
    try:
        datasets.dataset_path(relpath)
    except (datasets.DatasetNotFoundError, OSError) as err:
        pytest.skip(f"data set not in the data home ({err.__class__.__name__}); set NUMPYRO_DPPVI_DATA")


def test_lda_example_smoke():
    _require("nyt/nyt.ldac.gz")
    rows = _example("vips_lda_nyt").main([])  # the small default size
    assert [r["method"] for r in rows] == ["unigram", "LDA", "VIPS LDA"]
    assert all(np.isfinite(r["perplexity"]) and r["perplexity"] > 1 for r in rows)
    assert rows[2]["epsilon"] <= 2.0


def test_sbn_example_smoke():
    _require("mnist/train-images.idx3-ubyte.gz")
    rows = _example("vips_sbn_mnist").main([])  # the small default size
    assert [r["method"] for r in rows] == ["mean image", "SBN", "VIPS SBN"]
    assert all(0.5 < r["pixel_accuracy"] <= 1.0 for r in rows)
    assert rows[2]["epsilon"] > 0


@pytest.fixture(scope="module")
def adult():
    example = _example("vips_logistic_adult")
    return example, example.load()


@pytest.mark.slow
def test_adult_non_private_auc(adult):
    """Non-private full-batch PG-VB (exact VB iterations from the prior; no draw, so no seed dependence: keys 0-2
    gave the same AUC) reaches the paper's AUC. 5 iterations, not the example's 20: the iterations converge fast,
    test AUC 0.9052 / 0.9061 / 0.9067 / 0.9071 / 0.9071 after 2 / 3 / 5 / 10 / 20 (measured), so 5 keeps the
    margin over 0.89 (0.017 at 20) within 0.0004 for a quarter of the runtime."""
    example, (x, y, x_test, y_test) = adult
    result = example.fit_vips_logistic(x, y, None, 0, iterations=5)
    metrics = example.evaluate(example.vips_scores(result, x_test), y_test)
    assert metrics["auc"] >= 0.89  # measured 0.9067 (0.9071 at the example's 20 iterations)


@pytest.fixture(scope="module")
def private_vips(adult):
    example, (x, y, _, _) = adult
    return example.fit_vips_logistic(x, y, 1.0, 0)


@pytest.mark.slow
def test_adult_private_auc_and_accuracy(adult, private_vips):
    """epsilon = 1, delta = 1e-5 (PLD, Poisson/add-remove accounting): full-batch PG-VB, 10 releases."""
    example, (x, y, x_test, y_test) = adult
    result = private_vips
    assert result.epsilon <= 1.0
    metrics = example.evaluate(example.vips_scores(result, x_test), y_test)
    assert metrics["auc"] >= 0.87 and metrics["accuracy"] >= 0.83  # measured 0.894 / 0.847
