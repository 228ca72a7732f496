"""Docstrings of the public API (issue 26): every public name has one, and their examples run.

The API reference (``make docs``, docs/api/) is built from these docstrings, so a public name without
one is a hole in the reference. Public modules: every module of the package with no underscore in
its dotted path. Public names of a module: its ``__all__`` when it has one, else the functions and
classes defined in it (not imported) whose names do not start with an underscore. Constants
(strings, tuples, dicts) cannot carry a docstring of their own and are not checked; functions,
classes (their own docstring, not an inherited or a dataclass's generated ``Name(field, ...)``),
decorated callables and modules are.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import inspect
import pkgutil
import types

import pytest

import numpyro_dppvi


def public_modules() -> list[str]:
    """Dotted names of the package's public modules (no component starting with an underscore)."""
    found = pkgutil.walk_packages(numpyro_dppvi.__path__, prefix="numpyro_dppvi.",
                                  onerror=lambda name: None)
    names = [info.name for info in found if not any(part.startswith("_") for part in info.name.split("."))]
    return ["numpyro_dppvi", *sorted(names)]


def import_public(name: str) -> types.ModuleType:
    """Import a public module; the Flower modules need the ``flower`` extra (skipped without it)."""
    if name.startswith("numpyro_dppvi.flower"):
        pytest.importorskip("flwr", reason="numpyro_dppvi.flower needs the flower extra")
    return importlib.import_module(name)


def _is_checked(obj) -> bool:
    """Objects that can carry a docstring of their own: functions, classes, modules and decorated
    callables (``jax.jit``, ``functools.lru_cache``, ``functools.wraps``)."""
    return (inspect.isroutine(obj) or inspect.isclass(obj) or inspect.ismodule(obj)
            or (callable(obj) and hasattr(obj, "__wrapped__")))


def public_names(module: types.ModuleType) -> list[str]:
    """The names a module makes public: ``__all__``, else its own non-underscore functions and classes."""
    exported = getattr(module, "__all__", None)
    if exported is not None:
        return list(exported)
    return [name for name, obj in vars(module).items()
            if not name.startswith("_") and _is_checked(obj)
            and getattr(obj, "__module__", None) == module.__name__]


def own_docstring(obj) -> str:
    """The docstring ``obj`` itself declares: not a base class's, nor the signature a dataclass or a
    named tuple generates when its class has none."""
    if not inspect.isclass(obj):
        return (getattr(obj, "__doc__", None) or "").strip()
    doc = (obj.__dict__.get("__doc__") or "").strip()
    inherited = {(base.__dict__.get("__doc__") or "").strip() for base in obj.__mro__[1:]}
    generated = doc.startswith(f"{obj.__name__}(") and doc.endswith(")") and "\n" not in doc
    if doc in inherited or (generated and (dataclasses.is_dataclass(obj) or issubclass(obj, tuple))):
        return ""
    return doc


def undocumented(module: types.ModuleType) -> list[str]:
    """Public names of ``module`` (functions, classes, modules) without a docstring of their own."""
    missing = []
    for name in public_names(module):
        obj = getattr(module, name)
        if _is_checked(obj) and not own_docstring(obj):
            missing.append(name)
    return missing


@pytest.mark.parametrize("module_name", public_modules())
def test_public_names_have_docstrings(module_name):
    module = import_public(module_name)
    assert own_docstring(module), f"module {module_name} has no docstring"
    missing = undocumented(module)
    assert not missing, f"{module_name}: public names without a docstring: {missing}"


def test_the_check_catches_a_missing_docstring():
    """The check itself: a function, a class, a dataclass (whose generated ``Name(...)`` docstring does
    not count) and a module-level decorated function without docstrings are all reported."""
    module = types.ModuleType("numpyro_dppvi_fake", "A module.")

    def documented():
        """Has one."""

    def bare():
        pass

    class Bare:
        pass

    class Child(Bare):
        pass

    @dataclasses.dataclass
    class Fields:
        x: int = 0

    @dataclasses.dataclass
    class DocumentedFields:
        """Has one."""
        x: int = 0

    for obj in (documented, bare, Bare, Child, Fields, DocumentedFields):
        obj.__module__ = module.__name__
        setattr(module, obj.__name__, obj)
    assert sorted(undocumented(module)) == ["Bare", "Child", "Fields", "bare"]
    module.__all__ = ["documented", "Fields"]
    assert undocumented(module) == ["Fields"]


# ---------------------------------------------------------------------------------- doctests

def doctest_modules() -> list[str]:
    """Public modules whose own docstrings (the module's, its functions', classes' and methods')
    hold ``>>>`` examples."""
    finder = doctest.DocTestFinder()
    return [name for name in public_modules()
            if not name.startswith("numpyro_dppvi.flower")  # no examples there; needs the extra
            and any(test.examples for test in finder.find(importlib.import_module(name)))]


def test_some_docstrings_have_examples():
    assert "numpyro_dppvi.privacy.config" in doctest_modules()  # Privacy's Examples


@pytest.mark.parametrize("module_name", doctest_modules())
def test_docstring_examples_run(module_name):
    module = importlib.import_module(module_name)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder().find(module):
        runner.run(test)
    failed, attempted = runner.summarize(verbose=False)
    assert attempted > 0
    assert failed == 0, f"{failed} of {attempted} examples in {module_name} failed (doctest report above)"
