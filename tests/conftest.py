import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _persistent_cache_outside_home(tmp_path_factory):
    """JAX's persistent compilation cache on for the whole session, in a temporary folder (never the
    user's home; empty in every run): tests build many programs identical to earlier ones through
    new function objects, and the cache spares their compilation. ``dppvi`` commands run in this
    process and subprocesses find the same folder through ``NUMPYRO_DPPVI_CACHE``. The accountant's
    memo stays in-process (tests count the accountant's runs)."""
    from numpyro_dppvi import enable_compilation_cache
    from numpyro_dppvi.privacy import accounting_memo

    previous = os.environ.get("NUMPYRO_DPPVI_CACHE")
    os.environ["NUMPYRO_DPPVI_CACHE"] = str(tmp_path_factory.mktemp("numpyro_dppvi_cache"))
    enable_compilation_cache()
    accounting_memo.use(None)
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
