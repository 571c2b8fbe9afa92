"""Frame stacking: one frame stored per step, and the stack of the last `k` frames of the
step's own episode built whenever the step is read (see [Pixels](../pixels.md)).

This module holds the configuration (`Frames`) and what it says about shapes: the stored
example (the stack axis removed), the stacked one, and how an added batch is read (stacked
observations or single frames). The ring (`RingStorage`) applies it: it stores the frames,
checks each added stack against what it holds, and builds the stacks when a step is read."""

from typing import Any, Literal, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._checks import as_example_leaf, check_positive_int, keystr
from ._episodes import check_episode_end, check_episode_end_kind, ends_of, EpisodeEnd, top_level


Padding: TypeAlias = Literal["reset", "zeros"]


class Frames(eqx.Module):
    """Frame stacking: the buffer stores one frame per step of the observation leaf `leaf`,
    and every sample returns, for each step it holds, the stack of the last `k` frames of
    that step's own episode, oldest first, on axis `axis`: what the environment's
    frame-stacking wrapper returned at that step. Before an episode's first step the
    episode's first frame is repeated (`padding="reset"`, Gymnasium's
    `FrameStackObservation`), or zeros stand there (`padding="zeros"`, SB3's
    `VecFrameStack`). A stack never mixes two episodes, and each frame is stored once: a
    stack of `k` costs one frame per step, not `k`.

    Give it to a buffer as `frames=`. The example holds the stacked observation, as the
    environment returns it (`(84, 84, 4)` on Atari, `axis=-1`); `add` takes the stacked
    observations (it stores the newest frame, after checking that the older ones are the
    frames it holds for that row) or single frames.

    **Arguments:**

    - `leaf`: the name of the observation leaf to stack (a key of a dict example, or an
        attribute).
    - `k`: the number of frames in a stack, at least 1.
    - `axis`: the stack's axis in the stacked observation (default `-1`, the last).
    - `padding`: `"reset"` (default) or `"zeros"`, what stands before an episode's first
        frame.
    - `episode_end`: what marks the last step of an episode (a 0-d bool leaf's name or a
        function of one stored step), as for [`equibuffer.rules.Episodic`][]. Default: the
        buffer's rule's own, when it is episode-aware; else it must be given.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        example = {"obs": jnp.zeros((2, 3), jnp.uint8), "done": jnp.bool_(False)}
        buffer = eb.TransitionBuffer(example, add_batch_size=1, capacity=16,
                                     frames=eb.Frames("obs", k=3, episode_end="done"))
        assert buffer.storage.data["obs"].shape == (1, 16, 2)  # one frame per step
        frames = jnp.broadcast_to(jnp.arange(5, dtype=jnp.uint8)[None, :, None], (1, 5, 2))
        buffer = buffer.add({"obs": frames, "done": jnp.zeros((1, 5), bool)})  # single frames
        pair = buffer.sample(jax.random.key(0), batch_size=8).experience
        assert pair.first["obs"].shape == (8, 2, 3)
        newest = pair.first["obs"][:, 0, -1].astype(jnp.int32)
        oldest = jnp.maximum(newest - 2, 0)  # the first frame repeated before it
        assert (pair.first["obs"][:, 0, 0].astype(jnp.int32) == oldest).all()
        ```
    """

    leaf: str = eqx.field(static=True)
    k: int = eqx.field(static=True)
    axis: int = eqx.field(static=True, default=-1)
    padding: Padding = eqx.field(static=True, default="reset")
    episode_end: EpisodeEnd | None = eqx.field(static=True, default=None)

    @property
    def lookback(self) -> int:
        """The number of earlier steps a stack reads, `k - 1`."""
        return self.k - 1

    def checked(self, where: str, example: Any, rule_end: EpisodeEnd | None = None) -> "Frames":
        """This configuration checked against `example` (the stacked one, as the user gives
        it), with `axis` made non-negative and `episode_end` resolved: the rule's
        (`rule_end`) unless given, and checked against the stored example. Errors start
        with `where`."""
        if not isinstance(self.leaf, str):
            raise TypeError(
                f"{where}: `Frames.leaf` must be the name of the observation leaf to stack "
                f"(e.g. 'obs'), got {self.leaf!r}."
            )
        k = check_positive_int(where, "Frames.k", self.k, limit=2**16)
        if self.padding not in ("reset", "zeros"):
            raise ValueError(
                f"{where}: `Frames.padding` must be 'reset' (the episode's first frame repeated "
                f"before it) or 'zeros', got {self.padding!r}."
            )
        path, leaf = leaf_named(where, example, self.leaf)
        shape, nd = tuple(leaf.shape), len(leaf.shape)
        if isinstance(self.axis, bool) or not isinstance(self.axis, int):
            raise TypeError(f"{where}: `Frames.axis` must be an int, got {self.axis!r}.")
        if nd == 0:
            raise ValueError(
                f"{where}: the leaf {keystr(path)} to stack is 0-d: it has no stack axis. Give "
                f"the example's stacked observation, e.g. shape (84, 84, {k}) for `k={k}`."
            )
        if not -nd <= self.axis < nd:
            raise ValueError(
                f"{where}: `Frames.axis={self.axis}` is not an axis of the leaf {keystr(path)}, "
                f"of shape {shape}."
            )
        axis = self.axis % nd
        if shape[axis] != k:
            raise ValueError(
                f"{where}: the leaf {keystr(path)} has shape {shape}: {shape[axis]} on axis "
                f"{self.axis}, not `k={k}` frames. Give the example's stacked observation and "
                f"the axis its frames are stacked on (Atari's (84, 84, 4): `axis=-1`, `k=4`)."
            )
        given = self.episode_end
        if given is None and rule_end is None:
            raise ValueError(
                f"{where}: frame stacking needs to know where episodes start, so that a stack "
                "never mixes two episodes: pass `episode_end=` to eb.Frames (the name of a 0-d "
                "bool leaf, e.g. 'done', or a function of one step), or use an episode-aware "
                "rule (`episode_end=` on the buffer)."
            )
        if given is not None and rule_end is not None and given != rule_end:
            raise ValueError(
                f"{where}: eb.Frames(episode_end={given!r}) and the buffer's rule "
                f"(episode_end={rule_end!r}) disagree on where episodes end: give it once, "
                "to the buffer (the frames take the rule's)."
            )
        end = check_episode_end_kind(where, given if given is not None else rule_end)
        frames = Frames(self.leaf, k, axis, self.padding, end)
        check_episode_end(where, frames.stored(example), end)
        return frames

    def for_stored(self, where: str, stored: Any, rule_end: EpisodeEnd | None = None) -> "Frames":
        """This configuration checked, as `checked` does, against the example of one
        *stored* step (the frames leaf one frame, as an archive holds it): `axis` counts in
        the stacked observation, whose shape is the frame's with `k` frames at `axis`."""
        path, leaf = leaf_named(where, stored, self.leaf)
        k = check_positive_int(where, "Frames.k", self.k, limit=2**16)
        nd = len(leaf.shape) + 1
        if isinstance(self.axis, bool) or not isinstance(self.axis, int):
            raise TypeError(f"{where}: `Frames.axis` must be an int, got {self.axis!r}.")
        if not -nd <= self.axis < nd:
            raise ValueError(
                f"{where}: `Frames.axis={self.axis}` is not an axis of a stack of the leaf "
                f"{keystr(path)}'s frames, of shape {tuple(leaf.shape)}."
            )
        axis = self.axis % nd
        stacked = _with_leaf(stored, self.leaf, lambda s: _struct(_with(s.shape, axis, k), s))
        return Frames(self.leaf, k, axis, self.padding, self.episode_end).checked(
            where, stacked, rule_end
        )

    def ends_of(self, steps: Any, batch_dims: int) -> Any:
        """The episode-end flag of every step of `steps` (leaves `(*batch, *stored leaf)`,
        `batch_dims` batch axes), by the `episode_end` that `checked` resolved."""
        assert self.episode_end is not None, "a ring's frames are checked (episode_end resolved)"
        return ends_of(self.episode_end, steps, batch_dims)

    def stored(self, example: Any) -> Any:
        """The example of one stored step (`jax.ShapeDtypeStruct` leaves): the stacked
        leaf without its stack axis."""
        return _with_leaf(example, self.leaf, lambda s: _struct(_without(s.shape, self.axis), s))

    def stacked(self, stored: Any) -> Any:
        """The example of one step as a sample returns it: `stored` with the stack axis."""
        return _with_leaf(
            stored, self.leaf, lambda s: _struct(_with(s.shape, self.axis, self.k), s)
        )


