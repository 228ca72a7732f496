"""The ``dppvi`` command: listing and running experiments, benchmark names and where their JSON goes.

Nothing here runs a real example or benchmark: fake scripts in a temporary checkout stand in for them."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from numpyro_dppvi import cli

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))


@pytest.fixture
def fake_checkout(tmp_path, monkeypatch):
    """A checkout with one fake example and one fake benchmark (plus a ``_helper.py`` in each folder),
    the benchmark writing through the real ``benchmarks/_common.write``; ``cli`` looks only at it."""
    (tmp_path / "examples").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "examples" / "_helper.py").write_text('"""Not an experiment."""\n')
    (tmp_path / "examples" / "tiny.py").write_text(
        '"""A tiny experiment: exits with the status given by --status."""\n'
        "import argparse\n\n\n"
        "def main(argv=None):\n"
        "    parser = argparse.ArgumentParser()\n"
        "    parser.add_argument('--status', type=int, default=0)\n"
        "    parser.add_argument('--fail-message', default=None)\n"
        "    args = parser.parse_args(argv)\n"
        "    if args.fail_message:\n"
        "        raise SystemExit(args.fail_message)\n"
        "    return args.status if args.status else ['rows', 'are', 'not', 'a', 'status']\n")
    (tmp_path / "benchmarks" / "_helper.py").write_text('raise RuntimeError("a helper was run as a benchmark")\n')
    (tmp_path / "benchmarks" / "tiny_bench.py").write_text(
        '"""A tiny benchmark: one number and one flag."""\n'
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "from _common import write\n"
        "write('tiny_bench', {'setting': 'fake', 'speed': {'median_s': 0.25, 'all_s': [0.25, 0.3]}, 'ok': True})\n")
    monkeypatch.setattr(cli, "checkout_root", lambda: tmp_path)
    return tmp_path


def _exit_code(argv):
    """``cli.main(argv)``'s return value, or the code of the ``SystemExit`` it raised."""
    try:
        return cli.main(argv)
    except SystemExit as stop:
        return stop.code


# --------------------------------------------------------------------------- dppvi --help, dppvi run

def test_top_level_help_describes_every_subcommand(capsys):
    assert _exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("demo", "run", "bench"):
        assert any(line.strip().startswith(command + " ") for line in out.splitlines()), command


def test_run_help_lists_the_experiments_with_their_docstrings(capsys):
    assert _exit_code(["run", "--help"]) == 0
    out = capsys.readouterr().out
    assert len(EXAMPLES) >= 7
    for name in EXAMPLES:
        line = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
        assert cli.script_summary(ROOT / "examples" / f"{name}.py") in line
    assert "Bayesian VFL logistic regression" in out  # a docstring's first line, read without importing


def test_run_without_an_experiment_lists_them(capsys):
    assert _exit_code(["run"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in EXAMPLES)


def test_unknown_experiment_exits_nonzero_with_the_names(capsys):
    assert _exit_code(["run", "nosuch"]) not in (0, None)
    err = capsys.readouterr().err
    assert "dppvi run: no experiment named 'nosuch'" in err and all(name in err for name in EXAMPLES)
    assert _exit_code(["run", "adult_dpvi"]) != 0
    assert "did you mean 'adult_dppvi'?" in capsys.readouterr().err


def test_run_propagates_the_example_status(fake_checkout, capsys):
    assert _exit_code(["run", "tiny"]) == 0  # a main returning rows succeeds
    assert _exit_code(["run", "tiny", "--status", "3"]) == 3
    assert _exit_code(["run", "tiny", "--fail-message", "2 fit(s) failed"]) == 1
    assert "2 fit(s) failed" in capsys.readouterr().err
    assert _exit_code(["run", "tiny", "--no-such-option"]) == 2  # the example's own argparse error
    assert _exit_code(["run", "_helper"]) != 0


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_takes_quick_by_default_or_full_but_not_both(name, capsys):
    assert _exit_code(["run", name, "--help"]) == 0
    usage = capsys.readouterr().out
    assert usage.startswith(f"usage: dppvi run {name}") and "--quick" in usage and "--full" in usage
    quick_help = " ".join(usage.split("\n  --quick")[1].split("\n  --full")[0].split())
    assert "(the default)" in quick_help
    assert _exit_code(["run", name, "--quick", "--full"]) == 2  # argparse refuses before any work
    assert "not allowed with argument" in capsys.readouterr().err


def test_quick_and_full_set_the_size_flag():
    spec = importlib.util.spec_from_file_location("adult_dppvi_for_cli_test", ROOT / "examples" / "adult_dppvi.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        assert module.parse_args([]).full is False
        assert module.parse_args(["--quick"]).full is False
        assert module.parse_args(["--full"]).full is True
    finally:
        sys.modules.pop(spec.name, None)


# --------------------------------------------------------------------------- dppvi bench

def test_unknown_benchmark_exits_nonzero_with_the_names(capsys):
    assert _exit_code(["bench", "nosuch"]) not in (0, None)
    err = capsys.readouterr().err
    assert "dppvi bench: no benchmark named 'nosuch'" in err and "dp_step" in err and "pvi_rounds" in err


def test_helpers_are_not_benchmarks(capsys):
    benchmarks = cli.find_scripts(ROOT / "benchmarks")
    assert "_common" not in benchmarks and {"dp_step", "pvi_rounds"} <= set(benchmarks)
    assert _exit_code(["bench", "_common"]) != 0
    assert "_common" not in capsys.readouterr().err.split("available")[1]


def test_output_folder_choice(tmp_path):
    root = tmp_path / "checkout"
    assert cli.bench_output_dir(root) == root / "runs" / "bench"
    assert cli.bench_output_dir(root, out=tmp_path / "mine") == tmp_path / "mine"
    assert cli.bench_output_dir(root, update_results=True) == root / "benchmarks" / "results"
    with pytest.raises(SystemExit):  # --out and --update-results contradict each other
        cli.main(["bench", "--out", str(tmp_path), "--update-results"])


def test_fake_benchmark_writes_to_the_chosen_folder_and_prints_a_table(fake_checkout, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(cli.BENCH_OUT_ENV, raising=False)
    results = ROOT / "benchmarks" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.glob("*")}
    assert _exit_code(["bench"]) == 0  # every benchmark: the fake one, not the helper that raises
    default = fake_checkout / "runs" / "bench" / "tiny_bench.json"
    assert json.loads(default.read_text())["speed"]["median_s"] == 0.25
    out = capsys.readouterr().out
    assert "speed / median_s" in out and "0.25" in out and "ok" in out and "yes" in out
    assert '"median_s"' not in out and "all_s" not in out  # a table, not the JSON

    chosen = tmp_path / "elsewhere"
    assert _exit_code(["bench", "tiny_bench", "--out", str(chosen)]) == 0
    assert (chosen / "tiny_bench.json").exists()
    assert _exit_code(["bench", "tiny_bench", "--update-results"]) == 0
    assert (fake_checkout / "benchmarks" / "results" / "tiny_bench.json").exists()
    assert {p.name: p.stat().st_mtime_ns for p in results.glob("*")} == before  # the real results untouched
    assert cli.BENCH_OUT_ENV not in os.environ  # restored after the run


def test_demo_headers_name_split_and_method():
    line = cli.demo_header(3, 20, "unbalanced", "DP-PVI (DP optimisation)")
    assert line.startswith("[3/20] unbalanced split") and "rho 0.7" in line
    assert line.endswith("DP-PVI (DP optimisation)")
