"""The plumbing every strategy of `equibuffer.testing` shares: `_strategy` takes an argument
that is a value or a strategy as a strategy, and `_keeps_random` makes a strategy that runs
library code leave Python's global `random` state as it found it (which Hypothesis
requires)."""

import functools
import random
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
from hypothesis.strategies import SearchStrategy


def _keeps_random(fn: Callable) -> Callable:
    """`fn` with the global `random` state restored when it returns.

    Nothing here draws from `random`, but a runtime type checker may (beartype samples one
    item of a `list[int]` argument with `random.getrandbits`), and Hypothesis refuses a
    strategy that moves the global state. So every strategy of `equibuffer.testing` that
    runs library code (building a buffer, adding to it) leaves the state as it found it.
    """

    @functools.wraps(fn)
    def kept(*args: Any, **kwargs: Any) -> Any:
        state = random.getstate()
        try:
            return fn(*args, **kwargs)
        finally:
            random.setstate(state)

    return kept


def _strategy(value: Any, default: SearchStrategy) -> SearchStrategy:
    """A value or a strategy, as a strategy (`None`: `default`)."""
    if value is None:
        return default
    return value if isinstance(value, SearchStrategy) else st.just(value)
