"""Episode ends: the episode-end flag of every slot of the ring, and the episode rule that
reads them (`never_cross`: no end before a window's last step; `pad`: windows cut at the end,
masked past it). A component of the episode-aware rules (`Episodic`, `PrioritisedEpisodic`)."""

from typing import Any, Literal, TypeAlias

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, PyTree, Shaped

from .._custom_types import Indices
from .._episodes import (
    check_episode_end as check_episode_end,
    check_episode_end_kind as check_episode_end_kind,
    ends_of,
    EpisodeEnd as EpisodeEnd,
)
from .._ring import Appended, RingStorage
from ._request import Window
from ._valid import held_on_period, offset_slots, window_offsets, window_steps


Mode: TypeAlias = Literal["never_cross", "pad"]


def check_mode(where: str, mode: Any, episode_end: Any = ...) -> Mode:
    """`mode`, refused unless it is one of the two; where `episode_end` is given as None (a
    transition buffer's default, which reads no episode ends), also unless it is the default
    (before, any `mode` was taken there and ignored)."""
    if mode not in ("never_cross", "pad"):
        raise ValueError(f"{where}: `mode` must be 'never_cross' or 'pad', got {mode!r}.")
    if episode_end is None and mode != "never_cross":
        raise ValueError(
            f"{where}: mode={mode!r} is how episode-aware transitions treat an episode's end, "
            "and `episode_end` is None: give `episode_end` (the bool leaf, or a function of "
            "one step, that marks an episode's last step) or leave `mode` out."
        )
    return mode


class EpisodeEnds(eqx.Module):
    """The episode-end flag of every slot of the ring, and the episode rule that reads them.

    `episode_end` marks the last step of an episode. `never_cross`: a valid window has no end
    before its last step. `pad`: a window may also be cut by an end (incomplete after it); the
    steps past the end are masked out.
    """

    ends: Bool[Array, "rows length"]
    episode_end: EpisodeEnd = eqx.field(static=True)
    mode: Mode = eqx.field(static=True)

    def of(self, steps: PyTree[Shaped[Array, "rows time ..."]]) -> Bool[Array, "rows time"]:
        """The episode-end flag of every step of a `(rows, time, *leaf)` tree."""
        return jnp.asarray(ends_of(self.episode_end, steps, 2))

    def written(self, storage: RingStorage, appended: Appended) -> "EpisodeEnds":
        """The flags with those of the steps just written."""
        slots = (appended.start + jnp.arange(appended.keep, dtype=jnp.int32)) % storage.length
        new = self.of(appended.steps)
        if appended.refused is not False:  # (a refused add: the flags as they were)
            new = jnp.where(appended.refused, self.ends[:, slots], new)
        ends = self.ends.at[:, slots].set(new, unique_indices=True, mode="promise_in_bounds")
        return eqx.tree_at(lambda e: e.ends, self, ends)

    def recomputed(self, storage: RingStorage) -> "EpisodeEnds":
        """The flags recomputed from every held step (after `update`, or a ring replaced),
        false at the slots not written yet (as `written` leaves them)."""
        slots = jnp.arange(storage.length, dtype=jnp.int32)
        held = window_offsets(storage, slots) < storage.fill
        return eqx.tree_at(lambda e: e.ends, self, self.of(storage.data) & held[None, :])

    def validity(
        self, storage: RingStorage, offsets: Int[Array, " m"], window: Window
    ) -> tuple[Bool[Array, "rows m"], Int[Array, " m"]]:
        """Whether the window starting `offsets` steps after the oldest held step is valid by
        the counters and the episode rule, in every row; and the slot of each start."""
        s, period = window.length, window.period
        slots = offset_slots(storage, offsets)
        if s > 1:
            # The flags of the first `s - 1` steps of each window, and whether each is held.
            inner = offsets[:, None] + jnp.arange(s - 1, dtype=jnp.int32)[None, :]
            flags = self.ends[:, offset_slots(storage, inner)]  # (rows, m, s - 1)
            crossed = jnp.any(flags & (inner < storage.fill)[None], axis=-1)
        else:
            crossed = jnp.zeros((storage.rows, offsets.shape[0]), jnp.bool_)
        aligned, whole = held_on_period(storage, offsets, s, period)
        if self.mode == "never_cross":
            return whole[None, :] & ~crossed, slots
        # pad: a held, aligned start whose window is complete or cut by an end.
        return aligned[None, :] & (whole[None, :] | crossed), slots

    def mask(
        self, storage: RingStorage, indices: Indices, window: Window
    ) -> Bool[Array, "batch window"]:
        """True at the steps of each window up to and including the first episode end: all
        true in `never_cross` mode."""
        if self.mode == "never_cross":
            return jnp.ones((indices.shape[0], window.length), jnp.bool_)
        flat = window_steps(storage.length, indices, window.length)
        flags = self.ends.reshape(-1).at[flat].get(mode="promise_in_bounds").astype(jnp.int32)
        # Step j belongs to the episode when no end comes before it in the window.
        return jnp.cumsum(flags, axis=1) - flags == 0

    def no_window_message(self, where: str, window: Window, blocks: int = 1) -> str:
        fix = (
            "use mode='pad' (short episodes are zero-padded) or shorter windows"
            if self.mode == "never_cross"
            else "add more steps or use shorter windows"
        )
        held = "steps held"
        if blocks > 1:
            held = f"steps held in the rows of one of the row_blocks={blocks} blocks"
        return (
            f"{where}: no window of {window.name} fits inside an episode among the "
            f"{held} (mode={self.mode!r}; `can_sample()` only looks at the counters). "
            f"To sample anyway, {fix}."
        )


def new_episode_ends(where: str, storage: RingStorage, episode_end: Any, mode: Any) -> EpisodeEnds:
    """All-false flags for `storage`, with `episode_end` and `mode` checked."""
    return EpisodeEnds(
        ends=jnp.zeros((storage.rows, storage.length), jnp.bool_),
        episode_end=check_episode_end(where, storage.example(), episode_end),
        mode=check_mode(where, mode),
    )
