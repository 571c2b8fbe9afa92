"""Prioritised replay (Schaul et al., 2016, proportional variant): the ring storage and the
valid-window rule of the uniform buffers, with a `SumTree` holding one leaf per window start."""

from typing import Any, TypeVar, Unpack

import equinox as eqx
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._axes import in_blocks, on_auto_axes
from .._custom_types import Beta, ExampleTree, Steps
from .._errors import recorded
from .._frames import Frames
from .._protocol import AbstractPrioritisedSource
from .._ring import RingStorage
from .._sumtree import SumTree
from ..rules._base import AbstractPrioritisedRule, AbstractRule
from ..rules._by_priority import check_beta
from ..rules._episode_ends import check_mode, EpisodeEnd, Mode
from ..rules._prioritised import prioritised
from ..rules._prioritised_episodic import prioritised_episodic
from ..rules._request import Request
from ..views._base import AbstractView
from ..views._item import ItemView
from ..views._window import window_view
from ._base import AbstractBuffer
from ._generic import check_rule, compose
from ._items import item_rows, ItemAdds
from ._samples import (
    AbstractSample,
    PrioritisedEpisodeSample,
    PrioritisedSample as PrioritisedSample,
    priority_update,
)
from ._sizes import Sizes
from ._transition import transition_view


_Prioritised = TypeVar("_Prioritised", bound="AbstractPrioritisedBuffer")


class RulePriorities(eqx.Module):
    """`max_priority` and `alpha` of a buffer whose rule keeps them: the prioritised ring
    buffers and the prioritised clustered buffer."""

    rule: eqx.AbstractVar[Any]

    @property
    def max_priority(self) -> Float[Array, ""]:
        """The largest priority set so far (1 before any): what is added enters at it."""
        return self.rule.max_priority

    @property
    def alpha(self) -> float:
        """The priority exponent."""
        return self.rule.alpha


