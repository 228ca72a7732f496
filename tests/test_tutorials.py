"""The tutorials (docs/tutorials/*.py, jupytext's percent format): each is valid Python and listed in the site's
table of contents. They are *executed* by the documentation build (``make docs``, run by ``.ci/run`` after the
suite: myst-nb executes every tutorial on every build and a failing cell fails the build,
``nb_execution_raise_on_error``). Running them here as well took about 230 s of the suite's time on 2 cores for
the same check (issue 25); ``python docs/tutorials/<name>.py`` runs one alone."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("*.py"))


def test_there_are_tutorials():
    assert TUTORIALS, "docs/tutorials/ holds no tutorial"


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_a_tutorial_parses_and_is_in_the_table_of_contents(path):
    ast.parse(path.read_text(), filename=str(path))
    index = (ROOT / "docs" / "index.rst").read_text()
    assert f"tutorials/{path.stem}" in index, f"{path.name} is not in docs/index.rst's table of contents"


def test_the_documentation_build_executes_the_tutorials_and_fails_on_an_error():
    """What replaces running them here: the build's settings force execution and raise on a cell's error."""
    conf = (ROOT / "docs" / "conf.py").read_text()
    assert 'nb_execution_mode = "force"' in conf and "nb_execution_raise_on_error = True" in conf
    assert "make docs" in (ROOT / ".ci" / "run").read_text()
