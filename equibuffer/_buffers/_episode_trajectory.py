"""Episode-aware sequence sampling: the trajectory buffers with the episode rule (windows never
cross an episode end, or are cut at it and padded), drawn exactly uniformly or by priority.

The rules (`Episodic`, `PrioritisedEpisodic`) keep a `SumTree` with one leaf per window start
in step at `add`: only the windows that start at one of the steps just written, or at one of
the `sequence_length - 1` steps before them, can change status, so an `add` of `T` steps
touches `add_batch_size * min(T + sequence_length - 1, max_length_time_axis)` leaves and reads
`sequence_length - 1` episode flags for each. Sampling is a search in the tree: no rejection
loop.
"""

from typing import Any, Unpack

import equinox as eqx
from jaxtyping import Array, Bool, Int

from .._custom_types import ExampleTree
from .._frames import Frames
from .._ring import RingStorage
from .._sumtree import SumTree
from ..rules._base import AbstractPrioritisedRule, AbstractUniformRule
from ..rules._episode_ends import EpisodeEnd, Mode
from ..rules._episodic import Episodic, episodic
from ..rules._prioritised_episodic import prioritised_episodic, PrioritisedEpisodic
from ..views._base import AbstractView
from ..views._window import window_view
from ._base import AbstractUniformBuffer
from ._generic import compose
from ._prioritised import AbstractPrioritisedBuffer
from ._samples import (
    EpisodeSample as EpisodeSample,
    PrioritisedEpisodeSample as PrioritisedEpisodeSample,
)
from ._sizes import Sizes


def _episodic(rule: object) -> "Episodic | PrioritisedEpisodic":
    assert isinstance(rule, Episodic | PrioritisedEpisodic)
    return rule


def _prioritised_episodic(rule: object) -> PrioritisedEpisodic:
    assert isinstance(rule, PrioritisedEpisodic)
    return rule


class RuleEpisodes(eqx.Module):
    """`ends` and `mode` of a buffer whose rule keeps the episodes: the episode trajectory
    buffers, uniform and prioritised."""

    rule: eqx.AbstractVar[Any]

    @property
    def ends(self) -> Bool[Array, "rows length"]:
        """The episode-end flag of every slot of the ring."""
        return _episodic(self.rule).episodes.ends

    @property
    def mode(self) -> Mode:
        """`"never_cross"` or `"pad"`."""
        return _episodic(self.rule).episodes.mode


class EpisodeTrajectoryBuffer(AbstractUniformBuffer, RuleEpisodes):
    """A [`equibuffer.TrajectoryBuffer`][] whose windows stay inside one episode.

    `episode_end` marks the last step of an episode (termination and truncation both end
    it: store `terminated | truncated`). Two modes:

    - `mode="never_cross"` (default): a window never contains an episode end except possibly
        at its last step, so it is `sequence_length` steps of one episode. Episodes shorter
        than the window are skipped. Sampling is exactly uniform over the windows that remain.
    - `mode="pad"`: a window may start at any (period-aligned) step of an episode; the steps
        after the first episode end in it come back zero, with `mask` false there. Short
        episodes are used, padded.

    In both modes windows start at absolute steps that are multiples of `period` and never
    mix two episodes or span the write head, also across the ring's wrap-around.

    `can_sample()` depends only on the counters (as for every buffer, so
    `lax.cond(buffer.can_sample(), learn, skip)` stays a cond under `vmap`). A state with
    ready counters but no window that fits inside an episode makes `sample` fail (inside
    jit: recorded, raised by [`equibuffer.check`][]). `num_valid_windows()` counts the
    windows that can be drawn.

    The motivating configuration: `(84, 84, 3)` observations from 100 environments, 100,000
    sequences of 40 steps, any 40-step range inside an episode:

    ```python
    example = {"obs": jnp.zeros((84, 84, 3), jnp.uint8), "done": jnp.bool_(False)}
    buffer = eb.EpisodeTrajectoryBuffer(example, add_batch_size=100, sequence_length=40,
                                        capacity=100_000 * 40, episode_end="done")
    ```

    (4,000,000 steps of 21 KB: 85 GB of observations, so it needs a large accelerator; the
    storage size is `capacity`, whatever the number of environments adding. See
    `docs/episodes.md`.)

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"obs": jnp.zeros(2), "done": jnp.bool_(False)}
        buffer = eb.EpisodeTrajectoryBuffer(example, add_batch_size=2, max_length_time_axis=32,
                                            sequence_length=4, episode_end="done")
        done = jnp.zeros((2, 12), bool).at[:, 5].set(True)  # episodes of 6 steps
        buffer = buffer.add({"obs": jnp.ones((2, 12, 2)), "done": done})
        sample = buffer.sample(jax.random.key(0), batch_size=16)
        assert sample.experience["obs"].shape == (16, 4, 2)
        # no episode end before the last step of any window
        assert not sample.experience["done"][:, :-1].any()
        ```

    It is [`equibuffer.Buffer`][] with `rule=Episodic(episode_end, mode)` and
    `view=WindowView(sequence_length)`.
    """

    storage: RingStorage
    rule: AbstractUniformRule
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
        episode_end: EpisodeEnd = "done",
        mode: Mode = "never_cross",
        frames: Frames | None = None,
        **sizes: Unpack[Sizes],
    ):
        """**Arguments:**

        - `example`, `add_batch_size`, `sequence_length`, `period`, `frames`, `**sizes`: as for
            [`equibuffer.TrajectoryBuffer`][].
        - `episode_end`: what marks the last step of an episode: the name of a 0-d bool leaf
            of a dict example (default `"done"`), or a function of one step returning a 0-d
            bool (e.g. `lambda s: s["terminated"] | s["truncated"]`).
        - `mode`: `"never_cross"` (windows lie wholly inside an episode; shorter episodes are
            skipped) or `"pad"` (windows are cut at the episode end, zero-padded, with a
            `mask`).
        """
        where = "EpisodeTrajectoryBuffer()"
        view = window_view(where, sequence_length)
        rule = episodic(where, episode_end, mode)
        self.storage, self.rule, self.view, self.period, self.min_length_time_axis = compose(
            where, example, add_batch_size, sizes, rule, view, period=period, frames=frames
        )

    @property
    def tree(self) -> SumTree:
        """The [`equibuffer.SumTree`][] of 0/1 leaves: 1 at each valid window start."""
        return _episodic(self.rule).tree