class AbstractPrioritisedBuffer(
    AbstractBuffer[AbstractPrioritisedRule], RulePriorities, AbstractPrioritisedSource
):
    """A buffer whose windows are drawn with probability proportional to `priority ** alpha`.

    It is a [`equibuffer.RingStorage`][] plus the valid-window rule of the uniform buffers,
    plus a [`equibuffer.SumTree`][] with one leaf per possible window start (leaf
    `row * max_length_time_axis + slot`, the same flat index as `Sample.indices`). A leaf holds
    `priority ** alpha` while its window is valid and 0 otherwise, so windows that were
    overwritten or that would span the write head are never drawn.

    - New windows enter at the largest priority ever set (1 before any `set_priorities`),
        raised to `alpha` like every other priority.
    - A priority of 0 excludes a window at any `alpha` (also `alpha=0`, which is otherwise
        uniform over the windows of positive priority).
    - `can_sample()` depends only on the counters, as for the uniform buffers; a state with
        ready counters but no window of positive priority makes `sample` raise.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=8)
        assert isinstance(buffer, eb.AbstractPrioritisedBuffer)
        buffer = buffer.add({"x": jnp.arange(4.0)[None]})
        slots = jnp.arange(4)  # one row: item x sits in slot x, added at step x
        only_2 = jnp.array([0.0, 0.0, 1.0, 0.0])
        buffer = buffer.set_priorities(slots, only_2, steps=slots.astype(jnp.uint32))
        assert (buffer.sample(jax.random.key(1), batch_size=8).experience["x"] == 2).all()
        ```
    """

    @property
    def tree(self) -> SumTree:
        """The [`equibuffer.SumTree`][] of `priority ** alpha`, one leaf per window start, of
        a rule that keeps one (`Prioritised`, `PrioritisedEpisodic`; a rule of your own that
        keeps its priorities otherwise has none: then an `AttributeError`)."""
        tree = getattr(self.rule, "tree", None)
        if not isinstance(tree, SumTree):
            raise AttributeError(
                f"{type(self).__name__}.tree: its rule {type(self.rule).__name__} keeps its "
                "priorities in no SumTree; read them from `buffer.rule`."
            )
        return tree

    @on_auto_axes(split=in_blocks)
    @recorded
    def sample(
        self, key: PRNGKeyArray, batch_size: int, beta: Beta = 1.0, *, row_blocks: int = 1
    ) -> PrioritisedSample | PrioritisedEpisodeSample:
        """Draw `batch_size` windows, each with probability `P(i) = p_i**alpha / sum_k
        p_k**alpha` over the valid windows (stratified: the total is cut into `batch_size`
        equal segments and one window is drawn in each).

        **Arguments:**

        - `key`: a JAX PRNG key.
        - `batch_size`: the number of windows drawn (static).
        - `beta`: the importance-sampling exponent, `>= 0` (a float or a 0-d array, so it
            may be annealed without retracing). 0 gives weights of 1, 1 corrects the bias of
            prioritised sampling fully.
        - `row_blocks`: `n >= 1` dividing `add_batch_size` and `batch_size` (static). The rows
            are cut into `n` equal blocks of consecutive rows (the blocks `shard_rows` puts on
            the `n` devices of a mesh axis), and the `b`-th `batch_size / n` windows are drawn
            from block `b` only, each with probability `p_i**alpha / T_b`, `T_b` the sum over
            the valid windows of block `b`; `probabilities` are these, and `weights` are
            normalised by the largest weight of their block: each block is the sample its
            device would draw on its own (see [Scaling](../scaling.md)). Default 1: all rows.

        **Returns:**

        A [`equibuffer.PrioritisedSample`][]: `experience`, `indices`, `steps`,
        `probabilities` and `weights`.

        Fails (inside jit: recorded, raised by [`equibuffer.check`][]) when `can_sample()`
        is false, or when it is true but every valid window has priority 0.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.PrioritisedTrajectoryBuffer({"obs": jnp.zeros(2)}, add_batch_size=2,
                                                    max_length_time_axis=16, sequence_length=4)
            buffer = buffer.add({"obs": jnp.ones((2, 8, 2))})
            sample = buffer.sample(jax.random.key(0), batch_size=8, beta=0.4)
            assert sample.experience["obs"].shape == (8, 4, 2)
            # equal priorities: each of the 2 * 5 windows has probability 1/10, every weight is 1
            assert jnp.allclose(sample.probabilities, 0.1) and jnp.allclose(sample.weights, 1.0)
            ```
        """
        where, batch_size, blocks = self._sample_arguments(key, batch_size, row_blocks)
        ready, not_ready = self.can_sample(), self._not_ready(where)
        request = Request(key, batch_size, ready, not_ready, where, blocks, check_beta(where, beta))
        drawn = self.rule.draw(self.storage, self.window, request)
        assert drawn.probabilities is not None and drawn.weights is not None
        experience, mask = self._experience(drawn, blocks)
        fields = dict(
            experience=experience,
            indices=drawn.indices,
            steps=drawn.steps,
            probabilities=drawn.probabilities,
            weights=drawn.weights,
        )
        if mask is None:
            return PrioritisedSample(**fields)
        return PrioritisedEpisodeSample(**fields, mask=mask)

    @on_auto_axes()
    @recorded
    def set_priorities(
        self: _Prioritised,
        sample: AbstractSample | Int[ArrayLike, " batch"],
        priorities: Float[ArrayLike, " batch"],
        *,
        steps: Steps | None = None,
    ) -> _Prioritised:
        """Return the buffer with new priorities for sampled windows.

        **Arguments:**

        - `sample`: the [`equibuffer.Sample`][] the priorities are for (the least
            error-prone), or its `indices` together with `steps=sample.steps`.
        - `priorities`: `(batch,)` non-negative finite priorities, before the exponent `alpha`
            (e.g. `|td_error| + 1e-6`). A negative, NaN or infinite value fails (inside jit:
            recorded, raised by [`equibuffer.check`][] or [`equibuffer.filter_jit`][]) and
            the whole update is refused: no priority changes. So is an update from a sample
            that holds a failure.
        - `steps`: only when `sample` is an index array: the absolute start steps
            `sample.steps`.

        **Returns:**

        The updated buffer. An update is **dropped** when its window is no longer what was
        sampled: its first step was overwritten since (its slot now holds another absolute
        step) or it is no longer a valid window. When a window appears more than once, the
        last of its updates that is not dropped is applied, as in NumPy's `a[i] = p`, on
        every platform. The largest priority given for a current window (repeats included)
        raises the priority at which new windows enter.

        !!! example

            ```python
            import equibuffer as eb, jax, jax.numpy as jnp

            buffer = eb.PrioritisedItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=8)
            buffer = buffer.add({"x": jnp.arange(4.0)[None]})
            sample = buffer.sample(jax.random.key(0), batch_size=4)
            updated = buffer.set_priorities(sample, jnp.full(4, 5.0))
            assert float(updated.max_priority) == 5.0  # new items will enter at priority 5
            overwritten = buffer.add({"x": jnp.zeros((1, 8))})  # every sampled item replaced
            stale = overwritten.set_priorities(sample, jnp.full(4, 5.0))
            assert float(stale.max_priority) == 1.0  # the updates were dropped
            # Item 2 (slot 2, step 2) three times: the last priority given wins.
            slots, steps = jnp.array([2, 2, 2]), jnp.array([2, 2, 2], jnp.uint32)
            again = buffer.set_priorities(slots, jnp.array([4.0, 9.0, 3.0]), steps=steps)
            assert jnp.allclose(again.tree.get(jnp.array([2])), 3.0**again.alpha)
            ```
        """
        where = f"{type(self).__name__}.set_priorities()"
        update = priority_update(where, sample, priorities, steps)
        rule = self.rule.reprioritised(self.storage, self.window, update)
        return eqx.tree_at(lambda b: b.rule, self, rule)


