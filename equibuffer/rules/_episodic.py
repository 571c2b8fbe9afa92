"""The episodic rule: the windows valid by the counters and the episode rule, drawn exactly
uniformly (a sum tree of 0/1 leaves)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int

from .._custom_types import Indices, IntScalar
from .._errors import branched_error_if
from .._ring import Appended, RingStorage
from .._sumtree import SumTree
from ._base import AbstractUniformRule, unless
from ._episode_ends import (
    check_episode_end_kind,
    check_mode,
    EpisodeEnd,
    EpisodeEnds,
    Mode,
    new_episode_ends,
)
from ._request import Drawn, Request, Window
from ._valid import (
    changed_offsets,
    flat_indices,
    lookback_offsets,
    start_steps,
    window_offsets,
)


# Uniform episode leaves hold 0 or 1 and every node an integer count, exact in float32 up to
# 2**24.
MAX_COUNTED = 1 << 24


class Episodic(AbstractUniformRule):
    """Exactly uniform over the windows valid by the counters and the episode rule: a
    `SumTree` with a leaf of 1 at each valid window start and 0 elsewhere. The rule of
    `EpisodeTrajectoryBuffer` (and of `TransitionBuffer(episode_end=...)`).

    `episode_end` marks the last step of an episode: the name of a 0-d bool leaf of a dict
    example, or a function of one step returning a 0-d bool. `mode="never_cross"`: a window
    has no end before its last step; `"pad"`: a window may be cut by an end, and what lies
    past it comes back zero, with `sample.mask` false there.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.Buffer({"done": jnp.bool_(False)}, add_batch_size=1, capacity=16,
                           rule=eb.rules.Episodic(episode_end="done"),
                           view=eb.views.WindowView(3))
        buffer = buffer.add({"done": jnp.array([[False, True, False, False, False]])})
        assert int(buffer.num_valid_windows()) == 1  # steps 2-4: the only one in an episode
        ```
    """

    episodes: EpisodeEnds
    tree: SumTree

    def __init__(self, episode_end: EpisodeEnd = "done", mode: Mode = "never_cross"):
        """**Arguments:**

        - `episode_end`: the name of a 0-d bool leaf (default `"done"`), or a function
            `step -> 0-d bool`; checked against the example when a buffer sizes the rule.
        - `mode`: `"never_cross"` (default) or `"pad"`.

        The rule holds empty arrays until a buffer sizes it to its ring (`sized`).
        """
        self.episodes = EpisodeEnds(jnp.zeros((0, 0), jnp.bool_), episode_end, mode)
        self.tree = SumTree(1)

    def sized(self, where: str, storage: RingStorage) -> "Episodic":
        if storage.rows * storage.length > MAX_COUNTED:
            raise ValueError(
                f"{where}: the buffer holds {storage.rows * storage.length} steps in total, "
                f"more than {MAX_COUNTED} (2**24), the largest count of windows drawn exactly "
                "uniformly (the valid windows are counted in float32). Lower `capacity` (or "
                "`max_length_time_axis`)."
            )
        e = self.episodes
        episodes = new_episode_ends(where, storage, e.episode_end, e.mode)
        tree = SumTree(storage.rows * storage.length)
        return eqx.tree_at(lambda r: (r.episodes, r.tree), self, (episodes, tree))

    def row_leaves(self) -> tuple[Array, ...]:
        return (self.episodes.ends,)

    def _rated(
        self,
        storage: RingStorage,
        episodes: EpisodeEnds,
        offsets: Int[Array, " m"],
        window: Window,
        refused: Bool[ArrayLike, ""] = False,
    ) -> "Episodic":
        valid, slots = episodes.validity(storage, offsets, window)
        indices = flat_indices(storage.rows, storage.length, slots)  # (each slot named once)
        values = valid.reshape(-1).astype(jnp.float32)
        tree = self.tree.write(indices, values, mask=unless(refused, values), unique_indices=True)
        return eqx.tree_at(lambda r: (r.episodes, r.tree), self, (episodes, tree))

    def added(self, storage: RingStorage, appended: Appended, window: Window) -> "Episodic":
        episodes = self.episodes.written(storage, appended)
        offsets = changed_offsets(storage, appended.keep, window.length)
        offsets = jnp.concatenate([offsets, lookback_offsets(storage, offsets)])
        return self._rated(storage, episodes, offsets, window, appended.refused)

    def updated(
        self, storage: RingStorage, window: Window, *, restored: bool = False
    ) -> "Episodic":
        # Every flag and every leaf recomputed: the same whether restored or not.
        offsets = jnp.arange(storage.length, dtype=jnp.int32)
        return self._rated(storage, self.episodes.recomputed(storage), offsets, window)

    def mask(
        self, storage: RingStorage, indices: Indices, window: Window
    ) -> Bool[Array, "batch window"]:
        return self.episodes.mask(storage, indices, window)

    def count_valid(self, storage: RingStorage, window: Window) -> IntScalar:
        return self.tree.total().astype(jnp.int32)

    def valid_starts(self, storage: RingStorage, window: Window) -> Bool[Array, "rows length"]:
        # The leaves are 1 at the valid window starts, 0 elsewhere.
        return (self.tree.values() > 0).reshape(storage.rows, storage.length)

    def draw(self, storage: RingStorage, window: Window, request: Request) -> Drawn:
        key, batch_size, ready, not_ready, where, blocks, _ = request
        # Integer prefixes and integer node sums are exact in float32 below 2**24.
        if blocks == 1:
            total = self.count_valid(storage, window)
            rank = jax.random.randint(key, (batch_size,), 0, jnp.maximum(total, 1), jnp.int32)
            indices = self.tree.find(rank.astype(jnp.float32))
        else:
            totals = self.tree.block_totals(blocks).astype(jnp.int32)[:, None]
            shape = (blocks, batch_size // blocks)
            rank = jax.random.randint(key, shape, 0, jnp.maximum(totals, 1), jnp.int32)
            indices = self.tree.search_blocks(rank.astype(jnp.float32))[0].reshape(-1)
            total = jnp.min(totals)
        indices = branched_error_if(
            indices,
            ~ready | (total == 0),
            jnp.where(ready, 1, 0),
            [not_ready, self.episodes.no_window_message(where, window, blocks)],
        )
        return Drawn(indices, start_steps(storage, window_offsets(storage, indices)))


def episodic(where: str, episode_end: Any, mode: Any) -> Episodic:
    """A new `Episodic` rule of checked configuration (errors start with `where`; its
    episode-end leaf is checked against the example when a buffer sizes it)."""
    return Episodic(check_episode_end_kind(where, episode_end), check_mode(where, mode))
