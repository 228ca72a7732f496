"""The tutorials (docs/tutorials/*.py, jupytext's percent format) run from start to end as scripts, as the
documentation build executes them as notebooks (issue 26): a tutorial that no longer runs fails the suite, not
only the site."""

import os
import pathlib
import subprocess
import sys

import pytest

TUTORIALS = sorted((pathlib.Path(__file__).resolve().parents[1] / "docs" / "tutorials").glob("*.py"))

pytest.importorskip("matplotlib")


def test_there_are_tutorials():
    assert TUTORIALS, "docs/tutorials/ holds no tutorial"


@pytest.mark.slow
@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_a_tutorial_runs_as_a_script(path, tmp_path):
    env = dict(os.environ, MPLBACKEND="Agg", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list(tmp_path.iterdir()), "a tutorial wrote files into the working folder"