class PrioritisedEpisodeTrajectoryBuffer(AbstractPrioritisedBuffer, RuleEpisodes):
    """An [`equibuffer.EpisodeTrajectoryBuffer`][] that draws its valid windows in proportion
    to their priority: window `i` with probability `p_i**alpha / sum_k p_k**alpha`, the sum
    over the windows valid by the episode rule (`mode="never_cross"` or `"pad"`, exactly as
    for the uniform buffer). A window that is not valid is never drawn and keeps no priority.

    - A window enters at the largest priority set so far (1 before any `set_priorities`),
        raised to `alpha`, when it becomes valid: once complete and inside an episode
        (`never_cross`), or complete or cut by an episode end (`pad`).
    - A window that is already valid keeps the priority it was given when later steps are
        added (in `pad` mode a window cut by an end is valid, and may be sampled and given a
        priority, before the steps after the end arrive). A slot overwritten by new data
        starts afresh.
    - `set_priorities(sample, priorities)` drops the updates of windows overwritten since
        they were sampled, and of windows that are not valid by the episode rule.
    - `can_sample()` depends only on the counters; with ready counters `sample` raises
        (inside jit) if no window fits the episode rule, or if every valid window has
        priority 0, and says which.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"obs": jnp.zeros(2), "done": jnp.bool_(False)}
        buffer = eb.PrioritisedEpisodeTrajectoryBuffer(example, add_batch_size=2,
                                                       max_length_time_axis=32,
                                                       sequence_length=4, alpha=0.6)
        done = jnp.zeros((2, 12), bool).at[:, 5].set(True)  # episodes of 6 steps
        buffer = buffer.add({"obs": jnp.ones((2, 12, 2)), "done": done})
        sample = buffer.sample(jax.random.key(0), batch_size=16, beta=0.4)
        assert not sample.experience["done"][:, :-1].any()  # never crosses an end
        td_error = jnp.arange(16.0)
        buffer = buffer.set_priorities(sample, jnp.abs(td_error) + 1e-3)
        ```

    It is [`equibuffer.PrioritisedBuffer`][] with
    `rule=PrioritisedEpisodic(episode_end, mode, alpha)` and `view=WindowView(sequence_length)`.
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
        episode_end: EpisodeEnd = "done",
        mode: Mode = "never_cross",
        alpha: float = 0.6,
        frames: Frames | None = None,
        **sizes: Unpack[Sizes],
    ):
        """**Arguments:**

        - `example`, `add_batch_size`, `sequence_length`, `period`, `frames`, `episode_end`,
            `mode`, `**sizes`: as for [`equibuffer.EpisodeTrajectoryBuffer`][].
        - `alpha`: the priority exponent, `>= 0`: 0 is uniform over the valid windows of
            positive priority, 1 fully proportional. Default 0.6.
        """
        where = "PrioritisedEpisodeTrajectoryBuffer()"
        view = window_view(where, sequence_length)
        rule = prioritised_episodic(where, episode_end, mode, alpha)
        self.storage, self.rule, self.view, self.period, self.min_length_time_axis = compose(
            where, example, add_batch_size, sizes, rule, view, period=period, frames=frames
        )

    @property
    def valid(self) -> Bool[Array, "rows length"]:
        """Whether the window starting at each slot is valid by the episode rule."""
        return _prioritised_episodic(self.rule).valid

    @property
    def num_valid(self) -> Int[Array, ""]:
        """The number of valid windows, whatever their priority."""
        return _prioritised_episodic(self.rule).num_valid
