"""Docstrings of the public API (issue 26): every public name has one, and their examples run; the
user-facing API also describes every parameter and keeps internals off its pages (issue 60).

The API reference (``make docs``, docs/api/) is built from these docstrings, so a public name without
one is a hole in the reference. Public modules: every module of the package with no underscore in
its dotted path. Public names of a module: its ``__all__`` when it has one, else the functions and
classes defined in it (not imported) whose names do not start with an underscore. Constants
(strings, tuples, dicts) cannot carry a docstring of their own and are not checked; functions,
classes (their own docstring, not an inherited or a dataclass's generated ``Name(field, ...)``),
decorated callables and modules are.

Parameter lists: the user-facing API, the callables a program calls, has one entry per parameter
(Google style as napoleon reads it: ``Args:`` of a function or a constructor, ``Attributes:`` of a
dataclass or named tuple, ``Other Parameters:`` for the keyword options a function forwards). Its
scope is every callable in the ``__all__`` of ``numpyro_dppvi``, ``numpyro_dppvi.privacy``,
``numpyro_dppvi.vips``, ``numpyro_dppvi.vfl`` and ``numpyro_dppvi.datasets``, every function of
``numpyro_dppvi.plots``, and the functions and warnings of ``numpyro_dppvi.diagnostics`` a user
calls or filters. The pages of the internal modules (``numpyro_dppvi.pvi.plan``, ...) document
internals for whoever works on them and are not checked. The same scope's pages (and the public
methods of its classes) name no private function and no internal design document.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import inspect
import pkgutil
import re
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


# ------------------------------------------------------------------------ parameter lists (issue 60)

#: The modules whose ``__all__`` is the user-facing API, and the modules without one whose own
#: public names a user calls (None: all of them).
USER_FACING = {"numpyro_dppvi": None, "numpyro_dppvi.privacy": None, "numpyro_dppvi.vips": None,
               "numpyro_dppvi.vfl": None, "numpyro_dppvi.datasets": None, "numpyro_dppvi.plots": None,
               "numpyro_dppvi.diagnostics": ("convergence", "unconstrained_coordinates", "NoiseWarning",
                                             "ConvergenceWarning", "ClientUpdateWarning",
                                             "PosteriorRuleWarning", "CalibrationWarning")}

#: The sections whose entries describe parameters (napoleon's Google-style names).
PARAMETER_SECTIONS = ("Args", "Arguments", "Parameters", "Attributes", "Other Parameters", "Keyword Args",
                      "Keyword Arguments")

_HEADER = re.compile(rf"^(\s*)({'|'.join(PARAMETER_SECTIONS)}):\s*$")
_ENTRY = re.compile(r"^\*{0,2}(\w+)\s*(\([^)]*\))?:(\s|$)")


def user_facing_callables(module_name: str) -> list[tuple[str, object]]:
    """``(public name, callable)`` of the user-facing API in ``module_name`` (each object once, under
    the first name met): functions and classes, not modules or constants."""
    module = importlib.import_module(module_name)
    chosen = USER_FACING[module_name]
    names = public_names(module) if chosen is None else list(chosen)
    out = []
    for name in names:
        obj = getattr(module, name)
        if callable(obj) and not inspect.ismodule(obj):
            out.append((f"{module_name}.{name}", obj))
    return out


def parameter_docstring(obj) -> str:
    """What documents the parameters of ``obj``: its docstring, and for a class its own ``__init__``'s too."""
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and "__init__" in obj.__dict__:
        doc += "\n" + (inspect.getdoc(obj.__dict__["__init__"]) or "")
    return doc


def described_parameters(doc: str) -> set[str]:
    """Names with an entry (``name: ...``, ``name (type): ...``, ``**name: ...``) in a parameter section
    of ``doc``: the lines one indentation step under an ``Args:``/``Attributes:``/... header."""
    names, lines, i = set(), doc.splitlines(), 0
    while i < len(lines):
        header = _HEADER.match(lines[i])
        i += 1
        if not header:
            continue
        outer, entry_indent = len(header.group(1)), None
        while i < len(lines):
            line = lines[i]
            indent = len(line) - len(line.lstrip())
            if line.strip() and indent <= outer:
                break
            if line.strip():
                entry_indent = indent if entry_indent is None else entry_indent
                match = _ENTRY.match(line.strip()) if indent == entry_indent else None
                if match:
                    names.add(match.group(1))
            i += 1
    return names


