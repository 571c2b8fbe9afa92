"""Episode-aware sequence sampling: the trajectory buffer's ring plus a `SumTree` of 0/1 leaves,
one per window start, that says which windows fit inside an episode.

The tree is kept in step at `add` exactly like the prioritised buffers keep theirs: only the
windows that start at one of the steps just written, or at one of the `sequence_length - 1`
steps before them, can change status, so an `add` of `T` steps touches
`add_batch_size * min(T + sequence_length - 1, max_length)` leaves. Sampling draws an integer
rank uniformly below the number of valid windows and finds that window in the tree: exactly
uniform over the valid windows, with no rejection loop.
"""

from collections.abc import Callable, Mapping
from typing import Any, cast, Literal, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, PRNGKeyArray, PyTree, Shaped

from .._checks import check_positive_int, keystr
from .._custom_types import ExampleTree, ExperienceBatch, IntScalar
from .._ring import RingStorage
from .._sumtree import SumTree
from .._windows import gather, window_layout
from ._base import (
    AbstractBuffer,
    check_window_config,
    resolve_length,
    Sample,
    update_storage,
    UpdateFn,
)


# A leaf name, or `step -> 0-d bool` (its output is checked at construction, with a message).
EpisodeEnd: TypeAlias = str | Callable[[PyTree[Shaped[Array, "..."]]], Any]

# Leaves hold 0 or 1 and every node an integer count, exact in float32 up to 2**24.
_MAX_LEAVES = 1 << 24


class EpisodeSample(Sample):
    """What [`equibuffer.EpisodeTrajectoryBuffer`][]'s `sample` returns: a
    [`equibuffer.Sample`][] (`experience` with leaves `(batch, sequence_length, *leaf)`,
    `indices`, `steps`) plus

    - `mask`: `(batch, sequence_length)` bool, true at the steps that belong to the window's
        episode. With `mode="never_cross"` it is all true; with `mode="pad"` it is false
        after the first episode end in the window, and the experience is zero there.
    """

    mask: Bool[Array, "batch sequence"]


def _check_episode_end(where: str, example: Any, episode_end: Any) -> EpisodeEnd:
    """Validate `episode_end` against the example (a tree of `jax.ShapeDtypeStruct`s)."""
    if isinstance(episode_end, str):
        if not isinstance(example, Mapping) or episode_end not in example:
            leaves = jax.tree_util.tree_flatten_with_path(example)[0]
            names = ", ".join(keystr(p) for p, _ in leaves)
            raise ValueError(
                f"{where}: `episode_end={episode_end!r}` names no top-level leaf of the example "
                f"(its leaves are {names}). Name a boolean 0-d leaf of a dict example, or pass "
                "a function `step -> bool`, e.g. `lambda s: s['terminated'] | s['truncated']`."
            )
        leaf = example[episode_end]
        shape, dtype = tuple(leaf.shape), jnp.dtype(leaf.dtype)
        if shape != () or dtype != jnp.bool_:
            raise TypeError(
                f"{where}: the episode-end leaf [{episode_end!r}] must be a 0-d bool "
                f"(e.g. jnp.bool_(False)), got shape {shape} and dtype {dtype.name}. Store "
                "`terminated | truncated` as a bool, or pass a function `step -> bool`."
            )
        return episode_end
    if not callable(episode_end):
        raise TypeError(
            f"{where}: `episode_end` must be the name of a boolean leaf or a function "
            f"`step -> bool`, got {episode_end!r}."
        )
    out = jax.eval_shape(episode_end, example)
    if not hasattr(out, "shape") or tuple(out.shape) != () or jnp.dtype(out.dtype) != jnp.bool_:
        got = (
            f"shape {tuple(out.shape)} and dtype {jnp.dtype(out.dtype).name}"
            if hasattr(out, "shape")
            else repr(out)
        )
        raise TypeError(
            f"{where}: the `episode_end` function must return a 0-d bool for one step, got {got}."
        )
    return cast(EpisodeEnd, episode_end)


