# ruff: noqa: E402 (XLA_FLAGS set before jax is imported)
"""Fixtures and settings shared by every test.

Budgets, two hypothesis profiles and one marker:

- profile `full`, the default: every property test runs the `max_examples` it names. `nox -s
  tests-all` (CI) runs it; `nox -s stateful` runs it with the stateful budgets scaled up
  (`EQUIBUFFER_STATEFUL_EXAMPLES`).
- profile `quick` (`--hypothesis-profile quick`, which `nox -s tests` passes): a test written
  `@settings(max_examples=budget(n))` (`tests/helpers.py`) and every stateful test
  (`stateful_settings(n)`) runs at most `QUICK_EXAMPLES` examples; a test that names no
  `max_examples` gets `QUICK_EXAMPLES` too.
- marker `thorough`: the costliest cases of a statistical or parametrised test, whose cheaper
  siblings keep proving the same property in the quick session; and the cases of a test run
  for every kind of buffer but four spread over the list (`helpers.spread`). `nox -s tests`
  leaves them out (`-m "not slow and not thorough and not examples"`); `nox -s tests-all` and
  CI run them.
- marker `examples`: the docs' code blocks and the docstring examples (tests/test_docs.py),
  which `nox -s docs` runs before building the site; `nox -s tests` leaves them out too.

Neither profile has a deadline: the first example of each configuration compiles, and a
shared machine is slow. A new property test: `@settings(max_examples=budget(n),
deadline=None)`; a new costly case (more than about 10 s on two shared cores): mark it
`thorough` and keep a cheaper case of the same check unmarked.

One JAX compilation cache serves every process of a run (the xdist workers and the
subprocesses the tests start): a program compiled by one test (the same buffer, shapes and
step, often in another test or a docs example) is loaded, not compiled again, by the next. It
is a fresh directory per run, removed at the end; `EQUIBUFFER_TEST_JAX_CACHE=DIR` keeps one
across runs instead (JAX keys its entries by program, JAX and XLA version, so a stale entry is
never used).

`EQUIBUFFER_TEST_INSTALLED=1` (`nox -s package`) refuses an `equibuffer` imported from
anywhere but site-packages.
"""

import collections
import importlib.metadata
import os
import pathlib
import shutil
import tempfile


# --- Compiled faster: LLVM without its optimisations --------------------------------------
# Set before JAX starts its CPU backend, so for this process and every process the tests start
# (tests/helpers.py `xla_flags`). The tests' programs are tiny: compiling them is most of the
# suite's time (half of tests/test_protocol.py's, profiled), and LLVM's optimisations about a
# sixth of that (the same tests 1.15x-1.2x faster). The programs XLA builds (the HLO after its
# own passes, which the tests that inspect compiled programs read) and their results are the
# same; the benchmarks compile as users do.
# Before jaxlib 0.11 (Python 3.11's releases, what `nox -s tests` runs on a fresh machine), XLA's
# CPU backend also takes its older emitters in place of the fusion emitters, which compile
# 1.5x faster again (four kinds' add, sample and set_priorities, traced and compiled three
# times: 14.2 s, then 9.2 s). jaxlib 0.12 has no such flag (an unknown XLA flag ends the
# process), nor one that compiles faster.
FAST_COMPILE = ["--xla_backend_optimization_level=0"]
if tuple(map(int, importlib.metadata.version("jaxlib").split(".")[:2])) < (0, 11):
    FAST_COMPILE.append("--xla_cpu_use_fusion_emitters=false")
for flag in FAST_COMPILE:
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

import jax
import jax.random as jr
import pytest
from hypothesis import settings

from .helpers import QUICK_EXAMPLES, release_compiled_programs, SEQUENCES, STATEFUL_EXAMPLES


# --- One compilation cache for the run's processes -------------------------------------------
CACHE = "EQUIBUFFER_TEST_JAX_CACHE"
# Set here by the first process of a run (xdist's controller), inherited by its workers and
# their subprocesses; removed by the process that made it.
_MADE_CACHE = CACHE not in os.environ
if _MADE_CACHE:
    os.environ[CACHE] = tempfile.mkdtemp(prefix="equibuffer-jax-cache-")
# Each setting for this process (jax is imported already) and, as an environment variable, for
# the subprocesses' jax to read at import.
for name, value in {
    "jax_compilation_cache_dir": os.environ[CACHE],
    "jax_persistent_cache_min_compile_time_secs": 0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
}.items():
    jax.config.update(name, value)
    os.environ[name.upper()] = str(value)

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

