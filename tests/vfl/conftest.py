"""Fixtures of the VFL tests."""

import numpy as np
import pytest


@pytest.fixture
def logistic_data():
    rng = np.random.default_rng(0)
    n, p = 120, 4
    x = rng.normal(size=(n, p)).astype(np.float32)
    beta = np.array([1.0, -0.5, 0.8, 0.0])
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-(x @ beta + 0.3)))).astype(np.float32)
    return x, y


@pytest.fixture
def gaussian_data():
    rng = np.random.default_rng(1)
    n, p = 100, 4
    x = rng.normal(size=(n, p)).astype(np.float32)
    beta = np.array([1.0, -0.5, 0.8, 0.3])
    y = (x @ beta + 0.5 + 0.7 * rng.normal(size=n)).astype(np.float32)
    return x, y
