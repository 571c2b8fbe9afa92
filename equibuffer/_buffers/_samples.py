"""What `sample` returns: the experience a view gathered, plus what the sampling rule knows of
each draw (its window's place and start step; probabilities and weights; the episode mask)."""

from typing import Any, TypeVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, UInt32

from .._custom_types import Indices, Steps
from .._errors import first_failure, poisoned, record
from ..rules._request import Update


_Sample = TypeVar("_Sample", bound="AbstractSample")


def error_field() -> Any:
    """The `error` field of a final sample: 0 (no failure) unless given, keyword only."""
    return eqx.field(default_factory=lambda: jnp.zeros((), jnp.uint32), kw_only=True)


class AbstractSample(eqx.Module):
    """What every buffer's `sample` returns, whatever its kind: the sampled `experience`, the
    flat `indices` and start `steps` of its windows (what `set_priorities` takes), and the
    `error` word of a check recorded while drawing it. The samples of each kind are final
    classes of their own (`Sample`, `EpisodeSample`, `PrioritisedSample`, ...): test a sample
    of any kind with `isinstance(sample, eb.AbstractSample)`, a sample with probabilities and
    weights with `isinstance(sample, eb.AbstractPrioritisedSample)`.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedItemBuffer({"x": jnp.zeros(())}, add_batch_size=1, capacity=4)
        sample = buffer.add({"x": jnp.ones((1, 2))}).sample(jax.random.key(0), batch_size=3)
        assert isinstance(sample, eb.AbstractSample) and isinstance(sample, eb.PrioritisedSample)
        assert not isinstance(sample, eb.Sample)  # the uniform kind's own
        ```
    """

    experience: eqx.AbstractVar[Any]
    indices: eqx.AbstractVar[Indices]
    steps: eqx.AbstractVar[Steps]
    error: eqx.AbstractVar[UInt32[Array, ""]]

    def with_error(self: _Sample, word: UInt32[Array, ""]) -> _Sample:
        """The sample with failure `word` recorded, unless one is recorded already, and its
        floating leaves NaN when a failure is recorded (a loss computed from a sample that
        could not be drawn shows it)."""
        word = first_failure(self.error, word)
        return poisoned(eqx.tree_at(lambda s: s.error, self, word), word)


class AbstractPrioritisedSample(AbstractSample):
    """A sample drawn by priority: an [`equibuffer.AbstractSample`][] with the
    `probabilities` each window was drawn with and its importance `weights` (see
    [`equibuffer.PrioritisedSample`][]).

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedClusteredBuffer({"x": jnp.zeros(())}, add_batch_size=2,
                                               num_clusters=2, cluster_capacity=4,
                                               cluster_fn=lambda item: jnp.int32(0))
        sample = buffer.add({"x": jnp.ones(2)}).sample(jax.random.key(0), batch_size=3)
        assert isinstance(sample, eb.AbstractPrioritisedSample)
        assert sample.weights.shape == sample.probabilities.shape == (3,)
        ```
    """

    probabilities: eqx.AbstractVar[Float[Array, " batch"]]
    weights: eqx.AbstractVar[Float[Array, " batch"]]


class Sample(AbstractSample):
    """What a uniform buffer's `sample` returns (an [`equibuffer.AbstractSample`][]).

    - `experience`: the sampled data. Leaves `(batch, sequence_length, *leaf)` for a
        `TrajectoryBuffer`, a [`equibuffer.Transition`][] of `(batch, *leaf)` leaves for a
        `TransitionBuffer`, `(batch, *leaf)` for an `ItemBuffer`.
    - `indices`: `(batch,)` int32, the flat index `row * max_length_time_axis + slot` of the first
        step of each sampled window: what `set_priorities` takes in the prioritised buffers.
    - `steps`: `(batch,)` uint32, the absolute step (mod 2**32) at which each window starts,
        which tells whether its slot has been overwritten since.
    - `error`: 0-d uint32, the failure of a check recorded while drawing it inside jit (0
        when none): [`equibuffer.check`][] raises it on the host, and `set_priorities`
        passes it on to the buffer (see [Troubleshooting](../troubleshooting.md)).

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.TrajectoryBuffer({"x": jnp.zeros(2)}, add_batch_size=2, max_length_time_axis=8,
                                     sequence_length=3)
        buffer = buffer.add({"x": jnp.ones((2, 5, 2))})
        sample = buffer.sample(jax.random.key(0), batch_size=4)
        assert isinstance(sample, eb.Sample) and sample.experience["x"].shape == (4, 3, 2)
        assert sample.indices.dtype == jnp.int32 and sample.steps.dtype == jnp.uint32
        assert (sample.steps <= 2).all()  # windows of 3 of the 5 steps start at step 0, 1 or 2
        ```
    """

    experience: Any
    indices: Indices
    steps: Steps
    error: UInt32[Array, ""] = error_field()


