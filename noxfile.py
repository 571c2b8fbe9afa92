"""Every check of the project, one session each: `nox -s tests`, `nox -s lint`, ...

Environments are built with uv from the dependency groups in pyproject.toml.

Every session but `tests-all` runs on the Python that runs nox (any supported one: 3.11, 3.12
or 3.13), so each works on a machine with only its default Python. (On 3.11 the resolver picks
older releases: jax 0.10, zarr 3.1, mkdocs-jupyter 0.26; the code, the docs build and pyright
are kept working with both.) `tests-all` runs the whole suite on every supported Python (CI runs
it on each set of releases: .ci/run); a Python that a session asks for and that is not found is
an error, never a silent skip.
"""

import email
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import nox


nox.options.default_venv_backend = "uv"
nox.options.sessions = ["tests", "lint", "typecheck"]
# A session whose Python is missing fails (nox's default outside CI is to skip it and exit 0).
nox.options.error_on_missing_interpreters = True

PYPROJECT = nox.project.load_toml("pyproject.toml")
PYTHONS = ["3.11", "3.12", "3.13"]
# The Python running nox (what a fresh machine has), for the sessions a newcomer runs.
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"
# Set for a run against the installed wheel: tests/conftest.py then refuses a source import.
INSTALLED = "EQUIBUFFER_TEST_INSTALLED"
# `nox -s tests`'s selection (`nox -s package` runs the same against the wheel).
# Budgets (tests/conftest.py): hypothesis profile `quick`, marker `thorough` left out, and the
# docs' examples (marker `examples`) left to `nox -s docs`.
QUICK = ["-m", "not slow and not thorough and not examples", "--hypothesis-profile", "quick"]


def install(session: nox.Session, *groups: str, package: str = ".") -> None:
    # The session's processes write bytecode even where the machine sets
    # PYTHONDONTWRITEBYTECODE (this one does): else every test process (the two workers and
    # those the tests start) compiles jax, numpy, zarr, hypothesis, ... from source at its
    # start, about 6 s each on 2 cores. (The files go under .nox/ and __pycache__/: ignored.)
    session.env["PYTHONDONTWRITEBYTECODE"] = ""
    deps = [d for g in groups for d in nox.project.dependency_groups(PYPROJECT, g)]
    session.install("-e", package, *deps)


def run_tests(session: nox.Session, *selection: str) -> None:
    install(session, "tests")
    session.run("pytest", "-n", "2", "--dist", "loadfile", *selection, *session.posargs)


@nox.session(python=HERE)
def tests(session: nox.Session) -> None:
    """The test suite (jaxtyping + beartype runtime checks on), on the Python that runs nox,
    at the quick budgets: property and stateful tests at most 3 examples each (hypothesis
    profile `quick`), without the costliest cases (marker `thorough`) and the tests that start
    processes (marker `slow`: `nox -s slow`) and the docs' examples (marker `examples`: `nox -s
    docs`). `nox -s tests-all` and CI run everything at the full budgets (tests/conftest.py)."""
    run_tests(session, *QUICK)


@nox.session(python=HERE)
def slow(session: nox.Session) -> None:
    """The tests that start processes (marker `slow`): 8 emulated devices, several hosts on
    loopback, archive writers killed mid-write, an archive larger than the memory used."""
    run_tests(session, "-m", "slow")


@nox.session(python=PYTHONS, name="tests-all")
def tests_all(session: nox.Session) -> None:
    """The whole test suite on every supported Python, from the source tree; a missing one is
    an error. (CI runs it on 3.11 at the quick budgets, leaving the stateful tests and the
    docs' examples to `nox -s stateful` and `nox -s docs`, and on 3.13 against the wheel: `nox
    -s package`. See .ci/run.)"""
    run_tests(session)


# What the package run copies of the repository: everything the tests read (docs, notebooks,
# examples, README, pyproject's pytest settings) but the package's source.
NOT_COPIED = {"equibuffer", ".git", ".nox", ".venv", "site", "dist", "build", ".hypothesis"}


