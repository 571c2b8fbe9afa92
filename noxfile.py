"""Every check of the project, one session each: `nox -s tests`, `nox -s lint`, ...

Environments are built with uv from the dependency groups in pyproject.toml.

Every session but `tests-all` runs on the Python that runs nox (any supported one: 3.11, 3.12
or 3.13), so each works on a machine with only its default Python. (On 3.11 the resolver picks
older releases: jax 0.10, zarr 3.1, mkdocs-jupyter 0.26; the code, the docs build and pyright
are kept working with both.) `tests-all` runs the whole suite on every supported Python (CI runs
it); a Python that a session asks for and that is not found is an error, never a silent skip.
"""

import os
import sys

import nox


nox.options.default_venv_backend = "uv"
nox.options.sessions = ["tests", "lint", "typecheck"]
# A session whose Python is missing fails (nox's default outside CI is to skip it and exit 0).
nox.options.error_on_missing_interpreters = True

PYPROJECT = nox.project.load_toml("pyproject.toml")
PYTHONS = ["3.11", "3.12", "3.13"]
# The Python running nox (what a fresh machine has), for the sessions a newcomer runs.
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"


def install(session: nox.Session, *groups: str, package: str = ".") -> None:
    deps = [d for g in groups for d in nox.project.dependency_groups(PYPROJECT, g)]
    session.install("-e", package, *deps)


def run_tests(session: nox.Session, *selection: str) -> None:
    install(session, "tests")
    session.run("pytest", "-n", "2", "--dist", "loadfile", *selection, *session.posargs)


@nox.session(python=HERE)
def tests(session: nox.Session) -> None:
    """The test suite (jaxtyping + beartype runtime checks on), on the Python that runs nox,
    except the tests that start processes (marker `slow`: `nox -s slow`; CI runs both)."""
    run_tests(session, "-m", "not slow")


@nox.session(python=HERE)
def slow(session: nox.Session) -> None:
    """The tests that start processes (marker `slow`): 8 emulated devices, several hosts on
    loopback, archive writers killed mid-write, an archive larger than the memory used."""
    run_tests(session, "-m", "slow")


@nox.session(python=PYTHONS, name="tests-all")
def tests_all(session: nox.Session) -> None:
    """The test suite on every supported Python; a missing one is an error (CI runs this)."""
    run_tests(session)


@nox.session(python=HERE)
def stateful(session: nox.Session) -> None:
    """Every stateful test (marker `stateful`) scaled up: each one's `max_examples` times
    `EQUIBUFFER_STATEFUL_EXAMPLES`, at least 10,000 random sequences in all (the session fails
    with fewer); prints the count per test and the total. 7.5 to 9 minutes on two shared cores."""
    install(session, "tests")
    session.run(
        "pytest",
        "-m",
        "stateful",
        "-n",
        "2",
        "--dist",
        "load",
        "--min-sequences",
        "10000",
        *session.posargs,
        env={"EQUIBUFFER_STATEFUL_EXAMPLES": os.environ.get("EQUIBUFFER_STATEFUL_EXAMPLES", "36")},
    )


@nox.session(python=HERE)
def lint(session: nox.Session) -> None:
    """ruff: formatting and lint (imports sorted)."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")


@nox.session(python=HERE)
def typecheck(session: nox.Session) -> None:
    """pyright over the package, against the releases this Python resolves (CI runs it on
    3.11 and 3.12: the oldest and the newest jax and zarr)."""
    install(session, "typecheck", package=".[s3,testing]")
    session.run("pyright")


@nox.session(python=HERE)
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs-material + mkdocstrings), built strictly into `site/`.

    Any further arguments go to `mkdocs build` (e.g. `nox -s docs -- --site-dir /tmp/site`).
    """
    install(session, "docs")
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(python=HERE)
def notebooks(session: nox.Session) -> None:
    """Execute every `notebooks/*.ipynb` top to bottom in a fresh kernel; fail on any error,
    on a warning shown in an output, or on a committed notebook without outputs.

    `nox -s notebooks -- --write` saves the new outputs back into the notebooks (commit them:
    the docs render the committed outputs); `nox -s notebooks -- notebooks/quickstart.ipynb`
    runs one. See docs/run_notebooks.py.
    """
    install(session, "notebooks")
    session.run("python", "docs/run_notebooks.py", *session.posargs)


@nox.session(python=HERE)
def demo(session: nox.Session) -> None:
    """The README's demo: a DQN learning CartPole with a TransitionBuffer in its train state."""
    install(session, "demo")
    session.run("python", "examples/dqn_cartpole.py", *session.posargs)


@nox.session(python=HERE)
def bench(session: nox.Session) -> None:
    """Benchmarks side by side with the peers (ratios, never pass/fail). `-- --quick` for small.

    `nox -s bench -- --quick` runs every script at small sizes; `nox -s bench -- core` (or
    `calls`, `prioritised`, `step`, `archive`, `issue6`, `ring_write`, `devices`, `writers`,
    `programs`) runs one, with any further arguments passed to it. (`bench_gpu` is not among
    them: it is for a lent GPU, through `benchmarks/gpu.sh`.) The figures in
    `benchmarks/README.md` come from Python 3.12 and jax 0.12 (`nox --force-python 3.12 -s
    bench`); on 3.11 the same scripts measure jax 0.10.
    """
    install(session, "bench", package=".[s3]")
    names = [
        "core",
        "calls",
        "prioritised",
        "step",
        "archive",
        "issue6",
        "ring_write",
        "devices",
        "writers",
        "programs",
    ]
    args = list(session.posargs)
    chosen = [a for a in args if a in names] or names
    flags = [a for a in args if a not in names]
    for name in chosen:
        session.run("python", "-m", f"benchmarks.bench_{name}", *flags)
