"""Hypothesis strategies of buffers: `BufferConfig` (one buffer kind, its example and its
keyword arguments, shown as the constructor call), `buffer_configs` (configurations of every
kind, drawn within what each kind takes) and `buffers` (the configurations built)."""

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
from hypothesis import assume
from hypothesis.strategies import SearchStrategy
from jaxtyping import PyTree

from .._buffers._base import AbstractBuffer
from .._buffers._episode_trajectory import (
    EpisodeTrajectoryBuffer,
    PrioritisedEpisodeTrajectoryBuffer,
)
from .._buffers._item import ItemBuffer
from .._buffers._prioritised import (
    PrioritisedItemBuffer,
    PrioritisedTrajectoryBuffer,
    PrioritisedTransitionBuffer,
)
from .._buffers._queue import Queue
from .._buffers._trajectory import TrajectoryBuffer
from .._buffers._transition import TransitionBuffer
from ._draws import _keeps_random, _strategy
from ._examples import _examples, _leaves


KINDS: tuple[type, ...] = (
    TrajectoryBuffer,
    TransitionBuffer,
    ItemBuffer,
    PrioritisedTrajectoryBuffer,
    PrioritisedTransitionBuffer,
    PrioritisedItemBuffer,
    EpisodeTrajectoryBuffer,
    PrioritisedEpisodeTrajectoryBuffer,
    Queue,
)
_TRANSITIONS = (TransitionBuffer, PrioritisedTransitionBuffer)
_ITEMS = (ItemBuffer, PrioritisedItemBuffer)
_EPISODIC = (EpisodeTrajectoryBuffer, PrioritisedEpisodeTrajectoryBuffer)
_PRIORITISED = (
    PrioritisedTrajectoryBuffer,
    PrioritisedTransitionBuffer,
    PrioritisedItemBuffer,
    PrioritisedEpisodeTrajectoryBuffer,
)

AnyBuffer = AbstractBuffer | Queue


class _Spec:
    """How a `BufferConfig` shows one example leaf: `float32[3]`."""

    def __init__(self, leaf: Any):
        self.text = f"{jnp.dtype(leaf.dtype).name}{list(leaf.shape)}"

    def __repr__(self) -> str:
        return self.text


@dataclasses.dataclass(frozen=True)
class BufferConfig:
    """One buffer configuration: the class, its `example` and its keyword arguments (sized
    with `capacity=` only). `build()` constructs the buffer; the `repr` reads like the call,
    so a failing example reported by hypothesis says which buffer failed.

    **Arguments:**

    - `cls`: the buffer class (e.g. [`equibuffer.TrajectoryBuffer`][]).
    - `example`: one step, a pytree of arrays.
    - `kwargs`: every other argument of the constructor.

    !!! example

        ```python
        import jax.numpy as jnp
        import equibuffer as eb
        from equibuffer.testing import BufferConfig

        config = BufferConfig(eb.TrajectoryBuffer, {"obs": jnp.zeros(3)},
                              {"add_batch_size": 2, "capacity": 10, "sequence_length": 4})
        assert repr(config) == ("TrajectoryBuffer(example={'obs': float32[3]}, add_batch_size=2, "
                                "capacity=10, sequence_length=4)")
        buffer = config.build()
        assert isinstance(buffer, eb.TrajectoryBuffer) and buffer.capacity == 10
        ```
    """

    cls: type
    example: PyTree[Any]
    kwargs: Mapping[str, Any]

    def build(self) -> AnyBuffer:
        """The buffer: `cls(example, **kwargs)`."""
        return _keeps_random(self.cls)(self.example, **self.kwargs)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # (How Hypothesis and IPython print it: as the call, not field by field.)
        printer.text(repr(self))

    def __repr__(self) -> str:
        def show(v: Any) -> str:
            return v.__name__ if callable(v) else repr(v)

        example = jax.tree.map(_Spec, self.example)
        args = ", ".join(f"{k}={show(v)}" for k, v in self.kwargs.items())
        return f"{self.cls.__name__}(example={example!r}, {args})"


def _leaf_spec(example: Any, name: str) -> Any:
    if isinstance(example, Mapping):
        return example.get(name)
    return getattr(example, name, None)


def _is(example: Any, name: str | None, kind: str) -> bool:
    """Whether the step has a 0-d leaf `name` of `kind` ("bool" or "float")."""
    leaf = None if name is None else _leaf_spec(example, name)
    if leaf is None or not hasattr(leaf, "dtype") or tuple(leaf.shape) != ():
        return False
    if kind == "bool":
        return jnp.dtype(leaf.dtype) == jnp.bool_
    return bool(jnp.issubdtype(leaf.dtype, jnp.floating))


def _terminated_or_truncated(step: Mapping[str, Any]) -> Any:
    """The episode end of an n-step step: `terminated | truncated`."""
    return step["terminated"] | step["truncated"]