class PrioritisedBuffer(AbstractPrioritisedBuffer):
    """A buffer composed of parts whose rule draws by priority: a ring, a prioritised rule
    ([`equibuffer.rules.Prioritised`][] or [`equibuffer.rules.PrioritisedEpisodic`][]) and
    any view. `sample` returns probabilities and importance weights, and `set_priorities`
    updates the sampled windows, as for the named prioritised buffers (which are such
    compositions: `PrioritisedTrajectoryBuffer` is `rule=Prioritised(alpha)` with
    `view=WindowView(sequence_length)`).

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        # prioritised, episode-aware windows of 3 steps starting every 2 steps
        example = {"obs": jnp.zeros(2), "done": jnp.bool_(False)}
        buffer = eb.PrioritisedBuffer(example, add_batch_size=1, capacity=32, period=2,
                                      rule=eb.rules.PrioritisedEpisodic(episode_end="done"),
                                      view=eb.views.WindowView(3))
        done = jnp.zeros((1, 12), bool).at[:, 7].set(True)
        buffer = buffer.add({"obs": jnp.ones((1, 12, 2)), "done": done})
        assert int(buffer.num_valid_windows()) == 4  # starts 0, 2, 4 and 8
        sample = buffer.sample(jax.random.key(0), batch_size=8, beta=0.4)
        buffer = buffer.set_priorities(sample, jnp.arange(1.0, 9.0))
        ```
    """

    storage: RingStorage
    rule: AbstractPrioritisedRule
    view: AbstractView = eqx.field(static=True)
    period: int = eqx.field(static=True)
    min_length_time_axis: int = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        view: AbstractView,
        rule: AbstractRule,
        period: int = 1,
        frames: Frames | None = None,
        **sizes: Unpack[Sizes],
    ):
        """**Arguments:**

        - `example`, `add_batch_size`, `view`, `period`, `frames`, `**sizes`: as for
            [`equibuffer.Buffer`][].
        - `rule`: an [`equibuffer.rules.AbstractPrioritisedRule`][]:
            [`equibuffer.rules.Prioritised`][]`(alpha)`, or
            [`equibuffer.rules.PrioritisedEpisodic`][]`(episode_end, mode, alpha)`. A rule
            that draws uniformly takes an [`equibuffer.Buffer`][].
        """
        where = "PrioritisedBuffer()"
        rule = check_rule(where, rule, AbstractPrioritisedRule, "eb.Buffer")
        self.storage, self.rule, self.view, self.period, self.min_length_time_axis = compose(
            where, example, add_batch_size, sizes, rule, view, period=period, frames=frames
        )


class PrioritisedTrajectoryBuffer(AbstractPrioritisedBuffer):
    """A [`equibuffer.TrajectoryBuffer`][] that draws windows in proportion to their
    priority: windows of `sequence_length` consecutive steps of one row, starting at absolute
    steps that are multiples of `period`, each drawn with probability
    `p**alpha / sum_k p_k**alpha`.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedTrajectoryBuffer({"obs": jnp.zeros(4)}, add_batch_size=2,
                                                max_length_time_axis=100, sequence_length=8,
                                                alpha=0.6)
        buffer = buffer.add({"obs": jnp.ones((2, 10, 4))})
        sample = buffer.sample(jax.random.key(0), batch_size=32, beta=0.4)
        assert sample.experience["obs"].shape == (32, 8, 4)
        buffer = buffer.set_priorities(sample, jnp.abs(jnp.arange(32.0) - 16) + 1e-3)
        ```

    It is [`equibuffer.PrioritisedBuffer`][] with `rule=Prioritised(alpha)` and
    `view=WindowView(sequence_length)`.
    """

    storage: RingStorage
    rule: AbstractPrioritisedRule
    view: AbstractView = eqx.field(static=True)
    period: int = eqx.field(static=True)
    min_length_time_axis: int = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        sequence_length: int,
        period: int = 1,
        alpha: float = 0.6,
        frames: Frames | None = None,
        **sizes: Unpack[Sizes],
    ):
        """**Arguments:**

        - `example`, `add_batch_size`, `sequence_length`, `period`, `frames`, `**sizes`: as for
            [`equibuffer.TrajectoryBuffer`][].
        - `alpha`: the priority exponent, `>= 0`: 0 is uniform over windows of positive
            priority, 1 fully proportional. Default 0.6 (Schaul et al.).
        """
        where = "PrioritisedTrajectoryBuffer()"
        view = window_view(where, sequence_length)
        self.storage, self.rule, self.view, self.period, self.min_length_time_axis = compose(
            where,
            example,
            add_batch_size,
            sizes,
            prioritised(where, alpha),
            view,
            period=period,
            frames=frames,
        )