def parameters_of(obj) -> list[str]:
    """The named parameters of a callable (for a class, its constructor's), without ``*args``/``**kwargs``."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # builtins without a signature (an exception's inherited __init__)
        return []
    return [p.name for p in signature.parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in ("self", "cls")]


def undescribed(module_name: str) -> dict[str, list[str]]:
    """Per callable of the user-facing API in ``module_name``: its parameters without an entry."""
    missing = {}
    for name, obj in user_facing_callables(module_name):
        if inspect.isclass(obj) and issubclass(obj, BaseException) and "__init__" not in obj.__dict__:
            continue  # an exception or warning taking the message only (inherited constructor)
        described = described_parameters(parameter_docstring(obj))
        lacking = [p for p in parameters_of(obj) if p not in described]
        if lacking:
            missing[name] = lacking
    return missing


@pytest.mark.parametrize("module_name", sorted(USER_FACING))
def test_every_parameter_of_the_user_facing_api_is_described(module_name):
    missing = undescribed(module_name)
    report = "; ".join(f"{name}: {', '.join(params)}" for name, params in missing.items())
    assert not missing, f"parameters without an entry in their docstring's Args/Attributes: {report}"


def test_the_parameter_check_reads_the_sections():
    """The check itself: entries of ``Args:`` and ``Attributes:`` count, with or without a type, nested
    lines and prose mentioning a name do not."""
    doc = inspect.cleandoc("""Summary, naming x: in prose.

        Args:
            a: first.
                b: a continuation line, not an entry.
            c (int): typed.
            **d: forwarded.

        Attributes:
          e: a field.

        Returns:
            f: not a parameter section.
        """)
    assert described_parameters(doc) == {"a", "c", "d", "e"}

    def f(a, b, *args, c=1, **kwargs):
        """Summary.

        Args:
            a: one.
            c: two.
        """

    assert parameters_of(f) == ["a", "b", "c"]
    assert [p for p in parameters_of(f) if p not in described_parameters(parameter_docstring(f))] == ["b"]


#: References a public page must not hold: an internal design document, a private function or
#: method (``_name(``, or a cross-reference role to a name whose last part starts with ``_``).
_INTERNAL = (re.compile(r"DESIGN(\.md)?\s*§"),
             re.compile(r"(?<!\w)_[A-Za-z]\w*\("),
             re.compile(r":\w+:`~?(?:[\w.]*\.)?_[A-Za-z]\w*`"))


def public_page_docstrings(module_name: str) -> list[tuple[str, str]]:
    """``(name, docstring)`` of ``module_name`` itself, of each of its user-facing callables and of the
    public methods and properties of their classes (what their reference page shows)."""
    out = [(module_name, inspect.getdoc(importlib.import_module(module_name)) or "")]
    for name, obj in user_facing_callables(module_name):
        out.append((name, parameter_docstring(obj)))
        if not inspect.isclass(obj):
            continue
        for member, value in vars(obj).items():
            if member.startswith("_"):
                continue
            value = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            if inspect.isroutine(value) or isinstance(value, property):
                out.append((f"{name}.{member}", inspect.getdoc(value) or ""))
    return out


@pytest.mark.parametrize("module_name", sorted(USER_FACING))
def test_no_private_name_on_a_public_page(module_name):
    found = [f"{name}: {match.group(0)!r}" for name, doc in public_page_docstrings(module_name)
             for pattern in _INTERNAL for match in pattern.finditer(doc)]
    assert not found, f"internal references on the public page of {module_name}: {found}"


def test_the_internal_reference_check_catches_them():
    leaks = ["see DESIGN §5.3", "set by _resolve_virtual_defaults() later", "(:meth:`_resolve_virtual_defaults`)",
             ":func:`~numpyro_dppvi.pvi.plan._scale`"]
    fine = ["docs/guide.md §4", "``__init__(...)``", ":func:`~numpyro_dppvi.pvi.defaults.virtual_clip`",
            "``x_i`` and ``y_j``"]
    assert all(any(p.search(text) for p in _INTERNAL) for text in leaks)
    assert not any(p.search(text) for p in _INTERNAL for text in fine)