def check_dists(dist: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Check the wheel and the sdist in `dist` hold every file of `equibuffer/` (`py.typed` and
    any data file included) and declare the extras; return their paths."""
    package = {
        p.relative_to(".").as_posix()
        for p in pathlib.Path("equibuffer").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert "equibuffer/py.typed" in package, "equibuffer/py.typed is missing from the source"
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    with zipfile.ZipFile(wheel) as z:
        in_wheel = set(z.namelist())
        (meta,) = [n for n in in_wheel if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(z.read(meta))
    with tarfile.open(sdist) as t:
        in_sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for name, held in [(wheel.name, in_wheel), (sdist.name, in_sdist)]:
        missing = sorted(package - held)
        assert not missing, f"{name} lacks files of equibuffer/: {missing}"
    extras = set(metadata.get_all("Provides-Extra") or [])
    assert {"s3", "testing", "orbax", "offline"} <= extras, (
        f"{wheel.name} declares the extras {sorted(extras)}"
    )
    return wheel, sdist


def run_installed(session: nox.Session, *selection: str) -> None:
    """Build the sdist and the wheel, check them, install the wheel with its extras into this
    session's fresh environment and run the tests against it, from a copy of the repository
    without `equibuffer/` (the conftest checks the package comes from site-packages)."""
    tmp = pathlib.Path(session.create_tmp()).resolve()
    dist, copy = tmp / "dist", tmp / "repository"
    shutil.rmtree(dist, ignore_errors=True)
    shutil.rmtree(copy, ignore_errors=True)
    session.run("uv", "build", "--quiet", "--out-dir", str(dist))
    wheel, sdist = check_dists(dist)
    session.run("uv", "tool", "run", "twine", "check", "--strict", str(wheel), str(sdist))
    deps = nox.project.dependency_groups(PYPROJECT, "tests")
    session.install(
        f"equibuffer[s3,testing,orbax,offline] @ {wheel.as_uri()}",
        *deps,
        "--reinstall-package",
        "equibuffer",
    )
    shutil.copytree(".", copy, ignore=lambda d, names: NOT_COPIED if d == "." else ())
    with session.chdir(copy):
        session.run("pytest", "-n", "2", "--dist", "loadfile", *selection, env={INSTALLED: "1"})


@nox.session(python=HERE)
def package(session: nox.Session) -> None:
    """The package as `pip` installs it: builds the sdist and the wheel, checks their metadata
    (`twine check --strict`) and contents (`py.typed` and every file of `equibuffer/`),
    installs the wheel with its extras `[s3,testing,orbax,offline]` into a fresh environment
    and runs the tests against it from a copy of the repository without the source
    (`nox -s tests`'s selection; `nox -s package -- tests` runs the whole suite, as CI does on
    3.13)."""
    run_installed(session, *(session.posargs or QUICK))


@nox.session(python=HERE)
def stateful(session: nox.Session) -> None:
    """Every stateful test (marker `stateful`) scaled up: each one's `max_examples` times
    `EQUIBUFFER_STATEFUL_EXAMPLES`, at least 10,000 random sequences in all (the session fails
    with fewer); prints the count per test and the total. About 12 minutes on two cores
    (12,117 sequences in 12 min 21 s, Python 3.11)."""
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


def changed_files(base: str | None) -> tuple[str, list[str]]:
    """The base the change is counted from and the files it touches: the commits since
    `base` (default: the branch's upstream where one is set, else the newest commit older
    than four hours, as a session's change) and what is not committed, untracked included."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()

    if base is None:
        base = git("rev-parse", "--verify", "-q", "@{upstream}") or git(
            "rev-list", "-1", "--before=4 hours ago", "HEAD"
        )
        base = base or git("rev-list", "--max-parents=0", "HEAD").splitlines()[-1]
    committed = git("diff", "--name-only", base, "--").splitlines()
    untracked = git("ls-files", "--others", "--exclude-standard").splitlines()
    return base, sorted({*committed, *untracked})


def tests_of(files: list[str]) -> tuple[list[str], list[str]]:
    """The test files a change to `files` asks for: the changed test files; and the test
    files named after a changed module or its package (`equibuffer/_sumtree/_writes.py`:
    `tests/test_sumtree*.py`, `tests/test_writes*.py`), importing it by its dotted name, or
    importing a changed helper of `tests/`."""
    tests = pathlib.Path("tests")
    texts = {p: p.read_text() for p in sorted(tests.glob("test_*.py"))}
    changed: set[pathlib.Path] = set()
    touched: set[pathlib.Path] = set()
    for name in files:
        path = pathlib.Path(name)
        if path.suffix != ".py" or not path.exists():
            continue
        if path.parent == tests and path.name.startswith("test_"):
            changed.add(path)
        elif path.parent == tests:  # a helper: the tests that import it
            touched |= {p for p, t in texts.items() if re.search(rf"\b{path.stem}\b", t)}
        elif path.parts[0] == "equibuffer":
            stems = {part.removesuffix(".py").strip("_") for part in path.parts[1:]} - {"init"}
            dotted = ".".join(path.with_suffix("").parts)
            touched |= {p for s in stems if s for p in tests.glob(f"test_{s}*.py")}
            touched |= {p for p, t in texts.items() if dotted in t}
    return sorted(p.as_posix() for p in changed), sorted(p.as_posix() for p in touched - changed)


@nox.session(python=HERE)
def precheck(session: nox.Session) -> None:
    """The checks that have failed CI after a green local run, in minutes: lint; pyright
    against both sets of releases CI checks (Python 3.11's and 3.13's: both must be found,
    e.g. `PYENV_VERSION=3.11.7:3.13.0`); the docs' examples and the strict site build (`nox
    -s docs`); the tests of the files the change touched (see `tests_of`), in `nox -s tests`'s
    selection at its budgets. Run it before every push: about 10 minutes on 2 cores at most
    (the tests of every file: the quick tier).

    `nox -s precheck -- --base REV` counts the change from `REV`; `nox -s precheck --
    tests/test_x.py ...` runs those tests instead of the touched ones."""
    args = list(session.posargs)
    base = None
    if "--base" in args:
        at = args.index("--base")
        base, args = args[at + 1], args[:at] + args[at + 2 :]
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")
    nested = [sys.executable, "-m", "nox"]
    for python in ("3.11", "3.13"):
        session.run(*nested, "--force-python", python, "-s", "typecheck", external=True)
    session.run(*nested, "-s", "docs", external=True)
    base, files = changed_files(base)
    changed, touched = (args, []) if args else tests_of(files)
    session.log(f"changed since {base[:12]}: {len(files)} files")
    session.log(f"tests changed: {changed or 'none'}; of the modules changed: {touched or 'none'}")
    if changed or touched:
        # At the quick tier's budgets and selection (`nox -s tests`): the slow and thorough
        # cases of these files are left to `nox -s slow`, `nox -s tests-all` and CI, so that
        # the whole check stays within about 10 minutes however wide the change.
        install(session, "tests")
        selection = [*QUICK, *changed, *touched]
        session.run("pytest", "-n", "2", "--dist", "loadfile", *selection, success_codes=[0, 5])


@nox.session(python=HERE)
def lint(session: nox.Session) -> None:
    """ruff: formatting and lint (imports sorted)."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")


@nox.session(python=HERE)
def typecheck(session: nox.Session) -> None:
    """pyright over the package, against the releases this Python resolves (CI runs it on
    3.11 and 3.13: the oldest and the newest jax and zarr)."""
    install(session, "typecheck", package=".[s3,testing,orbax,offline]")
    session.run("pyright")


@nox.session(python=HERE)
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs-material + mkdocstrings), built strictly into `site/`,
    after running every code block of its pages and every docstring example as written (the
    tests marked `examples` in tests/test_docs.py).

    Any further arguments go to `mkdocs build` (e.g. `nox -s docs -- --site-dir /tmp/site`).
    """
    install(session, "docs", "tests")
    session.run("pytest", "-n", "2", "-m", "examples", "tests/test_docs.py")
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
    `programs`, `loader`, `epochs`, `clusters`, `checkpoint`, `import`, `pixels`) runs one, with
    any further arguments passed to it.
    (`bench_gpu` is not among them: it is for a lent GPU, through `benchmarks/gpu.sh`.) The
    figures in `benchmarks/README.md` come from Python 3.12 and jax 0.12 (`nox
    --force-python 3.12 -s bench`); on 3.11 the same scripts measure jax 0.10.
    """
    install(session, "bench", package=".[s3,orbax,offline]")
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
        "loader",
        "epochs",
        "clusters",
        "checkpoint",
        "import",
        "pixels",
    ]
    args = list(session.posargs)
    chosen = [a for a in args if a in names] or names
    flags = [a for a in args if a not in names]
    for name in chosen:
        session.run("python", "-m", f"benchmarks.bench_{name}", *flags)