def as_frames(where: str, frames: Any) -> Frames | None:
    """`frames` (a `frames=` argument), checked to be an `eb.Frames` or None."""
    if frames is not None and not isinstance(frames, Frames):
        raise TypeError(f"{where}: `frames` must be an eb.Frames, got {frames!r}.")
    return frames


def leaf_named(where: str, tree: Any, name: str) -> tuple[Any, jax.ShapeDtypeStruct]:
    """The path and shape of the top-level leaf called `name` (a dict key or an attribute)."""
    found = top_level(tree, name)
    if found is None:
        names = ", ".join(keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
        raise ValueError(
            f"{where}: `Frames(leaf={name!r})` names no top-level leaf of the example (its "
            f"leaves are {names}); name the observation leaf to stack."
        )
    _, path, leaf = found
    return path, as_example_leaf(path, leaf)


def leaf_position(tree: Any, name: str) -> int:
    """The position, among the flattened leaves of `tree`, of the top-level leaf `name`."""
    found = top_level(tree, name)
    if found is None:
        raise KeyError(name)
    return found[0]


def frame_at(x: Any, batch_dims: int, axis: int, i: int) -> Any:
    """Frame `i` of stacked observations `x` (leading `batch_dims` axes, the stack on
    `axis` after them), by basic indexing (a NumPy array stays one)."""
    return x[(slice(None),) * (batch_dims + axis) + (i,)]


def _with_leaf(tree: Any, name: str, fn: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    i = leaf_position(tree, name)
    new = [leaf for _, leaf in leaves]
    new[i] = fn(as_example_leaf(leaves[i][0], new[i]))
    return jax.tree_util.tree_unflatten(treedef, new)


def _struct(shape: tuple[int, ...], like: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, like.dtype)


def _without(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return tuple(shape[:axis]) + tuple(shape[axis + 1 :])


def _with(shape: tuple[int, ...], axis: int, k: int) -> tuple[int, ...]:
    return tuple(shape[:axis]) + (k,) + tuple(shape[axis:])


def stack_sources(
    frames: Frames,
    slot: Array,
    offset: Array,
    ends_before: Array,
) -> tuple[Array, Array]:
    """For steps at ring `slot` (any shape `*b`), `offset` steps after their row's oldest
    held step: the slot of each of the `k` frames of their stack, oldest first, and whether
    each lies in the step's episode (`(*b, k)` each). `ends_before[..., d - 1]` is the
    episode-end flag of the step `d` before (`d = 1, ..., k - 1`). An episode starts after
    an end, and at the oldest held step when nothing before it is held (the first step
    ever: the ring drops no window's frames otherwise, see `rules._valid.window_layout`).
    Before the start the episode's first frame stands (`"reset"`), or zeros (`inside`
    false there, `"zeros"`)."""
    k = frames.k
    back = jnp.arange(1, k, dtype=jnp.int32).reshape(*(1,) * slot.ndim, -1)
    boundary = ends_before | (offset[..., None] - back < 0)
    inside = jnp.cumsum(boundary, axis=-1, dtype=jnp.int32) == 0  # (*b, k - 1), a prefix
    if frames.padding == "reset":
        held = jnp.sum(inside, axis=-1, dtype=jnp.int32)[..., None]
        back = jnp.minimum(back, held)
    else:
        back = jnp.broadcast_to(back, inside.shape)
    # Oldest first: `k - 1` steps back, ..., 1 step back, then the step itself.
    back = jnp.concatenate([back[..., ::-1], jnp.zeros_like(back[..., :1])], axis=-1)
    inside = jnp.concatenate([inside[..., ::-1], jnp.ones_like(inside[..., :1])], axis=-1)
    return slot[..., None] - back.astype(slot.dtype), inside


def expected_older(
    frames: Frames, newest: Any, before: Any, start: Any, ends: Any, xp: Any = jnp
) -> Any:
    """What frame `k - 2` of each stack of `T` consecutive steps must be, `(rows, T,
    *frame)`: the previous step's newest frame, or the padding at an episode's first step.
    `newest`: the steps' newest frames, `(rows, T, *frame)`; `before`: the newest frame of
    the step before them, `(rows, *frame)`; `start`: whether the first of them starts an
    episode, `(rows,)`; `ends`: the steps' episode-end flags, `(rows, T)`. Written once for a
    ring's add inside jit (`xp=jax.numpy`) and for an import on the host (`xp=numpy`)."""
    prev = xp.concatenate([before[:, None], newest[:, :-1]], axis=1)
    starts = xp.concatenate([start[:, None], ends[:, :-1]], axis=1)
    pad = newest if frames.padding == "reset" else xp.zeros_like(newest)
    return xp.where(starts.reshape(*starts.shape, *(1,) * (newest.ndim - 2)), pad, prev)


def stacks_on_host(frames: Frames, steps: Any, first: int) -> Any:
    """Steps `first:` of `steps` (NumPy leaves `(rows, n, *leaf)`, one frame per step of
    `frames.leaf`, read from an archive) with that leaf made the stacks the wrapper returned:
    each step's own episode's last `k` frames, oldest first on `frames.axis`, its first frame
    (or zeros) before it. Step 0 is taken as an episode's first step: the caller reads from
    `k - 1` steps before `first`, or from the first step its source ever added.
    (`frames` is checked, its `episode_end` a leaf's name.)"""
    leaves, treedef = jax.tree_util.tree_flatten(steps)
    i = leaf_position(steps, frames.leaf)
    ends = np.asarray(frames.ends_of(steps, 2), bool)
    x = np.asarray(leaves[i])
    rows, n = ends.shape
    index = np.arange(n)
    begins = np.concatenate([np.ones((rows, 1), bool), ends[:, :-1]], axis=1)
    episode_start = np.maximum.accumulate(np.where(begins, index, 0), axis=1)[:, first:, None]
    back = index[first:, None] - (frames.k - 1) + np.arange(frames.k)  # (steps, k)
    stacks = x[np.arange(rows)[:, None, None], np.maximum(back, episode_start)]
    if frames.padding == "zeros":
        stacks[back < episode_start] = 0
    out = [np.asarray(leaf)[:, first:] for leaf in leaves]
    out[i] = np.moveaxis(stacks, 2, 2 + frames.axis)
    return jax.tree_util.tree_unflatten(treedef, out)
