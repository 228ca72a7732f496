import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _cache_outside_home(tmp_path_factory):
    """The command line turns on the persistent caches (``dppvi.enable_compilation_cache``): in tests
    they live in a temporary folder, never in the user's home, and start empty in every run."""
    previous = os.environ.get("NUMPYRO_DPPVI_CACHE")
    os.environ["NUMPYRO_DPPVI_CACHE"] = str(tmp_path_factory.mktemp("numpyro_dppvi_cache"))
    yield
    if previous is None:
        os.environ.pop("NUMPYRO_DPPVI_CACHE", None)
    else:
        os.environ["NUMPYRO_DPPVI_CACHE"] = previous


@pytest.fixture(autouse=True)
def _accounting_memo_in_process_only():
    """A test that turned on the persistent accountant memo (e.g. through the command line) leaves
    the next test with the in-process memo only, as a library user starts."""
    yield
    from numpyro_dppvi.privacy import accounting_memo

    accounting_memo.use(None)