@st.composite
@_keeps_random
def _configs(
    draw: Any,
    kinds: tuple,  # (no item types: beartype would draw from `random` to check one)
    explicit: bool,
    example: Any,
    rows_s: SearchStrategy,
    capacity_s: SearchStrategy | None,
    sequence_s: SearchStrategy | None,
    period_s: SearchStrategy,
    n_step: Any,
    discount_s: SearchStrategy,
    episodes: Any,
    mode_s: SearchStrategy,
    alpha_s: SearchStrategy,
    episode_end: str,
) -> BufferConfig:
    given = None
    usable = kinds
    if example is not None:
        given = draw(example, label="example") if isinstance(example, SearchStrategy) else example
        if not _is(given, episode_end, "bool"):
            usable = tuple(k for k in kinds if k not in _EPISODIC)
            if explicit and len(usable) < len(kinds):
                raise ValueError(
                    f"buffer_configs(): the episode-aware kinds need a 0-d bool leaf "
                    f"[{episode_end!r}] in the example (`episode_end={episode_end!r}`), which "
                    f"{jax.tree.map(_Spec, given)!r} lacks."
                )
    kind = draw(st.sampled_from(usable), label="kind")
    rows = draw(rows_s, label="add_batch_size")
    kwargs: dict[str, Any] = {"add_batch_size": rows}
    extra: dict[str, Any] = {}

    # The window: drawn here for transitions and items, after the length for sequences.
    n, window, truncated = None, None, "truncated"
    episodic = False
    if kind in _TRANSITIONS:
        n = draw(_strategy(n_step, st.none()), label="n_step")
        has_leaves = given is None or (
            _is(given, "reward", "float") and _is(given, "terminated", "bool")
        )
        if n is not None and not has_leaves:
            if not isinstance(n_step, SearchStrategy):
                raise ValueError(
                    "buffer_configs(): n-step transitions need 0-d leaves 'reward' (float) and "
                    f"'terminated' (bool) in the example, which {jax.tree.map(_Spec, given)!r} "
                    "lacks."
                )
            n = None
        if n is not None:
            if given is None:
                truncated = "truncated" if draw(st.booleans(), label="truncated leaf") else None
                extra.update(reward=jnp.float32(0), terminated=jnp.bool_(False))
                if truncated is not None:
                    extra["truncated"] = jnp.bool_(False)
            elif not _is(given, "truncated", "bool"):
                truncated = None
        episodic = bool(draw(_strategy(episodes, st.just(False)), label="episode-aware"))
        if episodic and n is None and given is not None and not _is(given, episode_end, "bool"):
            if not isinstance(episodes, SearchStrategy):
                raise ValueError(
                    f"buffer_configs(): episode-aware transitions need a 0-d bool leaf "
                    f"[{episode_end!r}] in the example, which {jax.tree.map(_Spec, given)!r} "
                    "lacks."
                )
            episodic = False
        window = 2 if n is None else n + 1
    elif kind in _ITEMS:
        window = 1
    if kind in _EPISODIC or (episodic and n is None):
        extra[episode_end] = jnp.bool_(False)

    if capacity_s is None:
        if window is None:
            window = draw(_strategy(sequence_s, st.integers(1, 4)), label="sequence_length")
        length = draw(st.integers(window, window + 6), label="steps per row")
        capacity = rows * length - draw(st.integers(0, rows - 1), label="capacity below")
    else:
        capacity = draw(capacity_s, label="capacity")
        length = math.ceil(capacity / rows)
        if window is None:
            default = st.integers(1, max(1, min(4, length)))
            window = draw(_strategy(sequence_s, default), label="sequence_length")
    assume(window <= length)
    kwargs["capacity"] = capacity

    if kind not in _TRANSITIONS and kind not in _ITEMS:
        kwargs["sequence_length"] = window
        if kind is not Queue:
            kwargs["period"] = draw(period_s, label="period")
    if n is not None:
        kwargs.update(n_step=n, discount=draw(discount_s, label="discount"), truncated=truncated)
    if kind in _EPISODIC or episodic:
        if n is None:
            kwargs["episode_end"] = episode_end
        else:  # the n-step sums stop at the same ends as the windows
            kwargs["episode_end"] = _terminated_or_truncated if truncated else "terminated"
        kwargs["mode"] = draw(mode_s, label="mode")
    if kind in _PRIORITISED:
        kwargs["alpha"] = draw(alpha_s, label="alpha")

    if given is None:
        random = _examples(None, _leaves(None, None), 1, 4, True, extra)
        given = draw(random, label="example")
    return BufferConfig(kind, given, kwargs)