settings.register_profile("full", deadline=None)
settings.register_profile("quick", deadline=None, max_examples=QUICK_EXAMPLES)


# --- Which equibuffer the tests import (`nox -s package` sets INSTALLED) --------------------
INSTALLED = "EQUIBUFFER_TEST_INSTALLED"


def _equibuffer_dir() -> pathlib.Path:
    import equibuffer

    return pathlib.Path(equibuffer.__file__).resolve().parent


def pytest_report_header(config):
    return f"equibuffer: {_equibuffer_dir()}"


def pytest_configure(config):
    # Here rather than at import: a conftest loaded late must not undo `--hypothesis-profile`.
    settings.load_profile(config.getoption("hypothesis_profile", None) or "full")
    if os.environ.get(INSTALLED) and "site-packages" not in _equibuffer_dir().parts:
        raise pytest.UsageError(
            f"{INSTALLED} is set but equibuffer was imported from {_equibuffer_dir()}, not "
            "from an installed package (site-packages): run the tests from a directory "
            "without the source tree."
        )


def pytest_unconfigure(config):
    if _MADE_CACHE:
        shutil.rmtree(os.environ[CACHE], ignore_errors=True)


@pytest.fixture
def getkey():
    """`getkey()` returns a fresh PRNG key each call, deterministic per test."""
    key = jr.key(0)

    def _getkey():
        nonlocal key
        key, sub = jr.split(key)
        return sub

    return _getkey


# --- The count of random sequences the stateful tests ran (`nox -s stateful`) ---------------
# Each test's report carries the sequences it ran (so xdist workers send theirs, and a worker
# that crashes later loses none); the controller adds them up and prints them.

_BEFORE = pytest.StashKey[dict]()
_REPORTED: collections.Counter[str] = collections.Counter()


def pytest_addoption(parser):
    parser.addoption(
        "--min-sequences",
        type=int,
        default=0,
        help="fail the session when the stateful tests ran fewer random sequences in all",
    )


def pytest_runtest_setup(item):
    item.stash[_BEFORE] = dict(SEQUENCES)


def pytest_runtest_teardown(item, nextitem):
    # A worker that runs hundreds of tests keeps every program they compiled: past a quarter
    # of the kernel's limit on mapped areas, JAX's caches are cleared (tests/helpers.py).
    # Between files only: a file's module-scoped jitted functions may count their traces
    # (tests/test_examples.py).
    if nextitem is None or nextitem.module is not item.module:
        release_compiled_programs()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        before = item.stash.get(_BEFORE, {})
        ran = {k: n - before.get(k, 0) for k, n in SEQUENCES.items() if n > before.get(k, 0)}
        if ran:
            report.user_properties.append(("stateful_sequences", ran))
    return report


# The bad inputs the fuzz tests tried, by kind and by the message that refused each
# (tests/test_fuzz.py reports them per test, through xdist): summed in the terminal summary.
_BAD_INPUTS: collections.Counter = collections.Counter()


def pytest_runtest_logreport(report):
    for key, ran in report.user_properties:
        if key == "stateful_sequences" and report.when == "call":
            _REPORTED.update(ran)
        elif key == "bad_inputs" and report.when == "teardown":  # (a fixture's, at teardown)
            _BAD_INPUTS.update({tuple(k.split("\t")): n for k, n in ran.items()})


def pytest_sessionfinish(session):
    wanted = session.config.getoption("--min-sequences")
    if getattr(session.config, "workerinput", None) is not None:
        return  # an xdist worker: the controller decides
    if wanted and sum(_REPORTED.values()) < wanted and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    if _BAD_INPUTS:
        terminalreporter.section("bad inputs refused")
        for (kind, message), n in sorted(_BAD_INPUTS.items()):
            terminalreporter.write_line(f"{kind}: {n} refused with '{message}'")
        terminalreporter.write_line(f"total: {sum(_BAD_INPUTS.values())} bad inputs refused")
    wanted = config.getoption("--min-sequences")
    if not (os.environ.get(STATEFUL_EXAMPLES) or wanted):
        return
    terminalreporter.section("stateful sequences")
    for name, n in sorted(_REPORTED.items()):
        terminalreporter.write_line(f"{name}: {n}")
    total = sum(_REPORTED.values())
    terminalreporter.write_line(f"total: {total} random sequences")
    if total < wanted:
        terminalreporter.write_line(f"FAILED: fewer than --min-sequences={wanted}", red=True)
