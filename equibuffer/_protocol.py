"""What "a buffer" is: the interfaces that `Mixer`, `RateLimited` and code written for any
buffer accept, declared once.

- `AbstractSource`: anything a batch is sampled from (`can_sample`, `size`, `sample`): every
    replay buffer, and a `Mixer`.
- `AbstractPrioritisedSource`: a source whose `sample` takes `beta` and returns importance
    `weights`, and which takes `set_priorities` back: the prioritised buffers and a `Mixer`.
- `AbstractReplayBuffer`: a source that is also added to (`add_batch_size`, `steps_in`,
    `add`): every ring buffer (`AbstractBuffer`) and the clustered buffers.

A wrapper takes the interface it needs and asks for nothing else: a `Mixer` draws from any
`AbstractSource` and passes `beta` and priorities to the `AbstractPrioritisedSource`s among
them; `RateLimited` wraps any `AbstractReplayBuffer`.
"""

import abc
from typing import Any, TypeVar

import equinox as eqx
from jaxtyping import ArrayLike, Float, PRNGKeyArray

from ._custom_types import Beta, BoolScalar, ExperienceBatch, IntScalar, StepCount


_Buffer = TypeVar("_Buffer", bound="AbstractReplayBuffer")
_Prioritised = TypeVar("_Prioritised", bound="AbstractPrioritisedSource")


class AbstractSource(eqx.Module):
    """Anything a batch can be sampled from: every replay buffer (an
    [`equibuffer.AbstractReplayBuffer`][]) and a [`equibuffer.Mixer`][]. This is what a
    `Mixer` takes as a source, so mixers nest.

    Code written against this interface runs on any of them:

    !!! example

        ```python
        import equibuffer as eb, equinox as eqx, jax, jax.numpy as jnp

        @eqx.filter_jit
        def draw(source: eb.AbstractSource, key):
            return source.can_sample(), source.size(), source.sample(key, 4).experience

        items = eb.ItemBuffer({"x": jnp.zeros(2)}, add_batch_size=2, capacity=8)
        items = items.add({"x": jnp.ones((2, 2))})
        clusters = eb.ClusteredBuffer({"x": jnp.zeros(2)}, add_batch_size=2, num_clusters=2,
                                      cluster_capacity=4,
                                      cluster_fn=lambda item: (item["x"][0] > 0).astype(int))
        clusters = clusters.add({"x": jnp.ones((2, 2))})
        for source in (items, clusters, eb.Mixer((items, clusters), proportions=(0.5, 0.5))):
            ready, size, experience = draw(source, jax.random.key(0))
            assert bool(ready) and experience["x"].shape == (4, 2)
        ```
    """

    @abc.abstractmethod
    def can_sample(self) -> BoolScalar:
        """Whether `sample` may be called now (0-d bool). It depends only on counters, never
        on stored data, so it stays unbatched when a training run is vmapped over seeds and
        `lax.cond(source.can_sample(), learn, skip)` stays a branch."""

    @abc.abstractmethod
    def size(self) -> IntScalar:
        """The number of steps (or items) held (0-d int32)."""

    @abc.abstractmethod
    def sample(self, key: PRNGKeyArray, batch_size: int, *, row_blocks: int = 1) -> Any:
        """Draw `batch_size` elements (with replacement). A buffer returns a
        [`equibuffer.AbstractSample`][] (its kind's own: `experience`, `indices`, `steps`, ...); a
        `Mixer` returns a [`equibuffer.MixedSample`][]. Fails when it cannot be sampled (inside
        jit: recorded in the sample, raised by [`equibuffer.check`][]). With `row_blocks=n`
        (static) the sample is cut into `n` equal blocks, block `d` drawn only from what
        `shard_rows` puts on device `d` of an `n`-device mesh axis, by the source's own rule
        (see [Scaling](../scaling.md))."""


