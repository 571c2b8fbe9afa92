"""The prioritised episodic rule: the windows valid by the counters and the episode rule,
drawn in proportion to `priority ** alpha` from a sum tree."""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from .._barriers import read_once
from .._custom_types import Indices, IntScalar, Steps
from .._ring import Appended, RingStorage
from .._sumtree import SumTree
from ._base import AbstractPrioritisedRule, unless
from ._by_priority import check_alpha, draw_by_priority, reprioritised_tree
from ._episode_ends import (
    check_episode_end_kind,
    check_mode,
    EpisodeEnd,
    EpisodeEnds,
    Mode,
    new_episode_ends,
)
from ._request import Drawn, Request, Update, Window
from ._valid import changed_offsets, flat_indices, lookback_offsets, still_held


class PrioritisedEpisodic(AbstractPrioritisedRule):
    """In proportion to `priority ** alpha` over the windows valid by the counters and the
    episode rule. A window enters at the largest priority set so far when it becomes valid,
    keeps its priority while it stays valid (in `pad` mode a window cut by an end is valid
    before the steps after the end arrive), and gets 0 when it stops being valid. The rule
    of `PrioritisedEpisodeTrajectoryBuffer` (and of
    `PrioritisedTransitionBuffer(episode_end=...)`).

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        rule = eb.rules.PrioritisedEpisodic(episode_end="done", alpha=1.0)
        buffer = eb.PrioritisedBuffer({"done": jnp.bool_(False)}, add_batch_size=1,
                                      capacity=16, rule=rule, view=eb.views.PairView())
        buffer = buffer.add({"done": jnp.array([[False, True, False, False]])})
        assert int(buffer.num_valid_windows()) == 2  # pairs 0-1 and 2-3; 1-2 crosses an end
        sample = buffer.sample(jax.random.key(0), batch_size=4)
        assert jnp.allclose(sample.probabilities, 0.5)
        ```
    """

    episodes: EpisodeEnds
    valid: Bool[Array, "rows length"]
    num_valid: Int[Array, ""]
    tree: SumTree
    max_priority: Float[Array, ""]
    alpha: float = eqx.field(static=True)

    def __init__(
        self, episode_end: EpisodeEnd = "done", mode: Mode = "never_cross", alpha: float = 0.6
    ):
        """**Arguments:**

        - `episode_end`, `mode`: as for [`equibuffer.rules.Episodic`][].
        - `alpha`: as for [`equibuffer.rules.Prioritised`][] (default 0.6).

        The rule holds empty arrays until a buffer sizes it to its ring (`sized`).
        """
        self.episodes = EpisodeEnds(jnp.zeros((0, 0), jnp.bool_), episode_end, mode)
        self.valid = jnp.zeros((0, 0), jnp.bool_)
        self.num_valid = jnp.array(0, jnp.int32)
        self.tree = SumTree(1)
        self.max_priority = jnp.array(1.0, jnp.float32)
        self.alpha = alpha

    def sized(self, where: str, storage: RingStorage) -> "PrioritisedEpisodic":
        e = self.episodes
        rule = PrioritisedEpisodic(e.episode_end, e.mode, check_alpha(where, self.alpha))
        episodes = new_episode_ends(where, storage, e.episode_end, e.mode)
        valid = jnp.zeros((storage.rows, storage.length), jnp.bool_)
        tree = SumTree(storage.rows * storage.length)
        return eqx.tree_at(lambda r: (r.episodes, r.valid, r.tree), rule, (episodes, valid, tree))

    def row_leaves(self) -> tuple[Array, ...]:
        return (self.episodes.ends, self.valid)

    def _rated(
        self,
        storage: RingStorage,
        episodes: EpisodeEnds,
        offsets: Int[Array, " m"],
        overwritten: Bool[Array, " m"],
        window: Window,
        refused: Bool[ArrayLike, ""] = False,
    ) -> "PrioritisedEpisodic":
        """Re-rate the windows starting at `offsets`: 0 if not valid; else the old leaf if the
        window was valid before and its slot was not `overwritten`, else `max_priority **
        alpha`."""
        valid, slots = episodes.validity(storage, offsets, window)
        indices = flat_indices(storage.rows, storage.length, slots)  # (each slot named once)
        before = self.valid[:, slots]
        old = self.tree.read(indices).reshape(valid.shape)
        fresh = self.max_priority**self.alpha
        kept = before & ~overwritten[None, :]
        leaves = jnp.where(valid, jnp.where(kept, old, fresh), 0.0).reshape(-1)
        tree = self.tree.write(indices, leaves, mask=unless(refused, leaves), unique_indices=True)
        # The flags written only after `before` is read: else XLA copies them to keep
        # `before`, which nothing makes it read first (see `read_once`).
        before, valid = read_once(before, valid)
        if refused is not False:  # (a refused add: every flag and count as it was)
            valid = jnp.where(refused, before, valid)
        new_valid = self.valid.at[:, slots].set(
            valid, unique_indices=True, mode="promise_in_bounds"
        )
        num_valid = self.num_valid + jnp.sum(valid, dtype=jnp.int32)
        num_valid = num_valid - jnp.sum(before, dtype=jnp.int32)
        return eqx.tree_at(
            lambda r: (r.episodes, r.valid, r.num_valid, r.tree),
            self,
            (episodes, new_valid, num_valid, tree),
        )

    def added(
        self, storage: RingStorage, appended: Appended, window: Window
    ) -> "PrioritisedEpisodic":
        episodes = self.episodes.written(storage, appended)
        offsets = changed_offsets(storage, appended.keep, window.length)
        m = offsets.shape[0]
        overwritten = jnp.arange(m) >= m - appended.keep
        front = lookback_offsets(storage, offsets)  # (none overwritten)
        offsets = jnp.concatenate([offsets, front])
        overwritten = jnp.concatenate([overwritten, jnp.zeros(front.shape, jnp.bool_)])
        return self._rated(storage, episodes, offsets, overwritten, window, appended.refused)

    def updated(
        self, storage: RingStorage, window: Window, *, restored: bool = False
    ) -> "PrioritisedEpisodic":
        offsets = jnp.arange(storage.length, dtype=jnp.int32)
        # Restored: every slot counts as overwritten, so no old priority is kept.
        overwritten = jnp.full(storage.length, restored, jnp.bool_)
        episodes = self.episodes.recomputed(storage)
        return self._rated(storage, episodes, offsets, overwritten, window)

    def mask(
        self, storage: RingStorage, indices: Indices, window: Window
    ) -> Bool[Array, "batch window"]:
        return self.episodes.mask(storage, indices, window)

    def draw(self, storage: RingStorage, window: Window, request: Request) -> Drawn:
        no_window = self.episodes.no_window_message(request.where, window)
        return draw_by_priority(storage, self.tree, request, self.num_valid == 0, no_window)

    def count_valid(self, storage: RingStorage, window: Window) -> IntScalar:
        return self.num_valid

    def valid_starts(self, storage: RingStorage, window: Window) -> Bool[Array, "rows length"]:
        return self.valid

    def reprioritised(
        self, storage: RingStorage, window: Window, update: Update
    ) -> "PrioritisedEpisodic":
        def current(indices: Indices, steps: Steps) -> Bool[Array, " batch"]:
            # Still valid by the episode rule (its flag), and still the window drawn.
            valid = self.valid.reshape(-1).at[indices].get(mode="fill", fill_value=False)
            return valid & still_held(storage, indices, steps)

        return reprioritised_tree(self, update, current)


def prioritised_episodic(
    where: str, episode_end: Any, mode: Any, alpha: Any
) -> PrioritisedEpisodic:
    """A new `PrioritisedEpisodic` rule of checked configuration (errors start with
    `where`; its episode-end leaf is checked against the example when a buffer sizes it)."""
    alpha = check_alpha(where, alpha)
    episode_end = check_episode_end_kind(where, episode_end)
    return PrioritisedEpisodic(episode_end, check_mode(where, mode), alpha)