class PrioritisedTransitionBuffer(AbstractPrioritisedBuffer):
    """A [`equibuffer.TransitionBuffer`][] that draws consecutive pairs `(first, second)` in
    proportion to their priority.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedTransitionBuffer({"obs": jnp.zeros(4)}, add_batch_size=8,
                                                capacity=1_000)
        buffer = buffer.add({"obs": jnp.ones((8, 3, 4))})
        sample = buffer.sample(jax.random.key(0), batch_size=32, beta=0.4)
        assert sample.experience.first["obs"].shape == (32, 4)
        buffer = buffer.set_priorities(sample, sample.weights)
        ```

    It is [`equibuffer.PrioritisedBuffer`][] with `rule=Prioritised(alpha)` (or
    `PrioritisedEpisodic(episode_end, mode, alpha)`) and `view=PairView()` (or
    `NStepView(n_step, discount, ...)`).
    """

    storage: RingStorage
    rule: AbstractPrioritisedRule
    view: AbstractView = eqx.field(static=True)
    period: int = eqx.field(static=True)
    min_length_time_axis: int = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        alpha: float = 0.6,
        n_step: int | None = None,
        discount: float | None = None,
        reward: str = "reward",
        terminated: str = "terminated",
        truncated: str | None = "truncated",
        episode_end: EpisodeEnd | None = None,
        mode: Mode = "never_cross",
        frames: Frames | None = None,
        **sizes: Unpack[Sizes],
    ):
        """**Arguments:**

        - `example`, `add_batch_size`, `frames`, `n_step`, `discount`, `reward`, `terminated`,
            `truncated`, `episode_end`, `mode`, `**sizes`: as for
            [`equibuffer.TransitionBuffer`][]. With `n_step` this is Rainbow's replay: n-step
            transitions drawn by priority, with importance weights, cut at episode ends.
        - `alpha`: the priority exponent, `>= 0` (default 0.6).
        """
        where = "PrioritisedTransitionBuffer()"
        check_mode(where, mode, episode_end)
        view = transition_view(where, n_step, discount, reward, terminated, truncated)
        rule = (
            prioritised(where, alpha)
            if episode_end is None
            else prioritised_episodic(where, episode_end, mode, alpha)
        )
        self.storage, self.rule, self.view, self.period, self.min_length_time_axis = compose(
            where, example, add_batch_size, sizes, rule, view, flat=True, frames=frames
        )


class PrioritisedItemBuffer(ItemAdds, AbstractPrioritisedBuffer):
    """A [`equibuffer.ItemBuffer`][] that draws items in proportion to their priority.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedItemBuffer({"x": jnp.zeros(3)}, add_batch_size=4, capacity=100)
        buffer = buffer.add({"x": jnp.ones((4, 3))})
        sample = buffer.sample(jax.random.key(0), batch_size=16, beta=0.4)
        buffer = buffer.set_priorities(sample, jnp.abs(sample.experience["x"][:, 0]) + 1e-3)
        assert sample.weights.shape == (16,) and float(buffer.max_priority) > 1.0
        ```

    It is [`equibuffer.PrioritisedBuffer`][] with `rule=Prioritised(alpha)` and
    `view=ItemView()`.
    """

    storage: RingStorage
    rule: AbstractPrioritisedRule
    view: AbstractView = eqx.field(static=True)
    period: int = eqx.field(static=True)
    min_length_time_axis: int = eqx.field(static=True)
    add_batches: bool = eqx.field(static=True)
    add_sequences: bool = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int | None = None,
        add_batches: bool = False,
        add_sequences: bool = False,
        alpha: float = 0.6,
        frames: Frames | None = None,
        **sizes: Unpack[Sizes],
    ):
        """**Arguments:**

        - `example`, `add_batch_size`, `add_batches`, `add_sequences`, `frames`, `**sizes`:
            as for [`equibuffer.ItemBuffer`][].
        - `alpha`: the priority exponent, `>= 0` (default 0.6).
        """
        where = "PrioritisedItemBuffer()"
        rows = item_rows(where, add_batch_size, add_batches, add_sequences, frames)
        self.add_batches, self.add_sequences = add_batches, add_sequences
        self.storage, self.rule, self.view, self.period, self.min_length_time_axis = compose(
            where,
            example,
            rows,
            sizes,
            prioritised(where, alpha),
            ItemView(),
            flat=True,
            frames=frames,
        )
