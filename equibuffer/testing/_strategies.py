"""Hypothesis strategies: example trees, buffer configurations and buffers, batches that fit a
buffer, and buffers filled by random adds (with their NumPy reference when asked)."""

import dataclasses
import functools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, overload

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import assume
from hypothesis.strategies import SearchStrategy
from jaxtyping import Array, PyTree, Shaped

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
from .._errors import filter_jit
from ._reference import BufferReference, QueueReference


# The leaf dtypes drawn by default: every one a buffer stores on any backend without x64.
DTYPES = (jnp.float32, jnp.int32, jnp.bool_, jnp.uint8, jnp.float16, jnp.int8)
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
_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=6)

AnyBuffer = AbstractBuffer | Queue


def _keeps_random(fn: Callable) -> Callable:
    """`fn` with the global `random` state restored when it returns.

    Nothing here draws from `random`, but a runtime type checker may (beartype samples one
    item of a `list[int]` argument with `random.getrandbits`), and Hypothesis refuses a
    strategy that moves the global state. So every strategy below that runs library code
    (building a buffer, adding to it) leaves the state as it found it.
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


def leaves(
    shape: tuple[int, ...] | SearchStrategy[tuple[int, ...]] | None = None,
    dtype: Any = None,
) -> SearchStrategy[Shaped[Array, "..."]]:
    """A strategy of example leaves: zero JAX arrays of a chosen or random shape and dtype.

    **Arguments:**

    - `shape`: a shape, or a strategy of shapes. Default: 0 to 2 dimensions of 1 to 3
        (`hypothesis.extra.numpy.array_shapes(min_dims=0, max_dims=2, max_side=3)`).
    - `dtype`: a dtype, or a strategy of dtypes. Default: one of float32, int32, bool,
        uint8, float16, int8.

    **Returns:**

    A strategy of `jnp.zeros(shape, dtype)`: values do not matter in an example, only the
    shape and dtype a buffer allocates from.

    !!! example

        ```python
        import jax.numpy as jnp
        from hypothesis import given, settings
        from equibuffer.testing import leaves

        @settings(max_examples=10)
        @given(leaves(dtype=jnp.float32), leaves(shape=(3,)))
        def test(a, b):
            assert a.dtype == jnp.float32 and a.ndim <= 2 and b.shape == (3,)

        test()
        ```
    """
    return _leaves(shape, dtype)


def _leaves(shape: Any, dtype: Any) -> SearchStrategy:
    # (The public functions' checks under beartype draw from `random`, which Hypothesis
    # forbids inside a draw: draws call these private forms.)
    shapes = _strategy(shape, hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=3))
    dtypes = _strategy(dtype, st.sampled_from(DTYPES))
    return st.builds(lambda s, d: jnp.zeros(tuple(s), d), shapes, dtypes)


def _as_leaf(value: Any) -> Any:
    if isinstance(value, jax.ShapeDtypeStruct) or (
        hasattr(value, "shape") and hasattr(value, "dtype")
    ):
        return jnp.zeros(value.shape, value.dtype)
    raise TypeError(
        "examples(): every leaf of `structure` must be an array, a jax.ShapeDtypeStruct or a "
        f"strategy of arrays (e.g. `leaves()`), got {type(value).__name__} {value!r}."
    )


@st.composite
@_keeps_random
def _examples(
    draw: Any,
    structure: Any,
    leaf: SearchStrategy,
    min_leaves: int,
    max_leaves: int,
    nested: bool,
    extra: Mapping,
) -> Any:
    if structure is not None:
        tree = jax.tree.map(
            lambda x: draw(x) if isinstance(x, SearchStrategy) else _as_leaf(x),
            structure,
        )
    else:
        n = draw(st.integers(min_leaves, max_leaves), label="leaves")
        sizes = []  # the leaves of each top-level entry: 1 for a leaf, more for a group
        while sum(sizes) < n:
            left = n - sum(sizes)
            group = nested and left >= 2 and draw(st.booleans(), label="nested")
            sizes.append(draw(st.integers(2, left), label="group size") if group else 1)
        names = _NAMES.filter(lambda k: k not in extra)
        keys = draw(st.lists(names, min_size=len(sizes), max_size=len(sizes), unique=True))
        tree = {}
        for key, size in zip(keys, sizes, strict=True):
            if size == 1:
                tree[key] = draw(leaf)
            elif draw(st.booleans(), label=f"{key} is a tuple"):
                tree[key] = tuple(draw(leaf) for _ in range(size))
            else:
                tree[key] = {f"{key}{j}": draw(leaf) for j in range(size)}
    if extra:
        if not isinstance(tree, dict):
            raise TypeError("examples(): `extra` leaves need a dict `structure`.")
        tree = {**tree, **{k: _as_leaf(v) for k, v in extra.items()}}
    return tree


def examples(
    structure: PyTree[Any] | None = None,
    *,
    shape: tuple[int, ...] | SearchStrategy[tuple[int, ...]] | None = None,
    dtype: Any = None,
    min_leaves: int = 1,
    max_leaves: int = 4,
    nested: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> SearchStrategy[PyTree[Shaped[Array, "..."]]]:
    """A strategy of example steps: what a buffer constructor takes as `example`.

    **Arguments:**

    - `structure`: `None` (default) for a random structure: a dict of `min_leaves` to
        `max_leaves` leaves under random names, some grouped in a nested dict or tuple when
        `nested`. Or a pytree of your own (dict, tuple, `eqx.Module`, ...) whose leaves are
        arrays or `jax.ShapeDtypeStruct`s (kept: their shape and dtype) or strategies of
        leaves such as [`equibuffer.testing.leaves`][] (drawn).
    - `shape`, `dtype`: the shapes and dtypes of the random leaves, as for
        [`equibuffer.testing.leaves`][] (a value or a strategy).
    - `min_leaves`, `max_leaves`, `nested`: the size and nesting of a random structure.
    - `extra`: top-level leaves every example has, exactly as given (e.g.
        `{"done": jnp.bool_(False)}` for an episode-aware buffer), added to a dict structure.

    **Returns:**

    A strategy of pytrees of zero JAX arrays.

    !!! example

        ```python
        import jax, jax.numpy as jnp
        from hypothesis import given, settings
        import equibuffer as eb
        from equibuffer.testing import examples, leaves

        @settings(max_examples=10, deadline=None)
        @given(examples(extra={"done": jnp.bool_(False)}),
               examples({"obs": leaves(dtype=jnp.float32), "action": jnp.int32(0)}))
        def test(random, chosen):
            assert random["done"].dtype == jnp.bool_ and 2 <= len(jax.tree.leaves(random)) <= 5
            assert chosen["obs"].dtype == jnp.float32 and chosen["action"].shape == ()
            eb.ItemBuffer(random, add_batch_size=2, capacity=4)  # any example builds a buffer

        test()
        ```
    """
    if not 1 <= min_leaves <= max_leaves:
        raise ValueError(
            f"examples(): need 1 <= min_leaves <= max_leaves, got {min_leaves}, {max_leaves}."
        )
    return _examples(structure, _leaves(shape, dtype), min_leaves, max_leaves, nested, extra or {})


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


def _elements(dtype: np.dtype) -> SearchStrategy:
    """The values `batches` draws by default for a dtype: episode ends (bools) on about one
    step in four, finite floats and integers in [-100, 100]."""
    if dtype == np.bool_:
        return st.sampled_from([False, False, False, True])
    if np.issubdtype(dtype, np.floating):
        width: Literal[16, 32, 64] = (
            16 if dtype.itemsize == 2 else 32 if dtype.itemsize == 4 else 64
        )
        return st.floats(-100, 100, width=width, allow_subnormal=False)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return st.integers(max(int(info.min), -100), min(int(info.max), 100))
    return hnp.from_dtype(dtype)


@st.composite
@_keeps_random
def _batches(
    draw: Any, buffer: Any, steps: SearchStrategy, elements: Callable[[np.dtype], SearchStrategy]
) -> Any:
    t = draw(steps, label="steps")
    if t is not None:
        assume(t >= 1)
    spec = buffer.storage.example()
    lead = (buffer.add_batch_size,) if t is None else (buffer.add_batch_size, t)

    def leaf(s: jax.ShapeDtypeStruct) -> Array:
        dtype = np.dtype(s.dtype)
        shape = lead + tuple(s.shape)
        if dtype.kind == "V":  # (ml_dtypes' bfloat16, float8, ...: drawn as float32)
            x = draw(hnp.arrays(np.float32, shape, elements=_elements(np.dtype(np.float32))))
            return jnp.asarray(x).astype(s.dtype)
        return jnp.asarray(draw(hnp.arrays(dtype, shape, elements=elements(dtype))))

    return jax.tree.map(leaf, spec)


def batches(
    buffer: AnyBuffer,
    *,
    steps: int | SearchStrategy[int | None] | None = None,
    elements: Callable[[np.dtype], SearchStrategy[Any]] | None = None,
) -> SearchStrategy[PyTree[Shaped[Array, "add_batch_size ..."]]]:
    """A strategy of batches that `buffer.add` takes: the example's structure and dtypes, with
    leaves `(add_batch_size, *leaf)` (one step) or `(add_batch_size, T, *leaf)` (`T` steps).

    **Arguments:**

    - `buffer`: any buffer or [`equibuffer.Queue`][].
    - `steps`: `T`, `None` for the one-step form, or a strategy of either. Default: either
        form, `T` from 1 to two more than the steps per row (so adds wrap the ring); for a
        queue at most its free room, so the add fits.
    - `elements`: a function `dtype -> strategy of values` for the leaves. Default: bools
        true on about one step in four (episode ends), floats and integers in [-100, 100].

    !!! example

        ```python
        import jax.numpy as jnp
        import equibuffer as eb
        from hypothesis import given, settings
        from equibuffer.testing import batches

        buffer = eb.TransitionBuffer({"obs": jnp.zeros(3), "action": jnp.int32(0)},
                                     add_batch_size=4, capacity=20)

        @settings(max_examples=10, deadline=None)
        @given(batches(buffer))
        def test(batch):
            t = buffer.steps_in(batch)  # None (one step) or T; raises if the batch did not fit
            assert batch["obs"].shape == ((4, 3) if t is None else (4, t, 3))
            assert batch["action"].dtype == jnp.int32
            buffer.add(batch)

        test()
        ```
    """
    if not isinstance(buffer, AnyBuffer):
        raise TypeError(f"batches(): expected a buffer or a Queue, got {type(buffer).__name__}.")
    return _batches_of(buffer, steps, elements)


def _batches_of(buffer: Any, steps: Any, elements: Any) -> SearchStrategy:
    length = buffer.capacity // buffer.add_batch_size
    if steps is None:
        most = length + 2
        if isinstance(buffer, Queue):
            most = length - int(buffer.unread)
            if most < 1:
                raise ValueError(
                    "batches(): the queue is full (no room for one more step per row); sample "
                    "from it first, or pass `steps=` to draw batches it refuses."
                )
        default: SearchStrategy = st.one_of(st.none(), st.integers(1, most))
    else:
        default = _strategy(steps, st.none())
    return _batches(buffer, default, elements or _elements)


@filter_jit  # (checked: a refused add raises here, as an eager one would)
def _add(buffer: Any, batch: Any) -> Any:
    return buffer.add(batch)


@st.composite
@_keeps_random
def _filled(
    draw: Any,
    source: SearchStrategy,
    adds: SearchStrategy,
    steps: Any,
    elements: Any,
    reference: bool,
) -> Any:
    item = draw(source, label="buffer")
    buffer = item.build() if isinstance(item, BufferConfig) else item
    if not isinstance(buffer, AnyBuffer):
        raise TypeError(f"filled_buffers(): drew a {type(buffer).__name__}, not a buffer.")
    model: BufferReference | QueueReference | None = None
    if reference:
        if isinstance(buffer, Queue):
            model = QueueReference.from_buffer(buffer)
        else:
            model = BufferReference.from_buffer(buffer)
    for i in range(draw(adds, label="adds")):
        if isinstance(buffer, Queue) and steps is None and not bool(buffer.can_add(1)):
            break
        batch = draw(_batches_of(buffer, steps, elements), label=f"batch {i}")
        buffer = _add(buffer, batch)
        if model is not None:
            model.add(batch)
    return (buffer, model) if reference else buffer


@overload
def filled_buffers(
    buffers: SearchStrategy[Any] | AnyBuffer | BufferConfig | None = None,
    *,
    adds: int | SearchStrategy[int] = ...,
    steps: int | SearchStrategy[int | None] | None = None,
    elements: Callable[[np.dtype], SearchStrategy[Any]] | None = None,
    reference: Literal[False] = False,
) -> SearchStrategy[AnyBuffer]: ...


@overload
def filled_buffers(
    buffers: SearchStrategy[Any] | AnyBuffer | BufferConfig | None = None,
    *,
    adds: int | SearchStrategy[int] = ...,
    steps: int | SearchStrategy[int | None] | None = None,
    elements: Callable[[np.dtype], SearchStrategy[Any]] | None = None,
    reference: Literal[True],
) -> SearchStrategy[tuple[AnyBuffer, BufferReference | QueueReference]]: ...


def filled_buffers(
    buffers: SearchStrategy[Any] | AnyBuffer | BufferConfig | None = None,
    *,
    adds: int | SearchStrategy[int] = st.integers(0, 4),
    steps: int | SearchStrategy[int | None] | None = None,
    elements: Callable[[np.dtype], SearchStrategy[Any]] | None = None,
    reference: bool = False,
) -> SearchStrategy[Any]:
    """A strategy of buffers filled to a random point by random adds: empty, not ready yet,
    ready, full, wrapped around.

    **Arguments:**

    - `buffers`: where the empty buffer comes from: a strategy of buffers or of
        [`equibuffer.testing.BufferConfig`][]s (default [`equibuffer.testing.buffer_configs`][]
        `()`: every kind), or one buffer or config.
    - `adds`: the number of adds (default 0 to 4), each of a batch from
        [`equibuffer.testing.batches`][] (`steps` and `elements` as there; a queue stops
        when full). The adds run under `eb.filter_jit` (a refused add raises).
    - `reference`: when true, draw `(buffer, reference)`: the
        [`equibuffer.testing.BufferReference`][] (or
        [`equibuffer.testing.QueueReference`][]) that saw the same adds.

    !!! example

        ```python
        import jax
        import equibuffer as eb
        from hypothesis import given, HealthCheck, settings
        from equibuffer.testing import buffer_configs, filled_buffers

        configs = buffer_configs([eb.TrajectoryBuffer, eb.PrioritisedItemBuffer])

        @settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(filled_buffers(configs, reference=True))
        def test(filled):
            buffer, reference = filled
            assert int(buffer.size()) == reference.size()
            assert bool(buffer.can_sample()) == reference.ready()
            if reference.ready():
                reference.check_sample(buffer.sample(jax.random.key(0), batch_size=8))

        test()
        ```
    """
    source = _strategy(buffers, buffer_configs())
    return _filled(source, _strategy(adds, st.integers(0, 4)), steps, elements, reference)