def buffer_configs(
    kinds: type | Sequence[type] | None = None,
    *,
    example: PyTree[Any] | SearchStrategy[PyTree[Any]] | None = None,
    add_batch_size: int | SearchStrategy[int] = st.integers(1, 3),
    capacity: int | SearchStrategy[int] | None = None,
    sequence_length: int | SearchStrategy[int] | None = None,
    period: int | SearchStrategy[int] = st.integers(1, 3),
    n_step: int | SearchStrategy[int | None] | None = st.one_of(st.none(), st.integers(1, 3)),
    discount: float | SearchStrategy[float] = st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    episodes: bool | SearchStrategy[bool] = st.booleans(),
    mode: str | SearchStrategy[str] = st.sampled_from(["never_cross", "pad"]),
    alpha: float | SearchStrategy[float] = st.sampled_from([0.0, 0.5, 0.6, 1.0]),
    episode_end: str = "done",
) -> SearchStrategy[BufferConfig]:
    """A strategy of buffer configurations ([`equibuffer.testing.BufferConfig`][]) of every
    kind, sized with `capacity=` and small enough to test quickly.

    Each argument is a value or a strategy; an argument applies only to the kinds that take
    it. A failing example is reported as the constructor call.

    **Arguments:**

    - `kinds`: a buffer class or a sequence of them, among [`equibuffer.TrajectoryBuffer`][],
        [`equibuffer.TransitionBuffer`][], [`equibuffer.ItemBuffer`][], their prioritised
        variants, [`equibuffer.EpisodeTrajectoryBuffer`][],
        [`equibuffer.PrioritisedEpisodeTrajectoryBuffer`][] and [`equibuffer.Queue`][].
        Default: all of them (those the `example` can serve).
    - `example`: the example step, or a strategy of them. Default: a random one from
        [`equibuffer.testing.examples`][] with the leaves the kind needs (`episode_end`, and
        `reward`, `terminated` and maybe `truncated` for n-step transitions). With your own
        example, the kinds and options that need leaves it lacks are left out (an error when
        you asked for them explicitly).
    - `add_batch_size`: rows per add (default 1 to 3).
    - `capacity`: steps held in total. Default: room for the window plus 0 to 6 steps per
        row, sometimes not a multiple of `add_batch_size` (it is rounded up per row).
    - `sequence_length`: the window of the trajectory, episode and queue kinds (default 1
        to 4, at most the steps per row).
    - `period`: the period of window starts of the trajectory kinds (default 1 to 3).
    - `n_step`: `None` for pairs or the `n_step` of the transition kinds (default either,
        `n_step` 1 to 3); `discount`: their discount.
    - `episodes`: whether the transition kinds are episode-aware (`episode_end=`).
    - `mode`: the episode mode, `"never_cross"` or `"pad"`.
    - `alpha`: the priority exponent of the prioritised kinds.
    - `episode_end`: the name of the 0-d bool leaf that ends an episode (episode-aware n-step
        transitions use `terminated | truncated`, so that the sums stop at the same ends).

    !!! example

        ```python
        import equibuffer as eb
        from hypothesis import given, settings
        from equibuffer.testing import buffer_configs

        @settings(max_examples=20, deadline=None)
        @given(buffer_configs([eb.TrajectoryBuffer, eb.Queue], add_batch_size=2))
        def test(config):
            assert config.kwargs["add_batch_size"] == 2 and "capacity" in config.kwargs
            buffer = config.build()
            assert buffer.capacity >= config.kwargs["capacity"]  # rounded up per row
            assert int(buffer.size()) == 0

        test()
        ```
    """
    if kinds is None:
        chosen, explicit = KINDS, False
    else:
        chosen = tuple(kinds) if isinstance(kinds, Sequence) else (kinds,)
        explicit = True
        for k in chosen:
            if k not in KINDS:
                raise ValueError(
                    f"buffer_configs(): {getattr(k, '__name__', k)!r} is not a buffer kind; "
                    f"choose among {[c.__name__ for c in KINDS]}."
                )
    if not chosen:
        raise ValueError("buffer_configs(): `kinds` is empty.")
    return _configs(
        chosen,
        explicit,
        example,
        _strategy(add_batch_size, st.integers(1, 3)),
        None if capacity is None else _strategy(capacity, st.nothing()),
        None if sequence_length is None else _strategy(sequence_length, st.nothing()),
        _strategy(period, st.integers(1, 3)),
        n_step,
        _strategy(discount, st.just(0.9)),
        episodes,
        _strategy(mode, st.just("never_cross")),
        _strategy(alpha, st.just(0.6)),
        episode_end,
    )


def buffers(
    kinds: type | Sequence[type] | None = None, **options: Any
) -> SearchStrategy[AnyBuffer]:
    """A strategy of empty buffers: [`equibuffer.testing.buffer_configs`][] built.

    **Arguments:** `kinds` and `**options` as for [`equibuffer.testing.buffer_configs`][].

    (Prefer drawing configurations when you can: a failing example then shows as the
    constructor call, not as the buffer's arrays.)

    !!! example

        ```python
        import equibuffer as eb, jax.numpy as jnp
        from hypothesis import given, settings
        from equibuffer.testing import buffers

        @settings(max_examples=10, deadline=None)
        @given(buffers(eb.EpisodeTrajectoryBuffer, mode="pad"))
        def test(buffer):
            assert isinstance(buffer, eb.EpisodeTrajectoryBuffer) and buffer.mode == "pad"
            assert not buffer.can_sample()

        test()
        ```
    """
    return buffer_configs(kinds, **options).map(BufferConfig.build)
