"""The window a sampling rule draws, what a buffer asks of one draw, and what it returns: the
types every rule and every buffer share (public as `equibuffer.rules.Window`,
`equibuffer.rules.Request` and `equibuffer.rules.Drawn`)."""

from typing import NamedTuple

from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from .._custom_types import BoolScalar, Indices, Steps


class Window(NamedTuple):
    """The static window configuration a rule works with: its length (the view's
    `window_length`), the period of its starts, and how errors name the window (the view's
    `window_name`, e.g. `sequence_length=4`).

    !!! example

        ```python
        import equibuffer as eb, jax.numpy as jnp

        buffer = eb.TrajectoryBuffer({"x": jnp.zeros(())}, add_batch_size=1, capacity=8,
                                     sequence_length=3, period=2)
        assert buffer.window == eb.rules.Window(3, 2, "sequence_length=3")
        ```
    """

    length: int
    period: int
    name: str


class Request(NamedTuple):
    """What a buffer asks of its rule's `draw`: `batch_size` windows drawn with `key`; raise
    `not_ready` inside jit unless `ready` (the counters allow a draw); errors start with
    `where`; with `blocks > 1` (dividing the rows and `batch_size`) the `b`-th
    `batch_size / blocks` windows come from the `b`-th of `blocks` equal blocks of rows; a
    prioritised rule weights by the importance exponent `beta` (None for a uniform rule).

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedItemBuffer({"x": jnp.zeros(())}, add_batch_size=1, capacity=4)
        buffer = buffer.add({"x": jnp.arange(3.0)[None]})
        request = eb.rules.Request(jax.random.key(0), 6, buffer.can_sample(), "not ready",
                                   "draw", beta=jnp.float32(0.4))
        drawn = buffer.rule.draw(buffer.storage, buffer.window, request)
        assert drawn.indices.shape == drawn.weights.shape == (6,)
        ```
    """

    key: PRNGKeyArray
    batch_size: int
    ready: BoolScalar
    not_ready: str
    where: str
    blocks: int = 1
    beta: Float[Array, ""] | None = None


class Drawn(NamedTuple):
    """What a rule's draw gives the buffer: the flat index (`row * max_length_time_axis +
    slot`) and absolute start step of each window, and for prioritised rules the probability
    and importance weight of each.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.ItemBuffer({"x": jnp.zeros(())}, add_batch_size=1, capacity=4)
        buffer = buffer.add({"x": jnp.arange(3.0)[None]})
        request = eb.rules.Request(jax.random.key(0), 5, buffer.can_sample(), "not ready", "draw")
        drawn = buffer.rule.draw(buffer.storage, buffer.window, request)
        assert isinstance(drawn, eb.rules.Drawn) and drawn.probabilities is None
        assert bool((drawn.indices < 3).all())  # slots 0-2 hold items
        ```
    """

    indices: Indices
    steps: Steps
    probabilities: Float[Array, " batch"] | None = None
    weights: Float[Array, " batch"] | None = None


class Update(NamedTuple):
    """What a buffer's `set_priorities` asks of its prioritised rule's `reprioritised`: the
    new `priorities` (before the exponent) of the windows at the flat `indices` that were
    drawn starting at the absolute `steps`; `failed` (0-d bool) when the sample they came
    from holds a recorded failure, which refuses the whole update; errors start with `where`.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedItemBuffer({"x": jnp.zeros(())}, add_batch_size=1, capacity=4)
        buffer = buffer.add({"x": jnp.arange(3.0)[None]})
        sample = buffer.sample(jax.random.key(0), batch_size=2)
        update = eb.rules.Update("update", sample.indices, sample.steps, jnp.full(2, 5.0))
        rule = buffer.rule.reprioritised(buffer.storage, buffer.window, update)
        assert float(rule.max_priority) == 5.0
        ```
    """

    where: str
    indices: Int[ArrayLike, " batch"]
    steps: Steps
    priorities: Float[ArrayLike, " batch"]
    failed: Bool[ArrayLike, ""] = False
