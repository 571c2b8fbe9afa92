"""Every check of the project, one session each: `nox -s tests`, `nox -s lint`, ...

Environments are built with uv from the dependency groups in pyproject.toml.
"""

import nox


nox.options.default_venv_backend = "uv"
nox.options.sessions = ["tests", "lint", "typecheck"]

PYPROJECT = nox.project.load_toml("pyproject.toml")
PYTHONS = ["3.11", "3.12", "3.13"]


def install(session: nox.Session, *groups: str, package: str = ".") -> None:
    deps = [d for g in groups for d in nox.project.dependency_groups(PYPROJECT, g)]
    session.install("-e", package, *deps)


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """The test suite (jaxtyping + beartype runtime checks on), on every supported Python."""
    install(session, "tests")
    session.run("pytest", "-n", "2", "--dist", "loadfile", *session.posargs)


@nox.session(python="3.12")
def lint(session: nox.Session) -> None:
    """ruff: formatting and lint (imports sorted)."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")


@nox.session(python="3.12")
def typecheck(session: nox.Session) -> None:
    """pyright over the package."""
    install(session, "typecheck", package=".[s3]")
    session.run("pyright")


@nox.session(python="3.12")
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs-material + mkdocstrings), built strictly into `site/`.

    Any further arguments go to `mkdocs build` (e.g. `nox -s docs -- --site-dir /tmp/site`).
    """
    install(session, "docs")
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(python="3.12")
def demo(session: nox.Session) -> None:
    """The README's demo: a DQN learning CartPole with a TransitionBuffer in its train state."""
    install(session, "demo")
    session.run("python", "examples/dqn_cartpole.py", *session.posargs)


@nox.session(python="3.12")
def bench(session: nox.Session) -> None:
    """Benchmarks side by side with the peers (ratios, never pass/fail). `-- --quick` for small.

    `nox -s bench -- --quick` runs every script at small sizes; `nox -s bench -- core` (or
    `prioritised`, `archive`, `issue6`, `ring_write`) runs one, with any further arguments
    passed to it.
    """
    install(session, "bench", package=".[s3]")
    names = ["core", "prioritised", "archive", "issue6", "ring_write"]
    args = list(session.posargs)
    chosen = [a for a in args if a in names] or names
    flags = [a for a in args if a not in names]
    for name in chosen:
        session.run("python", "-m", f"benchmarks.bench_{name}", *flags)
