"""Smoke test of examples/adult_dppvi.py: a tiny run writes the CSV (expected columns, one row per round)
and the plot. Utility is not asserted here (1,000 training and test rows, two rounds); the tuned settings are
checked at full size by the example itself."""

import csv
import importlib.util
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "adult_dppvi.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("adult_dppvi_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_tiny_run_writes_csv_and_plot(tmp_path):
    example = _load_example()
    out = example.main(["--figures", "1", "--splits", "balanced", "--methods", "local_avg_trusted", "virtual_trusted",
                        "--rounds", "2", "--seeds", "1", "--train-rows", "1000", "--test-rows", "1000",
                        "--out", str(tmp_path)])
    assert out == tmp_path
    with (tmp_path / "adult_dppvi.csv").open() as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == example.COLUMNS
    assert {r["method"] for r in rows} == {"local_avg_trusted", "virtual_trusted"}
    for method in ("local_avg_trusted", "virtual_trusted"):
        mine = [r for r in rows if r["method"] == method]
        assert [int(r["round"]) for r in mine] == [1, 2]
        assert [int(r["communications"]) for r in mine] == [10, 20]  # 10 clients, one exchange each per round
        for r in mine:
            assert r["figure"] == "1" and r["split"] == "balanced" and r["seed"] == "0"
            assert 0.0 <= float(r["accuracy"]) <= 1.0
            assert math.isfinite(float(r["log_lik"])) and float(r["log_lik"]) < 0.0
        # the budget is spent over the planned rounds: at most epsilon = 1 (accountant's own tolerance)
        assert 0.0 < float(mine[0]["epsilon"]) < float(mine[1]["epsilon"]) <= 1.0 + 1e-6
    png = tmp_path / "adult_dppvi.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_are_rejected():
    example = _load_example()
    with pytest.raises(SystemExit):
        example.parse_args(["--methods", "not_a_method"])
    with pytest.raises(SystemExit):
        example.parse_args(["--seeds", "0"])
