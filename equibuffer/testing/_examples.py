"""Hypothesis strategies of example steps: `leaves` (zero arrays of a chosen or random shape
and dtype) and `examples` (pytrees of them, of a random or a given structure), what a
buffer constructor takes as `example`."""

from collections.abc import Mapping
from typing import Any

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
from hypothesis.strategies import SearchStrategy
from jaxtyping import Array, PyTree, Shaped

from ._draws import _keeps_random, _strategy


# The leaf dtypes drawn by default: every one a buffer stores on any backend without x64.
DTYPES = (jnp.float32, jnp.int32, jnp.bool_, jnp.uint8, jnp.float16, jnp.int8)
_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=6)


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