class EpisodeTrajectoryBuffer(AbstractBuffer):
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
    ready counters but no window that fits inside an episode makes `sample` raise (inside
    jit, through `eqx.error_if`). `num_valid_windows()` counts the windows that can be drawn.

    The motivating configuration: `(84, 84, 3)` observations from 100 environments, 100,000
    sequences of 40 steps, any 40-step range inside an episode:

    ```python
    example = {"obs": jnp.zeros((84, 84, 3), jnp.uint8), "done": jnp.bool_(False)}
    buffer = eb.EpisodeTrajectoryBuffer(example, add_batch_size=100, sequence_length=40,
                                        capacity=100_000 * 40, episode_end="done")
    ```

    (4,000,000 steps of 21 KB: 85 GB of observations, so it needs a large accelerator; the
    storage size is `capacity`, whatever the number of environments adding.)

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp
        from equibuffer._buffers._episodes import EpisodeTrajectoryBuffer

        example = {"obs": jnp.zeros(2), "done": jnp.bool_(False)}
        buffer = EpisodeTrajectoryBuffer(example, add_batch_size=2, max_length=32,
                                         sequence_length=4, episode_end="done")
        done = jnp.zeros((2, 12), bool).at[:, 5].set(True)  # episodes of 6 steps
        buffer = buffer.add({"obs": jnp.ones((2, 12, 2)), "done": done})
        sample = buffer.sample(jax.random.key(0), batch_size=16)
        assert sample.experience["obs"].shape == (16, 4, 2)
        # no episode end before the last step of any window
        assert not sample.experience["done"][:, :-1].any()
        ```
    """

    storage: RingStorage
    ends: Bool[Array, "rows length"]
    tree: SumTree
    sequence_length: int = eqx.field(static=True)
    period: int = eqx.field(static=True)
    min_length: int = eqx.field(static=True)
    mode: Literal["never_cross", "pad"] = eqx.field(static=True)
    episode_end: EpisodeEnd = eqx.field(static=True)

    def __init__(
        self,
        example: ExampleTree,
        *,
        add_batch_size: int,
        sequence_length: int,
        period: int = 1,
        max_length: int | None = None,
        capacity: int | None = None,
        max_size: int | None = None,
        min_length: int | None = None,
        episode_end: EpisodeEnd = "done",
        mode: Literal["never_cross", "pad"] = "never_cross",
    ):
        """**Arguments:**

        - `example`, `add_batch_size`, `sequence_length`, `period`, `max_length`, `capacity`
            (alias `max_size`), `min_length`: as for [`equibuffer.TrajectoryBuffer`][].
        - `episode_end`: what marks the last step of an episode: the name of a 0-d bool leaf
            of a dict example (default `"done"`), or a function of one step returning a 0-d
            bool (e.g. `lambda s: s["terminated"] | s["truncated"]`).
        - `mode`: `"never_cross"` (windows lie wholly inside an episode; shorter episodes are
            skipped) or `"pad"` (windows are cut at the episode end, zero-padded, with a
            `mask`).
        """
        where = "EpisodeTrajectoryBuffer()"
        rows = check_positive_int(where, "add_batch_size", add_batch_size)
        length = resolve_length(where, rows, max_length, capacity, max_size)
        self.sequence_length, self.period, self.min_length = check_window_config(
            where, length, sequence_length, period, min_length
        )
        if mode not in ("never_cross", "pad"):
            raise ValueError(f"{where}: `mode` must be 'never_cross' or 'pad', got {mode!r}.")
        if rows * length > _MAX_LEAVES:
            raise ValueError(
                f"{where}: add_batch_size * max_length = {rows * length} steps is more than "
                f"{_MAX_LEAVES} (2**24), the largest count of windows drawn exactly uniformly "
                "(the valid windows are counted in float32). Lower `capacity`/`max_length`."
            )
        self.mode = mode
        self.storage = RingStorage(example, rows, length)
        self.episode_end = _check_episode_end(where, self.storage.example(), episode_end)
        self.ends = jnp.zeros((rows, length), jnp.bool_)
        # A top level of 256 (not the default 2048): the same draws, and `find` compiles in
        # seconds rather than a minute on CPU at capacities of ~1e4 (measured).
        self.tree = SumTree(rows * length, top=256)

    def add(self, batch: ExperienceBatch) -> "EpisodeTrajectoryBuffer":
        """Append one step `(add_batch_size, *leaf)` or `T` steps
        `(add_batch_size, T, *leaf)` to every row, and keep the set of valid windows in step.

        **Returns:**

        The updated buffer. The bookkeeping touches
        `add_batch_size * min(T + sequence_length - 1, max_length)` windows and reads
        `sequence_length - 1` episode flags for each, never the whole ring; under
        `eqx.filter_jit(donate="all")` the write is in place.
        """
        where = f"{type(self).__name__}.add()"
        t = self.storage.steps_in(batch, where)
        storage = self.storage.write(batch)
        length = storage.length
        steps = 1 if t is None else t
        keep = min(steps, length)
        if t is None:
            batch = jax.tree.map(lambda x: jnp.asarray(x)[:, None], batch)
        kept = jax.tree.map(lambda x: jnp.asarray(x)[:, steps - keep :], batch)
        new_ends = self._ends_of(kept)
        start = (self.storage.head + (steps - keep)) % length
        slots = (start + jnp.arange(keep, dtype=jnp.int32)) % length
        ends = self.ends.at[:, slots].set(new_ends, unique_indices=True, mode="promise_in_bounds")
        m = min(keep + self.sequence_length - 1, length)
        offsets = storage.fill - m + jnp.arange(m, dtype=jnp.int32)
        tree = self._refresh(self.tree, storage, ends, offsets)
        return eqx.tree_at(lambda b: (b.storage, b.ends, b.tree), self, (storage, ends, tree))

    def update(self, fn: UpdateFn) -> "EpisodeTrajectoryBuffer":
        """Return the buffer with `fn` applied to every stored step (see
        [`equibuffer.AbstractBuffer.update`][]); the episode ends are recomputed from the
        updated steps, and with them every window's validity (a cost of order the capacity
        times `sequence_length`)."""
        storage = update_storage(self.storage, fn, type(self).__name__)
        ends = self._ends_of(storage.data)
        offsets = jnp.arange(storage.length, dtype=jnp.int32)
        tree = self._refresh(self.tree, storage, ends, offsets)
        return eqx.tree_at(lambda b: (b.storage, b.ends, b.tree), self, (storage, ends, tree))

    def _ends_of(self, steps: PyTree[Shaped[Array, "rows time ..."]]) -> Bool[Array, "rows time"]:
        """The episode-end flag of every step of a `(rows, time, *leaf)` tree."""
        if isinstance(self.episode_end, str):
            return steps[self.episode_end]
        return jax.vmap(jax.vmap(self.episode_end))(steps)

    def _refresh(
        self,
        tree: SumTree,
        storage: RingStorage,
        ends: Bool[Array, "rows length"],
        offsets: Int[Array, " m"],
    ) -> SumTree:
        """`tree` with the leaves of the windows starting at `offsets` (from the oldest held
        step; may be negative: not held) set to 1 if valid, else 0."""
        s, length = self.sequence_length, storage.length
        first, count = window_layout(storage, s, self.period)
        rel = offsets - first
        aligned = (offsets >= 0) & (offsets < storage.fill) & (rel >= 0)
        aligned = aligned & (rel % self.period == 0)
        base = storage.head - storage.fill + length  # slot of offset 0, plus `length`
        slots = (base + offsets) % length
        if s > 1:
            # The flags of the first `s - 1` steps of each window, and whether each is held.
            inner = offsets[:, None] + jnp.arange(s - 1, dtype=jnp.int32)[None, :]
            flags = ends[:, (base + inner) % length]  # (rows, m, s - 1)
            flags = flags & (inner < storage.fill)[None]
            crossed = jnp.any(flags, axis=-1)
        else:
            crossed = jnp.zeros((storage.rows, offsets.shape[0]), jnp.bool_)
        if self.mode == "never_cross":
            held = aligned & (rel // self.period < count)
            valid = held[None, :] & ~crossed
        else:
            whole = aligned & (offsets + s <= storage.fill)
            valid = aligned[None, :] & (whole[None, :] | crossed)
        rows = jnp.arange(storage.rows, dtype=jnp.int32)[:, None]
        indices = (rows * length + slots[None, :]).reshape(-1)
        return tree.write(indices, valid.reshape(-1).astype(jnp.float32))

    def num_valid_windows(self) -> IntScalar:
        """The number of windows that can be drawn now (0-d int32): those inside the held
        steps that fit inside an episode (`mode="never_cross"`) or are cut by an episode end
        (`mode="pad"`). A function of the stored episode flags, so batched under `vmap`: for
        branching use `can_sample()`.

        !!! example

            ```python
            import jax.numpy as jnp
            from equibuffer._buffers._episodes import EpisodeTrajectoryBuffer

            example = {"done": jnp.bool_(False)}
            buffer = EpisodeTrajectoryBuffer(example, add_batch_size=1, max_length=8,
                                             sequence_length=3)
            buffer = buffer.add({"done": jnp.array([[True, False, False, False, False]])})
            assert int(buffer.num_valid_windows()) == 2  # steps 1-3 and 2-4
            ```
        """
        return self.tree.total().astype(jnp.int32)

    def sample(self, key: PRNGKeyArray, batch_size: int) -> EpisodeSample:
        """Draw `batch_size` windows independently and exactly uniformly over the valid
        windows (with replacement).

        **Returns:**

        An [`equibuffer.EpisodeSample`][]: `experience` leaves
        `(batch_size, sequence_length, *leaf)`, `indices`, `steps`, and `mask`
        `(batch_size, sequence_length)`.

        Raises inside jit (through `eqx.error_if`) when `can_sample()` is false, or when it is
        true but no window fits inside an episode.
        """
        where = f"{type(self).__name__}.sample()"
        batch_size = check_positive_int(where, "batch_size", batch_size)
        total = self.num_valid_windows()
        rank = jax.random.randint(key, (batch_size,), 0, jnp.maximum(total, 1), dtype=jnp.int32)
        # Integer prefixes and integer node sums are exact in float32 below 2**24.
        indices = self.tree.find(rank.astype(jnp.float32))
        failure = jnp.where(self.can_sample(), 1, 0)
        fix = (
            "use mode='pad' (short episodes are zero-padded) or a shorter sequence_length"
            if self.mode == "never_cross"
            else "add more steps or use a shorter sequence_length"
        )
        indices = eqx.branched_error_if(
            indices,
            ~self.can_sample() | (total == 0),
            failure,
            [
                f"{where}: the buffer cannot be sampled yet: it needs at least "
                f"min_length={self.min_length} steps per row and one window of "
                f"sequence_length={self.sequence_length}. Check `buffer.can_sample()` first.",
                f"{where}: no window of sequence_length={self.sequence_length} fits inside an "
                f"episode among the steps held (mode={self.mode!r}; `can_sample()` only looks "
                f"at the counters). To sample anyway, {fix}.",
            ],
        )
        storage = self.storage
        length = storage.length
        offset = (indices % length - storage.head + storage.fill) % length
        steps = storage.count_lo - storage.fill.astype(jnp.uint32) + offset.astype(jnp.uint32)
        windows = gather(storage, indices, self.sequence_length)
        if self.mode == "never_cross":
            mask = jnp.ones((batch_size, self.sequence_length), jnp.bool_)
            return EpisodeSample(experience=windows, indices=indices, steps=steps, mask=mask)
        row, slot = indices // length, indices % length
        j = jnp.arange(self.sequence_length, dtype=jnp.int32)
        flags = self.ends.reshape(-1).at[
            row[:, None] * length + (slot[:, None] + j[None, :]) % length
        ]
        flags = flags.get(mode="promise_in_bounds")
        # Step j belongs to the episode when no end comes before it in the window.
        before = jnp.cumsum(flags.astype(jnp.int32), axis=1) - flags.astype(jnp.int32)
        mask = before == 0

        def zero(x: Array) -> Array:
            m = mask.reshape(*mask.shape, *(1,) * (x.ndim - 2))
            return jnp.where(m, x, jnp.zeros((), x.dtype))

        windows = jax.tree.map(zero, windows)
        return EpisodeSample(experience=windows, indices=indices, steps=steps, mask=mask)
