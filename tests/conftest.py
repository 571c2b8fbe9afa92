import os

import jax
import jax.random as jr
import pytest

from .helpers import SEQUENCES, STATEFUL_EXAMPLES


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


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

_SEQUENCES_KEY = "equibuffer_stateful_sequences"


def pytest_addoption(parser):
    parser.addoption(
        "--min-sequences",
        type=int,
        default=0,
        help="fail the session when the stateful tests ran fewer random sequences in all",
    )


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand its counts to the controller
        workeroutput[_SEQUENCES_KEY] = dict(SEQUENCES)
        return
    wanted = session.config.getoption("--min-sequences")
    if wanted and sum(SEQUENCES.values()) < wanted and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    SEQUENCES.update(getattr(node, "workeroutput", {}).get(_SEQUENCES_KEY, {}))


def pytest_terminal_summary(terminalreporter, config):
    wanted = config.getoption("--min-sequences")
    if not (os.environ.get(STATEFUL_EXAMPLES) or wanted):
        return
    terminalreporter.section("stateful sequences")
    for name, n in sorted(SEQUENCES.items()):
        terminalreporter.write_line(f"{name}: {n}")
    total = sum(SEQUENCES.values())
    terminalreporter.write_line(f"total: {total} random sequences")
    if total < wanted:
        terminalreporter.write_line(f"FAILED: fewer than --min-sequences={wanted}", red=True)