class PrioritisedSample(AbstractPrioritisedSample):
    """What a prioritised buffer's `sample` returns: a [`equibuffer.Sample`][] (`experience`,
    `indices`, `steps`) plus

    - `probabilities`: `(batch,)` float32, the probability `P(i) = p_i**alpha / sum_k p_k**alpha`
        with which each window was drawn.
    - `weights`: `(batch,)` float32, the importance-sampling weights
        `(N * P(i)) ** -beta / max_j (N * P(j)) ** -beta` over the batch (so the largest is 1),
        ready to multiply the per-sample losses.

    Pass the whole sample back to `set_priorities`: its `steps` tell which windows have been
    overwritten since, and their updates are dropped.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=8,
                                          alpha=1.0)
        buffer = buffer.add({"x": jnp.arange(4.0)[None]})
        slots = jnp.arange(4)  # one row: item x sits in slot x, added at step x
        steps = slots.astype(jnp.uint32)
        buffer = buffer.set_priorities(slots, jnp.arange(1.0, 5.0), steps=steps)  # x + 1
        sample = buffer.sample(jax.random.key(1), batch_size=8, beta=1.0)
        assert jnp.allclose(sample.probabilities, (sample.experience["x"] + 1) / 10)
        assert sample.weights.dtype == jnp.float32 and float(sample.weights.max()) == 1.0
        ```
    """

    experience: Any
    indices: Indices
    steps: Steps
    probabilities: Float[Array, " batch"]
    weights: Float[Array, " batch"]
    error: UInt32[Array, ""] = error_field()


class EpisodeSample(AbstractSample):
    """What [`equibuffer.EpisodeTrajectoryBuffer`][]'s `sample` returns: a
    [`equibuffer.Sample`][] (`experience` with leaves `(batch, sequence_length, *leaf)`,
    `indices`, `steps`) plus

    - `mask`: `(batch, sequence_length)` bool, true at the steps that belong to the window's
        episode. With `mode="never_cross"` it is all true; with `mode="pad"` it is false
        after the first episode end in the window, and the experience is zero there.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"r": jnp.float32(0), "done": jnp.bool_(False)}
        buffer = eb.EpisodeTrajectoryBuffer(example, add_batch_size=1, max_length_time_axis=8,
                                            sequence_length=3, mode="pad")
        done = jnp.array([[False, True, False, False, False]])  # episodes 0-1 and 2-4
        buffer = buffer.add({"r": jnp.ones((1, 5)), "done": done})
        sample = buffer.sample(jax.random.key(0), batch_size=16)
        assert isinstance(sample, eb.EpisodeSample) and sample.mask.shape == (16, 3)
        assert (sample.experience["r"] == sample.mask.astype(jnp.float32)).all()  # 0 past the end
        ```
    """

    experience: Any
    indices: Indices
    steps: Steps
    mask: Bool[Array, "batch sequence"]
    error: UInt32[Array, ""] = error_field()


class PrioritisedEpisodeSample(AbstractPrioritisedSample):
    """What `PrioritisedEpisodeTrajectoryBuffer.sample` returns: a
    [`equibuffer.PrioritisedSample`][] (`experience`, `indices`, `steps`, `probabilities`,
    `weights`) plus `mask`, `(batch, sequence_length)` bool, as in
    [`equibuffer.EpisodeSample`][]: all true with `mode="never_cross"`; with `mode="pad"`
    false after the first episode end in the window, where the experience is zero.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedEpisodeTrajectoryBuffer(
            {"r": jnp.float32(0), "done": jnp.bool_(False)}, add_batch_size=1,
            max_length_time_axis=8, sequence_length=3, mode="pad")
        done = jnp.array([[False, True, False, False, False]])  # episodes 0-1, 2-
        buffer = buffer.add({"r": jnp.ones((1, 5)), "done": done})
        sample = buffer.sample(jax.random.key(0), batch_size=8)
        assert sample.mask.shape == (8, 3) and bool(sample.mask[:, 0].all())
        # a padded window's loss averages over its own episode's steps only
        steps = sample.mask.sum(axis=1, dtype=jnp.float32)
        loss = (sample.weights * sample.experience["r"].sum(axis=1) / steps).mean()
        ```
    """

    experience: Any
    indices: Indices
    steps: Steps
    probabilities: Float[Array, " batch"]
    weights: Float[Array, " batch"]
    mask: Bool[Array, "batch sequence"]
    error: UInt32[Array, ""] = error_field()


def priority_update(
    where: str,
    sample: AbstractSample | Int[ArrayLike, " batch"],
    priorities: Float[ArrayLike, " batch"],
    steps: Steps | None,
) -> Update:
    """What a `set_priorities(sample, priorities, steps=...)` call asks of the rule: the
    `(indices, steps)` of the sample, or the indices given with `steps=`, the priorities, and
    whether the sample holds a recorded failure (its windows are then not what was asked
    for: the update is refused, and the failure goes on to the buffer). The one preamble of
    every `set_priorities`."""
    if isinstance(sample, AbstractSample):
        if steps is not None:
            raise TypeError(
                f"{where}: `steps` is taken from the sample; pass either a Sample, or "
                "indices with `steps=`."
            )
        record(sample.error)  # a failure recorded while drawing it goes on to the buffer
        return Update(where, sample.indices, sample.steps, priorities, sample.error != 0)
    if steps is None:
        raise TypeError(
            f"{where}: pass the whole sample (`buffer.set_priorities(sample, "
            "priorities)`) or the indices with `steps=sample.steps`: the steps tell "
            "which windows were overwritten since they were sampled."
        )
    return Update(where, sample, steps, priorities)