class AbstractPrioritisedSource(AbstractSource):
    """A source that draws by priority: its `sample` takes the importance-sampling exponent
    `beta` and returns importance `weights` (`(batch,)` float32, the largest 1), and
    `set_priorities(sample, priorities)` returns it with the priorities of what that sample
    drew. Updates for what has been overwritten since are dropped.

    The prioritised buffers ([`equibuffer.AbstractPrioritisedBuffer`][],
    [`equibuffer.PrioritisedClusteredBuffer`][]) and a [`equibuffer.Mixer`][] (which routes
    the priorities to its prioritised sources) are prioritised sources.

    !!! example

        ```python
        import equibuffer as eb, equinox as eqx, jax, jax.numpy as jnp

        @eqx.filter_jit
        def learn(source: eb.AbstractPrioritisedSource, key):
            sample = source.sample(key, 4, beta=0.4)
            loss = sample.weights * 1.0  # a stand-in for the per-row loss
            return source.set_priorities(sample, loss + 1.0)

        items = eb.PrioritisedItemBuffer({"x": jnp.zeros(2)}, add_batch_size=2, capacity=8)
        items = items.add({"x": jnp.ones((2, 2))})
        clusters = eb.PrioritisedClusteredBuffer(
            {"x": jnp.zeros(2)}, add_batch_size=2, num_clusters=2, cluster_capacity=4,
            cluster_fn=lambda item: (item["x"][0] > 0).astype(int))
        clusters = clusters.add({"x": jnp.ones((2, 2))})
        for source in (items, clusters, eb.Mixer((items, clusters), proportions=(0.5, 0.5))):
            assert isinstance(learn(source, jax.random.key(0)), type(source))
        ```
    """

    @abc.abstractmethod
    def sample(
        self, key: PRNGKeyArray, batch_size: int, beta: Beta = 1.0, *, row_blocks: int = 1
    ) -> Any:
        """Draw `batch_size` elements by priority; the sample carries importance `weights`
        with exponent `beta` (`>= 0`; a float or a 0-d array). `row_blocks` as for
        [`equibuffer.AbstractSource.sample`][]."""

    @abc.abstractmethod
    def set_priorities(
        self: _Prioritised, sample: Any, priorities: Float[ArrayLike, " batch"]
    ) -> _Prioritised:
        """Return the source with new priorities (before the exponent `alpha`, `>= 0` and
        finite) for what `sample` drew, one per row. Updates for elements overwritten or no
        longer valid since are dropped."""


class AbstractReplayBuffer(AbstractSource):
    """A replay buffer: a source that is also added to. Every ring buffer (an
    [`equibuffer.AbstractBuffer`][], uniform, prioritised or episode-aware) and the
    clustered buffers are; [`equibuffer.RateLimited`][] wraps any of them. (A
    [`equibuffer.Queue`][] is not: it is read in order, not sampled.)

    !!! example

        ```python
        import equibuffer as eb, equinox as eqx, jax, jax.numpy as jnp

        @eqx.filter_jit
        def step(buffer: eb.AbstractReplayBuffer, batch, key):
            buffer = buffer.add(batch)
            return buffer, buffer.sample(key, 4)

        example = {"x": jnp.zeros(())}
        buffers = [
            eb.TransitionBuffer(example, add_batch_size=2, capacity=16),
            eb.PrioritisedItemBuffer(example, add_batch_size=2, capacity=16),
            eb.ClusteredBuffer(example, add_batch_size=2, num_clusters=2, cluster_capacity=8,
                               cluster_fn=lambda item: (item["x"] > 0).astype(int)),
        ]
        for buffer in buffers:
            assert buffer.steps_in({"x": jnp.ones((2, 3))}) == 3  # add's own batch check
            buffer, sample = step(buffer, {"x": jnp.ones((2, 3))}, jax.random.key(0))
            assert isinstance(sample, eb.AbstractSample) and int(buffer.size()) == 6
        ```
    """

    @property
    @abc.abstractmethod
    def add_batch_size(self) -> int:
        """The number of rows each `add` brings (the leading axis of every added leaf)."""

    @abc.abstractmethod
    def steps_in(self, batch: ExperienceBatch, where: str = "add()") -> int | None:
        """Check `batch` as `add` does and return its number of steps per row: `None` for
        leaves `(add_batch_size, *leaf)`, else `T` for `(add_batch_size, T, *leaf)`. Errors
        start with `where`."""

    @abc.abstractmethod
    def steps_added(self) -> StepCount:
        """The number of steps ever added to each row (overwritten ones included), a 0-d
        unsigned int array readable inside jit as well as outside."""

    @abc.abstractmethod
    def add(self: _Buffer, batch: ExperienceBatch) -> _Buffer:
        """Return the buffer with `batch` added: leaves `(add_batch_size, *leaf)` for one
        step, or `(add_batch_size, T, *leaf)` for `T` steps per row."""
