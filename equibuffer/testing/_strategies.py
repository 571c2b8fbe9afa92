"""Hypothesis strategies of what goes into a buffer: `batches` that fit a buffer's `add`,
and `filled_buffers`, buffers filled by random adds (with their NumPy reference when asked).
The strategies of example steps are in `_examples`, those of buffer configurations in
`_configs`."""

from collections.abc import Callable
from typing import Any, Literal, overload

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import assume
from hypothesis.strategies import SearchStrategy
from jaxtyping import Array, PyTree, Shaped

from .._buffers._queue import Queue
from .._errors import filter_jit
from ._configs import AnyBuffer, buffer_configs, BufferConfig
from ._draws import _keeps_random, _strategy
from ._reference import BufferReference, QueueReference


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
