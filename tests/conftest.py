import os
from importlib.metadata import PackageNotFoundError, version

os.environ.setdefault("JAX_PLATFORMS", "cpu")

#: The XLA flags that the suite compiles with (``_faster_compiles``), and the jaxlib from which they were measured.
FUSION_EMITTERS_OFF = "--xla_cpu_use_fusion_emitters=false"
#: XLA's backend optimisation level for the suite's programs (``_faster_compiles``): 1 of XLA:CPU's 0-3 (default 2).
BACKEND_OPTIMISATION = "--xla_backend_optimization_level=1"
MEASURED_FROM_JAXLIB = (0, 10)


def _faster_compiles() -> None:
    """Compile the suite's programs with XLA:CPU's loop emitter instead of its MLIR fusion emitters. The suite is
    dominated by compiling (each test file builds its fits afresh; in a fresh clone nothing is cached), and the
    fusion emitters compile each fused loop slowly: measured with jaxlib 0.10.2 on 2 cores, the DP round of a small
    private logistic fit compiles in 6.0-7.5 s against 9.0-9.8 s, ``tests/pvi/test_dp_optimisation.py`` runs in
    143 s against 189 s, ``test_low_rank.py`` with ``test_noise_aware.py`` on 2 workers in 298 s against 466 s, and
    the runtime-bound ``test_adult.py`` in 161 s against 170 s. The steady state of a compiled fit is about 40%
    slower, which the suite barely feels. Results agree to float32 rounding (the same fit's posterior means
    equal to 5-7 significant digits); the package itself, its benchmarks and ``make demo`` keep XLA's defaults.
    The backend's optimisation level 1 (LLVM's code generation at -O1 instead of -O2) compiles faster again at the
    cost of a slower steady state: the fresh-clone suite (2 workers, 1222 tests, all passing at both) took 1,317 s
    at level 2 and 1,145 s at level 1; the runtime-bound virtual-clients Adult test took 97 s against 60 s. Set
    only with a jaxlib where they were measured (older ones may not know the flags, and XLA refuses an unknown
    flag), and never over a choice already in ``XLA_FLAGS``."""
    flags = os.environ.get("XLA_FLAGS", "")
    try:
        release = tuple(int(part) for part in version("jaxlib").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return
    if release < MEASURED_FROM_JAXLIB:
        return
    if "xla_cpu_use_fusion_emitters" not in flags:
        flags = f"{flags} {FUSION_EMITTERS_OFF}"
    if "xla_backend_optimization_level" not in flags:
        flags = f"{flags} {BACKEND_OPTIMISATION}"
    os.environ["XLA_FLAGS"] = flags.strip()


_faster_compiles()

import pytest  # noqa: E402


def _session_cache_folder(tmp_path_factory):
    """One folder for the whole run, shared by the ``pytest-xdist`` workers (their base folders'
    parent): a program one worker compiled, the other reads instead of compiling it (measured on 8
    fit-heavy files, 2 workers: 545 s against 587 s with a folder per worker; on the full suite no
    gain beyond the spread between runs). ``enable_compilation_cache`` creates it. JAX keys an entry by
    the folder too, so the workers must share the folder itself, not copies. JAX writes an entry
    without a lock; a worker that reads one half-written (both compiling the same program at the
    same instant) gets a warning from JAX and compiles it itself."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "numpyro_dppvi_cache"


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
    os.environ["NUMPYRO_DPPVI_CACHE"] = str(_session_cache_folder(tmp_path_factory))
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


def _release_programs() -> None:
    """Drop the package's program store and JAX's caches, collect, and give the freed heap back to the system
    (``malloc_trim``; otherwise the resident size keeps its high-water mark)."""
    import ctypes
    import gc

    import jax

    from numpyro_dppvi import program_cache

    program_cache.clear()
    jax.clear_caches()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.fixture(scope="module", autouse=True)
def _programs_released_after_each_module(request):
    """Each test file starts with no compiled program in memory (issue 26: the suite's peak memory).
    A worker runs many files in turn, and XLA's executables, JAX's tracing caches and the package's
    program store otherwise accumulate over all of them. Programs shared within a file stay; a later
    file that needs one again reads it from the session's persistent compilation cache instead of
    compiling it. With ``NUMPYRO_DPPVI_TEST_MEMORY_LOG`` set, each file's resident and peak sizes are
    appended there (to find the file that needs memory)."""
    yield
    import resource

    _release_programs()
    log = os.environ.get("NUMPYRO_DPPVI_TEST_MEMORY_LOG")
    if log:
        with open(f"/proc/{os.getpid()}/status") as status:
            rss = next(line.split()[1] for line in status if line.startswith("VmRSS"))
        with open(log, "a") as out:
            out.write(f"{os.getpid()} {request.node.nodeid} rss_mb={int(rss) // 1024} "
                      f"peak_mb={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}\n")


@pytest.fixture
def release_programs_after_each_test():
    """For a file whose tests share no program (each fits its own model): its programs are released after each
    test, not only at the file's end (``pytestmark = pytest.mark.usefixtures(...)``)."""
    yield
    _release_programs()
